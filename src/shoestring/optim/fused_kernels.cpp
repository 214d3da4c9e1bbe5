#include "shoestring/optim/fused_kernels.h"

#include <cmath>
#include <cstring>
#include <algorithm>
#include <atomic>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <ATen/Parallel.h>

#include "shoestring/core/error.h"
#include "shoestring/optim/quantization.h"

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

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define SHOESTRING_FUSED_AVX512 1
// GCC 12's AVX-512 intrinsics initialize their "undefined" operands from
// themselves, which -Wmaybe-uninitialized reports at the header's lines
// (GCC bug 105593); silenced for the header only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

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

// The scalars of one AdamW step as the op chain passes them to libtorch:
// computed in double, then rounded to fp32 once (shared by the fp32/bf16 and
// the 8-bit kernels).
struct AdamConstants {
  float grad_scale, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps,
      neg_step_size;
};

AdamConstants adam_constants(const FusedAdamWScalars& s) {
  const double bias_correction1 = 1.0 - std::pow(s.beta1, static_cast<double>(s.step));
  const double bias_correction2 = 1.0 - std::pow(s.beta2, static_cast<double>(s.step));
  AdamConstants c;
  c.grad_scale = static_cast<float>(s.grad_scale);
  c.decay = static_cast<float>(1.0 - s.lr * s.weight_decay);
  c.beta1 = static_cast<float>(s.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - s.beta1);
  c.beta2 = static_cast<float>(s.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - s.beta2);
  c.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  c.eps = static_cast<float>(s.eps);
  c.neg_step_size = static_cast<float>(-(s.lr / bias_correction1));  // = -float(lr / bc1): rounding is symmetric
  return c;
}

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

// ---- AdamW8bit ---------------------------------------------------------------

struct AdamW8bitArgs : AdamConstants {
  void* param;
  const void* grad;
  uint8_t* exp_avg_q;
  float* exp_avg_absmax;
  uint8_t* exp_avg_sq_q;
  float* exp_avg_sq_absmax;
  int64_t n, block_size;
  const float* m_values;   // signed dynamic map, 256 values
  const float* v_values;   // unsigned dynamic map
  const uint32_t* m_table;  // QuantizationMap::fast_table()
  const uint32_t* v_table;
  uint8_t m_zero, v_zero;
  uint64_t param_key;
};

SHOESTRING_ALWAYS_INLINE bool finite_f32(float x) { return (bits_of(x) & 0x7F800000u) != 0x7F800000u; }
SHOESTRING_ALWAYS_INLINE float abs_f32(float x) {
  const uint32_t u = bits_of(x) & 0x7FFFFFFFu;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// One element (global index i) with decoded moments m, v: the update lands
// (parameter stored, m and v replaced) only when g, m1, v1 and p2 are finite.
template <typename P, typename G, Rounding kParamRounding>
SHOESTRING_ALWAYS_INLINE void adamw8bit_element(const AdamW8bitArgs& a, int64_t i, float& m, float& v) {
  P* p_ptr = static_cast<P*>(a.param);
  const G* g_ptr = static_cast<const G*>(a.grad);
  const float g = load(g_ptr, i) * a.grad_scale;
  const float p1 = load(p_ptr, i) * a.decay;
  const float m1 = fma_f32(g, a.one_minus_beta1, m * a.beta1);
  const float v1 = v * a.beta2 + (a.one_minus_beta2 * g) * g;
  const float denom = sqrt_f32(v1) / a.bias_correction2_sqrt + a.eps;
  const float p2 = p1 + (a.neg_step_size * m1) / denom;
  if (finite_f32(g) && finite_f32(m1) && finite_f32(v1) && finite_f32(p2)) {
    m = m1;
    v = v1;
    store(p_ptr, i, p2, a.param_key, kParamRounding);
  }
}

// Elements [k0, len) of the block starting at `start`: decode, update, keep
// the new moments in mbuf / vbuf, raise the running absmaxes.
template <typename P, typename G, Rounding kParamRounding>
SHOESTRING_ALWAYS_INLINE void adamw8bit_update_scalar(const AdamW8bitArgs& a, int64_t start, int64_t k0, int64_t len,
                                                      float m_absmax, float v_absmax, float* mbuf, float* vbuf,
                                                      float& m_max, float& v_max) {
  for (int64_t k = k0; k < len; ++k) {
    const int64_t i = start + k;
    float m = a.m_values[a.exp_avg_q[i]] * m_absmax;
    float v = a.v_values[a.exp_avg_sq_q[i]] * v_absmax;
    adamw8bit_element<P, G, kParamRounding>(a, i, m, v);
    mbuf[k] = m;
    vbuf[k] = v;
    const float am = abs_f32(m), av = abs_f32(v);
    m_max = am > m_max ? am : m_max;
    v_max = av > v_max ? av : v_max;
  }
}

SHOESTRING_ALWAYS_INLINE void encode_scalar(const float* x, int64_t k0, int64_t len, float inv, const uint32_t* table,
                                            uint8_t zero, uint8_t* codes) {
  for (int64_t k = k0; k < len; ++k) codes[k] = QuantizationMap::encode_with_table(table, x[k] * inv, zero);
}

// Portable kernel: blocks [b0, b1), one element at a time.
template <typename P, typename G, Rounding kParamRounding>
SHOESTRING_ALWAYS_INLINE void adamw8bit_blocks(const AdamW8bitArgs& a, int64_t b0, int64_t b1, float* mbuf,
                                               float* vbuf) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * a.block_size;
    const int64_t len = std::min(a.block_size, a.n - start);
    float m_max = 0.0f, v_max = 0.0f;
    adamw8bit_update_scalar<P, G, kParamRounding>(a, start, 0, len, a.exp_avg_absmax[b], a.exp_avg_sq_absmax[b], mbuf,
                                                  vbuf, m_max, v_max);
    a.exp_avg_absmax[b] = m_max;
    a.exp_avg_sq_absmax[b] = v_max;
    // As quantize_block: x * (1 / absmax); an all-zero block gives 0 * inf =
    // NaN, whose code is the zero code.
    encode_scalar(mbuf, 0, len, 1.0f / m_max, a.m_table, a.m_zero, a.exp_avg_q + start);
    encode_scalar(vbuf, 0, len, 1.0f / v_max, a.v_table, a.v_zero, a.exp_avg_sq_q + start);
  }
}

#ifdef SHOESTRING_FUSED_AVX512
// AVX-512 kernel: 16 elements at a time, the block's last len % 16 elements
// by the portable code (same operations, so the same bits).
#define SHOESTRING_AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")))
#define SHOESTRING_AVX512_INLINE SHOESTRING_AVX512_TARGET SHOESTRING_ALWAYS_INLINE

SHOESTRING_AVX512_INLINE __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
SHOESTRING_AVX512_INLINE __m512 load16(const bf16_bits* p) {
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}

// table[c] for 16 codes c in 0..255 (int32 lanes) without a gather: eight
// two-register permutes cover 32 entries each, then three blend levels pick
// by bits 5, 6 and 7 of the code (about 2.5x the throughput of a gather).
SHOESTRING_AVX512_INLINE __m512 lookup256(const float* table, __m512i c) {
  __m512 r[8];
  for (int k = 0; k < 8; ++k) {
    r[k] = _mm512_permutex2var_ps(_mm512_loadu_ps(table + 32 * k), c, _mm512_loadu_ps(table + 32 * k + 16));
  }
  const __mmask16 b5 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(32));
  const __mmask16 b6 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(64));
  const __mmask16 b7 = _mm512_test_epi32_mask(c, _mm512_set1_epi32(128));
  for (int k = 0; k < 4; ++k) r[k] = _mm512_mask_blend_ps(b5, r[2 * k], r[2 * k + 1]);
  for (int k = 0; k < 2; ++k) r[k] = _mm512_mask_blend_ps(b6, r[2 * k], r[2 * k + 1]);
  return _mm512_mask_blend_ps(b7, r[0], r[1]);
}

SHOESTRING_AVX512_INLINE __m512i mix64x8(__m512i z) {
  z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 30));
  z = _mm512_mullo_epi64(z, _mm512_set1_epi64(static_cast<long long>(0xBF58476D1CE4E5B9ull)));
  z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 27));
  z = _mm512_mullo_epi64(z, _mm512_set1_epi64(static_cast<long long>(0x94D049BB133111EBull)));
  return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}

// counter_random32(key, i + j) in lane j (j = 0..15).
SHOESTRING_AVX512_INLINE __m512i random32x16(uint64_t key, int64_t i) {
  const uint64_t g = kSplitMix64Gamma;
  const __m512i steps = _mm512_set_epi64(static_cast<long long>(7 * g), static_cast<long long>(6 * g),
                                         static_cast<long long>(5 * g), static_cast<long long>(4 * g),
                                         static_cast<long long>(3 * g), static_cast<long long>(2 * g),
                                         static_cast<long long>(g), 0);
  const uint64_t first = key + (static_cast<uint64_t>(i) + 1) * g;
  const __m512i z0 = _mm512_add_epi64(_mm512_set1_epi64(static_cast<long long>(first)), steps);
  const __m512i z1 = _mm512_add_epi64(z0, _mm512_set1_epi64(static_cast<long long>(8 * g)));
  const __m256i lo = _mm512_cvtepi64_epi32(_mm512_srli_epi64(mix64x8(z0), 32));
  const __m256i hi = _mm512_cvtepi64_epi32(_mm512_srli_epi64(mix64x8(z1), 32));
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

SHOESTRING_AVX512_INLINE __mmask16 finite16(__m512 x) {
  const __m512i e = _mm512_set1_epi32(0x7F800000);
  return _mm512_cmpneq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(x), e), e);
}

template <Rounding kParamRounding>
SHOESTRING_AVX512_INLINE void store16(float* p, int64_t i, __m512 x, __mmask16 ok, uint64_t) {
  _mm512_mask_storeu_ps(p + i, ok, x);
}
template <Rounding kParamRounding>
SHOESTRING_AVX512_INLINE void store16(bf16_bits* p, int64_t i, __m512 x, __mmask16 ok, uint64_t key) {
  // Only finite values are stored (ok), so no NaN case.
  const __m512i b = _mm512_castps_si512(x);
  __m512i r;
  if (kParamRounding == Rounding::stochastic) {
    r = _mm512_and_si512(random32x16(key, i), _mm512_set1_epi32(0xFFFF));
  } else {
    r = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1)),
                         _mm512_set1_epi32(0x7FFF));
  }
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(b, r), 16);
  _mm256_mask_storeu_epi16(p + i, ok, _mm512_cvtepi32_epi16(rounded));
}

// QuantizationMap::encode_with_table for 16 lanes.
SHOESTRING_AVX512_INLINE __m128i encode16(__m512 x, const uint32_t* table, uint8_t zero) {
  const __m512i b = _mm512_castps_si512(x);
  __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(mag, _mm512_set1_epi32(0x7F800000));
  const __m512i lo_bits = _mm512_set1_epi32(static_cast<int>(QuantizationMap::kFastMinBits));
  mag = _mm512_min_epu32(_mm512_max_epu32(mag, lo_bits),
                         _mm512_set1_epi32(static_cast<int>(QuantizationMap::kFastMaxBits)));
  __m512i idx = _mm512_srli_epi32(_mm512_sub_epi32(mag, lo_bits), 16);
  idx = _mm512_mask_add_epi32(idx, _mm512_movepi32_mask(b), idx,
                              _mm512_set1_epi32(static_cast<int>(QuantizationMap::kFastSignStride)));
  const __m512i e = _mm512_i32gather_epi32(idx, table, 4);
  const __m512i low16 = _mm512_set1_epi32(0xFFFF);
  const __mmask16 above = _mm512_cmpge_epu32_mask(_mm512_and_si512(mag, low16), _mm512_and_si512(e, low16));
  __m512i c = _mm512_and_si512(_mm512_srli_epi32(e, 16), _mm512_set1_epi32(0xFF));
  c = _mm512_mask_mov_epi32(c, above, _mm512_srli_epi32(e, 24));
  c = _mm512_mask_mov_epi32(c, nan, _mm512_set1_epi32(zero));
  return _mm512_cvtepi32_epi8(c);
}

template <typename P, typename G, Rounding kParamRounding>
SHOESTRING_AVX512_TARGET void adamw8bit_blocks_avx512(const AdamW8bitArgs& a, int64_t b0, int64_t b1, float* mbuf,
                                                      float* vbuf) {
  P* p_ptr = static_cast<P*>(a.param);
  const G* g_ptr = static_cast<const G*>(a.grad);
  const __m512 grad_scale = _mm512_set1_ps(a.grad_scale), decay = _mm512_set1_ps(a.decay),
               beta1 = _mm512_set1_ps(a.beta1), one_minus_beta1 = _mm512_set1_ps(a.one_minus_beta1),
               beta2 = _mm512_set1_ps(a.beta2), one_minus_beta2 = _mm512_set1_ps(a.one_minus_beta2),
               bc2_sqrt = _mm512_set1_ps(a.bias_correction2_sqrt), eps = _mm512_set1_ps(a.eps),
               neg_step_size = _mm512_set1_ps(a.neg_step_size);
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * a.block_size;
    const int64_t len = std::min(a.block_size, a.n - start);
    const float m_absmax = a.exp_avg_absmax[b], v_absmax = a.exp_avg_sq_absmax[b];
    const __m512 m_scale = _mm512_set1_ps(m_absmax), v_scale = _mm512_set1_ps(v_absmax);
    __m512 m_max16 = _mm512_setzero_ps(), v_max16 = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= len; k += 16) {
      const int64_t i = start + k;
      const __m512i mc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.exp_avg_q + i)));
      const __m512i vc = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.exp_avg_sq_q + i)));
      __m512 m = _mm512_mul_ps(lookup256(a.m_values, mc), m_scale);
      __m512 v = _mm512_mul_ps(lookup256(a.v_values, vc), v_scale);
      const __m512 g = _mm512_mul_ps(load16(g_ptr + i), grad_scale);
      const __m512 p1 = _mm512_mul_ps(load16(p_ptr + i), decay);
      const __m512 m1 = _mm512_fmadd_ps(g, one_minus_beta1, _mm512_mul_ps(m, beta1));
      const __m512 v1 = _mm512_add_ps(_mm512_mul_ps(v, beta2), _mm512_mul_ps(_mm512_mul_ps(one_minus_beta2, g), g));
      const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v1), bc2_sqrt), eps);
      const __m512 p2 = _mm512_add_ps(p1, _mm512_div_ps(_mm512_mul_ps(neg_step_size, m1), denom));
      const __mmask16 ok = finite16(g) & finite16(m1) & finite16(v1) & finite16(p2);
      m = _mm512_mask_mov_ps(m, ok, m1);
      v = _mm512_mask_mov_ps(v, ok, v1);
      _mm512_storeu_ps(mbuf + k, m);
      _mm512_storeu_ps(vbuf + k, v);
      m_max16 = _mm512_max_ps(m_max16, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(m), abs_mask)));
      v_max16 = _mm512_max_ps(v_max16, _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), abs_mask)));
      store16<kParamRounding>(p_ptr, i, p2, ok, a.param_key);
    }
    float m_max = _mm512_reduce_max_ps(m_max16), v_max = _mm512_reduce_max_ps(v_max16);
    adamw8bit_update_scalar<P, G, kParamRounding>(a, start, k, len, m_absmax, v_absmax, mbuf, vbuf, m_max, v_max);
    a.exp_avg_absmax[b] = m_max;
    a.exp_avg_sq_absmax[b] = v_max;
    // Both encodes in one loop: two independent gathers in flight.
    const float m_inv = 1.0f / m_max, v_inv = 1.0f / v_max;
    const __m512 m_inv16 = _mm512_set1_ps(m_inv), v_inv16 = _mm512_set1_ps(v_inv);
    uint8_t* mq = a.exp_avg_q + start;
    uint8_t* vq = a.exp_avg_sq_q + start;
    int64_t e = 0;
    for (; e + 16 <= len; e += 16) {
      const __m128i mc = encode16(_mm512_mul_ps(_mm512_loadu_ps(mbuf + e), m_inv16), a.m_table, a.m_zero);
      const __m128i vc = encode16(_mm512_mul_ps(_mm512_loadu_ps(vbuf + e), v_inv16), a.v_table, a.v_zero);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(mq + e), mc);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(vq + e), vc);
    }
    encode_scalar(mbuf, e, len, m_inv, a.m_table, a.m_zero, mq);
    encode_scalar(vbuf, e, len, v_inv, a.v_table, a.v_zero, vq);
  }
}

bool cpu_has_avx512() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return yes;
}
#endif

std::atomic<bool> g_force_portable{false};

using AdamW8bitBlocksFn = void (*)(const AdamW8bitArgs&, int64_t, int64_t, float*, float*);

#define SHOESTRING_A8_VARIANT(NAME, P, G, R)                                                           \
  SHOESTRING_FUSED_TARGET_CLONES void NAME(const AdamW8bitArgs& a, int64_t b0, int64_t b1, float* m, float* v) { \
    adamw8bit_blocks<P, G, R>(a, b0, b1, m, v);                                                            \
  }
SHOESTRING_A8_VARIANT(adamw8bit_f32_f32, float, float, Rounding::nearest)
SHOESTRING_A8_VARIANT(adamw8bit_f32_b16, float, bf16_bits, Rounding::nearest)
SHOESTRING_A8_VARIANT(adamw8bit_sr_f32, bf16_bits, float, Rounding::stochastic)
SHOESTRING_A8_VARIANT(adamw8bit_sr_b16, bf16_bits, bf16_bits, Rounding::stochastic)
SHOESTRING_A8_VARIANT(adamw8bit_rn_f32, bf16_bits, float, Rounding::nearest)
SHOESTRING_A8_VARIANT(adamw8bit_rn_b16, bf16_bits, bf16_bits, Rounding::nearest)
#undef SHOESTRING_A8_VARIANT

// Index: param kind (0 fp32, 1 bf16 SR, 2 bf16 nearest) * 2 + grad bf16.
constexpr AdamW8bitBlocksFn kAdamW8bit[6] = {adamw8bit_f32_f32, adamw8bit_f32_b16, adamw8bit_sr_f32,
                                             adamw8bit_sr_b16,  adamw8bit_rn_f32,  adamw8bit_rn_b16};
#ifdef SHOESTRING_FUSED_AVX512
constexpr AdamW8bitBlocksFn kAdamW8bitAvx512[6] = {
    adamw8bit_blocks_avx512<float, float, Rounding::nearest>,
    adamw8bit_blocks_avx512<float, bf16_bits, Rounding::nearest>,
    adamw8bit_blocks_avx512<bf16_bits, float, Rounding::stochastic>,
    adamw8bit_blocks_avx512<bf16_bits, bf16_bits, Rounding::stochastic>,
    adamw8bit_blocks_avx512<bf16_bits, float, Rounding::nearest>,
    adamw8bit_blocks_avx512<bf16_bits, bf16_bits, Rounding::nearest>};
#endif

// ---- Adafactor (factored) ----------------------------------------------------

// Lanes of the fp32 partial sums: independent accumulators, so the compiler
// may keep them in one vector register without reassociating anything.
constexpr int kLanes = 16;
// Terms per lane before a flush into double.
constexpr int64_t kFlushTerms = 64;

struct AdafactorSumArgs {
  const void* grad;
  int64_t n, m;
  float eps1;
  const float* r_factor;  // pass 2 only
  const float* c_factor;
};

// Rows [r0, r1): pass 1 (kSecond = false: g^2 + eps1, row sums and column
// partials) or pass 2 (true: ((r c) g)^2, total only).
template <typename G, bool kSecond>
SHOESTRING_ALWAYS_INLINE double adafactor_rows(const AdafactorSumArgs& a, int64_t r0, int64_t r1,
                                               double* __restrict row_sum, double* __restrict col_sum,
                                               float* __restrict col_part) {
  const G* __restrict g_ptr = static_cast<const G*>(a.grad);
  const float* __restrict c_factor = a.c_factor;
  const int64_t m = a.m;
  double total = 0.0;
  int64_t rows_in_part = 0;
  if (!kSecond) {
    for (int64_t j = 0; j < m; ++j) col_part[j] = 0.0f;
  }
  for (int64_t i = r0; i < r1; ++i) {
    const G* __restrict row = g_ptr + i * m;
    const float r = kSecond ? a.r_factor[i] : 0.0f;
    double row_total = 0.0;
    int64_t j = 0;
    while (j < m) {
      const int64_t chunk_end = std::min(m, j + kLanes * kFlushTerms);
      float lane[kLanes] = {};
      for (; j + kLanes <= chunk_end; j += kLanes) {
        for (int k = 0; k < kLanes; ++k) {
          const float g = load(row, j + k);
          float x;
          if (kSecond) {
            const float u = (r * c_factor[j + k]) * g;
            x = u * u;
          } else {
            x = g * g + a.eps1;
            col_part[j + k] += x;
          }
          lane[k] += x;
        }
      }
      double part = 0.0;
      for (int k = 0; k < kLanes; ++k) part += lane[k];
      for (; j < chunk_end; ++j) {  // last < kLanes elements of the row
        const float g = load(row, j);
        float x;
        if (kSecond) {
          const float u = (r * c_factor[j]) * g;
          x = u * u;
        } else {
          x = g * g + a.eps1;
          col_part[j] += x;
        }
        part += x;
      }
      row_total += part;
    }
    if (!kSecond) {
      row_sum[i] = row_total;
      if (++rows_in_part == kFlushTerms || i + 1 == r1) {
        for (int64_t c = 0; c < m; ++c) {
          col_sum[c] += col_part[c];
          col_part[c] = 0.0f;
        }
        rows_in_part = 0;
      }
    }
    total += row_total;
  }
  return total;
}

using AdafactorRowsFn = double (*)(const AdafactorSumArgs&, int64_t, int64_t, double*, double*, float*);
SHOESTRING_FUSED_TARGET_CLONES double adafactor_sums_f32(const AdafactorSumArgs& a, int64_t r0, int64_t r1,
                                                         double* rs, double* cs, float* cp) {
  return adafactor_rows<float, false>(a, r0, r1, rs, cs, cp);
}
SHOESTRING_FUSED_TARGET_CLONES double adafactor_sums_b16(const AdafactorSumArgs& a, int64_t r0, int64_t r1,
                                                         double* rs, double* cs, float* cp) {
  return adafactor_rows<bf16_bits, false>(a, r0, r1, rs, cs, cp);
}
SHOESTRING_FUSED_TARGET_CLONES double adafactor_sq_f32(const AdafactorSumArgs& a, int64_t r0, int64_t r1,
                                                       double* rs, double* cs, float* cp) {
  return adafactor_rows<float, true>(a, r0, r1, rs, cs, cp);
}
SHOESTRING_FUSED_TARGET_CLONES double adafactor_sq_b16(const AdafactorSumArgs& a, int64_t r0, int64_t r1,
                                                       double* rs, double* cs, float* cp) {
  return adafactor_rows<bf16_bits, true>(a, r0, r1, rs, cs, cp);
}

struct AdafactorApplyArgs {
  void* param;
  const void* grad;
  int64_t m;
  const float* r_factor;
  const float* c_factor;
  float clip, step_size, decay_alpha;
  bool decay;
  uint64_t param_key;
};

template <typename P, typename G, Rounding kParamRounding>
SHOESTRING_ALWAYS_INLINE void adafactor_apply_rows(const AdafactorApplyArgs& a, int64_t r0, int64_t r1) {
  P* __restrict p_ptr = static_cast<P*>(a.param);
  const G* __restrict g_ptr = static_cast<const G*>(a.grad);
  const int64_t m = a.m;
  for (int64_t i = r0; i < r1; ++i) {
    const float r = a.r_factor[i];
    const int64_t base = i * m;
    for (int64_t j = 0; j < m; ++j) {
      const int64_t e = base + j;
      const float u = (((r * a.c_factor[j]) * load(g_ptr, e)) / a.clip) * a.step_size;
      float p = load(p_ptr, e);
      const float p1 = fma_f32(p, a.decay_alpha, p);
      p = a.decay ? p1 : p;
      store(p_ptr, e, p - u, a.param_key, kParamRounding);
    }
  }
}

using AdafactorApplyFn = void (*)(const AdafactorApplyArgs&, int64_t, int64_t);
#define SHOESTRING_AF_VARIANT(NAME, P, G, R) \
  SHOESTRING_FUSED_TARGET_CLONES void NAME(const AdafactorApplyArgs& a, int64_t r0, int64_t r1) { \
    adafactor_apply_rows<P, G, R>(a, r0, r1);                                                      \
  }
SHOESTRING_AF_VARIANT(adafactor_apply_f32_f32, float, float, Rounding::nearest)
SHOESTRING_AF_VARIANT(adafactor_apply_f32_b16, float, bf16_bits, Rounding::nearest)
SHOESTRING_AF_VARIANT(adafactor_apply_sr_f32, bf16_bits, float, Rounding::stochastic)
SHOESTRING_AF_VARIANT(adafactor_apply_sr_b16, bf16_bits, bf16_bits, Rounding::stochastic)
SHOESTRING_AF_VARIANT(adafactor_apply_rn_f32, bf16_bits, float, Rounding::nearest)
SHOESTRING_AF_VARIANT(adafactor_apply_rn_b16, bf16_bits, bf16_bits, Rounding::nearest)
#undef SHOESTRING_AF_VARIANT
constexpr AdafactorApplyFn kAdafactorApply[6] = {adafactor_apply_f32_f32, adafactor_apply_f32_b16,
                                                 adafactor_apply_sr_f32,  adafactor_apply_sr_b16,
                                                 adafactor_apply_rn_f32,  adafactor_apply_rn_b16};

// Rows per parallel task: about kGrainSize elements.
int64_t row_grain(int64_t m) { return std::max<int64_t>(1, kGrainSize / std::max<int64_t>(m, 1)); }

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

namespace {
std::string adamw8bit_reason(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& mq,
                             const at::Tensor& m_absmax, const at::Tensor& vq, const at::Tensor& v_absmax,
                             int64_t block_size) {
  std::string why = first_reason({{&param, "param"}, {&grad, "grad"}});
  if (!why.empty()) return why;
  if (block_size < 1) return fmt::format("block_size must be >= 1, got {}", block_size);
  const int64_t n = param.numel();
  const int64_t blocks = (n + block_size - 1) / block_size;
  for (const auto& [t, name, dtype, numel] :
       {std::make_tuple(&mq, "exp_avg_q", at::kByte, n), std::make_tuple(&m_absmax, "exp_avg_absmax", at::kFloat, blocks),
        std::make_tuple(&vq, "exp_avg_sq_q", at::kByte, n),
        std::make_tuple(&v_absmax, "exp_avg_sq_absmax", at::kFloat, blocks)}) {
    if (!t->defined() || !t->device().is_cpu() || t->layout() != at::kStrided || t->scalar_type() != dtype ||
        !t->is_contiguous() || t->numel() != numel) {
      return fmt::format("{} must be a contiguous CPU {} tensor of {} elements", name, c10::toString(dtype), numel);
    }
  }
  if (signed_dynamic_map().fast_table() == nullptr || unsigned_dynamic_map().fast_table() == nullptr) {
    return "the dynamic maps have no one-load encode table";
  }
  return {};
}
}  // namespace

bool fused_adamw8bit_supported(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg_q,
                               const at::Tensor& exp_avg_absmax, const at::Tensor& exp_avg_sq_q,
                               const at::Tensor& exp_avg_sq_absmax, int64_t block_size) {
  return adamw8bit_reason(param, grad, exp_avg_q, exp_avg_absmax, exp_avg_sq_q, exp_avg_sq_absmax, block_size)
      .empty();
}

void fused_adamw8bit_step(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg_q,
                          at::Tensor& exp_avg_absmax, at::Tensor& exp_avg_sq_q, at::Tensor& exp_avg_sq_absmax,
                          int64_t block_size, const FusedAdamWScalars& s, const FusedRoundingKeys& keys) {
  const std::string why =
      adamw8bit_reason(param, grad, exp_avg_q, exp_avg_absmax, exp_avg_sq_q, exp_avg_sq_absmax, block_size);
  if (!why.empty()) fail("fused_adamw8bit_step: {}", why);
  if (s.step < 1) fail("fused_adamw8bit_step: step must be >= 1 (1-based), got {}", s.step);
  const int64_t n = param.numel();
  if (n == 0) return;
  const QuantizationMap& smap = signed_dynamic_map();
  const QuantizationMap& umap = unsigned_dynamic_map();
  AdamW8bitArgs a;
  static_cast<AdamConstants&>(a) = adam_constants(s);
  a.param = param.data_ptr();
  a.grad = grad.data_ptr();
  a.exp_avg_q = exp_avg_q.data_ptr<uint8_t>();
  a.exp_avg_absmax = exp_avg_absmax.data_ptr<float>();
  a.exp_avg_sq_q = exp_avg_sq_q.data_ptr<uint8_t>();
  a.exp_avg_sq_absmax = exp_avg_sq_absmax.data_ptr<float>();
  a.n = n;
  a.block_size = block_size;
  a.m_values = smap.values().data();
  a.v_values = umap.values().data();
  a.m_table = smap.fast_table();
  a.v_table = umap.fast_table();
  a.m_zero = smap.zero_code();
  a.v_zero = umap.zero_code();
  a.param_key = stream_key(keys.param);
  const int kind = param.scalar_type() == at::kFloat ? 0 : (keys.stochastic_rounding ? 1 : 2);
  const int variant = kind * 2 + (grad.scalar_type() == at::kBFloat16 ? 1 : 0);
  AdamW8bitBlocksFn fn = kAdamW8bit[variant];
#ifdef SHOESTRING_FUSED_AVX512
  if (cpu_has_avx512() && !g_force_portable.load(std::memory_order_relaxed)) fn = kAdamW8bitAvx512[variant];
#endif
  const int64_t blocks = (n + block_size - 1) / block_size;
  // ~16K elements per task at least; each task keeps one block of fp32 moments.
  const int64_t grain = std::max<int64_t>(1, kGrainSize / block_size);
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> m(static_cast<size_t>(block_size)), v(static_cast<size_t>(block_size));
    fn(a, begin, end, m.data(), v.data());
  });
  bump_version(param);
  bump_version(exp_avg_q);
  bump_version(exp_avg_absmax);
  bump_version(exp_avg_sq_q);
  bump_version(exp_avg_sq_absmax);
}

namespace {
// Splits rows [0, n) into tasks whose boundaries do not depend on the thread
// count (fixed chunks of row_grain(m) rows), so sums are reproducible.
template <typename F>
void for_fixed_row_chunks(int64_t n, int64_t m, const F& f) {
  const int64_t rows = row_grain(m);
  const int64_t chunks = (n + rows - 1) / rows;
  if (chunks == 1) {
    f(0, 0, n);
    return;
  }
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) f(c, c * rows, std::min(n, (c + 1) * rows));
  });
}
}  // namespace

void fused_adafactor_factored_step(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg_sq_row,
                                   at::Tensor& exp_avg_sq_col, int64_t n, int64_t m,
                                   const FusedAdafactorScalars& s, const FusedRoundingKeys& keys) {
  const char* what = "fused_adafactor_factored_step";
  if (n < 1 || m < 1) fail("{}: matrix shape [{}, {}] must be positive", what, n, m);
  const std::string why = first_reason({{&param, "param"}, {&grad, "grad"}});
  if (!why.empty()) fail("{}: {}", what, why);
  if (param.numel() != n * m) fail("{}: param has {} elements, expected {} x {}", what, param.numel(), n, m);
  for (const auto& [t, name, len] : {std::make_tuple(&exp_avg_sq_row, "exp_avg_sq_row", n),
                                     std::make_tuple(&exp_avg_sq_col, "exp_avg_sq_col", m)}) {
    if (!t->defined() || !t->device().is_cpu() || t->layout() != at::kStrided || t->scalar_type() != at::kFloat ||
        !t->is_contiguous() || t->numel() != len) {
      fail("{}: {} must be a contiguous CPU float32 tensor of {} elements", what, name, len);
    }
  }
  const bool g_bf16 = grad.scalar_type() == at::kBFloat16;
  const int64_t rows = row_grain(m);
  const int64_t chunks = (n + rows - 1) / rows;

  // Pass 1: row sums and per-chunk column sums (added in chunk order).
  std::vector<double> row_sum(static_cast<size_t>(n));
  std::vector<double> col_chunks(static_cast<size_t>(chunks * m), 0.0);
  AdafactorSumArgs sa{grad.data_ptr(), n, m, static_cast<float>(s.eps1), nullptr, nullptr};
  const AdafactorRowsFn sums = g_bf16 ? adafactor_sums_b16 : adafactor_sums_f32;
  for_fixed_row_chunks(n, m, [&](int64_t c, int64_t r0, int64_t r1) {
    std::vector<float> part(static_cast<size_t>(m));
    sums(sa, r0, r1, row_sum.data(), col_chunks.data() + c * m, part.data());
  });

  // Second-moment factors (n + m numbers).
  const auto beta2t = static_cast<float>(s.beta2t);
  const auto one_minus_beta2t = static_cast<float>(1.0 - s.beta2t);
  float* row = exp_avg_sq_row.data_ptr<float>();
  float* col = exp_avg_sq_col.data_ptr<float>();
  double row_total = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const auto mean = static_cast<float>(row_sum[static_cast<size_t>(i)] / static_cast<double>(m));
    row[i] = fma_f32(mean, one_minus_beta2t, row[i] * beta2t);
    row_total += row[i];
  }
  for (int64_t j = 0; j < m; ++j) {
    double sum = 0.0;
    for (int64_t c = 0; c < chunks; ++c) sum += col_chunks[static_cast<size_t>(c * m + j)];
    const auto mean = static_cast<float>(sum / static_cast<double>(n));
    col[j] = fma_f32(mean, one_minus_beta2t, col[j] * beta2t);
  }
  const auto row_mean = static_cast<float>(row_total / static_cast<double>(n));
  std::vector<float> r_factor(static_cast<size_t>(n)), c_factor(static_cast<size_t>(m));
  for (int64_t i = 0; i < n; ++i) r_factor[static_cast<size_t>(i)] = 1.0f / sqrt_f32(row[i] / row_mean);
  for (int64_t j = 0; j < m; ++j) c_factor[static_cast<size_t>(j)] = 1.0f / sqrt_f32(col[j]);

  // Pass 2: sum of squares of the unclipped update.
  sa.r_factor = r_factor.data();
  sa.c_factor = c_factor.data();
  const AdafactorRowsFn squares = g_bf16 ? adafactor_sq_b16 : adafactor_sq_f32;
  std::vector<double> chunk_sums(static_cast<size_t>(chunks), 0.0);
  for_fixed_row_chunks(n, m, [&](int64_t c, int64_t r0, int64_t r1) {
    chunk_sums[static_cast<size_t>(c)] = squares(sa, r0, r1, nullptr, nullptr, nullptr);
  });
  double sum_sq = 0.0;
  for (double x : chunk_sums) sum_sq += x;
  const double rms_u = std::sqrt(sum_sq / static_cast<double>(n * m));
  const double clip = std::max(1.0, rms_u / s.clip_threshold);

  // Pass 3: the weights.
  AdafactorApplyArgs a;
  a.param = param.data_ptr();
  a.grad = grad.data_ptr();
  a.m = m;
  a.r_factor = r_factor.data();
  a.c_factor = c_factor.data();
  a.clip = static_cast<float>(clip);
  a.step_size = static_cast<float>(s.step_size);
  a.decay_alpha = static_cast<float>(-s.weight_decay * s.step_size);
  a.decay = s.weight_decay != 0.0;
  a.param_key = stream_key(keys.param);
  const int kind = param.scalar_type() == at::kFloat ? 0 : (keys.stochastic_rounding ? 1 : 2);
  const AdafactorApplyFn apply = kAdafactorApply[kind * 2 + (g_bf16 ? 1 : 0)];
  for_fixed_row_chunks(n, m, [&](int64_t, int64_t r0, int64_t r1) { apply(a, r0, r1); });
  bump_version(param);
  bump_version(exp_avg_sq_row);
  bump_version(exp_avg_sq_col);
}

void fused_kernels_force_portable(bool portable) { g_force_portable.store(portable, std::memory_order_relaxed); }

}  // namespace shoestring
