// The memory trace of SD3.5's MMDiT (models/mmdit.h) for the planner: the
// ops MMDiTImpl::forward runs, in order, through the op vocabulary of
// nn/memory_trace.h. A change to the forward is mirrored here.
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/models/mmdit.h"

namespace shoestring::models {
namespace {

using nn::Sym;

MMDiTImpl& as_mmdit(torch::nn::Module& model) {
  auto* m = dynamic_cast<MMDiTImpl*>(&model);
  if (m == nullptr) fail("MMDiT trace: module '{}' is not an MMDiT", model.name());
  return *m;
}

struct Qkv {
  Sym q, k, v;
};

// The ops of one joint block (MMDiTJointBlockImpl::forward) and its parts.
class JointBlockTrace {
 public:
  explicit JointBlockTrace(nn::MemoryTracer& t) : t(t) {}

  // x * (1 + scale) + shift, per-sample [B, D] shift / scale over [B, L, D] (MMDiT modulate).
  Sym modulate(const Sym& x, const Sym& shift, const Sym& scale) {
    return t.add_bcast(t.mul(x, t.scalar_op(scale, "1 + scale")), shift, "add shift");
  }

  // MMDiTJointBlockImpl::forward. Returns x'; sets ctx_out to context' (an
  // undefined Sym for the last block, whose context stream is pre_only).
  Sym joint_block(MMDiTJointBlockImpl& jb, const Sym& context, const Sym& x, const Sym& c, Sym& ctx_out) {
    auto& cb = *jb.context_block;
    auto& xb = *jb.x_block;
    const int64_t B = x.shape[0], Lc = context.shape[1], Lx = x.shape[1], Hd = x.shape[2];
    Sym silu_c = t.unary(c, "silu");
    const int64_t nc = cb.adaLN_modulation->out_features / Hd, nx = xb.adaLN_modulation->out_features / Hd;
    auto cm = t.split(t.linear(silu_c, nc * Hd, true), std::vector<std::vector<int64_t>>(nc, {B, Hd}));
    auto xm = t.split(t.linear(silu_c, nx * Hd, true), std::vector<std::vector<int64_t>>(nx, {B, Hd}));
    Qkv cq = pre_attention(*cb.attn, modulate(t.layer_norm(context, false), cm[0], cm[1]));
    Sym x_norm = t.layer_norm(x, false);
    Qkv xq = pre_attention(*xb.attn, modulate(x_norm, xm[0], xm[1]));
    Sym a = grouped_attention({t.cat(cq.q, xq.q), t.cat(cq.k, xq.k), t.cat(cq.v, xq.v)});
    auto halves = t.split(a, {{B, Lc, Hd}, {B, Lx, Hd}});
    ctx_out = Sym{};
    if (!cb.pre_only) {
      Sym co = t.add(context, t.mul(t.linear(token_slice(halves[0]), Hd, true), cm[2]), "context attn residual");
      Sym n = modulate(t.layer_norm(co, false), cm[3], cm[4]);
      ctx_out = t.add(co, t.mul(mlp(*cb.mlp, n), cm[5]), "context mlp residual");
    }
    Sym y = t.add(x, t.mul(t.linear(token_slice(halves[1]), Hd, true), xm[2]), "x attn residual");
    if (xb.has_attn2) {
      Qkv q2 = pre_attention(*xb.attn2, modulate(x_norm, xm[6], xm[7]));
      y = t.add(y, t.mul(t.linear(grouped_attention(q2), Hd, true), xm[8]), "x attn2 residual");
    }
    Sym n = modulate(t.layer_norm(y, false), xm[3], xm[4]);
    return t.add(y, t.mul(mlp(*xb.mlp, n), xm[5]), "x mlp residual");
  }

 private:
  // nn::RMSNorm on a half input: fp32 copy, x * rsqrt(mean(x^2) + eps) and
  // * weight each save an fp32 full tensor; cast back.
  Sym rms_norm(const Sym& x_in) {
    const int64_t d = x_in.shape.back(), rows = x_in.numel() / d;
    Sym x = x_in.elem == 2 ? t.cast(x_in, 4) : x_in;
    Sym y = t.make(x.shape, 4, true);
    nn::TraceOp o;
    o.name = "rms_norm";
    o.inputs = {x.id};
    o.outputs = {y.id};
    o.saved = {x.id};
    o.grad_inputs = {x.id};
    o.saved_extra = rows * 4 * 2;
    o.forward_transient = x.numel() * 4;  // x^2
    t.sim.op(o);
    t.add_param({d});
    Sym w = t.make(x.shape, 4, true);
    nn::TraceOp ow;
    ow.name = "rms_norm weight";
    ow.inputs = {y.id};
    ow.outputs = {w.id};
    ow.saved = {y.id};
    ow.grad_inputs = {y.id};
    ow.param_grads = {t.param_grad_bytes({d})};
    ow.backward_transient = w.bytes();
    t.sim.op(ow);
    return x_in.elem == 2 ? t.cast(w, 2) : w;
  }

  // MMDiTAttentionImpl::pre_attention: qkv Linear, split into q [B, L, H, d],
  // k, v [B, L, Hkv, d], RMSNorm on q and k (qk_norm).
  Qkv pre_attention(MMDiTAttentionImpl& a, const Sym& x) {
    const int64_t B = x.shape[0], L = x.shape[1], H = a.heads, G = a.kv_heads, d = a.head_dim;
    Sym y = t.linear(x, (H + 2 * G) * d, a.qkv->bias.defined());
    auto parts = t.split(y, {{B, L, H, d}, {B, L, G, d}, {B, L, G, d}});
    Qkv r{parts[0], parts[1], parts[2]};
    if (a.ln_q) {
      r.q = rms_norm(r.q);
      r.k = rms_norm(r.k);
    }
    return r;
  }

  // models' grouped_attention on [B, L, H, d] q and [B, S, Hkv, d] k, v
  // (scores * scale, fp32 softmax cast back): [B, L, H * d].
  Sym grouped_attention(const Qkv& a) {
    const int64_t B = a.q.shape[0], L = a.q.shape[1], H = a.q.shape[2], d = a.q.shape[3];
    const int64_t S = a.k.shape[1], G = a.k.shape[2];
    nn::SdpaStyle st;
    st.scale_op = true;
    st.softmax_fp32 = true;
    st.chunkable = false;
    Sym q4 = t.view(a.q, {B, G, (H / G) * L, d}), k4 = t.view(a.k, {B, G, S, d}), v4 = t.view(a.v, {B, G, S, d});
    return t.merge_heads(t.sdpa(q4, k4, v4, L, st), L, H);
  }

  // Transformer MLP fc2(GELU_tanh(fc1(x))).
  Sym mlp(MMDiTMlpImpl& m, const Sym& x) {
    Sym h = t.unary(t.linear(x, m.fc1->out_features, true), "gelu_tanh");
    return t.linear(h, m.fc2->out_features, true);
  }

  // A slice of the joint attention output as a Linear input (a copy when not contiguous).
  Sym token_slice(const Sym& s) { return s.shape[0] > 1 ? t.copy(s, s.shape, "slice copy") : s; }

  nn::MemoryTracer& t;
};

}  // namespace

void trace_mmdit(torch::nn::Module& model, nn::MemoryTracer& t, const DenoiserBatch& in) {
  MMDiTImpl& m = as_mmdit(model);
  const auto& o = m.options();
  const int pe = t.precision().param_elem;
  const int64_t B = in.batch, S = in.latent_side, p = o.patch_size(), gh = S / p, Hd = o.hidden();
  if (S % p != 0 || gh > o.pos_embed_max_size()) {
    fail("plan: MMDiT latents of {}x{} do not fit patch {} and pos_embed_max_size {}", S, S, p, o.pos_embed_max_size());
  }
  JointBlockTrace jt(t);
  Sym x_in = t.input({B, o.in_channels(), S, S}, pe);
  t.input({B}, 4);  // t
  Sym ctx_in = t.input({B, in.context_tokens, o.context_dim()}, pe);
  Sym y = t.input({B, o.adm_in_channels()}, pe);
  Sym x = t.conv(x_in, Hd, p, p, 0);
  x = t.view(x, {B, gh * gh, Hd});
  x = t.add_bcast(x, t.constant({1, gh * gh, Hd}, pe, "pos_embed crop"), "add pos_embed");
  Sym c = t.embed_mlp(t.constant({B, o.frequency_embedding_size()}, 4, "timestep features"), Hd, Hd);
  c = t.add(c, t.embed_mlp(y, Hd, Hd), "add y embedding");
  Sym context = t.linear(ctx_in, Hd, true);
  const bool ckpt = t.precision().checkpoint;
  for (size_t i = 0; i < m.joint_blocks->size(); ++i) {
    auto& block = *m.joint_blocks->ptr<MMDiTJointBlockImpl>(i);
    Sym ctx_out;
    x = t.checkpointed(ckpt, {context.id, x.id, c.id}, [&] { return jt.joint_block(block, context, x, c, ctx_out); });
    context = ctx_out;
  }
  Sym mod = t.linear(t.unary(c, "silu"), 2 * Hd, true);
  auto parts = t.split(mod, {{B, Hd}, {B, Hd}});
  x = jt.modulate(t.layer_norm(x, false), parts[0], parts[1]);
  x = t.linear(x, m.final_linear->out_features, true);
  x = t.copy(x, {B, o.out_channels(), S, S}, "unpatchify");
  t.mse_loss(x, x_in);
}

DenoiserExample mmdit_example(torch::nn::Module& model, const DenoiserBatch& in, at::ScalarType dtype) {
  MMDiTImpl* dit = &as_mmdit(model);
  const auto& o = dit->options();
  const int64_t B = in.batch, S = in.latent_side;
  auto randn = [&](std::vector<int64_t> shape) { return torch::randn(shape).to(dtype); };
  at::Tensor x = randn({B, o.in_channels(), S, S});
  at::Tensor t = torch::rand({B});
  at::Tensor ctx = randn({B, in.context_tokens, o.context_dim()});
  at::Tensor y = randn({B, o.adm_in_channels()});
  DenoiserExample e;
  e.forward = [dit, x, t, ctx, y] { return dit->forward(x, t, ctx, y); };
  e.target = x;
  return e;
}

}  // namespace shoestring::models
