// The Stable Diffusion VAE (AutoencoderKL, Rombach et al. 2022, "High-Resolution
// Image Synthesis with Latent Diffusion Models", arXiv 2112.10752) in the
// CompVis layout of ldm/modules/diffusionmodules/model.py (Encoder, Decoder,
// ResnetBlock, AttnBlock) and ldm/models/autoencoder.py (quant_conv,
// post_quant_conv), so named_parameters() are the released keys below the
// single-file `first_stage_model.` prefix (standalone VAE files such as
// vae-ft-mse-840000-ema-pruned.safetensors have no prefix):
//
//   encoder.conv_in, encoder.down.<l>.block.<i>.{norm1,conv1,norm2,conv2,nin_shortcut},
//   encoder.down.<l>.downsample.conv, encoder.mid.{block_1,attn_1,block_2},
//   encoder.mid.attn_1.{norm,q,k,v,proj_out} (1x1 convs), encoder.norm_out, encoder.conv_out,
//   quant_conv, post_quant_conv,
//   decoder.conv_in, decoder.mid.*, decoder.up.<l>.block.<i>.*, decoder.up.<l>.upsample.conv,
//   decoder.norm_out, decoder.conv_out
//
// where decoder.up.<l> is stored at the index of the level it mirrors
// (up.3 is the deepest, run first). SD 1.x and SDXL share this architecture
// (83,653,863 parameters); they differ in weights and scaling factor.
//
// SD3 / SD3.5 use the same encoder/decoder with 16 latent channels and no
// quant_conv / post_quant_conv (VaeOptions::sd3(): 83,819,683 parameters,
// encoder 34,274,208 + decoder 49,545,475), and a latent shift as well as a
// scale (Stability-AI/sd3.5 sd3_impls.py SDVAE and SD3LatentFormat; diffusers
// vae/config.json of stabilityai/stable-diffusion-3.5-medium: latent_channels
// 16, scaling_factor 1.5305, shift_factor 0.0609, use_quant_conv false,
// use_post_quant_conv false). SD3.5 single files hold it under the same
// `first_stage_model.` prefix (see load_vae).
#pragma once
#include <cstdint>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include "shoestring/io/weight_files.h"
#include "shoestring/nn/layers.h"
#include "shoestring/nn/resblock.h"

namespace shoestring::models {

/// Hyper-parameters of the VAE (ddconfig of the LDM configs; defaults: SD).
struct VaeOptions {
  TORCH_ARG(int64_t, in_channels) = 3;
  TORCH_ARG(int64_t, out_channels) = 3;
  /// Channels of level 0 (`ch`); level l has ch * ch_mult[l].
  TORCH_ARG(int64_t, ch) = 128;
  TORCH_ARG(std::vector<int64_t>, ch_mult) = std::vector<int64_t>{1, 2, 4, 4};
  /// ResnetBlocks per encoder level (the decoder has one more).
  TORCH_ARG(int64_t, num_res_blocks) = 2;
  /// Latent channels (z_channels = embed_dim in SD).
  TORCH_ARG(int64_t, z_channels) = 4;
  TORCH_ARG(int64_t, groups) = 32;
  /// Latent scale: SD 1.x 0.18215, SDXL 0.13025 (the `scale_factor` of the
  /// LatentDiffusion config), SD3 1.5305. Used by encode_latents /
  /// decode_latents only.
  TORCH_ARG(double, scaling_factor) = 0.18215;
  /// Latent shift, subtracted before scaling: 0 for SD 1.x / SDXL, SD3 0.0609
  /// (SD3LatentFormat.shift_factor; diffusers `shift_factor`). Used by
  /// encode_latents / decode_latents only.
  TORCH_ARG(double, shift_factor) = 0.0;
  /// Build quant_conv (1x1, 2z -> 2z, applied to the encoder's moments) and
  /// post_quant_conv (1x1, z -> z, applied before the decoder), as LDM's
  /// AutoencoderKL. False (SD3): neither exists, named_parameters() has no
  /// such keys and the moments / latents pass straight through.
  TORCH_ARG(bool, use_quant_conv) = true;
  /// Device/dtype of the parameters; nn::LayerInit{torch::kMeta} allocates nothing.
  TORCH_ARG(nn::LayerInit, init) = nn::LayerInit{};

 public:  // (TORCH_ARG leaves the section private)
  /// Same structure at test size: ch 32 (groups 32 still divide every width).
  VaeOptions tiny() const { return VaeOptions(*this).ch(32); }
  /// SD3 / SD3.5 (Large, Medium, Turbo share it): z_channels 16, no quant
  /// convs, scaling_factor 1.5305, shift_factor 0.0609; the rest as SD.
  /// Encoder moments [B, 32, H/8, W/8], latents [B, 16, H/8, W/8].
  static VaeOptions sd3() {
    return VaeOptions().z_channels(16).use_quant_conv(false).scaling_factor(1.5305).shift_factor(0.0609);
  }
};

/// Single-head self-attention over the pixels of a feature map (LDM AttnBlock):
/// out = x + proj_out(softmax(q^T k / sqrt(C)) v) with q, k, v 1x1 convs of norm(x).
class VaeAttentionImpl : public torch::nn::Module {
 public:
  VaeAttentionImpl(int64_t channels, int64_t groups, const nn::LayerInit& init);
  /// x: [B, C, H, W] -> [B, C, H, W].
  torch::Tensor forward(const torch::Tensor& x);
  nn::GroupNorm norm{nullptr};
  nn::Conv2d q{nullptr}, k{nullptr}, v{nullptr}, proj_out{nullptr};
};
TORCH_MODULE(VaeAttention);

/// Middle of the encoder/decoder: block_1 -> attn_1 -> block_2.
class VaeMidImpl : public torch::nn::Module {
 public:
  VaeMidImpl(int64_t channels, const VaeOptions& o);
  torch::Tensor forward(const torch::Tensor& x);
  nn::ResBlock block_1{nullptr}, block_2{nullptr};
  VaeAttention attn_1{nullptr};
};
TORCH_MODULE(VaeMid);

/// One level: block.<i> ResnetBlocks and an optional resampling conv
/// (downsample.conv: 3x3 stride 2 after padding right/bottom by one;
/// upsample.conv: 3x3 after nearest 2x).
class VaeLevelImpl : public torch::nn::Module {
 public:
  VaeLevelImpl() = default;
  torch::nn::ModuleList block{nullptr};
  nn::Conv2d downsample{nullptr}, upsample{nullptr};
};
TORCH_MODULE(VaeLevel);

/// Image -> moments. Submodules conv_in, down.<l>, mid, norm_out, conv_out.
class VaeEncoderImpl : public torch::nn::Module {
 public:
  explicit VaeEncoderImpl(const VaeOptions& o);
  /// x: [B, in_channels, H, W] -> [B, 2 * z_channels, H / 2^(levels-1), ...].
  torch::Tensor forward(const torch::Tensor& x);
  nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
  torch::nn::ModuleList down{nullptr};
  VaeMid mid{nullptr};
  nn::GroupNorm norm_out{nullptr};
};
TORCH_MODULE(VaeEncoder);

/// Latent -> image. Submodules conv_in, mid, up.<l>, norm_out, conv_out.
class VaeDecoderImpl : public torch::nn::Module {
 public:
  explicit VaeDecoderImpl(const VaeOptions& o);
  /// z: [B, z_channels, h, w] -> [B, out_channels, h * 2^(levels-1), ...].
  torch::Tensor forward(const torch::Tensor& z);
  nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
  torch::nn::ModuleList up{nullptr};
  VaeMid mid{nullptr};
  nn::GroupNorm norm_out{nullptr};
};
TORCH_MODULE(VaeDecoder);

/// Mean and log-variance of the diagonal Gaussian posterior, each [B, z, h, w].
struct VaePosterior {
  at::Tensor mean, logvar;
};

/// AutoencoderKL. Runs in the dtype of its parameters.
class AutoencoderKLImpl : public torch::nn::Module {
 public:
  explicit AutoencoderKLImpl(const VaeOptions& options = {});
  /// x: [B, 3, H, W] in [-1, 1], H and W divisible by 2^(levels-1).
  /// Returns the posterior (logvar clamped to [-30, 20] as LDM's
  /// DiagonalGaussianDistribution). Throws shoestring::Error on bad shapes.
  VaePosterior encode(const torch::Tensor& x);
  /// z: [B, z_channels, h, w] (unscaled latents) -> image [B, 3, 8h, 8w] (~[-1, 1]).
  torch::Tensor decode(const torch::Tensor& z);
  /// Latents for the diffusion model, [B, z_channels, H/8, W/8] in the
  /// parameters' dtype: (z - shift_factor) * scaling_factor with
  /// z = mean + exp(logvar/2) * eps, eps ~ N(0, 1) from `generator` (or the
  /// default generator), or z = mean when sample is false.
  torch::Tensor encode_latents(const torch::Tensor& x, bool sample = true,
                               c10::optional<at::Generator> generator = c10::nullopt);
  /// decode(z / scaling_factor + shift_factor): latents of encode_latents -> image.
  torch::Tensor decode_latents(const torch::Tensor& z);

  const VaeOptions& options() const { return options_; }

  VaeEncoder encoder{nullptr};
  VaeDecoder decoder{nullptr};
  /// Null when options().use_quant_conv() is false.
  nn::Conv2d quant_conv{nullptr}, post_quant_conv{nullptr};

 private:
  VaeOptions options_;
};
TORCH_MODULE(AutoencoderKL);

/// Loads a VAE from a single file or a standalone VAE file into `vae`
/// (allocated, not meta): when any key starts with `first_stage_model.` (SD /
/// SDXL / SD3.5 single files) only those keys are read, prefix stripped, and
/// the rest of the file (UNet / MMDiT, text encoders) is ignored; otherwise
/// every key must be a VAE key (vae-ft-mse-840000-ema-pruned.safetensors,
/// sd3.5 `vae` extracts). Throws shoestring::Error naming the file and, before
/// any copy, the first quant_conv / post_quant_conv tensor present in a file
/// for a VAE built without them (an SD 1.x / SDXL VAE given where an SD3 one
/// is expected) or absent from one for a VAE built with them, and the latent
/// channels of the file when encoder.conv_out disagrees with z_channels;
/// otherwise missing / unexpected / mis-shaped keys as load_weights does.
LoadWeightsReport load_vae(AutoencoderKLImpl& vae, const WeightFiles& files);

}  // namespace shoestring::models
