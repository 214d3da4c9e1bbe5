// ZeRO stages 1 and 2 (Rajbhandari et al., "ZeRO: Memory Optimizations
// Toward Training Trillion Parameter Models", arXiv 1910.02054) over a
// ProcessGroup: every rank still holds every weight, but each trainable
// tensor has one owner rank, the only one that updates it and holds its
// optimizer state (stage 1) and, from stage 2 on, the only one that keeps
// its gradient after the reduction.
//
// Sharding is by whole tensors, never by flat byte ranges (DeepSpeed's
// partitions): AdamW8bit's 256-element blocks and Adafactor's factored row /
// column statistics then stay whole on their owner, and the optimizers of
// optim/ run unchanged on the tensors they are given (stochastic rounding
// included: its keys are the parameter's index in the full list, so every
// owner rounds as one process would). The owners come from TensorOwnership
// (a greedy balance by element count, deterministic on every rank).
//
// One step, per rank (train/trainer.cpp calls these):
//   reduce_gradients()  stage 1: every gradient summed over the ranks on
//                       every rank (as zero_stage = 0; each rank's is its
//                       share of the global batch's mean, so the sum is that
//                       mean: dist/data_parallel.h); stage 2: summed into
//                       its owner's .grad only (fp32 buckets of one owner's
//                       tensors, one Gloo reduce each), other ranks' .grad freed
//   optimizer step      on the owned tensors only (Optimizer::set_update_subset);
//                       stage 2's global gradient norm is the square root of
//                       sum_over_ranks(squared norm of the owned gradients)
//   broadcast_updated_parameters()  every tensor from its owner to all ranks,
//                       bit for bit (bf16 through the fp16-view broadcast)
//
// Stage 3 adds the parameters: the parameters of each streamed group (one
// checkpointed block's, declared with add_streamed_group) live only on their
// owner between uses; every other rank's copy is an empty tensor. A group
// is gathered (fetch: one broadcast per owner and dtype) just before the
// block runs, forward and again for its recompute in backward, and released
// after; after the recompute's backward its gradients are reduced to their
// owners at once (release with gradients_complete), so no rank ever holds
// more than its own share plus the blocks in use. The owner sums a tensor's
// gradients over the ranks and the micro-batches of a step; at reduce_gradients() it
// becomes the owner's .grad. Parameters in no group (the layers between
// blocks) stay resident and are treated as in stage 2. train/ connects the
// groups to the model's blocks (nn::BlockParameterStreaming). Saving and
// sampling need every weight on one rank for their duration: gathered
// there (hold_all_on), or given to it from the files every rank wrote of
// the parameters it owns (owned_streamed, hold_on: train/ does that for a
// full fine-tune, so no rank ever holds the whole model in its memory).
//
// Checkpoints: each rank writes its own tensors' optimizer state to a shard
// file of the checkpoint, indexed by rank 0 (train/checkpoint_io.h); on
// resume, at any world size and stage, each rank reads the state of the
// tensors it owns then (parameter_of_state + ownership()).
//
// Prefetch (stage 3): the gathering fetches of the first streamed step are
// recorded in order (forward blocks, then their recomputes in backward); from
// the next step on, once a group is gathered the next group of that order is
// gathered in flight (asynchronous broadcasts into a buffer that becomes its
// parameters), overlapped with the running block's compute, as DeepSpeed's
// stage-3 prefetch follows the first step's module trace. A step whose
// fetches leave the recorded order stops prefetching until end_step_fetches();
// every rank follows the same order, so the collectives stay matched.
// Never across steps: the optimizer step changes the weights in between.
// NCCL and overlapping the resident reductions with backward are later
// steps.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "shoestring/core/memory_ledger.h"
#include "shoestring/dist/data_parallel.h"
#include "shoestring/dist/process_group.h"

namespace shoestring::dist {

/// Which rank owns each tensor of a list (trainable parameters, in their
/// order). Greedy balance by element count, in list order: tensor i goes to
/// the rank that owns the fewest elements so far, the lowest such rank on
/// ties. So every rank computes the same map from the same list, and no
/// rank owns more than total / world + the largest tensor's elements.
class TensorOwnership {
 public:
  /// `numels`: each tensor's element count (>= 0), in list order. Throws
  /// shoestring::Error for world < 1 or a negative count.
  TensorOwnership(const std::vector<int64_t>& numels, int world);

  int owner(size_t index) const { return owner_.at(index); }
  size_t size() const { return owner_.size(); }
  int world() const { return static_cast<int>(elements_.size()); }
  /// Elements owned by `rank`.
  int64_t elements_of(int rank) const { return elements_.at(static_cast<size_t>(rank)); }
  /// One entry per tensor: owned by `rank`.
  std::vector<bool> owned_by(int rank) const;

 private:
  std::vector<int> owner_;
  std::vector<int64_t> elements_;
};

/// Named tensors ("<param name>.<state name>" for optimizer state).
using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// One rank's part of ZeRO stage 1 or 2 over a fixed list of trainable
/// parameters (see the file comment). Every rank must build it from the
/// same parameters (names, shapes, dtypes, order) and call its collectives
/// at the same points of the step.
class ZeroSharding {
 public:
  /// `params`: named leaf tensors (any floating dtype; the trainable
  /// weights). `stage`: 1, 2 or 3. Buckets hold whole tensors, at most
  /// `bucket_bytes` of fp32 (gradients) or of the weights' dtype
  /// (broadcasts) each; a larger tensor gets one of its own. Throws
  /// shoestring::Error for another stage, bucket_bytes < 1 or two
  /// parameters of one name.
  ZeroSharding(ProcessGroup& group, NamedTensors params, int stage, int64_t bucket_bytes = kDefaultBucketBytes);

  int stage() const { return stage_; }
  const TensorOwnership& ownership() const { return ownership_; }
  /// One entry per parameter: owned by this rank (what its optimizer updates).
  std::vector<bool> owned() const { return ownership_.owned_by(group_.rank()); }

  /// After backward. Stage 1: every parameter's .grad becomes its sum over
  /// the ranks, on every rank (GradientReducer). Stage 2: the sum goes into
  /// the owner's .grad only (summed in fp32, rounded once into the
  /// gradient's dtype) and every other rank's .grad is reset (undefined), so
  /// that a rank holds the gradients of about 1/size() of the elements. An
  /// undefined .grad counts as zeros and stays undefined. Collective. Throws
  /// shoestring::Error naming the collective and the rank when a peer failed
  /// or timed out.
  void reduce_gradients();

  /// The sum over the ranks of `value` (stage 2: each rank's squared norm of
  /// the gradients it owns; GradientPathOptions::sum_squared_norm).
  /// Collective. Throws as reduce_gradients.
  double sum_over_ranks(double value);

  /// After the optimizer step, in which each rank updated only the tensors
  /// it owns: every parameter's values copied from its owner into every
  /// rank's, bit for bit (buckets of one owner's tensors of one dtype, one
  /// broadcast each). Collective. Throws as reduce_gradients.
  void broadcast_updated_parameters();

  // ---- stage 3 (sharded parameters; see the file comment) ----

  /// Declares the parameters `params` (indices into the constructor's list,
  /// each in at most one group) as one group streamed together; returns its
  /// id. Before start_streaming(). Throws shoestring::Error for stage < 3, an
  /// index out of range or already in a group, or after start_streaming().
  size_t add_streamed_group(const std::vector<size_t>& params);
  /// Every rank frees the streamed parameters it does not own (their data
  /// becomes an empty tensor of their dtype on the group's device, wherever
  /// it was: the run keeps them in host memory until here, so that the
  /// device never holds the whole model); from now on a group is present
  /// only between fetch and release. Call once the weights are final for
  /// the start (loaded, restored from a checkpoint, equal on all ranks). No
  /// collective.
  void start_streaming();
  bool streaming() const { return streaming_; }
  /// Makes group `group`'s parameters present on every rank (their owners'
  /// values, bit for bit). Calls nest: only the first gathers. Collective
  /// (every rank fetches the same groups in the same order). Throws as
  /// reduce_gradients.
  void fetch(size_t group);
  /// Ends a fetch; the last one frees the parameters this rank does not own.
  /// With `gradients_complete` (the group's backward has just run), first
  /// reduces the group's gradients to their owners (summed over ranks, in
  /// fp32; the owner adds it to its sum over the step's micro-batches, or
  /// hands it to the StreamedGradientSink; others' .grad reset), unless the
  /// gradient path reduces them itself (set_streamed_gradients_reduced_in_backward).
  /// Collective with `gradients_complete`. Throws as reduce_gradients.
  void release(size_t group, bool gradients_complete);
  /// Where an owner's streamed gradients go after release's reduction:
  /// (parameter index into the constructor's list, that backward's gradient
  /// summed over the ranks: fp32, the parameter's shape, valid during the
  /// call). The gradient path's accumulator sums the micro-batches there
  /// (full_bf16 with accumulation: an fp32 or bf16 stochastically rounded
  /// buffer, never a bf16 sum rounded to nearest).
  using StreamedGradientSink = std::function<void(size_t, const at::Tensor&)>;
  /// Stage 3, before the first release: owners hand their streamed
  /// gradients to `sink` instead of summing them into their .grad (which
  /// stays undefined for them). Throws shoestring::Error below stage 3.
  void set_streamed_gradient_sink(StreamedGradientSink sink);
  /// Stage 3, before the first release: the gradient path sums the
  /// streamed gradients over the ranks itself, inside backward (the fused
  /// backward's buckets), so release never reduces. Throws shoestring::Error
  /// below stage 3.
  void set_streamed_gradients_reduced_in_backward();
  /// Gathers every streamed parameter onto rank `root` (per group, one
  /// broadcast per owner and dtype; other ranks only pass the buckets
  /// through), for saving or sampling there; until release_held(), fetch
  /// and release do nothing on `root`. Collective. Throws as
  /// reduce_gradients.
  void hold_all_on(int root);
  /// hold_all_on without a collective: rank `root` gives every streamed
  /// parameter it does not own the values `values` has under its name (the
  /// other ranks' owned_streamed(), e.g. mapped from the files they wrote;
  /// copied to the parameter's device when elsewhere); the other ranks only
  /// record the hold. Every rank calls it. Throws shoestring::Error naming a
  /// parameter missing from `values` or of another shape or dtype.
  void hold_on(int root, const std::map<std::string, at::Tensor>& values);
  /// Ends hold_all_on / hold_on: the root frees what it does not own again. No collective.
  void release_held();
  /// The streamed parameters this rank owns (their names and tensors;
  /// present on this rank between uses). Empty before streaming starts or
  /// on one rank.
  NamedTensors owned_streamed() const;
  /// Names of every streamed parameter (of all ranks), in list order.
  std::vector<std::string> streamed_names() const;
  /// After a step's micro-batches (before the optimizer step): the step's
  /// fetches are over. Waits for a prefetch still in flight (collective:
  /// every rank has issued it) and drops it; the first call ends the
  /// recording of the fetch order that later steps prefetch by. Throws as
  /// reduce_gradients.
  void end_step_fetches();
  /// Whether stage 3 prefetches (default true; false: every gather happens
  /// at its fetch). Set before the first fetch.
  void set_prefetch(bool on) { prefetch_on_ = on; }
  /// Gathers served by a prefetch so far (for tests and logs).
  int64_t prefetched_gathers() const { return prefetched_gathers_; }
  /// Elements of the trainable parameters in streamed groups / in all.
  int64_t streamed_elements() const;
  /// Streamed groups declared.
  size_t streamed_groups() const { return groups_.size(); }

  /// The index of the parameter that optimizer state key "<param
  /// name>.<state name>" (state names have no '.') belongs to; nullopt when
  /// it belongs to none. A checkpoint's state of parameter i is kept by
  /// rank ownership().owner(i) (re-sharding on resume, train/run.cpp).
  std::optional<size_t> parameter_of_state(const std::string& key) const;

 private:
  struct Bucket {
    int owner = 0;
    at::ScalarType dtype = at::kFloat;
    std::vector<size_t> params;  ///< indices into params_
    int64_t numel = 0;
  };
  /// A streamed group: its parameters, the buckets that gather them (one
  /// owner and dtype each) and that reduce their gradients (one owner each).
  struct StreamGroup {
    std::vector<size_t> params;
    std::vector<Bucket> fetch_buckets;
    std::vector<GradientBucket> gradient_buckets;
    int fetched = 0;  ///< open fetches
  };
  /// Buckets of whole tensors among `which` (indices, in order) with the
  /// same owner (and dtype, when `by_dtype`), at most `cap_bytes` each.
  std::vector<Bucket> make_buckets(const std::vector<size_t>& which, bool by_dtype, int64_t cap_bytes) const;
  /// Fills the buckets of the parameters in no streamed group (stages 2, 3).
  void make_resident_buckets();
  void reduce_to_owners();
  /// The owners' values of `bucket`'s parameters into every rank's (root
  /// < 0) or into rank `root`'s only (the others pass the bucket through).
  void gather_bucket(const Bucket& bucket, int root);
  /// A bucket's flat buffer, filled on its owner (category `category`).
  at::Tensor pack_bucket(const Bucket& bucket, MemoryCategory category) const;
  /// A group gathered in flight (prefetch).
  struct Prefetch {
    size_t group = 0;
    std::vector<at::Tensor> flats;  ///< one per fetch bucket (category weights)
    std::vector<PendingCollective> pending;
  };
  /// Order bookkeeping of a gathering fetch of `group`; returns whether a
  /// prefetch may follow it.
  bool follow_order(size_t group);
  /// Starts gathering the group after position order_pos_ of fetch_order_.
  void start_prefetch(size_t current);
  /// Waits for the prefetch in flight and gives its parameters their values
  /// (views of its buffers); `use` false: waits and drops it.
  void finish_prefetch(bool use);
  /// Frees group parameters this rank does not own.
  void free_unowned(const StreamGroup& g);
  bool owns(size_t i) const { return ownership_.owner(i) == group_.rank(); }

  ProcessGroup& group_;
  NamedTensors params_;
  std::map<std::string, size_t> index_of_;  ///< parameter name -> index into params_
  int stage_;
  TensorOwnership ownership_;
  std::unique_ptr<GradientReducer> reducer_;      ///< stage 1
  std::vector<GradientBucket> gradient_buckets_;  ///< stages 2, 3 (resident): fp32, one owner (root) each
  std::vector<Bucket> weight_buckets_;            ///< one owner and dtype each (stage 3: resident only)
  int64_t bucket_bytes_;
  std::vector<at::Tensor> tensors_;  ///< params_' tensors
  // stage 3
  std::vector<StreamGroup> groups_;
  std::vector<int> group_of_;                    ///< per parameter: its group, or -1 (resident)
  std::vector<std::vector<int64_t>> shapes_;     ///< per parameter: its full shape
  std::vector<at::Tensor> step_gradient_;        ///< per owned streamed parameter: the step's gradient, summed
  StreamedGradientSink streamed_gradient_sink_;  ///< set: owners' streamed gradients go there instead
  bool streamed_reduced_in_backward_ = false;    ///< release never reduces
  bool streaming_ = false;
  int held_on_ = -1;  ///< hold_all_on's root, -1 when none
  // stage 3 prefetch (see the file comment)
  std::vector<size_t> fetch_order_;  ///< gathering fetches of the first streamed step
  bool order_known_ = false;         ///< fetch_order_ is complete (after the first end_step_fetches)
  size_t order_pos_ = 0;             ///< this step's gathers so far, while they follow fetch_order_
  bool order_followed_ = true;
  std::optional<Prefetch> prefetch_;
  bool prefetch_on_ = true;
  int64_t prefetched_gathers_ = 0;
};

}  // namespace shoestring::dist
