// Fused AdamW and Lion steps (optim/fused_kernels.h): one pass over the
// parameter, its gradient and its state per element range.
#include "shoestring/optim/fused_kernel_support.h"

namespace shoestring {
namespace {

// Everything a range kernel needs; constants already rounded to fp32.
struct AdamWArgs : AdamConstants {
  void* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  uint64_t param_key, exp_avg_key, exp_avg_sq_key;  // counter_rng_key(...) of each tensor
};

template <typename P, typename G, typename S, Rounding kParamRounding>
SHOESTRING_ALWAYS_INLINE void adamw_range(const AdamWArgs& a, int64_t begin, int64_t end) {
  P* __restrict p_ptr = static_cast<P*>(a.param);
  const G* __restrict g_ptr = static_cast<const G*>(a.grad);
  S* __restrict m_ptr = static_cast<S*>(a.exp_avg);
  S* __restrict v_ptr = static_cast<S*>(a.exp_avg_sq);
  StoreWords<P, kParamRounding> p_words;
  StoreWords<S, Rounding::stochastic> m_words, v_words;
  for (int64_t b = begin; b < end; b += kRandom16BlockSize) {
    const int64_t len = std::min(kRandom16BlockSize, end - b);
    p_words.fill(a.param_key, b, len);
    m_words.fill(a.exp_avg_key, b, len);
    v_words.fill(a.exp_avg_sq_key, b, len);
    SHOESTRING_LOOP_NO_ALIAS
    for (int64_t k = 0; k < len; ++k) {
      const int64_t i = b + k;
      const float g = load(g_ptr, i) * a.grad_scale;
      float p = load(p_ptr, i) * a.decay;
      const float m = fma_f32(g, a.one_minus_beta1, load(m_ptr, i) * a.beta1);
      const float v = fma_f32(a.one_minus_beta2 * g, g, load(v_ptr, i) * a.beta2);
      const float denom = sqrt_f32(v) / a.bias_correction2_sqrt + a.eps;
      p = p + (a.neg_step_size * m) / denom;
      store(m_ptr, i, m, m_words[k], Rounding::stochastic);
      store(v_ptr, i, v, v_words[k], Rounding::stochastic);
      store(p_ptr, i, p, p_words[k], kParamRounding);
    }
  }
}

struct LionArgs {
  void* param;
  const void* grad;
  void* exp_avg;
  float grad_scale, decay, neg_lr, beta1, one_minus_beta1, beta2, one_minus_beta2;
  uint64_t param_key, exp_avg_key;
};

template <typename P, typename G, typename S, Rounding kParamRounding>
SHOESTRING_ALWAYS_INLINE void lion_range(const LionArgs& a, int64_t begin, int64_t end) {
  P* __restrict p_ptr = static_cast<P*>(a.param);
  const G* __restrict g_ptr = static_cast<const G*>(a.grad);
  S* __restrict m_ptr = static_cast<S*>(a.exp_avg);
  StoreWords<P, kParamRounding> p_words;
  StoreWords<S, Rounding::stochastic> m_words;
  for (int64_t b = begin; b < end; b += kRandom16BlockSize) {
    const int64_t len = std::min(kRandom16BlockSize, end - b);
    p_words.fill(a.param_key, b, len);
    m_words.fill(a.exp_avg_key, b, len);
    SHOESTRING_LOOP_NO_ALIAS
    for (int64_t k = 0; k < len; ++k) {
      const int64_t i = b + k;
      const float g = load(g_ptr, i) * a.grad_scale;
      const float m_old = load(m_ptr, i);
      float p = load(p_ptr, i) * a.decay;
      const float c = fma_f32(g, a.one_minus_beta1, m_old * a.beta1);
      // torch.sign: (0 < c) - (c < 0), so NaN -> 0. lr * sign is exact.
      const float sign = static_cast<float>(c > 0.0f) - static_cast<float>(c < 0.0f);
      p = p + a.neg_lr * sign;
      const float m = fma_f32(g, a.one_minus_beta2, m_old * a.beta2);
      store(m_ptr, i, m, m_words[k], Rounding::stochastic);
      store(p_ptr, i, p, p_words[k], kParamRounding);
    }
  }
}

// One non-template, target-cloned entry point per dtype combination
// (target_clones is not reliable on templates).
using AdamWRangeFn = void (*)(const AdamWArgs&, int64_t, int64_t);
using LionRangeFn = void (*)(const LionArgs&, int64_t, int64_t);

#define SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, NAME, P, G, S, R) \
  SHOESTRING_FUSED_TARGET_CLONES void NAME(const ARGS& a, int64_t b, int64_t e) { KERNEL<P, G, S, R>(a, b, e); }

#define SHOESTRING_FUSED_VARIANTS(KERNEL, ARGS, PREFIX)                                                              \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_f32_f32_f32, float, float, float, Rounding::nearest)               \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_f32_f32_b16, float, float, bf16_bits, Rounding::nearest)           \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_f32_b16_f32, float, bf16_bits, float, Rounding::nearest)           \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_f32_b16_b16, float, bf16_bits, bf16_bits, Rounding::nearest)       \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_sr_f32_f32, bf16_bits, float, float, Rounding::stochastic)         \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_sr_f32_b16, bf16_bits, float, bf16_bits, Rounding::stochastic)     \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_sr_b16_f32, bf16_bits, bf16_bits, float, Rounding::stochastic)     \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_sr_b16_b16, bf16_bits, bf16_bits, bf16_bits, Rounding::stochastic) \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_rn_f32_f32, bf16_bits, float, float, Rounding::nearest)            \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_rn_f32_b16, bf16_bits, float, bf16_bits, Rounding::nearest)        \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_rn_b16_f32, bf16_bits, bf16_bits, float, Rounding::nearest)        \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_rn_b16_b16, bf16_bits, bf16_bits, bf16_bits, Rounding::nearest)

SHOESTRING_FUSED_VARIANTS(adamw_range, AdamWArgs, adamw)
SHOESTRING_FUSED_VARIANTS(lion_range, LionArgs, lion)

// Table index: param kind (0 fp32, 1 bf16 SR, 2 bf16 nearest) * 4 + grad bf16 * 2 + state bf16.
constexpr AdamWRangeFn kAdamW[12] = {adamw_f32_f32_f32, adamw_f32_f32_b16, adamw_f32_b16_f32, adamw_f32_b16_b16,
                                     adamw_sr_f32_f32,  adamw_sr_f32_b16,  adamw_sr_b16_f32,  adamw_sr_b16_b16,
                                     adamw_rn_f32_f32,  adamw_rn_f32_b16,  adamw_rn_b16_f32,  adamw_rn_b16_b16};
constexpr LionRangeFn kLion[12] = {lion_f32_f32_f32, lion_f32_f32_b16, lion_f32_b16_f32, lion_f32_b16_b16,
                                   lion_sr_f32_f32,  lion_sr_f32_b16,  lion_sr_b16_f32,  lion_sr_b16_b16,
                                   lion_rn_f32_f32,  lion_rn_f32_b16,  lion_rn_b16_f32,  lion_rn_b16_b16};

}  // namespace

bool fused_adamw_supported(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                           const at::Tensor& exp_avg_sq) {
  return first_reason({{&param, "param"}, {&grad, "grad"}, {&exp_avg, "exp_avg"}, {&exp_avg_sq, "exp_avg_sq"}})
             .empty() &&
         exp_avg.scalar_type() == exp_avg_sq.scalar_type();
}

void fused_adamw_step(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                      const FusedAdamWScalars& s, const FusedRoundingKeys& keys) {
  const std::string why =
      first_reason({{&param, "param"}, {&grad, "grad"}, {&exp_avg, "exp_avg"}, {&exp_avg_sq, "exp_avg_sq"}});
  if (!why.empty()) fail("fused_adamw_step: {}", why);
  if (exp_avg.scalar_type() != exp_avg_sq.scalar_type()) {
    fail("fused_adamw_step: exp_avg is {} but exp_avg_sq is {}; both must have one dtype",
         c10::toString(exp_avg.scalar_type()), c10::toString(exp_avg_sq.scalar_type()));
  }
  if (s.step < 1) fail("fused_adamw_step: step must be >= 1 (1-based), got {}", s.step);
  const int64_t n = param.numel();
  if (n == 0) return;

  AdamWArgs a;
  static_cast<AdamConstants&>(a) = adam_constants(s);
  a.param = param.data_ptr();
  a.grad = grad.data_ptr();
  a.exp_avg = exp_avg.data_ptr();
  a.exp_avg_sq = exp_avg_sq.data_ptr();
  a.param_key = stream_key(keys.param);
  a.exp_avg_key = stream_key(keys.state1);
  a.exp_avg_sq_key = stream_key(keys.state2);
  const AdamWRangeFn fn = kAdamW[variant_index(param, grad, exp_avg, keys.stochastic_rounding)];
  at::parallel_for(0, n, kGrainSize, [&](int64_t begin, int64_t end) { fn(a, begin, end); });
  bump_version(param);
  bump_version(exp_avg);
  bump_version(exp_avg_sq);
}

bool fused_lion_supported(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg) {
  return first_reason({{&param, "param"}, {&grad, "grad"}, {&exp_avg, "exp_avg"}}).empty();
}

void fused_lion_step(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg, const FusedLionScalars& s,
                     const FusedRoundingKeys& keys) {
  const std::string why = first_reason({{&param, "param"}, {&grad, "grad"}, {&exp_avg, "exp_avg"}});
  if (!why.empty()) fail("fused_lion_step: {}", why);
  const int64_t n = param.numel();
  if (n == 0) return;
  LionArgs a;
  a.param = param.data_ptr();
  a.grad = grad.data_ptr();
  a.exp_avg = exp_avg.data_ptr();
  a.grad_scale = static_cast<float>(s.grad_scale);
  a.decay = static_cast<float>(1.0 - s.lr * s.weight_decay);
  a.neg_lr = static_cast<float>(-s.lr);
  a.beta1 = static_cast<float>(s.beta1);
  a.one_minus_beta1 = static_cast<float>(1.0 - s.beta1);
  a.beta2 = static_cast<float>(s.beta2);
  a.one_minus_beta2 = static_cast<float>(1.0 - s.beta2);
  a.param_key = stream_key(keys.param);
  a.exp_avg_key = stream_key(keys.state1);
  const LionRangeFn fn = kLion[variant_index(param, grad, exp_avg, keys.stochastic_rounding)];
  at::parallel_for(0, n, kGrainSize, [&](int64_t begin, int64_t end) { fn(a, begin, end); });
  bump_version(param);
  bump_version(exp_avg);
}

}  // namespace shoestring
