#include "shoestring/core/memory_ledger.h"

#include <cstdlib>
#include <cstring>
#include <mutex>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <nlohmann/json.hpp>

#include "shoestring/core/error.h"
#include "shoestring/core/torch_compat.h"

namespace shoestring {
namespace {

// Block layout: [BlockHeader, 64 bytes][data, n bytes]. posix_memalign gives a
// 64-byte aligned block, so the data is 64-byte aligned too (libtorch's
// default CPU alignment).
constexpr size_t kHeaderBytes = 64;
constexpr uint32_t kBlockMagic = 0x4C444752u;  // "LDGR"
constexpr uint8_t kAllocatorPriority = 100;

struct BlockHeader {
  int64_t size;                   // bytes requested by libtorch
  std::atomic<int32_t> category;  // int(MemoryCategory) currently charged
  uint32_t magic;
};
static_assert(sizeof(BlockHeader) <= kHeaderBytes, "header must fit in front of the data");

// Counters live in static storage (zero-initialized, trivially destructible)
// so that frees during static destruction still find them.
struct LedgerCounters {
  std::atomic<int64_t> current[kNumMemoryCategories];
  std::atomic<int64_t> peak[kNumMemoryCategories];
  std::atomic<int64_t> peak_breakdown[kNumMemoryCategories];
  std::atomic<int64_t> device_peak_breakdown[kNumMemoryCategories];
  std::atomic<int64_t> current_total;
  std::atomic<int64_t> peak_total;
  std::atomic<int64_t> current_device;  // every category but host_offload
  std::atomic<int64_t> peak_device;
};
LedgerCounters g_counters;

// Category charged for new allocations; `other` while no ScopedMemoryCategory
// is alive. Constant-initialized (constexpr constructor).
std::atomic<int> g_category{static_cast<int>(MemoryCategory::other)};

int category_now() { return g_category.load(std::memory_order_relaxed); }

// Raises `peak` to at least `value`; true when this call set a new maximum.
bool raise_peak(std::atomic<int64_t>& peak, int64_t value) {
  int64_t seen = peak.load(std::memory_order_relaxed);
  while (value > seen) {
    if (peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) return true;
  }
  return false;
}

void snapshot_breakdown(std::atomic<int64_t> (&into)[kNumMemoryCategories]) {
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    into[c].store(g_counters.current[c].load(std::memory_order_relaxed), std::memory_order_relaxed);
  }
}

/// Raises the device peak to `value`, and snapshots the categories when it rose.
void raise_device_peak(int64_t value) {
  if (raise_peak(g_counters.peak_device, value)) snapshot_breakdown(g_counters.device_peak_breakdown);
}

constexpr int kHostCategory = static_cast<int>(MemoryCategory::host_offload);

void charge(int category, int64_t bytes) {
  const int64_t now = g_counters.current[category].fetch_add(bytes) + bytes;
  raise_peak(g_counters.peak[category], now);
  if (category != kHostCategory) raise_device_peak(g_counters.current_device.fetch_add(bytes) + bytes);
  const int64_t total = g_counters.current_total.fetch_add(bytes) + bytes;
  if (raise_peak(g_counters.peak_total, total)) snapshot_breakdown(g_counters.peak_breakdown);
}

void discharge(int category, int64_t bytes) {
  g_counters.current[category].fetch_sub(bytes);
  if (category != kHostCategory) g_counters.current_device.fetch_sub(bytes);
  g_counters.current_total.fetch_sub(bytes);
}

BlockHeader* header_of(void* data) { return reinterpret_cast<BlockHeader*>(static_cast<char*>(data) - kHeaderBytes); }

// The deleter of every DataPtr the ledger hands out; also raw_deleter().
// The DataPtr's context is its data pointer, so this receives the data.
void free_block(void* data) {
  if (data == nullptr) return;
  BlockHeader* h = header_of(data);
  TORCH_INTERNAL_ASSERT(h->magic == kBlockMagic, "memory ledger: freeing a foreign block");
  discharge(h->category.load(), h->size);
  h->magic = 0;
  h->~BlockHeader();
  std::free(h);
}

c10::DataPtr allocate_block(size_t nbytes) {
  const c10::Device cpu(c10::DeviceType::CPU);
  // Zero bytes: a null DataPtr with our deleter, as c10's default allocator
  // does; free_block ignores null.
  if (nbytes == 0) return {nullptr, nullptr, &free_block, cpu};
  TORCH_CHECK(nbytes <= static_cast<size_t>(INT64_MAX) - kHeaderBytes, "memory ledger: allocation of ", nbytes,
              " bytes is too large");
  void* block = nullptr;
  if (posix_memalign(&block, kHeaderBytes, nbytes + kHeaderBytes) != 0 || block == nullptr) {
    TORCH_CHECK(false, "memory ledger: not enough memory: you tried to allocate ", nbytes, " bytes.");
  }
  const int category = category_now();
  auto* h = new (block) BlockHeader;
  h->size = static_cast<int64_t>(nbytes);
  h->category.store(category);
  h->magic = kBlockMagic;
  charge(category, static_cast<int64_t>(nbytes));
  void* data = static_cast<char*>(block) + kHeaderBytes;
  return {data, data, &free_block, cpu};
}

class LedgerAllocator final : public c10::Allocator {
 public:
#if SHOESTRING_ALLOCATOR_API_2_3
  c10::DataPtr allocate(size_t nbytes) override { return allocate_block(nbytes); }
  void copy_data(void* dest, const void* src, std::size_t count) const override { default_copy_data(dest, src, count); }
#else
  c10::DataPtr allocate(size_t nbytes) const override { return allocate_block(nbytes); }
#endif
  // Context == data pointer, so raw_allocate / raw_deallocate (used by
  // oneDNN's bf16 kernels) work.
  c10::DeleterFnPtr raw_deleter() const override { return &free_block; }
};

LedgerAllocator g_allocator;

// The ledger's header for t's storage, or null when the storage is not ours.
BlockHeader* ledger_block(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return nullptr;
  const c10::DataPtr& dp = t.storage().data_ptr();
  if (dp.get() == nullptr || dp.get_deleter() != &free_block) return nullptr;
  return header_of(dp.get());
}

int checked_index(MemoryCategory category) {
  const int c = static_cast<int>(category);
  if (c < 0 || c >= kNumMemoryCategories) {
    fail("memory ledger: invalid memory category {} (expected 0..{})", c, kNumMemoryCategories - 1);
  }
  return c;
}

}  // namespace

const char* to_string(MemoryCategory category) {
  switch (category) {
    case MemoryCategory::weights: return "weights";
    case MemoryCategory::gradients: return "gradients";
    case MemoryCategory::optimizer_state: return "optimizer_state";
    case MemoryCategory::activations: return "activations";
    case MemoryCategory::temporaries: return "temporaries";
    case MemoryCategory::other: return "other";
    case MemoryCategory::host_offload: return "host_offload";
  }
  return "unknown";
}

MemoryLedger& MemoryLedger::global() {
  static MemoryLedger ledger;
  return ledger;
}

void MemoryLedger::install() {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  if (installed()) return;
  c10::SetCPUAllocator(&g_allocator, kAllocatorPriority);
  if (!installed()) {
    fail(
        "memory ledger: could not install the tracking CPU allocator: libtorch keeps another "
        "CPU allocator registered with a priority above {}",
        static_cast<int>(kAllocatorPriority));
  }
}

bool MemoryLedger::installed() const { return c10::GetCPUAllocator() == &g_allocator; }

int64_t MemoryLedger::current_bytes(MemoryCategory category) const {
  return g_counters.current[checked_index(category)].load();
}

int64_t MemoryLedger::peak_bytes(MemoryCategory category) const {
  return g_counters.peak[checked_index(category)].load();
}

int64_t MemoryLedger::current_total() const { return g_counters.current_total.load(); }

int64_t MemoryLedger::peak_total() const { return g_counters.peak_total.load(); }

int64_t MemoryLedger::device_current_total() const { return g_counters.current_device.load(); }

int64_t MemoryLedger::device_peak_total() const { return g_counters.peak_device.load(); }

std::array<int64_t, kNumMemoryCategories> MemoryLedger::peak_breakdown() const {
  std::array<int64_t, kNumMemoryCategories> out{};
  for (int c = 0; c < kNumMemoryCategories; ++c) out[c] = g_counters.peak_breakdown[c].load();
  return out;
}

std::array<int64_t, kNumMemoryCategories> MemoryLedger::device_peak_breakdown() const {
  std::array<int64_t, kNumMemoryCategories> out{};
  for (int c = 0; c < kNumMemoryCategories; ++c) out[c] = g_counters.device_peak_breakdown[c].load();
  return out;
}

void MemoryLedger::reset_peaks() {
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    g_counters.peak[c].store(g_counters.current[c].load());
  }
  g_counters.peak_total.store(g_counters.current_total.load());
  g_counters.peak_device.store(g_counters.current_device.load());
  snapshot_breakdown(g_counters.peak_breakdown);
  snapshot_breakdown(g_counters.device_peak_breakdown);
}

void MemoryLedger::recharge(const at::Tensor& t, MemoryCategory to) {
  const int target = checked_index(to);
  BlockHeader* h = ledger_block(t);
  if (h == nullptr) return;
  const int from = h->category.exchange(target);
  if (from == target) return;
  // Add before subtracting so the total seen by concurrent readers never dips.
  const int64_t now = g_counters.current[target].fetch_add(h->size) + h->size;
  raise_peak(g_counters.peak[target], now);
  g_counters.current[from].fetch_sub(h->size);
  if (from == kHostCategory && target != kHostCategory) {
    raise_device_peak(g_counters.current_device.fetch_add(h->size) + h->size);
  } else if (from != kHostCategory && target == kHostCategory) {
    g_counters.current_device.fetch_sub(h->size);
  }
}

int MemoryLedger::charged_category(const at::Tensor& t) const {
  const BlockHeader* h = ledger_block(t);
  return h == nullptr ? -1 : h->category.load();
}

nlohmann::json MemoryLedger::to_json() const {
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
  return nlohmann::json{{"current_bytes", current_total()},
                        {"peak_bytes", peak_total()},
                        {"current", current},
                        {"peak", peak},
                        {"peak_per_category", peak_per_category}};
}

MemoryCategory current_memory_category() { return static_cast<MemoryCategory>(category_now()); }

namespace {
std::atomic<MemoryCategoryObserver> g_category_observer{nullptr};

int notify_and_check(MemoryCategory category) {
  const int c = checked_index(category);
  if (MemoryCategoryObserver observer = g_category_observer.load()) observer();
  return c;
}
}  // namespace

void set_memory_category_observer(MemoryCategoryObserver observer) { g_category_observer.store(observer); }

ScopedMemoryCategory::ScopedMemoryCategory(MemoryCategory category)
    : previous_(static_cast<MemoryCategory>(g_category.exchange(notify_and_check(category)))) {}

ScopedMemoryCategory::~ScopedMemoryCategory() {
  if (MemoryCategoryObserver observer = g_category_observer.load()) observer();
  g_category.store(static_cast<int>(previous_));
}

}  // namespace shoestring
