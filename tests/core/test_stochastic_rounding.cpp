// Tests of the counter-based RNG and stochastic rounding (SR).
// References: exact probabilities by enumerating every random value (the SR
// definition of torchastic / kohya / OneTrainer, REFERENCE.md examples);
// neighbours on the fp16 grid from c10::Half (torch's own conversion);
// SplitMix64 outputs published on Rosetta Code ("Pseudo-random
// numbers/Splitmix64", seed 1234567); torch's round-to-nearest .to(dtype).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "shoestring/core/counter_rng.h"
#include "shoestring/core/error.h"
#include "shoestring/core/stochastic_rounding.h"
#include "shoestring/core/stochastic_rounding_bits.h"

namespace shoestring {
namespace {

float from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

uint32_t to_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

float bf16_to_float(uint16_t bits) { return from_bits(static_cast<uint32_t>(bits) << 16); }

float half_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// Counts, over all 65536 values of the random word, how often SR(bits) is
// each result.
std::map<uint16_t, int> bf16_outcomes(uint32_t bits) {
  std::map<uint16_t, int> counts;
  for (uint32_t r = 0; r < 65536; ++r) ++counts[sr_bf16_from_fp32_bits(bits, r)];
  return counts;
}

// ---------------------------------------------------------------- counter RNG

TEST(CounterRng, MatchesPublishedSplitMix64Outputs) {
  // SplitMix64 seeded with 1234567: Rosetta Code reference values.
  const uint64_t expected[] = {6457827717110365317ull, 3203168211198807973ull, 9817491932198370423ull,
                               4593380528125082431ull, 16408922859458223821ull};
  for (uint64_t i = 0; i < 5; ++i) EXPECT_EQ(counter_random64(1234567, i), expected[i]) << i;
}

TEST(CounterRng, KeysDifferPerComponentAndBitsAreBalanced) {
  EXPECT_NE(counter_rng_key(1, 0, 0), counter_rng_key(1, 1, 0));
  EXPECT_NE(counter_rng_key(1, 0, 0), counter_rng_key(1, 0, 1));
  EXPECT_NE(counter_rng_key(1, 0, 0), counter_rng_key(2, 0, 0));
  EXPECT_NE(counter_rng_key(0, 1, 0), counter_rng_key(0, 0, 1));
  // Each of the 32 output bits is set with frequency 1/2 within 5 standard
  // errors over 2^20 consecutive indices of one stream.
  const uint64_t key = counter_rng_key(7, 3, 11);
  const int n = 1 << 20;
  std::array<int, 32> ones{};
  for (int i = 0; i < n; ++i) {
    const uint32_t r = counter_random32(key, static_cast<uint64_t>(i));
    for (int b = 0; b < 32; ++b) ones[b] += (r >> b) & 1u;
  }
  const double se = 0.5 / std::sqrt(static_cast<double>(n));
  for (int b = 0; b < 32; ++b) EXPECT_NEAR(ones[b] / static_cast<double>(n), 0.5, 5 * se) << b;
}

TEST(CounterRng, Random16IsFourLanesOfOneOutput) {
  // counter_random16 of element 4q + j is bits [16j, 16j + 16) of output q.
  const uint64_t key = counter_rng_key(5, 8, 13);
  for (uint64_t q : {uint64_t{0}, uint64_t{1}, uint64_t{977}, (uint64_t{1} << 40) + 3}) {
    const uint64_t h = counter_random64(key, q);
    for (uint64_t j = 0; j < 4; ++j) {
      EXPECT_EQ(counter_random16(key, 4 * q + j), (h >> (16 * j)) & 0xFFFFu) << q << " " << j;
    }
  }
  // The block fill gives the same words from any starting element and length.
  std::vector<uint16_t> storage(kRandom16BlockSize + 8);
  for (uint64_t first : {uint64_t{0}, uint64_t{1}, uint64_t{2}, uint64_t{3}, uint64_t{1234567}}) {
    for (int64_t n : {int64_t{1}, int64_t{3}, int64_t{5}, int64_t{1023}, kRandom16BlockSize}) {
      std::fill(storage.begin(), storage.end(), uint16_t{0xABCD});
      const uint16_t* w = counter_random16_fill(key, first, n, storage.data());
      for (int64_t k = 0; k < n; ++k) {
        ASSERT_EQ(w[k], counter_random16(key, first + static_cast<uint64_t>(k))) << first << " " << n << " " << k;
      }
    }
  }
  // Each of the 16 bits is set with frequency 1/2 (5 standard errors), and
  // neighbours sharing an output are uncorrelated: the xor of lanes j and
  // j + 1 is 1 half the time.
  const int n = 1 << 20;
  std::array<int, 16> ones{};
  int differ = 0;
  for (int i = 0; i < n; ++i) {
    const uint32_t r = counter_random16(key, static_cast<uint64_t>(i));
    for (int b = 0; b < 16; ++b) ones[b] += (r >> b) & 1u;
    if ((i & 3) != 3) differ += (r ^ counter_random16(key, static_cast<uint64_t>(i) + 1)) & 1u;
  }
  const double se = 0.5 / std::sqrt(static_cast<double>(n));
  for (int b = 0; b < 16; ++b) EXPECT_NEAR(ones[b] / static_cast<double>(n), 0.5, 5 * se) << b;
  const double pairs = n * 3.0 / 4.0;
  EXPECT_NEAR(differ / pairs, 0.5, 5 * 0.5 / std::sqrt(pairs));
}

// ----------------------------------------------------------------- bf16 rules

TEST(StochasticRoundingBf16, ExactProbabilitiesFromReference) {
  // 1.001953125 = 0x3F804000 -> 1.0078125 (0x3F81) with probability 1/4.
  auto counts = bf16_outcomes(0x3F804000u);
  ASSERT_EQ(counts.size(), 2u);
  EXPECT_EQ(bf16_to_float(0x3F81), 1.0078125f);
  EXPECT_EQ(counts[0x3F81], 65536 / 4);
  EXPECT_EQ(counts[0x3F80], 65536 * 3 / 4);
  // 1.00390625 = 0x3F808000 -> 1/2 each.
  counts = bf16_outcomes(0x3F808000u);
  EXPECT_EQ(counts[0x3F81], 65536 / 2);
  EXPECT_EQ(counts[0x3F80], 65536 / 2);
  // Negative mirror: the magnitude rounds up with the same probability.
  counts = bf16_outcomes(0xBF804000u);
  ASSERT_EQ(counts.size(), 2u);
  EXPECT_EQ(counts[0xBF81], 65536 / 4);
  EXPECT_EQ(counts[0xBF80], 65536 * 3 / 4);
  // Through the float API.
  EXPECT_EQ(bf16_to_float(stochastic_round_bf16_bits(1.001953125f, 0)), 1.0f);
  EXPECT_EQ(bf16_to_float(stochastic_round_bf16_bits(1.001953125f, 65535)), 1.0078125f);
}

TEST(StochasticRoundingBf16, RoundUpProbabilityEqualsLow16ForRandomPatterns) {
  std::mt19937 gen(123);
  for (int t = 0; t < 24; ++t) {
    // Finite patterns below the largest bf16, both signs, all exponents.
    uint32_t bits = gen();
    if ((bits & 0x7F800000u) == 0x7F800000u) bits &= 0xBFFFFFFFu;
    const uint32_t low = bits & 0xFFFFu;
    const uint16_t down = static_cast<uint16_t>(bits >> 16);
    auto counts = bf16_outcomes(bits);
    EXPECT_EQ(counts[down], 65536 - static_cast<int>(low)) << std::hex << bits;
    if (low != 0) {
      EXPECT_EQ(counts[static_cast<uint16_t>(down + 1)], static_cast<int>(low)) << std::hex << bits;
      EXPECT_EQ(counts.size(), 2u);
      // The two outcomes bracket x (value check, independent of the bit trick).
      const float x = from_bits(bits);
      const float a = bf16_to_float(down), b = bf16_to_float(static_cast<uint16_t>(down + 1));
      EXPECT_LE(std::min(a, b), x);
      EXPECT_GE(std::max(a, b), x);
    }
  }
}

TEST(StochasticRoundingBf16, ExactValuesInfAndZerosUnchanged) {
  const uint32_t randoms[] = {0u, 1u, 0x8000u, 0xFFFFu, 0xFFFFFFFFu, 0x12345678u};
  for (uint32_t hi = 0; hi < 65536; ++hi) {
    const uint32_t bits = hi << 16;
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) continue;  // NaN: separate test
    for (uint32_t r : randoms) {
      ASSERT_EQ(sr_bf16_from_fp32_bits(bits, r), hi) << std::hex << bits << " r=" << r;
    }
  }
}

TEST(StochasticRoundingBf16, NanStaysNanWithItsSign) {
  const uint32_t nans[] = {0x7F800001u, 0x7F80FFFFu, 0x7FC00000u, 0x7FFFFFFFu, 0xFF800001u, 0xFFC00000u, 0xFFFFFFFFu};
  for (uint32_t bits : nans) {
    for (uint32_t r : {0u, 0x7FFFu, 0xFFFFu}) {
      const uint16_t out = sr_bf16_from_fp32_bits(bits, r);
      EXPECT_TRUE(std::isnan(bf16_to_float(out))) << std::hex << bits;
      EXPECT_EQ(out & 0x8000u, (bits >> 16) & 0x8000u) << std::hex << bits;
    }
  }
  EXPECT_TRUE(std::isnan(bf16_to_float(stochastic_round_bf16_bits(std::numeric_limits<float>::quiet_NaN(), 0xFFFF))));
}

TEST(StochasticRoundingBf16, NearFltMaxRoundsToInfWithItsProbability) {
  // FLT_MAX = 0x7F7FFFFF: low16 = 0xFFFF, so inf with probability 65535/65536.
  auto counts = bf16_outcomes(to_bits(FLT_MAX));
  EXPECT_EQ(counts[0x7F80], 65535);  // +inf
  EXPECT_EQ(counts[0x7F7F], 1);      // largest bf16
  counts = bf16_outcomes(to_bits(-FLT_MAX));
  EXPECT_EQ(counts[0xFF80], 65535);  // -inf
  EXPECT_EQ(counts[0xFF7F], 1);
  EXPECT_TRUE(std::isinf(bf16_to_float(0x7F80)));
}

// ----------------------------------------------------------------- fp16 rules

// The two fp16 values that bracket x, from torch's own round-to-nearest
// (c10::Half) and a step to the adjacent code: lo <= x <= hi.
std::pair<float, float> half_neighbours(float x) {
  const c10::Half h(x);
  const float hv = static_cast<float>(h);
  if (hv == x) return {hv, hv};
  // Step one code away from zero (|x| > |hv|) or toward zero.
  const bool away = std::fabs(x) > std::fabs(hv);
  // Codes of one sign are ordered by magnitude; from +-0 the next code away
  // from zero is the smallest subnormal of x's sign.
  uint16_t other;
  if ((h.x & 0x7FFFu) == 0) {
    other = x < 0 ? 0x8001u : 0x0001u;
  } else {
    other = static_cast<uint16_t>(away ? h.x + 1 : h.x - 1);
  }
  const float ov = half_to_float(other);
  return {std::min(hv, ov), std::max(hv, ov)};
}

TEST(StochasticRoundingFp16, ResultIsOneOfTorchsTwoNeighbours) {
  std::mt19937 gen(7);
  std::vector<float> xs = {1.0f,    1.0001f, -1.0001f, 0.1f,  -0.3f, 3.14159f, 1000.7f, 65000.5f, 65504.0f, 6.1e-5f,
                           6.0e-5f, 3.3e-6f, -3.3e-6f, 1e-7f, 2e-8f, 5.96e-8f, 1e-30f,  0.0f,     -0.0f};
  std::uniform_real_distribution<float> expo(-27.0f, 15.9f);
  for (int i = 0; i < 300; ++i) {
    const float m = std::ldexp(1.0f, static_cast<int>(std::floor(expo(gen))));
    xs.push_back((i % 2 ? -1.0f : 1.0f) * m * (1.0f + static_cast<float>(gen() % 100000) / 1e5f));
  }
  for (float x : xs) {
    const auto [lo, hi] = half_neighbours(x);
    ASSERT_LE(lo, x);
    ASSERT_GE(hi, x);
    for (uint32_t r : {0u, 1u, 0x1FFFu, 0x800u, 0xFFFFF800u, 0xFFFFFFFFu, 0x9E3779B9u}) {
      const float y = half_to_float(stochastic_round_fp16_bits(x, r));
      EXPECT_TRUE(y == lo || y == hi) << "x=" << x << " r=" << r << " got " << y << " not in [" << lo << ", " << hi
                                      << "]";
    }
  }
}

TEST(StochasticRoundingFp16, ExactProbabilitiesNormal) {
  // Normal range: the up-probability is (low 13 mantissa bits) / 8192 exactly.
  const float xs[] = {1.0001f, -2.7182817f, 0.33333334f, 1000.7f, 6.2e-5f};
  for (float x : xs) {
    const auto [lo, hi] = half_neighbours(x);
    const double p_up = (std::fabs(static_cast<double>(x)) - std::fabs(static_cast<double>(x > 0 ? lo : hi))) /
                        (static_cast<double>(hi) - static_cast<double>(lo));
    int up = 0;
    for (uint32_t r = 0; r < 8192; ++r) {
      const float y = half_to_float(stochastic_round_fp16_bits(x, r));
      up += std::fabs(y) > std::fabs(x);
    }
    EXPECT_EQ(up, static_cast<int>(std::llround(p_up * 8192))) << x;
  }
}

TEST(StochasticRoundingFp16, ExactProbabilitiesSubnormal) {
  // Subnormal range (spacing 2^-24): the up-probability is the fraction of
  // |x| / 2^-24, exactly for |x| >= 2^-17 with the 16 random bits; below,
  // the fraction is truncated to 16 bits (at most one count of 65536 fewer).
  // Enumerate all 2^16 words.
  struct Case {
    float x;
    bool exact;
  };
  const Case cases[] = {{9.1e-6f, true}, {-2.3e-5f, true}, {6.09e-5f, true}, {1.7e-5f, true},
                        {-1e-7f, false}, {2.9e-7f, false}, {3.3e-6f, false}};
  for (const Case& c : cases) {
    const double units = std::fabs(static_cast<double>(c.x)) * std::ldexp(1.0, 24);
    const double frac = units - std::floor(units);
    int64_t up = 0;
    for (uint32_t r = 0; r < (1u << 16); ++r) {
      const float y = half_to_float(stochastic_round_fp16_bits(c.x, r));
      up += std::fabs(y) > std::fabs(c.x);
    }
    const double expected = frac * 65536.0;
    if (c.exact) {
      EXPECT_EQ(static_cast<double>(up), expected) << c.x;
    } else {
      EXPECT_LE(static_cast<double>(up), expected) << c.x;
      EXPECT_GT(static_cast<double>(up), expected - 1.0) << c.x;
    }
  }
}

TEST(StochasticRoundingFp16, ZerosInfNanOverflow) {
  for (uint32_t r : {0u, 0x1FFFu, 0xFFFFFFFFu}) {
    EXPECT_EQ(stochastic_round_fp16_bits(0.0f, r), 0x0000);
    EXPECT_EQ(stochastic_round_fp16_bits(-0.0f, r), 0x8000);
    EXPECT_EQ(stochastic_round_fp16_bits(INFINITY, r), 0x7C00);
    EXPECT_EQ(stochastic_round_fp16_bits(-INFINITY, r), 0xFC00);
    EXPECT_EQ(stochastic_round_fp16_bits(65504.0f, r), 0x7BFF);
    EXPECT_EQ(stochastic_round_fp16_bits(-65504.0f, r), 0xFBFF);
    EXPECT_EQ(stochastic_round_fp16_bits(65536.0f, r), 0x7C00);
    EXPECT_EQ(stochastic_round_fp16_bits(1e30f, r), 0x7C00);
    EXPECT_EQ(stochastic_round_fp16_bits(-FLT_MAX, r), 0xFC00);
    const uint16_t n = stochastic_round_fp16_bits(std::numeric_limits<float>::quiet_NaN(), r);
    EXPECT_TRUE(std::isnan(half_to_float(n)));
    EXPECT_EQ(stochastic_round_fp16_bits(from_bits(0xFF800001u), r), 0xFE00);
    // fp32 subnormals are far below half the smallest fp16 subnormal.
    EXPECT_EQ(stochastic_round_fp16_bits(from_bits(0x00000001u), r), 0x0000);
  }
  // Between 65504 and 2^16, inf takes the place of 2^16: 65520 is halfway.
  int inf = 0;
  for (uint32_t r = 0; r < 8192; ++r) inf += stochastic_round_fp16_bits(65520.0f, r) == 0x7C00;
  EXPECT_EQ(inf, 4096);
  // Just below 2^-14: rounds to the largest subnormal or the smallest normal.
  const float below = std::nextafter(std::ldexp(1.0f, -14), 0.0f);
  EXPECT_EQ(stochastic_round_fp16_bits(below, 0), 0x03FF);
  EXPECT_EQ(stochastic_round_fp16_bits(below, 0xFFFFFFFFu), 0x0400);
}

// ---------------------------------------------------------------- tensor path

double mean_of(const torch::Tensor& t) { return t.to(torch::kDouble).mean().item<double>(); }

TEST(StochasticRoundingTensor, MatchesScalarRuleWithCounterBits) {
  const RoundingKey key{42, 7, 3};
  torch::manual_seed(0);
  const auto src = torch::randn({70001}) * 100;
  const auto bf = stochastic_round(src, torch::kBFloat16, key);
  const auto hf = stochastic_round(src, torch::kHalf, key);
  ASSERT_EQ(bf.sizes(), src.sizes());
  const float* x = src.data_ptr<float>();
  const auto* b = reinterpret_cast<const uint16_t*>(bf.data_ptr());
  const auto* h = reinterpret_cast<const uint16_t*>(hf.data_ptr());
  for (int64_t i = 0; i < src.numel(); ++i) {
    const uint32_t r = stochastic_rounding_random_bits(key, static_cast<uint64_t>(i));
    ASSERT_EQ(b[i], stochastic_round_bf16_bits(x[i], r)) << i;
    ASSERT_EQ(h[i], stochastic_round_fp16_bits(x[i], r)) << i;
  }
}

TEST(StochasticRoundingTensor, UnbiasedOverAMillionDraws) {
  struct Case {
    float x;
    torch::ScalarType dtype;
  };
  const Case cases[] = {{1.001953125f, torch::kBFloat16}, {0.1f, torch::kBFloat16}, {-3.3f, torch::kBFloat16},
                        {1e-20f, torch::kBFloat16},       {1.0001f, torch::kHalf},  {-0.3f, torch::kHalf},
                        {3.3e-6f, torch::kHalf},          {2e-8f, torch::kHalf}};
  const int64_t n = 1 << 20;
  uint64_t id = 0;
  for (const Case& c : cases) {
    const auto src = torch::full({n}, c.x);
    const auto out = stochastic_round(src, c.dtype, RoundingKey{2024, 1, id++}).to(torch::kFloat);
    // Bracketing grid values, from torch's own conversion for an independent check.
    const double lo = out.min().item<float>(), hi = out.max().item<float>();
    ASSERT_LE(lo, c.x);
    ASSERT_GE(hi, c.x);
    const double p = (static_cast<double>(c.x) - lo) / (hi - lo);
    const double se = (hi - lo) * std::sqrt(p * (1 - p) / static_cast<double>(n));
    EXPECT_NEAR(mean_of(out), static_cast<double>(c.x), 5 * se) << c.x;
    EXPECT_GT(se, 0.0) << "x=" << c.x << " should not be exactly representable";
  }
}

TEST(StochasticRoundingTensor, SmallIncrementsAccumulateUnlikeRoundToNearest) {
  // bf16 weights start at 1.0 and get +1e-4 a thousand times (REFERENCE.md):
  // round-to-nearest stays at 1.0, SR ends near 1.1. 4096 independent copies
  // make the mean precise (per-copy SD ~0.03, mean SD ~5e-4).
  const int64_t n = 4096;
  auto w_sr = torch::ones({n}, torch::kBFloat16);
  auto w_rtn = torch::ones({n}, torch::kBFloat16);
  for (uint64_t step = 0; step < 1000; ++step) {
    const auto sum_sr = w_sr.to(torch::kFloat) + 1e-4f;
    stochastic_round_into(sum_sr, w_sr, RoundingKey{5, step, 0});
    w_rtn = (w_rtn.to(torch::kFloat) + 1e-4f).to(torch::kBFloat16);
  }
  EXPECT_TRUE(torch::equal(w_rtn, torch::ones({n}, torch::kBFloat16)));
  EXPECT_NEAR(mean_of(w_sr), 1.1, 0.005);
}

TEST(StochasticRoundingTensor, DeterministicAndKeySensitive) {
  const auto src = torch::full({50000}, 1.00390625f);  // p = 1/2 per element
  const RoundingKey key{9, 100, 4};
  const auto a = stochastic_round(src, torch::kBFloat16, key);
  const auto b = stochastic_round(src, torch::kBFloat16, key);
  EXPECT_TRUE(torch::equal(a, b));
  auto differ = [&](RoundingKey other) {
    const auto c = stochastic_round(src, torch::kBFloat16, other);
    return a.ne(c).to(torch::kDouble).mean().item<double>();
  };
  // Independent streams disagree on about half the elements.
  EXPECT_NEAR(differ({9, 101, 4}), 0.5, 0.02);
  EXPECT_NEAR(differ({9, 100, 5}), 0.5, 0.02);
  EXPECT_NEAR(differ({10, 100, 4}), 0.5, 0.02);
}

TEST(StochasticRoundingTensor, IndependentOfChunkingAndThreadCount) {
  torch::manual_seed(1);
  const int64_t n = 3 * 32768 + 12345;  // several parallel_for grains, uneven
  const auto src = torch::randn({n});
  const RoundingKey key{77, 5, 2};
  for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
    const auto whole = stochastic_round(src, dtype, key);
    auto chunked = torch::empty({n}, dtype);
    const int64_t cuts[] = {0, 1000, 70001, n};
    for (int i = 0; i < 3; ++i) {
      const auto s = src.slice(0, cuts[i], cuts[i + 1]);
      auto d = chunked.slice(0, cuts[i], cuts[i + 1]);
      stochastic_round_into(s, d, key, cuts[i]);
    }
    EXPECT_TRUE(torch::equal(whole, chunked));
    const int threads = torch::get_num_threads();
    torch::set_num_threads(1);
    const auto one = stochastic_round(src, dtype, key);
    torch::set_num_threads(2);
    const auto two = stochastic_round(src, dtype, key);
    torch::set_num_threads(threads);
    EXPECT_TRUE(torch::equal(whole, one));
    EXPECT_TRUE(torch::equal(whole, two));
  }
}

TEST(StochasticRoundingTensor, RejectsBadArguments) {
  const auto src = torch::zeros({8});
  auto dst = torch::empty({8}, torch::kBFloat16);
  auto wrong_numel = torch::empty({7}, torch::kBFloat16);
  auto wrong_dtype = torch::empty({8}, torch::kFloat);
  auto strided = torch::empty({16}, torch::kBFloat16).slice(0, 0, 16, 2);
  EXPECT_THROW(stochastic_round_into(src.to(torch::kDouble), dst, {}), Error);
  EXPECT_THROW(stochastic_round_into(src, wrong_numel, {}), Error);
  EXPECT_THROW(stochastic_round_into(src, wrong_dtype, {}), Error);
  EXPECT_THROW(stochastic_round_into(src, strided, {}), Error);
  EXPECT_THROW(stochastic_round_into(src, dst, {}, -1), Error);
  EXPECT_THROW(stochastic_round(src, torch::kFloat, {}), Error);
  // dst aliasing src's memory.
  auto alias = torch::from_blob(src.data_ptr(), {8}, torch::kBFloat16);
  EXPECT_THROW(stochastic_round_into(src, alias, {}), Error);
  try {
    stochastic_round_into(src, wrong_numel, {});
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("7 elements"), std::string::npos) << e.what();
  }
  // Empty tensors are fine; non-contiguous src goes through stochastic_round.
  auto empty_dst = torch::empty({0}, torch::kHalf);
  EXPECT_NO_THROW(stochastic_round_into(torch::zeros({0}), empty_dst, {}));
  const auto t = torch::randn({4, 6}).t();
  EXPECT_TRUE(torch::equal(stochastic_round(t, torch::kHalf, {1, 2, 3}),
                           stochastic_round(t.contiguous(), torch::kHalf, {1, 2, 3})));
}

// ---------------------------------------------------------------- ATen-op path
// The device-generic path (what CUDA tensors take without a custom kernel),
// forced on CPU tensors: the same bits as the fast CPU loop, element for
// element, over every class of input (random normals, the special patterns,
// fp16 subnormals and overflow, all-ones mantissas that carry).

torch::Tensor special_patterns() {
  std::vector<float> v = {0.0f,
                          -0.0f,
                          1.0f,
                          -1.0f,
                          65504.0f,
                          65519.0f,
                          65520.0f,
                          70000.0f,
                          -70000.0f,
                          FLT_MAX,
                          -FLT_MAX,
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN(),
                          -std::numeric_limits<float>::quiet_NaN(),
                          from_bits(0x7F800001u),
                          from_bits(0xFFFFFFFFu),
                          from_bits(0x7FFFFFFFu),
                          6.1e-5f,
                          6.0e-5f,
                          1e-7f,
                          -3e-8f,
                          5.96e-8f,
                          1e-30f,
                          from_bits(0x00000001u),
                          from_bits(0x807FFFFFu),
                          from_bits(0x3F7FFFFFu),
                          from_bits(0x387FFFFFu),
                          from_bits(0x38800000u),
                          from_bits(0x477FEFFFu)};
  return torch::tensor(v);
}

TEST(StochasticRoundingGeneric, RandomBitsTensorMatchesCounterRng) {
  const RoundingKey key{0xFFFFFFFFFFFFFFFFull, 123456789, 7};
  const int64_t first = (int64_t{1} << 40) + 5;
  const auto bits = stochastic_rounding_random_bits_tensor(key, first, 5000, torch::kCPU);
  ASSERT_EQ(bits.scalar_type(), torch::kLong);
  const int64_t* b = bits.data_ptr<int64_t>();
  for (int64_t i = 0; i < 5000; ++i) {
    ASSERT_EQ(static_cast<uint64_t>(b[i]), stochastic_rounding_random_bits(key, static_cast<uint64_t>(first + i))) << i;
  }
}

TEST(StochasticRoundingGeneric, SameBitsAsTheCpuLoop) {
  torch::manual_seed(3);
  // More than one 2^20-element chunk of the generic path, uneven.
  const int64_t n = (int64_t{1} << 20) + 4321;
  auto src = torch::randn({n}) * 3;
  src.slice(0, 0, 200000).mul_(1e-5);      // fp16 subnormals and small normals
  src.slice(0, 200000, 300000).mul_(3e4);  // fp16 overflow
  // Random bit patterns (every exponent, NaN payloads included).
  src.slice(0, 300000, 400000).copy_(torch::randint(INT32_MIN, INT32_MAX, {100000}, torch::kInt).view(torch::kFloat));
  const auto special = special_patterns();
  src.slice(0, 400000, 400000 + special.numel()).copy_(special);
  for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
    for (int64_t offset : {int64_t{0}, int64_t{987654321}}) {
      const RoundingKey key{31, 4, 9};
      auto fast = torch::empty({n}, dtype);
      auto generic = torch::empty({n}, dtype);
      stochastic_round_into(src, fast, key, offset);
      stochastic_round_into_generic(src, generic, key, offset);
      const auto fast_bits = fast.view(torch::kShort);
      const auto generic_bits = generic.view(torch::kShort);
      const int64_t differ = fast_bits.ne(generic_bits).sum().item<int64_t>();
      EXPECT_EQ(differ, 0) << c10::toString(dtype) << " offset " << offset;
    }
  }
}

TEST(StochasticRoundingGeneric, RejectsWhatTheCpuPathRejects) {
  const auto src = torch::zeros({8});
  auto wrong_numel = torch::empty({7}, torch::kBFloat16);
  auto strided = torch::empty({16}, torch::kBFloat16).slice(0, 0, 16, 2);
  EXPECT_THROW(stochastic_round_into_generic(src, wrong_numel, {}), Error);
  EXPECT_THROW(stochastic_round_into_generic(src, strided, {}), Error);
  auto meta_dst = torch::empty({8}, torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kMeta));
  try {
    stochastic_round_into(src, meta_dst, {});
    FAIL() << "expected an error for tensors on two devices";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("one device"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace shoestring
