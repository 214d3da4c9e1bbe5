// Basic layers that can be built on any device and dtype, including the meta
// device: a model built with `LayerInit{torch::kMeta}` has every parameter's
// name, shape and dtype but owns no storage, so SDXL-sized models can be
// counted and planned without allocating gigabytes (libtorch's own
// torch::nn::Linear / Conv2d always allocate on the CPU first).
//
// Parameter names and default initialisation follow PyTorch's torch.nn
// layers (weight, bias; U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for Linear and
// Conv2d, ones/zeros for norms), so checkpoints use the usual key names.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include "shoestring/nn/fp8_storage.h"

namespace shoestring::nn {

/// Where and how new parameters are created.
struct LayerInit {
  /// Device and dtype of new parameters. On the meta device no values are
  /// written (parameters have shapes but no storage).
  torch::TensorOptions options = torch::TensorOptions().dtype(torch::kFloat32);
  LayerInit() = default;
  /// Shorthand: `LayerInit{torch::kMeta}` builds on the meta device in fp32.
  LayerInit(torch::Device device) : options(torch::TensorOptions().dtype(torch::kFloat32).device(device)) {}
  LayerInit(torch::DeviceType type) : LayerInit(torch::Device(type)) {}
  explicit LayerInit(torch::TensorOptions o) : options(o) {}
  /// False: allocate parameters but leave them uninitialised (torch::empty),
  /// for a model whose weights are loaded from a checkpoint next.
  bool initialize = true;
  /// True when parameters are created without storage.
  bool is_meta() const { return options.device().is_meta(); }
  /// True when new parameters get their default initial values.
  bool fills_values() const { return initialize && !is_meta(); }
};

/// Optional additive adapter of a Linear or Conv2d layer (LoRA, nn/lora.h):
/// when set, the layer's forward returns base(x) + adapter(x), where base(x)
/// is the plain layer output and adapter(x) receives the same input and must
/// return a tensor of base(x)'s shape. The adapter is not a submodule: its
/// parameters are not among the layer's parameters(), so the layer's
/// checkpoint keys do not change. Empty (the default) costs nothing.
using LayerAdapter = std::function<torch::Tensor(const torch::Tensor& x)>;

/// y = x W^T + b (+ adapter(x) when an adapter is set). weight:
/// [out_features, in_features]; bias: [out_features].
/// Throws shoestring::Error on non-positive sizes.
class LinearImpl : public torch::nn::Module {
 public:
  LinearImpl(int64_t in_features, int64_t out_features, bool bias = true, const LayerInit& init = {});
  /// x: [..., in_features] -> [..., out_features], in x's dtype (weights must match).
  /// Inside a block with a compute dtype (nn/block_precision.h: current_compute_dtype())
  /// x, weight and bias are first cast to it, so weights may be stored in any dtype;
  /// the same holds for Conv2d, and Embedding returns that dtype.
  /// With weight_fp8 set, `weight` holds fp8 bytes and is decoded right
  /// before the matmul (nn/fp8_storage.h: fp8_linear).
  /// bias_scale multiplies the bias (added after the matmul, never through a
  /// cancellation): forward(s x, s) = s forward(x) for a stream held at
  /// scale s (Stable Cascade's activation rescaling, models/cascade.h).
  torch::Tensor forward(const torch::Tensor& x, double bias_scale = 1.0);
  int64_t in_features, out_features;
  torch::Tensor weight, bias;
  LayerAdapter adapter;  ///< see LayerAdapter; empty by default
  /// Set when `weight` is stored as fp8 bytes (by precision::apply).
  std::optional<Fp8Storage> weight_fp8;
};
TORCH_MODULE(Linear);

/// 2-D convolution (+ adapter(x) when an adapter is set, see LayerAdapter).
/// weight: [out, in / groups, k, k]; bias: [out].
/// Throws shoestring::Error on non-positive sizes or in/out not divisible by groups.
class Conv2dImpl : public torch::nn::Module {
 public:
  Conv2dImpl(int64_t in_channels, int64_t out_channels, int64_t kernel_size, int64_t stride = 1, int64_t padding = 0,
             bool bias = true, const LayerInit& init = {}, int64_t groups = 1);
  /// x: [B, in_channels, H, W] -> [B, out_channels, H', W']. With weight_fp8
  /// set, `weight` holds fp8 bytes decoded right before the convolution
  /// (nn/fp8_storage.h: fp8_conv2d). bias_scale as in LinearImpl::forward.
  torch::Tensor forward(const torch::Tensor& x, double bias_scale = 1.0);
  int64_t in_channels, out_channels, kernel_size, stride, padding, groups;
  torch::Tensor weight, bias;
  LayerAdapter adapter;  ///< see LayerAdapter; empty by default
  /// Set when `weight` is stored as fp8 bytes (by precision::apply).
  std::optional<Fp8Storage> weight_fp8;
};
TORCH_MODULE(Conv2d);

/// Transposed 2-D convolution (torch.nn.ConvTranspose2d, no output padding,
/// no dilation). weight: [in, out / groups, k, k]; bias: [out]. Output size
/// (H - 1) * stride - 2 * padding + k. Initialised as PyTorch does (uniform,
/// bound 1 / sqrt(out / groups * k * k)). Throws shoestring::Error on
/// non-positive sizes or in/out not divisible by groups.
class ConvTranspose2dImpl : public torch::nn::Module {
 public:
  ConvTranspose2dImpl(int64_t in_channels, int64_t out_channels, int64_t kernel_size, int64_t stride = 1,
                      int64_t padding = 0, bool bias = true, const LayerInit& init = {}, int64_t groups = 1);
  /// x: [B, in_channels, H, W] -> [B, out_channels, H', W'] in x's (or the
  /// block's compute) dtype; bf16 / fp16 on the CPU are computed in fp32.
  torch::Tensor forward(const torch::Tensor& x);
  int64_t in_channels, out_channels, kernel_size, stride, padding, groups;
  torch::Tensor weight, bias;
};
TORCH_MODULE(ConvTranspose2d);

/// Batch normalisation (Ioffe & Szegedy 2015) in evaluation form only, for
/// frozen pretrained networks (Stable Cascade's EfficientNet encoder and
/// previewer): y = (x - running_mean) / sqrt(running_var + eps) * weight + bias
/// per channel of [B, C, ...], with the stored statistics whatever the
/// module's training flag (batch statistics are never computed or updated).
/// Buffers running_mean, running_var [C] (0 and 1 initially); weight and bias
/// [C] when affine. torch.nn.BatchNorm2d's num_batches_tracked counter is not
/// kept (nothing here reads it; loaders skip the key). Computes in fp32 for
/// bf16/fp16 inputs and returns the input dtype. Throws shoestring::Error on a
/// non-positive channel count or a wrong input shape.
class BatchNorm2dImpl : public torch::nn::Module {
 public:
  BatchNorm2dImpl(int64_t channels, double eps = 1e-5, bool affine = true, const LayerInit& init = {});
  /// x: [B, channels, H, W] -> same shape and dtype.
  torch::Tensor forward(const torch::Tensor& x);
  int64_t channels;
  double eps;
  torch::Tensor weight, bias, running_mean, running_var;
};
TORCH_MODULE(BatchNorm2d);

/// Group normalisation (Wu & He 2018) over [B, C, ...]; weight and bias [C]
/// when affine. Computes in fp32 for bf16/fp16 inputs and returns the input
/// dtype. Throws shoestring::Error when groups does not divide channels.
class GroupNormImpl : public torch::nn::Module {
 public:
  GroupNormImpl(int64_t groups, int64_t channels, double eps = 1e-5, bool affine = true, const LayerInit& init = {});
  torch::Tensor forward(const torch::Tensor& x);
  int64_t groups, channels;
  double eps;
  torch::Tensor weight, bias;
};
TORCH_MODULE(GroupNorm);

/// Layer normalisation (Ba et al. 2016) over the last dimension; weight and
/// bias [dim] when elementwise_affine (bias only if `bias`). Computes in fp32
/// for bf16/fp16 inputs and returns the input dtype.
class LayerNormImpl : public torch::nn::Module {
 public:
  LayerNormImpl(int64_t dim, double eps = 1e-5, bool elementwise_affine = true, bool bias = true,
                const LayerInit& init = {});
  torch::Tensor forward(const torch::Tensor& x);
  int64_t dim;
  double eps;
  torch::Tensor weight, bias;
};
TORCH_MODULE(LayerNorm);

/// RMS normalisation (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) * weight
/// over the last dimension; weight [dim] when elementwise_affine. fp32 math.
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps = 1e-6, bool elementwise_affine = true, const LayerInit& init = {});
  torch::Tensor forward(const torch::Tensor& x);
  int64_t dim;
  double eps;
  torch::Tensor weight;
};
TORCH_MODULE(RMSNorm);

/// Token embedding table. weight: [num_embeddings, dim]; init N(0, 1) as torch.nn.Embedding.
class EmbeddingImpl : public torch::nn::Module {
 public:
  EmbeddingImpl(int64_t num_embeddings, int64_t dim, const LayerInit& init = {});
  /// ids: int64 [...] -> [..., dim]. Throws shoestring::Error on out-of-range ids.
  torch::Tensor forward(const torch::Tensor& ids);
  int64_t num_embeddings, dim;
  torch::Tensor weight;
};
TORCH_MODULE(Embedding);

/// Number of elements in every parameter of `module` (works on meta modules).
int64_t parameter_count(const torch::nn::Module& module);

}  // namespace shoestring::nn
