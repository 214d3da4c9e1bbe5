#include "shoestring/models/tiny_unet.h"

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/nn/checkpoint.h"

namespace shoestring::models {
namespace {

nn::TransformerOptions transformer_options(const TinyUNetOptions& o, int64_t channels) {
  if (channels % o.num_heads() != 0) {
    fail("TinyUNet: channels {} not divisible by num_heads {}", channels, o.num_heads());
  }
  return nn::TransformerOptions(channels, o.num_heads(), channels / o.num_heads())
      .num_kv_heads(o.num_kv_heads())
      .context_dim(o.context_dim())
      .dropout(o.dropout())
      .groups(o.groups())
      .init(o.init());
}

nn::ResBlock make_res(const TinyUNetOptions& o, int64_t in, int64_t out, int64_t temb_dim) {
  return nn::ResBlock(nn::ResBlockOptions(in, out, temb_dim)
                          .groups(o.groups())
                          .dropout(o.dropout())
                          .scale_shift(o.scale_shift_norm())
                          .init(o.init()));
}

nn::Conv2d conv3x3(const TinyUNetOptions& o, int64_t in, int64_t out, int64_t stride = 1) {
  return nn::Conv2d(in, out, 3, stride, 1, true, o.init());
}

}  // namespace

TinyUNetLevelImpl::TinyUNetLevelImpl() {
  res = register_module("res", torch::nn::ModuleList());
  attn = register_module("attn", torch::nn::ModuleList());
}

TinyUNetMidImpl::TinyUNetMidImpl(const TinyUNetOptions& o, int64_t channels, int64_t temb_dim) {
  res1 = register_module("res1", make_res(o, channels, channels, temb_dim));
  attn = register_module("attn", nn::SpatialTransformer(transformer_options(o, channels)));
  res2 = register_module("res2", make_res(o, channels, channels, temb_dim));
}

TinyUNetImpl::TinyUNetImpl(const TinyUNetOptions& options) : options_(options) {
  const auto& o = options_;
  const auto& mult = o.channel_mult();
  const int64_t levels = static_cast<int64_t>(mult.size());
  if (levels == 0) fail("TinyUNet: channel_mult must not be empty");
  if (o.in_channels() <= 0 || o.out_channels() <= 0 || o.base_channels() <= 0 || o.num_res_blocks() <= 0 ||
      o.num_heads() <= 0 || o.context_dim() <= 0) {
    fail(
        "TinyUNet: in_channels, out_channels, base_channels, num_res_blocks, num_heads and context_dim "
        "must be positive");
  }
  for (int64_t m : mult) {
    if (m <= 0) fail("TinyUNet: channel_mult entries must be positive, got {}", m);
  }
  std::vector<bool> has_attn(levels, false);
  for (int64_t l : o.attention_levels()) {
    if (l < 0 || l >= levels) fail("TinyUNet: attention level {} out of range [0, {})", l, levels);
    has_attn[l] = true;
  }

  const int64_t base = o.base_channels();
  const int64_t temb_dim = 4 * base;  // as LDM: time_embed_dim = 4 * model_channels
  time_embed =
      register_module("time_embed", nn::TimestepEmbedding(base, temb_dim, nn::KeyLayout::kShoestring, o.init()));
  if (o.pooled_context()) {
    text_embed = register_module("text_embed", nn::Linear(o.context_dim(), temb_dim, true, o.init()));
  }
  conv_in = register_module("conv_in", conv3x3(o, o.in_channels(), base));

  // Down path; record the channels of every tensor pushed as a skip.
  std::vector<int64_t> skip_channels{base};
  int64_t ch = base;
  down = register_module("down", torch::nn::ModuleList());
  for (int64_t l = 0; l < levels; ++l) {
    TinyUNetLevel level;
    const int64_t out = base * mult[l];
    for (int64_t i = 0; i < o.num_res_blocks(); ++i) {
      level->res->push_back(make_res(o, ch, out, temb_dim));
      ch = out;
      if (has_attn[l]) level->attn->push_back(nn::SpatialTransformer(transformer_options(o, ch)));
      skip_channels.push_back(ch);
    }
    if (l + 1 < levels) {
      level->downsample = level->register_module("downsample", conv3x3(o, ch, ch, 2));
      skip_channels.push_back(ch);
    }
    down->push_back(level);
  }

  mid = register_module("mid", TinyUNetMid(o, ch, temb_dim));

  // Up path, built deepest first but stored so that up[l] mirrors down[l].
  std::vector<TinyUNetLevel> up_levels(levels, nullptr);
  for (int64_t l = levels - 1; l >= 0; --l) {
    TinyUNetLevel level;
    const int64_t out = base * mult[l];
    for (int64_t i = 0; i <= o.num_res_blocks(); ++i) {
      const int64_t skip = skip_channels.back();
      skip_channels.pop_back();
      level->res->push_back(make_res(o, ch + skip, out, temb_dim));
      ch = out;
      if (has_attn[l]) level->attn->push_back(nn::SpatialTransformer(transformer_options(o, ch)));
    }
    if (l > 0) level->upsample = level->register_module("upsample", conv3x3(o, ch, ch));
    up_levels[l] = level;
  }
  up = register_module("up", torch::nn::ModuleList());
  for (auto& level : up_levels) up->push_back(level);

  norm_out = register_module("norm_out", nn::GroupNorm(nn::norm_groups(ch, o.groups()), ch, 1e-5, true, o.init()));
  conv_out = register_module("conv_out", conv3x3(o, ch, o.out_channels()));
  // Every ResBlock and SpatialTransformer is a block (precision rules, checkpointing).
  auto declare_level = [this](TinyUNetLevelImpl& level) {
    for (const auto& m : *level.res) block_table_->declare(m.get());
    for (const auto& m : *level.attn) block_table_->declare(m.get());
  };
  for (const auto& level : *down) declare_level(*level->as<TinyUNetLevelImpl>());
  for (const auto& level : *up) declare_level(*level->as<TinyUNetLevelImpl>());
  block_table_->declare(mid->res1.get());
  block_table_->declare(mid->attn.get());
  block_table_->declare(mid->res2.get());
  if (!o.init().is_meta()) {
    torch::NoGradGuard no_grad;
    conv_out->weight.zero_();
    conv_out->bias.zero_();
  }
}

torch::Tensor TinyUNetImpl::run_res(nn::ResBlock& block, const torch::Tensor& x, const torch::Tensor& temb) {
  // Shared ownership: a checkpointed segment is called again during backward.
  // run_block passes aliased inputs when not checkpointing, so checkpointing
  // changes no bit of the result (see nn/block_precision.h).
  std::shared_ptr<nn::ResBlockImpl> b = block.ptr();
  return nn::run_block(
      block_table_.get(), b,
      [b](const std::vector<torch::Tensor>& in) { return std::vector<torch::Tensor>{b->forward(in[0], in[1])}; },
      {x, temb})[0];
}

torch::Tensor TinyUNetImpl::run_attn(nn::SpatialTransformer& block, const torch::Tensor& x,
                                     const torch::Tensor& context, const torch::Tensor& mask) {
  std::shared_ptr<nn::SpatialTransformerImpl> b = block.ptr();
  return nn::run_block(block_table_.get(), b,
                       [b, mask](const std::vector<torch::Tensor>& in) {
                         return std::vector<torch::Tensor>{b->forward(in[0], in[1], mask)};
                       },
                       {x, context})[0];
}

torch::Tensor TinyUNetImpl::forward(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& context,
                                    const torch::Tensor& context_mask) {
  const auto& o = options_;
  const int64_t levels = static_cast<int64_t>(o.channel_mult().size());
  const int64_t factor = int64_t{1} << (levels - 1);
  // Inside a precision scope the model computes in the scope's dtype.
  const auto dtype = nn::current_compute_dtype().value_or(nn::value_dtype(conv_in->weight));
  if (!x.defined() || x.dim() != 4 || x.size(1) != o.in_channels()) {
    fail("TinyUNet: x must be [B, {}, H, W]", o.in_channels());
  }
  const int64_t B = x.size(0);
  if (x.size(2) % factor != 0 || x.size(3) % factor != 0) {
    fail("TinyUNet: image size {}x{} must be divisible by {}", x.size(2), x.size(3), factor);
  }
  if (x.scalar_type() != dtype) {
    fail("TinyUNet: x has dtype {} but the model is {}", c10::toString(x.scalar_type()), c10::toString(dtype));
  }
  if (!t.defined() || t.dim() != 1 || t.size(0) != B) fail("TinyUNet: t must be [{}]", B);
  if (!context.defined() || context.dim() != 3 || context.size(0) != B || context.size(2) != o.context_dim()) {
    fail("TinyUNet: context must be [{}, L, {}]", B, o.context_dim());
  }
  if (context.scalar_type() != dtype) {
    fail("TinyUNet: context has dtype {} but the model is {}", c10::toString(context.scalar_type()),
         c10::toString(dtype));
  }
  if (context_mask.defined() &&
      (context_mask.dim() != 2 || context_mask.size(0) != B || context_mask.size(1) != context.size(1) ||
       context_mask.scalar_type() != torch::kBool)) {
    fail("TinyUNet: context_mask must be bool [{}, {}]", B, context.size(1));
  }

  torch::Tensor temb = time_embed->forward(nn::timestep_embedding(t * 1000.0, o.base_channels()));
  if (o.pooled_context()) {
    // Mean over the real tokens ([B, L, C] -> [B, C]); all tokens without a mask.
    torch::Tensor pooled;
    if (context_mask.defined()) {
      const torch::Tensor w = context_mask.to(context.scalar_type()).unsqueeze(-1);  // [B, L, 1]
      pooled = (context * w).sum(1) / w.sum(1).clamp_min(1.0);
    } else {
      pooled = context.mean(1);
    }
    temb = temb + text_embed->forward(pooled);
  }

  std::vector<torch::Tensor> skips;
  torch::Tensor h = conv_in->forward(o.channels_last() ? x.contiguous(torch::MemoryFormat::ChannelsLast) : x);
  skips.push_back(h);
  for (int64_t l = 0; l < levels; ++l) {
    auto* level = down[l]->as<TinyUNetLevelImpl>();
    for (size_t i = 0; i < level->res->size(); ++i) {
      nn::ResBlock rb(level->res->ptr<nn::ResBlockImpl>(i));
      h = run_res(rb, h, temb);
      if (!level->attn->is_empty()) {
        nn::SpatialTransformer st(level->attn->ptr<nn::SpatialTransformerImpl>(i));
        h = run_attn(st, h, context, context_mask);
      }
      skips.push_back(h);
    }
    if (level->downsample) {
      h = level->downsample->forward(h);
      skips.push_back(h);
    }
  }

  h = run_res(mid->res1, h, temb);
  h = run_attn(mid->attn, h, context, context_mask);
  h = run_res(mid->res2, h, temb);

  for (int64_t l = levels - 1; l >= 0; --l) {
    auto* level = up[l]->as<TinyUNetLevelImpl>();
    for (size_t i = 0; i < level->res->size(); ++i) {
      h = torch::cat({h, skips.back()}, 1);
      skips.pop_back();
      nn::ResBlock rb(level->res->ptr<nn::ResBlockImpl>(i));
      h = run_res(rb, h, temb);
      if (!level->attn->is_empty()) {
        nn::SpatialTransformer st(level->attn->ptr<nn::SpatialTransformerImpl>(i));
        h = run_attn(st, h, context, context_mask);
      }
    }
    if (level->upsample) {
      namespace F = torch::nn::functional;
      h = F::interpolate(
          h,
          F::InterpolateFuncOptions().size(std::vector<int64_t>{h.size(2) * 2, h.size(3) * 2}).mode(torch::kNearest));
      h = level->upsample->forward(h);
    }
  }
  return conv_out->forward(torch::silu(norm_out->forward(h))).contiguous();
}

int64_t TinyUNetImpl::parameter_count() const {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n;
}

}  // namespace shoestring::models
