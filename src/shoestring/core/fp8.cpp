#include "shoestring/core/fp8.h"

#include <cmath>
#include <limits>

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include "shoestring/core/error.h"

namespace shoestring {
namespace {

struct Layout {
  int mantissa_bits;
  int bias;
  double max;
  bool has_inf;  // e5m2; e4m3fn saturates
};

Layout layout(Fp8Format f) {
  return f == Fp8Format::e4m3fn ? Layout{3, 7, 448.0, false} : Layout{2, 15, 57344.0, true};
}

std::array<float, 256> make_table(Fp8Format f) {
  std::array<float, 256> t{};
  for (int i = 0; i < 256; ++i) t[i] = fp8_decode(static_cast<uint8_t>(i), f);
  return t;
}

}  // namespace

const char* to_string(Fp8Format f) { return f == Fp8Format::e4m3fn ? "e4m3fn" : "e5m2"; }

float fp8_decode(uint8_t bits, Fp8Format f) {
  const Layout l = layout(f);
  const int exp_bits = 7 - l.mantissa_bits;
  const int mant = bits & ((1 << l.mantissa_bits) - 1);
  const int exp = (bits >> l.mantissa_bits) & ((1 << exp_bits) - 1);
  const bool negative = (bits & 0x80) != 0;
  const int exp_max = (1 << exp_bits) - 1;
  double v;
  if (f == Fp8Format::e4m3fn && exp == exp_max && mant == (1 << l.mantissa_bits) - 1) {
    v = std::numeric_limits<double>::quiet_NaN();
  } else if (l.has_inf && exp == exp_max) {
    v = mant == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  } else if (exp == 0) {
    v = std::ldexp(static_cast<double>(mant), 1 - l.bias - l.mantissa_bits);
  } else {
    v = std::ldexp(static_cast<double>((1 << l.mantissa_bits) + mant), exp - l.bias - l.mantissa_bits);
  }
  return static_cast<float>(negative ? -v : v);
}

const std::array<float, 256>& fp8_decode_table(Fp8Format f) {
  static const std::array<float, 256> e4m3 = make_table(Fp8Format::e4m3fn);
  static const std::array<float, 256> e5m2 = make_table(Fp8Format::e5m2);
  return f == Fp8Format::e4m3fn ? e4m3 : e5m2;
}

uint8_t fp8_encode(float x, Fp8Format f) {
  const Layout l = layout(f);
  const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
  if (std::isnan(x)) return sign | 0x7F;
  const double a = std::fabs(static_cast<double>(x));
  const int min_exponent = 1 - l.bias;  // of the smallest normal
  const int exp_field_max = (1 << (7 - l.mantissa_bits)) - 1;
  if (a == 0.0) return sign;
  double q;  // a rounded to the format's grid, before the range check
  if (std::isinf(a)) {
    q = std::numeric_limits<double>::infinity();
  } else {
    int e = std::ilogb(a);  // a = m * 2^e, 1 <= m < 2
    if (e < min_exponent) e = min_exponent;
    const double ulp = std::ldexp(1.0, e - l.mantissa_bits);
    q = std::nearbyint(a / ulp) * ulp;  // ties to even in the default rounding mode
  }
  if (q > l.max) {
    if (l.has_inf) return sign | static_cast<uint8_t>(exp_field_max << l.mantissa_bits);  // inf
    q = l.max;
  }
  if (q == 0.0) return sign;
  int e = std::ilogb(q);
  if (e < min_exponent) {  // subnormal: exponent field 0
    return sign | static_cast<uint8_t>(std::ldexp(q, l.bias - 1 + l.mantissa_bits));
  }
  const int mant = static_cast<int>(std::ldexp(q, l.mantissa_bits - e)) - (1 << l.mantissa_bits);
  return sign | static_cast<uint8_t>(((e + l.bias) << l.mantissa_bits) | mant);
}

at::Tensor fp8_decode_tensor(const at::Tensor& bytes, Fp8Format f, double scale, at::ScalarType dtype) {
  if (bytes.scalar_type() != at::kByte)
    fail("fp8_decode_tensor: expected uint8 bit patterns, got a {} tensor", c10::toString(bytes.scalar_type()));
  if (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf)
    fail("fp8_decode_tensor: target dtype must be fp32, bf16 or fp16, got {}", c10::toString(dtype));
  const std::array<float, 256>& table = fp8_decode_table(f);
  std::array<float, 256> scaled{};
  const float inv = static_cast<float>(1.0 / scale);  // a power of two: exact
  for (int i = 0; i < 256; ++i) scaled[i] = table[i] * inv;
  const at::Tensor b = bytes.contiguous();
  if (!b.device().is_cpu()) {
    // Device-generic path: a 256-entry lookup with ATen ops.
    at::Tensor lut = at::from_blob(scaled.data(), {256}, at::TensorOptions().dtype(at::kFloat)).to(b.device());
    return lut.index_select(0, b.reshape({-1}).to(at::kLong)).view(b.sizes()).to(dtype);
  }
  at::Tensor out = at::empty(b.sizes(), b.options().dtype(dtype));
  const uint8_t* in = b.data_ptr<uint8_t>();
  constexpr int64_t kGrain = 1 << 15;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "fp8_decode_tensor", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, b.numel(), kGrain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) o[i] = static_cast<scalar_t>(scaled[in[i]]);
    });
  });
  return out;
}

}  // namespace shoestring
