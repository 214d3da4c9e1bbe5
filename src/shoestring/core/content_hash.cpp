#include "shoestring/core/content_hash.h"

#include <cstring>

#include <fmt/format.h>

#include "shoestring/core/counter_rng.h"

namespace shoestring {
namespace {

constexpr uint64_t kLaneMultiplier = 0xD6E8FEB86659FD93ull;  // odd: the multiply is a bijection

inline uint64_t step(uint64_t lane, uint64_t word) {
  lane = (lane ^ word) * kLaneMultiplier;
  return lane ^ (lane >> 32);
}

inline uint64_t load64(const unsigned char* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);  // little-endian machines only (io/safetensors.cpp checks)
  return w;
}

}  // namespace

uint64_t content_hash64(const void* data, size_t n, uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t lane[4] = {mix64(seed + 1 * kSplitMix64Gamma), mix64(seed + 2 * kSplitMix64Gamma),
                      mix64(seed + 3 * kSplitMix64Gamma), mix64(seed + 4 * kSplitMix64Gamma)};
  size_t i = 0;
  for (; i + 32 <= n; i += 32) {
    lane[0] = step(lane[0], load64(p + i));
    lane[1] = step(lane[1], load64(p + i + 8));
    lane[2] = step(lane[2], load64(p + i + 16));
    lane[3] = step(lane[3], load64(p + i + 24));
  }
  size_t k = 0;
  for (; i + 8 <= n; i += 8, ++k) lane[k] = step(lane[k], load64(p + i));
  if (i < n) {
    unsigned char tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(tail, p + i, n - i);
    lane[k] = step(lane[k], load64(tail) ^ (0x80ull << 56));
  }
  uint64_t h = mix64(seed ^ (static_cast<uint64_t>(n) * kSplitMix64Gamma));
  for (uint64_t l : lane) h = mix64(h ^ l) + kSplitMix64Gamma;
  return mix64(h);
}

std::string hex64(uint64_t v) { return fmt::format("{:016x}", v); }

std::string content_key128(std::string_view bytes) {
  return hex64(content_hash64(bytes, 0x6b6579305f6c6f77ull)) + hex64(content_hash64(bytes, 0x6b6579315f686967ull));
}

bool parse_hex64(std::string_view s, uint64_t* out) {
  if (s.size() != 16) return false;
  uint64_t v = 0;
  for (char c : s) {
    int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
    if (d < 0) return false;
    v = v << 4 | static_cast<uint64_t>(d);
  }
  *out = v;
  return true;
}

}  // namespace shoestring
