#include <gtest/gtest.h>

#include <cmath>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/optim/grad_accumulation.h"

using namespace shoestring;

// 1000 micro-batches each adding 1e-4 to an accumulator that starts at 1.0
// (the first micro-batch). The exact sum is 1.1. bf16 spacing at 1.0 is
// 2^-7 = 0.0078, so round-to-nearest drops every 1e-4 addend; stochastic
// rounding keeps the sum unbiased (REFERENCE.md: "Adding 1e-4 to 1.0 a
// thousand times: round-to-nearest stays 1.0, SR ends near 1.1").
TEST(GradientAccumulator, Bf16RoundToNearestLosesTinyGradientsStochasticRoundingKeepsTheirSum) {
  const int64_t n = 4096;
  auto p = torch::zeros({n}, torch::kBFloat16);
  auto run = [&](GradAccumulationMode mode) {
    GradientAccumulator acc({p}, mode, 77);
    acc.add(0, torch::ones({n}, torch::kBFloat16), 0);
    auto tiny = torch::full({n}, 1e-4, torch::kBFloat16);  // bf16(1e-4) = 1.0014e-4
    for (int64_t k = 1; k <= 1000; ++k) acc.add(0, tiny, k);
    return acc.get(0).to(torch::kFloat64);
  };
  const double addend = torch::full({1}, 1e-4, torch::kBFloat16).to(torch::kFloat64).item<double>();
  const double exact = 1.0 + 1000 * addend;
  at::Tensor fp32 = run(GradAccumulationMode::fp32);
  at::Tensor rtn = run(GradAccumulationMode::native);
  at::Tensor sr = run(GradAccumulationMode::bf16_sr);
  EXPECT_NEAR(fp32.mean().item<double>(), exact, 1e-4);
  EXPECT_EQ(rtn.min().item<double>(), 1.0);  // every tiny gradient lost
  EXPECT_EQ(rtn.max().item<double>(), 1.0);
  const double mean = sr.mean().item<double>();
  const double se = sr.std().item<double>() / std::sqrt(static_cast<double>(n));
  EXPECT_GT(se, 0.0);   // SR is random per element
  EXPECT_LT(se, 2e-3);  // and not wildly so
  EXPECT_LT(std::abs(mean - exact), 4 * se) << "mean " << mean << " exact " << exact << " se " << se;
  EXPECT_GT(mean, 1.09);  // far from the round-to-nearest result
}

TEST(GradientAccumulator, FirstAddCopiesLaterAddsSumAndFinishReturnsFp32) {
  auto p = torch::zeros({2, 3});
  GradientAccumulator acc({p}, GradAccumulationMode::fp32, 0);
  EXPECT_FALSE(acc.has(0));
  auto g1 = torch::full({2, 3}, 1.5);
  acc.add(0, g1, 0);
  g1.fill_(100.0);  // not aliased without may_alias
  acc.add(0, torch::full({2, 3}, 0.25), 1);
  EXPECT_TRUE(torch::equal(acc.get(0), torch::full({2, 3}, 1.75)));
  EXPECT_EQ(acc.buffer_bytes(), 6 * 4);
  at::Tensor total = acc.finish(0, torch::full({2, 3}, 0.25, torch::kBFloat16));
  EXPECT_EQ(total.scalar_type(), torch::kFloat32);
  EXPECT_TRUE(torch::equal(total, torch::full({2, 3}, 2.0)));
  EXPECT_FALSE(acc.has(0));
  EXPECT_EQ(acc.buffer_bytes(), 0);
  EXPECT_FALSE(acc.finish(0, at::Tensor()).defined());
}

TEST(GradientAccumulator, Bf16BufferHalvesTheBytesAndIsChargedToGradients) {
  MemoryLedger::global().install();
  auto p = torch::zeros({10, 10});
  GradientAccumulator acc({p}, GradAccumulationMode::bf16_sr, 1);
  acc.add(0, torch::full({10, 10}, 0.5), 3);  // 0.5 is bf16-exact
  EXPECT_EQ(acc.buffer_dtype(0), torch::kBFloat16);
  EXPECT_EQ(acc.get(0).scalar_type(), torch::kBFloat16);
  EXPECT_EQ(acc.buffer_bytes(), 100 * 2);
  EXPECT_EQ(MemoryLedger::global().charged_category(acc.get(0)), static_cast<int>(MemoryCategory::gradients));
  EXPECT_TRUE(torch::equal(acc.finish(0, torch::full({10, 10}, 0.25)), torch::full({10, 10}, 0.75)));
  acc.add(0, torch::ones({10, 10}), 4);
  acc.reset();
  EXPECT_FALSE(acc.has(0));
}

TEST(GradientAccumulator, NativeModeUsesTheParameterDtype) {
  GradientAccumulator acc({torch::zeros({4}, torch::kBFloat16), torch::zeros({4})}, GradAccumulationMode::native, 0);
  EXPECT_EQ(acc.buffer_dtype(0), torch::kBFloat16);
  EXPECT_EQ(acc.buffer_dtype(1), torch::kFloat32);
}

TEST(GradientAccumulator, RejectsBadInput) {
  GradientAccumulator acc({torch::zeros({4})}, GradAccumulationMode::fp32, 0);
  EXPECT_THROW(acc.add(1, torch::zeros({4}), 0), Error);
  EXPECT_THROW(acc.add(0, torch::zeros({5}), 0), Error);
  EXPECT_THROW(parse_grad_accumulation_mode("bf16"), Error);
  EXPECT_EQ(parse_grad_accumulation_mode("bf16_sr"), GradAccumulationMode::bf16_sr);
  EXPECT_STREQ(to_string(GradAccumulationMode::fp32), "fp32");
  EXPECT_THROW(GradientAccumulator({torch::zeros({2}, torch::kLong)}, GradAccumulationMode::fp32, 0), Error);
}
