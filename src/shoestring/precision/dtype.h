// Precision dtypes as the rules name them (fp32, bf16, fp16, fp8_e4m3,
// fp8_e5m2), their ranges, and fp8 quantization for frozen weights.
//
// The fp8 bit encodings themselves are core/fp8.h's; packed fp8 weights are
// nn/fp8_storage.h's.
//
// Ranges (IEEE 754 binary16; bfloat16; OCP / NVIDIA Transformer Engine FP8):
//   fp16: max finite 65504, smallest normal 2^-14 (6.10e-5), smallest subnormal 2^-24 (5.96e-8)
//   bf16: max finite 3.3895e38 (same exponent range as fp32), smallest subnormal 2^-133
//   fp8_e4m3 (e4m3fn): max 448, no inf, smallest subnormal 2^-9
//   fp8_e5m2: max 57344, has inf, smallest subnormal 2^-16
#pragma once
#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

#include "shoestring/core/fp8.h"

namespace shoestring::precision {

enum class Dtype { fp32, bf16, fp16, fp8_e4m3, fp8_e5m2 };

/// "fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2".
const char* to_string(Dtype d);

/// The short name of a tensor dtype: "fp32", "bf16", "fp16" for kFloat,
/// kBFloat16, kHalf (the rules' names), else libtorch's ("Byte", ...).
const char* name_of(at::ScalarType t);

/// Parses a rule dtype name (exact: fp32 | bf16 | fp16 | fp8_e4m3 | fp8_e5m2).
/// Returns false for anything else.
bool parse_dtype(const std::string& s, Dtype& out);

/// True for fp8_e4m3 and fp8_e5m2.
inline bool is_fp8(Dtype d) { return d == Dtype::fp8_e4m3 || d == Dtype::fp8_e5m2; }

/// Largest finite value of `d` (fp32: FLT_MAX).
double max_finite(Dtype d);

/// Smallest positive (subnormal) value of `d`.
double min_positive(Dtype d);

/// The floating-point container a tensor of storage `d` is held in when it
/// is not packed as fp8 bytes: fp32 -> kFloat, bf16 -> kBFloat16, fp16 ->
/// kHalf. fp8: kBFloat16, which holds every fp8 value times a power-of-two
/// scale exactly. fp8 weights of nn::Linear / nn::Conv2d are not held in a
/// container but packed as one byte per element (fp8_packed_dtype,
/// nn/fp8_storage.h); every other fp8 parameter (norm weights, biases, ...)
/// keeps its fp8 values in this container.
at::ScalarType container_dtype(Dtype d);

/// Bytes per element of container_dtype(d) (fp8 counts 2: its bf16 container;
/// packed fp8 weights take 1, see precision::storage_bytes).
int64_t container_bytes(Dtype d);

/// core/fp8.h's format of an fp8 dtype (fp8_e4m3 -> e4m3fn, fp8_e5m2 -> e5m2).
/// Throws shoestring::Error for non-fp8 dtypes.
Fp8Format fp8_format(Dtype d);

/// The one-byte dtype packed fp8 weights of `d` are held in:
/// at::kFloat8_e4m3fn / kFloat8_e5m2 on libtorch >= 2.1, else at::kByte with
/// the same bit patterns (core/torch_compat.h: compat::fp8_storage_dtype).
at::ScalarType fp8_packed_dtype(Dtype d);

/// Rounds every element of `x` (float32) to the nearest value of fp8 format
/// `d` (round half to even; e4m3 saturates at +-448, e5m2 overflows to inf
/// beyond 57344 + half an ulp; NaN stays NaN). Returns float32.
at::Tensor round_to_fp8(const at::Tensor& x, Dtype d);

/// Per-tensor fp8 quantization for frozen weights: scale = 2^floor(log2(fp8_max /
/// amax)) (a power of two, so the dequantized values q / scale are exact in
/// bf16; Transformer Engine uses fp8_max / amax itself, which wastes at most
/// one bit of range less). amax = 0 gives scale 1.
struct Fp8Quantized {
  at::Tensor dequantized;  ///< float32, values round_to_fp8(x * scale) / scale
  at::Tensor bits;         ///< the fp8 bytes of x * scale, in fp8_packed_dtype(d), on x's device
  double scale = 1.0;      ///< multiply the fp32 value by this before rounding
  int64_t flushed = 0;     ///< nonzero inputs that became 0
};
Fp8Quantized quantize_fp8(const at::Tensor& x, Dtype d);

}  // namespace shoestring::precision
