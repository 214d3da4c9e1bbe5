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
#include <vector>

#include <ATen/ATen.h>

#include "shoestring/dist/process_group.h"

namespace shoestring::dist {

/// Default bucket size of GradientAverager: 25 MiB of fp32 (PyTorch DDP's).
inline constexpr int64_t kDefaultBucketBytes = int64_t{25} << 20;

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
  struct Bucket {
    std::vector<size_t> params;  ///< indices into params_
    int64_t numel = 0;
  };
  ProcessGroup& group_;
  std::vector<at::Tensor> params_;
  std::vector<Bucket> buckets_;
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
