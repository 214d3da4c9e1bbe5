// The Latent Diffusion UNet of Stable Diffusion 1.x and SDXL (Rombach et al.
// 2022; Podell et al. 2023, arXiv 2307.01952), in the module layout of CompVis
// / Stability's `openaimodel.UNetModel`, so that named_parameters() are the
// keys of the released single-file checkpoints (below the file's
// `model.diffusion_model.` prefix):
//
//   time_embed.{0,2}             Linear(mc, 4mc), Linear(4mc, 4mc)
//   label_emb.0.{0,2}            Linear(adm_in, 4mc), Linear(4mc, 4mc)        (SDXL only)
//   input_blocks.0.0             Conv2d(in, mc, 3)
//   input_blocks.<n>.0           ResBlock; .1 SpatialTransformer where that block's depth > 0
//   input_blocks.<n>.0.op        Conv2d(ch, ch, 3, stride 2)                   (downsample)
//   middle_block.0 / .1 / .2     ResBlock, SpatialTransformer, ResBlock        (SSD-1B: .0 only)
//   output_blocks.<n>.0          ResBlock on [h, skip]; .1 SpatialTransformer; .1/.2.conv upsample
//   out.0, out.2                 GroupNorm, Conv2d(mc, out, 3)
//
// e.g. `input_blocks.4.1.transformer_blocks.0.attn1.to_q.weight`. Per-block
// transformer depths follow ComfyUI's `transformer_depth` /
// `transformer_depth_output` / `transformer_depth_middle` convention, which
// also describes distilled SDXL variants such as Segmind's SSD-1B.
#pragma once
#include <cstdint>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include "shoestring/io/key_map.h"
#include "shoestring/models/denoiser.h"
#include "shoestring/models/denoiser_io.h"
#include "shoestring/nn/block_precision.h"
#include "shoestring/nn/layers.h"
#include "shoestring/nn/resblock.h"
#include "shoestring/nn/timestep.h"
#include "shoestring/nn/transformer.h"

namespace shoestring::models {

/// Hyper-parameters of LdmUNet (names as in the LDM / SGM YAML configs).
struct LdmUNetOptions {
  TORCH_ARG(int64_t, in_channels) = 4;
  TORCH_ARG(int64_t, out_channels) = 4;
  /// Channels of level 0; level l has model_channels * channel_mult[l].
  TORCH_ARG(int64_t, model_channels) = 320;
  TORCH_ARG(std::vector<int64_t>, channel_mult) = std::vector<int64_t>{1, 2, 4, 4};
  /// ResBlocks per level on the input path (the output path has one more).
  TORCH_ARG(int64_t, num_res_blocks) = 2;
  /// Transformer blocks in each input block's SpatialTransformer, one entry
  /// per ResBlock (levels * num_res_blocks entries); 0 = no SpatialTransformer.
  TORCH_ARG(std::vector<int64_t>, transformer_depth) = std::vector<int64_t>{1, 1, 1, 1, 1, 1, 0, 0};
  /// The same for the output blocks (levels * (num_res_blocks + 1) entries,
  /// deepest level first, in output_blocks order).
  TORCH_ARG(std::vector<int64_t>, transformer_depth_output) = std::vector<int64_t>{0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1};
  /// Depth of middle_block.1; -1 = the middle block is a single ResBlock
  /// (no middle_block.1 / .2, as SSD-1B).
  TORCH_ARG(int64_t, transformer_depth_middle) = 1;
  /// Attention heads when num_head_channels is -1 (head_dim = channels / num_heads).
  TORCH_ARG(int64_t, num_heads) = 8;
  /// Channels per head (heads = channels / 64 in SDXL); -1 = use num_heads.
  TORCH_ARG(int64_t, num_head_channels) = -1;
  /// Width of the cross-attention context (768 CLIP-L; 2048 CLIP-L + OpenCLIP-bigG).
  TORCH_ARG(int64_t, context_dim) = 768;
  /// Width of the vector conditioning y (SDXL 2816 = 1280 pooled text + 6 x 256
  /// size/crop embeddings); 0 = none (no label_emb).
  TORCH_ARG(int64_t, adm_in_channels) = 0;
  /// SpatialTransformer proj_in/proj_out as Linear (SDXL) instead of 1x1 conv (SD 1.x).
  TORCH_ARG(bool, linear_proj) = false;
  TORCH_ARG(int64_t, groups) = 32;
  TORCH_ARG(double, dropout) = 0.0;
  /// Device/dtype of the parameters; nn::LayerInit{torch::kMeta} allocates nothing.
  TORCH_ARG(nn::LayerInit, init) = nn::LayerInit{};

 public:  // (TORCH_ARG leaves the section private)
  /// Stable Diffusion 1.5 (v1-inference.yaml): mc 320, mult 1,2,4,4, 8 heads,
  /// attention at the first three levels, context 768. 859,520,964 parameters.
  static LdmUNetOptions sd15();
  /// SDXL base 1.0 (sd_xl_base.yaml): mc 320, mult 1,2,4, depth 0,2,10 per
  /// level, 64 channels per head, context 2048, adm_in_channels 2816, linear
  /// projections. 2,567,463,684 parameters.
  static LdmUNetOptions sdxl();
  /// Segmind SSD-1B: SDXL with transformer blocks removed (input depths
  /// 0,0,2,2,4,4; output 4,4,10,2,1,1,0,0,0; middle block a single ResBlock),
  /// per the diffusers config (transformer_layers_per_block [[1],[2,2],[4,4]],
  /// reverse_transformer_layers_per_block [[4,4,10],[2,1,1],1],
  /// mid_block_type UNetMidBlock2D) and ComfyUI's supported_models.SSD1B.
  static LdmUNetOptions ssd1b();
  /// The same block structure at test size: model_channels 32, 2 heads
  /// (num_head_channels -1), context 64, adm_in_channels 64 when non-zero.
  LdmUNetOptions tiny() const;
};

/// The block layout of `o` for the LDM <-> diffusers key map (io/key_map.h).
io::UNetKeyLayout unet_key_layout(const LdmUNetOptions& o);

/// A resampling layer in LDM naming: Downsample holds `op` (3x3 conv, stride 2,
/// padding 1); Upsample holds `conv` (nearest-neighbour 2x, then 3x3 conv).
class LdmResampleImpl : public torch::nn::Module {
 public:
  LdmResampleImpl(int64_t channels, bool down, const nn::LayerInit& init);
  /// x: [B, C, H, W] -> [B, C, H/2, W/2] (down) or [B, C, 2H, 2W] (up).
  torch::Tensor forward(const torch::Tensor& x);
  nn::Conv2d conv{nullptr};
  bool down;
};
TORCH_MODULE(LdmResample);

/// One LDM TimestepEmbedSequential: layers "0", "1", ... each a ResBlock,
/// SpatialTransformer, LdmResample or (input_blocks.0 only) Conv2d.
class LdmBlockImpl : public torch::nn::Module {
 public:
  LdmBlockImpl() = default;
  /// Appends a layer under the next index.
  template <class Holder>
  void add(Holder layer) {
    register_module(std::to_string(layers_.size()), layer);
    layers_.push_back(layer.ptr());
  }
  /// h: [B, C, H, W]; emb: [B, 4*mc]; context: [B, L, context_dim].
  torch::Tensor forward(const torch::Tensor& h, const torch::Tensor& emb, const torch::Tensor& context) {
    return forward_layers(h, emb, context, nullptr);
  }
  /// Total transformer blocks in this block's SpatialTransformers (0 if none).
  int64_t transformer_depth() const;
  /// forward() with each ResBlock and each SpatialTransformer run through
  /// nn::run_block(table, ...): per-block compute dtype and checkpointing when
  /// `table` is configured (precision rules). Each ResBlock and each
  /// transformer block is a block of its own and resamplers are none, so a
  /// checkpoint rule recomputes one layer's activations at a time in backward
  /// (for SDXL's 10-deep blocks at 1024 px about 1.4 GiB less than
  /// checkpointing the whole LDM block). nullptr or an unconfigured table:
  /// the plain forward.
  torch::Tensor forward_layers(const torch::Tensor& h, const torch::Tensor& emb, const torch::Tensor& context,
                               const nn::BlockTable* table);
  /// The layers "0", "1", ... in order.
  const std::vector<std::shared_ptr<torch::nn::Module>>& layers() const { return layers_; }

 private:
  std::vector<std::shared_ptr<torch::nn::Module>> layers_;
};
TORCH_MODULE(LdmBlock);

/// The LDM / SDXL UNet (eps- or v-prediction is the caller's business: this is
/// the network only). Runs in the dtype of its parameters.
class LdmUNetImpl : public torch::nn::Module, public Denoiser {
 public:
  /// Throws shoestring::Error on inconsistent options (depth lists of the
  /// wrong length, channels not divisible by heads, ...).
  explicit LdmUNetImpl(const LdmUNetOptions& options);

  /// x: [B, in_channels, H, W] (H, W divisible by 2^(levels-1)), in the model's
  /// dtype; timesteps: [B] on the DDPM scale 0..1000 (any float/int dtype);
  /// context: [B, L, context_dim] in the model's dtype; y: [B, adm_in_channels]
  /// (required iff adm_in_channels > 0). Returns [B, out_channels, H, W].
  /// Throws shoestring::Error on shape or dtype mismatch.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& timesteps, const torch::Tensor& context,
                        const torch::Tensor& y = {});

  /// The blocks of this UNet for per-block compute dtype and checkpointing
  /// (precision::resolve / apply, OverflowMonitor):
  ///  - every ResBlock (`input_blocks.4.0`, `middle_block.0`, ...) and every
  ///    transformer block (`input_blocks.4.1.transformer_blocks.0`, ...):
  ///    checkpointable blocks, so SDXL's 10-deep SpatialTransformers are
  ///    checkpointed layer by layer (gradient checkpointing is a precision
  ///    rule: `checkpoint = true` or the `gradient_checkpointing` shorthand);
  ///  - every SpatialTransformer (`input_blocks.4.1`) and the UNet itself
  ///    (the root): scopes that carry a compute dtype (for norm, proj_in /
  ///    proj_out, resp. time/label embedding, input_blocks.0.0, resamplers and
  ///    out.*) but are never checkpointed as a whole.
  /// Unconfigured (the default), forward() is the plain path. Once
  /// configured, forward() runs the UNet as its root scope (inputs cast to
  /// the scope's compute dtype, output returned in it); if the root has no
  /// entry, layers outside blocks compute in the enclosing scope's dtype, or
  /// in the parameters' dtype when there is none.
  nn::BlockTable* block_table() const override { return block_table_.get(); }

  const LdmUNetOptions& options() const { return options_; }

  nn::TimestepEmbedding time_embed{nullptr}, label_emb{nullptr};
  torch::nn::ModuleList input_blocks{nullptr}, output_blocks{nullptr};
  LdmBlock middle_block{nullptr};
  nn::GroupNorm out_norm{nullptr};
  nn::Conv2d out_conv{nullptr};

 private:
  torch::Tensor forward_impl(const torch::Tensor& x, const torch::Tensor& timesteps, const torch::Tensor& context,
                             const torch::Tensor& y);
  torch::Tensor run_ldm_block(LdmBlockImpl& block, const torch::Tensor& h, const torch::Tensor& emb,
                              const torch::Tensor& context);

  LdmUNetOptions options_;
  std::shared_ptr<nn::BlockTable> block_table_ = std::make_shared<nn::BlockTable>();
};
TORCH_MODULE(LdmUNet);

/// LdmUNetImpl::forward's memory trace (models/unet_ldm_trace.cpp): x [B,
/// in_channels, S, S], timesteps [B], context [B, L, context_dim] and (SDXL)
/// y [B, adm_in_channels]; each ResBlock and transformer block a checkpointed
/// segment under TracePrecision::checkpoint, as the trainer's rule applies
/// to the block table. Throws shoestring::Error when `model` is not an
/// LdmUNetImpl or S is not divisible by 2^(levels-1).
void trace_ldm_unet(torch::nn::Module& model, nn::MemoryTracer& tracer, const DenoiserBatch& in);

/// Random inputs of those shapes bound to LdmUNetImpl::forward (timesteps
/// integers in [0, 1000) as floats).
DenoiserExample ldm_unet_example(torch::nn::Module& model, const DenoiserBatch& in, at::ScalarType dtype);

}  // namespace shoestring::models
