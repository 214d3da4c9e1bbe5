// The memory trace of Stable Cascade's stage C (models/cascade.h) for the
// planner: the ops StageCImpl::forward runs, in order, through the op
// vocabulary of nn/memory_trace.h. A change to the forward is mirrored here.
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/models/cascade.h"

namespace shoestring::models {
namespace {

using nn::Sym;

StageCImpl& as_stage_c(torch::nn::Module& model) {
  auto* m = dynamic_cast<StageCImpl*>(&model);
  if (m == nullptr) fail("stage C trace: module '{}' is not a StageC", model.name());
  return *m;
}

class StageCTrace {
 public:
  StageCTrace(nn::MemoryTracer& t, const StageCOptions& o) : t(t), o(o) {}

  // Stage C LayerNorm2d: fp32 copy, layer_norm over channels of the permuted
  // tensor (a contiguous fp32 copy inside), cast back.
  Sym layer_norm_2d(const Sym& x) {
    const int64_t C = x.shape[1];
    return t.norm(x, C, x.numel() / C, "layer_norm_2d", false, x.numel() * 4);
  }

  // StageCImpl::run_level: the level's blocks `repeats` times, each block a
  // checkpointed segment when gradient checkpointing is on.
  Sym level(torch::nn::ModuleListImpl& blocks, torch::nn::ModuleListImpl& mappers, Sym x, const Sym& r_embed,
            const Sym& cond, const Sym* skip) {
    const bool ckpt = t.precision().checkpoint;
    const int64_t B = x.shape[0];
    for (size_t j = 0; j < mappers.size() + 1; ++j) {
      for (size_t b = 0; b < blocks.size(); ++b) {
        auto block = blocks.ptr(b);
        const int64_t C = x.shape[1], H = x.shape[2], W = x.shape[3];
        if (auto* res = dynamic_cast<CascadeResBlockImpl*>(block.get())) {
          const bool with_skip = b == 0 && res->c_skip > 0;
          if (res->c_skip > 0 && (skip == nullptr || !with_skip)) fail("plan: stage C ResBlock {} needs a skip", b);
          std::vector<int> in{x.id};
          if (with_skip) in.push_back(skip->id);
          x = t.checkpointed(ckpt, in, [&] {
            Sym h = layer_norm_2d(t.conv(x, C, res->depthwise->kernel_size, 1, -1, C));
            if (with_skip) h = t.cat(h, *skip);
            h = t.view(h, {B, H, W, h.shape[1]});
            h = t.view(channelwise(h, C, res->dropout), {B, C, H, W});
            return t.add(h, x, "resblock residual");
          });
        } else if (auto* ff = dynamic_cast<CascadeFeedForwardBlockImpl*>(block.get())) {
          x = t.checkpointed(ckpt, {x.id}, [&] {
            Sym h = t.view(layer_norm_2d(x), {B, H, W, C});
            return t.add(x, t.view(channelwise(h, C, ff->dropout), {B, C, H, W}), "ff residual");
          });
        } else if (auto* ts = dynamic_cast<CascadeTimestepBlockImpl*>(block.get())) {
          x = t.checkpointed(ckpt, {x.id, r_embed.id}, [&] {
            Sym ab;
            for (size_t i = 0; i < ts->mappers.size(); ++i) {
              Sym m = t.linear(t.view(r_embed, {B, o.r_dim()}), 2 * C, true);
              ab = i == 0 ? m : t.add(ab, m, "sum mappers");
            }
            auto parts = t.split(ab, {{B, C, 1, 1}, {B, C, 1, 1}});
            return t.add_bcast(t.mul(x, t.scalar_op(parts[0], "1 + a")), parts[1], "add b");
          });
        } else if (auto* at = dynamic_cast<CascadeAttnBlockImpl*>(block.get())) {
          x = t.checkpointed(ckpt, {x.id, cond.id}, [&] {
            const int64_t heads = at->attn->heads, d = C / heads, L = H * W;
            Sym kv = t.linear(t.unary(cond, "silu"), C, true);
            Sym q = t.view(layer_norm_2d(x), {B, L, C});
            if (at->self_attn) kv = t.cat(q, kv);
            const int64_t Sk = kv.shape[1];
            Sym qp = t.view(t.linear(q, C, true), {B, heads, L, d});
            Sym kp = t.view(t.linear(kv, C, true), {B, heads, Sk, d});
            Sym vp = t.view(t.linear(kv, C, true), {B, heads, Sk, d});
            nn::SdpaStyle st;
            st.scale_op = true;
            st.softmax_fp32 = true;
            st.dropout = at->attn->dropout;
            st.chunkable = false;
            Sym out = t.linear(t.merge_heads(t.sdpa(qp, kp, vp, L, st), L, heads), C, true);
            return t.add(x, t.view(out, {B, C, H, W}), "attention residual");
          });
        } else {
          fail("plan: stage C block '{}' is not modelled", block->name());
        }
      }
      if (j < mappers.size()) x = t.conv(x, x.shape[1], 1, 1, 0);
    }
    return x;
  }

 private:
  // GlobalResponseNorm on [B, H, W, C] (half input: fp32 math).
  Sym grn(const Sym& x_in) {
    const int64_t B = x_in.shape[0], C = x_in.shape.back();
    Sym x = x_in.elem == 2 ? t.cast(x_in, 4) : x_in;
    Sym g = t.make({B, 1, 1, C}, 4, true);
    nn::TraceOp op;
    op.name = "grn norm";
    op.inputs = {x.id};
    op.outputs = {g.id};
    op.saved = {x.id, g.id};
    op.grad_inputs = {x.id};
    t.sim.op(op);
    Sym n = t.scalar_op(g, "grn g / mean");
    Sym xn = t.mul(x, n);
    t.add_param({1, 1, 1, C});
    t.add_param({1, 1, 1, C});
    Sym gx = t.make(x.shape, 4, true);
    nn::TraceOp og;
    og.name = "grn gamma * xn + beta";
    og.inputs = {xn.id};
    og.outputs = {gx.id};
    og.saved = {xn.id};
    og.grad_inputs = {xn.id};
    og.param_grads = {t.param_grad_bytes({C}), t.param_grad_bytes({C})};
    og.backward_transient = xn.bytes();
    t.sim.op(og);
    Sym y = t.add(gx, x, "grn residual");
    return x_in.elem == 2 ? t.cast(y, 2) : y;
  }

  // Stage C channelwise MLP: Linear(4c), GELU, GRN, Dropout, Linear(c), on [B, H, W, C].
  Sym channelwise(const Sym& h, int64_t c, double p) {
    Sym y = t.unary(t.linear(h, 4 * c, true), "gelu");
    y = t.dropout(grn(y), p);
    return t.linear(y, c, true);
  }

  nn::MemoryTracer& t;
  const StageCOptions& o;
};

}  // namespace

void trace_stage_c(torch::nn::Module& model, nn::MemoryTracer& t, const DenoiserBatch& in) {
  StageCImpl& m = as_stage_c(model);
  const auto& o = m.options();
  const int pe = t.precision().param_elem;
  const int64_t B = in.batch, S = in.latent_side;
  if (o.patch_size() != 1) fail("plan: stage C with patch_size {} is not modelled", o.patch_size());
  StageCTrace st(t, o);
  Sym x_in = t.input({B, o.in_channels(), S, S}, pe);
  t.input({B}, 4);  // r
  Sym text = t.input({B, in.context_tokens, o.clip_text_dim()}, pe);
  Sym pooled = t.input({B, 1, o.clip_text_pooled_dim()}, pe);
  Sym img = t.input({B, 1, o.clip_image_dim()}, pe);
  const int64_t conds = static_cast<int64_t>(o.t_conds().size());
  Sym r_embed = t.constant({B, o.r_dim() * (1 + conds)}, pe, "r embedding");
  const int64_t cd = o.cond_dim(), seq = o.clip_seq();
  Sym txt = t.linear(text, cd, true);
  Sym pool = t.view(t.linear(pooled, cd * seq, true), {B, seq, cd});
  Sym im = t.view(t.linear(img, cd * seq, true), {B, seq, cd});
  Sym cond = t.layer_norm(t.cat({txt, pool, im}), false);
  Sym x = st.layer_norm_2d(t.conv(x_in, o.hidden()[0], 1, 1, 0));
  const size_t levels = o.hidden().size();
  std::vector<Sym> level_outputs;
  for (size_t i = 0; i < levels; ++i) {
    if (i > 0) {
      x = t.conv(st.layer_norm_2d(x), o.hidden()[i], 1, 1, 0);
      if (o.switch_level()[i - 1]) fail("plan: stage C with switch_level (resampling) is not modelled");
    }
    x = st.level(*m.down_blocks->ptr<torch::nn::ModuleListImpl>(i),
                 *m.down_repeat_mappers->ptr<torch::nn::ModuleListImpl>(i), x, r_embed, cond, nullptr);
    level_outputs.insert(level_outputs.begin(), x);
  }
  x = level_outputs[0];
  for (size_t k = 0; k < levels; ++k) {
    x = st.level(*m.up_blocks->ptr<torch::nn::ModuleListImpl>(k),
                 *m.up_repeat_mappers->ptr<torch::nn::ModuleListImpl>(k), x, r_embed, cond,
                 k > 0 ? &level_outputs[k] : nullptr);
    if (k + 1 < levels) x = t.conv(st.layer_norm_2d(x), o.hidden()[levels - 2 - k], 1, 1, 0);
  }
  x = t.conv(st.layer_norm_2d(x), o.out_channels(), 1, 1, 0);
  t.mse_loss(x, x_in);
}

DenoiserExample stage_c_example(torch::nn::Module& model, const DenoiserBatch& in, at::ScalarType dtype) {
  StageCImpl* c = &as_stage_c(model);
  const auto& o = c->options();
  const int64_t B = in.batch, S = in.latent_side, L = in.context_tokens;
  auto randn = [&](std::vector<int64_t> shape) { return torch::randn(shape).to(dtype); };
  at::Tensor x = randn({B, o.in_channels(), S, S});
  at::Tensor rr = torch::rand({B});
  at::Tensor text = randn({B, L, o.clip_text_dim()});
  at::Tensor pooled = randn({B, 1, o.clip_text_pooled_dim()});
  at::Tensor img = randn({B, 1, o.clip_image_dim()});
  DenoiserExample e;
  e.forward = [c, x, rr, text, pooled, img] { return c->forward(x, rr, text, pooled, img); };
  e.target = x;
  return e;
}

}  // namespace shoestring::models
