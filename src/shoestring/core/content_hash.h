// A fast 64-bit content hash (not cryptographic) for cache keys and
// checksums: file contents, tensor bytes, the canonical text of what a cached
// entry depends on (train/ldm_cache.h, io/tensor_cache.h).
//
// Design: four independent lanes take the input's 8-byte little-endian words
// in turn (word k goes to lane k mod 4); each step is lane = (lane ^ word) *
// K, then lane ^= lane >> 32. Every step is a bijection of the lane for a
// fixed word, so inputs of one length that differ in a single word always
// leave that lane different: a flipped bit, a zeroed or swapped word is never
// missed by one lane. The tail (< 8 bytes) is packed into one word; the lanes,
// the length and the seed are folded through core/counter_rng.h's mix64 (a
// bijection with full avalanche). Throughput is that of four independent
// multiply chains (several GB/s on one core); bench/ldm_disk_cache times it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace shoestring {

/// 64-bit hash of `n` bytes at `data`, under `seed` (different seeds give
/// unrelated hashes). Deterministic across runs, machines and builds
/// (little-endian words). `data` may be null when `n` is 0.
uint64_t content_hash64(const void* data, size_t n, uint64_t seed = 0);

/// content_hash64 of a string's bytes.
inline uint64_t content_hash64(std::string_view bytes, uint64_t seed = 0) {
  return content_hash64(bytes.data(), bytes.size(), seed);
}

/// 128 bits of `bytes` as 32 lowercase hex digits: content_hash64 under two
/// seeds. Used as a cache key (collisions: ~n^2 / 2^129 for n keys).
std::string content_key128(std::string_view bytes);

/// `v` as 16 lowercase hex digits.
std::string hex64(uint64_t v);

/// Parses 16 hex digits (as hex64 writes them). Returns false for anything else.
bool parse_hex64(std::string_view s, uint64_t* out);

}  // namespace shoestring
