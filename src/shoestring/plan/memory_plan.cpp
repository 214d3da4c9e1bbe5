#include "shoestring/plan/memory_plan.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <functional>
#include <map>
#include <mutex>

#include "shoestring/core/error.h"
#include "shoestring/models/architecture.h"
#include "shoestring/models/cascade.h"
#include "shoestring/models/mmdit.h"
#include "shoestring/models/unet_ldm.h"
#include "shoestring/nn/chunked_attention.h"
#include "shoestring/nn/lora.h"
#include "shoestring/nn/resblock.h"
#include "shoestring/nn/transformer.h"
#include "shoestring/optim/adafactor.h"
#include "shoestring/train/training_model.h"
#include "shoestring/optim/adamw8bit.h"

namespace shoestring::plan {
namespace {

constexpr int kW = static_cast<int>(MemoryCategory::weights);
constexpr int kG = static_cast<int>(MemoryCategory::gradients);
constexpr int kS = static_cast<int>(MemoryCategory::optimizer_state);
constexpr int kA = static_cast<int>(MemoryCategory::activations);
constexpr int kT = static_cast<int>(MemoryCategory::temporaries);

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

/// A symbolic tensor: storage id in the trace, shape, element size, and
/// whether autograd computes its gradient.
struct Sym {
  int id = -1;
  std::vector<int64_t> shape;
  int elem = 4;
  bool rg = false;
  int64_t numel() const { return numel_of(shape); }
  int64_t bytes() const { return numel() * elem; }
};

/// Emits the ops of the emoji model's forward pass (train/diffusion_model.cpp:
/// CaptionEncoder then TinyUNet), mirroring each module's forward() and
/// what libtorch 1.13's autograd saves for each op (derivatives.yaml):
/// convolution, linear/mm, layer_norm and group_norm save their input (norms
/// also mean and rstd), SiLU and GELU their input, softmax its output, bmm
/// both operands, mul both factors, add / cat / views nothing. matmul's
/// batched reshape of a permuted q, k or v makes a contiguous copy, which
/// bmm saves.
class ModelTracer {
 public:
  ModelTracer(const TrainConfig& c, int64_t vocab) : c_(c), vocab_(vocab) {
    // fp16 takes the same bytes as bf16 (full_fp16, mixed_precision = "fp16").
    const bool bf16 = c.full_bf16 || c.full_fp16;
    autocast_ = c.mixed_precision != "no" && !bf16;
    param_elem_ = bf16 ? 2 : 4;
    // LoRA: the base weights are frozen (no gradients); the adapters' are
    // added by plan_memory.
    frozen_ = !c.network_module.empty();
    compute_elem_ = (bf16 || autocast_) ? 2 : 4;
    chunk_bytes_ = c.attention_chunk_mib * (int64_t{1} << 20);
  }

  Trace trace;
  std::vector<std::vector<int64_t>> param_shapes;
  int64_t checkpointed_saved_inside = 0;  // filled by the caller from two traces

  /// The whole training forward for one micro-batch of `B` images.
  void build(int64_t B) {
    const int64_t R = c_.resolution, L = c_.max_caption_length;
    // The batch (trainer: x0, eps, xt, target fp32; t; tokens int64) lives
    // through the micro-batch.
    const int64_t img = B * 3 * R * R * 4;
    for (int i = 0; i < 2; ++i) trace.tensor(img, true);  // x0, eps
    Sym xt = input({B, 3, R, R}, 4);
    Sym target = input({B, 3, R, R}, 4);
    Sym t = input({B}, 4);
    Sym tokens = input({B, L}, 8);

    // ---- caption encoder ----
    const int64_t D = c_.text_dim;
    Sym mask = make({B, L}, 1, false);
    op("mask", {tokens}, {mask});
    Sym emb = make({B, L, D}, compute_elem_, true);
    add_param({vocab_, D});
    TraceOp e;
    e.name = "token_embedding";
    e.inputs = {tokens.id};
    e.outputs = {emb.id};
    e.saved = {tokens.id};
    e.param_grads = {vocab_ * D * grad_elem()};
    trace.op(e);
    add_param({c_.max_caption_length, D});
    Sym h = make({B, L, D}, compute_elem_, true);
    TraceOp pos;
    pos.name = "position add";
    pos.inputs = {emb.id};
    pos.outputs = {h.id};
    pos.passthrough = true;
    pos.grad_inputs = {emb.id};
    pos.param_grads = {c_.max_caption_length * D * grad_elem()};
    trace.op(pos);
    for (int64_t l = 0; l < c_.text_layers; ++l) {
      Sym n1 = layer_norm(h);
      Sym a = attention(n1, n1, &mask, c_.num_heads, c_.num_heads, D / c_.num_heads, D, D);
      h = add(h, a, "text residual");
      Sym n2 = layer_norm(h);
      Sym m = linear(n2, 4 * D, true);
      m = unary(m, "gelu");
      m = linear(m, D, true);
      h = add(h, m, "text residual");
    }
    Sym context = layer_norm(h);

    // ---- UNet ----
    const int64_t base = c_.base_channels, temb_dim = 4 * base;
    Sym temb_in = make({B, base}, 4, false);
    op("timestep_embedding", {t}, {temb_in});
    if (compute_elem_ != 4 && !autocast_) temb_in = cast(temb_in, compute_elem_);
    Sym temb = linear(temb_in, temb_dim, true);
    temb = unary(temb, "silu");
    temb = linear(temb, temb_dim, true);

    Sym x = xt;
    if (c_.full_bf16 || c_.full_fp16) x = cast(x, 2);  // DiffusionModel: x_t.to(bf16)
    x = copy(x, x.shape, "channels_last copy");  // TinyUNet: contiguous(ChannelsLast)
    const auto& mult = c_.channel_mult;
    const int64_t levels = static_cast<int64_t>(mult.size());
    std::vector<bool> has_attn(levels, false);
    for (int64_t l : c_.attention_levels) {
      if (l < 0 || l >= levels) fail("plan: attention level {} out of range [0, {})", l, levels);
      has_attn[l] = true;
    }
    h = conv(x, base, 3, 1);
    std::vector<Sym> skips{h};
    int64_t ch = base;
    for (int64_t l = 0; l < levels; ++l) {
      const int64_t out = base * mult[l];
      for (int64_t i = 0; i < c_.num_res_blocks; ++i) {
        h = emoji_res(h, out, temb);
        ch = out;
        if (has_attn[l]) h = emoji_attn(h, context, mask);
        skips.push_back(h);
      }
      if (l + 1 < levels) {
        h = conv(h, ch, 3, 2);
        skips.push_back(h);
      }
    }
    h = emoji_res(h, ch, temb);
    h = emoji_attn(h, context, mask);
    h = emoji_res(h, ch, temb);
    for (int64_t l = levels - 1; l >= 0; --l) {
      const int64_t out = base * mult[l];
      for (int64_t i = 0; i <= c_.num_res_blocks; ++i) {
        Sym skip = skips.back();
        skips.pop_back();
        h = cat(h, skip);
        h = emoji_res(h, out, temb);
        ch = out;
        if (has_attn[l]) h = emoji_attn(h, context, mask);
      }
      if (l > 0) {
        h = upsample(h);
        h = conv(h, ch, 3, 1);
      }
    }
    h = group_norm(h, ch, nn::norm_groups(ch, c_.norm_groups), 1e-5);
    h = unary(h, "silu");
    h = conv(h, 3, 3, 1);
    h = copy(h, h.shape, "contiguous output");
    mse_loss(h, target);
  }


  // ---- registered real architectures (models/architecture.h), the denoiser
  // only, on the inputs bench/model_step feeds (plan/memory_plan.h:
  // denoiser_inputs). Shapes are read from the model built on the meta device.

  /// models::LdmUNetImpl::forward (SD 1.5, SDXL, SSD-1B) on [B, C, R/8, R/8]
  /// latents, context [B, 77, context_dim] and (SDXL) y [B, adm_in_channels].
  void build_ldm(models::LdmUNetImpl& u, int64_t B, int64_t R) {
    const auto& o = u.options();
    const DenoiserInputs in = denoiser_inputs(c_.architecture, R);
    const int pe = param_elem_;
    Sym x = input({B, o.in_channels(), in.latent_side, in.latent_side}, pe);
    Sym t = input({B}, 4);
    Sym ctx = input({B, in.context_tokens, o.context_dim()}, pe);
    const int64_t mc = o.model_channels(), temb_dim = u.time_embed->linear_1->out_features;
    Sym temb = embed_mlp(constant({B, mc}, 4, "timestep_embedding"), temb_dim, temb_dim);
    if (o.adm_in_channels() > 0) {
      Sym y = input({B, o.adm_in_channels()}, pe);
      temb = add(temb, embed_mlp(y, temb_dim, temb_dim), "add label_emb");
    }
    std::vector<Sym> skips;
    Sym h = x;
    for (size_t i = 0; i < u.input_blocks->size(); ++i) {
      h = ldm_block(*u.input_blocks->ptr<models::LdmBlockImpl>(i), h, temb, ctx);
      skips.push_back(h);
    }
    h = ldm_block(*u.middle_block, h, temb, ctx);
    for (size_t i = 0; i < u.output_blocks->size(); ++i) {
      h = cat(h, skips.back());
      skips.pop_back();
      h = ldm_block(*u.output_blocks->ptr<models::LdmBlockImpl>(i), h, temb, ctx);
    }
    h = group_norm(h, h.shape[1], u.out_norm->groups, 1e-5);
    h = unary(h, "silu");
    h = conv(h, o.out_channels(), 3, 1);
    mse_loss(h, x);
  }

  /// models::MMDiTImpl::forward (SD 3.5 Medium) on [B, 16, R/8, R/8] latents,
  /// context [B, 154, context_dim], pooled y [B, adm_in_channels].
  void build_mmdit(models::MMDiTImpl& m, int64_t B, int64_t R) {
    const auto& o = m.options();
    const DenoiserInputs in = denoiser_inputs(c_.architecture, R);
    const int pe = param_elem_;
    const int64_t S = in.latent_side, p = o.patch_size(), gh = S / p, Hd = o.hidden();
    if (S % p != 0 || gh > o.pos_embed_max_size()) {
      fail("plan: {} latents of {}x{} do not fit patch {} and pos_embed_max_size {}", c_.architecture, S, S, p,
           o.pos_embed_max_size());
    }
    Sym x_in = input({B, o.in_channels(), S, S}, pe);
    Sym t = input({B}, 4);
    Sym ctx_in = input({B, in.context_tokens, o.context_dim()}, pe);
    Sym y = input({B, o.adm_in_channels()}, pe);
    Sym x = conv(x_in, Hd, p, p, 0);
    x = view(x, {B, gh * gh, Hd});
    x = add_bcast(x, constant({1, gh * gh, Hd}, pe, "pos_embed crop"), "add pos_embed");
    Sym c = embed_mlp(constant({B, o.frequency_embedding_size()}, 4, "timestep features"), Hd, Hd);
    c = add(c, embed_mlp(y, Hd, Hd), "add y embedding");
    Sym context = linear(ctx_in, Hd, true);
    const bool ckpt = c_.gradient_checkpointing;
    for (size_t i = 0; i < m.joint_blocks->size(); ++i) {
      auto& block = *m.joint_blocks->ptr<models::MMDiTJointBlockImpl>(i);
      Sym ctx_out;
      x = checkpointed(ckpt, {context.id, x.id, c.id}, [&] { return joint_block(block, context, x, c, ctx_out); });
      context = ctx_out;
    }
    Sym mod = linear(unary(c, "silu"), 2 * Hd, true);
    auto parts = split(mod, {{B, Hd}, {B, Hd}});
    x = modulate(layer_norm(x, false), parts[0], parts[1]);
    x = linear(x, m.final_linear->out_features, true);
    x = copy(x, {B, o.out_channels(), S, S}, "unpatchify");
    mse_loss(x, x_in);
  }

  /// models::StageCImpl::forward (Stable Cascade stage C) on [B, 16, s, s]
  /// latents (plan/memory_plan.h: denoiser_inputs), CLIP text [B, 77, 1280],
  /// pooled [B, 1, 1280], image [B, 1, 768].
  void build_stage_c(models::StageCImpl& m, int64_t B, int64_t R) {
    const auto& o = m.options();
    const DenoiserInputs in = denoiser_inputs(c_.architecture, R);
    const int pe = param_elem_;
    const int64_t S = in.latent_side;
    if (o.patch_size() != 1) fail("plan: stage C with patch_size {} is not modelled", o.patch_size());
    Sym x_in = input({B, o.in_channels(), S, S}, pe);
    input({B}, 4);
    Sym text = input({B, in.context_tokens, o.clip_text_dim()}, pe);
    Sym pooled = input({B, 1, o.clip_text_pooled_dim()}, pe);
    Sym img = input({B, 1, o.clip_image_dim()}, pe);
    const int64_t conds = static_cast<int64_t>(o.t_conds().size());
    Sym r_embed = constant({B, o.r_dim() * (1 + conds)}, pe, "r embedding");
    const int64_t cd = o.cond_dim(), seq = o.clip_seq();
    Sym txt = linear(text, cd, true);
    Sym pool = view(linear(pooled, cd * seq, true), {B, seq, cd});
    Sym im = view(linear(img, cd * seq, true), {B, seq, cd});
    Sym cond = layer_norm(cat({txt, pool, im}), false);
    Sym x = layer_norm_2d(conv(x_in, o.hidden()[0], 1, 1, 0));
    const size_t levels = o.hidden().size();
    std::vector<Sym> level_outputs;
    for (size_t i = 0; i < levels; ++i) {
      if (i > 0) {
        x = conv(layer_norm_2d(x), o.hidden()[i], 1, 1, 0);
        if (o.switch_level()[i - 1]) fail("plan: stage C with switch_level (resampling) is not modelled");
      }
      x = stage_c_level(*m.down_blocks->ptr<torch::nn::ModuleListImpl>(i),
                        *m.down_repeat_mappers->ptr<torch::nn::ModuleListImpl>(i), x, r_embed, cond, nullptr, o);
      level_outputs.insert(level_outputs.begin(), x);
    }
    x = level_outputs[0];
    for (size_t k = 0; k < levels; ++k) {
      x = stage_c_level(*m.up_blocks->ptr<torch::nn::ModuleListImpl>(k),
                        *m.up_repeat_mappers->ptr<torch::nn::ModuleListImpl>(k), x, r_embed, cond,
                        k > 0 ? &level_outputs[k] : nullptr, o);
      if (k + 1 < levels) x = conv(layer_norm_2d(x), o.hidden()[levels - 2 - k], 1, 1, 0);
    }
    x = conv(layer_norm_2d(x), o.out_channels(), 1, 1, 0);
    mse_loss(x, x_in);
  }

 private:
  // One LdmBlock (TimestepEmbedSequential) as a training run executes it:
  // the trainer applies the precision policy to the UNet's block table, so
  // with gradient checkpointing each ResBlock and each transformer block is
  // its own segment (the SpatialTransformer's norm and projections, and the
  // resampling convs, are not checkpointed).
  Sym ldm_block(models::LdmBlockImpl& block, const Sym& x, const Sym& emb, const Sym& ctx) {
    const bool ckpt = c_.gradient_checkpointing;
    const bool per_layer = ckpt;
    return checkpointed(ckpt && !per_layer, {x.id, emb.id, ctx.id}, [&] {
      Sym h = x;
      for (const auto& child : block.children()) {
        if (auto* res = dynamic_cast<nn::ResBlockImpl*>(child.get())) {
          const int64_t out = res->options().out_channels(), groups = res->options().groups();
          h = checkpointed(per_layer, {h.id, emb.id}, [&] { return res_block(h, out, emb, groups); });
        } else if (auto* st = dynamic_cast<nn::SpatialTransformerImpl*>(child.get())) {
          const auto& to = st->options();
          StSpec sp;
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
          h = spatial_transformer(h, ctx, nullptr, sp, per_layer);
        } else if (auto* rs = dynamic_cast<models::LdmResampleImpl*>(child.get())) {
          if (!rs->down) h = upsample(h);
          h = conv(h, rs->conv->out_channels, 3, rs->down ? 2 : 1);
        } else if (auto* cv = dynamic_cast<nn::Conv2dImpl*>(child.get())) {
          h = conv(h, cv->out_channels, cv->kernel_size, cv->stride, cv->padding, cv->groups);
        } else {
          fail("plan: LdmBlock layer '{}' is not modelled", child->name());
        }
      }
      return h;
    });
  }

  // x * (1 + scale) + shift, per-sample [B, D] shift / scale over [B, L, D] (MMDiT modulate).
  Sym modulate(const Sym& x, const Sym& shift, const Sym& scale) {
    return add_bcast(mul(x, scalar_op(scale, "1 + scale")), shift, "add shift");
  }

  // nn::RMSNorm on a half input: fp32 copy, x * rsqrt(mean(x^2) + eps) and
  // * weight each save an fp32 full tensor; cast back.
  Sym rms_norm(const Sym& x_in) {
    const int64_t d = x_in.shape.back(), rows = x_in.numel() / d;
    Sym x = x_in.elem == 2 ? cast(x_in, 4) : x_in;
    Sym y = make(x.shape, 4, true);
    TraceOp o;
    o.name = "rms_norm";
    o.inputs = {x.id};
    o.outputs = {y.id};
    o.saved = {x.id};
    o.grad_inputs = {x.id};
    o.saved_extra = rows * 4 * 2;
    o.forward_transient = x.numel() * 4;  // x^2
    trace.op(o);
    add_param({d});
    Sym w = make(x.shape, 4, true);
    TraceOp ow;
    ow.name = "rms_norm weight";
    ow.inputs = {y.id};
    ow.outputs = {w.id};
    ow.saved = {y.id};
    ow.grad_inputs = {y.id};
    ow.param_grads = {param_grad_bytes({d})};
    ow.backward_transient = w.bytes();
    trace.op(ow);
    return x_in.elem == 2 ? cast(w, 2) : w;
  }

  struct Qkv {
    Sym q, k, v;
  };
  // MMDiTAttentionImpl::pre_attention: qkv Linear, split into q [B, L, H, d],
  // k, v [B, L, Hkv, d], RMSNorm on q and k (qk_norm).
  Qkv pre_attention(models::MMDiTAttentionImpl& a, const Sym& x) {
    const int64_t B = x.shape[0], L = x.shape[1], H = a.heads, G = a.kv_heads, d = a.head_dim;
    Sym y = linear(x, (H + 2 * G) * d, a.qkv->bias.defined());
    auto parts = split(y, {{B, L, H, d}, {B, L, G, d}, {B, L, G, d}});
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
    SdpaStyle st;
    st.scale_op = true;
    st.softmax_fp32 = true;
    st.chunkable = false;
    Sym q4 = view(a.q, {B, G, (H / G) * L, d}), k4 = view(a.k, {B, G, S, d}), v4 = view(a.v, {B, G, S, d});
    return merge_heads(sdpa(q4, k4, v4, L, st), L, H);
  }

  // Transformer MLP fc2(GELU_tanh(fc1(x))) with its gate: gate * mlp.
  Sym mmdit_mlp(models::MMDiTMlpImpl& mlp, const Sym& x) {
    Sym h = unary(linear(x, mlp.fc1->out_features, true), "gelu_tanh");
    return linear(h, mlp.fc2->out_features, true);
  }

  // A slice of the joint attention output as a Linear input (a copy when not contiguous).
  Sym token_slice(const Sym& s) { return s.shape[0] > 1 ? copy(s, s.shape, "slice copy") : s; }

  // MMDiTJointBlockImpl::forward. Returns x'; sets ctx_out to context' (an
  // undefined Sym for the last block, whose context stream is pre_only).
  Sym joint_block(models::MMDiTJointBlockImpl& jb, const Sym& context, const Sym& x, const Sym& c, Sym& ctx_out) {
    auto& cb = *jb.context_block;
    auto& xb = *jb.x_block;
    const int64_t B = x.shape[0], Lc = context.shape[1], Lx = x.shape[1], Hd = x.shape[2];
    Sym silu_c = unary(c, "silu");
    const int64_t nc = cb.adaLN_modulation->out_features / Hd, nx = xb.adaLN_modulation->out_features / Hd;
    auto cm = split(linear(silu_c, nc * Hd, true), std::vector<std::vector<int64_t>>(nc, {B, Hd}));
    auto xm = split(linear(silu_c, nx * Hd, true), std::vector<std::vector<int64_t>>(nx, {B, Hd}));
    Qkv cq = pre_attention(*cb.attn, modulate(layer_norm(context, false), cm[0], cm[1]));
    Sym x_norm = layer_norm(x, false);
    Qkv xq = pre_attention(*xb.attn, modulate(x_norm, xm[0], xm[1]));
    Sym a = grouped_attention({cat(cq.q, xq.q), cat(cq.k, xq.k), cat(cq.v, xq.v)});
    auto halves = split(a, {{B, Lc, Hd}, {B, Lx, Hd}});
    ctx_out = Sym{};
    if (!cb.pre_only) {
      Sym co = add(context, mul(linear(token_slice(halves[0]), Hd, true), cm[2]), "context attn residual");
      Sym n = modulate(layer_norm(co, false), cm[3], cm[4]);
      ctx_out = add(co, mul(mmdit_mlp(*cb.mlp, n), cm[5]), "context mlp residual");
    }
    Sym y = add(x, mul(linear(token_slice(halves[1]), Hd, true), xm[2]), "x attn residual");
    if (xb.has_attn2) {
      Qkv q2 = pre_attention(*xb.attn2, modulate(x_norm, xm[6], xm[7]));
      y = add(y, mul(linear(grouped_attention(q2), Hd, true), xm[8]), "x attn2 residual");
    }
    Sym n = modulate(layer_norm(y, false), xm[3], xm[4]);
    return add(y, mul(mmdit_mlp(*xb.mlp, n), xm[5]), "x mlp residual");
  }

  // Stage C LayerNorm2d: fp32 copy, layer_norm over channels of the permuted
  // tensor (a contiguous fp32 copy inside), cast back.
  Sym layer_norm_2d(const Sym& x) {
    const int64_t C = x.shape[1];
    return norm(x, C, x.numel() / C, "layer_norm_2d", false, x.numel() * 4);
  }

  // GlobalResponseNorm on [B, H, W, C] (half input: fp32 math).
  Sym grn(const Sym& x_in) {
    const int64_t B = x_in.shape[0], C = x_in.shape.back();
    Sym x = x_in.elem == 2 ? cast(x_in, 4) : x_in;
    Sym g = make({B, 1, 1, C}, 4, true);
    TraceOp o;
    o.name = "grn norm";
    o.inputs = {x.id};
    o.outputs = {g.id};
    o.saved = {x.id, g.id};
    o.grad_inputs = {x.id};
    trace.op(o);
    Sym n = scalar_op(g, "grn g / mean");
    Sym xn = mul(x, n);
    add_param({1, 1, 1, C});
    add_param({1, 1, 1, C});
    Sym gx = make(x.shape, 4, true);
    TraceOp og;
    og.name = "grn gamma * xn + beta";
    og.inputs = {xn.id};
    og.outputs = {gx.id};
    og.saved = {xn.id};
    og.grad_inputs = {xn.id};
    og.param_grads = {param_grad_bytes({C}), param_grad_bytes({C})};
    og.backward_transient = xn.bytes();
    trace.op(og);
    Sym y = add(gx, x, "grn residual");
    return x_in.elem == 2 ? cast(y, 2) : y;
  }

  // Stage C channelwise MLP: Linear(4c), GELU, GRN, Dropout, Linear(c), on [B, H, W, C].
  Sym channelwise(const Sym& h, int64_t c, double p) {
    Sym y = unary(linear(h, 4 * c, true), "gelu");
    y = dropout(grn(y), p);
    return linear(y, c, true);
  }

  // StageCImpl::run_level: the level's blocks `repeats` times, each block a
  // checkpointed segment when gradient checkpointing is on.
  Sym stage_c_level(torch::nn::ModuleListImpl& blocks, torch::nn::ModuleListImpl& mappers, Sym x, const Sym& r_embed,
                    const Sym& cond, const Sym* skip, const models::StageCOptions& o) {
    const bool ckpt = c_.gradient_checkpointing;
    const int64_t B = x.shape[0];
    for (size_t j = 0; j < mappers.size() + 1; ++j) {
      for (size_t b = 0; b < blocks.size(); ++b) {
        auto block = blocks.ptr(b);
        const int64_t C = x.shape[1], H = x.shape[2], W = x.shape[3];
        if (auto* res = dynamic_cast<models::CascadeResBlockImpl*>(block.get())) {
          const bool with_skip = b == 0 && res->c_skip > 0;
          if (res->c_skip > 0 && (skip == nullptr || !with_skip)) fail("plan: stage C ResBlock {} needs a skip", b);
          std::vector<int> in{x.id};
          if (with_skip) in.push_back(skip->id);
          x = checkpointed(ckpt, in, [&] {
            Sym h = layer_norm_2d(conv(x, C, res->depthwise->kernel_size, 1, -1, C));
            if (with_skip) h = cat(h, *skip);
            h = view(h, {B, H, W, h.shape[1]});
            h = view(channelwise(h, C, res->dropout), {B, C, H, W});
            return add(h, x, "resblock residual");
          });
        } else if (auto* ff = dynamic_cast<models::CascadeFeedForwardBlockImpl*>(block.get())) {
          x = checkpointed(ckpt, {x.id}, [&] {
            Sym h = view(layer_norm_2d(x), {B, H, W, C});
            return add(x, view(channelwise(h, C, ff->dropout), {B, C, H, W}), "ff residual");
          });
        } else if (auto* ts = dynamic_cast<models::CascadeTimestepBlockImpl*>(block.get())) {
          x = checkpointed(ckpt, {x.id, r_embed.id}, [&] {
            Sym ab;
            for (size_t i = 0; i < ts->mappers.size(); ++i) {
              Sym m = linear(view(r_embed, {B, o.r_dim()}), 2 * C, true);
              ab = i == 0 ? m : add(ab, m, "sum mappers");
            }
            auto parts = split(ab, {{B, C, 1, 1}, {B, C, 1, 1}});
            return add_bcast(mul(x, scalar_op(parts[0], "1 + a")), parts[1], "add b");
          });
        } else if (auto* at = dynamic_cast<models::CascadeAttnBlockImpl*>(block.get())) {
          x = checkpointed(ckpt, {x.id, cond.id}, [&] {
            const int64_t heads = at->attn->heads, d = C / heads, L = H * W;
            Sym kv = linear(unary(cond, "silu"), C, true);
            Sym q = view(layer_norm_2d(x), {B, L, C});
            if (at->self_attn) kv = cat(q, kv);
            const int64_t Sk = kv.shape[1];
            Sym qp = view(linear(q, C, true), {B, heads, L, d});
            Sym kp = view(linear(kv, C, true), {B, heads, Sk, d});
            Sym vp = view(linear(kv, C, true), {B, heads, Sk, d});
            SdpaStyle st;
            st.scale_op = true;
            st.softmax_fp32 = true;
            st.dropout = at->attn->dropout;
            st.chunkable = false;
            Sym out = linear(merge_heads(sdpa(qp, kp, vp, L, st), L, heads), C, true);
            return add(x, view(out, {B, C, H, W}), "attention residual");
          });
        } else {
          fail("plan: stage C block '{}' is not modelled", block->name());
        }
      }
      if (j < mappers.size()) x = conv(x, x.shape[1], 1, 1, 0);
    }
    return x;
  }

 public:
  int64_t parameters() const {
    int64_t n = 0;
    for (const auto& s : param_shapes) n += numel_of(s);
    return n;
  }

 private:
  int grad_elem() const { return autocast_ ? 4 : param_elem_; }

  Sym input(std::vector<int64_t> shape, int elem) {
    Sym s{-1, std::move(shape), elem, false};
    s.id = trace.tensor(s.bytes(), true);
    return s;
  }
  Sym make(std::vector<int64_t> shape, int elem, bool rg) {
    Sym s{-1, std::move(shape), elem, rg};
    s.id = trace.tensor(s.bytes());
    return s;
  }
  void op(const std::string& name, std::vector<Sym> in, std::vector<Sym> out) {
    TraceOp o;
    o.name = name;
    for (auto& s : in) o.inputs.push_back(s.id);
    for (auto& s : out) o.outputs.push_back(s.id);
    trace.op(o);
  }
  void add_param(std::vector<int64_t> shape) { param_shapes.push_back(std::move(shape)); }
  int64_t param_grad_bytes(const std::vector<int64_t>& shape) const {
    return frozen_ ? 0 : numel_of(shape) * grad_elem();
  }

  // A dtype conversion: new tensor; backward converts the gradient back.
  Sym cast(const Sym& x, int elem) {
    Sym y = make(x.shape, elem, x.rg);
    TraceOp o;
    o.name = "cast";
    o.inputs = {x.id};
    o.outputs = {y.id};
    if (x.rg) o.grad_inputs = {x.id};
    trace.op(o);
    return y;
  }
  // A contiguous copy (reshape of a permuted tensor, channels-last
  // conversion): backward hands the gradient through as a view.
  Sym copy(const Sym& x, std::vector<int64_t> shape, const std::string& name) {
    Sym y = make(std::move(shape), x.elem, x.rg);
    TraceOp o;
    o.name = name;
    o.inputs = {x.id};
    o.outputs = {y.id};
    o.passthrough = true;
    if (x.rg) o.grad_inputs = {x.id};
    trace.op(o);
    return y;
  }
  Sym view(const Sym& x, std::vector<int64_t> shape) {
    Sym y{trace.alias(x.id, numel_of(shape) * x.elem), std::move(shape), x.elem, x.rg};
    TraceOp o;
    o.name = "view";
    o.inputs = {x.id};
    o.outputs = {y.id};
    o.passthrough = true;
    if (x.rg) o.grad_inputs = {x.id};
    trace.op(o);
    return y;
  }
  // Input of a matmul-like op: under autocast, an fp32 tensor is cast to
  // bf16 (the copy is what the op saves).
  Sym mm_input(const Sym& x) { return autocast_ && x.elem == 4 ? cast(x, 2) : x; }
  // Autocast casts each weight to bf16 once per forward (cached) and the
  // consuming op saves the copy; the gradient lands in fp32.
  void weight_cast(TraceOp& o, const std::vector<int64_t>& shape) {
    if (!autocast_) return;
    const int w = trace.tensor(numel_of(shape) * 2);
    TraceOp c;
    c.name = "autocast weight";
    c.outputs = {w};
    trace.op(c);
    o.inputs.push_back(w);
    o.saved.push_back(w);
    o.backward_transient += numel_of(shape) * 2;
  }

  // nn::Conv2d; `pad` -1 = k / 2 (same size at stride 1).
  Sym conv(const Sym& x_in, int64_t cout, int64_t k, int64_t stride, int64_t pad = -1, int64_t groups = 1) {
    Sym x = mm_input(x_in);
    const int64_t B = x.shape[0], cin = x.shape[1], H = x.shape[2], W = x.shape[3];
    if (pad < 0) pad = k / 2;
    const int64_t Ho = (H + 2 * pad - k) / stride + 1, Wo = (W + 2 * pad - k) / stride + 1;
    Sym y = make({B, cout, Ho, Wo}, compute_elem_, true);
    std::vector<int64_t> w{cout, cin / groups, k, k}, b{cout};
    add_param(w);
    add_param(b);
    TraceOp o;
    o.name = fmt::format("conv{}x{} {}->{} @{}x{}", k, k, cin, cout, Ho, Wo);
    o.inputs = {x.id};
    o.outputs = {y.id};
    o.saved = {x.id};
    if (x.rg) o.grad_inputs = {x.id};
    o.param_grads = {param_grad_bytes(w), param_grad_bytes(b)};
    weight_cast(o, w);
    trace.op(o);
    return y;
  }

  Sym linear(const Sym& x_in, int64_t out_f, bool bias, bool scaled_weight = false) {
    Sym x = mm_input(x_in);
    std::vector<int64_t> shape = x.shape;
    const int64_t in_f = shape.back();
    shape.back() = out_f;
    Sym y = make(shape, compute_elem_, true);
    std::vector<int64_t> w{out_f, in_f};
    add_param(w);
    TraceOp o;
    o.name = fmt::format("linear {}->{}", in_f, out_f);
    o.inputs = {x.id};
    o.outputs = {y.id};
    o.saved = {x.id};
    if (x.rg) o.grad_inputs = {x.id};
    if (scaled_weight) {
      // attention.cpp: linear(x, to_q.weight * scale): the scaled copy is saved.
      Sym ws = make(w, compute_elem_, true);
      TraceOp s;
      s.name = "scaled q weight";
      s.outputs = {ws.id};
      s.param_grads = {param_grad_bytes(w)};
      const int s_index = trace.op(s);
      (void)s_index;
      o.inputs.push_back(ws.id);
      o.saved.push_back(ws.id);
      o.grad_inputs.push_back(ws.id);
    } else {
      o.param_grads.push_back(param_grad_bytes(w));
      weight_cast(o, w);
    }
    if (bias) {
      add_param({out_f});
      o.param_grads.push_back(param_grad_bytes({out_f}));
    }
    trace.op(o);
    return y;
  }

  // nn::LayerNorm / nn::GroupNorm (nn/layers.h) compute in fp32: a bf16 input
  // is cast to an fp32 copy (which the norm saves), the fp32 output is cast
  // back; norm weights are cast to fp32 too (small copies, also saved).
  // Without `affine` (MMDiT's and Stage C's parameterless LayerNorms) there
  // is no weight or bias. `transient`: scratch of the forward (a contiguous
  // copy of a permuted input inside native_layer_norm).
  Sym norm(const Sym& x_in, int64_t C, int64_t stat_rows, const std::string& name, bool affine = true,
           int64_t transient = 0) {
    const int in_elem = x_in.elem;
    Sym x = in_elem == 2 ? cast(x_in, 4) : x_in;
    Sym y = make(x.shape, x.elem, true);
    TraceOp o;
    o.name = name;
    o.inputs = {x.id};
    o.outputs = {y.id};
    o.saved = {x.id};
    if (x.rg) o.grad_inputs = {x.id};
    o.saved_extra = 2 * stat_rows * 4;
    o.forward_transient = transient;
    if (affine) {
      add_param({C});
      add_param({C});
      o.saved_extra += param_elem_ == 2 ? 2 * C * 4 : 0;
      o.param_grads = {param_grad_bytes({C}), param_grad_bytes({C})};
    }
    trace.op(o);
    return in_elem == 2 ? cast(y, 2) : y;
  }

  Sym layer_norm(const Sym& x, bool affine = true) {
    const int64_t d = x.shape.back();
    return norm(x, d, x.numel() / d, "layer_norm", affine);
  }

  Sym group_norm(const Sym& x, int64_t C, int64_t groups, double eps) {
    (void)eps;
    return norm(x, C, x.shape[0] * groups, fmt::format("group_norm {}", C));
  }

  Sym unary(const Sym& x, const std::string& name) {  // silu, gelu: save the input
    Sym y = make(x.shape, x.elem, x.rg);
    TraceOp o;
    o.name = name;
    o.inputs = {x.id};
    o.outputs = {y.id};
    o.saved = {x.id};
    if (x.rg) o.grad_inputs = {x.id};
    trace.op(o);
    return y;
  }

  Sym add(const Sym& a, const Sym& b, const std::string& name = "add") {
    Sym y = make(a.shape, a.elem, a.rg || b.rg);
    TraceOp o;
    o.name = name;
    o.inputs = {a.id, b.id};
    o.outputs = {y.id};
    o.passthrough = true;
    if (a.rg) o.grad_inputs.push_back(a.id);
    if (b.rg && b.id != a.id) o.grad_inputs.push_back(b.id);
    trace.op(o);
    return y;
  }

  // a * b, b of a's shape or broadcast over it (a gate, a scale): saves both
  // factors; the gradient of a broadcast b is reduced from a full product.
  Sym mul(const Sym& a, const Sym& b) {
    Sym y = make(a.shape, std::max(a.elem, b.elem), a.rg || b.rg);
    TraceOp o;
    o.name = "mul";
    o.inputs = {a.id, b.id};
    o.outputs = {y.id};
    o.saved = {a.id, b.id};
    if (a.rg) o.grad_inputs.push_back(a.id);
    if (b.rg) o.grad_inputs.push_back(b.id);
    if (b.rg && b.numel() < a.numel()) o.backward_transient = y.bytes();
    trace.op(o);
    return y;
  }

  // a + b with b broadcast (a bias, a shift): a's gradient is the output's,
  // b's a reduction of it.
  Sym add_bcast(const Sym& a, const Sym& b, const std::string& name = "add") {
    Sym y = make(a.shape, a.elem, a.rg || b.rg);
    TraceOp o;
    o.name = name;
    o.inputs = {a.id, b.id};
    o.outputs = {y.id};
    o.passthrough = true;
    o.broadcast = true;
    if (a.rg) o.grad_inputs.push_back(a.id);
    if (b.rg) o.grad_inputs.push_back(b.id);
    trace.op(o);
    return y;
  }

  // An elementwise op with a scalar (x * s, 1 + x): new tensor, saves nothing.
  Sym scalar_op(const Sym& x, const std::string& name) {
    Sym y = make(x.shape, x.elem, x.rg);
    TraceOp o;
    o.name = name;
    o.inputs = {x.id};
    o.outputs = {y.id};
    if (x.rg) o.grad_inputs = {x.id};
    trace.op(o);
    return y;
  }

  // torch::cat along dim 1 (channels of [B, C, H, W], tokens of [B, L, D]).
  Sym cat(const std::vector<Sym>& parts) {
    std::vector<int64_t> s = parts.at(0).shape;
    s[1] = 0;
    bool rg = false;
    for (const Sym& p : parts) {
      s[1] += p.shape[1];
      rg = rg || p.rg;
    }
    Sym y = make(s, parts[0].elem, rg);
    TraceOp o;
    o.name = "cat";
    for (const Sym& p : parts) {
      o.inputs.push_back(p.id);
      if (p.rg) o.grad_inputs.push_back(p.id);
    }
    o.outputs = {y.id};
    o.passthrough = true;  // the inputs' gradients are slices (views) of the output's
    trace.op(o);
    return y;
  }
  Sym cat(const Sym& a, const Sym& b) { return cat(std::vector<Sym>{a, b}); }

  // Views of parts of x (chunk, slice) with the given shapes; their backward
  // assembles one gradient of x's size.
  std::vector<Sym> split(const Sym& x, const std::vector<std::vector<int64_t>>& shapes) {
    std::vector<Sym> out;
    TraceOp o;
    o.name = "split";
    o.inputs = {x.id};
    for (const auto& sh : shapes) {
      out.push_back(Sym{trace.alias(x.id, numel_of(sh) * x.elem), sh, x.elem, x.rg});
      o.outputs.push_back(out.back().id);
    }
    if (x.rg) o.grad_inputs = {x.id};
    trace.op(o);
    return out;
  }

  // A new tensor computed from inputs that need no gradient (timestep
  // features, positional embedding crops, dropout masks).
  Sym constant(std::vector<int64_t> shape, int elem, const std::string& name) {
    Sym y = make(std::move(shape), elem, false);
    op(name, {}, {y});
    return y;
  }

  Sym upsample(const Sym& x) {
    Sym y = make({x.shape[0], x.shape[1], x.shape[2] * 2, x.shape[3] * 2}, x.elem, true);
    TraceOp o;
    o.name = "upsample nearest";
    o.inputs = {x.id};
    o.outputs = {y.id};
    o.grad_inputs = {x.id};
    trace.op(o);
    return y;
  }

  // nn::ResBlock (nn/resblock.cpp): GroupNorm, SiLU, 3x3 conv, + Linear(SiLU(temb)),
  // GroupNorm, SiLU, 3x3 conv, + (1x1 conv) shortcut. `max_groups` as ResBlockOptions::groups.
  Sym res_block(const Sym& x, int64_t out, const Sym& temb, int64_t max_groups) {
    const int64_t cin = x.shape[1];
    Sym h = group_norm(x, cin, nn::norm_groups(cin, max_groups), 1e-5);
    h = unary(h, "silu");
    h = conv(h, out, 3, 1);
    Sym te = unary(temb, "silu");
    te = linear(te, out, true);
    h = add(h, te, "add temb");
    h = group_norm(h, out, nn::norm_groups(out, max_groups), 1e-5);
    h = unary(h, "silu");
    h = conv(h, out, 3, 1);
    Sym sc = cin != out ? conv(x, out, 1, 1) : x;
    return add(sc, h, "residual");
  }

  Sym feed_forward_gelu(const Sym& x, int64_t mult) {
    const int64_t dim = x.shape.back();
    Sym h = unary(linear(x, mult * dim, true), "gelu");
    return linear(h, dim, true);
  }

  Sym feed_forward_geglu(const Sym& x, int64_t mult = 4) {
    const int64_t dim = x.shape.back(), inner = mult * dim;
    Sym h = linear(x, 2 * inner, true);
    std::vector<int64_t> half = h.shape;
    half.back() = inner;
    // chunk: two views of h; backward concatenates their gradients (new).
    Sym a{trace.alias(h.id, numel_of(half) * h.elem), half, h.elem, true};
    Sym g{trace.alias(h.id, numel_of(half) * h.elem), half, h.elem, true};
    TraceOp ch;
    ch.name = "chunk";
    ch.inputs = {h.id};
    ch.outputs = {a.id, g.id};
    ch.grad_inputs = {h.id};
    trace.op(ch);
    Sym gl = unary(g, "gelu");
    Sym m = mul(a, gl);
    return linear(m, dim, true);
  }

  /// Style of a scaled-dot-product attention, per model.
  struct SdpaStyle {
    bool scale_op = false;      ///< scores * 1/sqrt(d) as an op (else folded into the query weight)
    bool softmax_fp32 = false;  ///< softmax(scores, dtype fp32).to(compute dtype), as MMDiT and Stage C
    bool masked = false;        ///< masked_fill before the softmax
    double dropout = 0.0;       ///< dropout on the attention weights (training)
    bool chunkable = true;      ///< nn::Attention: chunked (nn/chunked_attention.h) above attention_chunk_mib
  };

  // softmax(q k^T) v on heads: q4 [B, Hkv, R, d] (R = query rows of all
  // query heads sharing a key/value head), k4 / v4 [B, Hkv, Lk, d]; `rows_per_head`
  // is Lq (a batched matmul copies a permuted operand when Hkv > 1). Returns [B, Hkv, R, d].
  Sym sdpa(const Sym& q4, const Sym& k4, const Sym& v4, int64_t Lq, const SdpaStyle& st) {
    const int64_t B = q4.shape[0], Hkv = q4.shape[1], R = q4.shape[2], d = q4.shape[3], Lk = k4.shape[2];
    const int elem = q4.elem;
    const int64_t block = st.chunkable ? nn::attention_block_rows(B, Hkv, R, Lk, elem, chunk_bytes_) : 0;
    if (block != 0) {
      Sym o = make({B, Hkv, R, d}, elem, true);
      const int64_t blk = B * Hkv * block * Lk * elem;
      TraceOp ca;
      ca.name = fmt::format("chunked attention {}x{} (blocks of {})", R, Lk, block);
      ca.inputs = {q4.id, k4.id, v4.id};
      ca.outputs = {o.id};
      ca.saved = {q4.id, k4.id, v4.id, o.id};
      ca.grad_inputs = {q4.id, k4.id, v4.id};
      ca.forward_transient = 3 * blk;
      ca.backward_transient = 3 * blk + 2 * B * Hkv * Lk * d * 4 + B * Hkv * R * 4;  // dK, dV accumulate in fp32
      trace.op(ca);
      return o;
    }
    // matmul's batched reshape copies a permuted operand (not viewable).
    Sym qc = (Hkv > 1 && Lq > 1) ? copy(q4, q4.shape, "bmm q copy") : q4;
    Sym kc = (Hkv > 1 && Lk > 1) ? copy(k4, {B, Hkv, d, Lk}, "bmm k copy") : k4;
    Sym s = make({B, Hkv, R, Lk}, elem, true);
    TraceOp qk;
    qk.name = fmt::format("bmm scores {}x{}", R, Lk);
    qk.inputs = {qc.id, kc.id};
    qk.outputs = {s.id};
    qk.saved = {qc.id, kc.id};
    qk.grad_inputs = {qc.id, kc.id};
    trace.op(qk);
    if (st.scale_op) s = scalar_op(s, "scale scores");
    if (st.masked) s = scalar_op(s, "masked_fill");
    Sym p;
    if (st.softmax_fp32 && elem != 4) {
      Sym s32 = cast(s, 4);
      p = make(s.shape, 4, true);
      TraceOp sm;
      sm.name = fmt::format("softmax fp32 {}x{}", R, Lk);
      sm.inputs = {s32.id};
      sm.outputs = {p.id};
      sm.saved = {p.id};
      sm.grad_inputs = {s32.id};
      trace.op(sm);
      p = cast(p, elem);
    } else {
      p = make(s.shape, elem, true);
      TraceOp sm;
      sm.name = fmt::format("softmax {}x{}", R, Lk);
      sm.inputs = {s.id};
      sm.outputs = {p.id};
      sm.saved = {p.id};
      sm.grad_inputs = {s.id};
      trace.op(sm);
    }
    p = dropout(p, st.dropout);
    Sym vc = (Hkv > 1 && Lk > 1) ? copy(v4, v4.shape, "bmm v copy") : v4;
    Sym o = make({B, Hkv, R, d}, elem, true);
    TraceOp pv;
    pv.name = "bmm probs v";
    pv.inputs = {p.id, vc.id};
    pv.outputs = {o.id};
    pv.saved = {p.id, vc.id};
    pv.grad_inputs = {p.id, vc.id};
    trace.op(pv);
    return o;
  }

  // [B, Hkv, R, d] heads back to tokens [B, Lq, H * d] (a copy unless trivial).
  Sym merge_heads(const Sym& o, int64_t Lq, int64_t H) {
    const int64_t B = o.shape[0], inner = o.numel() / (B * Lq);
    return (H > 1 && Lq > 1) ? copy(o, {B, Lq, inner}, "heads merge copy") : view(o, {B, Lq, inner});
  }

  // nn::Attention (nn/attention.cpp): q = x W_q^T * scale (scaled weight
  // copy), k, v from kv, (chunked) softmax attention, to_out with bias.
  Sym attention(const Sym& x, const Sym& kv, const Sym* mask, int64_t H, int64_t Hkv, int64_t d,
                int64_t query_dim, int64_t context_dim) {
    (void)context_dim;
    const int64_t B = x.shape[0], Lq = x.shape[1], Lk = kv.shape[1], G = H / Hkv, R = G * Lq;
    const int64_t inner = H * d, kv_inner = Hkv * d;
    Sym q = linear(x, inner, false, /*scaled_weight=*/true);
    Sym k = linear(kv, kv_inner, false);
    Sym v = linear(kv, kv_inner, false);
    Sym q4 = G > 1 ? copy(q, {B, Hkv, R, d}, "gqa q copy") : view(q, {B, Hkv, R, d});
    Sym k4 = view(k, {B, Hkv, Lk, d});
    Sym v4 = view(v, {B, Hkv, Lk, d});
    SdpaStyle st;
    st.masked = mask != nullptr;
    Sym o = sdpa(q4, k4, v4, Lq, st);
    return linear(merge_heads(o, Lq, H), query_dim, true);
  }

  /// A SpatialTransformer's shape (nn::TransformerOptions).
  struct StSpec {
    int64_t heads = 1, head_dim = 1, depth = 1, ff_mult = 4, groups = 32;
    bool linear_proj = false, gated = true;
  };

  // nn::SpatialTransformer (nn/transformer.cpp): GroupNorm, proj_in (1x1 conv
  // or Linear), `depth` TransformerBlocks (self-attention, cross-attention on
  // `context`, GEGLU feed-forward; each checkpointed on its own when
  // `checkpoint_blocks`), proj_out, residual.
  Sym spatial_transformer(const Sym& x, const Sym& context, const Sym* mask, const StSpec& sp,
                          bool checkpoint_blocks) {
    const int64_t B = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3];
    Sym h = group_norm(x, C, nn::norm_groups(C, sp.groups), 1e-6);
    if (sp.linear_proj) {
      // Linear on the transposed tokens: matmul's reshape copies them.
      h = copy(h, {B, H * W, C}, "tokens copy");
      h = linear(h, C, true);
    } else {
      h = conv(h, C, 1, 1);
      h = view(h, {B, H * W, C});
    }
    for (int64_t i = 0; i < sp.depth; ++i) {
      std::vector<int> in{h.id, context.id};
      h = checkpointed(checkpoint_blocks, in, [&] {
        Sym n1 = layer_norm(h);
        Sym y = add(h, attention(n1, n1, nullptr, sp.heads, sp.heads, sp.head_dim, C, C), "attn1 residual");
        Sym n2 = layer_norm(y);
        y = add(y, attention(n2, context, mask, sp.heads, sp.heads, sp.head_dim, C, context.shape[2]),
                "attn2 residual");
        Sym n3 = layer_norm(y);
        return add(y, sp.gated ? feed_forward_geglu(n3, sp.ff_mult) : feed_forward_gelu(n3, sp.ff_mult),
                   "ff residual");
      });
    }
    if (sp.linear_proj) {
      h = linear(h, C, true);
      h = view(h, {B, C, H, W});
    } else {
      h = view(h, {B, C, H, W});
      h = conv(h, C, 1, 1);
    }
    return add(x, h, "transformer residual");
  }

  // Runs `f` (which emits ops) as a checkpointed segment with `inputs` when `on`.
  template <class F>
  Sym checkpointed(bool on, const std::vector<int>& inputs, F&& f) {
    const int first = trace.next_op_index();
    Sym y = f();
    if (on && trace.next_op_index() > first) trace.segment(first, trace.next_op_index() - 1, inputs);
    return y;
  }

  // The emoji UNet checkpoints each ResBlock and each SpatialTransformer.
  Sym emoji_res(const Sym& x, int64_t out, const Sym& temb) {
    return checkpointed(c_.gradient_checkpointing, {x.id, temb.id},
                        [&] { return res_block(x, out, temb, c_.norm_groups); });
  }
  Sym emoji_attn(const Sym& x, const Sym& context, const Sym& mask) {
    const int64_t C = x.shape[1];
    if (C % c_.num_heads != 0) fail("plan: channels {} not divisible by num_heads {}", C, c_.num_heads);
    StSpec sp;
    sp.heads = c_.num_heads;
    sp.head_dim = C / c_.num_heads;
    sp.groups = c_.norm_groups;
    return checkpointed(c_.gradient_checkpointing, {x.id, context.id},
                        [&] { return spatial_transformer(x, context, &mask, sp, false); });
  }

  // The training loss on the model output h against target:
  // mse_loss(h.to(fp32), target.to(fp32)) saves both fp32 operands.
  void mse_loss(Sym h, Sym target) {
    if (h.elem != 4) h = cast(h, 4);
    if (target.elem != 4) target = constant(target.shape, 4, "target fp32");
    Sym loss = make({1}, 4, true);
    TraceOp m;
    m.name = "mse_loss";
    m.inputs = {h.id, target.id};
    m.outputs = {loss.id};
    m.saved = {h.id, target.id};
    m.grad_inputs = {h.id};
    trace.op(m);
    trace.keep(loss.id);
  }

  // Dropout in training (ATen's CPU path): x * mask, saving both.
  Sym dropout(const Sym& x, double p) {
    if (p <= 0) return x;
    return mul(x, constant(x.shape, x.elem, "dropout mask"));
  }

  // Timestep / vector embedding MLP: Linear, SiLU, Linear (features cast to
  // the compute dtype first, as nn::TimestepEmbedding).
  Sym embed_mlp(Sym feats, int64_t hidden, int64_t out) {
    if (compute_elem_ != 4 && !autocast_ && feats.elem == 4) feats = cast(feats, compute_elem_);
    Sym h = linear(feats, hidden, true);
    h = unary(h, "silu");
    return linear(h, out, true);
  }

  const TrainConfig& c_;
  int64_t vocab_;
  bool autocast_ = false;
  bool frozen_ = false;
  int param_elem_ = 4, compute_elem_ = 4;
  int64_t chunk_bytes_ = 0;
};

/// Optimizer state bytes for one parameter of `shape`, and the scratch its
/// update allocates, for the config's optimizer (docs/optimizers/).
struct StateModel {
  int64_t state = 0;    ///< bytes kept
  int64_t scratch = 0;  ///< transient bytes of one update (beyond the gradient)
};

StateModel optimizer_state_for(const TrainConfig& c, const std::vector<int64_t>& shape) {
  const int64_t n = numel_of(shape);
  const int64_t sd = c.optimizer_state_dtype == "bf16" ? 2 : 4;
  const int64_t weight_elem = (c.full_bf16 || c.full_fp16) ? 2 : 4;
  StateModel m;
  const std::string& t = c.optimizer_type;
  if (t == "AdamW" || t == "Compass") {
    m.state = 2 * n * sd;
  } else if (t == "Lion") {
    m.state = n * sd;
  } else if (t == "AdamW8bit") {
    const AdamW8bitOptions o = parse_adamw8bit_args(c.optimizer_args);
    if (n >= o.min_8bit_size) {
      const int64_t blocks = (n + o.block_size - 1) / o.block_size;
      m.state = 2 * n + 2 * blocks * 4;
    } else {
      m.state = 8 * n;
    }
  } else if (t == "Adafactor") {
    const AdafactorOptions o = parse_adafactor_args(c.optimizer_args);
    const std::vector<int64_t> f = Adafactor::factored_shape(shape);
    if (!f.empty()) {
      m.state = (f[0] + f[1]) * 4;
      // The fused factored path measures RMS(X) on an fp32 copy of bf16 weights.
      if (!o.beta1 && weight_elem == 2) m.scratch = 4 * n;
      if (o.beta1) m.scratch = 4 * n * 4;  // op chain: grad, p, u, m in fp32
    } else {
      m.state = n * sd + (o.beta1 ? n * sd : 0);
      m.scratch = 4 * n * 4;
    }
  } else {
    fail("plan: unknown optimizer_type '{}'", t);
  }
  return m;
}

std::string fmt_bytes(int64_t b) {
  const double v = static_cast<double>(b);
  if (v >= (1LL << 30)) return fmt::format("{:.2f} GiB", v / (1LL << 30));
  if (v >= (1LL << 20)) return fmt::format("{:.1f} MiB", v / (1LL << 20));
  return fmt::format("{:.1f} KiB", v / 1024.0);
}

}  // namespace

nlohmann::json MemoryPlan::to_json() const {
  nlohmann::json j;
  j["predicted_peak_bytes"] = predicted_peak_bytes;
  j["first_step_peak_bytes"] = first_step_peak_bytes;
  for (int c = 0; c <= kT; ++c) j[fmt::format("{}_bytes", to_string(static_cast<MemoryCategory>(c)))] = at_peak[c];
  j["host_bytes"] = host_bytes;
  j["parameters"] = parameters;
  j["peak_phase"] = peak_phase;
  j["ema_bytes"] = ema_bytes;
  j["activations_kept_bytes"] = activation_bytes;
  j["checkpointing_saving_bytes"] = checkpointing_saving_bytes;
  j["notes"] = notes;
  return j;
}

DenoiserInputs denoiser_inputs(const std::string& name, int64_t resolution) {
  if (resolution < 8) fail("plan: resolution {} is too small", resolution);
  if (name == "sd15" || name == "sdxl" || name == "ssd1b") return {resolution / 8, 77};
  if (name == "sd35m") return {resolution / 8, 154};
  if (name == "cascade-c" || name == "cascade-c-lite") return {std::max<int64_t>(8, resolution * 3 / 128), 77};
  fail("plan: no denoiser inputs known for architecture '{}' (known: sd15, sdxl, ssd1b, sd35m, cascade-c, "
       "cascade-c-lite)",
       name);
}

bool planner_knows(const std::string& a) {
  return a == "tiny-unet" || a == "sd15" || a == "sdxl" || a == "ssd1b" || a == "sd35m" || a == "cascade-c" ||
         a == "cascade-c-lite";
}

namespace {

// The architecture built on the meta device, once per (name, tiny).
std::shared_ptr<torch::nn::Module> meta_model(const std::string& name, bool tiny) {
  static std::mutex mutex;
  static std::map<std::pair<std::string, bool>, std::shared_ptr<torch::nn::Module>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto& m = cache[{name, tiny}];
  if (!m) m = models::build_architecture(name, nn::LayerInit{torch::kMeta}, tiny);
  return m;
}

// Traces the config's model for one micro-batch into `tracer`.
void trace_model(ModelTracer& tracer, const TrainConfig& c, torch::nn::Module* real) {
  const int64_t B = c.train_batch_size;
  if (real == nullptr) {
    tracer.build(B);
  } else if (auto* u = dynamic_cast<models::LdmUNetImpl*>(real)) {
    tracer.build_ldm(*u, B, c.resolution);
  } else if (auto* m = dynamic_cast<models::MMDiTImpl*>(real)) {
    tracer.build_mmdit(*m, B, c.resolution);
  } else if (auto* s = dynamic_cast<models::StageCImpl*>(real)) {
    tracer.build_stage_c(*s, B, c.resolution);
  } else {
    fail("plan: architecture '{}' is not modelled", c.architecture);
  }
}

}  // namespace

MemoryPlan plan_memory(const TrainConfig& c, int64_t vocab_size) {
  if (!planner_knows(c.architecture)) {
    fail("plan: architecture '{}' is not known to the planner (known: tiny-unet, sd15, sdxl, ssd1b, sd35m, "
         "cascade-c, cascade-c-lite)",
         c.architecture);
  }
  if (c.architecture == "tiny-unet" && vocab_size < 1) fail("plan: vocab_size must be >= 1 (got {})", vocab_size);
  if (!c.network_module.empty() && c.architecture == "tiny-unet") {
    fail("plan: LoRA training (network_module = \"{}\") of tiny-unet is not modelled by the planner; it plans "
         "LoRA on the released architectures only",
         c.network_module);
  }
  std::shared_ptr<torch::nn::Module> real;
  if (c.architecture == "tiny-unet") {
    if (c.text_dim % c.num_heads != 0) fail("plan: text_dim {} not divisible by num_heads {}", c.text_dim, c.num_heads);
    const int64_t factor = int64_t{1} << (c.channel_mult.size() - 1);
    if (c.resolution % factor != 0) fail("plan: resolution {} must be divisible by {}", c.resolution, factor);
  } else {
    real = meta_model(c.architecture, c.tiny);
    if (auto* u = dynamic_cast<models::LdmUNetImpl*>(real.get())) {
      const int64_t factor = int64_t{1} << (u->options().channel_mult().size() - 1);
      const int64_t side = denoiser_inputs(c.architecture, c.resolution).latent_side;
      if (c.resolution % 8 != 0 || side % factor != 0) {
        fail("plan: {} needs a resolution divisible by {} (latents of resolution / 8 divisible by {}), got {}",
             c.architecture, 8 * factor, factor, c.resolution);
      }
    }
  }

  ModelTracer tracer(c, vocab_size);
  trace_model(tracer, c, real.get());
  int64_t frozen_parameters = 0, lora_elem = 0;
  if (real) {
    // Every parameter of the real model, not only those the trace names.
    tracer.param_shapes.clear();
    for (const auto& p : real->parameters()) tracer.param_shapes.push_back(p.sizes().vec());
  }
  if (real && !c.network_module.empty()) {
    // LoRA: the adapters the trainer would attach, on a fresh meta model
    // (nothing allocated); they are the trainable parameters.
    frozen_parameters = tracer.parameters();
    auto model = models::build_architecture(c.architecture, nn::LayerInit{torch::kMeta}, c.tiny);
    nn::LoraNetwork network(*model, std::vector<nn::LoraComponent>{{"lora_unet", ""}}, lora_options(c));
    tracer.param_shapes.clear();
    for (const auto& p : network->parameters()) tracer.param_shapes.push_back(p.sizes().vec());
    lora_elem = c.full_bf16 ? 2 : 4;
  }
  MemoryPlan p;
  p.parameters = tracer.parameters();
  if (real) {
    p.notes.push_back("the denoiser only: latents and text-encoder outputs are assumed cached (the VAE and text "
                      "encoders are not resident), inputs as bench/model_step feeds them");
    if (!(c.full_bf16 || c.full_fp16) && c.mixed_precision != "no") {
      p.notes.push_back("autocast (fp32 weights with mixed_precision) is approximated for real architectures");
    }
  }
  const int64_t weight_elem = (c.full_bf16 || c.full_fp16) ? 2 : 4;
  if (!c.precision_rules.empty()) {
    p.notes.push_back("per-module [[precision.rule]] entries are not modelled: the plan uses the config-wide "
                      "precision (full_bf16 / full_fp16 / mixed_precision / gradient_checkpointing)");
  }
  p.weights_bytes = frozen_parameters > 0 ? frozen_parameters * weight_elem + p.parameters * lora_elem
                                         : p.parameters * weight_elem;
  if (frozen_parameters > 0) {
    p.notes.push_back(fmt::format(
        "LoRA: {} adapter parameters train, {} base parameters frozen; activations are planned as for full "
        "training (a frozen layer's input is counted as saved), so the plan errs high",
        p.parameters, frozen_parameters));
  }
  if (real) {
    // Buffers stored with the weights (MMDiT's pos_embed: 226M elements at full size).
    for (const auto& b : real->buffers()) p.weights_bytes += b.numel() * weight_elem;
  }
  int64_t state = 0, scratch = 0, largest = 0, largest_state = 0;
  for (const auto& s : tracer.param_shapes) {
    StateModel m = optimizer_state_for(c, s);
    state += m.state;
    scratch = std::max(scratch, m.scratch);
    largest = std::max(largest, numel_of(s));
    largest_state = std::max(largest_state, m.state);
  }
  p.largest_parameter = largest;
  p.ema_bytes = c.ema_decay > 0 ? p.parameters * 4 : 0;
  const int64_t device_state = c.offload_optimizer_state ? 0 : state;
  p.host_bytes = c.offload_optimizer_state ? state : 0;
  p.optimizer_state_bytes = device_state + p.ema_bytes;

  // Per-update scratch: fp32 copy of a bf16 gradient (fused: accumulator
  // finish; clipped non-fused step: g.to(fp32) * scale), the optimizer's own,
  // offload staging (a device copy of one parameter's state).
  const int64_t grad_elem = weight_elem;
  const int64_t staging = c.offload_optimizer_state ? largest_state : 0;
  const int64_t accum = c.gradient_accumulation_steps;

  TraceOptions to;
  to.fused = c.fused_backward_pass;
  // Fused update of one parameter: fp32 copy of a bf16 gradient + the
  // optimizer's scratch (per gradient byte, taken at the largest parameter).
  if (to.fused) {
    const double per_byte = (grad_elem == 2 ? 2.0 : 0.0) +
                            (largest > 0 ? static_cast<double>(scratch + staging) / (largest * grad_elem) : 0.0);
    to.fused_transient_per_grad_byte = per_byte;
  }
  TraceResult tr = tracer.trace.simulate(to);
  p.activation_bytes = tr.forward_kept;
  if (c.gradient_checkpointing) {
    TrainConfig off = c;
    off.gradient_checkpointing = false;
    ModelTracer t2(off, vocab_size);
    trace_model(t2, off, real.get());
    p.checkpointing_saving_bytes = t2.trace.simulate(to).forward_kept - tr.forward_kept;
  }

  // Gradient-accumulation buffers alive through the step (gradients).
  int64_t accum_buffers = 0;
  if (accum > 1) {
    const bool sr16 = c.gradient_accumulation_dtype == "bf16_sr" && weight_elem == 2;
    if (c.fused_backward_pass || weight_elem == 2) accum_buffers = p.parameters * (sr16 ? 2 : 4);
  }

  Bytes persistent{};
  persistent[kW] = p.weights_bytes;
  persistent[kS] = p.optimizer_state_bytes;
  persistent[kG] = accum_buffers;
  // LoRA without fusion: the adapters' gradients (not in the trace, whose
  // base layers are frozen), counted from the start of backward (errs high).
  if (frozen_parameters > 0 && !c.fused_backward_pass) persistent[kG] += p.parameters * lora_elem;

  // Phase A: forward + backward of a micro-batch.
  Bytes a = tr.at_peak;
  for (int k = 0; k < kNumMemoryCategories; ++k) a[k] += persistent[k];
  int64_t peak_a = 0;
  for (int64_t v : a) peak_a += v;

  // Phase B (not fused): every gradient present; the norm, then per
  // parameter: clipped fp32 copy, optimizer scratch, staging; EMA update's
  // fp32 copy of a bf16 weight.
  Bytes b = persistent;
  int64_t peak_b = 0;
  if (!c.fused_backward_pass) {
    const bool accumulator = accum > 1 && weight_elem == 2;
    if (accumulator) {
      // .grad is folded into the accumulation buffers after every
      // micro-batch; the step reads the buffers (bf16_sr: as fp32 copies).
      if (c.gradient_accumulation_dtype == "bf16_sr") b[kT] += p.parameters * 4;
    } else {
      b[kG] += tr.gradients_after;
    }
    const int64_t norm_tmp = largest * (grad_elem == 2 ? 8 : 4);
    const int64_t step_tmp = largest * 4 + scratch + staging;
    const int64_t ema_tmp = (p.ema_bytes > 0 && weight_elem == 2) ? largest * 4 : 0;
    b[kT] += std::max({norm_tmp, step_tmp, ema_tmp});
    for (int64_t v : b) peak_b += v;
  }
  if (peak_a >= peak_b) {
    p.predicted_peak_bytes = peak_a;
    p.at_peak = a;
    p.peak_phase = tr.peak_op;
  } else {
    p.predicted_peak_bytes = peak_b;
    p.at_peak = b;
    p.peak_phase = "optimizer step";
  }
  // Step 1: no optimizer state before the update; it exists in full at the
  // end of the step's updates.
  p.first_step_peak_bytes = std::max(peak_a - device_state, peak_b);
  if (c.fused_backward_pass) {
    p.first_step_peak_bytes = std::max(peak_a - device_state,
                                       persistent[kW] + persistent[kS] + persistent[kG] +
                                           tr.at_peak[kA] / 8);  // rough tail of backward
    p.first_step_peak_bytes = std::min(p.first_step_peak_bytes, peak_a);
  }
  return p;
}

int64_t parse_byte_size(const std::string& text) {
  std::string s;
  for (char ch : text) {
    if (!std::isspace(static_cast<unsigned char>(ch))) s += ch;
  }
  size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(s, &pos);
  } catch (const std::exception&) {
    fail("'{}' is not a memory size (expected e.g. 8GiB, 512MiB, 1.5G, 2e9)", text);
  }
  std::string unit = s.substr(pos);
  for (auto& ch : unit) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  double mult = 1;
  if (unit.empty() || unit == "b") mult = 1;
  else if (unit == "k" || unit == "kib" || unit == "kb") mult = 1024.0;
  else if (unit == "m" || unit == "mib" || unit == "mb") mult = 1024.0 * 1024;
  else if (unit == "g" || unit == "gib" || unit == "gb") mult = 1024.0 * 1024 * 1024;
  else if (unit == "t" || unit == "tib" || unit == "tb") mult = 1024.0 * 1024 * 1024 * 1024;
  else fail("'{}': unknown unit '{}' (use B, KiB, MiB, GiB or TiB)", text, unit);
  if (!(v > 0) || !std::isfinite(v * mult)) fail("'{}' is not a positive memory size", text);
  if (v * mult >= 9.0e18) fail("'{}' is too large (at most 8 EiB)", text);
  return static_cast<int64_t>(v * mult);
}

Advice advise(const TrainConfig& config, int64_t vocab_size, int64_t budget) {
  Advice advice;
  MemoryPlan base = plan_memory(config, vocab_size);
  if (base.predicted_peak_bytes <= budget) {
    advice.fits_already = true;
    advice.found = true;
    advice.best.plan = base;
    advice.best.cost = "none";
    return advice;
  }
  // Switches, in the order of expected speed cost (factor on time per image).
  struct Switch {
    const char* line;
    double slowdown;
    const char* cost;
    std::function<bool(const TrainConfig&)> applicable;
    std::function<void(TrainConfig&)> apply;
  };
  std::vector<Switch> switches = {
      {"fused_backward_pass = true", 1.0, "fused backward: about free",
       [](const TrainConfig& c) { return !c.fused_backward_pass; },
       [](TrainConfig& c) { c.fused_backward_pass = true; }},
      {"optimizer_type = \"AdamW8bit\"", 1.02, "8-bit AdamW state: ~2% slower steps",
       [](const TrainConfig& c) { return c.optimizer_type == "AdamW" || c.optimizer_type == "Compass"; },
       [](TrainConfig& c) {
         c.optimizer_type = "AdamW8bit";
         c.optimizer_args.erase(std::remove_if(c.optimizer_args.begin(), c.optimizer_args.end(),
                                               [](const std::string& a) {
                                                 return a.rfind("weight_decay", 0) != 0 && a.rfind("betas", 0) != 0 &&
                                                        a.rfind("eps", 0) != 0;
                                               }),
                                c.optimizer_args.end());
       }},
      {"optimizer_type = \"Adafactor\"", 1.03, "Adafactor factored state: ~3% slower, different dynamics",
       [](const TrainConfig& c) { return c.optimizer_type != "Adafactor"; },
       [](TrainConfig& c) {
         c.optimizer_type = "Adafactor";
         c.optimizer_args.clear();
       }},
      {"optimizer_state_dtype = \"bf16\"", 1.0, "bf16 optimizer state (stochastic rounding): about free",
       [](const TrainConfig& c) { return c.optimizer_state_dtype != "bf16"; },
       [](TrainConfig& c) { c.optimizer_state_dtype = "bf16"; }},
      {"full_bf16 = true", 1.0, "bf16 weights with stochastic rounding: faster on bf16 hardware",
       [](const TrainConfig& c) { return !c.full_bf16 && !c.full_fp16; }, [](TrainConfig& c) { c.full_bf16 = true; }},
      {"attention_chunk_mib = 16", 1.05, "chunked attention: ~5% on attention layers",
       [](const TrainConfig& c) { return c.attention_chunk_mib == 0 || c.attention_chunk_mib > 16; },
       [](TrainConfig& c) { c.attention_chunk_mib = 16; }},
      {"offload_optimizer_state = true", 1.15, "optimizer state offload: two PCIe transfers of the state per step",
       [](const TrainConfig& c) { return !c.offload_optimizer_state; },
       [](TrainConfig& c) { c.offload_optimizer_state = true; }},
      {"gradient_checkpointing = true", 1.3, "gradient checkpointing: ~30% more compute (one extra forward)",
       [](const TrainConfig& c) { return !c.gradient_checkpointing; },
       [](TrainConfig& c) { c.gradient_checkpointing = true; }},
  };
  // Optimizer choices are exclusive: AdamW8bit xor Adafactor.
  std::vector<size_t> usable;
  for (size_t i = 0; i < switches.size(); ++i) {
    if (switches[i].applicable(config)) usable.push_back(i);
  }
  // Batch splits keeping images per step: batch / k with accumulation * k.
  std::vector<int64_t> splits{1};
  for (int64_t k = 2; k <= config.train_batch_size; k *= 2) {
    if (config.train_batch_size % k == 0) splits.push_back(k);
  }
  bool have = false;
  Proposal best, smallest;
  int64_t smallest_peak = INT64_MAX;
  const size_t n = usable.size();
  for (size_t mask = 0; mask < (size_t{1} << n); ++mask) {
    bool both_opt = false;
    {
      int opts = 0;
      for (size_t i = 0; i < n; ++i) {
        if ((mask >> i & 1) && std::string(switches[usable[i]].line).rfind("optimizer_type", 0) == 0) ++opts;
      }
      both_opt = opts > 1;
    }
    if (both_opt) continue;
    for (int64_t k : splits) {
      TrainConfig c = config;
      Proposal prop;
      prop.slowdown = 1.0;
      for (size_t i = 0; i < n; ++i) {
        if (!(mask >> i & 1)) continue;
        const Switch& s = switches[usable[i]];
        s.apply(c);
        prop.config_lines.push_back(s.line);
        prop.slowdown *= s.slowdown;
        prop.cost += (prop.cost.empty() ? "" : "; ") + std::string(s.cost);
      }
      if (k > 1) {
        c.train_batch_size = config.train_batch_size / k;
        c.gradient_accumulation_steps = config.gradient_accumulation_steps * k;
        prop.config_lines.push_back(fmt::format("train_batch_size = {}", c.train_batch_size));
        prop.config_lines.push_back(fmt::format("gradient_accumulation_steps = {}", c.gradient_accumulation_steps));
        // Smaller micro-batches use the hardware less well: ~10% per halving.
        prop.slowdown *= std::pow(1.1, std::log2(static_cast<double>(k)));
        prop.cost += (prop.cost.empty() ? "" : "; ") +
                     fmt::format("batch {} x {} accumulation steps: smaller matrices, ~{}% slower", c.train_batch_size,
                                 c.gradient_accumulation_steps,
                                 static_cast<int>(std::round((std::pow(1.1, std::log2(static_cast<double>(k))) - 1) * 100)));
      }
      if (!prop.config_lines.empty() && c.optimizer_type != config.optimizer_type) {
        // Show the arguments that go with a new optimizer.
        prop.config_lines.push_back(fmt::format("optimizer_args = [{}]", [&] {
          std::string s;
          for (const auto& a : c.optimizer_args) s += (s.empty() ? "\"" : ", \"") + a + "\"";
          return s;
        }()));
      }
      prop.plan = plan_memory(c, vocab_size);
      if (prop.plan.predicted_peak_bytes < smallest_peak) {
        smallest_peak = prop.plan.predicted_peak_bytes;
        smallest = prop;
      }
      if (prop.plan.predicted_peak_bytes <= budget) {
        const bool better = !have || prop.slowdown < best.slowdown - 1e-9 ||
                            (std::abs(prop.slowdown - best.slowdown) < 1e-9 &&
                             (prop.config_lines.size() < best.config_lines.size() ||
                              (prop.config_lines.size() == best.config_lines.size() &&
                               prop.plan.predicted_peak_bytes < best.plan.predicted_peak_bytes)));
        if (better) {
          best = prop;
          have = true;
        }
      }
    }
  }
  advice.found = have;
  if (have) {
    advice.best = best;
  } else {
    advice.best = smallest;
    const MemoryPlan& f = smallest.plan;
    advice.floor_reason = fmt::format(
        "the smallest configuration found needs {} (weights {}, optimizer state + EMA {}, activations of one "
        "image {} at batch {}, gradients {}, temporaries {}); lower the resolution or the model size, or drop EMA "
        "(ema_decay = 0, {})",
        fmt_bytes(f.predicted_peak_bytes), fmt_bytes(f.at_peak[kW]), fmt_bytes(f.at_peak[kS]),
        fmt_bytes(f.at_peak[kA]), 1, fmt_bytes(f.at_peak[kG]), fmt_bytes(f.at_peak[kT]), fmt_bytes(f.ema_bytes));
  }
  return advice;
}

}  // namespace shoestring::plan
