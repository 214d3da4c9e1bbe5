#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/optim/lion.h"
#include "golden_trajectory.h"

using namespace shoestring;


// Golden values: scripts/gen_optim_reference.py (Lion written step by step in PyTorch).
TEST(Lion, MatchesPyTorchReferenceOver50Steps) {
  const nlohmann::json ref = shoestring::testing::load_golden("lion_compass_reference.json");
  const auto& run = ref["lion"];
  const size_t np = ref["shapes"].size();
  shoestring::testing::GoldenParams g = shoestring::testing::golden_params(ref, run);
  LionOptions lo;
  lo.beta1 = run["betas"][0];
  lo.beta2 = run["betas"][1];
  Lion opt(g.optim_params, lo, {});
  const int checked = shoestring::testing::replay_golden_steps(opt, g.params, ref, run, "lion");
  EXPECT_EQ(checked, 30);
  auto st = opt.state_tensors();
  ASSERT_EQ(st.size(), np);
  EXPECT_EQ(st[0].first, "p0.exp_avg");
  EXPECT_EQ(st[0].second.scalar_type(), torch::kFloat);
  EXPECT_EQ(opt.state_bytes(), 4 * (30 + 5 + 48));
}

TEST(Lion, UpdateHasMagnitudeLrAndDecayIsDecoupled) {
  // One step from zero momentum: p <- p(1 - lr wd) - lr sign(g) (elements with g = 0 only decay).
  auto p = torch::tensor({1.0f, -2.0f, 3.0f, 0.5f}).requires_grad_(true);
  Lion opt({{"w", p, 0.5}}, {}, {});
  p.mutable_grad() = torch::tensor({1e-6f, -100.0f, 0.0f, -3.0f});
  opt.step(0.1);
  auto expected = torch::tensor({1.0f * 0.95f - 0.1f, -2.0f * 0.95f + 0.1f, 3.0f * 0.95f, 0.5f * 0.95f + 0.1f});
  EXPECT_TRUE(torch::allclose(p.detach(), expected, 0, 1e-6));
}

TEST(Lion, Bf16StateAndWeightsFollowFp32) {
  torch::manual_seed(5);
  const int64_t n = 4096;
  auto init = torch::randn({n}).to(torch::kBFloat16).to(torch::kFloat);  // bf16-exact start
  auto run = [&](at::ScalarType wdtype, at::ScalarType sdtype, bool sr = true) {
    auto p = init.to(wdtype, /*non_blocking=*/false, /*copy=*/true).requires_grad_(true);
    OptimizerOptions o;
    o.state_dtype = sdtype;
    o.stochastic_rounding = sr;
    o.seed = 4;
    Lion opt({{"w", p, 0.1}}, {}, o);
    torch::manual_seed(6);
    for (int s = 0; s < 50; ++s) {
      // a consistent descent direction plus noise, so the momentum matters
      p.mutable_grad() = (p.detach().to(torch::kFloat) * 0.5 + torch::randn({n}) * 0.1).to(wdtype);
      opt.step(1e-3);
    }
    EXPECT_EQ(opt.state_tensors()[0].second.scalar_type(), sdtype);
    return p.detach().to(torch::kFloat);
  };
  auto fp32 = run(torch::kFloat, torch::kFloat);
  auto bf16_state = run(torch::kFloat, torch::kBFloat16);
  auto bf16_all = run(torch::kBFloat16, torch::kBFloat16);
  auto bf16_rtn = run(torch::kBFloat16, torch::kBFloat16, /*sr=*/false);
  const double moved = (fp32 - init).norm().item<double>();
  const double err_state = (bf16_state - fp32).norm().item<double>() / moved;
  const double err_sr = (bf16_all - fp32).norm().item<double>() / moved;
  const double err_rtn = (bf16_rtn - fp32).norm().item<double>() / moved;
  EXPECT_GT(moved, 0.5);
  EXPECT_LT(err_state, 0.05);
  // bf16 weights: each step's update (lr) is below half a bf16 ulp for |p| > 0.5,
  // so round-to-nearest stalls while stochastic rounding follows fp32 up to its noise.
  EXPECT_LT(err_sr, 0.4);
  EXPECT_GT(err_rtn, 0.6);
  // No systematic drift: the mean difference is within 4 standard errors of 0.
  auto diff = bf16_all - fp32;
  EXPECT_LT(std::abs(diff.mean().item<double>()), 4 * diff.std().item<double>() / std::sqrt(double(diff.numel())));
  OptimizerOptions bad;
  bad.state_dtype = torch::kHalf;
  auto q = torch::zeros({2}).requires_grad_(true);
  EXPECT_THROW(Lion({{"w", q, 0.0}}, {}, bad), Error);
}

TEST(Lion, ParsesKohyaArgs) {
  auto o = parse_lion_args({"weight_decay=0.1", "betas=0.95,0.98"});
  EXPECT_DOUBLE_EQ(o.weight_decay, 0.1);
  EXPECT_DOUBLE_EQ(o.beta1, 0.95);
  EXPECT_DOUBLE_EQ(o.beta2, 0.98);
  auto d = parse_lion_args({});
  EXPECT_DOUBLE_EQ(d.beta1, 0.9);
  EXPECT_DOUBLE_EQ(d.beta2, 0.99);
  EXPECT_DOUBLE_EQ(d.weight_decay, 0.0);
  try {
    parse_lion_args({"eps=1e-8"});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("valid: weight_decay, betas"), std::string::npos) << e.what();
  }
  try {
    parse_lion_args({"weight_decay=0.1x"});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("weight_decay"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_lion_args({"betas=0.9"}), Error);
  EXPECT_THROW(parse_lion_args({"betas=0.9,1.5"}), Error);
  EXPECT_THROW(parse_lion_args({"weight_decay"}), Error);
  EXPECT_THROW(parse_lion_args({"weight_decay=-1"}), Error);
}
