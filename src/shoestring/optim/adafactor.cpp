#include "shoestring/optim/adafactor.h"
#include "shoestring/optim/optimizer_args.h"

#include <algorithm>
#include <cctype>
#include <cmath>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/core/units.h"
#include "shoestring/optim/fused_kernels.h"

namespace shoestring {
namespace {

// Rounding slots of write_state (1..15) for this optimizer's state tensors.
constexpr int kSlotRow = 1;
constexpr int kSlotCol = 2;
constexpr int kSlotSq = 3;
constexpr int kSlotAvg = 4;

at::Tensor as_fp32(const at::Tensor& t) { return t.scalar_type() == torch::kFloat32 ? t : t.to(torch::kFloat32); }

// Root mean square of a float tensor, as transformers' _rms: ||t||_2 / sqrt(numel).
double rms(const at::Tensor& t) { return t.norm().item<double>() / std::sqrt(static_cast<double>(t.numel())); }

}  // namespace

void validate_adafactor_options(const AdafactorOptions& o) {
  if (!(o.eps1 >= 0) || !(o.eps2 >= 0)) fail("Adafactor: eps must be two numbers >= 0 (got {},{})", o.eps1, o.eps2);
  if (!(o.clip_threshold > 0)) fail("Adafactor: clip_threshold must be > 0 (got {})", o.clip_threshold);
  if (!(o.decay_rate <= 0))
    fail("Adafactor: decay_rate must be <= 0 (got {}; beta2t = 1 - t^decay_rate)", o.decay_rate);
  if (o.beta1 && !(*o.beta1 >= 0 && *o.beta1 < 1))
    fail("Adafactor: beta1 must be in [0, 1) or None (got {})", *o.beta1);
  if (!(o.weight_decay >= 0)) fail("Adafactor: weight_decay must be >= 0 (got {})", o.weight_decay);
  if (o.warmup_init && !o.relative_step) fail("Adafactor: warmup_init=True requires relative_step=True");
}

Adafactor::Adafactor(std::vector<OptimParam> params, AdafactorOptions adafactor, OptimizerOptions options)
    : Optimizer(std::move(params), options), adafactor_(adafactor) {
  validate_adafactor_options(adafactor_);
}

std::vector<int64_t> Adafactor::factored_shape(at::IntArrayRef shape) {
  if (shape.size() < 2) return {};
  int64_t numel = 1;
  for (int64_t s : shape) numel *= s;
  if (numel == 0) return {};
  return {shape[0], numel / shape[0]};
}

double Adafactor::step_size(int64_t step, double lr, double param_rms) const {
  double rho = lr;
  if (adafactor_.relative_step) {
    const double t = static_cast<double>(step);
    const double min_step = adafactor_.warmup_init ? 1e-6 * t : 1e-2;
    rho = std::min(min_step, 1.0 / std::sqrt(t));
  }
  const double scale = adafactor_.scale_parameter ? std::max(adafactor_.eps2, param_rms) : 1.0;
  return scale * rho;
}

void Adafactor::update(size_t index, const at::Tensor& grad_in, double lr, int64_t step) {
  at::Tensor& live = params_[index].param;
  const std::string& pname = params_[index].name;
  if (!grad_in.sizes().equals(live.sizes())) {
    fail("Adafactor: gradient of '{}' has shape {}, expected {}", pname, format_shape(grad_in.sizes()),
         format_shape(live.sizes()));
  }
  if (live.numel() == 0) return;
  if (step < 1) fail("Adafactor: step must be >= 1 (got {})", step);
  const std::vector<int64_t> fshape = factored_shape(live.sizes());
  const bool factored = !fshape.empty();
  const bool first_moment = adafactor_.beta1.has_value();

  // State, created on first use (or checked after a restore).
  auto ensure = [&](const char* name, at::IntArrayRef shape, at::ScalarType dtype) -> at::Tensor& {
    at::Tensor& t = state(index, name);
    if (!t.defined()) {
      ScopedMemoryCategory category(MemoryCategory::optimizer_state);
      t = torch::zeros(shape, live.options().dtype(dtype));
    } else if (!t.sizes().equals(shape)) {
      fail("Adafactor: state '{}.{}' has shape {}, expected {}", pname, name, format_shape(t.sizes()),
           format_shape(shape));
    }
    return t;
  };

  const double t = static_cast<double>(step);
  const double beta2t = 1.0 - std::pow(t, adafactor_.decay_rate);
  const double wd = params_[index].weight_decay;

  // Fast path for factored tensors without a first moment (kohya's usual
  // setting): two passes over the gradient, the second with the weights
  // (optim/fused_kernels.h), instead of the op chain's dozen, with no
  // full-size temporary. Same formulas; sums are accumulated in double, so
  // results match the op chain to rounding, not bit for bit.
  // The fused kernels' scalars and rounding keys of this update.
  auto fused_scalars = [&] {
    FusedAdafactorScalars s;
    s.beta2t = beta2t;
    s.eps1 = adafactor_.eps1;
    s.clip_threshold = adafactor_.clip_threshold;
    s.step_size = step_size(step, lr, adafactor_.scale_parameter ? rms(as_fp32(live)) : 0.0);
    s.weight_decay = wd;
    return s;
  };
  auto fused_keys = [&] {
    FusedRoundingKeys keys;
    keys.stochastic_rounding = options_.stochastic_rounding;
    keys.param = rounding_key(index, step);
    return keys;
  };
  auto fusable = [](const at::Tensor& x) {
    return fast_cpu_path(x) && x.layout() == at::kStrided && x.is_contiguous() &&
           (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16);
  };
  if (factored && !first_moment && fusable(live) && fusable(grad_in)) {
    const int64_t n = fshape[0], m = fshape[1];
    at::Tensor& row = ensure("exp_avg_sq_row", {n}, torch::kFloat32);
    at::Tensor& col = ensure("exp_avg_sq_col", {m}, torch::kFloat32);
    if (row.scalar_type() != torch::kFloat32 || col.scalar_type() != torch::kFloat32 || !row.is_contiguous() ||
        !col.is_contiguous()) {
      fail("Adafactor: state '{}.exp_avg_sq_row' / '.exp_avg_sq_col' must be contiguous float32", pname);
    }
    fused_adafactor_factored_step(live, grad_in, row, col, n, m, fused_scalars(), fused_keys());
    return;
  }

  // Vectors without a first moment: one fused call, the op chain's bits.
  if (!factored && !first_moment && fusable(live) && fusable(grad_in)) {
    at::Tensor& v = ensure("exp_avg_sq", live.sizes(), options_.state_dtype);
    if (fused_adafactor_unfactored_supported(live, grad_in, v)) {
      FusedRoundingKeys keys = fused_keys();
      keys.state1 = rounding_key(index, step, kSlotSq);
      fused_adafactor_unfactored_step(live, grad_in, v, fused_scalars(), keys);
      return;
    }
  }

  at::Tensor grad = as_fp32(grad_in);
  at::Tensor p = as_fp32(live);  // fp32 weights: updated in place at the end
  const double a_t = step_size(step, lr, adafactor_.scale_parameter ? rms(p) : 0.0);

  at::Tensor u;  // the update direction U (fp32, parameter shape)
  {
    at::Tensor g2 = grad.square().add_(adafactor_.eps1);
    if (factored) {
      const int64_t n = fshape[0], m = fshape[1];
      at::Tensor& row_stored = ensure("exp_avg_sq_row", {n}, torch::kFloat32);
      at::Tensor& col_stored = ensure("exp_avg_sq_col", {m}, torch::kFloat32);
      at::Tensor row = as_fp32(row_stored), col = as_fp32(col_stored);
      at::Tensor g2m = g2.reshape({n, m});
      row.mul_(beta2t).add_(g2m.mean(-1), 1.0 - beta2t);
      col.mul_(beta2t).add_(g2m.mean(0), 1.0 - beta2t);
      g2 = at::Tensor();
      // 1/sqrt(Vhat) = rsqrt(R / mean(R)) rsqrt(C), Vhat = R C^T / mean(R).
      at::Tensor r_factor = (row / row.mean()).rsqrt_().unsqueeze(-1);  // [n, 1]
      at::Tensor c_factor = col.rsqrt().unsqueeze(0);                   // [1, m]
      u = (r_factor * c_factor).mul_(grad.reshape({n, m})).reshape(live.sizes());
      write_state(index, row_stored, row, step, kSlotRow);
      write_state(index, col_stored, col, step, kSlotCol);
    } else {
      at::Tensor& v_stored = ensure("exp_avg_sq", live.sizes(), options_.state_dtype);
      at::Tensor v = as_fp32(v_stored);
      v.mul_(beta2t).add_(g2, 1.0 - beta2t);
      g2 = at::Tensor();
      u = v.rsqrt().mul_(grad);
      write_state(index, v_stored, v, step, kSlotSq);
    }
  }
  // Update clipping (paper section 5): U / max(1, RMS(U)/d).
  u.div_(std::max(1.0, rms(u) / adafactor_.clip_threshold));
  u.mul_(a_t);
  if (first_moment) {
    at::Tensor& m_stored = ensure("exp_avg", live.sizes(), options_.state_dtype);
    at::Tensor m = as_fp32(m_stored);
    m.mul_(*adafactor_.beta1).add_(u, 1.0 - *adafactor_.beta1);
    write_state(index, m_stored, m, step, kSlotAvg);
    u = m;
  }
  if (wd != 0) p.add_(p, -wd * a_t);
  p.sub_(u);
  write_param(index, p, step);
}

AdafactorOptions parse_adafactor_args(const std::vector<std::string>& args) {
  OptimizerArgs a(args, "Adafactor",
                  {"scale_parameter", "relative_step", "warmup_init", "clip_threshold", "decay_rate", "beta1", "eps",
                   "weight_decay"});
  AdafactorOptions o;
  o.scale_parameter = a.get_bool("scale_parameter", o.scale_parameter);
  o.relative_step = a.get_bool("relative_step", o.relative_step);
  o.warmup_init = a.get_bool("warmup_init", o.warmup_init);
  o.clip_threshold = a.get_double("clip_threshold", o.clip_threshold);
  o.decay_rate = a.get_double("decay_rate", o.decay_rate);
  o.weight_decay = a.get_double("weight_decay", o.weight_decay);
  o.beta1 = a.get_optional_double("beta1", o.beta1);
  std::tie(o.eps1, o.eps2) = a.get_pair("eps", {o.eps1, o.eps2});
  validate_adafactor_options(o);
  return o;
}

OptimizerStateSize Adafactor::state_size(at::IntArrayRef shape, const AdafactorOptions& adafactor,
                                         const OptimizerOptions& options, at::ScalarType param_dtype) {
  const int64_t n = c10::multiply_integers(shape);
  OptimizerStateSize s;
  if (n == 0) return s;
  const int64_t sd = state_element_bytes(options.state_dtype);
  const bool beta1 = adafactor.beta1.has_value();
  const std::vector<int64_t> f = factored_shape(shape);
  if (!f.empty()) {
    s.state = (f[0] + f[1]) * 4 + (beta1 ? n * sd : 0);
    if (beta1) {
      s.scratch = 4 * n * 4;  // op chain: grad, p, u, m in fp32
    } else if (c10::elementSize(param_dtype) == 2) {
      s.scratch = 4 * n;  // the fused factored path measures RMS(X) on an fp32 copy of 2-byte weights
    }
  } else {
    s.state = n * sd + (beta1 ? n * sd : 0);
    s.scratch = 4 * n * 4;
  }
  return s;
}

}  // namespace shoestring
