// kohya's loss and noise options (train/diffusion_loss.h) against their
// formulas, written out here in double precision from the papers and kohya's
// library/custom_train_functions.py / train_util.py: SNR of Stable
// Diffusion's schedule, min-SNR-gamma and debiased weights (epsilon and
// v-prediction), the Huber threshold schedules, the four loss types, offset
// noise and pyramid noise (replaying the same random draws).
#include <gtest/gtest.h>

#include <cmath>

#include <torch/torch.h>

#include "../error_testing.h"
#include "shoestring/train/ddpm.h"
#include "shoestring/train/diffusion_loss.h"

using namespace shoestring;
using shoestring::testing::error_of;

namespace {

// alpha_bar_t of SD's "scaled_linear" schedule, from its definition:
// beta linear in sqrt from sqrt(0.00085) to sqrt(0.012) over 1000 steps.
std::vector<double> alpha_bar() {
  std::vector<double> ab(1000);
  double prod = 1.0;
  for (int i = 0; i < 1000; ++i) {
    const double s = std::sqrt(0.00085) + (std::sqrt(0.012) - std::sqrt(0.00085)) * i / 999.0;
    prod *= 1.0 - s * s;
    ab[static_cast<size_t>(i)] = prod;
  }
  return ab;
}

const std::vector<int64_t> kSteps = {0, 1, 10, 100, 250, 500, 750, 999};

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-30); }

}  // namespace

TEST(DiffusionLoss, SnrWeightsFollowTheirFormulas) {
  const DdpmSchedule schedule = DdpmSchedule::stable_diffusion();
  const std::vector<double> ab = alpha_bar();
  const at::Tensor t = torch::tensor(kSteps, torch::kLong);
  const at::Tensor snr = snr_of_timesteps(schedule.alphas_cumprod(), t);
  for (const bool v : {false, true}) {
    const at::Tensor min_snr = min_snr_weight(snr, 5.0, v);
    const at::Tensor debiased = debiased_weight(snr, v);
    EXPECT_EQ(min_snr.scalar_type(), torch::kFloat32);
    for (size_t i = 0; i < kSteps.size(); ++i) {
      const double s = ab[static_cast<size_t>(kSteps[i])] / (1.0 - ab[static_cast<size_t>(kSteps[i])]);
      EXPECT_LT(rel(snr[static_cast<int64_t>(i)].item<double>(), s), 1e-9) << kSteps[i];
      const double want_min = std::min(s, 5.0) / (v ? s + 1.0 : s);
      const double clamped = std::min(s, 1000.0);  // t = 0: SNR ~ 1175, clamped
      const double want_debiased = v ? 1.0 / (clamped + 1.0) : 1.0 / std::sqrt(clamped);
      EXPECT_LT(rel(min_snr[static_cast<int64_t>(i)].item<double>(), want_min), 1e-6) << kSteps[i] << " v " << v;
      EXPECT_LT(rel(debiased[static_cast<int64_t>(i)].item<double>(), want_debiased), 1e-6) << kSteps[i] << " v " << v;
    }
  }
  EXPECT_GT(snr[0].item<double>(), 1000.0);  // the clamp above was exercised
  EXPECT_NE(error_of([&] { snr_of_timesteps(schedule.alphas_cumprod(), torch::tensor({1000}, torch::kLong)); })
                .find("[0, 1000)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { min_snr_weight(snr, 0.0, false); }).find("min_snr_gamma"), std::string::npos);
}

TEST(DiffusionLoss, HuberThresholdSchedules) {
  const DdpmSchedule schedule = DdpmSchedule::stable_diffusion();
  const std::vector<double> ab = alpha_bar();
  const at::Tensor t = torch::tensor(kSteps, torch::kLong);
  const double c = 0.1, scale = 1.5;
  const at::Tensor constant = huber_threshold("constant", c, scale, t, at::Tensor());
  const at::Tensor exponential = huber_threshold("exponential", c, scale, t, schedule.alphas_cumprod());
  const at::Tensor snr = huber_threshold("snr", c, scale, t, schedule.alphas_cumprod());
  for (size_t i = 0; i < kSteps.size(); ++i) {
    const auto k = static_cast<int64_t>(i);
    const double step = static_cast<double>(kSteps[i]);
    EXPECT_LT(rel(constant[k].item<double>(), c * scale), 1e-6);
    // exp(-alpha t) with alpha = -ln(c) / 1000: c^(t / 1000), then the scale.
    EXPECT_LT(rel(exponential[k].item<double>(), std::pow(c, step / 1000.0) * scale), 1e-6) << kSteps[i];
    const double sigma = std::sqrt((1.0 - ab[static_cast<size_t>(kSteps[i])]) / ab[static_cast<size_t>(kSteps[i])]);
    EXPECT_LT(rel(snr[k].item<double>(), (1.0 - c) / ((1.0 + sigma) * (1.0 + sigma)) + c), 1e-6) << kSteps[i];
  }
  // Low noise: the threshold is near 1 (L2-like); high noise: near c (L1-like).
  EXPECT_GT(snr[0].item<double>(), 0.8);
  EXPECT_LT(snr[7].item<double>(), 0.2);
  EXPECT_NE(error_of([&] { huber_threshold("bogus", c, scale, t, schedule.alphas_cumprod()); }).find("bogus"),
            std::string::npos);
  EXPECT_NE(error_of([&] { huber_threshold("exponential", 0.0, scale, t, schedule.alphas_cumprod()); })
                .find("(0, 1]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { huber_threshold("snr", c, scale, t, at::Tensor()); }).find("constant"), std::string::npos);
}

TEST(DiffusionLoss, LossTypesFollowConditionalLoss) {
  torch::manual_seed(3);
  const at::Tensor p = torch::randn({3, 2, 4, 4}) * 2;
  const at::Tensor y = torch::randn({3, 2, 4, 4});
  const at::Tensor w = torch::tensor({0.5f, 1.0f, 2.0f});
  const at::Tensor c = torch::tensor({0.05f, 0.5f, 1.0f});
  // Plain l2 is torch's mse_loss, bit for bit.
  EXPECT_TRUE(torch::equal(diffusion_loss(p, y, "l2", at::Tensor(), at::Tensor()), torch::mse_loss(p, y)));
  auto reference = [&](const std::string& type, bool weighted) {
    const at::Tensor pd = p.to(torch::kDouble), yd = y.to(torch::kDouble);
    double total = 0;
    for (int64_t b = 0; b < 3; ++b) {
      const at::Tensor d = pd[b] - yd[b];
      const double cb = c[b].item<double>();
      at::Tensor e;
      if (type == "l2") e = d * d;
      if (type == "l1") e = d.abs();
      if (type == "huber") e = 2 * cb * ((d * d + cb * cb).sqrt() - cb);
      if (type == "smooth_l1") e = 2 * ((d * d + cb * cb).sqrt() - cb);
      total += (weighted ? w[b].item<double>() : 1.0) * e.mean().item<double>();
    }
    return total / 3.0;
  };
  for (const std::string type : {"l2", "l1", "huber", "smooth_l1"}) {
    for (const bool weighted : {false, true}) {
      const at::Tensor loss = diffusion_loss(p, y, type, weighted ? w : at::Tensor(), c);
      EXPECT_EQ(loss.dim(), 0);
      EXPECT_LT(rel(loss.item<double>(), reference(type, weighted)), 1e-5) << type << " weighted " << weighted;
    }
  }
  // A small difference d = 0.05 against c = 1: huber is about d^2 (L2-like;
  // the exact value is 2 (sqrt(1 + d^2) - 1) = d^2 (1 - d^2 / 4 + ...)).
  const at::Tensor small = y + 0.05;
  EXPECT_LT(rel(diffusion_loss(small, y, "huber", at::Tensor(), torch::full({3}, 1.0f)).item<double>(), 0.0025), 2e-3);
  EXPECT_NE(error_of([&] { diffusion_loss(p, y, "huber", at::Tensor(), at::Tensor()); }).find("huber_c"),
            std::string::npos);
  EXPECT_NE(error_of([&] { diffusion_loss(p, y, "l3", at::Tensor(), c); }).find("l3"), std::string::npos);
  EXPECT_NE(error_of([&] { diffusion_loss(p, y.narrow(0, 0, 2), "l2", at::Tensor(), c); }).find("shape"),
            std::string::npos);
}

TEST(DiffusionLoss, NoiseOffsetAddsAPerChannelNormal) {
  torch::manual_seed(11);
  const at::Tensor latents = torch::randn({2, 4, 6, 6}) + 0.7;
  const at::Tensor noise = torch::randn({2, 4, 6, 6});
  for (const double adaptive : {0.0, 0.25}) {
    torch::manual_seed(12);
    const at::Tensor got = apply_noise_offset(noise, latents, 0.1, adaptive);
    torch::manual_seed(12);  // the same per-sample, per-channel draw
    const at::Tensor n = torch::randn({2, 4, 1, 1});
    at::Tensor offset = torch::full({2, 4, 1, 1}, 0.1);
    if (adaptive != 0) offset = (offset + adaptive * latents.mean({2, 3}, true).abs()).clamp_min(0.0);
    EXPECT_TRUE(torch::allclose(got, noise + offset * n, 1e-6, 1e-6)) << adaptive;
    // Constant over the pixels of each (sample, channel).
    const at::Tensor shift = got - noise;
    EXPECT_LT((shift - shift.mean({2, 3}, true)).abs().max().item<double>(), 1e-6);
  }
}

TEST(DiffusionLoss, PyramidNoiseReplaysItsDraws) {
  for (const auto& [iterations, h, w] : {std::tuple<int64_t, int64_t, int64_t>{1, 8, 8}, {3, 16, 12}, {12, 8, 8}}) {
    torch::manual_seed(21);
    const at::Tensor noise = torch::randn({2, 3, h, w});
    torch::manual_seed(22);
    const at::Tensor got = pyramid_noise(noise, iterations, 0.3);
    // kohya's loop, written out again with torch.nn.functional.interpolate.
    torch::manual_seed(22);
    at::Tensor want = noise.clone();
    int64_t levels = 0;
    for (int64_t i = 0; i < iterations; ++i) {
      const double r = torch::rand({1}, torch::kDouble).item<double>() * 2 + 2;
      const int64_t hn = std::max<int64_t>(1, static_cast<int64_t>(std::floor(h / std::pow(r, i))));
      const int64_t wn = std::max<int64_t>(1, static_cast<int64_t>(std::floor(w / std::pow(r, i))));
      const at::Tensor level = torch::randn({2, 3, hn, wn});
      want = want + torch::nn::functional::interpolate(level, torch::nn::functional::InterpolateFuncOptions()
                                                                  .size(std::vector<int64_t>{h, w})
                                                                  .mode(torch::kBilinear)
                                                                  .align_corners(false)) *
                        std::pow(0.3, i);
      ++levels;
      if (hn == 1 || wn == 1) break;
    }
    want = want / want.std();
    EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-5)) << iterations;
    EXPECT_NEAR(got.std().item<double>(), 1.0, 1e-5);
    if (iterations == 12) {
      EXPECT_LT(levels, 12);  // stopped at a 1-pixel level
    }
  }
  EXPECT_NE(error_of([&] { pyramid_noise(torch::zeros({1, 1, 4, 4}), 0, 0.3); }).find("multires_noise_iterations"),
            std::string::npos);
}
