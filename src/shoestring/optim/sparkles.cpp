#include "shoestring/optim/sparkles.h"

#include <cmath>
#include <numeric>

#include <torch/torch.h>

#include "shoestring/core/counter_rng.h"
#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/core/stochastic_rounding.h"
#include "shoestring/optim/optimizer_args.h"

namespace shoestring {

namespace {

std::vector<int64_t> dims_from_one(const at::Tensor& g) {
  std::vector<int64_t> dims(static_cast<size_t>(g.dim() - 1));
  std::iota(dims.begin(), dims.end(), 1);
  return dims;
}

/// g interpolated towards g / (std(g) + 1e-8) with weight `alpha` (see sparkles.h).
at::Tensor normalize_gradient(const at::Tensor& g, bool channels, double alpha) {
  at::Tensor s;
  if (channels && g.dim() >= 2 && g.numel() / g.size(0) >= 2) {
    s = g.std(dims_from_one(g), /*unbiased=*/true, /*keepdim=*/true).add_(1e-8);
  } else if (g.numel() > 2) {
    s = g.std(/*unbiased=*/true).add_(1e-8);
  } else {
    return g;
  }
  return at::lerp(g, g / s, alpha);
}

}  // namespace

Sparkles::Sparkles(std::vector<OptimParam> params, SparklesOptions sparkles, OptimizerOptions options)
    : Optimizer(std::move(params), options), sparkles_(sparkles), permuted_(params_.size(), 0) {
  if (options_.state_dtype != at::kFloat && options_.state_dtype != at::kBFloat16) {
    fail("SPARKLES: state_dtype must be float32 or bfloat16 (got {})", c10::toString(options_.state_dtype));
  }
}

at::Tensor Sparkles::permutation(int64_t n, RoundingKey key) {
  at::Tensor perm = torch::arange(n, torch::kLong);
  int64_t* idx = perm.data_ptr<int64_t>();
  const uint64_t stream = counter_rng_key(key.seed, key.step, key.tensor_id);
  for (int64_t i = n - 1; i >= 1; --i) {
    const uint64_t word = counter_random32(stream, static_cast<uint64_t>(i));
    const auto j = static_cast<int64_t>((word * static_cast<uint64_t>(i + 1)) >> 32);
    std::swap(idx[i], idx[j]);
  }
  return perm;
}

bool Sparkles::prepare(size_t index, const at::Tensor& grad) {
  const at::Tensor& live = params_[index].param;
  check_gradient(index, grad, "SPARKLES");
  create_zero_state(index, {"ema", "ema_squared", "prev_grad"});
  permuted_[index] = 0;
  for (const char* name : {"ema", "ema_squared", "prev_grad"}) {
    if (!has_state(index, name) || state(index, name).sizes() != live.sizes()) {
      fail("SPARKLES: optimizer state '{}.{}' has shape {}, expected {} (a checkpoint of another model?)",
           params_[index].name, name, has_state(index, name) ? c10::str(state(index, name).sizes()) : "none",
           c10::str(live.sizes()));
    }
  }
  return live.numel() != 0;
}

std::optional<FusedSparklesTensor> Sparkles::fused_task(size_t index, const at::Tensor& grad, double lr, int64_t step,
                                                        double grad_scale) {
  const at::Tensor& live = params_[index].param;
  const at::Tensor& m = state(index, "ema");
  const at::Tensor& v = state(index, "ema_squared");
  const at::Tensor& prev = state(index, "prev_grad");
  if (!fast_cpu_path(live) || !fused_sparkles_supported(live, grad, m, v, prev)) return std::nullopt;
  FusedSparklesTensor t{live, grad, m, v, prev, {}, {}};
  FusedSparklesScalars& s = t.scalars;
  s.lr = lr;
  s.step = step;
  s.beta1 = sparkles_.beta1;
  s.beta2 = sparkles_.beta2;
  s.eps = sparkles_.eps;
  s.weight_decay = params_[index].weight_decay;
  s.decouple_weight_decay = sparkles_.decouple_weight_decay;
  s.centralization = sparkles_.centralization;
  s.normalization = sparkles_.normalization;
  s.normalize_channels = sparkles_.normalize_channels;
  s.amp_fac = sparkles_.amp_fac;
  s.clip_gradients = sparkles_.clip_gradients;
  s.stochastic_threshold = sparkles_.stochastic_threshold;
  s.grad_scale = grad_scale;
  t.keys.stochastic_rounding = options_.stochastic_rounding;
  t.keys.param = rounding_key(index, step);
  t.keys.ema = rounding_key(index, step, 1);
  t.keys.ema_squared = rounding_key(index, step, 2);
  t.keys.prev_grad = rounding_key(index, step, 3);
  return t;
}

void Sparkles::update(size_t index, const at::Tensor& grad_in, double lr, int64_t step) {
  if (!prepare(index, grad_in)) return;
  // CPU tensors: two passes over memory (optim/fused_kernels.h), the op
  // chain's results to fp32 rounding. A step whose update is permuted (rare)
  // is left to the op chain.
  if (std::optional<FusedSparklesTensor> t = fused_task(index, grad_in, lr, step, 1.0)) {
    if (fused_sparkles_step_many({*t})[0]) return;
  }
  update_op_chain(index, grad_in, lr, step);
}

void Sparkles::update_many(const std::vector<size_t>& indices, double lr, int64_t step, double grad_scale) {
  // The kernel scales the gradient as it reads it: no fp32 copies.
  std::vector<FusedSparklesTensor> fused;
  std::vector<size_t> fused_index;
  for (size_t i : indices) {
    if (!prepare(i, params_[i].param.grad())) continue;
    if (std::optional<FusedSparklesTensor> t = fused_task(i, params_[i].param.grad(), lr, step, grad_scale)) {
      fused.push_back(std::move(*t));
      fused_index.push_back(i);
    } else {
      update_op_chain(i, scaled_grad(i, grad_scale), lr, step);
    }
  }
  const std::vector<bool> done = fused_sparkles_step_many(fused);
  for (size_t j = 0; j < fused.size(); ++j) {
    if (!done[j]) update_op_chain(fused_index[j], scaled_grad(fused_index[j], grad_scale), lr, step);
  }
}

void Sparkles::update_op_chain(size_t index, const at::Tensor& grad_in, double lr, int64_t step) {
  at::Tensor& live = params_[index].param;
  const double wd = params_[index].weight_decay;
  at::Tensor& m_stored = state(index, "ema");
  at::Tensor& v_stored = state(index, "ema_squared");
  at::Tensor& prev_stored = state(index, "prev_grad");
  auto fp32 = [](const at::Tensor& t) { return t.scalar_type() == torch::kFloat32 ? t : t.to(torch::kFloat32); };
  // The gradient is modified below: always work on a copy (one parameter's size).
  at::Tensor g = grad_in.to(torch::kFloat32, /*non_blocking=*/false, /*copy=*/true).reshape(live.sizes());
  at::Tensor p = fp32(live);
  at::Tensor m = fp32(m_stored);
  at::Tensor v = fp32(v_stored);
  at::Tensor prev = fp32(prev_stored);

  // sparkles.py's operation order, with the fixes of docs/optimizers/sparkles.md.
  if (sparkles_.centralization != 0 && g.dim() >= 2) {
    g.sub_(g.mean(dims_from_one(g), /*keepdim=*/true).mul_(sparkles_.centralization));
  }
  if (sparkles_.normalization != 0) g = normalize_gradient(g, sparkles_.normalize_channels, sparkles_.normalization);
  if (wd != 0 && !sparkles_.decouple_weight_decay) g.add_(p, wd);
  const double bias_correction1 = 1.0 - std::pow(sparkles_.beta1, static_cast<double>(step));
  const double bias_correction2_sqrt = std::sqrt(1.0 - std::pow(sparkles_.beta2, static_cast<double>(step)));
  const double step_size = lr / bias_correction1;
  m.mul_(sparkles_.beta1).add_(g, 1.0 - sparkles_.beta1);
  g.add_(m, sparkles_.amp_fac);  // g is now the amplified gradient gh
  v.mul_(sparkles_.beta2).addcmul_(g, g, 1.0 - sparkles_.beta2);
  // One fp32 buffer serves for ||gh - prev_grad||, the denominator and the update.
  at::Tensor u = at::empty_like(g);
  bool permute = false;
  if (step > 1 && sparkles_.stochastic_threshold > 0) {
    at::sub_out(u, g, prev);
    permute = u.norm().item<double>() < sparkles_.stochastic_threshold;
  }
  at::sqrt_out(u, v).div_(bias_correction2_sqrt).add_(sparkles_.eps);
  if (wd != 0 && sparkles_.decouple_weight_decay) p.mul_(1.0 - step_size * wd);
  at::div_out(u, g, u).mul_(step_size);
  if (permute) {
    permuted_[index] = 1;
    if (u.dim() >= 1 && u.size(0) > 1) {
      at::Tensor perm = permutation(u.size(0), rounding_key(index, step, kPermutationSlot)).to(u.device());
      u = u.index_select(0, perm);
    }
  }
  if (sparkles_.clip_gradients) {
    const double clip = std::pow(static_cast<double>(step), 0.25);
    u.clamp_(-clip, clip);
  }
  p.sub_(u);
  write_state(index, m_stored, m, step, 1);
  write_state(index, v_stored, v, step, 2);
  write_state(index, prev_stored, g, step, 3);
  write_param(index, p, step);
}

SparklesOptions parse_sparkles_args(const std::vector<std::string>& args) {
  OptimizerArgs a(args, "SPARKLES",
                  {"weight_decay", "betas", "eps", "centralization", "normalization", "normalize_channels", "amp_fac",
                   "decouple_weight_decay", "clip_gradients", "stochastic_threshold", "permutation_strategy"});
  SparklesOptions o;
  o.weight_decay = a.get_double("weight_decay", o.weight_decay);
  std::tie(o.beta1, o.beta2) = a.get_pair("betas", {o.beta1, o.beta2});
  o.eps = a.get_double("eps", o.eps);
  o.centralization = a.get_double("centralization", o.centralization);
  o.normalization = a.get_double("normalization", o.normalization);
  o.normalize_channels = a.get_bool("normalize_channels", o.normalize_channels);
  o.amp_fac = a.get_double("amp_fac", o.amp_fac);
  o.decouple_weight_decay = a.get_bool("decouple_weight_decay", o.decouple_weight_decay);
  o.clip_gradients = a.get_bool("clip_gradients", o.clip_gradients);
  o.stochastic_threshold = a.get_double("stochastic_threshold", o.stochastic_threshold);
  // sparkles.py's "magnitude", "local" and "adaptive" strategies are not implemented.
  a.get_choice("permutation_strategy", "global", {"global"});
  if (!(o.weight_decay >= 0) || !std::isfinite(o.weight_decay)) {
    fail("optimizer_args: weight_decay must be a finite number >= 0 for SPARKLES (got {})", o.weight_decay);
  }
  if (!(o.eps > 0) || !std::isfinite(o.eps)) {
    fail("optimizer_args: eps must be a finite number > 0 for SPARKLES (got {})", o.eps);
  }
  if (!(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1)) {
    fail("optimizer_args: betas must be in [0, 1) for SPARKLES (got {},{})", o.beta1, o.beta2);
  }
  if (!(o.centralization >= 0 && o.centralization <= 1)) {
    fail("optimizer_args: centralization must be in [0, 1] for SPARKLES (got {})", o.centralization);
  }
  if (!(o.normalization >= 0 && o.normalization <= 1)) {
    fail("optimizer_args: normalization must be in [0, 1] for SPARKLES (got {})", o.normalization);
  }
  if (!std::isfinite(o.amp_fac)) fail("optimizer_args: amp_fac must be finite for SPARKLES (got {})", o.amp_fac);
  if (!(o.stochastic_threshold >= 0) || !std::isfinite(o.stochastic_threshold)) {
    fail("optimizer_args: stochastic_threshold must be a finite number >= 0 for SPARKLES (got {})",
         o.stochastic_threshold);
  }
  return o;
}

OptimizerStateSize Sparkles::state_size(at::IntArrayRef shape, const OptimizerOptions& options) {
  const int64_t n = c10::multiply_integers(shape);
  return {3 * n * state_element_bytes(options.state_dtype), 4 * n};
}

}  // namespace shoestring
