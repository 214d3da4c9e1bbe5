// A small text-conditioned UNet for pixel-space diffusion on tiny images (the
// emoji example). Layout follows the Latent Diffusion UNet (Rombach et al.
// 2022, CompVis `openaimodel.UNetModel`): per level `num_res_blocks` ResBlocks
// (+ a SpatialTransformer with self- and cross-attention on attention levels),
// stride-2 conv downsampling, a middle Res-Attn-Res, an up path with one more
// ResBlock per level eating the skip connections (concatenated on channels),
// nearest-neighbour upsampling + conv, and GroupNorm-SiLU-conv out with the
// final conv zero-initialised.
//
// Parameter paths (named_parameters()):
//   time_embed.linear_{1,2}.*, [text_embed.* with pooled_context], conv_in.*,
//   down.<level>.res.<i>.*, down.<level>.attn.<i>.*, down.<level>.downsample.*,
//   mid.res1.*, mid.attn.*, mid.res2.*,
//   up.<level>.res.<i>.*, up.<level>.attn.<i>.*, up.<level>.upsample.*,
//   norm_out.*, conv_out.*
// where <level> 0 is full resolution in both paths (up.<level> mirrors
// down.<level>), e.g. `down.1.attn.0.blocks.0.attn2.to_k.weight`.
#pragma once
#include <cstdint>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include "shoestring/models/denoiser.h"
#include "shoestring/nn/block_precision.h"
#include "shoestring/nn/layers.h"
#include "shoestring/nn/memory_trace.h"
#include "shoestring/nn/resblock.h"
#include "shoestring/nn/timestep.h"
#include "shoestring/nn/transformer.h"

namespace shoestring::models {

/// Hyper-parameters of TinyUNet. Defaults: ~25M parameters.
struct TinyUNetOptions {
  TORCH_ARG(int64_t, in_channels) = 3;
  TORCH_ARG(int64_t, out_channels) = 3;
  /// Channels at level 0; level i has base_channels * channel_mult[i].
  TORCH_ARG(int64_t, base_channels) = 64;
  TORCH_ARG(std::vector<int64_t>, channel_mult) = std::vector<int64_t>{1, 2, 4};
  /// ResBlocks per level on the down path (the up path has one more).
  TORCH_ARG(int64_t, num_res_blocks) = 2;
  /// Levels (0 = full resolution) whose ResBlocks are followed by a
  /// SpatialTransformer (self- + cross-attention). The middle always has one.
  TORCH_ARG(std::vector<int64_t>, attention_levels) = std::vector<int64_t>{1, 2};
  /// Attention heads; head_dim = channels / num_heads.
  TORCH_ARG(int64_t, num_heads) = 4;
  /// Key/value heads (grouped-query attention); 0 = num_heads.
  TORCH_ARG(int64_t, num_kv_heads) = 0;
  /// Width of the caption encoder's hidden states (cross-attention context).
  TORCH_ARG(int64_t, context_dim) = 256;
  /// Also condition every ResBlock on the caption: the mean of the context's
  /// real tokens, projected by `text_embed` (Linear context_dim -> 4 *
  /// base_channels), is added to the timestep embedding, as GLIDE (Nichol et
  /// al. 2022) feeds its text encoder's final token in place of ADM's class
  /// embedding and SDXL adds its pooled text embedding to the time embedding.
  /// Cross-attention stays; this path is learned in far fewer steps.
  TORCH_ARG(bool, pooled_context) = false;
  /// ResBlocks condition by scale and shift of their second GroupNorm
  /// (nn::ResBlockOptions::scale_shift, ADM's use_scale_shift_norm) instead
  /// of adding the embedding; time_emb_proj is then 2x wider.
  TORCH_ARG(bool, scale_shift_norm) = false;
  /// Upper bound on GroupNorm groups.
  TORCH_ARG(int64_t, groups) = 32;
  TORCH_ARG(double, dropout) = 0.0;
  /// Run activations in channels-last (NHWC) memory layout: oneDNN's convs
  /// are ~2x faster on CPU that way, and the transformer's [B, H*W, C] token
  /// view needs no copy. Weights and the returned tensor stay contiguous NCHW.
  TORCH_ARG(bool, channels_last) = true;
  /// Device/dtype of the parameters; nn::LayerInit{torch::kMeta} builds the
  /// module tree without allocating.
  TORCH_ARG(nn::LayerInit, init) = nn::LayerInit{};
};

/// One resolution level: res.<i> ResBlocks, attn.<i> SpatialTransformers (empty
/// on levels without attention) and an optional resampling conv
/// (`downsample`: 3x3 stride 2; `upsample`: 3x3 after nearest 2x).
class TinyUNetLevelImpl : public torch::nn::Module {
 public:
  TinyUNetLevelImpl();
  torch::nn::ModuleList res{nullptr}, attn{nullptr};
  nn::Conv2d downsample{nullptr}, upsample{nullptr};
};
TORCH_MODULE(TinyUNetLevel);

/// The middle block: res1 -> attn -> res2.
class TinyUNetMidImpl : public torch::nn::Module {
 public:
  TinyUNetMidImpl(const TinyUNetOptions& o, int64_t channels, int64_t temb_dim);
  nn::ResBlock res1{nullptr}, res2{nullptr};
  nn::SpatialTransformer attn{nullptr};
};
TORCH_MODULE(TinyUNetMid);

/// Text-conditioned UNet. Runs in fp32, or entirely in bf16 after
/// `->to(torch::kBFloat16)` (the caller casts x and context; t stays any float).
class TinyUNetImpl : public torch::nn::Module, public Denoiser {
 public:
  /// Throws shoestring::Error on bad options (empty channel_mult, attention
  /// level out of range, channels not divisible by num_heads, ...).
  explicit TinyUNetImpl(const TinyUNetOptions& options = {});

  /// x: [B, in_channels, H, W] in the model's dtype, H and W divisible by
  /// 2^(levels-1); t: [B] diffusion time in [0, 1] (embedded as t*1000, the
  /// DDPM timestep scale); context: [B, L, context_dim] in the model's dtype;
  /// context_mask: [B, L] bool, true = real token (undefined = all real).
  /// Returns [B, out_channels, H, W] in the model's dtype.
  /// Throws shoestring::Error on shape/dtype mismatch.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& context,
                        const torch::Tensor& context_mask = {});

  /// The blocks of this UNet (every ResBlock and SpatialTransformer), for
  /// per-block compute dtype and checkpointing (precision::apply). Gradient
  /// checkpointing (Chen et al. 2016: a block's activations recomputed in
  /// backward instead of stored) is a precision rule: `checkpoint = true` or
  /// the `gradient_checkpointing` shorthand.
  nn::BlockTable* block_table() const override { return block_table_.get(); }

  /// Number of scalar parameters (sum of numel over parameters()).
  int64_t parameter_count() const;

  const TinyUNetOptions& options() const { return options_; }

  nn::TimestepEmbedding time_embed{nullptr};
  nn::Linear text_embed{nullptr};  ///< only with options().pooled_context()
  nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
  torch::nn::ModuleList down{nullptr}, up{nullptr};
  TinyUNetMid mid{nullptr};
  nn::GroupNorm norm_out{nullptr};

 private:
  torch::Tensor run_res(nn::ResBlock& block, const torch::Tensor& x, const torch::Tensor& temb);
  torch::Tensor run_attn(nn::SpatialTransformer& block, const torch::Tensor& x, const torch::Tensor& context,
                         const torch::Tensor& mask);

  TinyUNetOptions options_;
  std::shared_ptr<nn::BlockTable> block_table_ = std::make_shared<nn::BlockTable>();
};
TORCH_MODULE(TinyUNet);

class CaptionEncoderImpl;

/// The memory trace of the emoji model's training forward
/// (models/tiny_unet_trace.cpp), as train/TinyUNetModel runs it on one
/// micro-batch of `batch` images of `resolution` px: the batch (x0, noise,
/// x_t and target fp32, t, tokens int64), `text` in its scope, then `unet` in
/// its scope, each ResBlock, SpatialTransformer and encoder layer a block
/// (MemoryTracer::block: the resolved precision policy's compute dtype and
/// checkpointing per block, or TracePrecision::checkpoint without one), then
/// mse_loss. `text` and `unet` may live on the meta device. Throws
/// shoestring::Error when channels are not divisible by num_heads.
void trace_text_to_image(const TinyUNetImpl& unet, const CaptionEncoderImpl& text, nn::MemoryTracer& tracer,
                         int64_t batch, int64_t resolution);

}  // namespace shoestring::models
