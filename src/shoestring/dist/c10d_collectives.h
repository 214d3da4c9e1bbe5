// The collectives a ProcessGroup issues, over one c10d backend: Gloo for
// host tensors (dist/process_group.cpp), NCCL for CUDA tensors
// (dist/nccl_collectives_cuda.cpp). Internal to dist/: only those two files
// include this header, and with it c10d's, so the rest of shoestring never
// sees c10d. The two c10d classes share no base class across libtorch
// versions (c10d::ProcessGroup in 1.13, c10d::Backend in 2.x), hence this
// small interface of our own.
#pragma once
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

namespace shoestring::dist {

/// One c10d backend's collectives, each returning c10d's Work in flight.
/// Tensors are contiguous and on the backend's device; the caller keeps them
/// alive and untouched until the Work is waited for.
class C10dCollectives {
 public:
  virtual ~C10dCollectives() = default;
  /// Sum over the ranks, in place on every rank.
  virtual c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors) = 0;
  /// Sum over the ranks into rank `root`'s tensors.
  virtual c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, int root) = 0;
  /// Rank `root`'s tensors into every rank's.
  virtual c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, int root) = 0;
  /// "NCCL on cuda:1" for logs and errors.
  virtual std::string describe() const = 0;
};

/// Sets what c10d's NCCL backend reads from the environment, before any
/// thread that might read the environment starts (setenv races getenv):
/// with libtorch 1.13, NCCL_ASYNC_ERROR_HANDLING = 1 unless set, so that the
/// watchdog ends a rank whose collective outlives the timeout instead of
/// hanging; nothing with 2.x, whose default already does. Defined in
/// dist/nccl_collectives_cuda.cpp (CUDA build).
void prepare_nccl_environment();

/// The NCCL backend of rank `rank` of `size` on CUDA device `device_index`,
/// rendezvousing through `store` (a prefix of the group's store of its own).
/// `timeout` bounds each collective: c10d's watchdog ends the process when a
/// collective runs longer (see prepare_nccl_environment). Defined in
/// dist/nccl_collectives_cuda.cpp, built only where libtorch has CUDA.
/// Throws shoestring::Error when this libtorch has no NCCL (USE_C10D_NCCL)
/// or nccl.h was not found at build time, naming what is missing; when
/// nccl.h's version is not libtorch's; and when another rank of the group
/// uses the same physical GPU (by host and PCI address), naming both ranks.
std::unique_ptr<C10dCollectives> make_nccl_collectives(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                       std::chrono::milliseconds timeout, int device_index);

}  // namespace shoestring::dist
