// The fused AdamW8bit step (optim/fused_kernels.h): blockwise-quantized
// state decoded, updated and re-encoded in one pass; AVX-512, AVX2 and
// portable kernels with the same bits.
#include "shoestring/optim/fused_kernel_support.h"

namespace shoestring {
namespace {

// ---- AdamW8bit ---------------------------------------------------------------

struct AdamW8bitArgs : AdamConstants {
  void* param;
  const void* grad;
  uint8_t* exp_avg_q;
  float* exp_avg_absmax;
  uint8_t* exp_avg_sq_q;
  float* exp_avg_sq_absmax;
  int64_t n, block_size;
  const float* m_values;    // signed dynamic map, 256 values
  const float* v_values;    // unsigned dynamic map
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
SHOESTRING_ALWAYS_INLINE void adamw8bit_element(const AdamW8bitArgs& a, int64_t i, float& m, float& v,
                                                uint32_t random16) {
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
    store(p_ptr, i, p2, random16, kParamRounding);
  }
}

// Whether the parameter stores round stochastically (and so need words).
template <typename P, Rounding kParamRounding>
constexpr bool kParamWords = std::is_same_v<P, bf16_bits>&& kParamRounding == Rounding::stochastic;

// The parameter's random words for the block of `len` elements at `start`
// (into `storage`, block_size + 8 entries). When none are needed, `storage`
// itself, unfilled and never read (a valid pointer, so words + k is too).
template <typename P, Rounding kParamRounding>
SHOESTRING_ALWAYS_INLINE const uint16_t* param_words(const AdamW8bitArgs& a, int64_t start, int64_t len,
                                                     uint16_t* storage) {
  if constexpr (kParamWords<P, kParamRounding>) {
    return counter_random16_fill(a.param_key, static_cast<uint64_t>(start), len, storage);
  } else {
    return storage;
  }
}

// Elements [k0, len) of the block starting at `start`: decode, update, keep
// the new moments in mbuf / vbuf, raise the running absmaxes. `words`: the
// block's parameter words (param_words).
template <typename P, typename G, Rounding kParamRounding>
SHOESTRING_ALWAYS_INLINE void adamw8bit_update_scalar(const AdamW8bitArgs& a, int64_t start, int64_t k0, int64_t len,
                                                      float m_absmax, float v_absmax, float* mbuf, float* vbuf,
                                                      const uint16_t* words, float& m_max, float& v_max) {
  for (int64_t k = k0; k < len; ++k) {
    const int64_t i = start + k;
    float m = a.m_values[a.exp_avg_q[i]] * m_absmax;
    float v = a.v_values[a.exp_avg_sq_q[i]] * v_absmax;
    uint32_t random16 = 0;
    if constexpr (kParamWords<P, kParamRounding>) random16 = words[k];
    adamw8bit_element<P, G, kParamRounding>(a, i, m, v, random16);
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
SHOESTRING_ALWAYS_INLINE void adamw8bit_blocks(const AdamW8bitArgs& a, int64_t b0, int64_t b1, float* mbuf, float* vbuf,
                                               uint16_t* wbuf) {
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * a.block_size;
    const int64_t len = std::min(a.block_size, a.n - start);
    float m_max = 0.0f, v_max = 0.0f;
    const uint16_t* words = param_words<P, kParamRounding>(a, start, len, wbuf);
    adamw8bit_update_scalar<P, G, kParamRounding>(a, start, 0, len, a.exp_avg_absmax[b], a.exp_avg_sq_absmax[b], mbuf,
                                                  vbuf, words, m_max, v_max);
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

SHOESTRING_AVX512_INLINE __mmask16 finite16(__m512 x) {
  const __m512i e = _mm512_set1_epi32(0x7F800000);
  return _mm512_cmpneq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(x), e), e);
}

// `words`: the 16 elements' random words (read only for stochastic rounding).
template <Rounding kParamRounding>
SHOESTRING_AVX512_INLINE void store16(float* p, int64_t i, __m512 x, __mmask16 ok, const uint16_t*) {
  _mm512_mask_storeu_ps(p + i, ok, x);
}
template <Rounding kParamRounding>
SHOESTRING_AVX512_INLINE void store16(bf16_bits* p, int64_t i, __m512 x, __mmask16 ok, const uint16_t* words) {
  // Only finite values are stored (ok), so no NaN case.
  const __m512i b = _mm512_castps_si512(x);
  __m512i r;
  if (kParamRounding == Rounding::stochastic) {
    r = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(words)));
  } else {
    r = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7FFF));
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
                                                      float* vbuf, uint16_t* wbuf) {
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
    const uint16_t* words = param_words<P, kParamRounding>(a, start, len, wbuf);
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
      store16<kParamRounding>(p_ptr, i, p2, ok, words + k);
    }
    float m_max = _mm512_reduce_max_ps(m_max16), v_max = _mm512_reduce_max_ps(v_max16);
    adamw8bit_update_scalar<P, G, kParamRounding>(a, start, k, len, m_absmax, v_absmax, mbuf, vbuf, words, m_max,
                                                  v_max);
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

// AVX2 + FMA kernel: the same operations 8 lanes at a time (decode and
// encode through gathers), for CPUs without AVX-512. Lanes whose update is not
// finite keep their old values by blending with what was loaded (the same
// bits a skipped store leaves), so every store is a plain one.
#define SHOESTRING_AVX2_TARGET __attribute__((target("avx2,fma")))
#define SHOESTRING_AVX2_INLINE SHOESTRING_AVX2_TARGET SHOESTRING_ALWAYS_INLINE

SHOESTRING_AVX2_INLINE __m256i load_bits8(const float* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
SHOESTRING_AVX2_INLINE __m256i load_bits8(const bf16_bits* p) {
  return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
SHOESTRING_AVX2_INLINE __m256 as_float8(const __m256i& bits, const float*) { return _mm256_castsi256_ps(bits); }
SHOESTRING_AVX2_INLINE __m256 as_float8(const __m256i& bits, const bf16_bits*) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
}
template <typename T>
SHOESTRING_AVX2_INLINE __m256 load8(const T* p) {
  return as_float8(load_bits8(p), p);
}

// All-ones lanes where x is not finite (exponent all ones).
SHOESTRING_AVX2_INLINE __m256i not_finite8(__m256 x) {
  const __m256i e = _mm256_set1_epi32(0x7F800000);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(x), e), e);
}

// Low 16 bits of eight int32 lanes (each < 2^16) as eight uint16.
SHOESTRING_AVX2_INLINE __m128i narrow16(__m256i x) {
  const __m256i packed = _mm256_packus_epi32(x, x);  // per 128-bit lane: x0..3 x0..3 | x4..7 x4..7
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

// x where ok, else the old bits: fp32 as is, bf16 rounded by kParamRounding
// with the lanes' random words (stochastic) or to nearest even.
template <Rounding kParamRounding>
SHOESTRING_AVX2_INLINE void store8(float* p, int64_t i, __m256 x, __m256i ok, __m256i old_bits, const uint16_t*) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + i), _mm256_blendv_epi8(old_bits, _mm256_castps_si256(x), ok));
}
template <Rounding kParamRounding>
SHOESTRING_AVX2_INLINE void store8(bf16_bits* p, int64_t i, __m256 x, __m256i ok, __m256i old_bits,
                                   const uint16_t* words) {
  // Only finite values are kept (ok), so no NaN case.
  const __m256i b = _mm256_castps_si256(x);
  __m256i r;
  if (kParamRounding == Rounding::stochastic) {
    r = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(words)));
  } else {
    r = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7FFF));
  }
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(b, r), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + i), narrow16(_mm256_blendv_epi8(old_bits, rounded, ok)));
}

// QuantizationMap::encode_with_table for 8 lanes, as 8 bytes.
SHOESTRING_AVX2_INLINE uint64_t encode8(__m256 x, const uint32_t* table, uint8_t zero) {
  const __m256i b = _mm256_castps_si256(x);
  __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF));
  const __m256i nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7F800000));  // mag < 2^31: signed is fine
  const __m256i lo_bits = _mm256_set1_epi32(static_cast<int>(QuantizationMap::kFastMinBits));
  mag = _mm256_min_epu32(_mm256_max_epu32(mag, lo_bits),
                         _mm256_set1_epi32(static_cast<int>(QuantizationMap::kFastMaxBits)));
  __m256i idx = _mm256_srli_epi32(_mm256_sub_epi32(mag, lo_bits), 16);
  idx = _mm256_add_epi32(idx, _mm256_and_si256(_mm256_srai_epi32(b, 31),
                                               _mm256_set1_epi32(static_cast<int>(QuantizationMap::kFastSignStride))));
  const __m256i e = _mm256_i32gather_epi32(reinterpret_cast<const int*>(table), idx, 4);
  const __m256i low16 = _mm256_set1_epi32(0xFFFF);
  // (mag & 0xFFFF) >= (e & 0xFFFF): both below 2^16, so a signed compare.
  const __m256i below = _mm256_cmpgt_epi32(_mm256_and_si256(e, low16), _mm256_and_si256(mag, low16));
  __m256i c = _mm256_blendv_epi8(_mm256_srli_epi32(e, 24),
                                 _mm256_and_si256(_mm256_srli_epi32(e, 16), _mm256_set1_epi32(0xFF)), below);
  c = _mm256_blendv_epi8(c, _mm256_set1_epi32(zero), nan);
  const __m128i c16 = narrow16(c);
  const __m128i c8 = _mm_packus_epi16(c16, c16);
  return static_cast<uint64_t>(_mm_cvtsi128_si64(c8));
}

template <typename P, typename G, Rounding kParamRounding>
SHOESTRING_AVX2_TARGET void adamw8bit_blocks_avx2(const AdamW8bitArgs& a, int64_t b0, int64_t b1, float* mbuf,
                                                  float* vbuf, uint16_t* wbuf) {
  P* p_ptr = static_cast<P*>(a.param);
  const G* g_ptr = static_cast<const G*>(a.grad);
  const __m256 grad_scale = _mm256_set1_ps(a.grad_scale), decay = _mm256_set1_ps(a.decay),
               beta1 = _mm256_set1_ps(a.beta1), one_minus_beta1 = _mm256_set1_ps(a.one_minus_beta1),
               beta2 = _mm256_set1_ps(a.beta2), one_minus_beta2 = _mm256_set1_ps(a.one_minus_beta2),
               bc2_sqrt = _mm256_set1_ps(a.bias_correction2_sqrt), eps = _mm256_set1_ps(a.eps),
               neg_step_size = _mm256_set1_ps(a.neg_step_size);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  // Locals, not a.*: the byte stores below may alias any object as far as
  // the compiler knows, which would reload every field in every iteration.
  const float* const m_values = a.m_values;
  const float* const v_values = a.v_values;
  const uint32_t* const m_table = a.m_table;
  const uint32_t* const v_table = a.v_table;
  const uint8_t m_zero = a.m_zero, v_zero = a.v_zero;
  uint8_t* const exp_avg_q = a.exp_avg_q;
  uint8_t* const exp_avg_sq_q = a.exp_avg_sq_q;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t start = b * a.block_size;
    const int64_t len = std::min(a.block_size, a.n - start);
    const float m_absmax = a.exp_avg_absmax[b], v_absmax = a.exp_avg_sq_absmax[b];
    const __m256 m_scale = _mm256_set1_ps(m_absmax), v_scale = _mm256_set1_ps(v_absmax);
    __m256 m_max8 = _mm256_setzero_ps(), v_max8 = _mm256_setzero_ps();
    const uint16_t* words = param_words<P, kParamRounding>(a, start, len, wbuf);
    int64_t k = 0;
    for (; k + 8 <= len; k += 8) {
      const int64_t i = start + k;
      const __m256i mc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(exp_avg_q + i)));
      const __m256i vc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(exp_avg_sq_q + i)));
      __m256 m = _mm256_mul_ps(_mm256_i32gather_ps(m_values, mc, 4), m_scale);
      __m256 v = _mm256_mul_ps(_mm256_i32gather_ps(v_values, vc, 4), v_scale);
      const __m256 g = _mm256_mul_ps(load8(g_ptr + i), grad_scale);
      const __m256i p_bits = load_bits8(p_ptr + i);
      const __m256 p1 = _mm256_mul_ps(as_float8(p_bits, p_ptr), decay);
      const __m256 m1 = _mm256_fmadd_ps(g, one_minus_beta1, _mm256_mul_ps(m, beta1));
      const __m256 v1 = _mm256_add_ps(_mm256_mul_ps(v, beta2), _mm256_mul_ps(_mm256_mul_ps(one_minus_beta2, g), g));
      const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v1), bc2_sqrt), eps);
      const __m256 p2 = _mm256_add_ps(p1, _mm256_div_ps(_mm256_mul_ps(neg_step_size, m1), denom));
      const __m256i bad = _mm256_or_si256(_mm256_or_si256(not_finite8(g), not_finite8(m1)),
                                          _mm256_or_si256(not_finite8(v1), not_finite8(p2)));
      const __m256i ok = _mm256_xor_si256(bad, _mm256_set1_epi32(-1));
      m = _mm256_blendv_ps(m, m1, _mm256_castsi256_ps(ok));
      v = _mm256_blendv_ps(v, v1, _mm256_castsi256_ps(ok));
      _mm256_storeu_ps(mbuf + k, m);
      _mm256_storeu_ps(vbuf + k, v);
      m_max8 = _mm256_max_ps(m_max8, _mm256_and_ps(m, abs_mask));
      v_max8 = _mm256_max_ps(v_max8, _mm256_and_ps(v, abs_mask));
      store8<kParamRounding>(p_ptr, i, p2, ok, p_bits, words + k);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, m_max8);
    float m_max = 0.0f;
    for (float x : lanes) m_max = x > m_max ? x : m_max;
    _mm256_store_ps(lanes, v_max8);
    float v_max = 0.0f;
    for (float x : lanes) v_max = x > v_max ? x : v_max;
    adamw8bit_update_scalar<P, G, kParamRounding>(a, start, k, len, m_absmax, v_absmax, mbuf, vbuf, words, m_max,
                                                  v_max);
    a.exp_avg_absmax[b] = m_max;
    a.exp_avg_sq_absmax[b] = v_max;
    const float m_inv = 1.0f / m_max, v_inv = 1.0f / v_max;
    const __m256 m_inv8 = _mm256_set1_ps(m_inv), v_inv8 = _mm256_set1_ps(v_inv);
    uint8_t* mq = exp_avg_q + start;
    uint8_t* vq = exp_avg_sq_q + start;
    int64_t e = 0;
    for (; e + 8 <= len; e += 8) {
      const uint64_t mc = encode8(_mm256_mul_ps(_mm256_loadu_ps(mbuf + e), m_inv8), m_table, m_zero);
      const uint64_t vc = encode8(_mm256_mul_ps(_mm256_loadu_ps(vbuf + e), v_inv8), v_table, v_zero);
      std::memcpy(mq + e, &mc, sizeof mc);
      std::memcpy(vq + e, &vc, sizeof vc);
    }
    encode_scalar(mbuf, e, len, m_inv, m_table, m_zero, mq);
    encode_scalar(vbuf, e, len, v_inv, v_table, v_zero, vq);
  }
}

#endif

using AdamW8bitBlocksFn = void (*)(const AdamW8bitArgs&, int64_t, int64_t, float*, float*, uint16_t*);

#define SHOESTRING_A8_VARIANT(NAME, P, G, R)                                                                 \
  void NAME(const AdamW8bitArgs& a, int64_t b0, int64_t b1, float* m, float* v, uint16_t* w) { \
    adamw8bit_blocks<P, G, R>(a, b0, b1, m, v, w);                                                           \
  }
SHOESTRING_A8_VARIANT(adamw8bit_f32_f32, float, float, Rounding::nearest)
SHOESTRING_A8_VARIANT(adamw8bit_f32_b16, float, bf16_bits, Rounding::nearest)
SHOESTRING_A8_VARIANT(adamw8bit_sr_f32, bf16_bits, float, Rounding::stochastic)
SHOESTRING_A8_VARIANT(adamw8bit_sr_b16, bf16_bits, bf16_bits, Rounding::stochastic)
SHOESTRING_A8_VARIANT(adamw8bit_rn_f32, bf16_bits, float, Rounding::nearest)
SHOESTRING_A8_VARIANT(adamw8bit_rn_b16, bf16_bits, bf16_bits, Rounding::nearest)
#undef SHOESTRING_A8_VARIANT

// Index: param kind (0 fp32, 1 bf16 SR, 2 bf16 nearest) * 2 + grad bf16. The
// hand-written AVX-512 and AVX2 kernels, and the portable one (baseline
// x86-64: GCC does not vectorize its table look-ups anyway).
#ifdef SHOESTRING_FUSED_AVX512
#define SHOESTRING_A8_ISA(P, G, R, PORTABLE) \
  { adamw8bit_blocks_avx512<P, G, R>, adamw8bit_blocks_avx2<P, G, R>, PORTABLE }
#else
#define SHOESTRING_A8_ISA(P, G, R, PORTABLE) \
  { PORTABLE, PORTABLE, PORTABLE }
#endif
constexpr IsaKernels<AdamW8bitBlocksFn> kAdamW8bit[6] = {
    SHOESTRING_A8_ISA(float, float, Rounding::nearest, adamw8bit_f32_f32),
    SHOESTRING_A8_ISA(float, bf16_bits, Rounding::nearest, adamw8bit_f32_b16),
    SHOESTRING_A8_ISA(bf16_bits, float, Rounding::stochastic, adamw8bit_sr_f32),
    SHOESTRING_A8_ISA(bf16_bits, bf16_bits, Rounding::stochastic, adamw8bit_sr_b16),
    SHOESTRING_A8_ISA(bf16_bits, float, Rounding::nearest, adamw8bit_rn_f32),
    SHOESTRING_A8_ISA(bf16_bits, bf16_bits, Rounding::nearest, adamw8bit_rn_b16)};
#undef SHOESTRING_A8_ISA

}  // namespace

namespace {
std::string adamw8bit_reason(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& mq,
                             const at::Tensor& m_absmax, const at::Tensor& vq, const at::Tensor& v_absmax,
                             int64_t block_size) {
  std::string why = first_reason({{&param, "param"}, {&grad, "grad"}});
  if (!why.empty()) return why;
  if (block_size < 1) return fmt::format("block_size must be >= 1, got {}", block_size);
  const int64_t n = param.numel();
  const int64_t blocks = (n + block_size - 1) / block_size;
  for (const auto& [t, name, dtype, numel] : {std::make_tuple(&mq, "exp_avg_q", at::kByte, n),
                                              std::make_tuple(&m_absmax, "exp_avg_absmax", at::kFloat, blocks),
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
  return adamw8bit_reason(param, grad, exp_avg_q, exp_avg_absmax, exp_avg_sq_q, exp_avg_sq_absmax, block_size).empty();
}

void fused_adamw8bit_step_many(const std::vector<FusedAdamW8bitTensor>& tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const FusedAdamW8bitTensor& t = tensors[i];
    const std::string what = tensors.size() == 1
                                 ? std::string("fused_adamw8bit_step")
                                 : fmt::format("fused_adamw8bit_step (tensor {} of {})", i, tensors.size());
    const std::string why = adamw8bit_reason(t.param, t.grad, t.exp_avg_q, t.exp_avg_absmax, t.exp_avg_sq_q,
                                             t.exp_avg_sq_absmax, t.block_size);
    if (!why.empty()) fail("{}: {}", what, why);
    if (t.scalars.step < 1) fail("{}: step must be >= 1 (1-based), got {}", what, t.scalars.step);
  }
  const QuantizationMap& smap = signed_dynamic_map();
  const QuantizationMap& umap = unsigned_dynamic_map();
  struct Task {
    AdamW8bitArgs args;
    AdamW8bitBlocksFn fn;
  };
  std::vector<Task> tasks(tensors.size());
  int64_t max_block = 1;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const FusedAdamW8bitTensor& t = tensors[i];
    AdamW8bitArgs& a = tasks[i].args;
    static_cast<AdamConstants&>(a) = adam_constants(t.scalars);
    a.param = t.param.data_ptr();
    a.grad = t.grad.data_ptr();
    a.exp_avg_q = t.exp_avg_q.data_ptr<uint8_t>();
    a.exp_avg_absmax = t.exp_avg_absmax.data_ptr<float>();
    a.exp_avg_sq_q = t.exp_avg_sq_q.data_ptr<uint8_t>();
    a.exp_avg_sq_absmax = t.exp_avg_sq_absmax.data_ptr<float>();
    a.n = t.param.numel();
    a.block_size = t.block_size;
    a.m_values = smap.values().data();
    a.v_values = umap.values().data();
    a.m_table = smap.fast_table();
    a.v_table = umap.fast_table();
    a.m_zero = smap.zero_code();
    a.v_zero = umap.zero_code();
    a.param_key = stream_key(t.keys.param);
    const int kind = t.param.scalar_type() == at::kFloat ? 0 : (t.keys.stochastic_rounding ? 1 : 2);
    tasks[i].fn = kAdamW8bit[kind * 2 + (t.grad.scalar_type() == at::kBFloat16 ? 1 : 0)].get();
    max_block = std::max(max_block, t.block_size);
  }
  // Chunks of whole blocks, about kGrainSize elements each; every chunk
  // boundary is a block boundary, so the blocks' absmaxes are what one pass
  // over the tensor gives. A worker keeps one block of fp32 moments.
  const int64_t grain = std::max<int64_t>(1, kGrainSize / max_block);
  const ChunkPlan plan = plan_chunks(static_cast<int64_t>(tasks.size()), grain, [&](int64_t t) {
    const AdamW8bitArgs& a = tasks[static_cast<size_t>(t)].args;
    return (a.n + a.block_size - 1) / a.block_size;
  });
  // Work for run_chunks: an 8-bit element counts 3 (it costs about 10 AdamW
  // elements on one thread, but the bench's fused rows ran slower with
  // regions below ~85K elements, measured with 2, 3 and 8).
  int64_t total = 0;
  for (const Task& t : tasks) total += 3 * t.args.n;
  run_chunks(plan.chunks(), total, [&](ChunkQueue& queue) {
    std::vector<float> m(static_cast<size_t>(max_block)), v(static_cast<size_t>(max_block));
    std::vector<uint16_t> words(static_cast<size_t>(max_block) + 8);
    for (int64_t c; (c = queue.take()) >= 0;) {
      for (int64_t k = plan.chunk_begin[c]; k < plan.chunk_begin[c + 1]; ++k) {
        const Segment& s = plan.segments[static_cast<size_t>(k)];
        const Task& task = tasks[static_cast<size_t>(s.task)];
        task.fn(task.args, s.begin, s.end, m.data(), v.data(), words.data());
      }
    }
  });
  for (const FusedAdamW8bitTensor& t : tensors) {
    if (t.param.numel() == 0) continue;
    for (const at::Tensor* x : {&t.param, &t.exp_avg_q, &t.exp_avg_absmax, &t.exp_avg_sq_q, &t.exp_avg_sq_absmax}) {
      bump_version(*x);
    }
  }
}

void fused_adamw8bit_step(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg_q, at::Tensor& exp_avg_absmax,
                          at::Tensor& exp_avg_sq_q, at::Tensor& exp_avg_sq_absmax, int64_t block_size,
                          const FusedAdamWScalars& s, const FusedRoundingKeys& keys) {
  fused_adamw8bit_step_many(
      {FusedAdamW8bitTensor{param, grad, exp_avg_q, exp_avg_absmax, exp_avg_sq_q, exp_avg_sq_absmax, block_size, s,
                            keys}});
}

}  // namespace shoestring
