// The memory ledger on CUDA (core/memory_ledger_cuda.h): allocations are
// charged to the current category, frees discharge them, a training step's
// categories are all non-zero, and the totals agree with the caching
// allocator's own statistics. Skips when no CUDA device is present.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include "cuda_testing.h"
#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/core/memory_ledger_cuda.h"
#include "shoestring/optim/factory.h"

namespace shoestring {
namespace {

using Cat = MemoryCategory;

CudaMemoryLedger& ledger() { return CudaMemoryLedger::global(); }

at::TensorOptions cuda_floats() { return at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, 0); }

TEST(CudaMemoryLedger, ChargesTheCurrentCategoryAndDischargesOnFree) {
  SHOESTRING_REQUIRE_CUDA();
  ledger().install(0);
  ASSERT_TRUE(ledger().installed());
  EXPECT_EQ(ledger().device(), 0);
  const int64_t w0 = ledger().current_bytes(Cat::weights);
  const int64_t total0 = ledger().current_total();
  constexpr int64_t kElems = 1 << 18;  // 1 MiB: a multiple of the allocator's 512-byte rounding
  {
    at::Tensor w;
    {
      ScopedMemoryCategory category(Cat::weights);
      w = at::empty({kElems}, cuda_floats());
    }
    EXPECT_EQ(ledger().current_bytes(Cat::weights) - w0, kElems * 4);
    EXPECT_EQ(ledger().current_total() - total0, kElems * 4);
    if (std::string(ledger().attribution()) == "trace") {
      EXPECT_EQ(ledger().charged_category(w), static_cast<int>(Cat::weights));
      ledger().recharge(w, Cat::gradients);
      EXPECT_EQ(ledger().charged_category(w), static_cast<int>(Cat::gradients));
      EXPECT_EQ(ledger().current_bytes(Cat::weights), w0);
    }
    ScopedMemoryCategory category(Cat::weights);  // the free is charged here on the delta path
    w.reset();
  }
  EXPECT_EQ(ledger().current_total(), total0);
  EXPECT_EQ(ledger().current_bytes(Cat::host_offload), 0);
  EXPECT_THROW(ledger().install(1 << 20), Error);
}

TEST(CudaMemoryLedger, TrainingStepFillsEveryCategoryAndAgreesWithTheAllocator) {
  SHOESTRING_REQUIRE_CUDA();
  ledger().install(0);
  ledger().reset_peaks();
  at::Tensor w1, w2;
  {
    ScopedMemoryCategory category(Cat::weights);
    w1 = at::randn({512, 1024}, cuda_floats()).mul_(0.02).set_requires_grad(true);
    w2 = at::randn({1024, 256}, cuda_floats()).mul_(0.02).set_requires_grad(true);
  }
  OptimizerOptions options;
  auto opt = make_optimizer("AdamW", {}, {{"w1", w1}, {"w2", w2}}, options);
  const at::Tensor x = at::randn({64, 512}, cuda_floats());
  for (int step = 0; step < 2; ++step) {
    at::Tensor loss;
    {
      ScopedMemoryCategory category(Cat::activations);
      loss = at::relu(x.matmul(w1)).matmul(w2).pow(2).mean();
    }
    {
      ScopedMemoryCategory category(Cat::temporaries);
      loss.backward();
    }
    ledger().recharge(w1.grad(), Cat::gradients);
    ledger().recharge(w2.grad(), Cat::gradients);
    opt->step(1e-3);  // state is created under optimizer_state
    w1.mutable_grad().reset();
    w2.mutable_grad().reset();
  }
  const auto at_peak = ledger().peak_breakdown();
  for (const Cat c : {Cat::weights, Cat::optimizer_state, Cat::activations}) {
    EXPECT_GT(ledger().peak_bytes(c), 0) << to_string(c);
  }
  if (std::string(ledger().attribution()) == "trace") {
    EXPECT_GT(ledger().peak_bytes(Cat::gradients), 0);
    EXPECT_GT(ledger().peak_bytes(Cat::temporaries), 0);
  }
  EXPECT_GE(ledger().peak_bytes(Cat::weights), (512 * 1024 + 1024 * 256) * 4);
  EXPECT_GE(ledger().peak_bytes(Cat::optimizer_state), 2 * (512 * 1024 + 1024 * 256) * 4);
  int64_t sum = 0;
  for (const int64_t b : at_peak) sum += b;
  EXPECT_EQ(sum, ledger().peak_total());
  const CudaAllocatorStats a = ledger().allocator_stats();
  // The ledger sees a subset of what the allocator hands out (not what was
  // allocated before install()), and requested bytes <= rounded blocks.
  EXPECT_LE(ledger().peak_total(), a.allocated_peak);
  EXPECT_LE(a.allocated_peak, a.reserved_peak);
  EXPECT_GT(a.reserved_peak, 0);
  const nlohmann::json j = ledger().to_json();
  EXPECT_EQ(j.at("device").get<int>(), 0);
  EXPECT_GT(j.at("peak").at("weights").get<int64_t>(), 0);
  EXPECT_EQ(j.at("allocator").at("reserved_peak_bytes").get<int64_t>(), a.reserved_peak);
}

}  // namespace
}  // namespace shoestring
