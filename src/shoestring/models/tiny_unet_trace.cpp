// The memory trace of the emoji model (train/tiny_unet_model.h: the
// CaptionEncoder of models/caption_encoder.h, then the TinyUNet of
// models/tiny_unet.h) for the planner: the ops their forwards run, in order,
// through the op vocabulary of nn/memory_trace.h, block by block over the
// real module tree. A change to either forward is mirrored here.
#include "shoestring/core/error.h"
#include "shoestring/models/caption_encoder.h"
#include "shoestring/models/tiny_unet.h"

namespace shoestring::models {
namespace {

using nn::Sym;
using nn::TraceOp;

// CaptionEncoderImpl::forward inside its scope: embedding + positions, the
// layers (blocks), the final norm. Returns the hidden states.
Sym caption_encoder(nn::MemoryTracer& t, const CaptionEncoderImpl& te, const Sym& tokens, const Sym& mask) {
  const auto& o = te.options();
  const nn::TracePrecision& p = t.precision();
  const int64_t B = tokens.shape[0], L = tokens.shape[1], D = o.dim(), vocab = o.vocab_size();
  const bool trains = p.trainable > 0 && !p.frozen;
  Sym emb = t.make({B, L, D}, p.compute_elem, trains);
  t.add_param({vocab, D});
  TraceOp e;
  e.name = "token_embedding";
  e.inputs = {tokens.id};
  e.outputs = {emb.id};
  e.saved = {tokens.id};
  e.param_grads = {t.param_grad_bytes({vocab, D})};
  t.sim.op(e);
  t.add_param({o.max_length(), D});
  Sym h = t.make({B, L, D}, p.compute_elem, trains);
  TraceOp pos;
  pos.name = "position add";
  pos.inputs = {emb.id};
  pos.outputs = {h.id};
  pos.passthrough = true;
  if (trains) pos.grad_inputs = {emb.id};
  pos.param_grads = {t.param_grad_bytes({o.max_length(), D})};
  t.sim.op(pos);
  const int64_t heads = o.heads();
  for (size_t l = 0; l < te.layers->size(); ++l) {
    h = t.block1(te.layers->ptr(l).get(), {h, mask}, false, [&](const std::vector<Sym>& in) {
      Sym x = in[0];
      Sym n1 = t.layer_norm(x);
      Sym a = t.attention(n1, n1, true, heads, heads, D / heads, D);
      x = t.add(x, a, "text residual");
      Sym n2 = t.layer_norm(x);
      Sym m = t.linear(n2, o.mlp_ratio() * D, true);
      m = t.unary(m, "gelu");
      m = t.linear(m, D, true);
      return t.add(x, m, "text residual");
    });
  }
  return t.layer_norm(h);
}

// TinyUNetImpl::forward inside its scope on x [B, 3, R, R] and context.
Sym tiny_unet(nn::MemoryTracer& t, const TinyUNetImpl& unet, const Sym& x_in, const Sym& time, const Sym& context) {
  const auto& u = unet.options();
  const nn::TracePrecision& p = t.precision();
  const int64_t B = x_in.shape[0];
  const int64_t base = u.base_channels(), temb_dim = 4 * base, heads = u.num_heads(), groups = u.groups();
  Sym temb_in = t.make({B, base}, 4, false);
  t.op("timestep_embedding", {time}, {temb_in});
  if (p.compute_elem != 4 && !p.autocast) temb_in = t.cast(temb_in, p.compute_elem);
  Sym temb = t.linear(temb_in, temb_dim, true);
  temb = t.unary(temb, "silu");
  temb = t.linear(temb, temb_dim, true);
  if (u.pooled_context()) {
    // Masked mean of the context ([B, L, C] -> [B, C]; the products are
    // transient, the mean saves nothing but shapes), projected and added.
    const bool trains = p.trainable > 0 && !p.frozen;
    Sym pooled = t.make({B, context.shape[2]}, p.compute_elem, trains);
    t.op("pooled context", {context}, {pooled});
    temb = t.add(temb, t.linear(pooled, temb_dim, true), "pooled context add");
  }

  // run_res / run_attn: each ResBlock and each SpatialTransformer is a block.
  const bool legacy_ckpt = p.checkpoint;
  auto res = [&](const torch::nn::Module* m, const Sym& x, int64_t out) {
    return t.block1(m, {x, temb}, legacy_ckpt, [&](const std::vector<Sym>& in) {
      return t.res_block(in[0], out, in[1], groups, u.scale_shift_norm());
    });
  };
  auto attn = [&](const torch::nn::Module* m, const Sym& x) {
    const int64_t C = x.shape[1];
    if (C % heads != 0) fail("plan: channels {} not divisible by num_heads {}", C, heads);
    nn::SpatialTransformerShape sp;
    sp.heads = heads;
    sp.head_dim = C / heads;
    sp.groups = groups;
    return t.block1(m, {x, context}, legacy_ckpt,
                    [&](const std::vector<Sym>& in) { return t.spatial_transformer(in[0], in[1], true, sp, false); });
  };

  // contiguous(ChannelsLast) of the input, and the GroupNorms' layout copies (nn::GroupNorm)
  Sym x = u.channels_last() ? t.copy(x_in, x_in.shape, "channels_last copy") : x_in;
  t.set_channels_last(u.channels_last());
  Sym h = t.conv(x, base, 3, 1);
  std::vector<Sym> skips{h};
  const int64_t levels = static_cast<int64_t>(u.channel_mult().size());
  int64_t ch = base;
  for (int64_t l = 0; l < levels; ++l) {
    const auto* level = unet.down->ptr(l)->as<TinyUNetLevelImpl>();
    const int64_t out = base * u.channel_mult()[l];
    for (size_t i = 0; i < level->res->size(); ++i) {
      h = res(level->res->ptr(i).get(), h, out);
      ch = out;
      if (!level->attn->is_empty()) h = attn(level->attn->ptr(i).get(), h);
      skips.push_back(h);
    }
    if (level->downsample) {
      h = t.conv(h, ch, 3, 2);
      skips.push_back(h);
    }
  }
  h = res(unet.mid->res1.get(), h, ch);
  h = attn(unet.mid->attn.get(), h);
  h = res(unet.mid->res2.get(), h, ch);
  for (int64_t l = levels - 1; l >= 0; --l) {
    const auto* level = unet.up->ptr(l)->as<TinyUNetLevelImpl>();
    const int64_t out = base * u.channel_mult()[l];
    for (size_t i = 0; i < level->res->size(); ++i) {
      h = t.cat(h, skips.back());
      skips.pop_back();
      h = res(level->res->ptr(i).get(), h, out);
      ch = out;
      if (!level->attn->is_empty()) h = attn(level->attn->ptr(i).get(), h);
    }
    if (level->upsample) {
      h = t.upsample(h);
      h = t.conv(h, ch, 3, 1);
    }
  }
  h = t.group_norm(h, ch, nn::norm_groups(ch, groups));
  h = t.unary(h, "silu");
  h = t.conv(h, u.out_channels(), 3, 1);
  return t.copy(h, h.shape, "contiguous output");
}

}  // namespace

void trace_text_to_image(const TinyUNetImpl& unet, const CaptionEncoderImpl& text, nn::MemoryTracer& t, int64_t B,
                         int64_t R) {
  const int64_t L = text.options().max_length();
  // The batch (trainer: x0, eps, xt, target fp32; t; tokens int64) lives
  // through the micro-batch.
  const int64_t img = B * 3 * R * R * 4;
  for (int i = 0; i < 2; ++i) t.sim.tensor(img, true);  // x0, eps
  Sym xt = t.input({B, 3, R, R}, 4);
  Sym target = t.input({B, 3, R, R}, 4);
  Sym time = t.input({B}, 4);
  Sym tokens = t.input({B, L}, 8);
  Sym mask = t.make({B, L}, 1, false);
  t.op("mask", {tokens}, {mask});
  // TinyUNetModel::forward: the encoder's scope, then the UNet's on (x_t, hidden).
  Sym context =
      t.block1(&text, {}, false, [&](const std::vector<Sym>&) { return caption_encoder(t, text, tokens, mask); });
  // Without configured scopes the model casts x_t to the weights' dtype.
  Sym x = xt;
  if (!t.has_block(&unet) && t.precision().param_elem == 2) x = t.cast(x, 2);
  Sym h = t.block1(&unet, {x, context}, false,
                   [&](const std::vector<Sym>& in) { return tiny_unet(t, unet, in[0], time, in[1]); });
  t.mse_loss(h, target);
}

}  // namespace shoestring::models
