// The NCCL backend of a ProcessGroup (CUDA tensors), over c10d's
// ProcessGroupNCCL. Built only where libtorch has CUDA (cmake/cuda.cmake);
// compile-checked elsewhere. The class exists when libtorch was built with
// NCCL (USE_C10D_NCCL, defined by the torch_cuda target) and nccl.h was
// found (SHOESTRING_HAVE_NCCL_H, cmake/cuda.cmake); otherwise the factory
// says which is missing.
#include <cstdlib>

#include <fmt/format.h>

#include "shoestring/core/error.h"
#include "shoestring/dist/c10d_collectives.h"

#if defined(USE_C10D_NCCL) && defined(SHOESTRING_HAVE_NCCL_H)
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace shoestring::dist {

#if defined(USE_C10D_NCCL) && defined(SHOESTRING_HAVE_NCCL_H)

namespace {

class NcclCollectives final : public C10dCollectives {
 public:
  NcclCollectives(c10::intrusive_ptr<c10d::ProcessGroupNCCL> group, int device_index)
      : group_(std::move(group)), device_index_(device_index) {}

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors) override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
    return group_->allreduce(tensors);
  }
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, int root) override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
    c10d::ReduceOptions o;
    o.rootRank = root;
    return group_->reduce(tensors, o);
  }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, int root) override {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
    c10d::BroadcastOptions o;
    o.rootRank = root;
    return group_->broadcast(tensors, o);
  }
  std::string describe() const override { return fmt::format("NCCL on cuda:{}", device_index_); }

 private:
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> group_;
  int device_index_;
};

/// Sets `name` to `value` unless the environment already has it.
void default_environment(const char* name, const char* value) {
  if (std::getenv(name) == nullptr) ::setenv(name, value, /*overwrite=*/0);
}

}  // namespace

std::unique_ptr<C10dCollectives> make_nccl_collectives(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                       std::chrono::milliseconds timeout, int device_index) {
  // A collective that outlives `timeout` (a stopped or dead peer: NCCL's
  // kernels wait for it forever) is caught by c10d's watchdog, which then
  // ends this process with its message naming the collective; libtorch 1.13
  // does so only with NCCL_ASYNC_ERROR_HANDLING = 1 (2.x's default is on;
  // it reads TORCH_NCCL_ASYNC_ERROR_HANDLING). Without it a rank would hang.
  if (std::getenv("NCCL_ASYNC_ERROR_HANDLING") == nullptr &&
      std::getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING") == nullptr) {
    default_environment("NCCL_ASYNC_ERROR_HANDLING", "1");
    default_environment("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1");
  }
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  auto group = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
  return std::make_unique<NcclCollectives>(std::move(group), device_index);
}

#else

std::unique_ptr<C10dCollectives> make_nccl_collectives(const c10::intrusive_ptr<c10d::Store>&, int rank, int size,
                                                       std::chrono::milliseconds, int device_index) {
#if !defined(USE_C10D_NCCL)
  const char* missing = "this libtorch was built without NCCL (USE_C10D_NCCL)";
#else
  const char* missing = "nccl.h was not found when shoestring was built (set SHOESTRING_NCCL_INCLUDE_DIR)";
#endif
  fail(
      "rank {} of {} on cuda:{}: several processes on CUDA devices reduce over NCCL, and {}; train on the CPU "
      "(device = \"cpu\") or rebuild against a libtorch with NCCL",
      rank, size, device_index, missing);
}

#endif

}  // namespace shoestring::dist
