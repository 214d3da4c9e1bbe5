// The OCP fp8 encodings (core/fp8.h) against their published definitions
// (OCP OFP8 rev. 1.0; NVIDIA's "FP8 Formats for Deep Learning", 2022): every
// bit pattern decoded against the formula (-1)^s * 2^(e - bias) * (1 + m / 2^M)
// for normals and (-1)^s * 2^(1 - bias) * (m / 2^M) for subnormals, the
// published limits, and round-to-nearest-even encoding.
#include <cmath>
#include <limits>

#include <gtest/gtest.h>

#include "shoestring/core/fp8.h"

using namespace shoestring;

namespace {

struct Spec {
  Fp8Format format;
  int exponent_bits, mantissa_bits, bias;
};
const Spec kE4m3{Fp8Format::e4m3fn, 4, 3, 7};
const Spec kE5m2{Fp8Format::e5m2, 5, 2, 15};

// The published value of pattern b, written out from the definitions with
// std::pow (the code under test uses ldexp and a different structure).
double formula(int b, const Spec& s) {
  const int m = b & ((1 << s.mantissa_bits) - 1);
  const int e = (b >> s.mantissa_bits) & ((1 << s.exponent_bits) - 1);
  const double sign = (b & 0x80) ? -1.0 : 1.0;
  const int e_all_ones = (1 << s.exponent_bits) - 1;
  const int m_all_ones = (1 << s.mantissa_bits) - 1;
  if (s.format == Fp8Format::e4m3fn) {
    // e4m3fn ("finite"): only S.1111.111 is NaN; the rest of exponent 15 is normal.
    if (e == e_all_ones && m == m_all_ones) return std::numeric_limits<double>::quiet_NaN();
  } else if (e == e_all_ones) {
    return m == 0 ? sign * std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  }
  const double frac = m / std::pow(2.0, s.mantissa_bits);
  if (e == 0) return sign * std::pow(2.0, 1 - s.bias) * frac;
  return sign * std::pow(2.0, e - s.bias) * (1.0 + frac);
}

bool same_value(double a, double b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

}  // namespace

TEST(Fp8, DecodeEveryPatternMatchesTheFormula) {
  for (const Spec& s : {kE4m3, kE5m2}) {
    const auto& table = fp8_decode_table(s.format);
    for (int b = 0; b < 256; ++b) {
      SCOPED_TRACE(std::string(to_string(s.format)) + " pattern " + std::to_string(b));
      const double want = formula(b, s);
      EXPECT_TRUE(same_value(fp8_decode(static_cast<uint8_t>(b), s.format), want));
      EXPECT_TRUE(same_value(table[b], want));
      // The sign bit is a sign, including for zero.
      if (!std::isnan(want)) {
        EXPECT_EQ(std::signbit(table[b]), (b & 0x80) != 0);
      }
    }
  }
}

TEST(Fp8, PublishedLimits) {
  // e4m3fn: max 448 = S.1111.110, NaN = S.1111.111, no infinities, min subnormal 2^-9, min normal 2^-6.
  EXPECT_EQ(fp8_decode(0x7E, Fp8Format::e4m3fn), 448.0f);
  EXPECT_EQ(fp8_decode(0xFE, Fp8Format::e4m3fn), -448.0f);
  EXPECT_TRUE(std::isnan(fp8_decode(0x7F, Fp8Format::e4m3fn)));
  EXPECT_TRUE(std::isnan(fp8_decode(0xFF, Fp8Format::e4m3fn)));
  EXPECT_EQ(fp8_decode(0x01, Fp8Format::e4m3fn), 0.001953125f);  // 2^-9
  EXPECT_EQ(fp8_decode(0x08, Fp8Format::e4m3fn), 0.015625f);     // 2^-6
  EXPECT_EQ(fp8_decode(0x78, Fp8Format::e4m3fn), 256.0f);        // S.1111.000 is normal
  int nan = 0, inf = 0;
  for (int b = 0; b < 256; ++b) {
    const float v = fp8_decode(static_cast<uint8_t>(b), Fp8Format::e4m3fn);
    nan += std::isnan(v);
    inf += std::isinf(v);
  }
  EXPECT_EQ(nan, 2);
  EXPECT_EQ(inf, 0);
  // e5m2: max 57344 = S.11110.11, inf = S.11111.00, NaN S.11111.{01,10,11}, min subnormal 2^-16, min normal 2^-14.
  EXPECT_EQ(fp8_decode(0x7B, Fp8Format::e5m2), 57344.0f);
  EXPECT_EQ(fp8_decode(0x7C, Fp8Format::e5m2), std::numeric_limits<float>::infinity());
  EXPECT_EQ(fp8_decode(0xFC, Fp8Format::e5m2), -std::numeric_limits<float>::infinity());
  for (int b : {0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF}) EXPECT_TRUE(std::isnan(fp8_decode(b, Fp8Format::e5m2))) << b;
  EXPECT_EQ(fp8_decode(0x01, Fp8Format::e5m2), 1.52587890625e-05f);  // 2^-16
  EXPECT_EQ(fp8_decode(0x04, Fp8Format::e5m2), 6.103515625e-05f);    // 2^-14
  EXPECT_EQ(fp8_decode(0x3C, Fp8Format::e5m2), 1.0f);
  EXPECT_EQ(fp8_decode(0x38, Fp8Format::e4m3fn), 1.0f);
}

TEST(Fp8, EncodeIsTheInverseOnEveryValue) {
  for (const Spec& s : {kE4m3, kE5m2}) {
    for (int b = 0; b < 256; ++b) {
      const double v = formula(b, s);
      if (std::isnan(v)) continue;
      EXPECT_EQ(fp8_encode(static_cast<float>(v), s.format), b) << to_string(s.format) << " " << v;
    }
  }
}

TEST(Fp8, EncodeRoundsToNearestTiesToEven) {
  // Between every two adjacent non-negative finite values a < b: the midpoint
  // goes to the one with an even mantissa (last bit 0), anything below it to
  // a, above it to b. Float holds every midpoint exactly.
  for (const Spec& s : {kE4m3, kE5m2}) {
    int checked = 0;
    for (int b = 0; b + 1 < 128; ++b) {
      const double lo = formula(b, s), hi = formula(b + 1, s);
      if (!std::isfinite(lo) || !std::isfinite(hi)) continue;
      const float mid = static_cast<float>((lo + hi) / 2);
      ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2);
      const int even = (b % 2 == 0) ? b : b + 1;
      EXPECT_EQ(fp8_encode(mid, s.format), even) << to_string(s.format) << " mid " << mid;
      EXPECT_EQ(fp8_encode(-mid, s.format), even | 0x80) << to_string(s.format) << " mid " << -mid;
      EXPECT_EQ(fp8_encode(std::nextafter(mid, 0.0f), s.format), b);
      EXPECT_EQ(fp8_encode(std::nextafter(mid, 1e9f), s.format), b + 1);
      ++checked;
    }
    EXPECT_EQ(checked, s.format == Fp8Format::e4m3fn ? 126 : 123);
  }
  // Below half the smallest subnormal: zero (2^-10 is the tie between 0 and 2^-9: even is 0).
  EXPECT_EQ(fp8_encode(std::ldexp(1.0f, -10), Fp8Format::e4m3fn), 0x00);
  EXPECT_EQ(fp8_encode(std::ldexp(1.0f, -17), Fp8Format::e5m2), 0x00);
  EXPECT_EQ(fp8_encode(-1e-30f, Fp8Format::e4m3fn), 0x80);  // -0
}

TEST(Fp8, OutOfRangeSaturatesInE4m3AndOverflowsInE5m2) {
  // e4m3fn has no inf: beyond 448 (the next step would be 480) saturates to 448, inf too.
  EXPECT_EQ(fp8_encode(464.0f, Fp8Format::e4m3fn), 0x7E);
  EXPECT_EQ(fp8_encode(1e30f, Fp8Format::e4m3fn), 0x7E);
  EXPECT_EQ(fp8_encode(std::numeric_limits<float>::infinity(), Fp8Format::e4m3fn), 0x7E);
  EXPECT_EQ(fp8_encode(-std::numeric_limits<float>::infinity(), Fp8Format::e4m3fn), 0xFE);
  // e5m2: round to nearest, overflowing to inf from 57344 + half an ulp (61440) up.
  EXPECT_EQ(fp8_encode(61439.0f, Fp8Format::e5m2), 0x7B);
  EXPECT_EQ(fp8_encode(61440.0f, Fp8Format::e5m2), 0x7C);
  EXPECT_EQ(fp8_encode(-1e30f, Fp8Format::e5m2), 0xFC);
  EXPECT_EQ(fp8_encode(std::numeric_limits<float>::infinity(), Fp8Format::e5m2), 0x7C);
  // NaN stays NaN.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(fp8_encode(nan, Fp8Format::e4m3fn) & 0x7F, 0x7F);
  EXPECT_TRUE(std::isnan(fp8_decode(fp8_encode(nan, Fp8Format::e5m2), Fp8Format::e5m2)));
}
