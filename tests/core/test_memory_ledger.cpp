// Tests of the memory ledger (tracking CPU allocator). The allocator is
// process-wide: every test installs it (idempotent) and measures deltas.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>
#include <nlohmann/json.hpp>

#include <thread>
#include <vector>

#include "../bf16_testing.h"
#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"

namespace shoestring {
namespace {

using Cat = MemoryCategory;

class MemoryLedgerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ledger().install();
    ASSERT_TRUE(ledger().installed());
  }
  static MemoryLedger& ledger() { return MemoryLedger::global(); }
};

TEST_F(MemoryLedgerTest, CategoryNamesAndDefault) {
  EXPECT_STREQ(to_string(Cat::weights), "weights");
  EXPECT_STREQ(to_string(Cat::gradients), "gradients");
  EXPECT_STREQ(to_string(Cat::optimizer_state), "optimizer_state");
  EXPECT_STREQ(to_string(Cat::activations), "activations");
  EXPECT_STREQ(to_string(Cat::temporaries), "temporaries");
  EXPECT_STREQ(to_string(Cat::other), "other");
  EXPECT_EQ(current_memory_category(), Cat::other);
  {
    ScopedMemoryCategory a(Cat::weights);
    EXPECT_EQ(current_memory_category(), Cat::weights);
    {
      ScopedMemoryCategory b(Cat::gradients);
      EXPECT_EQ(current_memory_category(), Cat::gradients);
    }
    EXPECT_EQ(current_memory_category(), Cat::weights);
  }
  EXPECT_EQ(current_memory_category(), Cat::other);
  EXPECT_THROW(ScopedMemoryCategory(static_cast<Cat>(17)), Error);
  EXPECT_EQ(current_memory_category(), Cat::other);
}

// The observer (the CUDA ledger's delta path) runs before each change, while
// the category being left is still current; an invalid category changes
// nothing and notifies nobody.
std::vector<Cat> g_observed;
void record_category() { g_observed.push_back(current_memory_category()); }

TEST_F(MemoryLedgerTest, CategoryObserverSeesTheCategoryBeingLeft) {
  g_observed.clear();
  set_memory_category_observer(&record_category);
  {
    ScopedMemoryCategory a(Cat::weights);
    { ScopedMemoryCategory b(Cat::gradients); }
    EXPECT_THROW(ScopedMemoryCategory(static_cast<Cat>(17)), Error);
  }
  set_memory_category_observer(nullptr);
  { ScopedMemoryCategory c(Cat::activations); }
  EXPECT_EQ(g_observed, (std::vector<Cat>{Cat::other, Cat::weights, Cat::gradients, Cat::weights}));
}

TEST_F(MemoryLedgerTest, AllocationChargesExactlyItsBytesAndFreeKeepsPeak) {
  const int64_t w0 = ledger().current_bytes(Cat::weights);
  const int64_t total0 = ledger().current_total();
  ledger().reset_peaks();
  torch::Tensor t;
  {
    ScopedMemoryCategory scope(Cat::weights);
    t = torch::empty({1000}, torch::kFloat);
  }
  ASSERT_EQ(t.nbytes(), 4000u);
  EXPECT_EQ(ledger().charged_category(t), static_cast<int>(Cat::weights));
  EXPECT_EQ(ledger().current_bytes(Cat::weights), w0 + 4000);
  EXPECT_EQ(ledger().current_total(), total0 + 4000);
  EXPECT_EQ(ledger().peak_bytes(Cat::weights), w0 + 4000);
  EXPECT_EQ(ledger().peak_total(), total0 + 4000);
  // The free (outside the scope) still decrements weights.
  t.reset();
  EXPECT_EQ(ledger().current_bytes(Cat::weights), w0);
  EXPECT_EQ(ledger().current_total(), total0);
  EXPECT_EQ(ledger().peak_bytes(Cat::weights), w0 + 4000);
  EXPECT_EQ(ledger().peak_total(), total0 + 4000);
  ledger().reset_peaks();
  EXPECT_EQ(ledger().peak_bytes(Cat::weights), w0);
  EXPECT_EQ(ledger().peak_total(), total0);
}

TEST_F(MemoryLedgerTest, ZeroByteTensorsAreNotCharged) {
  const int64_t total0 = ledger().current_total();
  auto t = torch::empty({0, 5});
  EXPECT_EQ(ledger().current_total(), total0);
  EXPECT_EQ(ledger().charged_category(t), -1);
  ledger().recharge(t, Cat::weights);  // no-op
  t.reset();
  EXPECT_EQ(ledger().current_total(), total0);
}

// offload runs: host_offload rises and falls apart from the device's
// categories, so the total's peak and the device's come at different
// moments; each breakdown is its own peak's (plan/measure.cpp compares the
// device's with the plan).
TEST_F(MemoryLedgerTest, DevicePeakBreakdownIsTheSnapshotAtTheDevicePeak) {
  ledger().reset_peaks();
  const int64_t device0 = ledger().device_current_total();
  const int64_t host0 = ledger().current_bytes(Cat::host_offload);
  torch::Tensor host, w, a;
  {
    ScopedMemoryCategory s(Cat::host_offload);
    host = torch::empty({4096}, torch::kFloat);  // 16384 B: the total's peak
  }
  host.reset();
  {
    ScopedMemoryCategory s(Cat::weights);
    w = torch::empty({1024}, torch::kFloat);  // 4096 B
  }
  {
    ScopedMemoryCategory s(Cat::activations);
    a = torch::empty({1024}, torch::kDouble);  // 8192 B: the device's peak
  }
  const auto total_at = ledger().peak_breakdown();
  EXPECT_EQ(total_at[int(Cat::host_offload)], host0 + 16384);
  const auto device_at = ledger().device_peak_breakdown();
  EXPECT_EQ(device_at[int(Cat::host_offload)], host0);
  EXPECT_EQ(ledger().device_peak_total(), device0 + 4096 + 8192);
  int64_t device_sum = 0;
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    if (c != int(Cat::host_offload)) device_sum += device_at[c];
  }
  EXPECT_EQ(device_sum, ledger().device_peak_total());
}

TEST_F(MemoryLedgerTest, PeakBreakdownIsTheSnapshotAtTheTotalPeak) {
  std::array<int64_t, kNumMemoryCategories> base{};
  for (int c = 0; c < kNumMemoryCategories; ++c) base[c] = ledger().current_bytes(Cat(c));
  ledger().reset_peaks();
  EXPECT_EQ(ledger().peak_breakdown(), base);
  torch::Tensor w, g, a;
  {
    ScopedMemoryCategory s(Cat::weights);
    w = torch::empty({1024}, torch::kFloat);  // 4096 B
  }
  {
    ScopedMemoryCategory s(Cat::gradients);
    g = torch::empty({1024}, torch::kDouble);  // 8192 B
  }
  const int64_t peak = ledger().peak_total();
  auto at_peak = ledger().peak_breakdown();
  EXPECT_EQ(at_peak[int(Cat::weights)], base[int(Cat::weights)] + 4096);
  EXPECT_EQ(at_peak[int(Cat::gradients)], base[int(Cat::gradients)] + 8192);
  int64_t sum = 0;
  for (int64_t v : at_peak) sum += v;
  EXPECT_EQ(sum, peak);
  // Below the peak: the breakdown stays, per-category peaks still move.
  g.reset();
  {
    ScopedMemoryCategory s(Cat::activations);
    a = torch::empty({512}, torch::kFloat);  // 2048 B
  }
  EXPECT_EQ(ledger().peak_total(), peak);
  EXPECT_EQ(ledger().peak_breakdown(), at_peak);
  EXPECT_EQ(ledger().peak_bytes(Cat::activations), base[int(Cat::activations)] + 2048);

  const nlohmann::json j = ledger().to_json();
  EXPECT_EQ(j.at("peak_bytes").get<int64_t>(), peak);
  EXPECT_EQ(j.at("current_bytes").get<int64_t>(), ledger().current_total());
  EXPECT_EQ(j.at("peak").at("gradients").get<int64_t>(), base[int(Cat::gradients)] + 8192);
  EXPECT_EQ(j.at("current").at("activations").get<int64_t>(), ledger().current_bytes(Cat::activations));
  EXPECT_EQ(j.at("peak_per_category").at("activations").get<int64_t>(), base[int(Cat::activations)] + 2048);
  EXPECT_EQ(j.at("current").size(), static_cast<size_t>(kNumMemoryCategories));
}

TEST_F(MemoryLedgerTest, RechargeMovesBytesAndTheFreeDecrementsTheNewCategory) {
  const int64_t tmp0 = ledger().current_bytes(Cat::temporaries);
  const int64_t opt0 = ledger().current_bytes(Cat::optimizer_state);
  const int64_t total0 = ledger().current_total();
  torch::Tensor t;
  {
    ScopedMemoryCategory s(Cat::temporaries);
    t = torch::zeros({10, 100}, torch::kBFloat16);  // 2000 B
  }
  EXPECT_EQ(ledger().current_bytes(Cat::temporaries), tmp0 + 2000);
  ledger().recharge(t, Cat::optimizer_state);
  EXPECT_EQ(ledger().charged_category(t), int(Cat::optimizer_state));
  EXPECT_EQ(ledger().current_bytes(Cat::temporaries), tmp0);
  EXPECT_EQ(ledger().current_bytes(Cat::optimizer_state), opt0 + 2000);
  EXPECT_GE(ledger().peak_bytes(Cat::optimizer_state), opt0 + 2000);
  EXPECT_EQ(ledger().current_total(), total0 + 2000);
  t.reset();
  EXPECT_EQ(ledger().current_bytes(Cat::optimizer_state), opt0);
  EXPECT_EQ(ledger().current_bytes(Cat::temporaries), tmp0);
  EXPECT_EQ(ledger().current_total(), total0);
}

TEST_F(MemoryLedgerTest, RechargeOfAViewMovesTheWholeStorageOnce) {
  const int64_t act0 = ledger().current_bytes(Cat::activations);
  const int64_t w0 = ledger().current_bytes(Cat::weights);
  torch::Tensor base;
  {
    ScopedMemoryCategory s(Cat::activations);
    base = torch::empty({100, 100}, torch::kFloat);  // 40000 B
  }
  auto view = base.slice(0, 10, 20).t();
  ledger().recharge(view, Cat::weights);
  ledger().recharge(base, Cat::weights);  // already there: nothing moves again
  ledger().recharge(view, Cat::weights);
  EXPECT_EQ(ledger().current_bytes(Cat::activations), act0);
  EXPECT_EQ(ledger().current_bytes(Cat::weights), w0 + 40000);
  base.reset();
  EXPECT_EQ(ledger().current_bytes(Cat::weights), w0 + 40000);  // the view keeps it alive
  view.reset();
  EXPECT_EQ(ledger().current_bytes(Cat::weights), w0);
}

TEST_F(MemoryLedgerTest, ForeignStoragesAreIgnored) {
  const auto before = ledger().to_json();
  // Memory the ledger did not allocate: from_blob, and a storage from c10's
  // default CPU allocator (as for tensors made before install()).
  std::vector<float> buffer(64, 1.0f);
  auto blob = torch::from_blob(buffer.data(), {64});
  c10::Storage storage(c10::Storage::use_byte_size_t(), 256, c10::GetDefaultCPUAllocator(), false);
  auto native = torch::empty({0}).set_(storage, 0, {64}, {1});
  EXPECT_EQ(ledger().charged_category(blob), -1);
  EXPECT_EQ(ledger().charged_category(native), -1);
  ledger().recharge(blob, Cat::weights);
  ledger().recharge(native, Cat::weights);
  ledger().recharge(torch::Tensor(), Cat::weights);
  native.reset();
  storage = c10::Storage();
  blob.reset();
  EXPECT_EQ(ledger().to_json(), before);
}

TEST_F(MemoryLedgerTest, WorkerThreadsChargeTheScopesCategory) {
  // The category is process-wide, so other threads (libtorch's intra-op
  // workers, or any std::thread) charge it too.
  const int64_t tmp0 = ledger().current_bytes(Cat::temporaries);
  std::vector<torch::Tensor> made(5);
  {
    ScopedMemoryCategory s(Cat::temporaries);
    at::parallel_for(0, 4, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) made[i] = torch::empty({256}, torch::kFloat);
    });
    std::thread worker([&] { made[4] = torch::empty({256}, torch::kFloat); });
    worker.join();
  }
  EXPECT_EQ(ledger().current_bytes(Cat::temporaries), tmp0 + 5 * 1024);
  made.clear();
  EXPECT_EQ(ledger().current_bytes(Cat::temporaries), tmp0);
}

TEST_F(MemoryLedgerTest, Bf16MatmulRunsAndIsCounted) {
  // bf16 mm goes through oneDNN, which allocates scratch memory with
  // raw_allocate (asserts context == data pointer).
  torch::manual_seed(3);
  const auto a32 = torch::randn({256, 256});
  const auto b32 = torch::randn({256, 256});
  const int64_t act0 = ledger().current_bytes(Cat::activations);
  const int64_t total0 = ledger().current_total();
  ledger().reset_peaks();
  torch::Tensor c;
  {
    ScopedMemoryCategory s(Cat::activations);
    const auto a = a32.to(torch::kBFloat16);
    const auto b = b32.to(torch::kBFloat16);
    c = torch::mm(a, b);
    for (int i = 0; i < 3; ++i) c = torch::mm(c.to(torch::kFloat).div(16).to(torch::kBFloat16), b);
    c = torch::mm(a, b);
  }
  ASSERT_EQ(c.scalar_type(), torch::kBFloat16);
  // The product is right, within what this CPU's bf16 kernel guarantees
  // (one bf16 rounding with oneDNN's fp32 sums, ~K roundings of the running
  // sum with libtorch's own bf16 gemm: bf16_testing.h). A wrong product, or
  // one read from memory the allocator handed out twice, is off by the
  // result's own size (|ref| ~ 16), far beyond either bound (~0.06 and ~2.5).
  const auto a16 = a32.to(torch::kBFloat16), b16 = b32.to(torch::kBFloat16);
  const auto ref = torch::mm(a16.to(torch::kFloat), b16.to(torch::kFloat));
  const auto bound = testing::bf16_mm_error_bound(a16, b16);
  const auto excess = ((c.to(torch::kFloat) - ref).abs() - bound).max().item<double>();
  EXPECT_LE(excess, 0.0) << "bf16 mm error beyond the bound (fp32 sums: " << testing::bf16_mm_accumulates_in_fp32()
                         << ")";
  // While they lived, a, b and c (3 x 128 KiB) were charged to activations.
  EXPECT_GE(ledger().peak_bytes(Cat::activations), act0 + 3 * 256 * 256 * 2);
  EXPECT_GE(ledger().peak_total(), total0 + 3 * 256 * 256 * 2);
  EXPECT_EQ(ledger().current_bytes(Cat::activations), act0 + static_cast<int64_t>(c.nbytes()));
  c.reset();
  EXPECT_EQ(ledger().current_bytes(Cat::activations), act0);
}

TEST_F(MemoryLedgerTest, RawAllocateRoundTrip) {
  c10::Allocator* alloc = c10::GetCPUAllocator();
  const int64_t other0 = ledger().current_bytes(Cat::other);
  void* p = alloc->raw_allocate(1000);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u);
  EXPECT_EQ(ledger().current_bytes(Cat::other), other0 + 1000);
  alloc->raw_deallocate(p);
  EXPECT_EQ(ledger().current_bytes(Cat::other), other0);
}

}  // namespace
}  // namespace shoestring
