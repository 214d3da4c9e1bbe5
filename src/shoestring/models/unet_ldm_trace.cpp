// The memory trace of the LDM UNet (models/unet_ldm.h) for the planner: the
// ops LdmUNetImpl::forward runs, in order, through the op vocabulary of
// nn/memory_trace.h. A change to the forward is mirrored here.
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/models/unet_ldm.h"

namespace shoestring::models {
namespace {

using nn::Sym;

LdmUNetImpl& as_ldm(torch::nn::Module& model) {
  auto* u = dynamic_cast<LdmUNetImpl*>(&model);
  if (u == nullptr) fail("LDM UNet trace: module '{}' is not an LdmUNet", model.name());
  return *u;
}

// One LdmBlock (TimestepEmbedSequential) as a training run executes it: the
// trainer applies the precision policy to the UNet's block table, so with
// gradient checkpointing each ResBlock and each transformer block is its own
// segment (the SpatialTransformer's norm and projections, and the resampling
// convs, are not checkpointed).
Sym ldm_block(nn::MemoryTracer& t, LdmBlockImpl& block, const Sym& x, const Sym& emb, const Sym& ctx) {
  const bool per_layer = t.precision().checkpoint;
  Sym h = x;
  for (const auto& child : block.children()) {
    if (auto* res = dynamic_cast<nn::ResBlockImpl*>(child.get())) {
      const int64_t out = res->options().out_channels(), groups = res->options().groups();
      h = t.checkpointed(per_layer, {h.id, emb.id}, [&] { return t.res_block(h, out, emb, groups); });
    } else if (auto* st = dynamic_cast<nn::SpatialTransformerImpl*>(child.get())) {
      const auto& to = st->options();
      nn::SpatialTransformerShape sp;
      sp.heads = to.heads();
      sp.head_dim = to.head_dim();
      sp.depth = to.depth();
      sp.ff_mult = to.ff_mult();
      sp.groups = to.groups();
      sp.linear_proj = to.linear_proj();
      sp.gated = to.gated_ff();
      if (to.num_kv_heads() > 0 && to.num_kv_heads() != to.heads()) {
        fail("plan: grouped-query attention in an LDM UNet is not modelled");
      }
      h = t.spatial_transformer(h, ctx, false, sp, per_layer);
    } else if (auto* rs = dynamic_cast<LdmResampleImpl*>(child.get())) {
      if (!rs->down) h = t.upsample(h);
      h = t.conv(h, rs->conv->out_channels, 3, rs->down ? 2 : 1);
    } else if (auto* cv = dynamic_cast<nn::Conv2dImpl*>(child.get())) {
      h = t.conv(h, cv->out_channels, cv->kernel_size, cv->stride, cv->padding, cv->groups);
    } else {
      fail("plan: LdmBlock layer '{}' is not modelled", child->name());
    }
  }
  return h;
}

}  // namespace

void trace_ldm_unet(torch::nn::Module& model, nn::MemoryTracer& t, const DenoiserBatch& in) {
  LdmUNetImpl& u = as_ldm(model);
  const auto& o = u.options();
  const int64_t factor = int64_t{1} << (o.channel_mult().size() - 1);
  if (in.latent_side % factor != 0) {
    fail("plan: this LDM UNet needs latents divisible by {} (a resolution divisible by {}), got {}x{} latents", factor,
         8 * factor, in.latent_side, in.latent_side);
  }
  const int64_t B = in.batch, S = in.latent_side;
  const int pe = t.precision().param_elem;
  Sym x = t.input({B, o.in_channels(), S, S}, pe);
  t.input({B}, 4);  // timesteps
  Sym ctx = t.input({B, in.context_tokens, o.context_dim()}, pe);
  const int64_t mc = o.model_channels(), temb_dim = u.time_embed->linear_1->out_features;
  Sym temb = t.embed_mlp(t.constant({B, mc}, 4, "timestep_embedding"), temb_dim, temb_dim);
  if (o.adm_in_channels() > 0) {
    Sym y = t.input({B, o.adm_in_channels()}, pe);
    temb = t.add(temb, t.embed_mlp(y, temb_dim, temb_dim), "add label_emb");
  }
  std::vector<Sym> skips;
  Sym h = x;
  for (size_t i = 0; i < u.input_blocks->size(); ++i) {
    h = ldm_block(t, *u.input_blocks->ptr<LdmBlockImpl>(i), h, temb, ctx);
    skips.push_back(h);
  }
  h = ldm_block(t, *u.middle_block, h, temb, ctx);
  for (size_t i = 0; i < u.output_blocks->size(); ++i) {
    h = t.cat(h, skips.back());
    skips.pop_back();
    h = ldm_block(t, *u.output_blocks->ptr<LdmBlockImpl>(i), h, temb, ctx);
  }
  h = t.group_norm(h, h.shape[1], u.out_norm->groups);
  h = t.unary(h, "silu");
  h = t.conv(h, o.out_channels(), 3, 1);
  t.mse_loss(h, x);
}

DenoiserExample ldm_unet_example(torch::nn::Module& model, const DenoiserBatch& in, at::ScalarType dtype) {
  LdmUNetImpl* unet = &as_ldm(model);
  const auto& o = unet->options();
  const int64_t B = in.batch, S = in.latent_side;
  auto randn = [&](std::vector<int64_t> shape) { return torch::randn(shape).to(dtype); };
  at::Tensor x = randn({B, o.in_channels(), S, S});
  at::Tensor t = torch::randint(0, 1000, {B}).to(torch::kFloat32);
  at::Tensor ctx = randn({B, in.context_tokens, o.context_dim()});
  at::Tensor y = o.adm_in_channels() > 0 ? randn({B, o.adm_in_channels()}) : at::Tensor();
  DenoiserExample e;
  e.forward = [unet, x, t, ctx, y] { return unet->forward(x, t, ctx, y); };
  e.target = x;
  return e;
}

}  // namespace shoestring::models
