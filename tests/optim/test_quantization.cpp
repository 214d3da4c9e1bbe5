#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <limits>
#include <random>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/optim/quantization.h"

using namespace shoestring;

namespace {
nlohmann::json load_map_json() {
  std::ifstream in(std::string(SHOESTRING_TEST_DATA) + "/optim/dynamic_map.json");
  EXPECT_TRUE(in.good());
  return nlohmann::json::parse(in);
}

/// Half the distance between the two map values that bracket r (the largest
/// possible nearest-value error for r), or the distance to the end value when
/// r lies outside the map.
double half_local_spacing(const QuantizationMap& map, float r) {
  const auto& v = map.values();
  if (r <= v.front()) return v.front() - r;
  if (r >= v.back()) return r - v.back();
  const auto hi = std::lower_bound(v.begin(), v.end(), r);
  if (*hi == r) return 0.0;
  return (static_cast<double>(*hi) - static_cast<double>(*(hi - 1))) / 2.0;
}
}  // namespace

// Reference: scripts/gen_dynamic_map.py derives the maps by decoding the 256
// bit patterns of dynamic tree quantization and by bitsandbytes' documented
// construction, and checks the two agree.
TEST(DynamicMap, MatchesReferenceValues) {
  auto ref = load_map_json();
  for (bool is_signed : {true, false}) {
    const auto expected = ref[is_signed ? "signed" : "unsigned"].get<std::vector<double>>();
    const auto got = create_dynamic_map(is_signed);
    ASSERT_EQ(got.size(), 256u);
    ASSERT_EQ(expected.size(), 256u);
    for (size_t i = 0; i < 256; ++i) {
      EXPECT_NEAR(got[i], expected[i], 1e-6 * std::abs(expected[i]) + 1e-30)
          << (is_signed ? "signed " : "unsigned ") << i;
    }
  }
  const auto s = create_dynamic_map(true);
  EXPECT_EQ(s.front(), -0.99296875f);  // REFERENCE.md
  EXPECT_EQ(s.back(), 1.0f);
  EXPECT_EQ(std::count(s.begin(), s.end(), 0.0f), 1);
  EXPECT_EQ(s[127], 0.0f);  // 127 negative values below zero
  const auto u = create_dynamic_map(false);
  EXPECT_EQ(u.front(), 0.0f);
  EXPECT_EQ(u.back(), 1.0f);
  EXPECT_FLOAT_EQ(u[254], 0.99648437f);  // midpoint of the top bin of [0.1, 1] cut into 128
  // Smallest non-zero magnitudes: 10^-6 times the middle of [0.1, 1].
  EXPECT_FLOAT_EQ(s[128], 0.55e-6f);
  EXPECT_FLOAT_EQ(u[1], 0.325e-6f);  // first of two bins at 10^-6
  EXPECT_EQ(signed_dynamic_map().values()[255], 1.0f);
  EXPECT_EQ(unsigned_dynamic_map().values()[0], 0.0f);
  EXPECT_THROW(create_dynamic_map(true, 8, 8), Error);
  EXPECT_THROW(create_dynamic_map(true, 0, 8), Error);
  EXPECT_THROW(create_dynamic_map(true, 3, 9), Error);
  EXPECT_EQ(create_dynamic_map(true, 3, 4).size(), 16u);
}

TEST(DynamicMap, EncodePicksNearestValue) {
  const QuantizationMap& map = signed_dynamic_map();
  const auto& v = map.values();
  for (int i = 0; i < 256; ++i) {
    EXPECT_EQ(map.encode(v[i]), i);
    EXPECT_EQ(map.decode(static_cast<uint8_t>(i)), v[i]);
    if (i + 1 < 256) {
      const float gap = v[i + 1] - v[i];
      EXPECT_EQ(map.encode(v[i] + 0.4f * gap), i) << i;
      EXPECT_EQ(map.encode(v[i] + 0.6f * gap), i + 1) << i;
    }
  }
  // The table-driven encode agrees with an exhaustive nearest search on floats
  // of every magnitude and sign (both maps).
  std::mt19937 rng(17);
  std::uniform_int_distribution<uint32_t> any_bits;
  for (const QuantizationMap* m : {&signed_dynamic_map(), &unsigned_dynamic_map()}) {
    const auto& mv = m->values();
    auto brute = [&](float x) {
      int best = 0;
      for (int i = 1; i < 256; ++i) {
        if (std::abs(static_cast<double>(x) - mv[i]) < std::abs(static_cast<double>(x) - mv[best])) best = i;
      }
      return best;
    };
    for (int k = 0; k < 20000; ++k) {
      float x;
      if (k % 2) {
        const uint32_t b = any_bits(rng);
        std::memcpy(&x, &b, sizeof(x));
        if (std::isnan(x) || std::abs(x) > 4.0f) continue;  // beyond: clamps (checked below)
      } else {
        x = std::uniform_real_distribution<float>(-1.05f, 1.05f)(rng) *
            std::pow(10.0f, -std::uniform_real_distribution<float>(0, 8)(rng));
      }
      ASSERT_EQ(m->encode(x), brute(x)) << x;
    }
    for (float x : {0.0f, -0.0f, std::numeric_limits<float>::denorm_min(), -std::numeric_limits<float>::denorm_min()}) {
      EXPECT_EQ(m->encode(x), brute(x)) << x;
    }
    EXPECT_EQ(m->encode(3e38f), 255);
    EXPECT_EQ(m->encode(std::numeric_limits<float>::infinity()), 255);
    EXPECT_EQ(m->encode(-std::numeric_limits<float>::infinity()), 0);
    EXPECT_EQ(m->encode(-3e38f), 0);
  }
  EXPECT_EQ(map.encode(-5.0f), 0);
  EXPECT_EQ(map.encode(5.0f), 255);
  EXPECT_EQ(map.encode(std::nanf("")), 127);  // nearest 0
  EXPECT_THROW(QuantizationMap(std::vector<float>(256, 0.0f)), Error);
  EXPECT_THROW(QuantizationMap(std::vector<float>(10, 0.0f)), Error);
}

// The one-load encode (QuantizationMap::fast_table) against exact nearest-value
// searches: (1) about 2^24 float32 bit patterns spread evenly over [-1, 1]
// (every 127th magnitude pattern from 0 to 1.0, both signs; an odd stride so
// every low-bit pattern occurs), checked against a binary search over the
// sorted values with exact (double) distances to both neighbours; (2) every
// float within 4 ulps of each of the 255 decision points, where a wrong
// threshold would show, checked against an exhaustive scan of all 256 values.
TEST(DynamicMap, OneLoadEncodeEqualsNearestSearchOnDenseSample) {
  for (const QuantizationMap* m : {&signed_dynamic_map(), &unsigned_dynamic_map()}) {
    ASSERT_NE(m->fast_table(), nullptr);
    const auto& v = m->values();
    auto by_bisection = [&](float x) {
      const auto it = std::upper_bound(v.begin(), v.end(), x);  // first value > x
      if (it == v.begin()) return 0;
      if (it == v.end()) return 255;
      const int hi = static_cast<int>(it - v.begin());
      const double xd = x;
      return (xd - v[hi - 1] <= v[hi] - xd) ? hi - 1 : hi;  // ties: lower index
    };
    auto exhaustive = [&](float x) {
      int best = 0;
      for (int i = 1; i < 256; ++i) {
        if (std::abs(static_cast<double>(x) - v[i]) < std::abs(static_cast<double>(x) - v[best])) best = i;
      }
      return best;
    };
    auto from_bits = [](uint32_t b) {
      float f;
      std::memcpy(&f, &b, sizeof(f));
      return f;
    };
    int64_t checked = 0, mismatches = 0;
    for (uint32_t sign : {0u, 0x80000000u}) {
      for (uint32_t mag = 0; mag <= 0x3F800000u; mag += 127) {
        const float x = from_bits(sign | mag);
        ++checked;
        if (m->encode(x) != by_bisection(x)) {
          if (++mismatches < 5) ADD_FAILURE() << "x = " << x << " (bits " << (sign | mag) << ")";
        }
      }
    }
    EXPECT_EQ(mismatches, 0);
    EXPECT_GT(checked, int64_t{1} << 24);
    // Decision points: the first float (in value order) whose code is k.
    for (int k = 1; k < 256; ++k) {
      const double mid = (static_cast<double>(v[k - 1]) + v[k]) / 2.0;
      const float near = static_cast<float>(mid);
      for (int d = -4; d <= 4; ++d) {
        float x = near;
        for (int s = 0; s < std::abs(d); ++s) x = std::nextafter(x, d < 0 ? -2.0f : 2.0f);
        ASSERT_EQ(m->encode(x), exhaustive(x)) << "k = " << k << ", x = " << x;
        ASSERT_EQ(m->encode(x), m->encode_by_search(x)) << "k = " << k << ", x = " << x;
      }
    }
  }
}

TEST(BlockwiseQuantization, ErrorWithinHalfLocalSpacing) {
  torch::manual_seed(3);
  const int64_t n = 256 * 20 + 77;  // a short last block
  // Values spanning four decades inside every block.
  auto x = torch::randn({n}) * torch::pow(10.0, torch::rand({n}) * -4.0);
  x.narrow(0, 0, 256).mul_(1e-3);  // a block with a tiny absmax
  for (bool is_signed : {true, false}) {
    const QuantizationMap& map = is_signed ? signed_dynamic_map() : unsigned_dynamic_map();
    auto input = is_signed ? x : x.abs();
    auto q = quantize_blockwise(input, map);
    ASSERT_EQ(q.codes.scalar_type(), torch::kByte);
    ASSERT_EQ(q.absmax.numel(), 21);
    auto back = dequantize_blockwise(q.codes, q.absmax, map);
    ASSERT_EQ(back.sizes(), input.sizes());
    auto xa = input.accessor<float, 1>();
    auto ba = back.accessor<float, 1>();
    auto am = q.absmax.accessor<float, 1>();
    int64_t violations = 0;
    double worst = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float a = am[i / 256];
      const double bound = half_local_spacing(map, xa[i] / a) * a;
      const double err = std::abs(static_cast<double>(ba[i]) - xa[i]);
      worst = std::max(worst, err / a);
      if (err > bound + 1e-6 * std::abs(xa[i]) + 1e-12 * a) ++violations;
    }
    EXPECT_EQ(violations, 0) << (is_signed ? "signed" : "unsigned");
    EXPECT_LT(worst, 0.0071);  // the widest bins, [0.1, 1] in 64 (signed) steps: 0.9/64/2
    for (int64_t b = 0; b < 21; ++b) {
      const int64_t len = std::min<int64_t>(256, n - b * 256);
      auto blk = input.narrow(0, b * 256, len);
      EXPECT_EQ(am[b], blk.abs().max().item<float>());
      // the absmax element itself decodes exactly (code of +-1.0)
      const int64_t arg = blk.abs().argmax().item<int64_t>() + b * 256;
      if (is_signed && xa[arg] < 0) {
        EXPECT_NEAR(ba[arg], xa[arg], 0.0071 * am[b]);  // -1.0 is not in the signed map
      } else {
        EXPECT_EQ(ba[arg], xa[arg]);
      }
    }
  }
}

TEST(BlockwiseQuantization, ZeroBlocksAndErrors) {
  auto x = torch::zeros({1000});
  x.narrow(0, 300, 10).fill_(-2.5f);
  auto q = quantize_blockwise(x, signed_dynamic_map());
  EXPECT_EQ(q.absmax[0].item<float>(), 0.0f);
  EXPECT_EQ(q.absmax[1].item<float>(), 2.5f);
  EXPECT_EQ(q.absmax[3].item<float>(), 0.0f);
  auto back = dequantize_blockwise(q.codes, q.absmax, signed_dynamic_map());
  EXPECT_TRUE(torch::equal(back.narrow(0, 0, 256), torch::zeros({256})));
  EXPECT_TRUE(torch::equal(back.narrow(0, 512, 488), torch::zeros({488})));
  // -2.5 / 2.5 = -1 encodes as the signed map's minimum -0.99296875
  EXPECT_FLOAT_EQ(back[300].item<float>(), -0.99296875f * 2.5f);
  auto qu = quantize_blockwise(torch::zeros({10}), unsigned_dynamic_map());
  EXPECT_TRUE(torch::equal(dequantize_blockwise(qu.codes, qu.absmax, unsigned_dynamic_map()), torch::zeros({10})));
  // any shape; custom block size
  EXPECT_EQ(quantize_blockwise(torch::ones({3, 5, 7}), signed_dynamic_map()).codes.sizes(),
            torch::IntArrayRef({3, 5, 7}));
  auto q64 = quantize_blockwise(x, signed_dynamic_map(), 64);
  EXPECT_EQ(q64.absmax.numel(), 16);

  EXPECT_THROW(quantize_blockwise(torch::zeros({4}, torch::kDouble), signed_dynamic_map()), Error);
  auto bad = torch::zeros({4});
  bad[1] = std::numeric_limits<float>::infinity();
  EXPECT_THROW(quantize_blockwise(bad, signed_dynamic_map()), Error);
  EXPECT_THROW(quantize_blockwise(x, signed_dynamic_map(), 0), Error);
  EXPECT_THROW(dequantize_blockwise(q.codes, torch::zeros({3}), signed_dynamic_map()), Error);
  EXPECT_THROW(dequantize_blockwise(q.codes.to(torch::kInt), q.absmax, signed_dynamic_map()), Error);
}
