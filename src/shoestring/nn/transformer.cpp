#include "shoestring/nn/transformer.h"

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/nn/resblock.h"

namespace shoestring::nn {

FeedForwardImpl::FeedForwardImpl(int64_t dim, int64_t inner_dim, bool gated, double dropout_p, KeyLayout layout,
                                 const LayerInit& init)
    : gated_(gated) {
  if (dim <= 0 || inner_dim <= 0) fail("FeedForward: bad sizes (dim {}, inner_dim {})", dim, inner_dim);
  const bool ldm = layout != KeyLayout::kShoestring;
  proj = register_at(*this, ldm ? (gated ? "net.0.proj" : "net.0.0") : "proj",
                     Linear(dim, gated ? 2 * inner_dim : inner_dim, true, init));
  dropout = register_at(*this, ldm ? "net.1" : "dropout", torch::nn::Dropout(dropout_p));
  out = register_at(*this, ldm ? "net.2" : "out", Linear(inner_dim, dim, true, init));
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
  const int64_t dim = o.dim();
  const LayerInit& init = o.init();
  auto attention = [&](int64_t context_dim) {
    return Attention(AttentionOptions(dim, o.heads(), o.head_dim())
                         .context_dim(context_dim)
                         .num_kv_heads(o.num_kv_heads())
                         .layout(o.layout())
                         .init(init));
  };
  norm1 = register_module("norm1", LayerNorm(dim, 1e-5, true, true, init));
  attn1 = register_module("attn1", attention(0));
  if (o.context_dim() > 0) {
    norm2 = register_module("norm2", LayerNorm(dim, 1e-5, true, true, init));
    attn2 = register_module("attn2", attention(o.context_dim()));
  }
  norm3 = register_module("norm3", LayerNorm(dim, 1e-5, true, true, init));
  ff = register_module("ff", FeedForward(dim, o.ff_mult() * dim, o.gated_ff(), o.dropout(), o.layout(), init));
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
    fail("SpatialTransformer: bad sizes (dim {}, heads {}, head_dim {}, depth {}, ff_mult {})", o.dim(), o.heads(),
         o.head_dim(), o.depth(), o.ff_mult());
  }
  const LayerInit& init = o.init();
  const int64_t dim = o.dim();
  // eps 1e-6 as LDM's SpatialTransformer.norm.
  norm = register_module("norm", GroupNorm(norm_groups(dim, o.groups()), dim, 1e-6, true, init));
  if (o.linear_proj()) {
    proj_in_linear = register_module("proj_in", Linear(dim, dim, true, init));
  } else {
    proj_in = register_module("proj_in", Conv2d(dim, dim, 1, 1, 0, true, init));
  }
  blocks =
      register_module(o.layout() == KeyLayout::kShoestring ? "blocks" : "transformer_blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.depth(); ++i) blocks->push_back(TransformerBlock(o));
  torch::Tensor out_w, out_b;
  if (o.linear_proj()) {
    proj_out_linear = register_module("proj_out", Linear(dim, dim, true, init));
    out_w = proj_out_linear->weight, out_b = proj_out_linear->bias;
  } else {
    proj_out = register_module("proj_out", Conv2d(dim, dim, 1, 1, 0, true, init));
    out_w = proj_out->weight, out_b = proj_out->bias;
  }
  if (o.zero_init_out() && !init.is_meta()) {
    torch::NoGradGuard no_grad;
    out_w.zero_();
    out_b.zero_();
  }
}

torch::Tensor SpatialTransformerImpl::forward(const torch::Tensor& x, const torch::Tensor& context,
                                              const torch::Tensor& context_mask) {
  if (x.dim() != 4 || x.size(1) != options_.dim()) {
    fail("SpatialTransformer: input x must be [B, {}, H, W], got a {}-d tensor", options_.dim(), x.dim());
  }
  const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  torch::Tensor h = norm->forward(x);
  // [B, H*W, C]: a free view when x is channels-last (NHWC), else a strided
  // view that the first LayerNorm makes contiguous.
  if (proj_in) {
    h = proj_in->forward(h).flatten(2).transpose(1, 2);
  } else {
    h = proj_in_linear->forward(h.flatten(2).transpose(1, 2));
  }
  const bool by_table = block_table_ && block_table_->configured();
  for (const auto& block : *blocks) {
    if (by_table) {
      auto self = std::static_pointer_cast<TransformerBlockImpl>(block);
      const torch::Tensor mask = context_mask;  // by value: a checkpointed segment runs again in backward
      std::vector<torch::Tensor> in{h};
      if (context.defined()) in.push_back(context);
      h = run_block(
          block_table_, block,
          [self, mask](const std::vector<torch::Tensor>& x) {
            return std::vector<torch::Tensor>{self->forward(x[0], x.size() > 1 ? x[1] : torch::Tensor(), mask)};
          },
          in)[0];
    } else {
      h = block->as<TransformerBlockImpl>()->forward(h, context, context_mask);
    }
  }
  if (proj_out_linear) h = proj_out_linear->forward(h);
  h = h.transpose(1, 2).reshape({B, C, H, W});  // a channels-last view of contiguous tokens
  return x + (proj_out ? proj_out->forward(h) : h);
}

}  // namespace shoestring::nn
