// Bit-level stochastic rounding kernels, fp32 -> bf16 and fp32 -> IEEE fp16.
// Header-only and free of libtorch so the same code runs in CPU loops
// (stochastic_rounding.cpp) and CUDA kernels (kernels/cuda/). Both rules read
// 16 random bits per element, counter_random16 (counter_rng.h). Written as
// straight-line integer code with selects only, so a loop over them
// vectorizes.
//
// Stochastic rounding (SR) of x to a grid rounds to one of the two grid values
// that bracket x, the upper one (in magnitude) with probability equal to the
// distance from the lower one divided by the spacing, so that E[SR(x)] = x.
// With a uniform random integer r the rule "add r below the kept bits, then
// truncate" produces exactly that distribution (Connolly, Higham & Mary,
// "Stochastically rounding floating-point arithmetic", SIAM J. Sci. Comput.
// 2021, mode 1). For bf16 this is the rule of torchastic's copy_stochastic_,
// kohya-ss's fused Adafactor and OneTrainer; llm.c draws the same distribution
// from a hash of the element position.
#pragma once
#include <cstdint>
#include <cstring>

#include "shoestring/core/counter_rng.h"

namespace shoestring {

/// SR of the fp32 bit pattern `bits` to bf16 bits, using the low 16 bits of
/// `random` (uniform in [0, 65536)). Operates on the magnitude bits, so it is
/// sign-symmetric: |x| rounds up with probability (bits & 0xFFFF) / 65536,
/// else truncates toward zero.
///  - bf16-exact values (low 16 bits zero), zeros and +-inf are unchanged.
///  - NaN stays NaN with its sign: the result is the truncated pattern with the
///    quiet bit set (as c10::BFloat16 does), never inf.
///  - |x| above the largest bf16 (0x7F7F, ~3.3895e38) rounds to inf with
///    probability low16/65536: inf takes the place of the next grid value
///    2^128 in the bit layout, which is the unbiased rule's behaviour there.
SHOESTRING_HOST_DEVICE inline uint16_t sr_bf16_from_fp32_bits(uint32_t bits, uint32_t random) {
  const uint32_t rounded = (bits + (random & 0xFFFFu)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x0040u;
  const bool is_nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  return static_cast<uint16_t>(is_nan ? quiet_nan : rounded);
}

/// SR of the fp32 bit pattern `bits` to IEEE 754 binary16 bits, using the
/// low 16 bits of `random` (uniform in [0, 65536)).
///  - Normal fp16 range (2^-14 <= |x| <= 65504): the 13 fp32 mantissa bits
///    below fp16's last bit are rounded with the low 13 bits of `random`
///    (exact probabilities); a carry moves into the exponent naturally and the
///    exponent is re-biased from 127 to 15.
///  - Subnormal fp16 range (|x| < 2^-14, spacing 2^-24, including fp32
///    subnormals): |x| / 2^-24 is formed as a fixed-point number with 16
///    fraction bits, floor(|x| * 2^40) (the exponent field is raised by 40 and
///    an int32 conversion truncates), and rounded with the 16 random bits. The
///    probabilities are exact for |x| >= 2^-17; below that the fraction is
///    truncated to 16 bits, an absolute bias under 2^-40 (~9.1e-13) toward
///    zero. Rounding up from just below 2^-14 gives the smallest normal,
///    0x0400.
///    (The int conversion replaces a per-element variable shift, which keeps
///    the loop vectorizable on baseline x86-64 / SSE2.)
///  - Overflow: the grid is extended by inf in the slot of 2^16 (its place in
///    the bit layout), the same rule that bf16 SR follows at FLT_MAX: for
///    65504 < |x| < 65536, |x| becomes inf with probability (|x| - 65504) / 32,
///    else 65504; |x| >= 65536 always becomes inf. (Round-to-nearest differs
///    only on (65504, 65520), where it always returns 65504.)
///  - Zeros keep their sign; +-inf stay +-inf; NaN becomes the quiet NaN
///    0x7E00 with the input's sign (as c10::Half does).
SHOESTRING_HOST_DEVICE inline uint16_t sr_fp16_from_fp32_bits(uint32_t bits, uint32_t random) {
  const uint32_t sign = (bits >> 16) & 0x8000u;
  const uint32_t a = bits & 0x7FFFFFFFu;
  // Normal path (meaningful for a >= 2^-14; wraps harmlessly below).
  uint32_t normal = ((a + (random & 0x1FFFu)) >> 13) - ((127u - 15u) << 10);
  normal = normal < 0x7C00u ? normal : 0x7C00u;
  // Subnormal path (a < 2^-14): v = |x| / 2^-24 in 10.16 fixed point, i.e.
  // floor(|x| * 2^40), which is < 2^26. The scaling adds 40 to the exponent
  // field (exact; no float op that could trap, so the loop stays branch-free)
  // and the int32 conversion truncates. fp32 subnormals (< 2^-126) give v = 0,
  // and so does every input outside the subnormal range (selected away).
  const bool is_subnormal = a < 0x38800000u;
  const uint32_t scaled_bits = (is_subnormal && a >= 0x00800000u) ? a + (40u << 23) : 0u;
  float scaled;
  std::memcpy(&scaled, &scaled_bits, sizeof scaled);
  const uint32_t v = static_cast<uint32_t>(static_cast<int32_t>(scaled));
  const uint32_t subnormal = (v + (random & 0xFFFFu)) >> 16;
  uint32_t mag = is_subnormal ? subnormal : normal;
  mag = a > 0x7F800000u ? 0x7E00u : mag;
  return static_cast<uint16_t>(sign | mag);
}

#if defined(__GNUC__)
#define SHOESTRING_RANDOM16_INLINE inline __attribute__((always_inline))
#else
#define SHOESTRING_RANDOM16_INLINE inline
#endif

// Put before a loop that reads a block's random words and writes a 16-bit
// tensor: tells GCC's vectorizer the two do not overlap. GCC 12 cannot prove
// it and gives up on the loop rather than check at run time. Clang checks at
// run time by itself; it gets nothing, since it rejects GCC's pragma
// (-Wunknown-pragmas) and its own `vectorize(assume_safety)` turns into an
// error (-Wpass-failed) when a sanitizer build cannot vectorize the loop.
#if defined(__clang__)
#define SHOESTRING_LOOP_NO_ALIAS
#elif defined(__GNUC__)
#define SHOESTRING_LOOP_NO_ALIAS _Pragma("GCC ivdep")
#else
#define SHOESTRING_LOOP_NO_ALIAS
#endif

/// words + (first_index & 3) as w, with w[k] = counter_random16(key,
/// first_index + k) for k in [0, n): one 64-bit hash per four elements, in a
/// loop that vectorizes. `words` holds at least n + 8 entries. For CPU loops
/// that then read one word per element; not for device code.
SHOESTRING_RANDOM16_INLINE const uint16_t* counter_random16_fill(uint64_t key, uint64_t first_index, int64_t n,
                                                                 uint16_t* words) {
  const uint64_t first_output = first_index >> 2;
  const int64_t skip = static_cast<int64_t>(first_index & 3u);
  const int64_t outputs = (skip + n + 3) >> 2;
  // counter_random64(key, first_output + q) = mix64(z), z a Weyl sequence
  // advanced by an addition (a vector add, where a multiply by gamma per
  // output would be three emulated 64-bit multiplies per lane on AVX2).
  uint64_t z = key + (first_output + 1) * kSplitMix64Gamma;
  for (int64_t q = 0; q < outputs; ++q, z += kSplitMix64Gamma) {
    const uint64_t h = mix64(z);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    std::memcpy(words + 4 * q, &h, sizeof h);
#else
    for (int j = 0; j < 4; ++j) words[4 * q + j] = static_cast<uint16_t>(h >> (16 * j));
#endif
  }
  return words + skip;
}

/// Elements per block of random words in the CPU loops (Random16Block).
constexpr int64_t kRandom16BlockSize = 1024;

/// Stack storage (2 KiB) for the words of up to kRandom16BlockSize elements.
struct Random16Block {
  uint16_t words[kRandom16BlockSize + 8];

  /// counter_random16_fill into this block; n <= kRandom16BlockSize.
  SHOESTRING_RANDOM16_INLINE const uint16_t* fill(uint64_t key, uint64_t first_index, int64_t n) {
    return counter_random16_fill(key, first_index, n, words);
  }
};

}  // namespace shoestring
