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
    fail("ResBlock: bad sizes (in_channels {}, out_channels {}, temb_dim {})", o.in_channels(),
         o.out_channels(), o.temb_dim());
  }
  using namespace torch::nn;
  norm1 = register_module(
      "norm1", GroupNorm(GroupNormOptions(norm_groups(o.in_channels(), o.groups()), o.in_channels()).eps(o.eps())));
  conv1 = register_module("conv1", Conv2d(Conv2dOptions(o.in_channels(), o.out_channels(), 3).padding(1)));
  if (o.temb_dim() > 0) {
    time_emb_proj = register_module("time_emb_proj", Linear(o.temb_dim(), o.out_channels()));
  }
  norm2 = register_module(
      "norm2", GroupNorm(GroupNormOptions(norm_groups(o.out_channels(), o.groups()), o.out_channels()).eps(o.eps())));
  dropout = register_module("dropout", Dropout(o.dropout()));
  conv2 = register_module("conv2", Conv2d(Conv2dOptions(o.out_channels(), o.out_channels(), 3).padding(1)));
  if (o.zero_init_out()) {
    torch::NoGradGuard no_grad;
    conv2->weight.zero_();
    conv2->bias.zero_();
  }
  if (o.in_channels() != o.out_channels()) {
    conv_shortcut = register_module("conv_shortcut", Conv2d(Conv2dOptions(o.in_channels(), o.out_channels(), 1)));
  }
}

torch::Tensor ResBlockImpl::forward(const torch::Tensor& x, const torch::Tensor& temb) {
  const auto& o = options_;
  if (x.dim() != 4 || x.size(1) != o.in_channels()) {
    fail("ResBlock: input x must be [B, {}, H, W], got a {}-d tensor with {} channels", o.in_channels(),
         x.dim(), x.dim() > 1 ? x.size(1) : -1);
  }
  torch::Tensor h = conv1->forward(torch::silu(norm1->forward(x)));
  if (time_emb_proj) {
    if (!temb.defined() || temb.dim() != 2 || temb.size(0) != x.size(0) || temb.size(1) != o.temb_dim()) {
      fail("ResBlock: temb must be [{}, {}]", x.size(0), o.temb_dim());
    }
    h = h + time_emb_proj->forward(torch::silu(temb)).unsqueeze(-1).unsqueeze(-1);
  }
  h = conv2->forward(dropout->forward(torch::silu(norm2->forward(h))));
  return (conv_shortcut ? conv_shortcut->forward(x) : x) + h;
}

}  // namespace shoestring::nn
