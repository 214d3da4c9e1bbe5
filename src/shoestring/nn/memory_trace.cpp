#include "shoestring/nn/memory_trace.h"

#include <algorithm>

#include <fmt/format.h>

namespace shoestring::nn {

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

int64_t MemoryTracer::parameters() const {
  int64_t n = 0;
  for (const auto& s : param_shapes) n += numel_of(s);
  return n;
}

Sym MemoryTracer::input(std::vector<int64_t> shape, int elem) {
  Sym s{-1, std::move(shape), elem, false};
  s.id = sim.tensor(s.bytes(), true);
  return s;
}

Sym MemoryTracer::make(std::vector<int64_t> shape, int elem, bool rg) {
  Sym s{-1, std::move(shape), elem, rg};
  s.id = sim.tensor(s.bytes());
  return s;
}

void MemoryTracer::op(const std::string& name, const std::vector<Sym>& in, const std::vector<Sym>& out) {
  TraceOp o;
  o.name = name;
  for (const auto& s : in) o.inputs.push_back(s.id);
  for (const auto& s : out) o.outputs.push_back(s.id);
  sim.op(o);
}

int64_t MemoryTracer::param_grad_bytes(const std::vector<int64_t>& shape) const {
  if (p_.frozen) return 0;
  const int64_t bytes = numel_of(shape) * grad_elem();
  return p_.trainable >= 1.0 ? bytes : static_cast<int64_t>(static_cast<double>(bytes) * p_.trainable);
}

void MemoryTracer::emit(TraceOp& o, const Sym& out) {
  if (!out.rg) {
    o.saved.clear();
    o.saved_extra = 0;
    o.backward_transient = 0;
    o.param_grads.clear();
    o.grad_inputs.clear();
  }
  sim.op(o);
}

std::vector<Sym> MemoryTracer::block(const torch::nn::Module* m, const std::vector<Sym>& inputs, bool legacy_checkpoint,
                                     const std::function<std::vector<Sym>(const std::vector<Sym>&)>& f) {
  const TracePrecision* s = lookup_ ? lookup_(m) : nullptr;
  std::vector<int> ids;
  if (s == nullptr) {
    for (const Sym& x : inputs) ids.push_back(x.id);
    const int first = sim.next_op_index();
    std::vector<Sym> out = f(inputs);
    if (legacy_checkpoint && sim.next_op_index() > first) sim.segment(first, sim.next_op_index() - 1, ids);
    return out;
  }
  const TracePrecision caller = p_;
  p_ = *s;
  p_.attention_chunk_bytes = caller.attention_chunk_bytes;
  // run_block: floating inputs to the block's compute dtype.
  std::vector<Sym> in;
  for (const Sym& x : inputs) {
    const bool floating = x.elem == 2 || x.elem == 4;
    in.push_back(floating && x.elem != p_.compute_elem ? cast(x, p_.compute_elem) : x);
    ids.push_back(in.back().id);
  }
  const int first = sim.next_op_index();
  std::vector<Sym> out = f(in);
  if (p_.checkpoint && sim.next_op_index() > first) sim.segment(first, sim.next_op_index() - 1, ids);
  if (p_.emulate_fp16) {
    for (Sym& y : out) {
      if (y.elem == 4) y = cast(cast(y, 2), 4);
    }
  }
  p_ = caller;
  return out;
}

Sym MemoryTracer::cast(const Sym& x, int elem) {
  Sym y = make(x.shape, elem, x.rg);
  TraceOp o;
  o.name = "cast";
  o.inputs = {x.id};
  o.outputs = {y.id};
  if (x.rg) o.grad_inputs = {x.id};
  sim.op(o);
  return y;
}

Sym MemoryTracer::copy(const Sym& x, std::vector<int64_t> shape, const std::string& name) {
  Sym y = make(std::move(shape), x.elem, x.rg);
  TraceOp o;
  o.name = name;
  o.inputs = {x.id};
  o.outputs = {y.id};
  o.passthrough = true;
  if (x.rg) o.grad_inputs = {x.id};
  sim.op(o);
  return y;
}

Sym MemoryTracer::view(const Sym& x, std::vector<int64_t> shape) {
  Sym y{sim.alias(x.id, numel_of(shape) * x.elem), std::move(shape), x.elem, x.rg};
  TraceOp o;
  o.name = "view";
  o.inputs = {x.id};
  o.outputs = {y.id};
  o.passthrough = true;
  if (x.rg) o.grad_inputs = {x.id};
  sim.op(o);
  return y;
}

Sym MemoryTracer::unary(const Sym& x, const std::string& name) {
  Sym y = make(x.shape, x.elem, x.rg);
  TraceOp o;
  o.name = name;
  o.inputs = {x.id};
  o.outputs = {y.id};
  o.saved = {x.id};
  if (x.rg) o.grad_inputs = {x.id};
  emit(o, y);
  return y;
}

Sym MemoryTracer::add(const Sym& a, const Sym& b, const std::string& name) {
  Sym y = make(a.shape, a.elem, a.rg || b.rg);
  TraceOp o;
  o.name = name;
  o.inputs = {a.id, b.id};
  o.outputs = {y.id};
  o.passthrough = true;
  if (a.rg) o.grad_inputs.push_back(a.id);
  if (b.rg && b.id != a.id) o.grad_inputs.push_back(b.id);
  sim.op(o);
  return y;
}

Sym MemoryTracer::mul(const Sym& a, const Sym& b) {
  Sym y = make(a.shape, std::max(a.elem, b.elem), a.rg || b.rg);
  TraceOp o;
  o.name = "mul";
  o.inputs = {a.id, b.id};
  o.outputs = {y.id};
  o.saved = {a.id, b.id};
  if (a.rg) o.grad_inputs.push_back(a.id);
  if (b.rg) o.grad_inputs.push_back(b.id);
  if (b.rg && b.numel() < a.numel()) o.backward_transient = y.bytes();
  emit(o, y);
  return y;
}

Sym MemoryTracer::add_bcast(const Sym& a, const Sym& b, const std::string& name) {
  Sym y = make(a.shape, a.elem, a.rg || b.rg);
  TraceOp o;
  o.name = name;
  o.inputs = {a.id, b.id};
  o.outputs = {y.id};
  o.passthrough = true;
  o.broadcast = true;
  if (a.rg) o.grad_inputs.push_back(a.id);
  if (b.rg) o.grad_inputs.push_back(b.id);
  sim.op(o);
  return y;
}

Sym MemoryTracer::scalar_op(const Sym& x, const std::string& name) {
  Sym y = make(x.shape, x.elem, x.rg);
  TraceOp o;
  o.name = name;
  o.inputs = {x.id};
  o.outputs = {y.id};
  if (x.rg) o.grad_inputs = {x.id};
  sim.op(o);
  return y;
}

Sym MemoryTracer::cat(const std::vector<Sym>& parts) {
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
  sim.op(o);
  return y;
}

std::vector<Sym> MemoryTracer::split(const Sym& x, const std::vector<std::vector<int64_t>>& shapes) {
  std::vector<Sym> out;
  TraceOp o;
  o.name = "split";
  o.inputs = {x.id};
  for (const auto& sh : shapes) {
    out.push_back(Sym{sim.alias(x.id, numel_of(sh) * x.elem), sh, x.elem, x.rg});
    o.outputs.push_back(out.back().id);
  }
  if (x.rg) o.grad_inputs = {x.id};
  sim.op(o);
  return out;
}

Sym MemoryTracer::constant(std::vector<int64_t> shape, int elem, const std::string& name) {
  Sym y = make(std::move(shape), elem, false);
  op(name, {}, {y});
  return y;
}

Sym MemoryTracer::upsample(const Sym& x) {
  Sym y = make({x.shape[0], x.shape[1], x.shape[2] * 2, x.shape[3] * 2}, x.elem, x.rg);
  TraceOp o;
  o.name = "upsample nearest";
  o.inputs = {x.id};
  o.outputs = {y.id};
  o.grad_inputs = {x.id};
  emit(o, y);
  return y;
}

Sym MemoryTracer::dropout(const Sym& x, double p) {
  if (p <= 0) return x;
  return mul(x, constant(x.shape, x.elem, "dropout mask"));
}

Sym MemoryTracer::mm_input(const Sym& x) {
  return p_.autocast && x.elem != p_.compute_elem ? cast(x, p_.compute_elem) : x;
}

void MemoryTracer::weight_cast(TraceOp& o, const std::vector<int64_t>& shape, bool input_needs_grad) {
  if (!p_.autocast) return;
  const int64_t bytes = numel_of(shape) * p_.compute_elem;
  if (p_.fp8_weights) {  // decoded in the op, again in its backward; never saved
    o.forward_transient += bytes;
    if (input_needs_grad || p_.frozen) o.backward_transient += bytes;
    return;
  }
  const int w = sim.tensor(bytes);
  TraceOp c;
  c.name = "autocast weight";
  c.outputs = {w};
  sim.op(c);
  o.inputs.push_back(w);
  // Kept for the input's gradient (LoRA: counted as for a trained layer).
  if (input_needs_grad || p_.frozen) o.saved.push_back(w);
  if (weight_grad()) o.backward_transient += bytes;
}

Sym MemoryTracer::conv(const Sym& x_in, int64_t cout, int64_t k, int64_t stride, int64_t pad, int64_t groups) {
  Sym x = mm_input(x_in);
  const int64_t B = x.shape[0], cin = x.shape[1], H = x.shape[2], W = x.shape[3];
  if (pad < 0) pad = k / 2;
  const int64_t Ho = (H + 2 * pad - k) / stride + 1, Wo = (W + 2 * pad - k) / stride + 1;
  // Under LoRA every layer's output is treated as needing a gradient.
  Sym y = make({B, cout, Ho, Wo}, p_.compute_elem, x.rg || weight_grad() || p_.frozen);
  std::vector<int64_t> w{cout, cin / groups, k, k}, b{cout};
  add_param(w);
  add_param(b);
  TraceOp o;
  o.name = fmt::format("conv{}x{} {}->{} @{}x{}", k, k, cin, cout, Ho, Wo);
  o.inputs = {x.id};
  o.outputs = {y.id};
  // For the weight's gradient; a frozen fp8 conv saves only its bytes (no
  // conv LoRA is modelled on an fp8 base).
  if (weight_grad() || (p_.frozen && !p_.fp8_weights)) o.saved = {x.id};
  if (x.rg) o.grad_inputs = {x.id};
  o.param_grads = {param_grad_bytes(w), param_grad_bytes(b)};
  weight_cast(o, w, x.rg);
  emit(o, y);
  return y;
}

Sym MemoryTracer::linear(const Sym& x_in, int64_t out_f, bool bias, bool scaled_weight) {
  Sym x = mm_input(x_in);
  std::vector<int64_t> shape = x.shape;
  const int64_t in_f = shape.back();
  shape.back() = out_f;
  // Under LoRA every layer's output is treated as needing a gradient.
  Sym y = make(shape, p_.compute_elem, x.rg || weight_grad() || p_.frozen);
  std::vector<int64_t> w{out_f, in_f};
  add_param(w);
  TraceOp o;
  o.name = fmt::format("linear {}->{}", in_f, out_f);
  o.inputs = {x.id};
  o.outputs = {y.id};
  if (weight_grad() || p_.frozen) o.saved = {x.id};  // for the weight's gradient
  if (x.rg) o.grad_inputs = {x.id};
  if (scaled_weight) {
    // attention.cpp: linear(x, to_q.weight * scale): the scaled copy is saved
    // for the input's gradient.
    Sym ws = make(w, p_.compute_elem, weight_grad() || p_.frozen);
    TraceOp s;
    s.name = "scaled q weight";
    s.outputs = {ws.id};
    s.param_grads = {param_grad_bytes(w)};
    sim.op(s);
    o.inputs.push_back(ws.id);
    if (x.rg || p_.frozen) o.saved.push_back(ws.id);
    if (ws.rg) o.grad_inputs.push_back(ws.id);
  } else {
    o.param_grads.push_back(param_grad_bytes(w));
    weight_cast(o, w, x.rg);
  }
  if (bias) {
    add_param({out_f});
    o.param_grads.push_back(param_grad_bytes({out_f}));
  }
  emit(o, y);
  return y;
}

Sym MemoryTracer::norm(const Sym& x_in, int64_t C, int64_t stat_rows, const std::string& name, bool affine,
                       int64_t transient, bool relayout) {
  const int in_elem = x_in.elem;
  const bool copied = in_elem == 2 || relayout;  // to fp32, or to NCHW: a copy that backward undoes
  Sym x = copied ? cast(x_in, 4) : x_in;
  Sym y = make(x.shape, x.elem, x.rg || (affine && weight_grad()) || p_.frozen);
  TraceOp o;
  o.name = name;
  o.inputs = {x.id};
  o.outputs = {y.id};
  o.saved = {x.id};
  if (x.rg) o.grad_inputs = {x.id};
  o.saved_extra = 2 * stat_rows * 4;
  o.forward_transient = transient;
  // Channels-last: the gradient reaches the norm's backward in channels-last
  // layout, and libtorch's contiguous kernel copies it to NCHW first.
  if (relayout) o.backward_transient = x.numel() * 4;
  if (affine) {
    add_param({C});
    add_param({C});
    o.saved_extra += p_.param_elem == 2 ? 2 * C * 4 : 0;
    o.param_grads = {param_grad_bytes({C}), param_grad_bytes({C})};
  }
  emit(o, y);
  return copied ? cast(y, in_elem) : y;
}

Sym MemoryTracer::layer_norm(const Sym& x, bool affine) {
  const int64_t d = x.shape.back();
  return norm(x, d, x.numel() / d, "layer_norm", affine);
}

Sym MemoryTracer::group_norm(const Sym& x, int64_t C, int64_t groups) {
  return norm(x, C, x.shape[0] * groups, fmt::format("group_norm {}", C), /*affine=*/true, /*transient=*/0,
              channels_last_ && x.shape.size() == 4);
}

Sym MemoryTracer::embed_mlp(Sym feats, int64_t hidden, int64_t out) {
  if (p_.compute_elem != 4 && !p_.autocast && feats.elem == 4) feats = cast(feats, p_.compute_elem);
  Sym h = linear(feats, hidden, true);
  h = unary(h, "silu");
  return linear(h, out, true);
}

void MemoryTracer::mse_loss(Sym h, Sym target) {
  if (h.elem != 4) h = cast(h, 4);
  if (target.elem != 4) target = constant(target.shape, 4, "target fp32");
  Sym loss = make({1}, 4, true);
  TraceOp m;
  m.name = "mse_loss";
  m.inputs = {h.id, target.id};
  m.outputs = {loss.id};
  m.saved = {h.id, target.id};
  m.grad_inputs = {h.id};
  sim.op(m);
  sim.keep(loss.id);
}

}  // namespace shoestring::nn
