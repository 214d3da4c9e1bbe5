// Data parallel (zero_stage = 0): every rank holds the whole model, takes
// its own rows of each global batch, and after backward the gradients are
// averaged over the ranks, so that every rank applies the same update: the
// one a single process would apply to the whole global batch (up to fp32
// summation order). The averaging is bucketed: gradients are flattened into
// fp32 buckets of about 25 MiB, each summed with one all-reduce, two in
// flight (the next bucket fills while the previous one is summed), as
// PyTorch DDP's Reducer does (torch/csrc/distributed/c10d/reducer.hpp,
// bucket_cap_mb = 25); unlike DDP the all-reduces start after backward, not
// during it.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "shoestring/dist/process_group.h"

namespace shoestring::dist {

/// Default bucket size of GradientAverager: 25 MiB of fp32 (PyTorch DDP's).
inline constexpr int64_t kDefaultBucketBytes = int64_t{25} << 20;

/// Whole gradients of some parameters, flattened into one fp32 buffer for
/// one collective (GradientAverager's all-reduce, ZeroSharding's reduce to
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
/// waits and copies the sum times 1 / group.size() back into the .grad of
/// the rank(s) receiving it: every rank when bucket.root is -1, else rank
/// bucket.root only, and every other rank's .grad of the bucket is reset
/// (undefined) once packed. Collective (every rank runs the same buckets
/// in the same order). Throws what PendingCollective::wait throws.
void reduce_gradient_buckets(ProcessGroup& group, const std::vector<at::Tensor>& params,
                             const std::vector<GradientBucket>& buckets, const StartBucketCollective& start);

/// Averages the gradients (.grad) of a fixed list of parameters over the
/// ranks of a group, in place. Every rank must build it from the same
/// parameters (shapes, order).
class GradientAverager {
 public:
  /// `params`: leaf tensors whose .grad is averaged (any floating dtype;
  /// bf16 / fp16 gradients are summed in fp32 and rounded to nearest once).
  /// Buckets hold whole tensors, at most `bucket_bytes` of fp32 each (a
  /// larger tensor gets a bucket of its own). Throws shoestring::Error for
  /// bucket_bytes < 1.
  GradientAverager(ProcessGroup& group, std::vector<at::Tensor> params, int64_t bucket_bytes = kDefaultBucketBytes);

  /// Replaces every parameter's .grad by the mean over ranks of its .grad
  /// (sum / size()). An undefined .grad counts as zeros and stays
  /// undefined. Collective: every rank calls it at the same point of the
  /// step. Throws shoestring::Error naming the collective and the rank when
  /// a peer failed or timed out.
  void all_reduce_gradients();

  /// Number of buckets (at least one per call when there are parameters).
  size_t bucket_count() const { return buckets_.size(); }

 private:
  ProcessGroup& group_;
  std::vector<at::Tensor> params_;
  std::vector<GradientBucket> buckets_;
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
