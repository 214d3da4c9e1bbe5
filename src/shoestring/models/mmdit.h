// MMDiT / MMDiT-X: the multimodal diffusion transformer of Stable Diffusion 3
// (Esser et al. 2024, "Scaling Rectified Flow Transformers for High-Resolution
// Image Synthesis") and its SD3.5 Medium variant MMDiT-X, whose first 13
// image blocks add a second, image-only self-attention (attn2).
//
// Architecture and parameter names follow Stability's reference code
// (github.com/Stability-AI/sd3.5, mmditx.py: PatchEmbed, TimestepEmbedder,
// VectorEmbedder, SelfAttention, DismantledBlock, JointBlock, FinalLayer,
// MMDiTX), so named_parameters() plus the `pos_embed` buffer, each prefixed
// with kMMDiTCheckpointPrefix, are exactly the MMDiT tensors of the released
// single file sd3.5_medium.safetensors:
//
//   x_embedder.proj.{weight,bias}          conv patch x patch, stride patch
//   pos_embed                              buffer [1, max_size^2, hidden]
//   t_embedder.mlp.{0,2}.*, y_embedder.mlp.{0,2}.*, context_embedder.*
//   joint_blocks.<i>.{context_block,x_block}.attn.{qkv,proj}.*, attn.ln_q.weight,
//       attn.ln_k.weight (RMSNorm qk-norm over head_dim), adaLN_modulation.1.*,
//       mlp.fc1.*, mlp.fc2.*; x_block.attn2.* in x_block_self_attn_layers
//   final_layer.linear.*, final_layer.adaLN_modulation.1.*
//
// The last block's context_block is "pre_only": it only produces keys and
// values for the joint attention (qkv, ln_q/ln_k and a 2 * hidden adaLN), no
// proj / mlp.
//
// Grouped-query attention (Ainslie et al. 2023, arXiv 2305.13245) is an
// extension: with num_kv_heads < num_heads every qkv projection has
// (num_heads + 2 * num_kv_heads) * head_dim outputs laid out [q | k | v], and
// query head h uses key/value head h / (num_heads / num_kv_heads). The
// release uses plain multi-head attention (num_kv_heads = num_heads).
#pragma once
#include <cstdint>
#include <vector>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/pimpl.h>

#include "shoestring/models/denoiser.h"
#include "shoestring/models/denoiser_io.h"
#include "shoestring/nn/block_precision.h"
#include "shoestring/nn/layers.h"

namespace shoestring::models {

/// Key prefix of the MMDiT tensors in the SD3 / SD3.5 single-file releases.
inline constexpr const char* kMMDiTCheckpointPrefix = "model.diffusion_model.";

/// Hyper-parameters of MMDiT. Defaults are SD3.5 Medium (sd3.5 reference
/// repo's sd3_impls.py reads them from the checkpoint: depth = 24 from
/// x_embedder.proj.weight, pos_embed_max_size 384, adm_in_channels 2048,
/// context 4096, qk_norm "rms", x_block_self_attn_layers 0..12; diffusers
/// SD3Transformer2DModel config of stabilityai/stable-diffusion-3.5-medium).
struct MMDiTOptions {
  TORCH_ARG(int64_t, in_channels) = 16;
  TORCH_ARG(int64_t, out_channels) = 16;
  TORCH_ARG(int64_t, patch_size) = 2;
  /// Number of joint blocks.
  TORCH_ARG(int64_t, depth) = 24;
  /// Width; 0 = 64 * depth (the reference's rule).
  TORCH_ARG(int64_t, hidden_size) = 0;
  /// Query heads; 0 = depth (head_dim 64 with the default width).
  TORCH_ARG(int64_t, num_heads) = 0;
  /// Key/value heads (grouped-query attention); 0 = num_heads.
  TORCH_ARG(int64_t, num_kv_heads) = 0;
  TORCH_ARG(double, mlp_ratio) = 4.0;
  /// Width of the pooled text vector y.
  TORCH_ARG(int64_t, adm_in_channels) = 2048;
  /// Width of the text tokens (CLIP-L/G + T5 hidden states, 4096).
  TORCH_ARG(int64_t, context_dim) = 4096;
  /// Side of the stored positional-embedding grid; inputs may have at most
  /// this many patches per side (the centre crop is used).
  TORCH_ARG(int64_t, pos_embed_max_size) = 384;
  /// Blocks whose x_block has the extra self-attention attn2 (MMDiT-X).
  TORCH_ARG(std::vector<int64_t>, x_block_self_attn_layers) = std::vector<int64_t>{0, 1, 2, 3,  4,  5, 6,
                                                                                   7, 8, 9, 10, 11, 12};
  /// RMSNorm qk-norm (ln_q, ln_k) in every attention.
  TORCH_ARG(bool, qk_norm) = true;
  TORCH_ARG(bool, qkv_bias) = true;
  /// Width of the sinusoidal timestep features fed to t_embedder.
  TORCH_ARG(int64_t, frequency_embedding_size) = 256;

 public:
  /// SD3.5 Medium (sd3.5_medium.safetensors).
  static MMDiTOptions sd35_medium() { return MMDiTOptions(); }
  /// Same structure as SD3.5 Medium (16 latent channels, patch 2, qk-norm,
  /// attn2), small: depth 3, hidden 64, 4 heads, attn2 in blocks 0 and 1, a
  /// 32 x 32 patch grid at most, and context and pooled widths 64 (what the
  /// tiny CLIP-L and bigG of width 32 give side by side, as 768 + 1280 =
  /// 2048 do for the release). For tests that train on the CPU.
  static MMDiTOptions tiny() {
    return MMDiTOptions()
        .depth(3)
        .hidden_size(64)
        .num_heads(4)
        .pos_embed_max_size(32)
        .x_block_self_attn_layers({0, 1})
        .context_dim(64)
        .adm_in_channels(64);
  }
  int64_t hidden() const { return hidden_size_ > 0 ? hidden_size_ : 64 * depth_; }
  int64_t heads() const { return num_heads_ > 0 ? num_heads_ : depth_; }
  int64_t kv_heads() const { return num_kv_heads_ > 0 ? num_kv_heads_ : heads(); }
};

/// Self-attention projection of one stream: qkv (Linear hidden ->
/// (heads + 2 kv_heads) * head_dim), optional RMSNorm qk-norm, proj (absent when pre_only).
class MMDiTAttentionImpl : public torch::nn::Module {
 public:
  MMDiTAttentionImpl(int64_t dim, int64_t heads, int64_t kv_heads, bool qkv_bias, bool pre_only, bool qk_norm,
                     const nn::LayerInit& init);
  /// x: [B, L, dim] -> q [B, L, heads, head_dim], k and v [B, L, kv_heads, head_dim]
  /// (q and k normalised when qk_norm).
  std::vector<torch::Tensor> pre_attention(const torch::Tensor& x);
  int64_t heads, kv_heads, head_dim;
  nn::Linear qkv{nullptr}, proj{nullptr};
  nn::RMSNorm ln_q{nullptr}, ln_k{nullptr};
};
TORCH_MODULE(MMDiTAttention);

/// Transformer MLP: fc2(GELU_tanh(fc1(x))).
class MMDiTMlpImpl : public torch::nn::Module {
 public:
  MMDiTMlpImpl(int64_t dim, int64_t hidden, const nn::LayerInit& init);
  torch::Tensor forward(const torch::Tensor& x);
  nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(MMDiTMlp);

/// One stream of a joint block (the reference's DismantledBlock): adaLN
/// modulation from the conditioning vector (6 chunks, 9 with attn2, 2 when
/// pre_only), LayerNorm (no affine, eps 1e-6), attention projections, MLP.
class MMDiTStreamBlockImpl : public torch::nn::Module {
 public:
  MMDiTStreamBlockImpl(const MMDiTOptions& o, bool pre_only, bool self_attn2, const nn::LayerInit& init);
  bool pre_only, has_attn2;
  MMDiTAttention attn{nullptr}, attn2{nullptr};
  MMDiTMlp mlp{nullptr};
  nn::Linear adaLN_modulation{nullptr};  // adaLN_modulation.1 (after SiLU)
};
TORCH_MODULE(MMDiTStreamBlock);

/// Joint block: context and image streams attend jointly over the
/// concatenation [context tokens, image tokens].
class MMDiTJointBlockImpl : public torch::nn::Module {
 public:
  MMDiTJointBlockImpl(const MMDiTOptions& o, bool last, bool self_attn2, const nn::LayerInit& init);
  /// context: [B, Lc, hidden]; x: [B, Lx, hidden]; c: [B, hidden].
  /// Returns {context' (undefined for the last block), x'}.
  std::vector<torch::Tensor> forward(const torch::Tensor& context, const torch::Tensor& x, const torch::Tensor& c);
  MMDiTStreamBlock context_block{nullptr}, x_block{nullptr};
};
TORCH_MODULE(MMDiTJointBlock);

/// Where an image's patch grid sits in the position embedding, in patches
/// from its top-left corner; top < 0 = centred (the reference's default).
/// SD3.5 Medium was trained with random crops (kohya's
/// pos_emb_random_crop_rate draws top in [0, max - h], left in [0, max - w]).
struct PosEmbedCrop {
  int64_t top = -1, left = -1;
};

/// The MMDiT(-X) denoiser. Runs in the dtype of its parameters (fp32, or
/// bf16 after `->to(torch::kBFloat16)`; inputs in that dtype too).
class MMDiTImpl : public torch::nn::Module, public Denoiser {
 public:
  /// Builds the model; with `init` on the meta device nothing is allocated
  /// (pos_embed too is a meta buffer). Non-meta builds get DiT's
  /// initialisation (Peebles & Xie 2023: xavier-uniform linears with zero
  /// bias, N(0, 0.02) timestep/vector MLPs, zero adaLN modulations and final
  /// linear, so a fresh model predicts 0) and the fixed 2-D sin-cos pos_embed
  /// of the reference's get_2d_sincos_pos_embed.
  /// Throws shoestring::Error on bad options (hidden not divisible by heads,
  /// kv heads not dividing heads, attn2 layer out of range, ...).
  explicit MMDiTImpl(const MMDiTOptions& options = {}, const nn::LayerInit& init = {});

  /// x: [B, in_channels, H, W] latents, H and W divisible by patch_size and
  /// at most pos_embed_max_size patches per side; t: [B] flow-matching time
  /// (sigma) in [0, 1], embedded as timestep 1000 t as in SD3;
  /// context: [B, L, context_dim]; y: [B, adm_in_channels] pooled text.
  /// skip_layers: joint-block indices (0 .. depth - 1, any order, repeats
  /// allowed) skipped entirely, both streams: a skipped block's outputs are
  /// its inputs (sd3.5 reference mmditx.py forward_core_with_concat
  /// `if i in skip_layers: continue`, used by skip-layer guidance,
  /// sd3_impls.py SkipLayerCFGDenoiser; SD3.5 Medium skips 7, 8, 9). Skipping
  /// the last block leaves the image stream as the previous block's output.
  /// Returns [B, out_channels, H, W]. Throws shoestring::Error on shape
  /// mismatch or a skip index outside [0, depth).
  /// `crop`: where the image's patch grid sits in pos_embed (centred by default).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& context,
                        const torch::Tensor& y, const std::vector<int64_t>& skip_layers = {},
                        const PosEmbedCrop& crop = {});

  /// The crop of pos_embed for an h x w patch grid: [1, h * w, hidden],
  /// centred (top = (max - h) / 2, left = (max - w) / 2, the reference's
  /// cropped_pos_embed) unless `crop` places it. Throws shoestring::Error
  /// when the grid exceeds pos_embed_max_size or the crop leaves it.
  torch::Tensor cropped_pos_embed(int64_t h, int64_t w, const PosEmbedCrop& crop = {}) const;

  /// The blocks of this model for per-block compute dtype and checkpointing
  /// (precision::resolve / apply, OverflowMonitor): every joint block
  /// (`joint_blocks.<i>`, context and image stream together) is a
  /// checkpointable block (gradient checkpointing is a precision rule:
  /// `checkpoint = true` or the `gradient_checkpointing` shorthand); the model itself (the root) is
  /// a scope that carries the compute dtype of the embedders, pos_embed
  /// addition and final layer but is never checkpointed.
  /// Unconfigured (the default), forward() is the plain path. Once
  /// configured, forward() runs as its root scope (x, context and y cast to
  /// the scope's compute dtype, t never; output in that dtype); if the root
  /// has no entry, layers outside blocks compute in the enclosing scope's
  /// dtype, or in the parameters' dtype when there is none.
  nn::BlockTable* block_table() const override { return block_table_.get(); }

  const MMDiTOptions& options() const { return options_; }

  nn::Conv2d x_embedder{nullptr};                           // x_embedder.proj
  nn::Linear t_embedder_0{nullptr}, t_embedder_2{nullptr};  // t_embedder.mlp.{0,2}
  nn::Linear y_embedder_0{nullptr}, y_embedder_2{nullptr};  // y_embedder.mlp.{0,2}
  nn::Linear context_embedder{nullptr};
  torch::nn::ModuleList joint_blocks{nullptr};
  nn::Linear final_linear{nullptr}, final_adaLN{nullptr};  // final_layer.linear, final_layer.adaLN_modulation.1
  torch::Tensor pos_embed;

 private:
  void reset_parameters();
  torch::Tensor forward_impl(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& context,
                             const torch::Tensor& y, const std::vector<bool>& skip, const PosEmbedCrop& crop);
  MMDiTOptions options_;
  std::vector<MMDiTJointBlock> blocks_;
  std::shared_ptr<nn::BlockTable> block_table_ = std::make_shared<nn::BlockTable>();
};
TORCH_MODULE(MMDiT);

/// MMDiTImpl::forward's memory trace (models/mmdit_trace.cpp): x [B,
/// in_channels, S, S], t [B], context [B, L, context_dim], pooled y [B,
/// adm_in_channels]; each joint block a checkpointed segment under
/// TracePrecision::checkpoint. Throws shoestring::Error when `model` is not
/// an MMDiTImpl or S does not fit patch_size and pos_embed_max_size.
void trace_mmdit(torch::nn::Module& model, nn::MemoryTracer& tracer, const DenoiserBatch& in);

/// Random inputs of those shapes bound to MMDiTImpl::forward (t in [0, 1)).
DenoiserExample mmdit_example(torch::nn::Module& model, const DenoiserBatch& in, at::ScalarType dtype);

/// Fixed 2-D sin-cos positional embedding of a grid x grid patch grid:
/// [grid * grid, dim], row-major over (row, column); the first dim/2
/// channels encode the column, the rest the row, each as [sin | cos] of
/// pos / 10000^(2i/(dim/2)) (MAE / DiT get_2d_sincos_pos_embed). fp32.
torch::Tensor sincos_pos_embed_2d(int64_t dim, int64_t grid);

/// SD3.5 Medium (sd3.5_medium.safetensors): 2,243,171,520 parameters plus the
/// 226,492,416-element pos_embed buffer.
MMDiT build_sd35_medium(const nn::LayerInit& init = {});

}  // namespace shoestring::models
