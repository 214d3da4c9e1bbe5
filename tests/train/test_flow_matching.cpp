// Rectified flow (train/flow_matching.h): interpolation, target, time
// distributions, Euler; and SD3's pieces (shift, "mode" density, loss
// weights, sampling schedule, Euler over it with CFG and skip-layer guidance)
// against values an independent PyTorch script computes from the formulas of
// Stability-AI/sd3.5, diffusers and kohya (scripts/gen_flow_reference.py,
// tests/data/train/flow_reference.json), plus closed forms.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/train/flow_matching.h"
#include "shoestring/train/lr_schedule.h"

#include "reference_testing.h"

using namespace shoestring;

namespace {

using shoestring::testing::doubles;
using shoestring::testing::max_diff;

nlohmann::json flow_reference() { return shoestring::testing::train_reference("flow_reference.json"); }

}  // namespace

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

TEST(FlowMatching, ShiftMatchesReference) {
  const nlohmann::json ref = flow_reference()["shift"];
  const at::Tensor sigma = doubles(ref["sigma"]);
  for (const char* k : {"1.0", "3.0", "0.5", "6.0"}) {
    const double shift = std::stod(k);
    const at::Tensor want = doubles(ref["values"][k]);
    const at::Tensor got = flow_shift(sigma, shift);
    EXPECT_EQ(got.scalar_type(), torch::kDouble);
    EXPECT_LT(max_diff(got, want), 1e-15) << k;
    EXPECT_LT(max_diff(flow_shift(sigma.to(torch::kFloat), shift), want), 3e-7) << k;  // float32 in, float32 out
    EXPECT_EQ(flow_shift(sigma.to(torch::kFloat), shift).scalar_type(), torch::kFloat);
    for (int64_t i = 0; i < sigma.size(0); ++i)
      EXPECT_NEAR(flow_shift(sigma[i].item<double>(), shift), want[i].item<double>(), 1e-15) << k << " " << i;
  }
  // Fixed ends, identity at shift 1, inverse: shift s then 1/s.
  EXPECT_DOUBLE_EQ(flow_shift(0.0, 3.0), 0.0);
  EXPECT_DOUBLE_EQ(flow_shift(1.0, 3.0), 1.0);
  EXPECT_DOUBLE_EQ(flow_shift(0.37, 1.0), 0.37);
  EXPECT_NEAR(flow_shift(flow_shift(0.37, 3.0), 1.0 / 3.0), 0.37, 1e-15);
  for (double bad : {0.0, -1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    EXPECT_THROW(flow_shift(0.5, bad), Error) << bad;
    EXPECT_THROW(flow_shift(torch::tensor({0.5}), bad), Error) << bad;
  }
}

TEST(FlowMatching, ModeDensityMatchesReference) {
  const nlohmann::json ref = flow_reference()["mode"];
  const at::Tensor u = doubles(ref["u"]);
  for (const char* k : {"1.29", "0.0", "-1.0", "1.75"})
    EXPECT_LT(max_diff(flow_mode_transform(u, std::stod(k)), doubles(ref["values"][k])), 1e-15) << k;
  // scale 0: t = 1 - u. The map is monotone only for -1 <= s <= 2 / (pi - 2).
  EXPECT_LT(max_diff(flow_mode_transform(u, 0.0), 1 - u), 1e-15);
  EXPECT_NO_THROW(flow_mode_transform(u, 2.0 / (M_PI - 2.0)));
  EXPECT_THROW(flow_mode_transform(u, 1.76), Error);
  EXPECT_THROW(flow_mode_transform(u, -1.01), Error);
  EXPECT_THROW(flow_mode_transform(u, std::nan("")), Error);

  // Drawing: one uniform per sample through the map, in [0, 1]; E[t] = 1/2 for every scale
  // (the integral of cos^2(pi u / 2) over [0, 1] is 1/2), and with scale 1.29 the middle is
  // denser than under the uniform: P(|t - 1/2| < 1/4) = u-measure of the preimage.
  torch::manual_seed(3);
  const at::Tensor t = sample_flow_times(200000, "mode", 0, 1);  // default scale 1.29
  torch::manual_seed(3);
  const at::Tensor u2 = torch::rand({200000}, torch::kFloat32);
  EXPECT_EQ(t.scalar_type(), torch::kFloat);
  EXPECT_LT(max_diff(t, flow_mode_transform(u2.to(torch::kDouble), kFlowModeScale)), 1e-7);
  EXPECT_GE(t.min().item<double>(), 0.0);
  EXPECT_LE(t.max().item<double>(), 1.0);
  EXPECT_NEAR(t.mean().item<double>(), 0.5, 0.005);
  const double middle = ((t - 0.5).abs() < 0.25).to(torch::kDouble).mean().item<double>();
  EXPECT_GT(middle, 0.7);  // 0.5 for the uniform, ~0.73 here
  torch::manual_seed(3);
  const at::Tensor t0 = sample_flow_times(1000, "mode", 0, 1, 0.0);
  torch::manual_seed(3);
  const at::Tensor u0 = 1 - torch::rand({1000});
  EXPECT_TRUE(torch::equal(t0, u0)) << max_diff(t0, u0);
  EXPECT_THROW(sample_flow_times(4, "mode", 0, 1, 2.0), Error);
  EXPECT_THROW(sample_flow_times(4, "cosmap", 0, 1), Error);
}

TEST(FlowMatching, TrainingShiftAppliesToDrawnTimes) {
  for (const char* mode : {"uniform", "logit_normal", "mode"}) {
    torch::manual_seed(9);
    const at::Tensor plain = sample_flow_times(50000, mode, 0.0, 1.0);
    torch::manual_seed(9);
    const at::Tensor shifted = sample_flow_times(50000, mode, 0.0, 1.0, kFlowModeScale, 3.0);
    EXPECT_EQ(shifted.scalar_type(), torch::kFloat);
    EXPECT_LT(max_diff(shifted, flow_shift(plain.to(torch::kDouble), 3.0)), 1e-6) << mode;
    // The median moves from 1/2 to flow_shift(1/2, 3) = 3/4 (all three are symmetric about 1/2).
    EXPECT_NEAR(shifted.median().item<double>(), 0.75, 0.01) << mode;
  }
  EXPECT_THROW(sample_flow_times(4, "uniform", 0, 1, kFlowModeScale, 0.0), Error);
  // The existing four-argument calls keep their stream.
  torch::manual_seed(2);
  const at::Tensor a = sample_flow_times(64, "logit_normal", 0.0, 1.0);
  torch::manual_seed(2);
  EXPECT_TRUE(torch::equal(a, torch::sigmoid(torch::randn({64}))));
}

TEST(FlowMatching, LossWeightsMatchReference) {
  const nlohmann::json ref = flow_reference()["loss_weight"];
  const at::Tensor sigma = doubles(ref["sigma"]);
  for (const char* k : {"none", "sigma_sqrt", "cosmap"}) {
    EXPECT_LT(max_diff(flow_loss_weight(sigma, k), doubles(ref["values"][k])), 1e-12) << k;
    const at::Tensor w = flow_loss_weight(sigma.to(torch::kFloat), k);
    EXPECT_EQ(w.scalar_type(), torch::kFloat) << k;
    EXPECT_EQ(w.sizes(), sigma.sizes()) << k;
  }
  // cosmap peaks at sigma 1/2 with 2 / (pi / 2) = 4 / pi and is 2 / pi at both ends.
  const at::Tensor c = flow_loss_weight(torch::tensor({0.0, 0.5, 1.0}, torch::kDouble), "cosmap");
  EXPECT_NEAR(c[1].item<double>(), 4.0 / M_PI, 1e-15);
  EXPECT_NEAR(c[0].item<double>(), 2.0 / M_PI, 1e-15);
  EXPECT_NEAR(c[2].item<double>(), 2.0 / M_PI, 1e-15);
  EXPECT_THROW(flow_loss_weight(sigma, "uniform"), Error);
  EXPECT_THROW(flow_loss_weight(sigma.view({2, 3}), "none"), Error);
}

TEST(FlowMatching, Sd3SigmasMatchReference) {
  for (const auto& c : flow_reference()["sd3_sigmas"]) {
    const double shift = c["shift"].get<double>();
    const int64_t steps = c["steps"].get<int64_t>();
    const at::Tensor s = sd3_sigmas(steps, shift);
    EXPECT_EQ(s.scalar_type(), torch::kDouble);
    ASSERT_EQ(s.size(0), steps + 1);
    EXPECT_LT(max_diff(s, doubles(c["f64"])), 1e-14) << shift << " " << steps;
    // The reference's own float32 computation (sd3_infer.py get_sigmas).
    EXPECT_LT(max_diff(s, doubles(c["reference_f32"])), 2e-7) << shift << " " << steps;
    EXPECT_EQ(s[0].item<double>(), 1.0);
    EXPECT_EQ(s[steps].item<double>(), 0.0);
    EXPECT_TRUE((s.slice(0, 1) < s.slice(0, 0, steps)).all().item<bool>()) << "decreasing";
    if (steps > 1) {  // the last non-zero entry is sigma_min = shift(0.001) shifted once more
      EXPECT_NEAR(s[steps - 1].item<double>(), flow_shift(flow_shift(0.001, shift), shift), 1e-15);
    }
  }
  EXPECT_THROW(sd3_sigmas(0, 3.0), Error);
  EXPECT_THROW(sd3_sigmas(4, 0.0), Error);
}

TEST(FlowMatching, EulerOverSigmasMatchesReference) {
  const nlohmann::json ref = flow_reference()["euler_linear"];
  const at::Tensor noise = doubles(ref["noise"]).view(ref["shape"].get<std::vector<int64_t>>()).to(torch::kFloat);
  VelocityFn v = [](const at::Tensor& x, const at::Tensor& t) {
    EXPECT_EQ(t.scalar_type(), torch::kFloat);
    EXPECT_EQ(t.dim(), 1);
    return 0.3 * x + 0.2 * t.view({-1, 1, 1, 1});
  };
  const at::Tensor out = sample_euler_sigmas(v, noise, sd3_sigmas(8, 3.0));
  EXPECT_EQ(out.scalar_type(), torch::kFloat);
  EXPECT_LT(max_diff(out.flatten(), doubles(ref["out"])), 1e-5);

  // The model is called at every sigma but the last, in order.
  std::vector<double> seen;
  VelocityFn record = [&](const at::Tensor& x, const at::Tensor& t) {
    seen.push_back(t[0].item<double>());
    return torch::zeros_like(x);
  };
  const at::Tensor sig = torch::tensor({1.0, 0.6, 0.2, 0.0}, torch::kDouble);
  EXPECT_TRUE(torch::equal(sample_euler_sigmas(record, noise, sig), noise));
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_NEAR(seen[1], 0.6, 1e-7);

  // Exact for a point mass at c (straight paths) on any schedule; the uniform schedule is sample_euler.
  const at::Tensor c = torch::tensor({0.3f, -0.7f}).view({1, 2, 1, 1});
  VelocityFn point = [&](const at::Tensor& x, const at::Tensor& t) { return (x - c) / t.view({-1, 1, 1, 1}); };
  const at::Tensor n2 = torch::randn({5, 2, 1, 1});
  for (int steps : {1, 4, 9})
    EXPECT_TRUE(
        torch::allclose(sample_euler_sigmas(point, n2, sd3_sigmas(steps, 3.0)), c.expand({5, 2, 1, 1}), 1e-5, 1e-5))
        << steps;
  EXPECT_TRUE(
      torch::allclose(sample_euler_sigmas(v, n2, torch::linspace(1, 0, 7)), sample_euler(v, n2, 6), 1e-6, 1e-6));
  EXPECT_THROW(sample_euler_sigmas(v, noise, torch::tensor({1.0})), Error);
  EXPECT_THROW(sample_euler_sigmas(v, noise, torch::ones({2, 2})), Error);
  EXPECT_THROW(sample_euler_sigmas(v, noise, torch::tensor({1.0, std::nan("")})), Error);
}

TEST(FlowMatching, GuidanceCombinesCfgAndSkipLayer) {
  const at::Tensor vc = torch::tensor({1.0f, 2.0f}), vu = torch::tensor({0.5f, -1.0f}),
                   vs = torch::tensor({0.0f, 3.0f});
  // v_u + s (v_c - v_u) and + slg (v_c - v_c_skip).
  EXPECT_TRUE(torch::allclose(combine_guidance({vc, vu, {}}, 5.0, 2.5), vu + 5.0 * (vc - vu)));
  EXPECT_TRUE(torch::allclose(combine_guidance({vc, vu, vs}, 5.0, 2.5), vu + 5.0 * (vc - vu) + 2.5 * (vc - vs)));
  EXPECT_TRUE(torch::allclose(combine_guidance({vc, vu, {}}, 1.0, 0.0), vc));
  // A skip pass that changes nothing gives plain CFG.
  EXPECT_TRUE(torch::equal(combine_guidance({vc, vu, vc}, 5.0, 2.5), combine_guidance({vc, vu, {}}, 5.0, 0.0)));
  EXPECT_THROW(combine_guidance({vc, {}, {}}, 5.0, 0.0), Error);

  // The active window: start * steps < i < end * steps, strict.
  const FlowGuidance g = FlowGuidance::sd35_medium();
  EXPECT_EQ(g.cfg_scale, 5.0);
  EXPECT_EQ(g.slg_scale, 2.5);
  EXPECT_EQ(g.slg_layers, (std::vector<int64_t>{7, 8, 9}));
  auto active = [&](const FlowGuidance& f, int64_t steps) {
    std::vector<int64_t> on;
    for (int64_t i = 0; i < steps; ++i)
      if (f.slg_active(i, steps)) on.push_back(i);
    return on;
  };
  EXPECT_EQ(active(g, 50), (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8, 9}));  // 0.5 < i < 10
  EXPECT_EQ(active(g, 20), (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(active(g, 8), (std::vector<int64_t>{1}));
  EXPECT_TRUE(active(g, 5).empty());  // 0.05 < i < 1
  FlowGuidance off = g;
  off.slg_scale = 0.0;
  EXPECT_TRUE(active(off, 50).empty());
  off = g;
  off.slg_layers.clear();
  EXPECT_TRUE(active(off, 50).empty());
  EXPECT_TRUE(active(FlowGuidance{}, 50).empty());  // SLG off by default
}

TEST(FlowMatching, GuidedEulerMatchesReference) {
  const nlohmann::json ref = flow_reference()["euler_guided"];
  const at::Tensor noise = doubles(ref["noise"]).view(ref["shape"].get<std::vector<int64_t>>()).to(torch::kFloat);
  FlowGuidance g = FlowGuidance::sd35_medium();
  g.cfg_scale = ref["cfg"].get<double>();
  g.slg_scale = ref["slg"].get<double>();
  g.slg_start = ref["start"].get<double>();
  g.slg_end = ref["end"].get<double>();
  const int64_t steps = ref["steps"].get<int64_t>();
  std::vector<int64_t> skip_steps;
  int64_t step = 0;
  GuidedVelocityFn model = [&](const at::Tensor& x, const at::Tensor& t, const std::vector<int64_t>& skip) {
    const at::Tensor s = t.view({-1, 1, 1, 1});
    GuidedVelocities v{0.3 * x + 0.1 * s, 0.2 * x - 0.4, {}};
    if (!skip.empty()) {
      EXPECT_EQ(skip, (std::vector<int64_t>{7, 8, 9}));
      skip_steps.push_back(step);
      v.cond_skip = 0.25 * x - 0.05 * s;
    }
    ++step;
    return v;
  };
  const at::Tensor out = sample_euler_guided(model, noise, sd3_sigmas(steps, ref["shift"].get<double>()), g);
  EXPECT_EQ(skip_steps, ref["active_steps"].get<std::vector<int64_t>>());
  EXPECT_LT(max_diff(out.flatten(), doubles(ref["out"])), 1e-4 * doubles(ref["out"]).abs().max().item<double>());

  // An unchanged skip pass equals plain CFG; cfg 1 without SLG equals the conditional model alone.
  GuidedVelocityFn same = [&](const at::Tensor& x, const at::Tensor& t, const std::vector<int64_t>& skip) {
    const at::Tensor vc = 0.3 * x + 0.1 * t.view({-1, 1, 1, 1});
    return GuidedVelocities{vc, 0.2 * x - 0.4, skip.empty() ? at::Tensor() : vc.clone()};
  };
  FlowGuidance cfg_only = g;
  cfg_only.slg_scale = 0.0;
  const at::Tensor sig = sd3_sigmas(steps, 3.0);
  EXPECT_TRUE(torch::equal(sample_euler_guided(same, noise, sig, g), sample_euler_guided(same, noise, sig, cfg_only)));
  FlowGuidance plain;
  plain.cfg_scale = 1.0;
  VelocityFn cond = [](const at::Tensor& x, const at::Tensor& t) { return 0.3 * x + 0.1 * t.view({-1, 1, 1, 1}); };
  EXPECT_TRUE(
      torch::allclose(sample_euler_guided(same, noise, sig, plain), sample_euler_sigmas(cond, noise, sig), 1e-6, 1e-6));
  // A model that ignores the skip request on an active step is an error.
  GuidedVelocityFn lazy = [](const at::Tensor& x, const at::Tensor&, const std::vector<int64_t>&) {
    return GuidedVelocities{x, x, {}};
  };
  EXPECT_THROW(sample_euler_guided(lazy, noise, sig, g), Error);
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
