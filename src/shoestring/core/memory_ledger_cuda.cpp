// CUDA memory ledger (see memory_ledger_cuda.h). Host code that uses
// libtorch's c10/cuda headers: built only in the CUDA build, compile-checked
// otherwise (cmake/cuda.cmake).
#include "shoestring/core/memory_ledger_cuda.h"

#include <mutex>
#include <type_traits>
#include <unordered_map>
#include <utility>

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <nlohmann/json.hpp>

#include "shoestring/core/error.h"
#include "shoestring/core/torch_compat.h"

namespace shoestring {
namespace {

namespace cca = c10::cuda::CUDACachingAllocator;

constexpr int kHost = static_cast<int>(MemoryCategory::host_offload);
constexpr int kTemporaries = static_cast<int>(MemoryCategory::temporaries);

struct Block {
  int64_t bytes;
  int category;
};

// Everything below is guarded by g_mutex. Allocator callbacks run under the
// allocator's own lock and take g_mutex; nothing here calls the allocator
// while holding g_mutex, so the two locks are always taken in that order.
struct State {
  int device = -1;
  std::array<int64_t, kNumMemoryCategories> current{};
  std::array<int64_t, kNumMemoryCategories> peak{};
  std::array<int64_t, kNumMemoryCategories> breakdown{};
  int64_t total = 0;
  int64_t total_peak = 0;
  std::unordered_map<int64_t, Block> blocks;  // trace path: address -> block
  int64_t last_allocated = 0;                 // delta path: allocator's allocated bytes at the last sync
};
std::mutex g_mutex;
State g_state;
std::atomic<bool> g_installed{false};

// The category device allocations made now are charged to.
int device_category() {
  const int c = static_cast<int>(current_memory_category());
  return c == kHost ? kTemporaries : c;
}

void charge_locked(int category, int64_t bytes) {
  State& s = g_state;
  s.current[category] += bytes;
  s.peak[category] = std::max(s.peak[category], s.current[category]);
  s.total += bytes;
  if (s.total > s.total_peak) {
    s.total_peak = s.total;
    s.breakdown = s.current;
  }
}

cca::DeviceStats stats_of(int device) { return cca::getDeviceStats(device); }

constexpr size_t kAggregate = static_cast<size_t>(cca::StatType::AGGREGATE);

#if SHOESTRING_HAS_CUDA_TRACE_TRACKER
constexpr bool kTrace = true;

// Whether the allocator's trace entries name their device (newer releases).
template <typename Entry, typename = void>
struct HasDevice : std::false_type {};
template <typename Entry>
struct HasDevice<Entry, std::void_t<decltype(std::declval<const Entry&>().device_)>> : std::true_type {};

// One allocator event: ALLOC charges the block, FREE_REQUESTED discharges it.
// Generic over the entry type, whose definition moves between releases.
template <typename Entry>
void on_trace(const Entry& e) {
  const bool alloc = e.action_ == Entry::ALLOC;
  const bool free = e.action_ == Entry::FREE_REQUESTED;
  if (!alloc && !free) return;
  const auto address = static_cast<int64_t>(e.addr_);
  std::lock_guard<std::mutex> lock(g_mutex);
  if constexpr (HasDevice<Entry>::value) {
    if (static_cast<int>(e.device_) != g_state.device) return;
  }
  if (alloc) {
    const Block b{static_cast<int64_t>(e.size_), device_category()};
    g_state.blocks[address] = b;
    charge_locked(b.category, b.bytes);
  } else {
    auto it = g_state.blocks.find(address);
    if (it == g_state.blocks.end()) return;  // allocated before install()
    charge_locked(it->second.category, -it->second.bytes);
    g_state.blocks.erase(it);
  }
}

void start_attribution(int /*device*/) {
  cca::attachAllocatorTraceTracker([](const auto& entry) { on_trace(entry); });
}
#else
constexpr bool kTrace = false;

// Charges the change of the allocator's allocated bytes since the last sync
// to the category current now (set_memory_category_observer calls this
// before every change of category).
void sync_delta() {
  const int device = g_state.device;
  if (device < 0) return;
  const int64_t now = stats_of(device).allocated_bytes[kAggregate].current;
  std::lock_guard<std::mutex> lock(g_mutex);
  charge_locked(device_category(), now - g_state.last_allocated);
  g_state.last_allocated = now;
}

void start_attribution(int device) {
  const int64_t now = stats_of(device).allocated_bytes[kAggregate].current;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_state.last_allocated = now;
  }
  set_memory_category_observer(&sync_delta);
}
#endif

// Brings the delta path up to date before a read; nothing to do on the trace
// path.
void sync() {
#if !SHOESTRING_HAS_CUDA_TRACE_TRACKER
  sync_delta();
#endif
}

int index_of(MemoryCategory category) {
  const int c = static_cast<int>(category);
  if (c < 0 || c >= kNumMemoryCategories) {
    fail("CUDA memory ledger: invalid memory category {} (expected 0..{})", c, kNumMemoryCategories - 1);
  }
  return c;
}

// The block address of t's storage when it lives on the ledger's device.
int64_t block_address(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage() || !t.is_cuda() || t.device().index() != g_state.device) return 0;
  return reinterpret_cast<int64_t>(t.storage().data_ptr().get());
}

}  // namespace

CudaMemoryLedger& CudaMemoryLedger::global() {
  static CudaMemoryLedger ledger;
  return ledger;
}

void CudaMemoryLedger::install(int device) {
  static std::mutex install_mutex;
  std::lock_guard<std::mutex> lock(install_mutex);
  if (g_installed.load()) {
    if (g_state.device != device) {
      fail("CUDA memory ledger: already installed for cuda:{}, asked for cuda:{}", g_state.device, device);
    }
    return;
  }
  const int count = static_cast<int>(c10::cuda::device_count());
  if (count == 0) fail("CUDA memory ledger: no CUDA device is visible to libtorch");
  if (device < 0 || device >= count) {
    fail("CUDA memory ledger: device cuda:{} does not exist ({} CUDA device(s): cuda:0..cuda:{})", device, count,
         count - 1);
  }
  // The caching allocator is set up by the first CUDA allocation; a trace
  // tracker cannot be attached before.
  { at::empty({1}, at::TensorOptions().device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device)))); }
  {
    std::lock_guard<std::mutex> state_lock(g_mutex);
    g_state.device = device;
  }
  start_attribution(device);
  g_installed.store(true);
}

bool CudaMemoryLedger::installed() const { return g_installed.load(); }

int CudaMemoryLedger::device() const {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_state.device;
}

const char* CudaMemoryLedger::attribution() const { return kTrace ? "trace" : "delta"; }

int64_t CudaMemoryLedger::current_bytes(MemoryCategory category) const {
  const int c = index_of(category);
  sync();
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_state.current[c];
}

int64_t CudaMemoryLedger::peak_bytes(MemoryCategory category) const {
  const int c = index_of(category);
  sync();
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_state.peak[c];
}

int64_t CudaMemoryLedger::current_total() const {
  sync();
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_state.total;
}

int64_t CudaMemoryLedger::peak_total() const {
  sync();
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_state.total_peak;
}

std::array<int64_t, kNumMemoryCategories> CudaMemoryLedger::peak_breakdown() const {
  sync();
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_state.breakdown;
}

CudaAllocatorStats CudaMemoryLedger::allocator_stats() const {
  const int d = device();
  if (d < 0) fail("CUDA memory ledger: allocator_stats() before install()");
  const cca::DeviceStats s = stats_of(d);
  CudaAllocatorStats out;
  out.allocated_current = s.allocated_bytes[kAggregate].current;
  out.allocated_peak = s.allocated_bytes[kAggregate].peak;
  out.reserved_current = s.reserved_bytes[kAggregate].current;
  out.reserved_peak = s.reserved_bytes[kAggregate].peak;
  return out;
}

void CudaMemoryLedger::reset_peaks() {
  sync();
  const int d = device();
  if (d >= 0) cca::resetPeakStats(d);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_state.peak = g_state.current;
  g_state.total_peak = g_state.total;
  g_state.breakdown = g_state.current;
}

void CudaMemoryLedger::recharge(const at::Tensor& t, MemoryCategory to) {
  int target = index_of(to);
  if (target == kHost) target = kTemporaries;
  std::lock_guard<std::mutex> lock(g_mutex);
  const int64_t address = block_address(t);
  if (address == 0) return;
  auto it = g_state.blocks.find(address);
  if (it == g_state.blocks.end() || it->second.category == target) return;
  // Add before subtracting, as the CPU ledger does.
  charge_locked(target, it->second.bytes);
  charge_locked(it->second.category, -it->second.bytes);
  it->second.category = target;
}

int CudaMemoryLedger::charged_category(const at::Tensor& t) const {
  std::lock_guard<std::mutex> lock(g_mutex);
  const int64_t address = block_address(t);
  if (address == 0) return -1;
  auto it = g_state.blocks.find(address);
  return it == g_state.blocks.end() ? -1 : it->second.category;
}

nlohmann::json CudaMemoryLedger::to_json() const {
  nlohmann::json current = nlohmann::json::object();
  nlohmann::json peak = nlohmann::json::object();
  nlohmann::json peak_per_category = nlohmann::json::object();
  const auto breakdown = peak_breakdown();
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    const auto category = static_cast<MemoryCategory>(c);
    current[to_string(category)] = current_bytes(category);
    peak[to_string(category)] = breakdown[c];
    peak_per_category[to_string(category)] = peak_bytes(category);
  }
  const CudaAllocatorStats a = allocator_stats();
  return nlohmann::json{{"device", device()},
                        {"attribution", attribution()},
                        {"current_bytes", current_total()},
                        {"peak_bytes", peak_total()},
                        {"current", current},
                        {"peak", peak},
                        {"peak_per_category", peak_per_category},
                        {"allocator",
                         {{"allocated_bytes", a.allocated_current},
                          {"allocated_peak_bytes", a.allocated_peak},
                          {"reserved_bytes", a.reserved_current},
                          {"reserved_peak_bytes", a.reserved_peak}}}};
}

}  // namespace shoestring
