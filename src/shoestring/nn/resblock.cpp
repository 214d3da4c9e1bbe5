#include "shoestring/nn/resblock.h"

#include <torch/torch.h>

#include "shoestring/core/error.h"

namespace shoestring::nn {

int64_t norm_groups(int64_t channels, int64_t max_groups) {
  if (channels <= 0 || max_groups <= 0) {
    fail("norm_groups: channels ({}) and max_groups ({}) must be positive", channels, max_groups);
  }
  for (int64_t g = std::min(channels, max_groups); g > 1; --g) {
    if (channels % g == 0) return g;
  }
  return 1;
}

ResBlockImpl::ResBlockImpl(const ResBlockOptions& options) : options_(options) {
  const auto& o = options_;
  if (o.in_channels() <= 0 || o.out_channels() <= 0 || o.temb_dim() < 0) {
    fail("ResBlock: bad sizes (in_channels {}, out_channels {}, temb_dim {})", o.in_channels(), o.out_channels(),
         o.temb_dim());
  }
  // Key names per layout, in registration order:
  // norm1, conv1, time_emb_proj, norm2, dropout, conv2, conv_shortcut.
  struct Names {
    const char *norm1, *conv1, *temb, *norm2, *dropout, *conv2, *shortcut;
  };
  static constexpr Names kShoestringNames{"norm1",   "conv1", "time_emb_proj", "norm2",
                                          "dropout", "conv2", "conv_shortcut"};
  static constexpr Names kLdmNames{"in_layers.0",  "in_layers.2",  "emb_layers.1",   "out_layers.0",
                                   "out_layers.2", "out_layers.3", "skip_connection"};
  static constexpr Names kAutoencoderNames{"norm1", "conv1", "temb_proj", "norm2", "dropout", "conv2", "nin_shortcut"};
  const Names& n = o.layout() == KeyLayout::kLdm              ? kLdmNames
                   : o.layout() == KeyLayout::kLdmAutoencoder ? kAutoencoderNames
                                                              : kShoestringNames;
  const LayerInit& init = o.init();
  const int64_t in = o.in_channels(), out = o.out_channels();
  norm1 = register_at(*this, n.norm1, GroupNorm(norm_groups(in, o.groups()), in, o.eps(), true, init));
  conv1 = register_at(*this, n.conv1, Conv2d(in, out, 3, 1, 1, true, init));
  if (o.temb_dim() > 0) {
    time_emb_proj = register_at(*this, n.temb, Linear(o.temb_dim(), o.scale_shift() ? 2 * out : out, true, init));
  }
  norm2 = register_at(*this, n.norm2, GroupNorm(norm_groups(out, o.groups()), out, o.eps(), true, init));
  dropout = register_at(*this, n.dropout, torch::nn::Dropout(o.dropout()));
  conv2 = register_at(*this, n.conv2, Conv2d(out, out, 3, 1, 1, true, init));
  if (o.zero_init_out() && !init.is_meta()) {
    torch::NoGradGuard no_grad;
    conv2->weight.zero_();
    conv2->bias.zero_();
  }
  if (in != out) conv_shortcut = register_at(*this, n.shortcut, Conv2d(in, out, 1, 1, 0, true, init));
}

torch::Tensor ResBlockImpl::forward(const torch::Tensor& x, const torch::Tensor& temb) {
  const auto& o = options_;
  if (x.dim() != 4 || x.size(1) != o.in_channels()) {
    fail("ResBlock: input x must be [B, {}, H, W], got a {}-d tensor with {} channels", o.in_channels(), x.dim(),
         x.dim() > 1 ? x.size(1) : -1);
  }
  torch::Tensor h = conv1->forward(torch::silu(norm1->forward(x)));
  if (time_emb_proj) {
    if (!temb.defined() || temb.dim() != 2 || temb.size(0) != x.size(0) || temb.size(1) != o.temb_dim()) {
      fail("ResBlock: temb must be [{}, {}]", x.size(0), o.temb_dim());
    }
    const torch::Tensor emb = time_emb_proj->forward(torch::silu(temb)).unsqueeze(-1).unsqueeze(-1);
    if (o.scale_shift()) {
      const auto scale_shift = emb.chunk(2, 1);
      h = norm2->forward(h) * (1 + scale_shift[0]) + scale_shift[1];
      return (conv_shortcut ? conv_shortcut->forward(x) : x) + conv2->forward(dropout->forward(torch::silu(h)));
    }
    h = h + emb;
  }
  h = conv2->forward(dropout->forward(torch::silu(norm2->forward(h))));
  return (conv_shortcut ? conv_shortcut->forward(x) : x) + h;
}

}  // namespace shoestring::nn
