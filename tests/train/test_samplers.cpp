// The samplers (train/samplers.h) against independent references: the exact
// probability-flow ODE solution for Gaussian data, whose denoiser is known in
// closed form; the statistics of Euler ancestral's samples; DDIM against
// DdpmSchedule's own variance-preserving DDIM step; k-diffusion's published
// sigma range of Stable Diffusion.
#include <cmath>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/train/ddpm.h"
#include "shoestring/train/samplers.h"
#include "shoestring/train/sampling.h"

using namespace shoestring;

namespace {

// Data x0 ~ N(mu, s^2) per element. With x = x0 + sigma eps the posterior
// mean is E[x0 | x] = (s^2 x + sigma^2 mu) / (s^2 + sigma^2), and the
// probability-flow ODE dx/dsigma = (x - D(x, sigma)) / sigma carries x from
// sigma_T to sigma as x - mu = (x_T - mu) sqrt(s^2 + sigma^2) / sqrt(s^2 + sigma_T^2)
// (Karras et al. 2022, eq. 3 with a Gaussian p_data).
struct GaussianData {
  double mu = 0.7, s = 0.5;
  DenoiseFn denoiser() const {
    return [m = mu, v = s * s](const at::Tensor& x, const NoiseLevel& level) {
      const double s2 = level.sigma * level.sigma;
      return (x * v + s2 * m) / (v + s2);
    };
  }
  /// Where the ODE takes x_T (at sigma_T) at sigma = 0.
  at::Tensor exact(const at::Tensor& x_t, double sigma_t) const {
    return mu + (x_t - mu) * (s / std::sqrt(s * s + sigma_t * sigma_t));
  }
};

/// Geometric levels from 10 down to `lowest`, then 0. (The last step, to 0,
/// returns the denoiser's posterior mean, which differs from the ODE's end
/// point by ~(lowest / s)^2: negligible at 1e-4.)
std::vector<NoiseLevel> geometric_levels(int steps, double lowest = 1e-4) {
  std::vector<NoiseLevel> levels;
  for (int i = 0; i < steps; ++i) {
    levels.push_back({10.0 * std::pow(lowest / 10.0, static_cast<double>(i) / (steps - 1)), 0.0});
  }
  levels.push_back({0.0, 0.0});
  return levels;
}

double ode_error(SamplerKind kind, int steps) {
  GaussianData data;
  torch::manual_seed(3);
  at::Tensor noise = torch::randn({4096}, torch::kFloat64).to(torch::kFloat32);
  const std::vector<NoiseLevel> levels = geometric_levels(steps);
  at::Tensor got = run_sampler(kind, data.denoiser(), noise, levels);
  at::Tensor want = data.exact(noise.to(torch::kFloat64) * levels[0].sigma, levels[0].sigma);
  return (got.to(torch::kFloat64) - want).abs().max().item<double>();
}

}  // namespace

TEST(Samplers, EulerAndDpmpp2mSolveTheOdeAtTheirOrder) {
  // Doubling the steps halves Euler's error (first order) and quarters
  // DPM++ 2M's (second order). (float64 reference runs of the same
  // recurrences: Euler 0.167, 0.084, 0.042; DPM++ 2M 0.0153, 0.0039, 0.00096.)
  const double e32 = ode_error(SamplerKind::euler, 32), e64 = ode_error(SamplerKind::euler, 64),
               e128 = ode_error(SamplerKind::euler, 128);
  EXPECT_NEAR(e64 / e32, 0.5, 0.05) << e32 << " " << e64;
  EXPECT_NEAR(e128 / e64, 0.5, 0.05) << e64 << " " << e128;
  const double d32 = ode_error(SamplerKind::dpmpp_2m, 32), d64 = ode_error(SamplerKind::dpmpp_2m, 64),
               d128 = ode_error(SamplerKind::dpmpp_2m, 128);
  EXPECT_NEAR(d64 / d32, 0.25, 0.04) << d32 << " " << d64;
  EXPECT_NEAR(d128 / d64, 0.25, 0.04) << d64 << " " << d128;
  EXPECT_LT(d128, e128 / 10);
  EXPECT_LT(e128, 0.05);
}

TEST(Samplers, EulerAncestralSamplesTheData) {
  // With the exact denoiser the ancestral sampler draws from N(mu, s^2) as
  // its steps grow (first order: the standard deviation's shortfall about
  // halves with each doubling; float64 reference: 0.028 at 60 steps, 0.0064
  // at 240). 20000 samples: standard error of the mean 0.0035, of the
  // standard deviation 0.0025.
  GaussianData data;
  torch::manual_seed(4);
  at::Tensor noise = torch::randn({20000});
  auto draw = [&](int steps, uint64_t seed) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    return run_sampler(SamplerKind::euler_a, data.denoiser(), noise, geometric_levels(steps, 0.02), &gen);
  };
  const at::Tensor x = draw(240, 11);
  EXPECT_NEAR(x.mean().item<double>(), data.mu, 0.012);
  EXPECT_NEAR(x.std().item<double>(), data.s, 0.015);
  const double shortfall_60 = data.s - draw(60, 11).std().item<double>();
  EXPECT_GT(shortfall_60, data.s - x.std().item<double>() + 0.01);
  // The ODE samplers map noise deterministically; the ancestral one does not
  // collapse onto that map (its noise is fresh each step).
  at::Tensor ode = run_sampler(SamplerKind::euler, data.denoiser(), noise, geometric_levels(240, 0.02));
  EXPECT_GT((x - ode).abs().mean().item<double>(), 0.1);
  // Same generator seed, same samples.
  EXPECT_TRUE(torch::equal(draw(240, 11), x));
  EXPECT_THROW(run_sampler(SamplerKind::euler_a, data.denoiser(), noise, geometric_levels(60)), Error);
}

TEST(Samplers, DdimEqualsTheVariancePreservingDdimStep) {
  // A fixed "model" epsilon(x_t, t): run_sampler's ddim in sigma space and
  // DdpmSchedule::ddim_step's loop in alpha_bar space give the same sample.
  DdpmSchedule schedule = DdpmSchedule::stable_diffusion();
  torch::manual_seed(5);
  at::Tensor noise = torch::randn({2, 4, 3, 3});
  at::Tensor target = torch::randn({2, 4, 3, 3}) * 0.5;
  auto eps_model = [&](const at::Tensor& x_vp, double t) {
    return torch::tanh(x_vp - target) * (0.5 + t / 2000.0);  // any smooth function of x_t and t
  };
  const int steps = 12;
  const std::vector<NoiseLevel> levels = sampling_levels(schedule, SamplerKind::ddim, steps);
  ASSERT_EQ(levels.size(), static_cast<size_t>(steps) + 1);
  at::Tensor ours = run_sampler(
      SamplerKind::ddim,
      [&](const at::Tensor& x, const NoiseLevel& level) {
        return denoised_from_output(x, eps_model(model_input(x, level.sigma), level.timestep), level.sigma, false);
      },
      noise, levels);
  at::Tensor x = noise.clone();
  const std::vector<int64_t> ts = schedule.ddim_timesteps(steps);
  for (size_t k = 0; k < ts.size(); ++k) {
    x = schedule.ddim_step(x, eps_model(x, static_cast<double>(ts[k])), ts[k], k + 1 < ts.size() ? ts[k + 1] : -1);
  }
  EXPECT_TRUE(torch::allclose(ours, x, 1e-4, 1e-5)) << (ours - x).abs().max().item<double>();
}

TEST(Samplers, VPredictionDenoisedMatchesItsDefinition) {
  // v = sqrt(ab) eps - sqrt(1 - ab) x0 (Salimans & Ho 2022) on x_t = sqrt(ab) x0
  // + sqrt(1 - ab) eps; in sigma coordinates x = x_t / sqrt(ab), sigma^2 = (1 - ab) / ab.
  torch::manual_seed(6);
  at::Tensor x0 = torch::randn({64}, torch::kFloat64), eps = torch::randn({64}, torch::kFloat64);
  for (double ab : {0.99, 0.5, 0.01}) {
    const double sigma = std::sqrt((1 - ab) / ab);
    at::Tensor x = x0 + sigma * eps;
    at::Tensor v = std::sqrt(ab) * eps - std::sqrt(1 - ab) * x0;
    EXPECT_TRUE(torch::allclose(denoised_from_output(x, v, sigma, true), x0, 1e-9, 1e-9)) << ab;
    EXPECT_TRUE(torch::allclose(denoised_from_output(x, eps, sigma, false), x0, 1e-9, 1e-9)) << ab;
    EXPECT_TRUE(torch::allclose(model_input(x, sigma), std::sqrt(ab) * x0 + std::sqrt(1 - ab) * eps, 1e-9, 1e-9));
  }
}

TEST(Samplers, LevelsFollowKDiffusion) {
  // k-diffusion's DiscreteSchedule over SD's table: sigma_max 14.6146 at t
  // 999, sigma_min 0.0292 at t 0 (the values A1111 and ComfyUI report).
  DdpmSchedule schedule = DdpmSchedule::stable_diffusion();
  const std::vector<NoiseLevel> levels = sampling_levels(schedule, SamplerKind::euler, 20);
  ASSERT_EQ(levels.size(), 21u);
  EXPECT_NEAR(levels.front().sigma, 14.6146, 1e-4);
  EXPECT_DOUBLE_EQ(levels.front().timestep, 999.0);
  EXPECT_NEAR(levels[19].sigma, 0.0292, 1e-4);
  EXPECT_EQ(levels.back().sigma, 0.0);
  // A fractional timestep interpolates log sigma between its neighbours.
  const at::Tensor table = ddpm_sigmas(schedule);
  const double t = levels[1].timestep;  // 999 * 18 / 19
  const auto lo = static_cast<int64_t>(std::floor(t));
  const double w = t - static_cast<double>(lo);
  EXPECT_NEAR(std::log(levels[1].sigma),
              (1 - w) * std::log(table[lo].item<double>()) + w * std::log(table[lo + 1].item<double>()), 1e-12);
  // DDIM: diffusers' timesteps, then alpha_bar_0.
  const std::vector<NoiseLevel> ddim = sampling_levels(schedule, SamplerKind::ddim, 50);
  EXPECT_DOUBLE_EQ(ddim.front().timestep, 981.0);
  EXPECT_DOUBLE_EQ(ddim.back().timestep, 0.0);
  EXPECT_NEAR(ddim.back().sigma, std::sqrt((1 - 0.99915) / 0.99915), 1e-9);
  EXPECT_THROW(sampling_levels(schedule, SamplerKind::euler, 0), Error);
  EXPECT_EQ(parse_sampler("dpmpp_2m", "--sampler"), SamplerKind::dpmpp_2m);
  try {
    parse_sampler("heun", "--sampler");
    FAIL() << "heun accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("euler_a"), std::string::npos) << e.what();
  }
}

TEST(Samplers, SamplePromptsTakeKohyasInlineOptions) {
  // kohya's sample_images syntax: the prompt, then " --" options.
  const SamplePrompt p = parse_sample_prompt("a red heart --n blurry, dark --w 512 --h 768 --s 20 --l 6.5 --d 42", "p");
  EXPECT_EQ(p.prompt, "a red heart");
  EXPECT_EQ(p.negative, "blurry, dark");
  EXPECT_EQ(p.width, 512);
  EXPECT_EQ(p.height, 768);
  EXPECT_EQ(p.steps, 20);
  EXPECT_DOUBLE_EQ(p.cfg.value_or(0), 6.5);
  EXPECT_EQ(p.seed.value_or(0), 42u);
  SampleRequest r;
  r.seeds = {0, 1, 2};
  EXPECT_EQ(row_seeds(p, r), (std::vector<uint64_t>{42, 43, 44}));
  EXPECT_EQ(parse_sample_prompt("plain", "p").prompt, "plain");
  EXPECT_THROW(parse_sample_prompt("x --q 3", "p"), Error);
  EXPECT_THROW(parse_sample_prompt("x --s abc", "p"), Error);
  EXPECT_THROW(parse_sample_prompt("x --s 3 --s 4", "p"), Error);
  EXPECT_THROW(parse_sample_prompt("x --l nan", "p"), Error);
}
