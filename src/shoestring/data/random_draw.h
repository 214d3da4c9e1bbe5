// Bounded integer draws from std::mt19937_64 with a result that is the same on
// every standard library (std::uniform_int_distribution's is
// implementation-defined), for the data pipeline's seeded orders and crops.
#pragma once
#include <cstdint>
#include <limits>
#include <random>

namespace shoestring {

/// Uniform in [0, bound] (bound < 2^64 - 1), by rejection: draws gen() until
/// it falls below the largest multiple of bound + 1, then takes the remainder.
inline uint64_t uniform_up_to(std::mt19937_64& gen, uint64_t bound) {
  const uint64_t range = bound + 1;
  const uint64_t limit = std::numeric_limits<uint64_t>::max() - std::numeric_limits<uint64_t>::max() % range;
  uint64_t r;
  do {
    r = gen();
  } while (r >= limit);
  return r % range;
}

}  // namespace shoestring
