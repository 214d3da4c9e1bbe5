// Counter-based random numbers: 32 random bits as a pure function of
// (seed, step, tensor_id, element index). No state, no sequence: any thread,
// any chunk, any device, and a resumed run all see the same bits for the same
// element. Used by stochastic rounding (stochastic_rounding.h), on the CPU and
// (same header) in CUDA kernels.
//
// Generator: SplitMix64 (Steele, Lea & Flood, "Fast splittable pseudorandom
// number generators", OOPSLA 2014), in the form of Vigna's splitmix64.c: the
// state is a Weyl sequence key + (i + 1) * 0x9E3779B97F4A7C15 and each output
// is that state passed through the 64-bit finalizer with David Stafford's
// "Mix13" constants. Output i of a key is therefore exactly output i of a
// SplitMix64 generator seeded with the key, a sequence that passes TestU01
// BigCrush and PractRand (Vigna, prng.di.unimi.it). Random access to output i
// costs one multiply-add and the finalizer (2 multiplies, 3 xor-shifts).
//
// Streams: the key of (seed, step, tensor_id) is built by chaining the same
// bijective finalizer, so different steps (or tensor ids) of one seed always
// give different keys; two keys' Weyl sequences could only overlap if keys
// happened to lie within n * gamma of each other (probability ~ n / 2^64 for a
// tensor of n elements), which we neglect.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define SHOESTRING_HOST_DEVICE __host__ __device__
#else
#define SHOESTRING_HOST_DEVICE
#endif

namespace shoestring {

/// Weyl increment of SplitMix64 (2^64 / golden ratio, odd).
constexpr uint64_t kSplitMix64Gamma = 0x9E3779B97F4A7C15ull;

/// SplitMix64 output finalizer (Stafford's Mix13 variant): a bijection on
/// 64-bit words with full avalanche. mix64(0) == 0.
SHOESTRING_HOST_DEVICE inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// Stream key for one (seed, step, tensor_id). Distinct steps (or tensor ids)
/// under the same other two components always give distinct keys, because
/// every link of the chain is a bijection.
SHOESTRING_HOST_DEVICE inline uint64_t counter_rng_key(uint64_t seed, uint64_t step, uint64_t tensor_id) {
  uint64_t k = mix64(seed + kSplitMix64Gamma);
  k = mix64(k ^ (step + 2 * kSplitMix64Gamma));
  k = mix64(k ^ (tensor_id + 3 * kSplitMix64Gamma));
  return k;
}

/// 64 random bits: output `index` of the SplitMix64 stream seeded with `key`.
SHOESTRING_HOST_DEVICE inline uint64_t counter_random64(uint64_t key, uint64_t index) {
  return mix64(key + (index + 1) * kSplitMix64Gamma);
}

/// 32 random bits (the high half of counter_random64; every bit is usable, so
/// `& 0xFFFF` or `& 0x1FFF` give uniform 16 or 13 bits).
SHOESTRING_HOST_DEVICE inline uint32_t counter_random32(uint64_t key, uint64_t index) {
  return static_cast<uint32_t>(counter_random64(key, index) >> 32);
}

/// 16 random bits for element `index`: four consecutive elements share one
/// 64-bit output, element 4q + j taking bits [16j, 16j + 16) of
/// counter_random64(key, q). This is the word stochastic rounding uses (it
/// needs 16 bits per element), at a quarter of the hashing cost of one output
/// per element. On a little-endian machine the outputs q0, q0 + 1, ... stored
/// as uint64_t and read as uint16_t are exactly the words of elements 4 q0,
/// 4 q0 + 1, ..., which is how the CPU loops fill a block of words
/// (counter_random16_block in stochastic_rounding_bits.h).
SHOESTRING_HOST_DEVICE inline uint32_t counter_random16(uint64_t key, uint64_t index) {
  return static_cast<uint32_t>(counter_random64(key, index >> 2) >> (16u * static_cast<uint32_t>(index & 3u))) &
         0xFFFFu;
}

}  // namespace shoestring
