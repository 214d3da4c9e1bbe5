#include <gtest/gtest.h>

#include <cmath>

#include <torch/torch.h>

#include "shoestring/train/flow_matching.h"
#include "shoestring/train/lr_schedule.h"

using namespace shoestring;

TEST(FlowMatching, InterpolationAndTarget) {
  torch::manual_seed(0);  // independent of the tests run before this one
  auto x0 = torch::randn({3, 2, 4, 4});
  auto eps = torch::randn({3, 2, 4, 4});
  auto t = torch::tensor({0.0f, 0.25f, 1.0f});
  auto xt = flow_interpolate(x0, eps, t);
  EXPECT_TRUE(torch::allclose(xt[0], x0[0]));
  // x0 + 1 * (eps - x0) rounds to eps within one ulp of max(|x0|, |eps|).
  EXPECT_TRUE(torch::allclose(xt[2], eps[2], 1e-6, 1e-6));
  EXPECT_TRUE(torch::allclose(xt[1], 0.75 * x0[1] + 0.25 * eps[1], 1e-6, 1e-6));
  // The target is the time derivative of x_t.
  auto dt = 1e-3f;
  auto t2 = t + dt;
  auto numeric = (flow_interpolate(x0, eps, t2) - xt) / dt;
  EXPECT_TRUE(torch::allclose(numeric, flow_target(x0, eps), 1e-2, 1e-2));
}

TEST(FlowMatching, TimeDistributions) {
  torch::manual_seed(0);
  auto u = sample_flow_times(200000, "uniform", 0, 1);
  EXPECT_NEAR(u.mean().item<double>(), 0.5, 0.005);
  auto ln = sample_flow_times(200000, "logit_normal", 0, 1);
  EXPECT_GT(ln.min().item<double>(), 0.0);
  EXPECT_LT(ln.max().item<double>(), 1.0);
  // logit(t) ~ N(0.5, 2): check its moments.
  auto ln2 = sample_flow_times(200000, "logit_normal", 0.5, 2.0);
  auto logit = torch::log(ln2 / (1 - ln2));
  EXPECT_NEAR(logit.mean().item<double>(), 0.5, 0.02);
  EXPECT_NEAR(logit.std().item<double>(), 2.0, 0.02);
}

TEST(FlowMatching, EulerIsExactForPointMass) {
  // For data concentrated at c, the exact velocity is v(x, t) = (x - c) / t and
  // the ODE path is a straight line: Euler integrates it exactly for any step count.
  auto c = torch::tensor({0.3f, -0.7f}).view({1, 2, 1, 1});
  VelocityFn v = [&](const at::Tensor& x, const at::Tensor& t) { return (x - c) / t.view({-1, 1, 1, 1}); };
  auto noise = torch::randn({5, 2, 1, 1});
  for (int steps : {1, 3, 10}) {
    auto out = sample_euler(v, noise, steps);
    EXPECT_TRUE(torch::allclose(out, c.expand({5, 2, 1, 1}), 1e-5, 1e-5)) << steps;
  }
}

TEST(LrSchedule, WarmupConstantCosine) {
  EXPECT_DOUBLE_EQ(learning_rate_at("constant", 1.0, 0, 10, 100), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate_at("constant_with_warmup", 1.0, 5, 10, 100), 0.5);
  EXPECT_DOUBLE_EQ(learning_rate_at("constant_with_warmup", 1.0, 50, 10, 100), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate_at("cosine", 2.0, 10, 10, 110), 2.0);
  EXPECT_NEAR(learning_rate_at("cosine", 2.0, 60, 10, 110), 1.0, 1e-12);
  EXPECT_NEAR(learning_rate_at("cosine", 2.0, 110, 10, 110), 0.0, 1e-12);
  EXPECT_NEAR(learning_rate_at("cosine", 1.0, 35, 10, 110), 0.5 * (1 + std::cos(M_PI * 0.25)), 1e-12);
}
