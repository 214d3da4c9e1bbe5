// The memory ledger on CUDA: bytes per ledger category (weights, gradients,
// optimizer_state, activations, temporaries, other, host_offload) of the
// memory libtorch's CUDA caching allocator hands out, next to the
// allocator's own totals (peak allocated and peak reserved), so that `plan`
// can be held against a real GPU run.
//
// Why not an allocator wrapper like the CPU ledger: libtorch creates CUDA
// tensors through c10::cuda::CUDACachingAllocator directly (1.13: a fixed
// allocator object, not c10::GetAllocator(kCUDA); 2.x: a replaceable
// CUDAAllocator whose interface changes from release to release and which
// can only be swapped before the first CUDA allocation). Instead:
//
// * libtorch >= 2.1 (SHOESTRING_HAS_CUDA_TRACE_TRACKER): a trace tracker
//   attached to the caching allocator sees every allocation (address and
//   requested bytes) and every free request. Each block is charged to the
//   category current when it was allocated (ScopedMemoryCategory, the same
//   process-wide setting the CPU ledger reads) and discharged from the
//   category it is charged to when freed; recharge() moves a tensor's block,
//   as on the CPU. Exact per block.
// * libtorch < 2.1: at every change of the category (ScopedMemoryCategory)
//   and every read, the change of the allocator's allocated bytes since the
//   previous one is charged to the category that was current. Approximate: a
//   block freed while another category is current is debited from that
//   category (a category's current bytes may even go negative), and
//   recharge() is a no-op. Totals are exact.
//
// Bytes: per category, the bytes libtorch requested (trace path) or the
// allocator's allocated bytes, which are rounded to 512 (delta path); the
// allocator's totals come from c10::cuda::CUDACachingAllocator::getDeviceStats
// (allocated: blocks handed out, rounded to 512 bytes; reserved: the cudaMalloc'd
// segments, 2 MiB for requests up to 1 MiB, 20 MiB up to 10 MiB, larger ones
// rounded up to 2 MiB). The CUDA context and cuDNN/cuBLAS handles are outside
// the allocator and not counted. Device memory allocated while host_offload
// is current (staging for offloaded state) is charged to temporaries:
// host_offload is host memory and stays on the CPU ledger.
//
// Built only in the CUDA build (and compiled by the CUDA compile check); this
// header has no CUDA dependency.
#pragma once
#include <array>
#include <cstdint>

#include <ATen/core/Tensor.h>
#include <nlohmann/json_fwd.hpp>

#include "shoestring/core/memory_ledger.h"

namespace shoestring {

/// Totals of the caching allocator for one device (bytes), from its
/// statistics (aggregate pool).
struct CudaAllocatorStats {
  int64_t allocated_current = 0;  ///< blocks handed out now (rounded to 512 bytes)
  int64_t allocated_peak = 0;     ///< their peak since the last reset_peaks()
  int64_t reserved_current = 0;   ///< segments held from cudaMalloc (used or cached)
  int64_t reserved_peak = 0;
};

/// Process-wide ledger of one CUDA device's caching-allocator memory, per
/// category. See the file comment for how bytes are attributed.
class CudaMemoryLedger {
 public:
  /// The single CUDA ledger of the process.
  static CudaMemoryLedger& global();

  /// Starts attributing allocations on CUDA device `device` (an index).
  /// Allocations made before are not charged (their frees are ignored).
  /// Idempotent for the same device. Throws shoestring::Error when libtorch
  /// sees no CUDA device, for an index out of range, or when the ledger was
  /// installed for another device.
  void install(int device = 0);
  bool installed() const;
  /// The device index given to install(); -1 before.
  int device() const;
  /// "trace" (per block, libtorch >= 2.1) or "delta" (per scope, older).
  const char* attribution() const;

  /// Bytes charged to `category` now / its highest value since install() or
  /// the last reset_peaks(). host_offload is always 0 (see the file comment).
  int64_t current_bytes(MemoryCategory category) const;
  int64_t peak_bytes(MemoryCategory category) const;
  /// Sum over categories, current and peak.
  int64_t current_total() const;
  int64_t peak_total() const;
  /// Per-category bytes when the total peak was reached; indexed by
  /// int(MemoryCategory).
  std::array<int64_t, kNumMemoryCategories> peak_breakdown() const;

  /// The allocator's own totals for the device (all allocations, also those
  /// made before install()).
  CudaAllocatorStats allocator_stats() const;

  /// Sets every peak to its current value, the allocator's peak statistics
  /// included (c10::cuda::CUDACachingAllocator::resetPeakStats).
  void reset_peaks();

  /// Moves the block of t's storage (a CUDA tensor) to category `to`, as
  /// MemoryLedger::recharge does on the CPU. No-op for tensors not on the
  /// ledger's device, blocks the ledger did not see allocated, and on the
  /// delta path.
  void recharge(const at::Tensor& t, MemoryCategory to);
  /// int(MemoryCategory) t's block is charged to, or -1 (not seen, or the
  /// delta path).
  int charged_category(const at::Tensor& t) const;

  /// {"device": index, "attribution": "trace"|"delta", "current_bytes",
  ///  "peak_bytes", "current": {category: bytes}, "peak": {category: bytes at
  ///  the total peak}, "peak_per_category": {...}, "allocator":
  ///  {"allocated_bytes", "allocated_peak_bytes", "reserved_bytes",
  ///  "reserved_peak_bytes"}}.
  nlohmann::json to_json() const;

 private:
  CudaMemoryLedger() = default;
};

}  // namespace shoestring
