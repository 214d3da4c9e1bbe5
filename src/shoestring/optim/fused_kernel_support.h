// Internal to optim/: what the fused CPU kernels (fused_kernels.cpp: AdamW
// and Lion; fused_adamw8bit.cpp; fused_adafactor.cpp) share: the compile
// options their loops need, bf16 bit handling, rounding on store, the AdamW
// constants and the checks of the public entry points (optim/fused_kernels.h).
// Include it first in a kernel file, and compile that file as CMakeLists.txt
// compiles fused_kernels.cpp (-fno-math-errno, no shared PCH).
#pragma once
#include "shoestring/optim/fused_kernels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
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
#define SHOESTRING_FUSED_TARGET_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
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

// How a value is stored: fp32 as is; bf16 by stochastic rounding (with the
// element's random word, counter_random16) or by round-to-nearest-even
// (c10::BFloat16's rule, NaN -> 0x7FC0).
enum class Rounding { stochastic, nearest };

SHOESTRING_ALWAYS_INLINE void store(float* p, int64_t i, float x, uint32_t, Rounding) { p[i] = x; }
SHOESTRING_ALWAYS_INLINE void store(bf16_bits* p, int64_t i, float x, uint32_t random16, Rounding rounding) {
  const uint32_t b = bits_of(x);
  if (rounding == Rounding::stochastic) {
    p[i] = sr_bf16_from_fp32_bits(b, random16);
  } else {
    const uint32_t rne = (b + (((b >> 16) & 1u) + 0x7FFFu)) >> 16;
    const bool is_nan = (b & 0x7FFFFFFFu) > 0x7F800000u;
    p[i] = static_cast<bf16_bits>(is_nan ? 0x7FC0u : rne);
  }
}

// The random words of a block of stores into a T tensor with rounding R:
// computed (Random16Block, one hash per four elements) only when the stores
// round stochastically into bf16, else every word reads 0 and nothing is
// hashed. Kernels fill it per block of at most kRandom16BlockSize elements,
// then index it by the element's position in the block. The element loop that
// reads the words needs SHOESTRING_LOOP_NO_ALIAS: GCC cannot prove that the words
// (uint16) do not alias the bf16 tensors it writes, and gives up on the loop
// (seen with GCC 12 for the AVX2 clones) instead of checking at run time.
template <typename T, Rounding R>
struct StoreWords {
  static constexpr bool kNeeded = std::is_same_v<T, bf16_bits> && R == Rounding::stochastic;
  Random16Block block;
  const uint16_t* words = nullptr;
  SHOESTRING_ALWAYS_INLINE void fill(uint64_t key, int64_t first_index, int64_t n) {
    if constexpr (kNeeded) words = block.fill(key, static_cast<uint64_t>(first_index), n);
  }
  SHOESTRING_ALWAYS_INLINE uint32_t operator[](int64_t k) const {
    if constexpr (kNeeded) {
      return words[k];
    } else {
      return 0;
    }
  }
};

// The scalars of one AdamW step as the op chain passes them to libtorch:
// computed in double, then rounded to fp32 once (shared by the fp32/bf16 and
// the 8-bit kernels).
struct AdamConstants {
  float grad_scale, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size;
};

inline AdamConstants adam_constants(const FusedAdamWScalars& s) {
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

inline int variant_index(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& state, bool sr) {
  const int p = param.scalar_type() == at::kFloat ? 0 : (sr ? 1 : 2);
  return p * 4 + (grad.scalar_type() == at::kBFloat16 ? 2 : 0) + (state.scalar_type() == at::kBFloat16 ? 1 : 0);
}

// Why `t` cannot take the fused path, or "" when it can.
inline std::string unsupported_reason(const at::Tensor& t, const char* name, int64_t numel) {
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

inline std::string first_reason(std::initializer_list<std::pair<const at::Tensor*, const char*>> tensors) {
  int64_t numel = -1;
  for (const auto& [t, name] : tensors) {
    std::string why = unsupported_reason(*t, name, numel);
    if (!why.empty()) return why;
    numel = t->numel();
  }
  return {};
}

inline uint64_t stream_key(const RoundingKey& k) { return counter_rng_key(k.seed, k.step, k.tensor_id); }

inline void bump_version(at::Tensor& t) { t.unsafeGetTensorImpl()->bump_version(); }

}  // namespace
}  // namespace shoestring
