// Stable Cascade's frozen image <-> latent networks around stage C:
//
// - EfficientNetEncoder, the stage C latent encoder (Stability-AI/StableCascade
//   modules/effnet.py, released as `effnet_encoder.safetensors`): the feature
//   extractor of EfficientNetV2-S (Tan & Le 2021, "EfficientNetV2: Smaller
//   Models and Faster Training", arXiv 2104.00298) in torchvision's layout
//   (torchvision/models/efficientnet.py, `efficientnet_v2_s().features`),
//   then a 1x1 conv to 16 channels and a BatchNorm without affine parameters
//   that makes each latent channel roughly zero-mean, unit-variance. Keys:
//
//     backbone.0.{0,1}.*                         stem: conv 3x3 s2 + BN (+ SiLU)
//     backbone.<s>.<i>.block.<j>.{0,1}.*          stages 1..6 (FusedMBConv, MBConv)
//     backbone.<s>.<i>.block.2.{fc1,fc2}.*        MBConv's squeeze-excitation
//     backbone.7.{0,1}.*                          head: conv 1x1 to 1280 + BN (+ SiLU)
//     mapper.0.weight, mapper.1.{running_mean,running_var}
//
//   20,197,968 parameters and BatchNorm statistics are not among them: 20,177,488
//   in the backbone (torchvision's 21,458,488 for V2-S less its 1280 x 1000
//   classifier) and 20,480 in mapper.0 (counted from the architecture below).
//
// - Previewer (StableCascade modules/previewer.py, `previewer.safetensors`):
//   16-channel stage C latents -> an RGB image 8x larger, roughly in [0, 1],
//   for previews during training without stage B and A. Keys blocks.<n>.* as
//   its nn.Sequential: convs, ConvTranspose2d upsamplers, BatchNorms.
//
// Both run in evaluation form only (BatchNorm with the stored statistics,
// nn/layers.h: BatchNorm2d); files carry torch's `*.num_batches_tracked`
// counters, which load_cascade_coder skips.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "shoestring/io/weight_files.h"
#include "shoestring/nn/layers.h"

namespace shoestring::models {

/// One stage of EfficientNetV2's feature extractor (a row of torchvision's
/// `_efficientnet_conf`): `layers` blocks, the first taking in_channels with
/// `stride`, the rest out_channels -> out_channels with stride 1.
struct EfficientNetStage {
  bool fused = false;        ///< FusedMBConv (true) or MBConv with squeeze-excitation
  int64_t expand_ratio = 1;  ///< hidden width = block input channels x expand_ratio
  int64_t kernel = 3;        ///< kernel of the spatial conv (3 in V2-S)
  int64_t stride = 1;        ///< of the stage's first block
  int64_t in_channels = 0, out_channels = 0;
  int64_t layers = 1;
};

/// Hyper-parameters of EfficientNetEncoder. Defaults: the released encoder
/// (EfficientNetV2-S, torchvision `_efficientnet_conf("efficientnet_v2_s")`;
/// StableCascade `EfficientNetEncoder(c_latent=16)`).
struct EfficientNetEncoderOptions {
  /// Output channels of the stem conv (backbone.0).
  TORCH_ARG(int64_t, stem_channels) = 24;
  TORCH_ARG(std::vector<EfficientNetStage>, stages) = v2_s_stages();
  /// Output channels of the 1x1 head conv (backbone.7).
  TORCH_ARG(int64_t, head_channels) = 1280;
  TORCH_ARG(int64_t, latent_channels) = 16;
  /// Device/dtype of the parameters; nn::LayerInit{torch::kMeta} allocates nothing.
  TORCH_ARG(nn::LayerInit, init) = nn::LayerInit{};

 public:  // (TORCH_ARG leaves the section private)
  /// The six stages of V2-S: FusedMBConv (1,3,1,24,24,2), (4,3,2,24,48,4),
  /// (4,3,2,48,64,4), MBConv (4,3,2,64,128,6), (6,3,1,128,160,9), (6,3,2,160,256,15).
  static std::vector<EfficientNetStage> v2_s_stages();
  /// The same structure at test size (stem 8, stages 8-16-24-32-40-48 with 1-2
  /// blocks each and expansion 1-4, head 64; 88,962 parameters);
  /// scripts/gen_cascade_coders_reference.py builds the same.
  static EfficientNetEncoderOptions micro();
};

/// torchvision's Conv2dNormActivation: conv (no bias; padding (k - 1) / 2) ->
/// BatchNorm (eps 1e-3) -> SiLU when `activation`. Keys `0.weight`, `1.*`.
class ConvNormActivationImpl : public torch::nn::Module {
 public:
  ConvNormActivationImpl(int64_t in, int64_t out, int64_t kernel, int64_t stride, int64_t groups, bool activation,
                         const nn::LayerInit& init);
  /// x: [B, in, H, W] -> [B, out, ceil(H / stride), ceil(W / stride)].
  torch::Tensor forward(const torch::Tensor& x);
  nn::Conv2d conv{nullptr};
  nn::BatchNorm2d norm{nullptr};
  bool activation;
};
TORCH_MODULE(ConvNormActivation);

/// torchvision's SqueezeExcitation with SiLU inside: x * sigmoid(fc2(silu(fc1(mean_hw(x))))),
/// fc1 / fc2 1x1 convs with bias.
class SqueezeExcitationImpl : public torch::nn::Module {
 public:
  SqueezeExcitationImpl(int64_t channels, int64_t squeeze_channels, const nn::LayerInit& init);
  /// x: [B, channels, H, W] -> same shape.
  torch::Tensor forward(const torch::Tensor& x);
  nn::Conv2d fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(SqueezeExcitation);

/// One FusedMBConv or MBConv block (torchvision efficientnet.py). Its layers
/// live under `block.<j>`:
///   fused, expand 1:  block.0 = CNA(in, out, k, stride, SiLU)
///   fused, expand e:  block.0 = CNA(in, in*e, k, stride, SiLU), block.1 = CNA(in*e, out, 1)
///   MBConv:           block.0 = CNA(in, in*e, 1, SiLU), block.1 = depthwise CNA(in*e, k, stride, SiLU),
///                     block.2 = SqueezeExcitation(in*e, max(1, in / 4)), block.3 = CNA(in*e, out, 1)
/// with x added back when stride is 1 and in == out (stochastic depth is the
/// identity at inference).
class EfficientNetBlockImpl : public torch::nn::Module {
 public:
  EfficientNetBlockImpl(const EfficientNetStage& stage, int64_t in, int64_t stride, const nn::LayerInit& init);
  torch::Tensor forward(const torch::Tensor& x);
  std::vector<ConvNormActivation> layers;  ///< the CNAs in order (SE between the 2nd and 3rd of MBConv)
  SqueezeExcitation se{nullptr};
  bool residual;
};
TORCH_MODULE(EfficientNetBlock);

/// Stable Cascade's stage C latent encoder (see the file comment).
class EfficientNetEncoderImpl : public torch::nn::Module {
 public:
  /// Throws shoestring::Error when a stage's in_channels is not the previous
  /// stage's out_channels (the stem's for the first) or a size is not positive.
  explicit EfficientNetEncoderImpl(const EfficientNetEncoderOptions& options = {});
  /// x: [B, 3, H, W], an RGB image already normalised with ImageNet's mean and
  /// std -> latents [B, latent_channels, ceil(H / 32), ceil(W / 32)] (five
  /// stride-2 convs with padding 1, each rounding up), in the dtype of the
  /// parameters (x is cast to it). Throws shoestring::Error on a wrong shape.
  torch::Tensor forward(const torch::Tensor& x);
  /// images: [B, 3, H, W] in [-1, 1] (the range of shoestring's image loader) ->
  /// forward(normalise((images + 1) / 2)) with ImageNet's mean (0.485, 0.456,
  /// 0.406) and std (0.229, 0.224, 0.225), as StableCascade train/train_c.py's
  /// effnet_preprocess after kohya's stable_cascade.py maps [-1, 1] to [0, 1].
  /// No scale factor follows (stage C consumes the mapper's output as is).
  torch::Tensor encode(const torch::Tensor& images);

  const EfficientNetEncoderOptions& options() const { return options_; }

  ConvNormActivation stem{nullptr}, head{nullptr};
  std::vector<std::vector<EfficientNetBlock>> stages;  ///< backbone.1 .. backbone.<n>
  nn::Conv2d mapper_conv{nullptr};                     ///< mapper.0
  nn::BatchNorm2d mapper_norm{nullptr};                ///< mapper.1 (no affine, eps 1e-5)

 private:
  EfficientNetEncoderOptions options_;
};
TORCH_MODULE(EfficientNetEncoder);

/// Hyper-parameters of Previewer (StableCascade modules/previewer.py defaults).
struct PreviewerOptions {
  TORCH_ARG(int64_t, in_channels) = 16;
  /// Width of the first two convs; halved, then quartered by the upsamplers.
  TORCH_ARG(int64_t, hidden_channels) = 512;
  TORCH_ARG(int64_t, out_channels) = 3;
  TORCH_ARG(nn::LayerInit, init) = nn::LayerInit{};
};

/// Stable Cascade's previewer: stage C latents -> RGB. blocks.<n> as the
/// reference nn.Sequential (h = hidden_channels): 0 conv 1x1 in->h, 1 GELU,
/// 2 BN, 3 conv 3x3 h->h, 4 GELU, 5 BN, 6 ConvT 2x2 s2 h->h/2, 7 GELU, 8 BN,
/// 9 conv 3x3, 10 GELU, 11 BN, 12 ConvT h/2->h/4, 13 GELU, 14 BN, 15 conv 3x3,
/// 16 GELU, 17 BN, 18 ConvT h/4->h/4, 19 GELU, 20 BN, 21 conv 3x3, 22 GELU,
/// 23 BN, 24 conv 1x1 h/4->out. GELU is the exact (erf) form; BN eps 1e-5.
/// 3,979,651 parameters at the defaults.
class PreviewerImpl : public torch::nn::Module {
 public:
  /// Throws shoestring::Error when hidden_channels is not a positive multiple of 4.
  explicit PreviewerImpl(const PreviewerOptions& options = {});
  /// latents: [B, in_channels, h, w] -> [B, out_channels, 8h, 8w] in the
  /// parameters' dtype (latents are cast to it), roughly in [0, 1] (not clamped; kohya's stable_cascade.py clamps to
  /// [0, 1] for display). Throws shoestring::Error on a wrong shape.
  torch::Tensor forward(const torch::Tensor& latents);

  const PreviewerOptions& options() const { return options_; }

  std::vector<nn::Conv2d> convs;                ///< blocks 0, 3, 9, 15, 21, 24
  std::vector<nn::ConvTranspose2d> upsamplers;  ///< blocks 6, 12, 18
  std::vector<nn::BatchNorm2d> norms;           ///< blocks 2, 5, 8, 11, 14, 17, 20, 23

 private:
  PreviewerOptions options_;
};
TORCH_MODULE(Previewer);

/// Loads a released coder file (`effnet_encoder.safetensors`,
/// `previewer.safetensors`, or any file whose keys are the module's) into an
/// EfficientNetEncoder or Previewer, skipping torch's `*.num_batches_tracked`
/// counters. Throws shoestring::Error naming the file and the missing,
/// unexpected or mis-shaped keys (see load_weights, io/weight_files.h).
LoadWeightsReport load_cascade_coder(torch::nn::Module& module, const WeightFiles& files);

}  // namespace shoestring::models
