// The blocks of the memory-trace op vocabulary (nn/memory_trace.h): ResBlock,
// feed-forwards, attention and SpatialTransformer, as nn/ implements them.
#include <fmt/format.h>

#include "shoestring/nn/chunked_attention.h"
#include "shoestring/nn/memory_trace.h"
#include "shoestring/nn/resblock.h"

namespace shoestring::nn {

Sym MemoryTracer::res_block(const Sym& x, int64_t out, const Sym& temb, int64_t max_groups, bool scale_shift) {
  const int64_t cin = x.shape[1];
  Sym h = group_norm(x, cin, norm_groups(cin, max_groups));
  h = unary(h, "silu");
  h = conv(h, out, 3, 1);
  Sym te = unary(temb, "silu");
  if (scale_shift) {
    te = linear(te, 2 * out, true);
    const std::vector<int64_t> half = {te.shape[0], out};
    const std::vector<Sym> parts = split(te, {half, half});
    h = group_norm(h, out, norm_groups(out, max_groups));
    h = mul(h, scalar_op(parts[0], "1 + scale"));
    h = add_bcast(h, parts[1], "shift");
  } else {
    te = linear(te, out, true);
    h = add(h, te, "add temb");
    h = group_norm(h, out, norm_groups(out, max_groups));
  }
  h = unary(h, "silu");
  h = conv(h, out, 3, 1);
  Sym sc = cin != out ? conv(x, out, 1, 1) : x;
  return add(sc, h, "residual");
}

Sym MemoryTracer::feed_forward_gelu(const Sym& x, int64_t mult) {
  const int64_t dim = x.shape.back();
  Sym h = unary(linear(x, mult * dim, true), "gelu");
  return linear(h, dim, true);
}

Sym MemoryTracer::feed_forward_geglu(const Sym& x, int64_t mult) {
  const int64_t dim = x.shape.back(), inner = mult * dim;
  Sym h = linear(x, 2 * inner, true);
  std::vector<int64_t> half = h.shape;
  half.back() = inner;
  // chunk: two views of h; backward concatenates their gradients (new).
  Sym a{sim.alias(h.id, numel_of(half) * h.elem), half, h.elem, h.rg};
  Sym g{sim.alias(h.id, numel_of(half) * h.elem), half, h.elem, h.rg};
  TraceOp ch;
  ch.name = "chunk";
  ch.inputs = {h.id};
  ch.outputs = {a.id, g.id};
  ch.grad_inputs = {h.id};
  sim.op(ch);
  Sym gl = unary(g, "gelu");
  Sym m = mul(a, gl);
  return linear(m, dim, true);
}

Sym MemoryTracer::sdpa(const Sym& q4, const Sym& k4, const Sym& v4, int64_t Lq, const SdpaStyle& st) {
  const int64_t B = q4.shape[0], Hkv = q4.shape[1], R = q4.shape[2], d = q4.shape[3], Lk = k4.shape[2];
  const int elem = q4.elem;
  const bool rg = q4.rg || k4.rg || v4.rg;
  const int64_t block = st.chunkable ? attention_block_rows(B, Hkv, R, Lk, elem, p_.attention_chunk_bytes) : 0;
  if (block != 0) {
    Sym o = make({B, Hkv, R, d}, elem, rg);
    const int64_t blk = B * Hkv * block * Lk * elem;
    TraceOp ca;
    ca.name = fmt::format("chunked attention {}x{} (blocks of {})", R, Lk, block);
    ca.inputs = {q4.id, k4.id, v4.id};
    ca.outputs = {o.id};
    ca.saved = {q4.id, k4.id, v4.id, o.id};
    ca.grad_inputs = {q4.id, k4.id, v4.id};
    ca.forward_transient = 3 * blk;
    ca.backward_transient = 3 * blk + 2 * B * Hkv * Lk * d * 4 + B * Hkv * R * 4;  // dK, dV accumulate in fp32
    emit(ca, o);
    return o;
  }
  // matmul's batched reshape copies a permuted operand (not viewable).
  Sym qc = (Hkv > 1 && Lq > 1) ? copy(q4, q4.shape, "bmm q copy") : q4;
  Sym kc = (Hkv > 1 && Lk > 1) ? copy(k4, {B, Hkv, d, Lk}, "bmm k copy") : k4;
  Sym s = make({B, Hkv, R, Lk}, elem, rg);
  TraceOp qk;
  qk.name = fmt::format("bmm scores {}x{}", R, Lk);
  qk.inputs = {qc.id, kc.id};
  qk.outputs = {s.id};
  qk.saved = {qc.id, kc.id};
  qk.grad_inputs = {qc.id, kc.id};
  emit(qk, s);
  if (st.scale_op) s = scalar_op(s, "scale scores");
  if (st.masked) s = scalar_op(s, "masked_fill");
  Sym p;
  if (st.softmax_fp32 && elem != 4) {
    Sym s32 = cast(s, 4);
    p = make(s.shape, 4, rg);
    TraceOp sm;
    sm.name = fmt::format("softmax fp32 {}x{}", R, Lk);
    sm.inputs = {s32.id};
    sm.outputs = {p.id};
    sm.saved = {p.id};
    sm.grad_inputs = {s32.id};
    emit(sm, p);
    p = cast(p, elem);
  } else {
    p = make(s.shape, elem, rg);
    TraceOp sm;
    sm.name = fmt::format("softmax {}x{}", R, Lk);
    sm.inputs = {s.id};
    sm.outputs = {p.id};
    sm.saved = {p.id};
    sm.grad_inputs = {s.id};
    emit(sm, p);
  }
  p = dropout(p, st.dropout);
  Sym vc = (Hkv > 1 && Lk > 1) ? copy(v4, v4.shape, "bmm v copy") : v4;
  Sym o = make({B, Hkv, R, d}, elem, rg);
  TraceOp pv;
  pv.name = "bmm probs v";
  pv.inputs = {p.id, vc.id};
  pv.outputs = {o.id};
  pv.saved = {p.id, vc.id};
  pv.grad_inputs = {p.id, vc.id};
  emit(pv, o);
  return o;
}

Sym MemoryTracer::merge_heads(const Sym& o, int64_t Lq, int64_t H) {
  const int64_t B = o.shape[0], inner = o.numel() / (B * Lq);
  return (H > 1 && Lq > 1) ? copy(o, {B, Lq, inner}, "heads merge copy") : view(o, {B, Lq, inner});
}

Sym MemoryTracer::attention(const Sym& x, const Sym& kv, bool masked, int64_t H, int64_t Hkv, int64_t d,
                            int64_t query_dim) {
  const int64_t B = x.shape[0], Lq = x.shape[1], Lk = kv.shape[1], G = H / Hkv, R = G * Lq;
  const int64_t inner = H * d, kv_inner = Hkv * d;
  Sym q = linear(x, inner, false, /*scaled_weight=*/true);
  Sym k = linear(kv, kv_inner, false);
  Sym v = linear(kv, kv_inner, false);
  Sym q4 = G > 1 ? copy(q, {B, Hkv, R, d}, "gqa q copy") : view(q, {B, Hkv, R, d});
  Sym k4 = view(k, {B, Hkv, Lk, d});
  Sym v4 = view(v, {B, Hkv, Lk, d});
  SdpaStyle st;
  st.masked = masked;
  Sym o = sdpa(q4, k4, v4, Lq, st);
  return linear(merge_heads(o, Lq, H), query_dim, true);
}

Sym MemoryTracer::spatial_transformer(const Sym& x, const Sym& context, bool masked, const SpatialTransformerShape& sp,
                                      bool checkpoint_blocks) {
  const int64_t B = x.shape[0], C = x.shape[1], H = x.shape[2], W = x.shape[3];
  Sym h = group_norm(x, C, norm_groups(C, sp.groups));
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
      Sym y = add(h, attention(n1, n1, false, sp.heads, sp.heads, sp.head_dim, C), "attn1 residual");
      Sym n2 = layer_norm(y);
      y = add(y, attention(n2, context, masked, sp.heads, sp.heads, sp.head_dim, C), "attn2 residual");
      Sym n3 = layer_norm(y);
      return add(y, sp.gated ? feed_forward_geglu(n3, sp.ff_mult) : feed_forward_gelu(n3, sp.ff_mult), "ff residual");
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

}  // namespace shoestring::nn
