#include "shoestring/nn/transformer.h"

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/nn/resblock.h"

namespace shoestring::nn {

FeedForwardImpl::FeedForwardImpl(int64_t dim, int64_t inner_dim, bool gated, double dropout_p)
    : gated_(gated) {
  if (dim <= 0 || inner_dim <= 0) fail("FeedForward: bad sizes (dim {}, inner_dim {})", dim, inner_dim);
  proj = register_module("proj", torch::nn::Linear(dim, gated ? 2 * inner_dim : inner_dim));
  dropout = register_module("dropout", torch::nn::Dropout(dropout_p));
  out = register_module("out", torch::nn::Linear(inner_dim, dim));
}

torch::Tensor FeedForwardImpl::forward(const torch::Tensor& x) {
  torch::Tensor h = proj->forward(x);
  if (gated_) {
    auto parts = h.chunk(2, -1);
    h = parts[0] * torch::gelu(parts[1]);
  } else {
    h = torch::gelu(h);
  }
  return out->forward(dropout->forward(h));
}

TransformerBlockImpl::TransformerBlockImpl(const TransformerOptions& o) {
  using torch::nn::LayerNorm;
  using torch::nn::LayerNormOptions;
  const int64_t dim = o.dim();
  norm1 = register_module("norm1", LayerNorm(LayerNormOptions({dim})));
  attn1 = register_module(
      "attn1", Attention(AttentionOptions(dim, o.heads(), o.head_dim()).num_kv_heads(o.num_kv_heads())));
  if (o.context_dim() > 0) {
    norm2 = register_module("norm2", LayerNorm(LayerNormOptions({dim})));
    attn2 = register_module("attn2", Attention(AttentionOptions(dim, o.heads(), o.head_dim())
                                                   .context_dim(o.context_dim())
                                                   .num_kv_heads(o.num_kv_heads())));
  }
  norm3 = register_module("norm3", LayerNorm(LayerNormOptions({dim})));
  ff = register_module("ff", FeedForward(dim, o.ff_mult() * dim, o.gated_ff(), o.dropout()));
}

torch::Tensor TransformerBlockImpl::forward(const torch::Tensor& x, const torch::Tensor& context,
                                            const torch::Tensor& context_mask) {
  torch::Tensor h = x + attn1->forward(norm1->forward(x));
  if (attn2) {
    if (!context.defined()) fail("TransformerBlock: this block has cross-attention and needs a context");
    h = h + attn2->forward(norm2->forward(h), context, context_mask);
  }
  return h + ff->forward(norm3->forward(h));
}

SpatialTransformerImpl::SpatialTransformerImpl(const TransformerOptions& options) : options_(options) {
  const auto& o = options_;
  if (o.dim() <= 0 || o.heads() <= 0 || o.head_dim() <= 0 || o.depth() <= 0 || o.ff_mult() <= 0) {
    fail("SpatialTransformer: bad sizes (dim {}, heads {}, head_dim {}, depth {}, ff_mult {})", o.dim(),
         o.heads(), o.head_dim(), o.depth(), o.ff_mult());
  }
  using namespace torch::nn;
  // eps 1e-6 as LDM's SpatialTransformer.norm.
  norm = register_module("norm", GroupNorm(GroupNormOptions(norm_groups(o.dim(), o.groups()), o.dim()).eps(1e-6)));
  proj_in = register_module("proj_in", Conv2d(Conv2dOptions(o.dim(), o.dim(), 1)));
  blocks = register_module("blocks", ModuleList());
  for (int64_t i = 0; i < o.depth(); ++i) blocks->push_back(TransformerBlock(o));
  proj_out = register_module("proj_out", Conv2d(Conv2dOptions(o.dim(), o.dim(), 1)));
  if (o.zero_init_out()) {
    torch::NoGradGuard no_grad;
    proj_out->weight.zero_();
    proj_out->bias.zero_();
  }
}

torch::Tensor SpatialTransformerImpl::forward(const torch::Tensor& x, const torch::Tensor& context,
                                              const torch::Tensor& context_mask) {
  if (x.dim() != 4 || x.size(1) != options_.dim()) {
    fail("SpatialTransformer: input x must be [B, {}, H, W], got a {}-d tensor", options_.dim(), x.dim());
  }
  const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  torch::Tensor h = proj_in->forward(norm->forward(x));
  // [B, H*W, C]: a free view when x is channels-last (NHWC), else a strided
  // view that the first LayerNorm makes contiguous.
  h = h.flatten(2).transpose(1, 2);
  for (const auto& block : *blocks) {
    h = block->as<TransformerBlockImpl>()->forward(h, context, context_mask);
  }
  h = h.transpose(1, 2).reshape({B, C, H, W});  // a channels-last view of contiguous tokens
  return x + proj_out->forward(h);
}

}  // namespace shoestring::nn
