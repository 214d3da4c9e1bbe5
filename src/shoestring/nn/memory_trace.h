// The op vocabulary of memory traces: what each nn layer's forward does to
// memory, as ops of the memory simulator (nn/memory_simulator.h).
//
// A model's memory trace (models/<model>_trace.cpp, next to the model it
// mirrors) calls these in the order its forward() runs its layers; each call
// creates the symbolic output tensors, records what libtorch 1.13's autograd
// saves for the op (derivatives.yaml): convolution, linear/mm, layer_norm
// and group_norm save their input (norms also mean and rstd), SiLU and GELU
// their input, softmax its output, bmm both operands, mul both factors,
// add / cat / views nothing; matmul's batched reshape of a permuted q, k or
// v makes a contiguous copy, which bmm saves. Parameters are recorded by
// shape (param_shapes) with the bytes of their gradients.
//
// Precision (TracePrecision) sets the element sizes: weights, activations,
// gradients, autocast's bf16 copies of fp32 weights and inputs, frozen
// weights (no gradients), and which blocks are checkpointed.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "shoestring/nn/memory_simulator.h"

namespace shoestring::nn {

/// Product of `shape` (1 for a scalar).
int64_t numel_of(const std::vector<int64_t>& shape);

/// A symbolic tensor: storage id in the simulator, shape, element size in
/// bytes, and whether autograd computes its gradient.
struct Sym {
  int id = -1;
  std::vector<int64_t> shape;
  int elem = 4;
  bool rg = false;
  int64_t numel() const { return numel_of(shape); }
  int64_t bytes() const { return numel() * elem; }
};

/// Element sizes and switches a trace is emitted with: config-wide, or per
/// block and scope as the precision policy resolved them (MemoryTracer::block).
struct TracePrecision {
  /// Weights are cast to compute-dtype copies for matmuls (storage differs
  /// from compute: fp32 weights with bf16 compute, mixed_precision; bf16 or
  /// fp16 weights with fp32 compute), which the ops save for the input's
  /// gradient; matmul inputs of another dtype are cast too.
  bool autocast = false;
  int param_elem = 4;  ///< bytes per weight element (2: bf16 / fp16 / fp8 storage)
  /// Frozen weights stored as fp8 bytes (nn/fp8_storage.h): each matmul
  /// decodes its weight into a scratch copy that lives only while the op (or
  /// its backward) runs; nothing decoded is saved for backward.
  bool fp8_weights = false;
  int compute_elem = 4;  ///< bytes per activation element of matmul-like ops
  /// Base weights frozen under LoRA adapters: no parameter gradients, and
  /// each layer's input counted as saved (its adapter saves it; errs high
  /// for layers without one).
  bool frozen = false;
  /// Fraction of the scope's parameters that train (per-module rules):
  /// parameter gradients are scaled by it; at 0 a layer saves no input for
  /// its weight's gradient and, on inputs that need no gradient, nothing.
  double trainable = 1.0;
  /// Gradient checkpointing: config-wide, of the blocks a model's trace marks
  /// checkpointable; in a block's settings, of that block.
  bool checkpoint = false;
  /// fp16 compute emulated on the CPU (nn/block_precision.h): fp32 math
  /// (compute_elem 4), each block output rounded through fp16.
  bool emulate_fp16 = false;
  /// nn::Attention computes score matrices above this many bytes in query
  /// blocks (nn/chunked_attention.h); 0 = never.
  int64_t attention_chunk_bytes = 0;
};

/// The resolved settings of a declared block or scope (nullptr: none, the
/// module runs as its caller does).
using BlockLookup = std::function<const TracePrecision*(const torch::nn::Module* block)>;

/// Style of a scaled-dot-product attention, per model.
struct SdpaStyle {
  bool scale_op = false;      ///< scores * 1/sqrt(d) as an op (else folded into the query weight)
  bool softmax_fp32 = false;  ///< softmax(scores, dtype fp32).to(compute dtype), as MMDiT and Stage C
  bool masked = false;        ///< masked_fill before the softmax
  double dropout = 0.0;       ///< dropout on the attention weights (training)
  bool chunkable = true;      ///< nn::Attention: chunked (nn/chunked_attention.h) above attention_chunk_bytes
};

/// A SpatialTransformer's shape (nn::TransformerOptions).
struct SpatialTransformerShape {
  int64_t heads = 1, head_dim = 1, depth = 1, ff_mult = 4, groups = 32;
  bool linear_proj = false, gated = true;
};

/// Emits the ops of layers into a MemorySimulator (see the file comment).
/// Shapes are [B, C, H, W] for images and [B, L, D] for tokens; `elem` is
/// bytes per element. Methods throw shoestring::Error only where noted.
class MemoryTracer {
 public:
  explicit MemoryTracer(const TracePrecision& precision) : p_(precision) {}

  MemorySimulator sim;
  /// Shapes of the parameters the trace has created, in order.
  std::vector<std::vector<int64_t>> param_shapes;

  /// The settings in effect (inside block(): the block's).
  const TracePrecision& precision() const { return p_; }
  /// Per-block settings from the resolved precision policy; without it (or
  /// for modules it does not know) block() runs as nn::run_block without a
  /// configured table.
  void set_block_lookup(BlockLookup lookup) { lookup_ = std::move(lookup); }
  /// True when the lookup has settings for `block`.
  bool has_block(const torch::nn::Module* block) const { return lookup_ && lookup_(block) != nullptr; }
  /// Sum of numel over param_shapes.
  int64_t parameters() const;

  // ---- tensors ----
  /// An input of the pass (persistent: alive through the step), no gradient.
  Sym input(std::vector<int64_t> shape, int elem);
  /// A new tensor (the output of the op that follows).
  Sym make(std::vector<int64_t> shape, int elem, bool requires_grad);
  /// An op with no saved tensors and no gradient (masks, features).
  void op(const std::string& name, const std::vector<Sym>& in, const std::vector<Sym>& out);
  void add_param(std::vector<int64_t> shape) { param_shapes.push_back(std::move(shape)); }
  /// Bytes of the gradient of a parameter of `shape` (0 when frozen).
  int64_t param_grad_bytes(const std::vector<int64_t>& shape) const;
  /// Bytes per parameter-gradient element (the weight's storage dtype).
  int grad_elem() const { return p_.param_elem; }
  /// Activations in channels-last layout (the tiny UNet's, models/tiny_unet.h):
  /// group_norm then copies an fp32 input to NCHW and its output back, as
  /// nn::GroupNorm does (a 2-byte input is copied to fp32 either way).
  void set_channels_last(bool on) { channels_last_ = on; }

  // ---- elementwise and layout ----
  /// A dtype conversion: new tensor; backward converts the gradient back.
  Sym cast(const Sym& x, int elem);
  /// A contiguous copy (reshape of a permuted tensor, channels-last
  /// conversion): backward hands the gradient through as a view.
  Sym copy(const Sym& x, std::vector<int64_t> shape, const std::string& name);
  /// A view of x's storage.
  Sym view(const Sym& x, std::vector<int64_t> shape);
  /// silu, gelu, ...: saves the input.
  Sym unary(const Sym& x, const std::string& name);
  Sym add(const Sym& a, const Sym& b, const std::string& name = "add");
  /// a * b, b of a's shape or broadcast over it (a gate, a scale): saves both
  /// factors; the gradient of a broadcast b is reduced from a full product.
  Sym mul(const Sym& a, const Sym& b);
  /// a + b with b broadcast (a bias, a shift).
  Sym add_bcast(const Sym& a, const Sym& b, const std::string& name = "add");
  /// An elementwise op with a scalar (x * s, 1 + x): new tensor, saves nothing.
  Sym scalar_op(const Sym& x, const std::string& name);
  /// torch::cat along dim 1 (channels of [B, C, H, W], tokens of [B, L, D]).
  Sym cat(const std::vector<Sym>& parts);
  Sym cat(const Sym& a, const Sym& b) { return cat(std::vector<Sym>{a, b}); }
  /// Views of parts of x (chunk, slice) with the given shapes; their backward
  /// assembles one gradient of x's size.
  std::vector<Sym> split(const Sym& x, const std::vector<std::vector<int64_t>>& shapes);
  /// A new tensor computed from inputs that need no gradient (timestep
  /// features, positional embedding crops, dropout masks).
  Sym constant(std::vector<int64_t> shape, int elem, const std::string& name);
  /// Nearest 2x upsampling of [B, C, H, W].
  Sym upsample(const Sym& x);
  /// Dropout in training (ATen's CPU path): x * mask, saving both; x when p <= 0.
  Sym dropout(const Sym& x, double p);

  // ---- layers with parameters (nn/layers.h) ----
  /// Input of a matmul-like op: under autocast, a tensor of another dtype is
  /// cast to the compute dtype.
  Sym mm_input(const Sym& x);
  /// nn::Conv2d with bias; `pad` -1 = k / 2 (same size at stride 1).
  Sym conv(const Sym& x, int64_t cout, int64_t k, int64_t stride, int64_t pad = -1, int64_t groups = 1);
  /// nn::Linear on the last dim. `scaled_weight`: the weight enters as a
  /// scaled copy (nn::Attention's q projection), which the op saves.
  Sym linear(const Sym& x, int64_t out_features, bool bias, bool scaled_weight = false);
  /// nn::LayerNorm / nn::GroupNorm compute in fp32: a 2-byte input is cast
  /// to an fp32 copy (which the norm saves), the output cast back; affine
  /// weights of 2-byte storage are cast to fp32 too. `stat_rows`: rows of
  /// mean / rstd; `transient`: forward scratch (a contiguous copy inside).
  /// `relayout`: a 4-byte input is copied too (nn::GroupNorm of a
  /// channels-last input normalises an NCHW copy, saved, and returns a
  /// channels-last copy); backward copies the channels-last gradient to
  /// NCHW inside the kernel (one more fp32 copy while it runs) and the
  /// input's gradient back.
  Sym norm(const Sym& x, int64_t channels, int64_t stat_rows, const std::string& name, bool affine = true,
           int64_t transient = 0, bool relayout = false);
  Sym layer_norm(const Sym& x, bool affine = true);
  Sym group_norm(const Sym& x, int64_t channels, int64_t groups);
  /// Timestep / vector embedding MLP: Linear, SiLU, Linear (fp32 features
  /// cast to the compute dtype first, as nn::TimestepEmbedding).
  Sym embed_mlp(Sym features, int64_t hidden, int64_t out);
  /// The training loss: mse_loss(h.to(fp32), target.to(fp32)) saves both
  /// fp32 operands; the loss lives until the end of backward.
  void mse_loss(Sym h, Sym target);

  // ---- blocks (memory_trace_layers.cpp) ----
  /// nn::ResBlock: GroupNorm, SiLU, 3x3 conv, + Linear(SiLU(temb)), GroupNorm,
  /// SiLU, 3x3 conv, + (1x1 conv) shortcut. `max_groups` as ResBlockOptions::groups;
  /// `scale_shift` as ResBlockOptions::scale_shift (norm2(h) * (1 + scale) + shift).
  Sym res_block(const Sym& x, int64_t out, const Sym& temb, int64_t max_groups, bool scale_shift = false);
  Sym feed_forward_gelu(const Sym& x, int64_t mult);
  Sym feed_forward_geglu(const Sym& x, int64_t mult = 4);
  /// softmax(q k^T) v on heads: q4 [B, Hkv, R, d] (R = query rows of all
  /// query heads sharing a key/value head), k4 / v4 [B, Hkv, Lk, d]; `Lq`
  /// query tokens (a batched matmul copies a permuted operand when Hkv > 1).
  /// Returns [B, Hkv, R, d].
  Sym sdpa(const Sym& q4, const Sym& k4, const Sym& v4, int64_t Lq, const SdpaStyle& style);
  /// [B, Hkv, R, d] heads back to tokens [B, Lq, H * d] (a copy unless trivial).
  Sym merge_heads(const Sym& o, int64_t Lq, int64_t H);
  /// nn::Attention: q = x W_q^T * scale (scaled weight copy), k, v from kv,
  /// (chunked) softmax attention, to_out with bias.
  Sym attention(const Sym& x, const Sym& kv, bool masked, int64_t heads, int64_t kv_heads, int64_t head_dim,
                int64_t query_dim);
  /// nn::SpatialTransformer: GroupNorm, proj_in (1x1 conv or Linear),
  /// `depth` TransformerBlocks (self-attention, cross-attention on
  /// `context`, GEGLU / GELU feed-forward; each its own checkpointed segment
  /// when `checkpoint_blocks`), proj_out, residual.
  Sym spatial_transformer(const Sym& x, const Sym& context, bool masked, const SpatialTransformerShape& shape,
                          bool checkpoint_blocks);

  /// A declared block or scope `block` run as nn::run_block runs it (its
  /// forward emitted by `f` on `inputs`): with settings from the lookup, the
  /// floating inputs are cast to its compute dtype, `f` runs under them,
  /// checkpointed when they say so, and emulated-fp16 outputs are rounded
  /// through fp16; without, `f` runs on `inputs` under the caller's
  /// settings, checkpointed when `legacy_checkpoint`. Returns f's outputs.
  std::vector<Sym> block(const torch::nn::Module* block, const std::vector<Sym>& inputs, bool legacy_checkpoint,
                         const std::function<std::vector<Sym>(const std::vector<Sym>&)>& f);
  /// block() of a module with one output.
  Sym block1(const torch::nn::Module* m, const std::vector<Sym>& inputs, bool legacy_checkpoint,
             const std::function<Sym(const std::vector<Sym>&)>& f) {
    return block(m, inputs, legacy_checkpoint, [&](const std::vector<Sym>& in) { return std::vector<Sym>{f(in)}; })
        .at(0);
  }

  /// Runs `f` (which emits ops and returns the segment's output) as a
  /// checkpointed segment with `inputs` when `on`.
  template <class F>
  Sym checkpointed(bool on, const std::vector<int>& inputs, F&& f) {
    const int first = sim.next_op_index();
    Sym y = f();
    if (on && sim.next_op_index() > first) sim.segment(first, sim.next_op_index() - 1, inputs);
    return y;
  }

 private:
  // Autocast casts each weight to bf16 once per forward (cached) and the
  // consuming op saves the copy; the gradient lands in fp32.
  void weight_cast(TraceOp& o, const std::vector<int64_t>& shape, bool input_needs_grad);
  // Appends `o`; when its output needs no gradient autograd records no node:
  // nothing saved, no parameter gradients.
  void emit(TraceOp& o, const Sym& out);
  // A layer's weight gets a gradient.
  bool weight_grad() const { return !p_.frozen && p_.trainable > 0; }

  TracePrecision p_;
  BlockLookup lookup_;
  bool channels_last_ = false;
};

}  // namespace shoestring::nn
