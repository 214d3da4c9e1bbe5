// Stable Cascade stage C (Pernias et al. 2024, "Würstchen: An Efficient
// Architecture for Large-Scale Text-to-Image Diffusion Models", ICLR 2024;
// released by Stability AI as "Stable Cascade"): the text-conditional
// diffusion model that works on 16 x 24 x 24 EfficientNet latents.
//
// Architecture and parameter names follow Stability's reference code
// (github.com/Stability-AI/StableCascade, modules/stage_c.py and
// modules/common.py), so the module tree *is* the key tree of the released
// single-file checkpoints `stage_c.safetensors` / `stage_c_bf16.safetensors`
// (3.6B) and `stage_c_lite*.safetensors` (1B), which carry no key prefix:
//
//   clip_txt_mapper.*, clip_txt_pooled_mapper.*, clip_img_mapper.*,
//   embedding.1.*                                (1x1 conv in),
//   down_blocks.<level>.<i>.*, down_downscalers.<level>.1.blocks.0.*,
//   down_repeat_mappers.<level>.<j>.*,
//   up_blocks.<k>.<i>.*, up_upscalers.<k>.1.blocks.1.*, up_repeat_mappers.<k>.<j>.*,
//   clf.1.*                                      (1x1 conv out)
//
// where up_blocks.<k> is level (levels-1-k) and block <i> of a level is one
// of (per the level's config letters, "CTA" in the releases):
//   C  ResBlock:      depthwise.{weight,bias}, channelwise.0.* (Linear c+skip -> 4c),
//                     channelwise.2.{gamma,beta} (GlobalResponseNorm), channelwise.4.*
//   T  TimestepBlock: mapper.*, mapper_sca.*, mapper_crp.*
//   A  AttnBlock:     attention.attn.{in_proj_weight,in_proj_bias} and
//                     attention.attn.out_proj.* (torch.nn.MultiheadAttention's names),
//                     kv_mapper.1.*
//   F  FeedForwardBlock: channelwise.{0,2,4} as in C.
// LayerNorm2d layers carry no parameters (elementwise_affine=False).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include "shoestring/models/denoiser.h"
#include "shoestring/models/denoiser_io.h"
#include "shoestring/nn/block_precision.h"
#include "shoestring/nn/layers.h"
#include "shoestring/nn/lora.h"

namespace shoestring::models {

/// Hyper-parameters of StageC, named as the reference constructor's
/// arguments (c_in -> in_channels, c_r -> r_dim, c_cond -> cond_dim, ...).
/// Defaults are the released 3.6B model (StableCascade modules/stage_c.py
/// defaults; stabilityai/stable-cascade-prior prior/config.json).
struct StageCOptions {
  TORCH_ARG(int64_t, in_channels) = 16;
  TORCH_ARG(int64_t, out_channels) = 16;
  /// Width of one sinusoidal embedding of r (and of each t_cond).
  TORCH_ARG(int64_t, r_dim) = 64;
  /// PixelUnshuffle factor in front of the first 1x1 conv.
  TORCH_ARG(int64_t, patch_size) = 1;
  /// Width of the CLIP conditioning tokens (kv_mapper input).
  TORCH_ARG(int64_t, cond_dim) = 2048;
  /// Channels per level.
  TORCH_ARG(std::vector<int64_t>, hidden) = std::vector<int64_t>{2048, 2048};
  /// Attention heads per level.
  TORCH_ARG(std::vector<int64_t>, heads) = std::vector<int64_t>{32, 32};
  /// Repeats of the level's block pattern on the down path, level 0 first.
  TORCH_ARG(std::vector<int64_t>, down_blocks) = std::vector<int64_t>{8, 24};
  /// Repeats on the up path, deepest level first (the reference's blocks[1]).
  TORCH_ARG(std::vector<int64_t>, up_blocks) = std::vector<int64_t>{24, 8};
  /// How many times each level's blocks run on the down path (level 0
  /// first; n > 1 adds n-1 1x1 "repeat mapper" convs) and on the up path
  /// (deepest first), as block_repeat[0] / block_repeat[1].
  TORCH_ARG(std::vector<int64_t>, down_repeat) = std::vector<int64_t>{1, 1};
  TORCH_ARG(std::vector<int64_t>, up_repeat) = std::vector<int64_t>{1, 1};
  /// Block pattern per level: letters C (ResBlock), T (TimestepBlock),
  /// A (AttnBlock), F (FeedForwardBlock).
  TORCH_ARG(std::vector<std::string>, level_config) = std::vector<std::string>{"CTA", "CTA"};
  TORCH_ARG(int64_t, clip_text_dim) = 1280;
  TORCH_ARG(int64_t, clip_text_pooled_dim) = 1280;
  TORCH_ARG(int64_t, clip_image_dim) = 768;
  /// Tokens each pooled text / image embedding is mapped to.
  TORCH_ARG(int64_t, clip_seq) = 4;
  TORCH_ARG(int64_t, kernel_size) = 3;
  /// Dropout in ResBlocks / FeedForwardBlocks and on attention weights
  /// (training mode only), every level.
  TORCH_ARG(double, dropout) = 0.1;
  /// Attention keys/values are [image tokens, condition tokens] (true) or
  /// the condition tokens only (false).
  TORCH_ARG(bool, self_attn) = true;
  /// Extra timestep-like conditions, each embedded like r and added by its
  /// own mapper_<name> in every TimestepBlock.
  TORCH_ARG(std::vector<std::string>, t_conds) = std::vector<std::string>{"sca", "crp"};
  /// Per level transition: true = resample by 2 (bilinear) between levels.
  TORCH_ARG(std::vector<bool>, switch_level) = std::vector<bool>{false};

 public:
  /// The 3.6B release (stage_c.safetensors).
  static StageCOptions cascade_c() { return StageCOptions(); }
  /// The 1B "lite" release (stage_c_lite.safetensors): StableCascade
  /// train/train_c.py model_version "1B" (c_cond 1536, c_hidden [1536, 1536],
  /// nhead [24, 24], blocks [[4, 12], [12, 4]]).
  static StageCOptions cascade_c_lite();
  /// Same block structure as the releases, small channels (hidden 32, 2
  /// heads, cond 32), few blocks (down 1 + 2, up 2 + 1), no dropout, and
  /// CLIP input widths 32 (text, pooled and image: what a tiny bigG gives,
  /// ClipTextOptions::clip_g().tiny()): for tests that train on the CPU.
  static StageCOptions tiny();
};

/// GlobalResponseNorm (Woo et al. 2023, ConvNeXt V2) on channels-last input:
/// y = gamma * (x * N) + beta + x with G = ||x||_2 over (H, W) per channel and
/// N = G / (mean_c G + 1e-6). gamma, beta: [1, 1, 1, dim], zero-initialised.
class GlobalResponseNormImpl : public torch::nn::Module {
 public:
  GlobalResponseNormImpl(int64_t dim, const nn::LayerInit& init = {});
  /// x: [B, H, W, dim] -> same shape.
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor gamma, beta;
};
TORCH_MODULE(GlobalResponseNorm);

/// Stage C ResBlock: x + channelwise(LayerNorm2d(depthwise(x)) ++ skip),
/// channelwise = Linear(c + c_skip, 4c) -> GELU -> GRN -> Dropout -> Linear(4c, c).
///
/// Activation rescaling (StageCImpl::set_activation_rescale): every block's
/// forward takes the `stream_scale` s of its residual-stream input, x = s h
/// for the unscaled stream h, and returns s times its unscaled output. The
/// weights are untouched; the layers whose bias would break the scale
/// invariance add s b instead of b (nn::LinearImpl::forward's bias_scale):
/// the depthwise conv ahead of the LayerNorm (whose eps becomes s^2 eps) and
/// the output Linear, whose input is scaled by s (W (s g) + s b = s Linear(g),
/// LoRA included, as LoRA is linear without bias). s = 1 is the reference
/// function exactly.
class CascadeResBlockImpl : public torch::nn::Module {
 public:
  CascadeResBlockImpl(int64_t c, int64_t c_skip, int64_t kernel_size, double dropout, const nn::LayerInit& init);
  /// x: [B, c, H, W]; skip: [B, c_skip, H, W] (required iff c_skip > 0);
  /// stream_scale: see above (> 0).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& skip = {}, double stream_scale = 1.0);
  int64_t c_skip;
  double dropout;
  nn::Conv2d depthwise{nullptr};
  nn::Linear fc1{nullptr}, fc2{nullptr};  // channelwise.0, channelwise.4
  GlobalResponseNorm grn{nullptr};        // channelwise.2
};
TORCH_MODULE(CascadeResBlock);

/// Stage C FeedForwardBlock: x + channelwise(LayerNorm2d(x)) (channelwise as in the ResBlock).
class CascadeFeedForwardBlockImpl : public torch::nn::Module {
 public:
  CascadeFeedForwardBlockImpl(int64_t c, double dropout, const nn::LayerInit& init);
  /// x: [B, c, H, W]; stream_scale as in CascadeResBlockImpl.
  torch::Tensor forward(const torch::Tensor& x, double stream_scale = 1.0);
  double dropout;
  nn::Linear fc1{nullptr}, fc2{nullptr};
  GlobalResponseNorm grn{nullptr};
};
TORCH_MODULE(CascadeFeedForwardBlock);

/// Stage C TimestepBlock: x * (1 + a) + b with (a, b) = sum over conditions i
/// of mapper_i(t_i) split in two; t: [B, r_dim * (1 + conds)] holds the
/// embeddings of r and of each condition back to back.
///
/// With activation rescaling the input is x = s_in h and the output is
/// s_out (h (1 + a) + b) = x ((s_out / s_in)(1 + a)) + s_out b: the block
/// is where the stream's scale changes (the block is not residual, so this
/// is possible: KBlueLeaf's Stable-Cascade-FP16-fixed README), at run time
/// rather than folded into the mapper weights, so training cannot undo it.
class CascadeTimestepBlockImpl : public torch::nn::Module {
 public:
  CascadeTimestepBlockImpl(int64_t c, int64_t r_dim, const std::vector<std::string>& conds, const nn::LayerInit& init);
  /// x: [B, c, H, W]; t: [B, r_dim * (1 + conds)]; scale_in / scale_out: the
  /// stream scales before and after the block (> 0; 1 and 1 = the reference).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, double scale_in = 1.0,
                        double scale_out = 1.0);
  std::vector<nn::Linear> mappers;  // mapper, mapper_<cond>...
};
TORCH_MODULE(CascadeTimestepBlock);

/// torch.nn.MultiheadAttention (batch_first, bias, kdim = vdim = embed_dim)
/// with its parameter names: in_proj_weight [3c, c] (q, k, v rows),
/// in_proj_bias [3c], out_proj.{weight,bias}. Dropout applies to the
/// attention weights in training mode.
/// For LoRA the q, k and v thirds of in_proj_weight are the Linear maps
/// `to_q`, `to_k`, `to_v` (nn::PackedLinearHost; the names kohya's
/// stable-cascade code, ComfyUI and OneTrainer give them); out_proj is an
/// ordinary nn::Linear.
class PackedMultiheadAttentionImpl : public torch::nn::Module, public nn::PackedLinearHost {
 public:
  PackedMultiheadAttentionImpl(int64_t c, int64_t heads, double dropout, const nn::LayerInit& init);
  /// q: [B, L, c]; kv: [B, S, c] -> [B, L, c], times out_scale (applied
  /// ahead of out_proj with its bias corrected: activation rescaling).
  torch::Tensor forward(const torch::Tensor& q, const torch::Tensor& kv, double out_scale = 1.0);

  /// {"to_q", "to_k", "to_v"}.
  std::vector<std::string> packed_names() const override { return {"to_q", "to_k", "to_v"}; }
  /// Rows [i c, (i + 1) c) of in_proj_weight: [c, c] (a view).
  torch::Tensor packed_weight(size_t i) const override;
  nn::LayerAdapter& packed_adapter(size_t i) override;

  int64_t c, heads;
  double dropout;
  torch::Tensor in_proj_weight, in_proj_bias;
  nn::Linear out_proj{nullptr};

 private:
  nn::LayerAdapter adapters_[3];  // q, k, v (LoRA, see nn/lora.h)
};
TORCH_MODULE(PackedMultiheadAttention);

/// Stage C AttnBlock: x + MHA(LayerNorm2d(x), kv = [norm(x) tokens,] kv_mapper(cond)),
/// kv_mapper = SiLU -> Linear(cond_dim, c).
class CascadeAttnBlockImpl : public torch::nn::Module {
 public:
  CascadeAttnBlockImpl(int64_t c, int64_t cond_dim, int64_t heads, bool self_attn, double dropout,
                       const nn::LayerInit& init);
  /// x: [B, c, H, W]; cond: [B, S, cond_dim]; stream_scale as in
  /// CascadeResBlockImpl (the attention output is scaled ahead of out_proj).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cond, double stream_scale = 1.0);
  bool self_attn;
  PackedMultiheadAttention attn{nullptr};  // attention.attn
  nn::Linear kv_mapper{nullptr};           // kv_mapper.1
};
TORCH_MODULE(CascadeAttnBlock);

/// Stable Cascade stage C. Runs in the dtype of its parameters (fp32, or
/// bf16 after `->to(torch::kBFloat16)`; inputs must be in that dtype too).
class StageCImpl : public torch::nn::Module, public Denoiser {
 public:
  /// Builds the model; with `init` on the meta device nothing is allocated.
  /// Non-meta builds get the reference initialisation (StageC.__init__:
  /// xavier-uniform convs/linears with zero bias, N(0, 0.02) CLIP mappers,
  /// embedding conv xavier gain 0.02, zero clf conv, zero TimestepBlock
  /// mappers, ResBlock output Linear scaled by sqrt(1 / sum(down_blocks))).
  /// Throws shoestring::Error on inconsistent options (list lengths, unknown
  /// block letter, channels not divisible by heads).
  explicit StageCImpl(const StageCOptions& options = {}, const nn::LayerInit& init = {});

  /// x: [B, in_channels, H, W] (24 x 24 for 1024 px images); r: [B] noise
  /// level in [0, 1] (embedded as sin/cos of r * 10000, StageC.gen_r_embedding);
  /// clip_text: [B, L, clip_text_dim]; clip_text_pooled: [B, 1, clip_text_pooled_dim]
  /// or [B, clip_text_pooled_dim]; clip_img: [B, 1, clip_image_dim] or [B, clip_image_dim];
  /// t_cond_values: one [B] tensor per options().t_conds() entry (missing or
  /// undefined ones are zero, as in the reference). Returns [B, out_channels, H, W].
  /// Throws shoestring::Error on shape mismatch.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& r, const torch::Tensor& clip_text,
                        const torch::Tensor& clip_text_pooled, const torch::Tensor& clip_img,
                        const std::vector<torch::Tensor>& t_cond_values = {});

  /// The conditioning tokens [B, L + 2 * clip_seq, cond_dim] (LayerNorm'ed, no affine).
  torch::Tensor condition_tokens(const torch::Tensor& clip_text, const torch::Tensor& clip_text_pooled,
                                 const torch::Tensor& clip_img);
  /// Sinusoidal embedding of r: [B] -> [B, r_dim], as StageC.gen_r_embedding.
  torch::Tensor r_embedding(const torch::Tensor& r) const;

  /// The blocks of this model for per-block compute dtype and checkpointing
  /// (precision::resolve / apply, OverflowMonitor): every ResBlock,
  /// TimestepBlock, AttnBlock and FeedForwardBlock (`down_blocks.<l>.<i>`,
  /// `up_blocks.<k>.<i>`) is a checkpointable block (gradient checkpointing
  /// is a precision rule: `checkpoint = true` or the `gradient_checkpointing`
  /// shorthand);
  /// the model itself (the root) is a scope that carries the compute dtype of
  /// the CLIP mappers, embedding, level transitions, repeat mappers and clf,
  /// never checkpointed.
  /// Unconfigured (the default), forward() is the plain path. Once
  /// configured, forward() runs as its root scope (x and the CLIP inputs cast
  /// to the scope's compute dtype; r and the t_conds never); if the root has
  /// no entry, layers outside blocks compute in the enclosing scope's dtype,
  /// or in the parameters' dtype when there is none.
  nn::BlockTable* block_table() const override { return block_table_.get(); }

  const StageCOptions& options() const { return options_; }

  /// fp16 overflow fix by activation rescaling: in the last up-block group
  /// (`up_blocks.<levels - 1>`, level 0, the group whose hidden states
  /// outgrow fp16 in the releases: KBlueLeaf's Stable-Cascade-FP16-fixed
  /// README), every TimestepBlock multiplies the residual stream by `factor`
  /// on top of its own function, so after the j-th TimestepBlock of the
  /// group the stream is held as factor^j times its reference value; the
  /// blocks in between carry the scale (see CascadeResBlockImpl) and the
  /// group ends in clf's scale-invariant LayerNorm2d. Every LayerNorm2d of a
  /// stream held at scale s uses eps s^2 1e-6, so the function is the
  /// reference one up to rounding; a power of two (0.5, 0.25) keeps the
  /// scaling itself exact. The multipliers live in the
  /// model object (not in the weights or the state dict), so training and
  /// saving never see them. 1 = off (the default).
  /// Throws shoestring::Error unless 0 < factor <= 1.
  void set_activation_rescale(double factor);
  double activation_rescale() const { return activation_rescale_; }

  nn::Linear clip_txt_mapper{nullptr}, clip_txt_pooled_mapper{nullptr}, clip_img_mapper{nullptr};
  nn::Conv2d embedding_conv{nullptr};  // embedding.1
  nn::Conv2d clf_conv{nullptr};        // clf.1
  torch::nn::ModuleList down_blocks{nullptr}, down_downscalers{nullptr}, down_repeat_mappers{nullptr};
  torch::nn::ModuleList up_blocks{nullptr}, up_upscalers{nullptr}, up_repeat_mappers{nullptr};

 private:
  torch::Tensor run_level(const torch::nn::ModuleList& blocks, const torch::nn::ModuleList& repeat_mappers,
                          torch::Tensor x, const torch::Tensor& r_embed, const torch::Tensor& cond,
                          const torch::Tensor& skip, double rescale, double* stream_scale);
  void reset_parameters();
  torch::Tensor forward_impl(const torch::Tensor& x, const torch::Tensor& r, const torch::Tensor& clip_text,
                             const torch::Tensor& clip_text_pooled, const torch::Tensor& clip_img,
                             const std::vector<torch::Tensor>& t_cond_values);

  StageCOptions options_;
  double activation_rescale_ = 1.0;
  std::shared_ptr<nn::BlockTable> block_table_ = std::make_shared<nn::BlockTable>();
  // Per level: the 1x1 convs between levels (nullptr where there is none).
  std::vector<nn::Conv2d> downscale_convs_, upscale_convs_;
  // Typed views of down_blocks.<i> / down_repeat_mappers.<i> and the up ones.
  std::vector<torch::nn::ModuleList> down_levels_, down_maps_, up_levels_, up_maps_;
};
TORCH_MODULE(StageC);

/// StageCImpl::forward's memory trace (models/cascade_trace.cpp): x [B,
/// in_channels, S, S], r [B], CLIP text [B, L, clip_text_dim], pooled [B, 1,
/// clip_text_pooled_dim], image [B, 1, clip_image_dim]; each block a
/// checkpointed segment under TracePrecision::checkpoint. Throws
/// shoestring::Error when `model` is not a StageCImpl or uses patch_size > 1
/// or switch_level (not modelled).
void trace_stage_c(torch::nn::Module& model, nn::MemoryTracer& tracer, const DenoiserBatch& in);

/// Random inputs of those shapes bound to StageCImpl::forward (r in [0, 1)).
DenoiserExample stage_c_example(torch::nn::Module& model, const DenoiserBatch& in, at::ScalarType dtype);

/// The released 3.6B stage C (stage_c.safetensors): 3,589,103,632 parameters.
StageC build_cascade_c(const nn::LayerInit& init = {});
/// The released 1B stage C lite (stage_c_lite.safetensors): 1,030,785,040 parameters.
StageC build_cascade_c_lite(const nn::LayerInit& init = {});

}  // namespace shoestring::models
