// Stable Cascade's GDF objective (train/gdf.h) against values computed from
// the formulas of Stability-AI/StableCascade gdf/ by an independent PyTorch
// script (scripts/gen_gdf_reference.py, tests/data/train/gdf_reference.json),
// plus the properties the formulas imply: the schedule's limits, r = t where
// no clamp bites, a + b variance preserving, a sampler that recovers x0 when
// the model knows the noise, and errors.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/train/gdf.h"

#include "reference_testing.h"

using namespace shoestring;

namespace {

using shoestring::testing::doubles;
using shoestring::testing::max_diff;

nlohmann::json reference() { return shoestring::testing::train_reference("gdf_reference.json"); }

}  // namespace

TEST(Gdf, ScheduleMatchesTheReference) {
  const nlohmann::json ref = reference();
  const at::Tensor t = doubles(ref["t"]).to(torch::kFloat);  // the trainer's times are float32
  GdfCosineSchedule sc;
  for (const char* shift : {"1.0", "2.0", "0.5"}) {
    const auto& r = ref["schedule"][shift];
    const at::Tensor ls = sc.log_snr(t, std::stod(shift));
    EXPECT_LT(max_diff(ls, doubles(r["log_snr"])), 1e-4) << shift;  // float32 t: ~1e-7 in t, x dlogSNR/dt
    const auto [a, b] = gdf_vp_scalers(ls);
    EXPECT_LT(max_diff(a, doubles(r["a"])), 1e-6) << shift;
    EXPECT_LT(max_diff(b, doubles(r["b"])), 1e-6) << shift;
    EXPECT_LT(max_diff(sc.noise_cond(ls), doubles(r["noise_cond"])), 1e-6) << shift;
    EXPECT_LT(max_diff(gdf_p2_weight(ls), doubles(r["p2"])), 1e-6) << shift;
    // Variance preserving.
    EXPECT_LT(max_diff(a * a + b * b, torch::ones_like(a)), 1e-12);
  }
  // Limits: +-log(0.9999 / 1e-4); shifts move inside them and clamp there.
  const auto [lo, hi] = sc.limits();
  EXPECT_NEAR(hi, std::log(0.9999 / 1e-4), 1e-9);
  EXPECT_NEAR(lo, -hi, 1e-9);
  const at::Tensor mid = torch::tensor({0.5});
  EXPECT_NEAR((sc.log_snr(mid, 2.0) - sc.log_snr(mid)).item<double>(), -2 * std::log(2.0), 1e-9);
  EXPECT_NEAR(sc.log_snr(torch::tensor({0.0}), 0.5).item<double>(), hi, 1e-9);
  // Where the variance clamp does not bite, the noise condition gives t back.
  const at::Tensor ts = torch::linspace(0.05, 0.95, 19, torch::kDouble);
  EXPECT_LT(max_diff(sc.noise_cond(sc.log_snr(ts)), ts), 1e-6);
}

TEST(Gdf, SamplerGridMatchesTheReference) {
  const nlohmann::json ref = reference();
  GdfCosineSchedule sc;
  const at::Tensor grid = gdf_sample_log_snrs(sc, 20, 2.0);
  EXPECT_LT(max_diff(grid, doubles(ref["grid_shift2_20"]["log_snr"])), 1e-9);
  EXPECT_LT(max_diff(sc.noise_cond(grid), doubles(ref["grid_shift2_20"]["noise_cond"])), 1e-6);
  // A fixed linear "model" eps = 0.3 x + 0.2 r, deterministic steps (eta 0).
  const auto& d = ref["ddim_linear_model"];
  const at::Tensor noise = doubles(d["noise"]).reshape(d["shape"].get<std::vector<int64_t>>()).to(torch::kFloat);
  const at::Tensor x0 = gdf_sample(
      [](const at::Tensor& x, const at::Tensor& r) {
        return x * 0.3 + r.view({-1, 1, 1, 1}) * 0.2;
      },
      noise, sc, d["steps"].get<int64_t>(), d["shift"].get<double>(), /*eta=*/0.0);
  const at::Tensor expected = doubles(d["x0"]).reshape(noise.sizes());
  EXPECT_LT(max_diff(x0, expected), 1e-4 * expected.abs().max().item<double>());
}

TEST(Gdf, StochasticSamplerRecoversX0WhenTheModelKnowsTheNoise) {
  // With eps_hat = (x - a x0) / b exact at every step, every x0 prediction is
  // x0 whatever the injected noise (eta = 1, the DDPM sampler).
  torch::manual_seed(3);
  const at::Tensor x0 = torch::randn({2, 4, 3, 3});
  GdfCosineSchedule sc;
  const at::Tensor grid = gdf_sample_log_snrs(sc, 10, 2.0);
  int64_t step = 0;
  const at::Tensor got = gdf_sample(
      [&](const at::Tensor& x, const at::Tensor&) {
        const auto [a, b] = gdf_vp_scalers(grid.slice(0, step, step + 1));
        ++step;
        return (x - x0 * a.item<double>()) / b.item<double>();
      },
      torch::randn({2, 4, 3, 3}), sc, 10, 2.0, /*eta=*/1.0);
  EXPECT_EQ(step, 10);
  EXPECT_LT(max_diff(got, x0), 1e-4);
}

TEST(Gdf, AdaptiveLossWeightMatchesTheReference) {
  const nlohmann::json ref = reference();
  const auto& ad = ref["adaptive"];
  GdfAdaptiveLossWeight w;
  EXPECT_LT(max_diff(w.weight(doubles(ad["probe_log_snr"])), torch::ones({13})), 1e-7);  // every bucket starts at 1
  for (const auto& u : ad["updates"]) w.update(doubles(u["log_snr"]), doubles(u["loss"]));
  const at::Tensor probe = doubles(ad["probe_log_snr"]);
  EXPECT_TRUE(torch::equal(w.bucket_index(probe), torch::tensor(ad["probe_bucket"].get<std::vector<int64_t>>())));
  EXPECT_LT(max_diff(w.weight(probe), doubles(ad["probe_weight"])), 1e-5);
  const at::Tensor losses = w.bucket_losses();
  int changed = 0;
  for (int64_t i = 0; i < GdfAdaptiveLossWeight::kBuckets; ++i) {
    const std::string key = std::to_string(i);
    const double expected = ad["changed"].contains(key) ? ad["changed"][key].get<double>() : 1.0;
    changed += ad["changed"].contains(key);
    EXPECT_NEAR(losses[i].item<double>(), expected, 1e-12) << i;
  }
  EXPECT_GE(changed, 8);  // buckets 0 and 299 (beyond the edges), duplicates, neighbours
  // Resume: restored buckets weight alike; bad buckets are refused.
  GdfAdaptiveLossWeight resumed;
  resumed.set_bucket_losses(losses);
  EXPECT_TRUE(torch::equal(resumed.weight(probe), w.weight(probe)));
  EXPECT_THROW(resumed.set_bucket_losses(torch::ones({299})), Error);
  EXPECT_THROW(resumed.set_bucket_losses(torch::zeros({300})), Error);
  EXPECT_THROW(w.update(torch::zeros({3}), torch::ones({2})), Error);
}

TEST(Gdf, DiffuseAndTimes) {
  torch::manual_seed(1);
  const at::Tensor x0 = torch::randn({3, 2, 4, 4}), eps = torch::randn({3, 2, 4, 4});
  GdfCosineSchedule sc;
  const at::Tensor ls = sc.log_snr(torch::tensor({0.0f, 0.5f, 1.0f}));
  const at::Tensor xt = gdf_diffuse(x0, eps, ls);
  const auto [a, b] = gdf_vp_scalers(ls);
  for (int i = 0; i < 3; ++i) {
    const at::Tensor expected = x0[i] * a[i].item<double>() + eps[i] * b[i].item<double>();
    EXPECT_LT(max_diff(xt[i], expected), 1e-6) << i;
  }
  EXPECT_GT(a[0].item<double>(), 0.9999);  // t = 0: almost clean
  EXPECT_LT(a[2].item<double>(), 0.011);   // t = 1: almost noise (var clamped at 1e-4)
  EXPECT_THROW(gdf_diffuse(x0, eps.slice(0, 0, 2), ls), Error);
  EXPECT_THROW(gdf_diffuse(x0, eps, ls.slice(0, 0, 2)), Error);
  EXPECT_THROW(sc.log_snr(ls, 0.0), Error);
  EXPECT_THROW(gdf_sample_log_snrs(sc, 0, 1.0), Error);
  // Training times: in [0.001, 1], uniform: mean 0.5005, and from the global generator.
  torch::manual_seed(7);
  const at::Tensor t = gdf_sample_times(20000);
  EXPECT_GE(t.min().item<double>(), 0.001);
  EXPECT_LE(t.max().item<double>(), 1.0);
  EXPECT_NEAR(t.mean().item<double>(), 0.5005, 4 * std::sqrt(1.0 / 12 / 20000));
  torch::manual_seed(7);
  EXPECT_TRUE(torch::equal(gdf_sample_times(20000), t));
}
