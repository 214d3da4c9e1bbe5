#include "shoestring/plan/memory_plan.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <functional>

#include "shoestring/core/error.h"
#include "shoestring/nn/chunked_attention.h"
#include "shoestring/nn/resblock.h"
#include "shoestring/optim/adafactor.h"
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
        h = res_block(h, out, temb);
        ch = out;
        if (has_attn[l]) h = spatial_transformer(h, context, mask);
        skips.push_back(h);
      }
      if (l + 1 < levels) {
        h = conv(h, ch, 3, 2);
        skips.push_back(h);
      }
    }
    h = res_block(h, ch, temb);
    h = spatial_transformer(h, context, mask);
    h = res_block(h, ch, temb);
    for (int64_t l = levels - 1; l >= 0; --l) {
      const int64_t out = base * mult[l];
      for (int64_t i = 0; i <= c_.num_res_blocks; ++i) {
        Sym skip = skips.back();
        skips.pop_back();
        h = cat(h, skip);
        h = res_block(h, out, temb);
        ch = out;
        if (has_attn[l]) h = spatial_transformer(h, context, mask);
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
    // Loss: v.to(fp32), mse_loss saves both operands.
    if (h.elem != 4) h = cast(h, 4);
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
  int64_t param_grad_bytes(const std::vector<int64_t>& shape) const { return numel_of(shape) * grad_elem(); }

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

  Sym conv(const Sym& x_in, int64_t cout, int64_t k, int64_t stride) {
    Sym x = mm_input(x_in);
    const int64_t B = x.shape[0], cin = x.shape[1], H = x.shape[2], W = x.shape[3];
    const int64_t pad = k / 2;
    const int64_t Ho = (H + 2 * pad - k) / stride + 1, Wo = (W + 2 * pad - k) / stride + 1;
    Sym y = make({B, cout, Ho, Wo}, compute_elem_, true);
    std::vector<int64_t> w{cout, cin, k, k}, b{cout};
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
  Sym norm(const Sym& x_in, int64_t C, int64_t stat_rows, const std::string& name) {
    const int in_elem = x_in.elem;
    Sym x = in_elem == 2 ? cast(x_in, 4) : x_in;
    Sym y = make(x.shape, x.elem, true);
    add_param({C});
    add_param({C});
    TraceOp o;
    o.name = name;
    o.inputs = {x.id};
    o.outputs = {y.id};
    o.saved = {x.id};
    if (x.rg) o.grad_inputs = {x.id};
    o.saved_extra = 2 * stat_rows * 4 + (param_elem_ == 2 ? 2 * C * 4 : 0);
    o.param_grads = {param_grad_bytes({C}), param_grad_bytes({C})};
    trace.op(o);
    return in_elem == 2 ? cast(y, 2) : y;
  }

  Sym layer_norm(const Sym& x) {
    const int64_t d = x.shape.back();
    return norm(x, d, x.numel() / d, "layer_norm");
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

  Sym mul(const Sym& a, const Sym& b) {
    Sym y = make(a.shape, a.elem, true);
    TraceOp o;
    o.name = "mul";
    o.inputs = {a.id, b.id};
    o.outputs = {y.id};
    o.saved = {a.id, b.id};
    o.grad_inputs = {a.id, b.id};
    trace.op(o);
    return y;
  }

  Sym cat(const Sym& a, const Sym& b) {
    std::vector<int64_t> s = a.shape;
    s[1] += b.shape[1];
    Sym y = make(s, a.elem, true);
    TraceOp o;
    o.name = "cat";
    o.inputs = {a.id, b.id};
    o.outputs = {y.id};
    o.passthrough = true;  // the inputs' gradients are slices (views) of the output's
    o.grad_inputs = {a.id, b.id};
    trace.op(o);
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

  Sym res_block(const Sym& x, int64_t out, const Sym& temb) {
    const int first = trace.next_op_index();
    const int64_t cin = x.shape[1];
    Sym h = group_norm(x, cin, nn::norm_groups(cin, c_.norm_groups), 1e-5);
    h = unary(h, "silu");
    h = conv(h, out, 3, 1);
    Sym te = unary(temb, "silu");
    te = linear(te, out, true);
    h = add(h, te, "add temb");
    h = group_norm(h, out, nn::norm_groups(out, c_.norm_groups), 1e-5);
    h = unary(h, "silu");
    h = conv(h, out, 3, 1);
    Sym sc = cin != out ? conv(x, out, 1, 1) : x;
    Sym y = add(sc, h, "residual");
    if (c_.gradient_checkpointing) trace.segment(first, trace.next_op_index() - 1, {x.id, temb.id});
    return y;
  }

  Sym feed_forward_geglu(const Sym& x) {
    const int64_t dim = x.shape.back(), inner = 4 * dim;
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

  Sym attention(const Sym& x, const Sym& kv, const Sym* mask, int64_t H, int64_t Hkv, int64_t d,
                int64_t query_dim, int64_t context_dim) {
    (void)context_dim;
    (void)mask;
    const int64_t B = x.shape[0], Lq = x.shape[1], Lk = kv.shape[1], G = H / Hkv, R = G * Lq;
    const int64_t inner = H * d, kv_inner = Hkv * d;
    Sym q = linear(x, inner, false, /*scaled_weight=*/true);
    Sym k = linear(kv, kv_inner, false);
    Sym v = linear(kv, kv_inner, false);
    Sym q4 = G > 1 ? copy(q, {B, Hkv, R, d}, "gqa q copy") : view(q, {B, Hkv, R, d});
    Sym k4 = view(k, {B, Hkv, Lk, d});
    Sym v4 = view(v, {B, Hkv, Lk, d});
    const int elem = q.elem;
    const int64_t block = nn::attention_block_rows(B, Hkv, R, Lk, elem, chunk_bytes_);
    Sym o;
    if (block == 0) {
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
      if (mask != nullptr) {
        Sym s2 = make(s.shape, elem, true);
        TraceOp mf;
        mf.name = "masked_fill";
        mf.inputs = {s.id};
        mf.outputs = {s2.id};
        mf.grad_inputs = {s.id};
        trace.op(mf);
        s = s2;
      }
      Sym p = make(s.shape, elem, true);
      TraceOp sm;
      sm.name = fmt::format("softmax {}x{}", R, Lk);
      sm.inputs = {s.id};
      sm.outputs = {p.id};
      sm.saved = {p.id};
      sm.grad_inputs = {s.id};
      trace.op(sm);
      Sym vc = (Hkv > 1 && Lk > 1) ? copy(v4, v4.shape, "bmm v copy") : v4;
      o = make({B, Hkv, R, d}, elem, true);
      TraceOp pv;
      pv.name = "bmm probs v";
      pv.inputs = {p.id, vc.id};
      pv.outputs = {o.id};
      pv.saved = {p.id, vc.id};
      pv.grad_inputs = {p.id, vc.id};
      trace.op(pv);
    } else {
      o = make({B, Hkv, R, d}, elem, true);
      const int64_t blk = B * Hkv * block * Lk * elem;
      const int acc = elem == 4 ? 4 : 4;  // dK, dV accumulate in fp32
      TraceOp ca;
      ca.name = fmt::format("chunked attention {}x{} (blocks of {})", R, Lk, block);
      ca.inputs = {q4.id, k4.id, v4.id};
      ca.outputs = {o.id};
      ca.saved = {q4.id, k4.id, v4.id, o.id};
      ca.grad_inputs = {q4.id, k4.id, v4.id};
      ca.forward_transient = 3 * blk;
      ca.backward_transient = 3 * blk + 2 * B * Hkv * Lk * d * acc + B * Hkv * R * 4;
      trace.op(ca);
    }
    Sym oc = (H > 1 && Lq > 1) ? copy(o, {B, Lq, inner}, "heads merge copy") : view(o, {B, Lq, inner});
    return linear(oc, query_dim, true);
  }

  Sym spatial_transformer(const Sym& x, const Sym& context, const Sym& mask) {
    const int first = trace.next_op_index();
    const int64_t B = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3];
    Sym h = group_norm(x, C, nn::norm_groups(C, c_.norm_groups), 1e-6);
    h = conv(h, C, 1, 1);
    h = view(h, {B, H * W, C});
    const int64_t heads = c_.num_heads, d = C / heads;
    if (C % heads != 0) fail("plan: channels {} not divisible by num_heads {}", C, heads);
    // One TransformerBlock (depth 1).
    Sym n1 = layer_norm(h);
    h = add(h, attention(n1, n1, nullptr, heads, heads, d, C, C), "attn1 residual");
    Sym n2 = layer_norm(h);
    h = add(h, attention(n2, context, &mask, heads, heads, d, C, context.shape[2]), "attn2 residual");
    Sym n3 = layer_norm(h);
    h = add(h, feed_forward_geglu(n3), "ff residual");
    h = view(h, {B, C, H, W});
    h = conv(h, C, 1, 1);
    Sym y = add(x, h, "transformer residual");
    if (c_.gradient_checkpointing) trace.segment(first, trace.next_op_index() - 1, {x.id, context.id});
    return y;
  }

  const TrainConfig& c_;
  int64_t vocab_;
  bool autocast_ = false;
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

MemoryPlan plan_memory(const TrainConfig& c, int64_t vocab_size) {
  if (c.architecture != "tiny-unet") fail("plan: architecture '{}' is not known to the planner", c.architecture);
  if (vocab_size < 1) fail("plan: vocab_size must be >= 1 (got {})", vocab_size);
  if (!c.network_module.empty()) {
    fail("plan: LoRA training (network_module = \"{}\") is not modelled by the planner yet", c.network_module);
  }
  if (c.text_dim % c.num_heads != 0) fail("plan: text_dim {} not divisible by num_heads {}", c.text_dim, c.num_heads);
  const int64_t factor = int64_t{1} << (c.channel_mult.size() - 1);
  if (c.resolution % factor != 0) fail("plan: resolution {} must be divisible by {}", c.resolution, factor);

  ModelTracer tracer(c, vocab_size);
  tracer.build(c.train_batch_size);
  MemoryPlan p;
  p.parameters = tracer.parameters();
  const int64_t weight_elem = (c.full_bf16 || c.full_fp16) ? 2 : 4;
  if (!c.precision_rules.empty()) {
    p.notes.push_back("per-module [[precision.rule]] entries are not modelled: the plan uses the config-wide "
                      "precision (full_bf16 / full_fp16 / mixed_precision / gradient_checkpointing)");
  }
  p.weights_bytes = p.parameters * weight_elem;
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
    t2.build(c.train_batch_size);
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
