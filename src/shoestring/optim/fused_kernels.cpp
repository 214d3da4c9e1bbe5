#include "shoestring/optim/fused_kernels.h"

#include <cmath>
#include <cstring>
#include <string>
#include <utility>

#include <fmt/format.h>

#include <ATen/Parallel.h>

#include "shoestring/core/error.h"

// The loops below must vectorize and must evaluate exactly the written fp32
// operations: -O3 (also in -O2 builds), and no implicit fp contraction (GNU
// mode contracts a*b + c into an fma on FMA targets; the fmas that libtorch's
// own GCC-compiled kernels end up with are written out instead, see the
// header). sqrt must not set errno, which
// only a command-line flag achieves: CMakeLists.txt compiles this file with
// -fno-math-errno. The pragma applies to the functions defined (and the
// inline helpers included) from here on.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("O3", "fp-contract=off")
#endif

#include "shoestring/core/counter_rng.h"
#include "shoestring/core/stochastic_rounding_bits.h"

namespace shoestring {
namespace {

// Elements per parallel task: 16384 elements move 224-448 KiB (AdamW), big
// enough to amortize a task, small enough to split mid-size tensors.
constexpr int64_t kGrainSize = 16384;

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define SHOESTRING_FUSED_TARGET_CLONES \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SHOESTRING_FUSED_TARGET_CLONES
#endif

#if defined(__GNUC__)
#define SHOESTRING_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define SHOESTRING_ALWAYS_INLINE inline
#endif

// bf16 is handled as its raw bits (uint16_t); fp32 as float.
using bf16_bits = uint16_t;

// Builtins rather than std::sqrt / std::fma: the <cmath> wrappers were
// compiled without the options above, and GCC will not inline a function with
// different optimization options, which would leave a call in the loop.
#if defined(__GNUC__)
SHOESTRING_ALWAYS_INLINE float sqrt_f32(float x) { return __builtin_sqrtf(x); }
SHOESTRING_ALWAYS_INLINE float fma_f32(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
#else
SHOESTRING_ALWAYS_INLINE float sqrt_f32(float x) { return std::sqrt(x); }
SHOESTRING_ALWAYS_INLINE float fma_f32(float a, float b, float c) { return std::fma(a, b, c); }
#endif

SHOESTRING_ALWAYS_INLINE float load(const float* p, int64_t i) { return p[i]; }
SHOESTRING_ALWAYS_INLINE float load(const bf16_bits* p, int64_t i) {
  const uint32_t u = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

SHOESTRING_ALWAYS_INLINE uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

// How a value is stored: fp32 as is; bf16 by stochastic rounding (key, element
// index) or by round-to-nearest-even (c10::BFloat16's rule, NaN -> 0x7FC0).
enum class Rounding { stochastic, nearest };

SHOESTRING_ALWAYS_INLINE void store(float* p, int64_t i, float x, uint64_t, Rounding) { p[i] = x; }
SHOESTRING_ALWAYS_INLINE void store(bf16_bits* p, int64_t i, float x, uint64_t key, Rounding rounding) {
  const uint32_t b = bits_of(x);
  if (rounding == Rounding::stochastic) {
    p[i] = sr_bf16_from_fp32_bits(b, counter_random32(key, static_cast<uint64_t>(i)));
  } else {
    const uint32_t rne = (b + (((b >> 16) & 1u) + 0x7FFFu)) >> 16;
    const bool is_nan = (b & 0x7FFFFFFFu) > 0x7F800000u;
    p[i] = static_cast<bf16_bits>(is_nan ? 0x7FC0u : rne);
  }
}

// Everything a range kernel needs; constants already rounded to fp32.
struct AdamWArgs {
  void* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  float grad_scale, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps,
      neg_step_size;
  uint64_t param_key, exp_avg_key, exp_avg_sq_key;  // counter_rng_key(...) of each tensor
};

template <typename P, typename G, typename S, Rounding kParamRounding>
SHOESTRING_ALWAYS_INLINE void adamw_range(const AdamWArgs& a, int64_t begin, int64_t end) {
  P* __restrict p_ptr = static_cast<P*>(a.param);
  const G* __restrict g_ptr = static_cast<const G*>(a.grad);
  S* __restrict m_ptr = static_cast<S*>(a.exp_avg);
  S* __restrict v_ptr = static_cast<S*>(a.exp_avg_sq);
  for (int64_t i = begin; i < end; ++i) {
    const float g = load(g_ptr, i) * a.grad_scale;
    float p = load(p_ptr, i) * a.decay;
    const float m = fma_f32(g, a.one_minus_beta1, load(m_ptr, i) * a.beta1);
    const float v = fma_f32(a.one_minus_beta2 * g, g, load(v_ptr, i) * a.beta2);
    const float denom = sqrt_f32(v) / a.bias_correction2_sqrt + a.eps;
    p = p + (a.neg_step_size * m) / denom;
    store(m_ptr, i, m, a.exp_avg_key, Rounding::stochastic);
    store(v_ptr, i, v, a.exp_avg_sq_key, Rounding::stochastic);
    store(p_ptr, i, p, a.param_key, kParamRounding);
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
  for (int64_t i = begin; i < end; ++i) {
    const float g = load(g_ptr, i) * a.grad_scale;
    const float m_old = load(m_ptr, i);
    float p = load(p_ptr, i) * a.decay;
    const float c = fma_f32(g, a.one_minus_beta1, m_old * a.beta1);
    // torch.sign: (0 < c) - (c < 0), so NaN -> 0. lr * sign is exact.
    const float sign = static_cast<float>(c > 0.0f) - static_cast<float>(c < 0.0f);
    p = p + a.neg_lr * sign;
    const float m = fma_f32(g, a.one_minus_beta2, m_old * a.beta2);
    store(m_ptr, i, m, a.exp_avg_key, Rounding::stochastic);
    store(p_ptr, i, p, a.param_key, kParamRounding);
  }
}

// One non-template, target-cloned entry point per dtype combination
// (target_clones is not reliable on templates).
using AdamWRangeFn = void (*)(const AdamWArgs&, int64_t, int64_t);
using LionRangeFn = void (*)(const LionArgs&, int64_t, int64_t);

#define SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, NAME, P, G, S, R) \
  SHOESTRING_FUSED_TARGET_CLONES void NAME(const ARGS& a, int64_t b, int64_t e) { KERNEL<P, G, S, R>(a, b, e); }

#define SHOESTRING_FUSED_VARIANTS(KERNEL, ARGS, PREFIX)                                                  \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_f32_f32_f32, float, float, float, Rounding::nearest)    \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_f32_f32_b16, float, float, bf16_bits, Rounding::nearest) \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_f32_b16_f32, float, bf16_bits, float, Rounding::nearest) \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_f32_b16_b16, float, bf16_bits, bf16_bits, Rounding::nearest) \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_sr_f32_f32, bf16_bits, float, float, Rounding::stochastic) \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_sr_f32_b16, bf16_bits, float, bf16_bits, Rounding::stochastic) \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_sr_b16_f32, bf16_bits, bf16_bits, float, Rounding::stochastic) \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_sr_b16_b16, bf16_bits, bf16_bits, bf16_bits, Rounding::stochastic) \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_rn_f32_f32, bf16_bits, float, float, Rounding::nearest) \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_rn_f32_b16, bf16_bits, float, bf16_bits, Rounding::nearest) \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_rn_b16_f32, bf16_bits, bf16_bits, float, Rounding::nearest) \
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

int variant_index(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& state, bool sr) {
  const int p = param.scalar_type() == at::kFloat ? 0 : (sr ? 1 : 2);
  return p * 4 + (grad.scalar_type() == at::kBFloat16 ? 2 : 0) + (state.scalar_type() == at::kBFloat16 ? 1 : 0);
}

// Why `t` cannot take the fused path, or "" when it can.
std::string unsupported_reason(const at::Tensor& t, const char* name, int64_t numel) {
  if (!t.defined()) return fmt::format("{} is undefined", name);
  if (!t.device().is_cpu()) return fmt::format("{} is on {}, expected the CPU", name, t.device().str());
  if (t.layout() != at::kStrided) return fmt::format("{} is not a strided (dense) tensor", name);
  if (t.scalar_type() != at::kFloat && t.scalar_type() != at::kBFloat16) {
    return fmt::format("{} is {}, expected float32 or bfloat16", name, c10::toString(t.scalar_type()));
  }
  if (!t.is_contiguous()) return fmt::format("{} is not contiguous", name);
  if (numel >= 0 && t.numel() != numel) return fmt::format("{} has {} elements, expected {}", name, t.numel(), numel);
  return {};
}

std::string first_reason(std::initializer_list<std::pair<const at::Tensor*, const char*>> tensors) {
  int64_t numel = -1;
  for (const auto& [t, name] : tensors) {
    std::string why = unsupported_reason(*t, name, numel);
    if (!why.empty()) return why;
    numel = t->numel();
  }
  return {};
}

uint64_t stream_key(const RoundingKey& k) { return counter_rng_key(k.seed, k.step, k.tensor_id); }

void bump_version(at::Tensor& t) { t.unsafeGetTensorImpl()->bump_version(); }

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

  // Constants exactly as the op chain passes them to libtorch (double
  // arithmetic, then one rounding to fp32).
  const double bias_correction1 = 1.0 - std::pow(s.beta1, static_cast<double>(s.step));
  const double bias_correction2 = 1.0 - std::pow(s.beta2, static_cast<double>(s.step));
  AdamWArgs a;
  a.param = param.data_ptr();
  a.grad = grad.data_ptr();
  a.exp_avg = exp_avg.data_ptr();
  a.exp_avg_sq = exp_avg_sq.data_ptr();
  a.grad_scale = static_cast<float>(s.grad_scale);
  a.decay = static_cast<float>(1.0 - s.lr * s.weight_decay);
  a.beta1 = static_cast<float>(s.beta1);
  a.one_minus_beta1 = static_cast<float>(1.0 - s.beta1);
  a.beta2 = static_cast<float>(s.beta2);
  a.one_minus_beta2 = static_cast<float>(1.0 - s.beta2);
  a.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  a.eps = static_cast<float>(s.eps);
  a.neg_step_size = static_cast<float>(-(s.lr / bias_correction1));
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
