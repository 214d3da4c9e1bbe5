#include "shoestring/precision/dtype.h"

#include <cfloat>
#include <cmath>
#include <limits>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/torch_compat.h"
#include "shoestring/nn/fp8_storage.h"

namespace shoestring::precision {

const char* to_string(Dtype d) {
  switch (d) {
    case Dtype::fp32: return "fp32";
    case Dtype::bf16: return "bf16";
    case Dtype::fp16: return "fp16";
    case Dtype::fp8_e4m3: return "fp8_e4m3";
    case Dtype::fp8_e5m2: return "fp8_e5m2";
  }
  return "?";
}

const char* name_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "fp32";
    case at::kBFloat16: return "bf16";
    case at::kHalf: return "fp16";
    default: return c10::toString(t);
  }
}

bool parse_dtype(const std::string& s, Dtype& out) {
  for (Dtype d : {Dtype::fp32, Dtype::bf16, Dtype::fp16, Dtype::fp8_e4m3, Dtype::fp8_e5m2}) {
    if (s == to_string(d)) {
      out = d;
      return true;
    }
  }
  return false;
}

double max_finite(Dtype d) {
  switch (d) {
    case Dtype::fp32: return FLT_MAX;
    case Dtype::bf16: return 3.3895313892515355e38;  // 0x7F7F
    case Dtype::fp16: return 65504.0;
    case Dtype::fp8_e4m3: return 448.0;
    case Dtype::fp8_e5m2: return 57344.0;
  }
  return 0;
}

double min_positive(Dtype d) {
  switch (d) {
    case Dtype::fp32: return std::ldexp(1.0, -149);
    case Dtype::bf16: return std::ldexp(1.0, -133);
    case Dtype::fp16: return std::ldexp(1.0, -24);
    case Dtype::fp8_e4m3: return std::ldexp(1.0, -9);
    case Dtype::fp8_e5m2: return std::ldexp(1.0, -16);
  }
  return 0;
}

at::ScalarType container_dtype(Dtype d) {
  switch (d) {
    case Dtype::fp32: return at::kFloat;
    case Dtype::fp16: return at::kHalf;
    default: return at::kBFloat16;
  }
}

int64_t container_bytes(Dtype d) { return d == Dtype::fp32 ? 4 : 2; }

Fp8Format fp8_format(Dtype d) {
  if (d == Dtype::fp8_e4m3) return Fp8Format::e4m3fn;
  if (d == Dtype::fp8_e5m2) return Fp8Format::e5m2;
  fail("fp8 format expected, got {}", to_string(d));
}

at::ScalarType fp8_packed_dtype(Dtype d) { return compat::fp8_storage_dtype(fp8_format(d) == Fp8Format::e4m3fn); }

at::Tensor round_to_fp8(const at::Tensor& x, Dtype d) {
  const Fp8Format f = fp8_format(d);
  at::Tensor src = x.detach().to(at::kFloat).contiguous().cpu();
  at::Tensor out = torch::empty_like(src);
  const float* in = src.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t n = src.numel();
  for (int64_t i = 0; i < n; ++i) o[i] = fp8_decode(fp8_encode(in[i], f), f);
  return out;
}

Fp8Quantized quantize_fp8(const at::Tensor& x, Dtype d) {
  const Fp8Format f = fp8_format(d);
  at::Tensor src = x.detach().to(at::kFloat).contiguous().cpu();
  const double amax = src.numel() ? src.abs().max().item<double>() : 0.0;
  Fp8Quantized q;
  if (amax > 0 && std::isfinite(amax))
    q.scale = std::ldexp(1.0, static_cast<int>(std::floor(std::log2(max_finite(d) / amax))));
  const nn::Fp8Storage storage{f, q.scale};
  at::Tensor bits = nn::encode_fp8(src, storage);
  q.dequantized = nn::dequantize_fp8(bits, storage, at::kFloat);
  q.flushed = (src.ne(0) & q.dequantized.eq(0)).sum().item<int64_t>();
  q.bits = bits.to(x.device());
  return q;
}

}  // namespace shoestring::precision
