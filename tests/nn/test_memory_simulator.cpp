// The autograd memory simulator (nn/memory_simulator.h) on hand-sized graphs.
#include <gtest/gtest.h>

#include "shoestring/nn/memory_simulator.h"

using namespace shoestring;
using namespace shoestring::nn;

namespace {
constexpr int kA = static_cast<int>(MemoryCategory::activations);
constexpr int kT = static_cast<int>(MemoryCategory::temporaries);
constexpr int kG = static_cast<int>(MemoryCategory::gradients);

// How chain() checkpoints f and g: not at all, as one segment, or each as a
// segment of its own (two blocks).
enum class Checkpoint { none, together, each };

// x(100, persistent) -> a = f(x) [saves x] -> b = g(a) [saves a] -> loss(b) [saves b]
MemorySimulator chain(Checkpoint checkpoint) {
  MemorySimulator t;
  const int x = t.tensor(100, true);
  const int a = t.tensor(200);
  const int b = t.tensor(300);
  const int l = t.tensor(4);
  TraceOp f;
  f.name = "f";
  f.inputs = {x};
  f.outputs = {a};
  f.saved = {x};
  f.param_grads = {50};
  const int f_op = t.op(f);
  if (checkpoint == Checkpoint::each) t.segment(f_op, f_op, {x});
  TraceOp g;
  g.name = "g";
  g.inputs = {a};
  g.outputs = {b};
  g.saved = {a};
  g.grad_inputs = {a};
  g.param_grads = {70};
  g.backward_transient = 10;
  const int g_op = t.op(g);
  if (checkpoint == Checkpoint::each) t.segment(g_op, g_op, {a});
  if (checkpoint == Checkpoint::together) t.segment(f_op, g_op, {x});
  TraceOp loss;
  loss.name = "loss";
  loss.inputs = {b};
  loss.outputs = {l};
  loss.saved = {b};
  loss.grad_inputs = {b};
  t.op(loss);
  t.keep(l);
  return t;
}
}  // namespace

TEST(MemorySimulator, ChainPeakByHand) {
  TraceResult r = chain(Checkpoint::none).simulate({});
  // End of forward: x 100 + a 200 (saved by g) + b 300 (saved by loss) + loss 4.
  EXPECT_EQ(r.forward_kept, 604);
  // Backward of loss: + grad(loss) 4 + grad(b) 300 -> 908. Backward of g: b
  // freed (its saver ran), x, a, loss 304 + grad(b) 300 + grad(a) 200 +
  // transient 10 + parameter gradient 70 = 884. So the peak is at loss: 908.
  EXPECT_EQ(r.peak_total, 908);
  EXPECT_EQ(r.at_peak[kA], 604);
  EXPECT_EQ(r.at_peak[kT], 304);
  EXPECT_EQ(r.gradients_after, 120);
}

TEST(MemorySimulator, CheckpointKeepsOnlySegmentInputs) {
  TraceResult plain = chain(Checkpoint::none).simulate({});
  TraceResult ckpt = chain(Checkpoint::together).simulate({});
  // a (200) is not kept; b is the segment output, saved by loss.
  EXPECT_EQ(ckpt.forward_kept, plain.forward_kept - 200);
  // The recompute brings a back as a temporary.
  EXPECT_GE(ckpt.peak_per_category[kT], 200);
  EXPECT_EQ(ckpt.gradients_after, plain.gradients_after);
}

TEST(MemorySimulator, FusedBackwardFreesParameterGradients) {
  TraceOptions fused;
  fused.fused = true;
  fused.fused_transient_per_grad_byte = 2.0;
  TraceResult r = chain(Checkpoint::none).simulate(fused);
  EXPECT_EQ(r.gradients_after, 0);
  EXPECT_EQ(r.peak_per_category[kG], 70);
}

TEST(MemorySimulator, StreamedBlocksGradientsLeaveAfterTheirBackward) {
  // f and g as two checkpointed blocks.
  const TraceResult kept = chain(Checkpoint::each).simulate({});
  EXPECT_EQ(kept.gradients_after, 120);
  EXPECT_EQ(kept.peak_per_category[kG], 120);
  TraceOptions streamed;
  streamed.segment_gradients_leave = true;
  const TraceResult r = chain(Checkpoint::each).simulate(streamed);
  // g's 70 bytes leave before f's backward makes its 50: never both.
  EXPECT_EQ(r.gradients_after, 0);
  EXPECT_EQ(r.peak_per_category[kG], 70);
  // Nothing else changes: activations and temporaries follow the same pass.
  EXPECT_EQ(r.forward_kept, kept.forward_kept);
  EXPECT_EQ(r.peak_per_category[kT], kept.peak_per_category[kT]);
}

TEST(MemorySimulator, PassthroughSharesTheGradient) {
  // y = x1 + x2 with both inputs requiring grad: add's backward allocates nothing.
  MemorySimulator t;
  const int x1 = t.tensor(100), x2 = t.tensor(100), y = t.tensor(100);
  TraceOp mk;
  mk.name = "make";
  mk.outputs = {x1, x2};
  t.op(mk);
  TraceOp add;
  add.name = "add";
  add.inputs = {x1, x2};
  add.outputs = {y};
  add.passthrough = true;
  add.grad_inputs = {x1, x2};
  t.op(add);
  t.keep(y);
  TraceResult r = t.simulate({});
  EXPECT_EQ(r.forward_kept, 100);  // x1, x2 freed (not saved)
  EXPECT_EQ(r.peak_per_category[kT], 100);
}

TEST(MemorySimulator, BroadcastOperandGetsItsOwnReducedGradient) {
  // y = x + b with b broadcast (10 bytes against 100): x's gradient is y's
  // (shared), b's a new 10-byte reduction; so backward holds 100 + 10.
  MemorySimulator t;
  const int x = t.tensor(100), b = t.tensor(10), y = t.tensor(100);
  TraceOp mk;
  mk.name = "make";
  mk.outputs = {x, b};
  t.op(mk);
  TraceOp add;
  add.name = "add";
  add.inputs = {x, b};
  add.outputs = {y};
  add.passthrough = true;
  add.broadcast = true;
  add.grad_inputs = {x, b};
  t.op(add);
  t.keep(y);
  TraceResult r = t.simulate({});
  EXPECT_EQ(r.peak_per_category[kT], 110);
  add.broadcast = false;  // plain passthrough would alias b's gradient to y's
  MemorySimulator t2;
  t2.tensor(100), t2.tensor(10), t2.tensor(100);
  t2.op(mk);
  t2.op(add);
  t2.keep(y);
  EXPECT_EQ(t2.simulate({}).peak_per_category[kT], 100);
}
