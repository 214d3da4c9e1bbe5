// Fused backward: each parameter is stepped by the optimizer the moment its
// gradient is complete, inside the backward pass (a post-accumulate-grad
// hook), and its gradient is freed at once, so a full set of gradients never
// exists. Same idea as kohya-ss sd-scripts' --fused_backward_pass and
// OneTrainer's fused back pass (both built on torch >= 2.1's
// Tensor.register_post_accumulate_grad_hook); here it also supports
//  - gradient accumulation: on micro-batches before the last, each gradient
//    is added to a GradientAccumulator buffer (fp32 weights: fp32 buffer;
//    bf16/fp16 weights: bf16 buffer with stochastic rounding, 2 bytes per
//    parameter) and freed; on the last micro-batch the buffer and the fresh
//    gradient are summed in fp32, the optimizer steps, and both are freed;
//  - global-norm clipping (kohya and OneTrainer clip per tensor only), by one
//    of two documented methods (see FusedClipMethod).
// Works with gradient checkpointing (nn/checkpoint.h): parameters inside a
// checkpointed segment receive their gradient during the segment's recompute
// and are stepped there.
//
// Caveat: a parameter must receive its gradient in ONE AccumulateGrad call
// per backward. A parameter used in two checkpointed segments (or inside and
// outside one) gets two partial gradients; the fused step then throws
// shoestring::Error (on the second call) rather than step on a partial gradient.
// Details, costs and the non-finite policy: docs/fused_backward.md.
#pragma once
#include <algorithm>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "shoestring/optim/grad_accumulation.h"
#include "shoestring/optim/grad_hooks.h"
#include "shoestring/optim/optimizer.h"

namespace shoestring {

/// How global-norm clipping is done when gradients never coexist.
enum class FusedClipMethod {
  /// Default. Step t is scaled by min(1, max_norm / (||g_{t-1}|| + 1e-6)),
  /// where ||g_{t-1}|| is the global norm of the previous finite step,
  /// accumulated in the hooks (one extra norm reduction per parameter per
  /// step, no extra memory or passes). Caveat: one step late; the first step
  /// (and steps after a restart unless set_previous_grad_norm is called) is
  /// not clipped.
  previous_step_norm,
  /// The last micro-batch's backward runs twice: the first pass only measures
  /// ||g_t|| (buffer + fresh gradient, then frees the gradient), the second
  /// steps with the exact clip scale. Costs one extra forward + backward of
  /// the last micro-batch per step (~+100% compute with accumulation 1); the
  /// caller must replay that micro-batch identically (same inputs, noise and
  /// dropout RNG). Also detects a non-finite step before any parameter moves.
  two_pass,
};

/// "previous_step_norm" / "two_pass"; parse throws shoestring::Error listing both.
const char* to_string(FusedClipMethod method);
FusedClipMethod parse_fused_clip_method(const std::string& name);

/// Several ranks: each parameter's step gradient (fp32, its micro-batches
/// summed; each rank's its share of the global batch's mean) is summed over
/// the ranks before the parameter is updated. The hooks pack the step
/// gradients, in hook order (the same on every rank, which runs the same
/// graph), into fp32 buckets of at most `bucket_bytes` (or one larger
/// tensor) whose parameters share a root; each full bucket's collective
/// starts at once, at most two are in flight while backward goes on, and a
/// bucket's parameters are updated when its sum has arrived, where this rank
/// receives it (as PyTorch DDP's Reducer buckets gradients, with the
/// optimizer step after each bucket instead of after backward).
struct FusedReduction {
  /// Per parameter (the optimizer's order): the rank that receives its sum
  /// and alone updates it (ZeRO: its owner), or -1 for every rank.
  std::vector<int> root_of;
  int rank = 0;  ///< this process's rank
  /// Starts the sum over the ranks of `flat` (contiguous fp32) onto `root`
  /// (-1: every rank) and returns what waits for it, after which `flat`
  /// holds the sum where this rank receives it. Called in the same order on
  /// every rank; the wait throws what the collective throws.
  std::function<std::function<void()>(const at::Tensor& flat, int root)> start;
  int64_t bucket_bytes = int64_t{25} << 20;  ///< fused_bucket_bytes() (PyTorch DDP's bucket_cap_mb = 25 at most)
  /// With gradient accumulation: false (default): no communication before
  /// the last micro-batch, every rank buffers every parameter's gradients;
  /// true (ZeRO stage 3, where a rank keeps only its own tensors): each
  /// micro-batch's gradients are summed over the ranks the same way, and
  /// only the receiving rank adds the sum to its buffer, so a rank's buffers
  /// hold its own tensors' sums. Every rank must call begin_micro_batch and
  /// end_step in step (the buckets of a micro-batch end at the next call).
  bool every_micro_batch = false;
};

/// FusedReduction::bucket_bytes for `parameters` trainable elements whose
/// sums go to `receivers` ranks (1: every rank receives every sum, data
/// parallel; more: ZeRO's owners, FusedBackward filling one bucket per
/// owner, each up to its share of this): a quarter of the fp32 gradients
/// with one receiver, a thirty-second with several (their buckets fill side
/// by side, each held until full), at least 256 KiB and at most 25 MiB
/// (PyTorch DDP's bucket_cap_mb), so that a small model's gradients are not
/// all held until the end of backward.
inline int64_t fused_bucket_bytes(int64_t parameters, int64_t receivers = 1) {
  const int64_t share = parameters * static_cast<int64_t>(sizeof(float)) / (receivers > 1 ? 32 : 4);
  return std::clamp<int64_t>(share, int64_t{256} << 10, int64_t{25} << 20);
}

/// What FusedBackward's buckets hold on one rank of several, in bytes.
struct FusedBucketSizes {
  int64_t largest = 0;  ///< the largest bucket sent
  int64_t peak = 0;     ///< the most held at once: buckets filling, one being packed (its flat copy), two in flight
};

/// FusedBackward's bucketing of step gradients of `bytes` (fp32, in the
/// order their hooks fire) to `roots` (the receiving rank of each, -1: every
/// rank) with FusedReduction::bucket_bytes `bucket_bytes`: one bucket per
/// root, each sent when the next gradient would take it past bucket_bytes /
/// (number of roots), the rest at the end of backward, root by root; after
/// each send at most two wait in flight. For the planner (plan/) and tests.
/// Throws shoestring::Error when the sizes differ in length.
FusedBucketSizes fused_bucket_sizes(const std::vector<int64_t>& bytes, const std::vector<int>& roots,
                                    int64_t bucket_bytes);

struct FusedBackwardOptions {
  int64_t accumulation_steps = 1;  ///< micro-batches per optimizer step (>= 1)
  double max_grad_norm = 0.0;      ///< global L2 norm bound; <= 0 disables clipping
  FusedClipMethod clip_method = FusedClipMethod::previous_step_norm;
  /// Accumulation buffer precision; default: fp32 for fp32 weights, bf16_sr
  /// for bf16/fp16 weights (chosen per parameter).
  std::optional<GradAccumulationMode> accumulation_mode;
  uint64_t seed = 0;  ///< stochastic-rounding seed of the accumulation buffers
  /// Several ranks (data parallel, ZeRO stages 1-3): how the step
  /// gradients are summed over the ranks before their updates (see
  /// FusedReduction). Unset: one process. With two_pass clipping the last
  /// micro-batch's gradients are summed twice: its measuring pass measures
  /// each sum where it arrives (the norms then summed through
  /// sum_over_ranks), its second pass applies them.
  std::optional<FusedReduction> reduction;
  /// Set when each rank measures only part of the step's norm (with
  /// `reduction`, at ZeRO stages 1-2: its own tensors'): end_step sums the
  /// squared norm and the count of stepped parameters over every rank
  /// through it, so that the norm, the non-finite verdict, the step count
  /// and the next step's clipping agree everywhere.
  std::function<double(double)> sum_over_ranks;
};

/// What one fused optimizer step did (returned by FusedBackward::end_step).
struct FusedStepResult {
  int64_t step = 0;  ///< optimizer step number (1-based) the updates used
  double grad_norm =
      0;  ///< global L2 norm of this step's gradient (after grad_multiplier, before clipping); inf/NaN if non-finite
  double clip_scale = 1;                 ///< factor applied to every gradient of this step (clipping only)
  bool finite = true;                    ///< false: some gradient had inf/NaN (count it as a non-finite step)
  int64_t params_stepped = 0;            ///< parameters updated (over every rank with sum_over_ranks)
  int64_t params_skipped_nonfinite = 0;  ///< parameters left unchanged because their gradient was non-finite
};

/// Drives fused optimizer steps for `optimizer`'s parameters.
///
/// Per optimizer step:
///   fb.begin_step(lr);
///   for (m = 0; m < accumulation_steps; ++m) {
///     fb.begin_micro_batch(m);
///     (loss_m / accumulation_steps).backward();      // hooks accumulate / step
///     if (fb.needs_second_pass() && fb.begin_second_pass())
///       (loss_m / accumulation_steps).backward();    // two_pass only: replay
///   }
///   FusedStepResult r = fb.end_step();              // advances step_count
/// Do not call optimizer.step() for these parameters. Backward passes outside
/// begin_step .. end_step leave .grad alone (e.g. for tests or validation).
/// Hooks run on the thread executing the backward (CPU: the caller's thread).
/// Not copyable or movable (hooks refer to this object).
class FusedBackward {
 public:
  /// Installs post-accumulate-grad hooks on every parameter of `optimizer`
  /// (each must be a leaf requiring grad). `optimizer` must outlive this
  /// object. Throws shoestring::Error for accumulation_steps < 1.
  FusedBackward(Optimizer& optimizer, FusedBackwardOptions options);
  ~FusedBackward();
  FusedBackward(const FusedBackward&) = delete;
  FusedBackward& operator=(const FusedBackward&) = delete;

  /// Starts optimizer step optimizer.step_count() + 1 with learning rate
  /// `lr`; every gradient is multiplied by `grad_multiplier` (e.g. 1/loss
  /// scale) before its norm is taken. Throws if a step is already open.
  void begin_step(double lr, double grad_multiplier = 1.0);
  /// Announces micro-batch `micro` (0-based, in order) of the open step; the
  /// last one (accumulation_steps - 1) steps the parameters. Throws
  /// shoestring::Error when out of order or no step is open.
  void begin_micro_batch(int64_t micro);
  /// True after the measuring backward of the last micro-batch (two_pass).
  bool needs_second_pass() const;
  /// two_pass: computes the exact global norm and clip scale (with
  /// `reduction`: after the measuring pass's sums have arrived, the same on
  /// every rank); returns true when the caller must now replay the last
  /// micro-batch's backward, false when the gradient is non-finite (the step
  /// is skipped on every rank, nothing moves). Collective with `reduction`.
  bool begin_second_pass();
  /// Closes the step: applies parameters whose buffer got no gradient in the
  /// last micro-batch, frees every buffer, advances optimizer.step_count()
  /// when at least one parameter was updated, and records the norm for the
  /// next step's clipping (finite steps only).
  FusedStepResult end_step();

  /// Global norm of the last finite step (NaN before any); saved with
  /// training state so a resumed run clips its first step like the original.
  double previous_grad_norm() const { return previous_norm_; }
  void set_previous_grad_norm(double norm) { previous_norm_ = norm; }
  /// Bytes of accumulation buffers held now (MemoryCategory::gradients).
  int64_t buffer_bytes() const;
  const FusedBackwardOptions& options() const { return options_; }

 private:
  enum class Pass { idle, accumulate, measure, apply };
  void on_gradient(size_t index, at::Tensor& param);
  /// One process: apply(). Several ranks: into the filling bucket of its
  /// root (FusedReduction), which is sent when full; a bucket's parameters
  /// are applied when its sum has arrived.
  void reduce_and_apply(size_t index, at::Tensor grad_fp32, int64_t accumulate_micro = -1);
  /// Starts the collective of `root`'s filling bucket (nothing when empty);
  /// waits for the oldest in flight while more than two are.
  void send_bucket(int root);
  /// Waits for the oldest bucket in flight and applies its parameters where
  /// this rank receives the sum (or adds it to their buffers: `micro` of an
  /// accumulating bucket).
  void finish_oldest_bucket();
  /// Sends the filling buckets (by root) and waits for every one in flight.
  void flush_buckets();
  struct Bucket {
    std::vector<std::pair<size_t, at::Tensor>> grads;  ///< (index, fp32 step gradient) while filling
    std::vector<size_t> params;                        ///< once sent
    at::Tensor flat;
    int root = -1;
    int64_t bytes = 0;
    int64_t micro = -1;    ///< every_micro_batch: the micro-batch whose sums it carries into the buffers; -1: applied
    bool measure = false;  ///< two_pass's measuring pass: its sums are measured, not applied
    std::function<void()> wait;
  };
  void apply(size_t index, const at::Tensor& grad);
  /// two_pass's measuring pass: adds a step gradient's squared norm (times
  /// the gradient multiplier) to the step's.
  void add_measured_norm(const at::Tensor& grad_fp32);
  /// Several ranks sum every micro-batch (FusedReduction::every_micro_batch).
  bool every_micro_batch() const { return options_.reduction && options_.reduction->every_micro_batch; }
  double clip_scale_for(double norm) const;

  Optimizer& optimizer_;
  FusedBackwardOptions options_;
  std::vector<std::unique_ptr<GradientAccumulator>> accumulators_;  // one per mode in use
  std::vector<GradientAccumulator*> accumulator_of_;                // per parameter
  std::shared_ptr<FusedBackward*> self_;                            // cleared in the destructor; hooks check it
  PostAccumulateGradHooks hooks_;

  Pass pass_ = Pass::idle;
  bool step_open_ = false;
  int64_t step_ = 0;
  int64_t micro_ = -1;
  double lr_ = 0;
  double multiplier_ = 1;
  double scale_ = 1;           // clip scale of the open step
  double sumsq_ = 0;           // this step's squared norm so far
  double measured_sumsq_ = 0;  // two_pass: the measuring pass's, summed over the ranks
  bool finite_ = true;
  bool skip_step_ = false;  // two_pass found a non-finite gradient
  double previous_norm_;
  int64_t stepped_ = 0, skipped_ = 0;
  std::vector<uint8_t> done_;  // per parameter: hook fired in the current measure/apply pass
  // Several ranks: the buckets being packed, one per receiving rank (-1:
  // all), each up to bucket_bytes / (number of roots), so that owners
  // interleaved in parameter order (ZeRO's greedy balance) do not cut the
  // buckets down to a tensor or two each: one small collective per tensor
  // cost ZeRO stage 3's fused backward ~10 % of its step time.
  std::map<int, Bucket> filling_;
  int64_t root_bucket_bytes_ = 0;  // bucket_bytes / number of roots
  std::deque<Bucket> in_flight_;   // several ranks: sent, oldest first
};

}  // namespace shoestring
