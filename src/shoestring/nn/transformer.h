// Transformer blocks over image feature maps, as in the Latent Diffusion /
// Stable Diffusion UNet (CompVis `ldm/modules/attention.py`: SpatialTransformer,
// BasicTransformerBlock, FeedForward with GEGLU from Shazeer 2020, "GLU
// Variants Improve Transformer", arXiv 2002.05202).
#pragma once
#include <cstdint>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/pimpl.h>

#include "shoestring/nn/attention.h"
#include "shoestring/nn/block_precision.h"
#include "shoestring/nn/key_layout.h"
#include "shoestring/nn/layers.h"

namespace shoestring::nn {

/// Position-wise feed-forward: GEGLU (gated=true): out(dropout(a * GELU(g)))
/// with [a, g] = proj(x).chunk(2); plain (gated=false): out(dropout(GELU(proj(x)))).
/// GELU is the exact (erf) form. Submodules: proj, dropout, out; key names
/// kShoestring proj / dropout / out, kLdm net.0.proj (gated) or net.0.0
/// (plain) / net.1 / net.2 (LDM's FeedForward.net Sequential).
class FeedForwardImpl : public torch::nn::Module {
 public:
  /// dim: input/output channels; inner_dim: hidden width (the gated form's
  /// proj emits 2*inner_dim). Throws shoestring::Error on non-positive sizes.
  FeedForwardImpl(int64_t dim, int64_t inner_dim, bool gated = true, double dropout = 0.0,
                  KeyLayout layout = KeyLayout::kShoestring, const LayerInit& init = {});
  /// x: [..., dim] -> [..., dim].
  torch::Tensor forward(const torch::Tensor& x);

  Linear proj{nullptr}, out{nullptr};
  torch::nn::Dropout dropout{nullptr};

 private:
  bool gated_;
};
TORCH_MODULE(FeedForward);

/// Options for TransformerBlock and SpatialTransformer.
struct TransformerOptions {
  TransformerOptions(int64_t dim, int64_t heads, int64_t head_dim) : dim_(dim), heads_(heads), head_dim_(head_dim) {}
  /// Token channels (SpatialTransformer: the feature-map channels).
  TORCH_ARG(int64_t, dim);
  TORCH_ARG(int64_t, heads);
  TORCH_ARG(int64_t, head_dim);
  /// Key/value heads for grouped-query attention; 0 = heads.
  TORCH_ARG(int64_t, num_kv_heads) = 0;
  /// Channels of the cross-attention context; 0 = no cross-attention (no attn2/norm2).
  TORCH_ARG(int64_t, context_dim) = 0;
  /// Feed-forward hidden width = ff_mult * dim.
  TORCH_ARG(int64_t, ff_mult) = 4;
  /// GEGLU feed-forward (true, as in SD) or plain GELU MLP.
  TORCH_ARG(bool, gated_ff) = true;
  TORCH_ARG(double, dropout) = 0.0;
  /// Number of TransformerBlocks inside a SpatialTransformer.
  TORCH_ARG(int64_t, depth) = 1;
  /// Upper bound on GroupNorm groups of SpatialTransformer.norm.
  TORCH_ARG(int64_t, groups) = 32;
  /// Zero-initialise SpatialTransformer.proj_out (LDM's `zero_module`), so the
  /// block starts as the identity.
  TORCH_ARG(bool, zero_init_out) = true;
  /// SpatialTransformer proj_in / proj_out as Linear [dim, dim] on tokens
  /// (SDXL / SD2: `use_linear_in_transformer`) instead of 1x1 convolutions
  /// [dim, dim, 1, 1] on the feature map (SD 1.x). The same map either way.
  TORCH_ARG(bool, linear_proj) = false;
  /// Key names (see KeyLayout): SpatialTransformer blocks.<i> (kShoestring)
  /// or transformer_blocks.<i> (kLdm); passed on to Attention and FeedForward.
  TORCH_ARG(KeyLayout, layout) = KeyLayout::kShoestring;
  /// Device/dtype of the parameters; LayerInit{torch::kMeta} allocates nothing.
  TORCH_ARG(LayerInit, init) = LayerInit{};
};

/// Pre-norm transformer block (LDM BasicTransformerBlock):
///   x = x + attn1(norm1(x));  x = x + attn2(norm2(x), context, mask);  x = x + ff(norm3(x)).
/// Submodules: norm1, attn1, norm2, attn2 (if context_dim > 0), norm3, ff.
class TransformerBlockImpl : public torch::nn::Module {
 public:
  explicit TransformerBlockImpl(const TransformerOptions& options);
  /// x: [B, L, dim]; context: [B, Lc, context_dim] (required iff context_dim > 0);
  /// context_mask: [B, Lc] bool (true = real token) or undefined. Returns [B, L, dim].
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& context = {},
                        const torch::Tensor& context_mask = {});

  LayerNorm norm1{nullptr}, norm2{nullptr}, norm3{nullptr};
  Attention attn1{nullptr}, attn2{nullptr};
  FeedForward ff{nullptr};
};
TORCH_MODULE(TransformerBlock);

/// Transformer over a feature map (LDM SpatialTransformer):
///   h = proj_in(norm(x)) -> [B, H*W, dim] -> blocks -> [B, dim, H, W] -> proj_out;  out = x + h.
/// proj_in / proj_out are 1x1 convolutions, or Linear layers with
/// options.linear_proj(). Submodules: norm, proj_in, blocks.<i> (kLdm:
/// transformer_blocks.<i>), proj_out.
class SpatialTransformerImpl : public torch::nn::Module {
 public:
  /// Throws shoestring::Error on bad options.
  explicit SpatialTransformerImpl(const TransformerOptions& options);
  /// x: [B, dim, H, W]; context / context_mask as in TransformerBlock.
  /// Returns [B, dim, H, W]. Throws shoestring::Error on shape mismatch.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& context = {},
                        const torch::Tensor& context_mask = {});

  const TransformerOptions& options() const { return options_; }

  /// Routes each transformer block through nn::run_block(table, ...) while
  /// `table` is configured (per-block compute dtype / checkpoint from
  /// precision rules, nn/block_precision.h; a deep stack such as SDXL's 10
  /// blocks then recomputes one block at a time in backward when each block
  /// has its own checkpoint entry). The owning model declares
  /// the blocks in `table` and keeps it alive; nullptr (default) or an
  /// unconfigured table leaves forward() as without this call.
  void set_block_table(const BlockTable* table) { block_table_ = table; }

  GroupNorm norm{nullptr};
  /// The projections: proj_in/proj_out (1x1 convs) unless linear_proj, then
  /// proj_in_linear/proj_out_linear (registered as "proj_in"/"proj_out").
  Conv2d proj_in{nullptr}, proj_out{nullptr};
  Linear proj_in_linear{nullptr}, proj_out_linear{nullptr};
  torch::nn::ModuleList blocks{nullptr};

 private:
  TransformerOptions options_;
  const BlockTable* block_table_ = nullptr;
};
TORCH_MODULE(SpatialTransformer);

}  // namespace shoestring::nn
