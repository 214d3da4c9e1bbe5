// The memory simulator: an analytic model of what libtorch's autograd keeps
// alive during one forward + backward pass, for the memory planner
// (`shoestring plan`). Models describe their forward as ops through the op
// vocabulary of nn/memory_trace.h; this file only replays a list of ops.
//
// A model is described as a list of ops over symbolic tensors (bytes only,
// no storage): each op names the tensors it reads, the tensors it creates,
// which of them autograd saves for backward (e.g. a convolution saves its
// input, a softmax its output), the gradients of parameters it produces, and
// extra transient bytes it needs in forward / backward. Views (chunk, reshape
// without copy) are aliases of one storage. Gradient-checkpointed segments
// (nn/checkpoint.h) save only their inputs and are re-run inside backward.
//
// simulate() replays the pass: forward in op order (a storage lives until
// its last use, or until backward when saved), then backward in reverse
// (gradients of activations appear when computed and die when consumed;
// saved storages die after the last op that saved them; parameter gradients
// accumulate, or are stepped and freed at once with a fused backward). It
// reports the peak of the sum and the bytes per ledger category at that peak.
// The categories follow the trainer: forward allocations are `activations`,
// anything allocated during backward (including checkpoint recomputation) is
// `temporaries`, parameter gradients are `gradients`.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "shoestring/core/memory_ledger.h"

namespace shoestring::nn {

using Bytes = std::array<int64_t, kNumMemoryCategories>;

/// One op of the traced forward pass.
struct TraceOp {
  std::string name;
  std::vector<int> inputs;       ///< tensors read in forward
  std::vector<int> outputs;      ///< tensors created (new storages or aliases)
  std::vector<int> saved;        ///< tensors autograd keeps for this op's backward
  std::vector<int> grad_inputs;  ///< inputs this op's backward computes a gradient for
  /// Backward passes the output gradient through unchanged (add, views): the
  /// input gradients alias the output gradient, nothing is allocated.
  bool passthrough = false;
  /// With passthrough: inputs smaller than the output (broadcast operands,
  /// e.g. a per-channel shift) get a new gradient of their own size (the
  /// reduction of the output gradient) instead of aliasing it.
  bool broadcast = false;
  int64_t saved_extra = 0;           ///< small saved side tensors (norm statistics), bytes
  int64_t forward_transient = 0;     ///< scratch while the op runs in forward, bytes
  int64_t backward_transient = 0;    ///< scratch while the op's backward runs, bytes
  std::vector<int64_t> param_grads;  ///< bytes of each parameter gradient produced in backward
};

/// How simulate() treats parameter gradients.
struct TraceOptions {
  /// Fused backward: each parameter gradient is stepped and freed as it is
  /// produced; `fused_update_transient(bytes)` gives the scratch of that
  /// update for a gradient of `bytes` (charged to temporaries).
  bool fused = false;
  double fused_transient_per_grad_byte = 0.0;
  /// Block streaming (offload_params, train/block_streaming.h): the
  /// parameter gradients made inside a checkpointed segment leave the device
  /// once backward has run the segment's first op (moved to host memory), so
  /// they never pile up over the blocks.
  bool segment_gradients_leave = false;
};

/// The simulated pass.
struct TraceResult {
  int64_t forward_kept = 0;     ///< activation bytes alive at the end of forward (saved + outputs)
  int64_t peak_total = 0;       ///< highest sum over categories during forward + backward
  Bytes at_peak{};              ///< bytes per category at that moment
  Bytes peak_per_category{};    ///< each category's own highest value
  std::string peak_op;          ///< op (and pass) at which the peak happened
  int64_t gradients_after = 0;  ///< parameter-gradient bytes alive after backward (on the device)
};

/// The op list of one forward pass and its replay (see the file comment).
class MemorySimulator {
 public:
  /// A new storage of `bytes`, e.g. an op's output. `persistent` storages
  /// (inputs of the pass such as the batch) are never freed by the simulation
  /// and count as activations.
  int tensor(int64_t bytes, bool persistent = false);
  /// A view of `base`'s storage (no bytes of its own) of `bytes` logical size
  /// (the size of its gradient).
  int alias(int base, int64_t bytes);
  int64_t bytes(int id) const { return tensors_.at(id).bytes; }

  /// Appends an op; returns its index.
  int op(TraceOp op);

  /// Marks ops [first, last] as a checkpointed segment with these inputs.
  /// Ops inside save nothing in forward; their saves come back (as
  /// temporaries) when backward reaches `last`.
  void segment(int first, int last, std::vector<int> inputs);
  int next_op_index() const { return static_cast<int>(ops_.size()); }

  /// Storage kept alive until the end of backward (e.g. the loss).
  void keep(int id) { tensors_.at(id).kept = true; }

  TraceResult simulate(const TraceOptions& options) const;

  const std::vector<TraceOp>& ops() const { return ops_; }

 private:
  struct T {
    int64_t bytes;
    int base;  // storage id (itself for a storage)
    bool persistent = false;
    bool kept = false;
  };
  struct Segment {
    int first, last;
    std::vector<int> inputs;
  };
  std::vector<T> tensors_;
  std::vector<TraceOp> ops_;
  std::vector<Segment> segments_;
};

}  // namespace shoestring::nn
