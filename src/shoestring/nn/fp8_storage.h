// Frozen weights stored as fp8: one byte per element plus a per-tensor scale,
// dequantized layer by layer in forward (docs/precision.md, "fp8 storage").
//
// A Linear or Conv2d whose `weight_fp8` is set holds in `weight` the fp8 bit
// patterns of weight * scale (core/fp8.h; dtype compat::fp8_storage_dtype:
// uint8 on libtorch 1.13, at::kFloat8_* on libtorch >= 2.1), frozen
// (requires_grad false). Its forward decodes the bytes into the compute dtype
// right before the matmul / convolution (fp8_linear, fp8_conv2d) and frees
// them right after: autograd keeps only the bytes (which the layer holds
// anyway), and backward decodes them once more to compute the input gradient
// (x's gradient needs W; the weight, being frozen, needs none). So a model
// with an fp8 base holds about one byte per base parameter, plus one layer's
// dequantized weight at a time.
//
// The precision policy (precision::apply) is what packs weights; models only
// use nn::Linear / nn::Conv2d. Parameters of other layers stay in their
// containers (precision/dtype.h).
#pragma once
#include <map>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "shoestring/core/fp8.h"

namespace shoestring::nn {

/// How a parameter's fp8 bytes map to values: value = fp8_decode(byte) / scale.
/// `scale` is a power of two chosen by precision::quantize_fp8.
struct Fp8Storage {
  Fp8Format format = Fp8Format::e4m3fn;
  double scale = 1.0;
};

/// True for the one-byte dtypes fp8 bytes are held in on this build (uint8 on
/// libtorch 1.13, float8 on libtorch >= 2.1; compat::fp8_storage_dtype).
bool is_fp8_storage_dtype(at::ScalarType t);

/// The floating dtype a layer's parameter computes in when no compute dtype
/// is set (nn/block_precision.h): `param`'s own dtype, or fp32 when it holds
/// fp8 bytes. For models that choose their input dtype from a weight.
at::ScalarType value_dtype(const at::Tensor& param);

/// fp8 bytes `bits` (any shape, dtype compat::fp8_storage_dtype or uint8, any
/// device) decoded to `dtype` (a floating type): fp8_decode(b) / s.scale per
/// element, exact for fp32 and bf16 (every fp8 value times a power of two is
/// a bf16 value in range), rounded to nearest for fp16. Contiguous result.
/// Throws shoestring::Error when `bits` is not a one-byte tensor.
at::Tensor dequantize_fp8(const at::Tensor& bits, const Fp8Storage& s, at::ScalarType dtype);

/// `values` (floating, any device) times s.scale, encoded to fp8 bytes with
/// fp8_encode (round to nearest even; e4m3fn saturates, e5m2 overflows to
/// inf), in compat::fp8_storage_dtype(s.format), on values' device.
at::Tensor encode_fp8(const at::Tensor& values, const Fp8Storage& s);

/// x W^T for W = dequantize_fp8(bits, s, x's dtype): x [..., in], bits
/// [out, in] -> [..., out]. Differentiable in x only; W is decoded in forward
/// and again in backward and never saved.
at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& bits, const Fp8Storage& s);

/// conv2d(x, W) (no bias, dilation 1) for W = dequantize_fp8(bits, s, x's
/// dtype): x [B, in, H, W], bits [out, in / groups, k, k]. Differentiable in x
/// only (the gradient is the transposed convolution); W is never saved.
at::Tensor fp8_conv2d(const at::Tensor& x, const at::Tensor& bits, const Fp8Storage& s, int64_t stride, int64_t padding,
                      int64_t groups);

/// The fp8 slot of parameter `name` (a direct parameter of `owner`): the
/// `weight_fp8` of an nn::Linear or nn::Conv2d for "weight", else nullptr
/// (that parameter cannot be computed from fp8 bytes).
std::optional<Fp8Storage>* fp8_slot(torch::nn::Module& owner, const std::string& name);

/// True when fp8_slot(owner, name) would be non-null (owner may be on the
/// meta device; used by the planner and precision::resolve).
bool can_store_fp8(const torch::nn::Module& owner, const std::string& name);

/// Every parameter of `root` stored as fp8 bytes, by dotted path.
std::map<std::string, Fp8Storage> fp8_parameters(const torch::nn::Module& root);

}  // namespace shoestring::nn
