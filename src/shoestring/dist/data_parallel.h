// Data parallel (zero_stage = 0): every rank holds the whole model, takes
// its own rows of each global batch, backpropagates its share of the global
// batch's mean loss (its rows' mean / world size: GradientPath::
// backward_loss, so that every activation gradient has the size one process
// gives it, which matters for fp16's range), and after backward the
// gradients are summed over the ranks: every rank then holds the global
// batch's mean gradient and applies the same update, the one a single
// process would apply to the whole global batch (up to fp32 summation
// order). The reduction is bucketed: gradients are flattened into
// fp32 buckets of about 25 MiB, each summed with one all-reduce, two in
// flight (the next bucket fills while the previous one is summed), as
// PyTorch DDP's Reducer does (torch/csrc/distributed/c10d/reducer.hpp,
// bucket_cap_mb = 25). As in DDP, the buckets are filled in reverse
// parameter order (the order backward produces gradients in) and their
// all-reduces start during backward: a bucket is sent once every gradient
// in it has arrived (GradientReducer::gradient_ready, from a
// post-accumulate-grad hook), buckets always in the same order on every
// rank, so Gloo (which runs collectives on its own threads) sums the early
// buckets while backward computes the rest.
#pragma once
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "shoestring/dist/process_group.h"

namespace shoestring::dist {

/// Default bucket size of GradientReducer: 25 MiB of fp32 (PyTorch DDP's).
inline constexpr int64_t kDefaultBucketBytes = int64_t{25} << 20;

/// Whole gradients of some parameters, flattened into one fp32 buffer for
/// one collective (GradientReducer's all-reduce, ZeroSharding's reduce to
/// the owner).
struct GradientBucket {
  std::vector<size_t> params;  ///< indices into the parameter list, in order
  int64_t numel = 0;           ///< elements of all of them
  int root = -1;               ///< the rank that receives the sum (-1: every rank)
};

/// What reduce_gradient_buckets does with one bucket: starts its collective
/// on the packed fp32 buffer (which stays alive and untouched until wait()).
using StartBucketCollective = std::function<PendingCollective(const at::Tensor& flat, const GradientBucket& bucket)>;

/// The bucket loop of the gradient reductions: for each bucket, in order,
/// packs the parameters' .grad into a zeroed fp32 buffer (an undefined
/// .grad counts as zeros and stays undefined), starts `start` on it, and,
/// two buckets in flight (the next fills while the previous one is summed),
/// waits and copies the sum back into the .grad of
/// the rank(s) receiving it: every rank when bucket.root is -1, else rank
/// bucket.root only, and every other rank's .grad of the bucket is reset
/// (undefined) once packed. Collective (every rank runs the same buckets
/// in the same order). Throws what PendingCollective::wait throws.
/// With `receive` set, a receiving rank hands each parameter's fp32 sum
/// (index, a [numel]-shaped view of the parameter's shape into the bucket,
/// valid during the call) to it instead of copying it into .grad, and its
/// .grad is left as it was packed.
void reduce_gradient_buckets(ProcessGroup& group, const std::vector<at::Tensor>& params,
                             const std::vector<GradientBucket>& buckets, const StartBucketCollective& start,
                             const std::function<void(size_t, const at::Tensor&)>& receive = {});

/// Sums the gradients (.grad) of a fixed list of parameters over the ranks
/// of a group, in place (each rank's .grad being its share of the global
/// batch's mean gradient, the sum is that mean). Every rank must build it
/// from the same parameters (shapes, order).
class GradientReducer {
 public:
  /// `params`: leaf tensors whose .grad is summed (any floating dtype;
  /// bf16 / fp16 gradients are summed in fp32 and rounded to nearest once).
  /// Buckets hold whole tensors, at most `bucket_bytes` of fp32 each (a
  /// larger tensor gets a bucket of its own). Throws shoestring::Error for
  /// bucket_bytes < 1.
  GradientReducer(ProcessGroup& group, std::vector<at::Tensor> params, int64_t bucket_bytes = kDefaultBucketBytes);

  /// Replaces every parameter's .grad by the sum over ranks of its .grad.
  /// An undefined .grad counts as zeros and stays
  /// undefined. Collective: every rank calls it at the same point of the
  /// step. Throws shoestring::Error naming the collective and the rank when
  /// a peer failed or timed out.
  void all_reduce_gradients();

  /// Number of buckets (at least one per call when there are parameters).
  size_t bucket_count() const { return buckets_.size(); }

  // ---- overlap with backward ----
  //
  // The trainer calls start_overlap() before the backward of a step's last
  // micro-batch and gradient_ready(i) from a post-accumulate-grad hook on
  // parameter i (optim/grad_hooks.h); all_reduce_gradients() then starts the
  // buckets not started yet and waits for all. The first such step only
  // counts the gradients each parameter receives in one backward; from the
  // next step on, when every parameter received at most one (a static graph,
  // as DDP's static_graph assumes), the buckets whose gradients are all
  // present start during backward. The sums and the reduced gradients are
  // those of the plain call, bit for bit.

  /// Arms the overlap for the backward that follows (the step's last micro-batch).
  void start_overlap();
  /// Parameter `index`'s gradient has been accumulated into its .grad. Outside
  /// an armed backward it does nothing. Collective when it starts buckets.
  /// Throws shoestring::Error naming the parameter when, with the overlap
  /// on, a parameter receives a second gradient in one backward (its
  /// bucket may already be summed: the graph is not static), and what
  /// PendingCollective::wait throws.
  void gradient_ready(size_t index);
  /// Buckets whose all-reduce started during the last armed backward (0 while
  /// the overlap is off).
  size_t buckets_started_in_backward() const { return started_in_backward_; }
  /// The overlap is on (an armed backward was counted and every tensor got one gradient).
  bool overlapping() const { return overlap_; }

 private:
  struct InFlight {
    const GradientBucket* bucket;
    at::Tensor flat;  ///< [bucket->numel] fp32
    PendingCollective pending;
  };
  /// Packs bucket `b`'s gradients and starts its all-reduce; with two in
  /// flight already, first finishes the oldest.
  void start_bucket(size_t b);
  /// Waits for the oldest bucket in flight and writes its sum into the gradients.
  void finish_oldest();

  ProcessGroup& group_;
  std::vector<at::Tensor> params_;
  std::vector<GradientBucket> buckets_;
  std::vector<size_t> bucket_of_;  ///< per parameter
  std::vector<int> arrived_;       ///< per parameter: gradients in this armed backward
  std::vector<size_t> complete_;   ///< per bucket: parameters whose gradient arrived
  bool armed_ = false;             ///< between start_overlap and all_reduce_gradients
  bool probed_ = false;            ///< one armed backward counted
  bool overlap_ = false;           ///< the graph is static: buckets start during backward
  size_t next_bucket_ = 0;         ///< the next bucket to start, in order
  size_t started_in_backward_ = 0;
  std::deque<InFlight> in_flight_;
};

/// Copies rank `root`'s values of `tensors` (parameters, buffers) into every
/// rank's, bit for bit (what DDP does at construction, so that ranks start
/// from the same weights even when their initialisation differed). Throws
/// as ProcessGroup::broadcast.
void broadcast_tensors(ProcessGroup& group, const std::vector<at::Tensor>& tensors, int root = 0);

/// The rows of a global batch that `rank` of `world` takes: rows
/// [rank * n, (rank + 1) * n) of dim 0, n = size(0) / world (a view).
/// Throws shoestring::Error naming `what` when dim 0 is not divisible by
/// world.
at::Tensor rank_rows(const at::Tensor& global, int rank, int world, const std::string& what);

}  // namespace shoestring::dist
