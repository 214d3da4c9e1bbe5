#include "shoestring/optim/compass.h"

#include <cmath>
#include <numeric>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/optim/optimizer_args.h"

namespace shoestring {

Compass::Compass(std::vector<OptimParam> params, CompassOptions compass, OptimizerOptions options)
    : Optimizer(std::move(params), options), compass_(compass) {
  if (options_.state_dtype != at::kFloat && options_.state_dtype != at::kBFloat16) {
    fail("Compass: state_dtype must be float32 or bfloat16 (got {})", c10::toString(options_.state_dtype));
  }
}

void Compass::update(size_t index, const at::Tensor& grad_in, double lr, int64_t step) {
  at::Tensor& live = params_[index].param;
  check_gradient(index, grad_in, "Compass");
  const double wd = params_[index].weight_decay;
  create_zero_state(index, {"exp_avg", "exp_avg_sq"});
  at::Tensor& m_stored = state(index, "exp_avg");
  at::Tensor& v_stored = state(index, "exp_avg_sq");
  auto fp32 = [](const at::Tensor& t) { return t.scalar_type() == torch::kFloat32 ? t : t.to(torch::kFloat32); };
  // The gradient is modified below: always work on a copy (one parameter's size).
  at::Tensor g = grad_in.to(torch::kFloat32, /*non_blocking=*/false, /*copy=*/true).reshape(live.sizes());
  at::Tensor p = fp32(live);
  at::Tensor m = fp32(m_stored);
  at::Tensor v = fp32(v_stored);

  // Same operation order as compass.py.
  if (compass_.centralization != 0) {
    at::Tensor mean;
    if (g.dim() >= 2) {
      std::vector<int64_t> dims(static_cast<size_t>(g.dim() - 1));
      std::iota(dims.begin(), dims.end(), 1);
      mean = g.mean(dims, /*keepdim=*/true);
    } else {
      mean = g.mean();  // torch reduces every dim when the dim list is empty
    }
    g.sub_(mean.mul_(compass_.centralization));
  }
  const double bias_correction1 = 1.0 - std::pow(compass_.beta1, static_cast<double>(step));
  const double bias_correction2_sqrt = std::sqrt(1.0 - std::pow(compass_.beta2, static_cast<double>(step)));
  const double step_size = lr / bias_correction1;
  m.mul_(compass_.beta1).add_(g, 1.0 - compass_.beta1);
  g.add_(m, compass_.amp_fac);
  v.mul_(compass_.beta2).addcmul_(g, g, 1.0 - compass_.beta2);
  at::Tensor denom = (v.sqrt() / bias_correction2_sqrt).add_(compass_.eps);
  if (wd != 0) p.mul_(1.0 - step_size * wd);
  p.addcdiv_(g, denom, -step_size);
  write_state(index, m_stored, m, step, 1);
  write_state(index, v_stored, v, step, 2);
  write_param(index, p, step);
}

CompassOptions parse_compass_args(const std::vector<std::string>& args) {
  OptimizerArgs a(args, "Compass", {"weight_decay", "betas", "eps", "amp_fac", "centralization"});
  CompassOptions o;
  o.weight_decay = a.get_double("weight_decay", o.weight_decay);
  o.eps = a.get_double("eps", o.eps);
  std::tie(o.beta1, o.beta2) = a.get_pair("betas", {o.beta1, o.beta2});
  o.amp_fac = a.get_double("amp_fac", o.amp_fac);
  o.centralization = a.get_double("centralization", o.centralization);
  if (!(o.weight_decay >= 0)) fail("optimizer_args: weight_decay must be >= 0 (got {})", o.weight_decay);
  if (!(o.eps > 0) || !std::isfinite(o.eps)) fail("optimizer_args: eps must be > 0 (got {})", o.eps);
  if (!(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1)) {
    fail("optimizer_args: betas must be in [0, 1) (got {},{})", o.beta1, o.beta2);
  }
  if (!std::isfinite(o.amp_fac)) fail("optimizer_args: amp_fac must be finite (got {})", o.amp_fac);
  if (!std::isfinite(o.centralization)) {
    fail("optimizer_args: centralization must be finite (got {})", o.centralization);
  }
  return o;
}

OptimizerStateSize Compass::state_size(at::IntArrayRef shape, const OptimizerOptions& options) {
  return {2 * c10::multiply_integers(shape) * state_element_bytes(options.state_dtype), 0};
}

}  // namespace shoestring
