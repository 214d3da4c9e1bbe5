#include "shoestring/optim/lion.h"

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/optim/fused_kernels.h"
#include "shoestring/optim/optimizer_args.h"

namespace shoestring {

Lion::Lion(std::vector<OptimParam> params, LionOptions lion, OptimizerOptions options)
    : Optimizer(std::move(params), options), lion_(lion) {
  if (options_.state_dtype != at::kFloat && options_.state_dtype != at::kBFloat16) {
    fail("Lion: state_dtype must be float32 or bfloat16 (got {})", c10::toString(options_.state_dtype));
  }
}

std::optional<FusedLionTensor> Lion::fused_task(size_t index, const at::Tensor& grad, double lr, int64_t step,
                                                double grad_scale) {
  const at::Tensor& live = params_[index].param;
  check_gradient(index, grad, "Lion");
  create_zero_state(index, {"exp_avg"});
  const at::Tensor& m = state(index, "exp_avg");
  if (!fast_cpu_path(live) || !fused_lion_supported(live, grad, m)) return std::nullopt;
  FusedLionTensor t{live, grad, m, {}, {}};
  t.scalars.lr = lr;
  t.scalars.beta1 = lion_.beta1;
  t.scalars.beta2 = lion_.beta2;
  t.scalars.weight_decay = params_[index].weight_decay;
  t.scalars.grad_scale = grad_scale;
  t.keys.stochastic_rounding = options_.stochastic_rounding;
  t.keys.param = rounding_key(index, step);
  t.keys.state1 = rounding_key(index, step, 1);
  return t;
}

void Lion::update_many(const std::vector<size_t>& indices, double lr, int64_t step, double grad_scale) {
  update_many_fused<FusedLionTensor>(
      indices, lr, step, grad_scale,
      [this](size_t i, const at::Tensor& g, double l, int64_t s, double gs) { return fused_task(i, g, l, s, gs); },
      fused_lion_step_many);
}

void Lion::update(size_t index, const at::Tensor& grad_in, double lr, int64_t step) {
  // Fast path: one pass over memory (optim/fused_kernels.h), bit-identical to
  // the op chain below, which remains the reference and the path for other
  // layouts and dtypes (fp16, non-contiguous, non-CPU).
  if (auto t = fused_task(index, grad_in, lr, step, 1.0)) {
    fused_lion_step_many({std::move(*t)});
    return;
  }
  at::Tensor& live = params_[index].param;
  const double wd = params_[index].weight_decay;
  at::Tensor& m_stored = state(index, "exp_avg");
  // fp32 tensors are updated in place; low-precision ones through fp32 copies
  // that are stochastically rounded back (one parameter at a time).
  auto fp32 = [](const at::Tensor& t) { return t.scalar_type() == torch::kFloat32 ? t : t.to(torch::kFloat32); };
  const at::Tensor grad = fp32(grad_in).reshape(live.sizes());
  at::Tensor p = fp32(live);
  at::Tensor m = fp32(m_stored);

  p.mul_(1.0 - lr * wd);
  at::Tensor direction = (m * lion_.beta1).add_(grad, 1.0 - lion_.beta1).sign_();
  p.add_(direction, -lr);
  m.mul_(lion_.beta2).add_(grad, 1.0 - lion_.beta2);
  write_state(index, m_stored, m, step, 1);
  write_param(index, p, step);
}

LionOptions parse_lion_args(const std::vector<std::string>& args) {
  OptimizerArgs a(args, "Lion", {"weight_decay", "betas"});
  LionOptions o;
  o.weight_decay = a.get_double("weight_decay", o.weight_decay);
  std::tie(o.beta1, o.beta2) = a.get_pair("betas", {o.beta1, o.beta2});
  if (!(o.weight_decay >= 0)) fail("optimizer_args: weight_decay must be >= 0 (got {})", o.weight_decay);
  if (!(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1)) {
    fail("optimizer_args: betas must be in [0, 1) (got {},{})", o.beta1, o.beta2);
  }
  return o;
}

OptimizerStateSize Lion::state_size(at::IntArrayRef shape, const OptimizerOptions& options) {
  return {c10::multiply_integers(shape) * state_element_bytes(options.state_dtype), 0};
}

}  // namespace shoestring
