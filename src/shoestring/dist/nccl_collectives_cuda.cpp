// The NCCL backend of a ProcessGroup (CUDA tensors), over c10d's
// ProcessGroupNCCL. Built only where libtorch has CUDA (cmake/cuda.cmake);
// compile-checked elsewhere. The class exists when libtorch was built with
// NCCL (USE_C10D_NCCL, defined by the torch_cuda target) and nccl.h was
// found (SHOESTRING_HAVE_NCCL_H, cmake/cuda.cmake); otherwise the factory
// says which is missing.
#include <cstdint>
#include <cstdlib>

#include <fmt/format.h>

#include "shoestring/core/error.h"
#include "shoestring/dist/c10d_collectives.h"

#if defined(USE_C10D_NCCL) && defined(SHOESTRING_HAVE_NCCL_H)
#include <unistd.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/cuda/nccl.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "shoestring/core/torch_compat.h"
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
  ~NcclCollectives() override {
    // The group's last collectives finish before its communicators go.
    try {
      c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index_));
      c10::cuda::device_synchronize();
    } catch (...) {
    }
  }

 private:
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> group_;
  int device_index_;
};

/// "host/0000:3b:00" for the GPU of `device_index`: which physical GPU a
/// rank uses, whatever CUDA_VISIBLE_DEVICES renumbered.
std::string gpu_identity(int device_index) {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  const cudaDeviceProp* p = at::cuda::getDeviceProperties(device_index);
  return fmt::format("{}/{:04x}:{:02x}:{:02x}", host, p->pciDomainID, p->pciBusID, p->pciDeviceID);
}

/// Refuses two ranks on one GPU (NCCL would fail at the first collective
/// with "Duplicate GPU detected"), naming both: every rank leaves its GPU's
/// identity in the store and reads the others'.
void refuse_shared_gpus(c10d::Store& store, int rank, int size, int device_index, std::chrono::milliseconds timeout) {
  const std::string mine = gpu_identity(device_index);
  store.set("gpu/" + std::to_string(rank), std::vector<uint8_t>(mine.begin(), mine.end()));
  for (int r = 0; r < size; ++r) {
    if (r == rank) continue;
    const std::string key = "gpu/" + std::to_string(r);
    store.wait({key}, timeout);
    const std::vector<uint8_t> bytes = store.get(key);
    if (std::string(bytes.begin(), bytes.end()) == mine) {
      fail(
          "rank {} and rank {} of {} both use the GPU at {} (this rank's cuda:{}): each rank needs a GPU of its own; "
          "start at most as many processes per machine as it has GPUs, or give each its own with "
          "CUDA_VISIBLE_DEVICES",
          std::min(r, rank), std::max(r, rank), size, mine, device_index);
    }
  }
}

/// NCCL's version as libtorch was built with it, major * 100 + minor, or -1
/// where libtorch reports it in another form (torch::cuda::nccl::version():
/// major << 32 | minor << 16 | patch since libtorch 1.x's later releases).
int torch_nccl_version() {
  const std::uint64_t v = torch::cuda::nccl::version();
  if (v < (std::uint64_t{1} << 32)) return -1;
  return static_cast<int>(v >> 32) * 100 + static_cast<int>((v >> 16) & 0xffff);
}

}  // namespace

void prepare_nccl_environment() {
#if SHOESTRING_NCCL_WATCHDOG_NEEDS_ENV
  // libtorch 1.13's watchdog ends a rank whose collective outlives the
  // timeout only with NCCL_ASYNC_ERROR_HANDLING = 1 (its default, 0, hangs
  // on a dead peer). libtorch 2.x's default (3: end the process without the
  // communicator abort that can itself hang) is the better one: left alone.
  if (std::getenv("NCCL_ASYNC_ERROR_HANDLING") == nullptr) ::setenv("NCCL_ASYNC_ERROR_HANDLING", "1", 0);
#endif
}

std::unique_ptr<C10dCollectives> make_nccl_collectives(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                       std::chrono::milliseconds timeout, int device_index) {
  // ProcessGroupNCCL's Options hold an ncclConfig_t whose size follows
  // nccl.h's version: ours must be the one libtorch was built with.
  const int built = torch_nccl_version();
  if (built >= 0 && built != NCCL_MAJOR * 100 + NCCL_MINOR) {
    fail(
        "rank {} of {}: shoestring was built with nccl.h {}.{} but libtorch with NCCL {}.{}; rebuild with "
        "SHOESTRING_NCCL_INCLUDE_DIR set to libtorch's NCCL headers (pip: site-packages/nvidia/nccl/include)",
        rank, size, NCCL_MAJOR, NCCL_MINOR, built / 100, built % 100);
  }
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device_index));
  refuse_shared_gpus(*store, rank, size, device_index, timeout);
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  auto group = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
  return std::make_unique<NcclCollectives>(std::move(group), device_index);
}

#else

void prepare_nccl_environment() {}

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
