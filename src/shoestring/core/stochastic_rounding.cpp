#include "shoestring/core/stochastic_rounding.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "shoestring/core/counter_rng.h"
#include "shoestring/core/error.h"
#include "shoestring/core/stochastic_rounding_bits.h"

#if defined(SHOESTRING_WITH_CUDA_KERNELS)
#include "shoestring/core/cuda_host.h"
#endif

namespace shoestring {
namespace {

// Elements per parallel task: big enough to amortize task overhead (~96 KiB of
// input per task on the bf16 path), small enough to split medium tensors.
constexpr int64_t kGrainSize = 32768;

// Inner loops: per block of kRandom16BlockSize elements, the random words
// (one SplitMix64 output per four elements, Random16Block), then the rule per
// element: plain counted loops over 32-bit words with no branches (selects
// only), restrict-qualified, so GCC/Clang vectorize both at -O3. The random
// index is the global element index.
//
// The hash needs 64-bit multiplies, which baseline x86-64 (SSE2) and AVX2
// emulate with 32-bit ones; on GCC/x86-64 the loops are also compiled for
// x86-64-v3 (AVX2) and x86-64-v4 (AVX-512, native 64-bit vector multiply) and
// picked at load time (ifunc). Results are bit-identical across variants
// (integer-only rules). bench/optimizer_memory measures the kernels that
// round on store.
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define SHOESTRING_SR_TARGET_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define SHOESTRING_SR_TARGET_CLONES
#endif

// One of the bit rules over a range, a block of random words at a time.
template <uint16_t (*kRule)(uint32_t, uint32_t)>
SHOESTRING_RANDOM16_INLINE void round_range(const uint32_t* __restrict in, uint16_t* __restrict out, int64_t n,
                                            uint64_t key, uint64_t first_index) {
  Random16Block block;
  for (int64_t b = 0; b < n; b += kRandom16BlockSize) {
    const int64_t len = std::min(kRandom16BlockSize, n - b);
    const uint16_t* __restrict r = block.fill(key, first_index + static_cast<uint64_t>(b), len);
    const uint32_t* __restrict x = in + b;
    uint16_t* __restrict y = out + b;
    SHOESTRING_LOOP_NO_ALIAS
    for (int64_t i = 0; i < len; ++i) y[i] = kRule(x[i], r[i]);
  }
}

// Non-template entry points: target_clones is not reliable on templates.
SHOESTRING_SR_TARGET_CLONES
void round_range_bf16(const uint32_t* __restrict in, uint16_t* __restrict out, int64_t n, uint64_t key,
                      uint64_t first_index) {
  round_range<sr_bf16_from_fp32_bits>(in, out, n, key, first_index);
}

SHOESTRING_SR_TARGET_CLONES
void round_range_fp16(const uint32_t* __restrict in, uint16_t* __restrict out, int64_t n, uint64_t key,
                      uint64_t first_index) {
  round_range<sr_fp16_from_fp32_bits>(in, out, n, key, first_index);
}

uint32_t float_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

}  // namespace

namespace {

// The checks every path shares (src / dst as stochastic_round_into documents).
void check_round_into(const char* what, const at::Tensor& src, const at::Tensor& dst, int64_t element_offset) {
  if (!src.defined() || !dst.defined()) {
    fail("{}: src and dst must be defined tensors", what);
  }
  if (src.device() != dst.device()) {
    fail("{}: src and dst must be on one device, got src on {} and dst on {}", what, src.device().str(),
         dst.device().str());
  }
  if (src.scalar_type() != at::kFloat) {
    fail("{}: src must be float32, got {}", what, c10::toString(src.scalar_type()));
  }
  if (dst.scalar_type() != at::kBFloat16 && dst.scalar_type() != at::kHalf) {
    fail("{}: dst must be bfloat16 or float16, got {}", what, c10::toString(dst.scalar_type()));
  }
  if (src.layout() != at::kStrided || dst.layout() != at::kStrided || !src.is_contiguous() || !dst.is_contiguous()) {
    fail("{}: src and dst must be contiguous (src contiguous: {}, dst contiguous: {})", what, src.is_contiguous(),
         dst.is_contiguous());
  }
  if (dst.numel() != src.numel()) {
    fail("{}: dst has {} elements, expected {} (the numel of src)", what, dst.numel(), src.numel());
  }
  if (element_offset < 0) {
    fail("{}: element_offset must be >= 0, got {}", what, element_offset);
  }
  if (src.numel() == 0) return;
  // Same storage and intersecting byte ranges (device pointers compare as well as host ones).
  const auto in_begin = reinterpret_cast<uintptr_t>(src.data_ptr());
  const auto out_begin = reinterpret_cast<uintptr_t>(dst.data_ptr());
  const auto n = static_cast<uintptr_t>(src.numel());
  if (in_begin < out_begin + n * 2 && out_begin < in_begin + n * 4) {
    fail("{}: dst memory overlaps src", what);
  }
}

void round_into_cpu(const at::Tensor& src, at::Tensor& dst, RoundingKey key, int64_t element_offset) {
  const int64_t n = src.numel();
  const auto* in = static_cast<const uint32_t*>(src.data_ptr());
  auto* out = static_cast<uint16_t*>(dst.data_ptr());
  const uint64_t k = counter_rng_key(key.seed, key.step, key.tensor_id);
  const uint64_t first = static_cast<uint64_t>(element_offset);
  const bool to_bf16 = dst.scalar_type() == at::kBFloat16;
  at::parallel_for(0, n, kGrainSize, [&](int64_t begin, int64_t end) {
    const uint64_t index = first + static_cast<uint64_t>(begin);
    if (to_bf16) {
      round_range_bf16(in + begin, out + begin, end - begin, k, index);
    } else {
      round_range_fp16(in + begin, out + begin, end - begin, k, index);
    }
  });
}

// ---- the ATen-op path --------------------------------------------------------
// 64-bit words live in int64 tensors as their two's-complement patterns:
// addition and multiplication wrap modulo 2^64 (the kernels libtorch uses for
// int64 on CPU and CUDA), xor / and / or are bit-exact, and a logical right
// shift is the arithmetic one with the sign-extended bits masked off.
// 32-bit words are kept zero-extended in int64 (values in [0, 2^32)), so the
// uint32 expressions of stochastic_rounding_bits.h hold without wraparound
// (the one place where uint32 arithmetic could wrap, bits + random for NaN
// patterns, is selected away, and a final & 0xFFFF keeps the low half).

constexpr int64_t as_int64(uint64_t u) { return static_cast<int64_t>(u); }

at::Tensor shr(const at::Tensor& x, int k) {
  return x.__rshift__(k).bitwise_and_(as_int64(~uint64_t{0} >> k));  // logical shift
}

at::Tensor mix64_tensor(at::Tensor z) {
  z = z.bitwise_xor(shr(z, 30)).mul_(as_int64(0xBF58476D1CE4E5B9ull));
  z = z.bitwise_xor(shr(z, 27)).mul_(as_int64(0x94D049BB133111EBull));
  return z.bitwise_xor_(shr(z, 31));
}

// uint16 results (int64 in [0, 65536)) as the 16-bit pattern of `dtype`.
at::Tensor to_16bit(const at::Tensor& v, at::ScalarType dtype) {
  const at::Tensor signed16 = v - v.__rshift__(15).bitwise_and_(1).mul_(65536);  // [-32768, 32767], exact in int16
  return signed16.to(at::kShort).view(dtype);
}

at::Tensor sr_bf16_tensor(const at::Tensor& bits, const at::Tensor& random) {
  const at::Tensor rounded = (bits + random.bitwise_and(0xFFFF)).__rshift__(16).bitwise_and_(0xFFFF);
  const at::Tensor quiet_nan = bits.__rshift__(16).bitwise_or_(0x0040);
  const at::Tensor is_nan = bits.bitwise_and(0x7FFFFFFF).gt(0x7F800000);
  return at::where(is_nan, quiet_nan, rounded);
}

at::Tensor sr_fp16_tensor(const at::Tensor& bits, const at::Tensor& random) {
  const at::Tensor sign = bits.__rshift__(16).bitwise_and_(0x8000);
  const at::Tensor a = bits.bitwise_and(0x7FFFFFFF);
  at::Tensor normal = (a + random.bitwise_and(0x1FFF)).__rshift__(13).sub_((127 - 15) << 10);
  normal = at::minimum(normal, at::full({}, 0x7C00, normal.options()));
  const at::Tensor is_subnormal = a.lt(0x38800000);
  const at::Tensor scaled_bits =
      at::where(is_subnormal.logical_and(a.ge(0x00800000)), a + (int64_t{40} << 23), at::zeros_like(a));
  // floor(|x| * 2^40) < 2^26: the float's bits in int32, converted back with truncation.
  const at::Tensor v = scaled_bits.to(at::kInt).view(at::kFloat).to(at::kInt).to(at::kLong);
  const at::Tensor subnormal = (v + random.bitwise_and(0xFFFF)).__rshift__(16);
  at::Tensor mag = at::where(is_subnormal, subnormal, normal);
  mag = at::where(a.gt(0x7F800000), at::full({}, 0x7E00, mag.options()), mag);
  return sign.bitwise_or_(mag);
}

constexpr int64_t kGenericChunk = int64_t{1} << 20;

}  // namespace

at::Tensor stochastic_rounding_random_bits_tensor(RoundingKey key, int64_t first_index, int64_t n,
                                                  const c10::Device& device) {
  if (first_index < 0 || n < 0 || first_index > std::numeric_limits<int64_t>::max() - n) {
    fail("stochastic_rounding_random_bits_tensor: indices [{}, {} + {}) out of range", first_index, first_index, n);
  }
  const uint64_t k = counter_rng_key(key.seed, key.step, key.tensor_id);
  // counter_random16: element i takes bits [16 (i & 3), +16) of
  // counter_random64(k, i >> 2) = mix64(k + ((i >> 2) + 1) * gamma), all
  // modulo 2^64. An arithmetic shift by up to 48 leaves the wanted 16 bits
  // in place (sign bits land above them, masked off).
  const at::Tensor index =
      at::arange(first_index, first_index + n, at::TensorOptions().dtype(at::kLong).device(device));
  at::Tensor z = index.__rshift__(2).add_(1);
  z.mul_(as_int64(kSplitMix64Gamma)).add_(as_int64(k));
  const at::Tensor shift = index.bitwise_and(3).mul_(16);
  return mix64_tensor(std::move(z)).__rshift__(shift).bitwise_and_(0xFFFF);
}

void stochastic_round_into_generic(const at::Tensor& src, at::Tensor& dst, RoundingKey key, int64_t element_offset) {
  check_round_into("stochastic_round_into", src, dst, element_offset);
  const int64_t n = src.numel();
  const at::Tensor in = src.view({n});
  at::Tensor out = dst.view({n});
  const bool to_bf16 = dst.scalar_type() == at::kBFloat16;
  for (int64_t begin = 0; begin < n; begin += kGenericChunk) {
    const int64_t len = std::min(kGenericChunk, n - begin);
    const at::Tensor bits = in.narrow(0, begin, len).view(at::kInt).to(at::kLong).bitwise_and_(int64_t{0xFFFFFFFF});
    const at::Tensor random = stochastic_rounding_random_bits_tensor(key, element_offset + begin, len, src.device());
    const at::Tensor result = to_bf16 ? sr_bf16_tensor(bits, random) : sr_fp16_tensor(bits, random);
    out.narrow(0, begin, len).copy_(to_16bit(result, dst.scalar_type()));
  }
}

void stochastic_round_into(const at::Tensor& src, at::Tensor& dst, RoundingKey key, int64_t element_offset) {
  check_round_into("stochastic_round_into", src, dst, element_offset);
  if (src.numel() == 0) return;
  if (src.device().is_cpu()) {
    round_into_cpu(src, dst, key, element_offset);
    return;
  }
#if defined(SHOESTRING_WITH_CUDA_KERNELS)
  if (src.device().is_cuda()) {
    cuda_host::stochastic_round_into(src, dst, key, element_offset);
    return;
  }
#endif
  stochastic_round_into_generic(src, dst, key, element_offset);
}

at::Tensor stochastic_round(const at::Tensor& src, at::ScalarType dtype, RoundingKey key) {
  if (dtype != at::kBFloat16 && dtype != at::kHalf) {
    fail("stochastic_round: target dtype must be bfloat16 or float16, got {}", c10::toString(dtype));
  }
  if (!src.defined()) fail("stochastic_round: src must be a defined tensor");
  const at::Tensor in = src.contiguous();
  at::Tensor out = at::empty(in.sizes(), in.options().dtype(dtype));
  stochastic_round_into(in, out, key, 0);
  return out;
}

uint16_t stochastic_round_bf16_bits(float x, uint32_t random16) {
  return sr_bf16_from_fp32_bits(float_bits(x), random16);
}

uint16_t stochastic_round_fp16_bits(float x, uint32_t random_bits) {
  return sr_fp16_from_fp32_bits(float_bits(x), random_bits);
}

uint32_t stochastic_rounding_random_bits(RoundingKey key, uint64_t index) {
  return counter_random16(counter_rng_key(key.seed, key.step, key.tensor_id), index);
}

}  // namespace shoestring
