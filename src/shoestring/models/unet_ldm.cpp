#include "shoestring/models/unet_ldm.h"

#include <optional>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/units.h"
#include "shoestring/nn/checkpoint.h"
#include "shoestring/nn/key_layout.h"

namespace shoestring::models {

LdmUNetOptions LdmUNetOptions::sd15() {
  // CompVis v1-inference.yaml: attention_resolutions [4, 2, 1] = levels 0-2.
  return LdmUNetOptions()
      .channel_mult({1, 2, 4, 4})
      .transformer_depth({1, 1, 1, 1, 1, 1, 0, 0})
      .transformer_depth_output({0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1})
      .transformer_depth_middle(1)
      .num_heads(8)
      .num_head_channels(-1)
      .context_dim(768);
}

LdmUNetOptions LdmUNetOptions::sdxl() {
  // Stability generative-models sd_xl_base.yaml: attention_resolutions [4, 2],
  // transformer_depth [0, 2, 10], num_head_channels 64, adm_in_channels 2816.
  return LdmUNetOptions()
      .channel_mult({1, 2, 4})
      .transformer_depth({0, 0, 2, 2, 10, 10})
      .transformer_depth_output({10, 10, 10, 2, 2, 2, 0, 0, 0})
      .transformer_depth_middle(10)
      .num_heads(-1)
      .num_head_channels(64)
      .context_dim(2048)
      .adm_in_channels(2816)
      .linear_proj(true);
}

LdmUNetOptions LdmUNetOptions::ssd1b() {
  return sdxl()
      .transformer_depth({0, 0, 2, 2, 4, 4})
      .transformer_depth_output({4, 4, 10, 2, 1, 1, 0, 0, 0})
      .transformer_depth_middle(-1);
}

LdmUNetOptions LdmUNetOptions::tiny() const {
  LdmUNetOptions o = *this;
  o.model_channels(32).num_heads(2).num_head_channels(-1).context_dim(64);
  if (o.adm_in_channels() > 0) o.adm_in_channels(64);
  return o;
}

io::UNetKeyLayout unet_key_layout(const LdmUNetOptions& o) {
  io::UNetKeyLayout k;
  k.levels = static_cast<int64_t>(o.channel_mult().size());
  k.num_res_blocks = o.num_res_blocks();
  for (int64_t d : o.transformer_depth()) k.input_attention.push_back(d > 0);
  for (int64_t d : o.transformer_depth_output()) k.output_attention.push_back(d > 0);
  k.middle_attention = o.transformer_depth_middle() > 0;
  k.middle_second_res = o.transformer_depth_middle() >= 0;
  k.label_emb = o.adm_in_channels() > 0;
  return k;
}

LdmResampleImpl::LdmResampleImpl(int64_t channels, bool down_, const nn::LayerInit& init) : down(down_) {
  conv = register_module(down ? "op" : "conv", nn::Conv2d(channels, channels, 3, down ? 2 : 1, 1, true, init));
}

torch::Tensor LdmResampleImpl::forward(const torch::Tensor& x) {
  if (down) return conv->forward(x);
  namespace F = torch::nn::functional;
  return conv->forward(F::interpolate(
      x, F::InterpolateFuncOptions().size(std::vector<int64_t>{x.size(2) * 2, x.size(3) * 2}).mode(torch::kNearest)));
}

int64_t LdmBlockImpl::transformer_depth() const {
  int64_t depth = 0;
  for (const auto& layer : layers_) {
    if (auto* st = dynamic_cast<nn::SpatialTransformerImpl*>(layer.get())) depth += st->options().depth();
  }
  return depth;
}

torch::Tensor LdmBlockImpl::forward_layers(const torch::Tensor& x, const torch::Tensor& emb,
                                           const torch::Tensor& context, const nn::BlockTable* table) {
  torch::Tensor h = x;
  for (const auto& layer : layers_) {
    if (auto res = std::dynamic_pointer_cast<nn::ResBlockImpl>(layer)) {
      h = nn::run_block(table, res,
                        [res](const std::vector<torch::Tensor>& in) {
                          return std::vector<torch::Tensor>{res->forward(in[0], in[1])};
                        },
                        {h, emb})[0];
    } else if (auto st = std::dynamic_pointer_cast<nn::SpatialTransformerImpl>(layer)) {
      // Never checkpointed whole: its transformer blocks are, one by one.
      h = nn::run_block(
          table, st,
          [st](const std::vector<torch::Tensor>& in) { return std::vector<torch::Tensor>{st->forward(in[0], in[1])}; },
          {h, context})[0];
    } else if (auto* rs = dynamic_cast<LdmResampleImpl*>(layer.get())) {
      h = rs->forward(h);
    } else if (auto* conv = dynamic_cast<nn::Conv2dImpl*>(layer.get())) {
      h = conv->forward(h);
    } else {
      fail("LdmBlock: unsupported layer type {}", layer->name());
    }
  }
  return h;
}

LdmUNetImpl::LdmUNetImpl(const LdmUNetOptions& options) : options_(options) {
  const auto& o = options_;
  const auto& mult = o.channel_mult();
  const int64_t levels = static_cast<int64_t>(mult.size());
  const int64_t nrb = o.num_res_blocks();
  if (levels == 0 || nrb <= 0 || o.model_channels() <= 0 || o.in_channels() <= 0 || o.out_channels() <= 0 ||
      o.context_dim() <= 0 || o.adm_in_channels() < 0) {
    fail(
        "LdmUNet: channel_mult must be non-empty and in_channels, out_channels, model_channels, "
        "num_res_blocks, context_dim positive");
  }
  if (static_cast<int64_t>(o.transformer_depth().size()) != levels * nrb) {
    fail("LdmUNet: transformer_depth has {} entries, expected levels * num_res_blocks = {}",
         o.transformer_depth().size(), levels * nrb);
  }
  if (static_cast<int64_t>(o.transformer_depth_output().size()) != levels * (nrb + 1)) {
    fail("LdmUNet: transformer_depth_output has {} entries, expected levels * (num_res_blocks + 1) = {}",
         o.transformer_depth_output().size(), levels * (nrb + 1));
  }
  if ((o.num_heads() <= 0) == (o.num_head_channels() <= 0)) {
    fail("LdmUNet: set exactly one of num_heads ({}) and num_head_channels ({})", o.num_heads(), o.num_head_channels());
  }
  const nn::LayerInit& init = o.init();
  const int64_t mc = o.model_channels();
  const int64_t temb = 4 * mc;  // LDM: time_embed_dim = model_channels * 4
  const auto ldm = nn::KeyLayout::kLdm;

  auto res = [&](int64_t in, int64_t out) {
    return nn::ResBlock(
        nn::ResBlockOptions(in, out, temb).groups(o.groups()).dropout(o.dropout()).layout(ldm).init(init));
  };
  auto transformer = [&](int64_t ch, int64_t depth) {
    int64_t heads = o.num_heads(), head_dim = 0;
    if (o.num_head_channels() > 0) {
      head_dim = o.num_head_channels();
      heads = ch / head_dim;
    } else {
      head_dim = ch / heads;
    }
    if (heads * head_dim != ch) fail("LdmUNet: {} channels do not split into heads of {}", ch, head_dim);
    return nn::SpatialTransformer(nn::TransformerOptions(ch, heads, head_dim)
                                      .context_dim(o.context_dim())
                                      .depth(depth)
                                      .dropout(o.dropout())
                                      .groups(o.groups())
                                      .linear_proj(o.linear_proj())
                                      .layout(ldm)
                                      .init(init));
  };

  time_embed = register_module("time_embed", nn::TimestepEmbedding(mc, temb, ldm, init));
  if (o.adm_in_channels() > 0) {
    label_emb = nn::register_at(*this, "label_emb.0", nn::TimestepEmbedding(o.adm_in_channels(), temb, ldm, init));
  }

  input_blocks = register_module("input_blocks", torch::nn::ModuleList());
  {
    LdmBlock first;
    first->add(nn::Conv2d(o.in_channels(), mc, 3, 1, 1, true, init));
    input_blocks->push_back(first);
  }
  std::vector<int64_t> skip_channels{mc};
  int64_t ch = mc;
  for (int64_t l = 0; l < levels; ++l) {
    for (int64_t i = 0; i < nrb; ++i) {
      LdmBlock block;
      block->add(res(ch, mc * mult[l]));
      ch = mc * mult[l];
      const int64_t depth = o.transformer_depth()[l * nrb + i];
      if (depth > 0) block->add(transformer(ch, depth));
      input_blocks->push_back(block);
      skip_channels.push_back(ch);
    }
    if (l + 1 < levels) {
      LdmBlock block;
      block->add(LdmResample(ch, /*down=*/true, init));
      input_blocks->push_back(block);
      skip_channels.push_back(ch);
    }
  }

  middle_block = register_module("middle_block", LdmBlock());
  middle_block->add(res(ch, ch));
  if (o.transformer_depth_middle() >= 0) {
    if (o.transformer_depth_middle() > 0) middle_block->add(transformer(ch, o.transformer_depth_middle()));
    middle_block->add(res(ch, ch));
  }

  output_blocks = register_module("output_blocks", torch::nn::ModuleList());
  int64_t n = 0;
  for (int64_t l = levels - 1; l >= 0; --l) {
    for (int64_t i = 0; i <= nrb; ++i, ++n) {
      LdmBlock block;
      block->add(res(ch + skip_channels.back(), mc * mult[l]));
      skip_channels.pop_back();
      ch = mc * mult[l];
      const int64_t depth = o.transformer_depth_output()[n];
      if (depth > 0) block->add(transformer(ch, depth));
      if (l > 0 && i == nrb) block->add(LdmResample(ch, /*down=*/false, init));
      output_blocks->push_back(block);
    }
  }

  out_norm = nn::register_at(*this, "out.0", nn::GroupNorm(nn::norm_groups(ch, o.groups()), ch, 1e-5, true, init));
  out_conv = nn::register_at(*this, "out.2", nn::Conv2d(ch, o.out_channels(), 3, 1, 1, true, init));
  if (!init.is_meta()) {  // LDM: zero_module(conv_nd(...)) on the output conv
    torch::NoGradGuard no_grad;
    out_conv->weight.zero_();
    out_conv->bias.zero_();
  }

  // Blocks for precision rules (see block_table()).
  block_table_->declare(this, /*checkpointable=*/false);
  auto declare_layers = [this](const LdmBlockImpl& block) {
    for (const auto& layer : block.layers()) {
      if (auto* res = dynamic_cast<nn::ResBlockImpl*>(layer.get())) {
        block_table_->declare(res);
      } else if (auto* st = dynamic_cast<nn::SpatialTransformerImpl*>(layer.get())) {
        block_table_->declare(st, /*checkpointable=*/false);
        for (const auto& tb : *st->blocks) block_table_->declare(tb.get());
        st->set_block_table(block_table_.get());
      }
    }
  };
  for (const auto& b : *input_blocks) declare_layers(*b->as<LdmBlockImpl>());
  declare_layers(*middle_block);
  for (const auto& b : *output_blocks) declare_layers(*b->as<LdmBlockImpl>());
}

torch::Tensor LdmUNetImpl::run_ldm_block(LdmBlockImpl& block, const torch::Tensor& h, const torch::Tensor& emb,
                                         const torch::Tensor& context) {
  // Per block, as the precision rules say (the plain forward while unconfigured).
  return block.forward_layers(h, emb, context, block_table_->configured() ? block_table_.get() : nullptr);
}

torch::Tensor LdmUNetImpl::forward(const torch::Tensor& x, const torch::Tensor& timesteps, const torch::Tensor& context,
                                   const torch::Tensor& y) {
  if (!block_table_->configured()) return forward_impl(x, timesteps, context, y);
  if (block_table_->find(this)) {
    // The UNet as its root scope: x, context and y are cast to its compute
    // dtype; timesteps are not an input (captured, never rounded to bf16).
    auto self = std::static_pointer_cast<LdmUNetImpl>(shared_from_this());
    const torch::Tensor t = timesteps;
    return nn::run_block(block_table_.get(), self,
                         [self, t](const std::vector<torch::Tensor>& in) {
                           return std::vector<torch::Tensor>{self->forward_impl(in[0], t, in[1], in[2])};
                         },
                         {x, context, y})[0];
  }
  std::optional<nn::ComputeDtypeGuard> guard;
  if (!nn::current_compute_dtype()) guard.emplace(nn::value_dtype(out_conv->weight));
  return forward_impl(x, timesteps, context, y);
}

torch::Tensor LdmUNetImpl::forward_impl(const torch::Tensor& x, const torch::Tensor& timesteps,
                                        const torch::Tensor& context, const torch::Tensor& y) {
  const auto& o = options_;
  const int64_t levels = static_cast<int64_t>(o.channel_mult().size());
  const int64_t factor = int64_t{1} << (levels - 1);
  // Inside a precision scope the UNet computes in the scope's dtype.
  const auto dtype = nn::current_compute_dtype().value_or(nn::value_dtype(out_conv->weight));
  if (!x.defined() || x.dim() != 4 || x.size(1) != o.in_channels() || x.size(2) % factor != 0 ||
      x.size(3) % factor != 0) {
    fail("LdmUNet: x must be [B, {}, H, W] with H, W divisible by {}, got {}", o.in_channels(), factor,
         x.defined() ? format_shape(x.sizes()) : "undefined");
  }
  const int64_t B = x.size(0);
  if (x.scalar_type() != dtype) {
    fail("LdmUNet: x has dtype {} but the model is {}", c10::toString(x.scalar_type()), c10::toString(dtype));
  }
  if (!timesteps.defined() || timesteps.dim() != 1 || timesteps.size(0) != B) {
    fail("LdmUNet: timesteps must be [{}]", B);
  }
  if (!context.defined() || context.dim() != 3 || context.size(0) != B || context.size(2) != o.context_dim() ||
      context.scalar_type() != dtype) {
    fail("LdmUNet: context must be [{}, L, {}] in {}, got {} {}", B, o.context_dim(), c10::toString(dtype),
         context.defined() ? format_shape(context.sizes()) : "undefined",
         context.defined() ? c10::toString(context.scalar_type()) : "");
  }
  torch::Tensor emb = time_embed->forward(nn::timestep_embedding(timesteps, o.model_channels()));
  if (label_emb) {
    if (!y.defined() || y.dim() != 2 || y.size(0) != B || y.size(1) != o.adm_in_channels()) {
      fail("LdmUNet: y must be [{}, {}] (adm_in_channels)", B, o.adm_in_channels());
    }
    emb = emb + label_emb->forward(y);
  } else if (y.defined()) {
    fail("LdmUNet: this model has no vector conditioning (adm_in_channels 0) but y was given");
  }

  std::vector<torch::Tensor> skips;
  torch::Tensor h = x;
  for (size_t i = 0; i < input_blocks->size(); ++i) {
    h = run_ldm_block(*input_blocks->ptr<LdmBlockImpl>(i), h, emb, context);
    skips.push_back(h);
  }
  h = run_ldm_block(*middle_block, h, emb, context);
  for (size_t i = 0; i < output_blocks->size(); ++i) {
    h = torch::cat({h, skips.back()}, 1);
    skips.pop_back();
    h = run_ldm_block(*output_blocks->ptr<LdmBlockImpl>(i), h, emb, context);
  }
  return out_conv->forward(torch::silu(out_norm->forward(h)));
}

}  // namespace shoestring::models
