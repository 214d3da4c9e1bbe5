#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/optim/compass.h"
#include "golden_trajectory.h"

using namespace shoestring;

namespace {
/// Runs the reference trajectory `key` of lion_compass_reference.json and
/// returns how many parameter snapshots were compared.
int check_compass_run(const char* key) {
  const nlohmann::json ref = shoestring::testing::load_golden("lion_compass_reference.json");
  const auto& run = ref[key];
  shoestring::testing::GoldenParams g = shoestring::testing::golden_params(ref, run);
  CompassOptions co;
  co.beta1 = run["betas"][0];
  co.beta2 = run["betas"][1];
  co.amp_fac = run["amp_fac"];
  co.eps = run["eps"];
  co.centralization = run["centralization"];
  Compass opt(g.optim_params, co, {});
  const int checked = shoestring::testing::replay_golden_steps(opt, g.params, ref, run, key);
  EXPECT_EQ(opt.state_bytes(), 8 * (30 + 5 + 48));
  return checked;
}
}  // namespace

// Golden values: scripts/gen_optim_reference.py (compass.py's update written
// step by step in PyTorch), with centralization 0.5 and weight decay on two of
// the three tensors.
TEST(Compass, MatchesPyTorchReferenceWithCentralization) { EXPECT_EQ(check_compass_run("compass"), 30); }

TEST(Compass, MatchesPyTorchReferenceDefaults) { EXPECT_EQ(check_compass_run("compass_default"), 30); }

TEST(Compass, FirstStepByHand) {
  // t = 1, m0 = v0 = 0: m = (1-b1) g; gh = g (1 + amp (1-b1)); v = (1-b2) gh^2;
  // denom = |gh| + eps; s = lr / (1-b1) = 10 lr. So p <- p (1 - s wd) - s sign(g) (approximately).
  auto p = torch::tensor({1.0f, -1.0f}).requires_grad_(true);
  Compass opt({{"w", p, 0.01}}, {}, {});
  p.mutable_grad() = torch::tensor({0.3f, -2.0f});
  opt.step(1e-3);
  const float s = 1e-3f / 0.1f;
  auto expected = torch::tensor({1.0f * (1 - s * 0.01f) - s, -1.0f * (1 - s * 0.01f) + s});
  EXPECT_TRUE(torch::allclose(p.detach(), expected, 0, 1e-6)) << p;
}

TEST(Compass, Bf16StateFollowsFp32) {
  torch::manual_seed(8);
  auto init = torch::randn({64, 64}).to(torch::kBFloat16).to(torch::kFloat);  // bf16-exact start
  auto run = [&](at::ScalarType wdtype, at::ScalarType sdtype, bool sr = true) {
    auto p = init.to(wdtype, /*non_blocking=*/false, /*copy=*/true).requires_grad_(true);
    OptimizerOptions o;
    o.state_dtype = sdtype;
    o.stochastic_rounding = sr;
    o.seed = 2;
    CompassOptions co;
    co.centralization = 1.0;
    Compass opt({{"w", p, 0.01}}, co, o);
    torch::manual_seed(9);
    for (int s = 0; s < 50; ++s) {
      p.mutable_grad() = (p.detach().to(torch::kFloat) * 0.5 + torch::randn({64, 64}) * 0.1).to(wdtype);
      opt.step(1e-3);
    }
    for (const auto& [name, t] : opt.state_tensors()) EXPECT_EQ(t.scalar_type(), sdtype) << name;
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
  // bf16 weights: most late updates are below half a bf16 ulp, so round-to-nearest
  // lags while stochastic rounding follows fp32 up to its noise.
  EXPECT_LT(err_sr, 0.3);
  EXPECT_GT(err_rtn, 0.4);
  // No systematic drift: the mean difference is within 4 standard errors of 0.
  auto diff = bf16_all - fp32;
  EXPECT_LT(std::abs(diff.mean().item<double>()), 4 * diff.std().item<double>() / std::sqrt(double(diff.numel())));
}

TEST(Compass, ParsesKohyaArgs) {
  auto o = parse_compass_args({"weight_decay=0.01", "betas=0.8,0.99", "eps=1e-6", "amp_fac=3", "centralization=0.5"});
  EXPECT_DOUBLE_EQ(o.weight_decay, 0.01);
  EXPECT_DOUBLE_EQ(o.beta1, 0.8);
  EXPECT_DOUBLE_EQ(o.beta2, 0.99);
  EXPECT_DOUBLE_EQ(o.eps, 1e-6);
  EXPECT_DOUBLE_EQ(o.amp_fac, 3.0);
  EXPECT_DOUBLE_EQ(o.centralization, 0.5);
  auto d = parse_compass_args({});
  EXPECT_DOUBLE_EQ(d.beta1, 0.9);
  EXPECT_DOUBLE_EQ(d.beta2, 0.999);
  EXPECT_DOUBLE_EQ(d.amp_fac, 2.0);
  EXPECT_DOUBLE_EQ(d.eps, 1e-8);
  EXPECT_DOUBLE_EQ(d.weight_decay, 0.0);
  EXPECT_DOUBLE_EQ(d.centralization, 0.0);
  try {
    parse_compass_args({"momentum=0.9"});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("valid: weight_decay, betas, eps, amp_fac, centralization"), std::string::npos)
        << e.what();
  }
  try {
    parse_compass_args({"amp_fac=two"});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("amp_fac"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_compass_args({"eps=0"}), Error);
  EXPECT_THROW(parse_compass_args({"betas=1,0.9"}), Error);
}
