// The two OCP 8-bit floating-point formats (OCP 8-bit Floating Point
// Specification (OFP8) rev. 1.0, 2023; the formats of NVIDIA Transformer
// Engine, PyTorch's float8_e4m3fn / float8_e5m2 and safetensors' F8_E4M3 /
// F8_E5M2), bit pattern <-> value:
//
//   e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits. No infinities;
//           S.1111.111 (0x7F / 0xFF) is NaN, so S.1111.110 = +-448 is the
//           largest finite value. Subnormals down to 2^-9.
//   e5m2:   1 sign, 5 exponent (bias 15), 2 mantissa bits, IEEE-like:
//           S.11111.00 (0x7C / 0xFC) is +-inf, S.11111.{01,10,11} NaN.
//           Largest finite 57344, subnormals down to 2^-16.
//
// This is the one encoder / decoder shoestring has: precision rules quantize
// frozen weights with it (precision/dtype.h), layers decode fp8 weights with
// its table (nn/fp8_storage.h). Independent of the libtorch version: on
// libtorch without float8 dtypes the bytes live in uint8 tensors, with them in
// at::kFloat8_e4m3fn / kFloat8_e5m2 tensors (core/torch_compat.h).
#pragma once
#include <array>
#include <cstdint>

#include <ATen/ATen.h>

namespace shoestring {

enum class Fp8Format { e4m3fn, e5m2 };

/// "e4m3fn" or "e5m2".
const char* to_string(Fp8Format f);

/// The value of bit pattern `bits` in format `f` (exact as a float; NaN for
/// the NaN patterns, +-inf for e5m2's 0x7C / 0xFC).
float fp8_decode(uint8_t bits, Fp8Format f);

/// The 256 values of format `f`, indexed by bit pattern (fp8_decode of each).
const std::array<float, 256>& fp8_decode_table(Fp8Format f);

/// The bit pattern of `x` rounded to the nearest value of `f`, ties to even
/// mantissa. Out of range: e4m3fn saturates to +-448 (values beyond it,
/// +-inf included: the format has no inf, and saturation is what
/// Transformer Engine and torch's float8 casts with saturate do for weights);
/// e5m2 rounds to +-inf from 61440 (57344 + half its ulp) up, as IEEE
/// overflow does. NaN -> 0x7F (sign kept: 0xFF for a negative NaN). Zero
/// keeps its sign (-0 -> 0x80).
uint8_t fp8_encode(float x, Fp8Format f);

/// The values of fp8 bit patterns `bytes` (a uint8 tensor of any shape, on
/// any device) in format `f`, divided by `scale` (a power of two, so the
/// division is exact), as a new tensor of `dtype` (fp32, bf16 or fp16) of
/// the same shape: fp8_decode of each element, rounded once to `dtype`. CPU
/// tensors decode through the 256-entry table in one pass; others through a
/// device-generic ATen lookup with the same values. Used by fp8 layers
/// (nn/fp8_storage.h) and by the loading of F8_E4M3 / F8_E5M2 files into
/// float tensors where libtorch has no float8 dtype (io/weight_files.h).
/// Throws shoestring::Error for a tensor that is not uint8 or a `dtype`
/// that is not fp32 / bf16 / fp16.
at::Tensor fp8_decode_tensor(const at::Tensor& bytes, Fp8Format f, double scale, at::ScalarType dtype);

}  // namespace shoestring
