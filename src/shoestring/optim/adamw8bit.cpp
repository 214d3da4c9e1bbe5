#include "shoestring/optim/adamw8bit.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include "shoestring/core/counter_rng.h"
#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/core/stochastic_rounding_bits.h"
#include "shoestring/optim/fused_kernels.h"
#include "shoestring/optim/optimizer_args.h"
#include "shoestring/optim/quantization.h"

namespace shoestring {
namespace {

/// Per-step scalars, in fp32 as torch's CPU kernels use them.
struct AdamStep {
  float decay;  // 1 - lr * wd
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float sqrt_bias_correction2;
  float step_size;  // lr / (1 - beta1^t)
  float eps;
};

/// One element of AdamW (same operation order as AdamW::update). Returns
/// false, leaving p, m, v untouched, when g or a result is not finite.
inline bool adam_element(float& p, float g, float& m, float& v, const AdamStep& s) {
  if (!std::isfinite(g)) return false;
  // torch's vectorized add_(g, alpha) is a fused multiply-add: use one too,
  // so small tensors follow torch.optim.AdamW to the last bit on most elements.
  const float p1 = p * s.decay;
  const float m1 = std::fma(g, s.one_minus_beta1, m * s.beta1);
  const float v1 = v * s.beta2 + s.one_minus_beta2 * g * g;
  const float denom = std::sqrt(v1) / s.sqrt_bias_correction2 + s.eps;
  const float p2 = p1 + (-s.step_size) * m1 / denom;
  if (!std::isfinite(m1) || !std::isfinite(v1) || !std::isfinite(p2)) return false;
  p = p2;
  m = m1;
  v = v1;
  return true;
}

inline uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

/// Stores fp32 `x` into a parameter element: fp32 as is; bf16 / fp16 by
/// stochastic rounding with random word `index` of the stream `rng_key` (the
/// word Optimizer::write_param would use), or round-to-nearest when sr is off.
template <typename P>
inline void store_param(P* dst, float x, bool sr, uint64_t rng_key, uint64_t index) {
  if constexpr (std::is_same_v<P, float>) {
    *dst = x;
  } else if constexpr (std::is_same_v<P, c10::BFloat16>) {
    if (sr) {
      *dst = c10::BFloat16(sr_bf16_from_fp32_bits(float_bits(x), counter_random16(rng_key, index)),
                           c10::BFloat16::from_bits());
    } else {
      *dst = c10::BFloat16(x);
    }
  } else {
    if (sr) {
      *dst = c10::Half(sr_fp16_from_fp32_bits(float_bits(x), counter_random16(rng_key, index)), c10::Half::from_bits());
    } else {
      *dst = c10::Half(x);
    }
  }
}

/// Everything one parameter's kernel needs.
struct Work {
  int64_t n = 0;
  AdamStep s{};
  bool sr = false;
  uint64_t rng_key = 0;
  // fp32 state (small tensors) ...
  float* m = nullptr;
  float* v = nullptr;
  // ... or 8-bit state
  uint8_t* mq = nullptr;
  float* m_absmax = nullptr;
  uint8_t* vq = nullptr;
  float* v_absmax = nullptr;
  int64_t block_size = 256;
};

template <typename P, typename G>
void run_fp32_state(P* p, const G* g, const Work& w) {
  // Small tensors (< min_8bit_size elements): one serial pass.
  for (int64_t i = 0; i < w.n; ++i) {
    float pv = static_cast<float>(p[i]);
    if (adam_element(pv, static_cast<float>(g[i]), w.m[i], w.v[i], w.s)) {
      store_param(p + i, pv, w.sr, w.rng_key, static_cast<uint64_t>(i));
    }
  }
}

template <typename P, typename G>
void run_8bit_state(P* p, const G* g, const Work& w) {
  const QuantizationMap& smap = signed_dynamic_map();
  const QuantizationMap& umap = unsigned_dynamic_map();
  const int64_t bs = w.block_size;
  const int64_t blocks = (w.n + bs - 1) / bs;
  // ~64K elements per task: enough work to amortize scheduling.
  const int64_t grain = std::max<int64_t>(1, 65536 / bs);
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> m(static_cast<size_t>(bs)), v(static_cast<size_t>(bs));  // one block
    for (int64_t b = begin; b < end; ++b) {
      const int64_t start = b * bs;
      const int64_t len = std::min(bs, w.n - start);
      dequantize_block(w.mq + start, len, w.m_absmax[b], smap, m.data());
      dequantize_block(w.vq + start, len, w.v_absmax[b], umap, v.data());
      for (int64_t k = 0; k < len; ++k) {
        const int64_t i = start + k;
        float pv = static_cast<float>(p[i]);
        if (adam_element(pv, static_cast<float>(g[i]), m[k], v[k], w.s)) {
          store_param(p + i, pv, w.sr, w.rng_key, static_cast<uint64_t>(i));
        }
      }
      quantize_block(m.data(), len, smap, w.mq + start, w.m_absmax + b);
      quantize_block(v.data(), len, umap, w.vq + start, w.v_absmax + b);
    }
  });
}

template <typename P>
void dispatch_grad(P* p, const at::Tensor& g, const Work& w, bool eight_bit) {
  switch (g.scalar_type()) {
    case at::kFloat:
      eight_bit ? run_8bit_state(p, g.data_ptr<float>(), w) : run_fp32_state(p, g.data_ptr<float>(), w);
      break;
    case at::kBFloat16:
      eight_bit ? run_8bit_state(p, g.data_ptr<c10::BFloat16>(), w) : run_fp32_state(p, g.data_ptr<c10::BFloat16>(), w);
      break;
    case at::kHalf:
      eight_bit ? run_8bit_state(p, g.data_ptr<c10::Half>(), w) : run_fp32_state(p, g.data_ptr<c10::Half>(), w);
      break;
    default:
      fail("AdamW8bit: gradient dtype {} is not supported (float32, bfloat16, float16)",
           c10::toString(g.scalar_type()));
  }
}

int64_t num_blocks(int64_t numel, int64_t block_size) { return (numel + block_size - 1) / block_size; }

/// The device-generic step (ATen ops only; any device): the per-element rule
/// of adam_element over the whole tensor at once, with the same fp32
/// operations in the same order (torch's add_(x, alpha) is the fused
/// multiply-add m1 needs; v1 has two roundings as adam_element), then the
/// parameter stored as write_param would (SR with the same key, or
/// round-to-nearest), and m, v requantized block-wise
/// (quantize_blockwise_generic). The same bits as the CPU paths.
void adamw8bit_generic_step(at::Tensor& live, const at::Tensor& grad_in, std::map<std::string, at::Tensor>& st,
                            bool eight_bit, int64_t block_size, const AdamStep& s, bool sr, RoundingKey key) {
  torch::NoGradGuard no_grad;
  const int64_t n = live.numel();
  const at::Tensor g = grad_in.contiguous().view({n}).to(at::kFloat);
  const at::Tensor p = live.contiguous().view({n}).to(at::kFloat);
  at::Tensor m, v;
  if (eight_bit) {
    m = dequantize_blockwise_generic(st["exp_avg_q"], st["exp_avg_absmax"], signed_dynamic_map(), block_size).view({n});
    v = dequantize_blockwise_generic(st["exp_avg_sq_q"], st["exp_avg_sq_absmax"], unsigned_dynamic_map(), block_size)
            .view({n});
  } else {
    m = st["exp_avg"].view({n});
    v = st["exp_avg_sq"].view({n});
  }
  const at::Tensor p1 = p * s.decay;
  const at::Tensor m1 = (m * s.beta1).add_(g, s.one_minus_beta1);             // fma(g, 1 - b1, m b1)
  const at::Tensor v1 = (v * s.beta2).add_((g * s.one_minus_beta2).mul_(g));  // v b2 + ((1 - b2) g) g
  const at::Tensor denom = v1.sqrt().div_(s.sqrt_bias_correction2).add_(s.eps);
  const at::Tensor p2 = p1 + (m1 * (-s.step_size)).div_(denom);
  const at::Tensor ok =
      g.isfinite().logical_and_(m1.isfinite()).logical_and_(v1.isfinite()).logical_and_(p2.isfinite());
  const at::Tensor m_new = at::where(ok, m1, m);
  const at::Tensor v_new = at::where(ok, v1, v);
  // Parameter: elements that fail keep their stored bits.
  at::Tensor stored;
  if (live.scalar_type() == at::kFloat) {
    stored = p2;
  } else if (sr) {
    stored = at::empty({n}, p2.options().dtype(live.scalar_type()));
    stochastic_round_into(p2, stored, key);
  } else {
    stored = p2.to(live.scalar_type());
  }
  const at::Tensor flat_live = live.contiguous().view({n});
  live.copy_(at::where(ok, stored, flat_live).view(live.sizes()));
  if (eight_bit) {
    BlockwiseQuantized qm = quantize_blockwise_generic(m_new, signed_dynamic_map(), block_size);
    BlockwiseQuantized qv = quantize_blockwise_generic(v_new, unsigned_dynamic_map(), block_size);
    st["exp_avg_q"].copy_(qm.codes.view(st["exp_avg_q"].sizes()));
    st["exp_avg_absmax"].copy_(qm.absmax);
    st["exp_avg_sq_q"].copy_(qv.codes.view(st["exp_avg_sq_q"].sizes()));
    st["exp_avg_sq_absmax"].copy_(qv.absmax);
  } else {
    st["exp_avg"].view({n}).copy_(m_new);
    st["exp_avg_sq"].view({n}).copy_(v_new);
  }
}

}  // namespace

AdamW8bit::AdamW8bit(std::vector<OptimParam> params, AdamW8bitOptions adam, OptimizerOptions options)
    : Optimizer(std::move(params), options), adam8_(adam) {
  if (adam8_.block_size < 1) fail("AdamW8bit: block_size must be >= 1 (got {})", adam8_.block_size);
  if (adam8_.min_8bit_size < 0) fail("AdamW8bit: min_8bit_size must be >= 0 (got {})", adam8_.min_8bit_size);
}

bool AdamW8bit::uses_8bit_state(size_t index) const { return params_.at(index).param.numel() >= adam8_.min_8bit_size; }

void AdamW8bit::check_state(size_t index) const {
  const auto& st = state_[index];
  const at::Tensor& p = params_[index].param;
  const std::string& name = params_[index].name;
  auto expect = [&](const char* sname, at::ScalarType dtype, int64_t numel) {
    auto it = st.find(sname);
    if (it == st.end() || !it->second.defined()) fail("AdamW8bit: state tensor '{}.{}' is missing", name, sname);
    const at::Tensor& t = it->second;
    if (t.scalar_type() != dtype || t.numel() != numel || !t.is_contiguous()) {
      fail("AdamW8bit: state tensor '{}.{}' must be a contiguous {} tensor of {} elements (got {} with {})", name,
           sname, c10::toString(dtype), numel, c10::toString(t.scalar_type()), t.numel());
    }
  };
  size_t defined = 0;
  for (const auto& [k, t] : st) defined += t.defined() ? 1 : 0;
  if (defined == 0) return;
  if (uses_8bit_state(index)) {
    const int64_t blocks = num_blocks(p.numel(), adam8_.block_size);
    expect("exp_avg_q", at::kByte, p.numel());
    expect("exp_avg_absmax", at::kFloat, blocks);
    expect("exp_avg_sq_q", at::kByte, p.numel());
    expect("exp_avg_sq_absmax", at::kFloat, blocks);
    if (defined != 4) fail("AdamW8bit: parameter '{}' has {} state tensors, expected 4 (8-bit)", name, defined);
  } else {
    expect("exp_avg", at::kFloat, p.numel());
    expect("exp_avg_sq", at::kFloat, p.numel());
    if (defined != 2) fail("AdamW8bit: parameter '{}' has {} state tensors, expected 2 (fp32)", name, defined);
  }
}

void AdamW8bit::load_state_tensors(const std::map<std::string, at::Tensor>& tensors) {
  Optimizer::load_state_tensors(tensors);
  for (size_t i = 0; i < params_.size(); ++i) check_state(i);
}

bool AdamW8bit::prepare(size_t index, const at::Tensor& grad_in) {
  at::Tensor& live = params_[index].param;
  const std::string& name = params_[index].name;
  const auto pdtype = live.scalar_type();
  if (pdtype != at::kFloat && pdtype != at::kBFloat16 && pdtype != at::kHalf) {
    fail("AdamW8bit: parameter '{}' has dtype {} (expected float32, bfloat16 or float16)", name, c10::toString(pdtype));
  }
  if (grad_in.numel() != live.numel() || grad_in.device() != live.device()) {
    fail("AdamW8bit: gradient of '{}' has {} elements on {}, expected {} on {}", name, grad_in.numel(),
         grad_in.device().str(), live.numel(), live.device().str());
  }
  const bool eight_bit = uses_8bit_state(index);
  const int64_t n = live.numel();
  const int64_t bs = adam8_.block_size;
  const bool fresh = !has_state(index, eight_bit ? "exp_avg_q" : "exp_avg");
  if (fresh) {
    ScopedMemoryCategory category(MemoryCategory::optimizer_state);
    auto cpu = live.options().requires_grad(false);
    if (eight_bit) {
      const int64_t blocks = num_blocks(n, bs);
      state(index, "exp_avg_q") = at::full(live.sizes(), signed_dynamic_map().encode(0.0f), cpu.dtype(at::kByte));
      state(index, "exp_avg_absmax") = at::zeros({blocks}, cpu.dtype(at::kFloat));
      state(index, "exp_avg_sq_q") = at::full(live.sizes(), unsigned_dynamic_map().encode(0.0f), cpu.dtype(at::kByte));
      state(index, "exp_avg_sq_absmax") = at::zeros({blocks}, cpu.dtype(at::kFloat));
    } else {
      state(index, "exp_avg") = at::zeros(live.sizes(), cpu.dtype(at::kFloat));
      state(index, "exp_avg_sq") = at::zeros(live.sizes(), cpu.dtype(at::kFloat));
    }
  }
  check_state(index);
  for (const auto& [sname, t] : state_[index]) {
    if (t.defined() && t.device() != live.device()) {
      fail("AdamW8bit: state tensor '{}.{}' is on {} but the parameter on {}", name, sname, t.device().str(),
           live.device().str());
    }
  }
  return eight_bit;
}

std::optional<FusedAdamW8bitTensor> AdamW8bit::fused_task(size_t index, const at::Tensor& grad, double lr, int64_t step,
                                                          double grad_scale) {
  const bool eight_bit = prepare(index, grad);
  const at::Tensor& live = params_[index].param;
  auto& st = state_[index];
  // Fast path (optim/fused_kernels.h): one pass, vectorized, bit-identical to
  // the per-element kernel of update(), which remains the path for fp16 and
  // non-contiguous tensors.
  if (!eight_bit || !fast_cpu_path(live) ||
      !fused_adamw8bit_supported(live, grad, st["exp_avg_q"], st["exp_avg_absmax"], st["exp_avg_sq_q"],
                                 st["exp_avg_sq_absmax"], adam8_.block_size)) {
    return std::nullopt;
  }
  FusedAdamW8bitTensor t{
      live, grad, st["exp_avg_q"], st["exp_avg_absmax"], st["exp_avg_sq_q"], st["exp_avg_sq_absmax"], adam8_.block_size,
      {},   {}};
  const AdamWOptions& a = adam8_.adam;
  t.scalars.lr = lr;
  t.scalars.beta1 = a.beta1;
  t.scalars.beta2 = a.beta2;
  t.scalars.eps = a.eps;
  t.scalars.weight_decay = params_[index].weight_decay;
  t.scalars.step = step;
  t.scalars.grad_scale = grad_scale;
  t.keys.stochastic_rounding = options_.stochastic_rounding;
  t.keys.param = rounding_key(index, step);
  return t;
}

void AdamW8bit::update_many(const std::vector<size_t>& indices, double lr, int64_t step, double grad_scale) {
  update_many_fused<FusedAdamW8bitTensor>(
      indices, lr, step, grad_scale,
      [this](size_t i, const at::Tensor& g, double l, int64_t s, double gs) { return fused_task(i, g, l, s, gs); },
      fused_adamw8bit_step_many);
}

void AdamW8bit::update(size_t index, const at::Tensor& grad_in, double lr, int64_t step) {
  if (auto t = fused_task(index, grad_in, lr, step, 1.0)) {
    fused_adamw8bit_step_many({std::move(*t)});
    return;
  }
  at::Tensor& live = params_[index].param;
  const auto pdtype = live.scalar_type();
  const bool eight_bit = uses_8bit_state(index);
  const int64_t n = live.numel();
  const int64_t bs = adam8_.block_size;
  const AdamWOptions& a = adam8_.adam;
  const double wd = params_[index].weight_decay;
  const double bias_correction1 = 1.0 - std::pow(a.beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(a.beta2, static_cast<double>(step));
  Work w;
  w.n = n;
  w.block_size = bs;
  w.s.decay = static_cast<float>(1.0 - lr * wd);
  w.s.beta1 = static_cast<float>(a.beta1);
  w.s.one_minus_beta1 = static_cast<float>(1.0 - a.beta1);
  w.s.beta2 = static_cast<float>(a.beta2);
  w.s.one_minus_beta2 = static_cast<float>(1.0 - a.beta2);
  w.s.sqrt_bias_correction2 = static_cast<float>(std::sqrt(bias_correction2));
  w.s.step_size = static_cast<float>(lr / bias_correction1);
  w.s.eps = static_cast<float>(a.eps);
  w.sr = options_.stochastic_rounding && pdtype != at::kFloat;
  // Same stream as Optimizer::write_param.
  const RoundingKey rk = rounding_key(index, step);
  if (!fast_cpu_path(live)) {
    adamw8bit_generic_step(live, grad_in, state_[index], eight_bit, bs, w.s, w.sr, rk);
    return;
  }
  w.rng_key = counter_rng_key(rk.seed, rk.step, rk.tensor_id);
  if (eight_bit) {
    w.mq = state(index, "exp_avg_q").data_ptr<uint8_t>();
    w.m_absmax = state(index, "exp_avg_absmax").data_ptr<float>();
    w.vq = state(index, "exp_avg_sq_q").data_ptr<uint8_t>();
    w.v_absmax = state(index, "exp_avg_sq_absmax").data_ptr<float>();
  } else {
    w.m = state(index, "exp_avg").data_ptr<float>();
    w.v = state(index, "exp_avg_sq").data_ptr<float>();
  }

  const at::Tensor grad = grad_in.contiguous();
  // Parameters are normally contiguous; otherwise work on a contiguous copy.
  at::Tensor work = live.is_contiguous() ? live : live.contiguous();
  switch (pdtype) {
    case at::kFloat: dispatch_grad(work.data_ptr<float>(), grad, w, eight_bit); break;
    case at::kBFloat16: dispatch_grad(work.data_ptr<c10::BFloat16>(), grad, w, eight_bit); break;
    default: dispatch_grad(work.data_ptr<c10::Half>(), grad, w, eight_bit); break;
  }
  if (!work.is_same(live)) {
    torch::NoGradGuard no_grad;
    live.copy_(work);
  }
}

AdamW8bitOptions parse_adamw8bit_args(const std::vector<std::string>& args) {
  OptimizerArgs a(args, "AdamW8bit", {"weight_decay", "betas", "eps", "min_8bit_size", "block_size"});
  AdamW8bitOptions o;
  // The AdamW arguments are checked exactly as for AdamW.
  std::vector<std::string> adam_args;
  for (const auto& arg : args) {
    if (arg.rfind("min_8bit_size", 0) != 0 && arg.rfind("block_size", 0) != 0) adam_args.push_back(arg);
  }
  o.adam = parse_adamw_args(adam_args);
  for (const char* key : {"min_8bit_size", "block_size"}) {
    const double lowest = std::string(key) == "block_size" ? 1 : 0;
    const double fallback = std::string(key) == "block_size" ? o.block_size : o.min_8bit_size;
    const double d = a.get_double(key, fallback);
    if (d != std::floor(d) || d < lowest || d > 1e15) {
      fail("optimizer_args: {} must be an integer >= {} (got {})", key, lowest, d);
    }
    (std::string(key) == "block_size" ? o.block_size : o.min_8bit_size) = static_cast<int64_t>(d);
  }
  return o;
}

OptimizerStateSize AdamW8bit::state_size(at::IntArrayRef shape, const AdamW8bitOptions& adam) {
  const int64_t n = c10::multiply_integers(shape);
  if (n < adam.min_8bit_size) return {8 * n, 0};
  const int64_t blocks = (n + adam.block_size - 1) / adam.block_size;
  return {2 * n + 2 * blocks * 4, 0};
}

}  // namespace shoestring
