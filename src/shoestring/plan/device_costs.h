// What a CUDA device adds to a memory plan that the planner can know without
// the device: the caching allocator's rounding and the cuBLAS workspaces.
// Applied to the plan only when the run computes on CUDA (device = "cuda" or
// "cuda:N"); the CPU plan is unchanged.
//
// Sources (libtorch's c10/cuda/CUDACachingAllocator.cpp and
// aten/src/ATen/cuda/CublasHandlePool.cpp, 1.13 to 2.x): every block is
// rounded up to a multiple of 512 bytes (kMinBlockSize); requests up to 1 MiB
// are carved from 2 MiB segments (kSmallBuffer), up to 10 MiB from 20 MiB
// segments (kLargeBuffer), larger ones get their own segment rounded up to
// 2 MiB (kRoundLarge). The cuBLAS workspace of a (handle, stream) pair comes
// from the same allocator: 4096 KiB * 2 + 16 KiB * 8 = 8.125 MiB by default in
// libtorch 2.x (CUBLAS_WORKSPACE_CONFIG overrides it; 32 MiB on compute
// capability 9.0), plus 1 MiB for cuBLASLt; one stream computes.
//
// Not included, and said so in the plan's notes: the CUDA context and the
// cuDNN / cuBLAS handles (hundreds of MiB, driver- and GPU-dependent, outside
// the allocator: what nvidia-smi shows beyond the allocator's reserved bytes),
// and the segments' unused tails (reserved minus allocated: fragmentation
// depends on the order of allocations).
#pragma once
#include <cstdint>

#include "shoestring/plan/memory_plan.h"

namespace shoestring::plan {

/// The caching allocator's block granularity (bytes).
constexpr int64_t kCudaBlockBytes = 512;
/// Default cuBLAS + cuBLASLt workspace of one stream (bytes): 8.125 MiB + 1 MiB.
constexpr int64_t kCudaBlasWorkspaceBytes = 4096 * 1024 * 2 + 16 * 1024 * 8 + 1024 * 1024;

/// Fixed CUDA costs of a plan, bytes.
struct CudaFixedCosts {
  /// Expected 512-byte rounding of the tensors resident at the peak:
  /// kCudaBlockBytes / 2 per tensor (uniform remainders), at most 511 each.
  int64_t rounding_bytes = 0;
  int64_t workspace_bytes = 0;  ///< kCudaBlasWorkspaceBytes
  int64_t total() const { return rounding_bytes + workspace_bytes; }
};

/// The fixed costs for `resident_tensors` tensors at the peak (>= 0; throws
/// shoestring::Error for a negative count).
CudaFixedCosts cuda_fixed_costs(int64_t resident_tensors);

/// Adds cuda_fixed_costs(plan.resident_tensors) to `plan`: to the
/// temporaries at the peak, the steady-state and first-step peaks, and
/// plan.device_fixed_bytes, with a note naming what is included and what is
/// not (the CUDA context). Call it once, for a run on CUDA only.
void add_cuda_fixed_costs(MemoryPlan& plan);

}  // namespace shoestring::plan
