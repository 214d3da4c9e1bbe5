// Memory ledger: a tracking CPU allocator under libtorch that counts current
// and peak bytes per category (weights, gradients, optimizer state,
// activations, temporaries, other), so the trainer can print where its memory
// goes, as llm.c does at start-up, and tests can assert memory budgets.
//
// How: MemoryLedger::install() registers an allocator with
// c10::SetCPUAllocator. Every block carries a 64-byte header (size, category)
// in front of the data, so frees and recharges know what to decrement. The
// category charged for new allocations is a process-wide setting
// (ScopedMemoryCategory), so allocations made by libtorch's intra-op worker
// threads are charged like the caller's.
#pragma once
#include <array>
#include <atomic>
#include <cstdint>

#include <ATen/core/Tensor.h>
#include <nlohmann/json_fwd.hpp>

namespace shoestring {

/// What an allocation is for. Order and values are stable (used as indices).
enum class MemoryCategory : int {
  weights = 0,
  gradients,
  optimizer_state,
  activations,
  temporaries,
  other,
  /// Bytes kept in HOST memory on behalf of the device: optimizer state with
  /// offload_optimizer_state (pinned when CUDA is present). Not device
  /// memory: device_current_total() / device_peak_total() exclude it.
  host_offload
};
constexpr int kNumMemoryCategories = 7;

/// "weights", "gradients", "optimizer_state", "activations", "temporaries",
/// "other", "host_offload"; "unknown" for values outside the enum.
const char* to_string(MemoryCategory category);

/// Process-wide ledger of CPU tensor memory allocated through libtorch.
///
/// Counts are the bytes libtorch requested (a tensor's storage nbytes), not
/// including the ledger's 64-byte header per block or malloc's own overhead.
/// Storages allocated before install() (or by other allocators, or wrapping
/// foreign memory via from_blob) are not counted and are freed by their own
/// deleter. Counters are atomics; a per-category peak and the total peak are
/// maintained with compare-and-swap loops. peak_breakdown() is a snapshot of
/// the per-category counters taken by the allocation that set the new total
/// peak: exact when allocations are not concurrent, otherwise it may be off by
/// allocations racing with the snapshot (a benign race, documented rather
/// than locked: the ledger sits on every tensor allocation).
class MemoryLedger {
 public:
  /// The single ledger of the process.
  static MemoryLedger& global();

  /// Installs the tracking allocator as libtorch's CPU allocator (priority
  /// 100 in c10::SetCPUAllocator). Idempotent and thread-safe. Throws
  /// shoestring::Error if libtorch keeps another allocator of higher
  /// priority.
  void install();
  /// True when the tracking allocator is libtorch's current CPU allocator.
  bool installed() const;

  /// Bytes currently allocated in `category` / its highest value since start
  /// or the last reset_peaks().
  int64_t current_bytes(MemoryCategory category) const;
  int64_t peak_bytes(MemoryCategory category) const;
  /// Sum over categories, current and peak (bytes). The total peak is not the
  /// sum of per-category peaks, which may occur at different moments.
  int64_t current_total() const;
  int64_t peak_total() const;
  /// Per-category bytes at the moment the total peak was reached (see the
  /// class comment about concurrency). Indexed by int(MemoryCategory).
  std::array<int64_t, kNumMemoryCategories> peak_breakdown() const;
  /// Current / peak bytes of every category except host_offload: the memory
  /// an accelerator would hold (on a CPU-only run, what is left when
  /// offloaded state is set aside). The device peak is tracked on its own
  /// (it is not peak_total() minus a host peak).
  int64_t device_current_total() const;
  int64_t device_peak_total() const;
  /// Per-category bytes at the moment the device peak was reached (as
  /// peak_breakdown for the total peak; the two differ where host_offload
  /// rose and fell apart from the device's categories).
  std::array<int64_t, kNumMemoryCategories> device_peak_breakdown() const;

  /// Sets every peak (per category, total and the breakdown) to the current
  /// value, e.g. at the start of a measured phase.
  void reset_peaks();

  /// Moves the bytes of t's whole storage (not just the view's extent) from
  /// the category it is charged to into `to`; a later free then decrements
  /// `to`. No-op for undefined tensors, tensors without storage, empty
  /// storages, and storages the ledger did not allocate (recognized by the
  /// DataPtr's deleter). Not synchronized against concurrent recharges of the
  /// same storage from other threads (each recharge is atomic on its own).
  void recharge(const at::Tensor& t, MemoryCategory to);

  /// int(MemoryCategory) that t's storage is charged to, or -1 when the
  /// ledger did not allocate it or it is empty (see recharge). For tests and
  /// reports.
  int charged_category(const at::Tensor& t) const;

  /// {"current_bytes": total, "peak_bytes": total peak,
  ///  "device_peak_bytes": device_peak_total(),
  ///  "current": {category: bytes}, "peak": {category: bytes at the total
  ///  peak (peak_breakdown)}, "peak_per_category": {category: peak_bytes}}.
  nlohmann::json to_json() const;

 private:
  MemoryLedger() = default;
};

/// The category charged for allocations made now (process-wide).
MemoryCategory current_memory_category();

/// Called on every change of the process-wide category (ScopedMemoryCategory
/// construction and destruction), just before the change, so
/// current_memory_category() still returns the category being left. One
/// observer per process; nullptr removes it. Used by the CUDA ledger where it
/// attributes allocated-bytes deltas per scope (core/memory_ledger_cuda.h).
using MemoryCategoryObserver = void (*)();
void set_memory_category_observer(MemoryCategoryObserver observer);

/// Sets the category charged for allocations made while it lives, for the
/// whole process (not thread-local, so libtorch's intra-op worker threads
/// charge the same category as the thread that launched the op); the
/// destructor restores the previous category. Scopes are meant to be nested
/// on one driving thread; overlapping scopes on different threads interleave
/// (last writer wins). The default category is `other`.
class ScopedMemoryCategory {
 public:
  explicit ScopedMemoryCategory(MemoryCategory category);
  ~ScopedMemoryCategory();
  ScopedMemoryCategory(const ScopedMemoryCategory&) = delete;
  ScopedMemoryCategory& operator=(const ScopedMemoryCategory&) = delete;

 private:
  MemoryCategory previous_;
};

}  // namespace shoestring
