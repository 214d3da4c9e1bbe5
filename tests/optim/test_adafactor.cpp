// Adafactor: checked against the paper's formulas evaluated in plain double
// loops here (Shazeer & Stern 2018, Algorithms 4-6 with update clipping and
// relative step sizes, as transformers implements them), and against the
// golden trajectories of scripts/gen_adafactor_reference.py.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/optim/adafactor.h"

using namespace shoestring;

namespace {

at::Tensor from_list(const nlohmann::json& values, const nlohmann::json& shape) {
  std::vector<float> v = values.get<std::vector<float>>();
  return torch::tensor(v).view(shape.get<std::vector<int64_t>>());
}

std::vector<double> to_vec(const at::Tensor& t) {
  at::Tensor c = t.detach().to(torch::kFloat64).contiguous().flatten();
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

double rms(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return std::sqrt(s / static_cast<double>(v.size()));
}

// The paper's formulas in double precision, element by element. A tensor
// with >= 2 dims is the matrix rows x cols = shape[0] x numel/shape[0];
// cols == 0 means "vector" (unfactored).
struct HandAdafactor {
  AdafactorOptions o;
  int64_t rows, cols;
  std::vector<double> r, c, v, m;

  HandAdafactor(AdafactorOptions opt, int64_t rows_, int64_t cols_) : o(opt), rows(rows_), cols(cols_) {}

  void step(std::vector<double>& x, const std::vector<double>& g, int64_t t, double lr) {
    const size_t n = x.size();
    const double b2 = 1.0 - std::pow(static_cast<double>(t), o.decay_rate);
    double rho = lr;
    if (o.relative_step) rho = std::min(o.warmup_init ? 1e-6 * t : 1e-2, 1.0 / std::sqrt(static_cast<double>(t)));
    const double a = (o.scale_parameter ? std::max(o.eps2, rms(x)) : 1.0) * rho;
    std::vector<double> u(n);
    if (cols > 0) {
      r.resize(rows, 0.0);
      c.resize(cols, 0.0);
      for (int64_t i = 0; i < rows; ++i) {
        double s = 0;
        for (int64_t j = 0; j < cols; ++j) s += g[i * cols + j] * g[i * cols + j] + o.eps1;
        r[i] = b2 * r[i] + (1 - b2) * s / cols;
      }
      for (int64_t j = 0; j < cols; ++j) {
        double s = 0;
        for (int64_t i = 0; i < rows; ++i) s += g[i * cols + j] * g[i * cols + j] + o.eps1;
        c[j] = b2 * c[j] + (1 - b2) * s / rows;
      }
      double rmean = 0;
      for (double x_ : r) rmean += x_ / rows;
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t j = 0; j < cols; ++j) u[i * cols + j] = g[i * cols + j] / std::sqrt(r[i] * c[j] / rmean);
      }
    } else {
      v.resize(n, 0.0);
      for (size_t k = 0; k < n; ++k) {
        v[k] = b2 * v[k] + (1 - b2) * (g[k] * g[k] + o.eps1);
        u[k] = g[k] / std::sqrt(v[k]);
      }
    }
    const double d = std::max(1.0, rms(u) / o.clip_threshold);
    for (auto& e : u) e = e / d * a;
    if (o.beta1) {
      m.resize(n, 0.0);
      for (size_t k = 0; k < n; ++k) u[k] = m[k] = *o.beta1 * m[k] + (1 - *o.beta1) * u[k];
    }
    for (size_t k = 0; k < n; ++k) x[k] = x[k] - o.weight_decay * a * x[k] - u[k];
  }
};

AdafactorOptions kohya_options() {
  return parse_adafactor_args({"scale_parameter=False", "relative_step=False", "warmup_init=False"});
}

void expect_close(const at::Tensor& actual, const std::vector<double>& expected, double rel, const std::string& what) {
  std::vector<double> a = to_vec(actual);
  ASSERT_EQ(a.size(), expected.size()) << what;
  for (size_t k = 0; k < a.size(); ++k) {
    EXPECT_NEAR(a[k], expected[k], rel * std::max(1.0, std::abs(expected[k]))) << what << " element " << k;
  }
}

}  // namespace

TEST(Adafactor, FirstStepOfAMatrixWorkedByHand) {
  // G = [[1,2],[3,4]], step 1 (beta2t = 1 - 1^-0.8 = 0): R = rowmean(G^2) = [2.5, 12.5],
  // C = colmean(G^2) = [5, 10], mean(R) = 7.5, Vhat = R C^T / 7.5 = [[5/3, 10/3], [25/3, 50/3]],
  // U = G / sqrt(Vhat), U^2 = [[0.6, 1.2], [1.08, 0.96]], RMS(U) = sqrt(0.96) < 1 (no clipping).
  // kohya arguments: step size = lr = 0.1, so X1 = X0 - 0.1 U.
  auto x = torch::tensor({1.0f, -1.0f, 0.5f, 2.0f}).view({2, 2}).requires_grad_(true);
  Adafactor opt({{"w", x, 0.0}}, kohya_options(), {});
  x.mutable_grad() = torch::tensor({1.0f, 2.0f, 3.0f, 4.0f}).view({2, 2});
  opt.step(0.1);
  const std::vector<double> u = {1 / std::sqrt(5.0 / 3), 2 / std::sqrt(10.0 / 3), 3 / std::sqrt(25.0 / 3),
                                 4 / std::sqrt(50.0 / 3)};
  expect_close(x, {1.0 - 0.1 * u[0], -1.0 - 0.1 * u[1], 0.5 - 0.1 * u[2], 2.0 - 0.1 * u[3]}, 1e-6, "X1");
  auto st = opt.state_tensors();
  std::map<std::string, at::Tensor> by_name(st.begin(), st.end());
  ASSERT_EQ(by_name.size(), 2u);
  expect_close(by_name.at("w.exp_avg_sq_row"), {2.5, 12.5}, 1e-6, "R");
  expect_close(by_name.at("w.exp_avg_sq_col"), {5.0, 10.0}, 1e-6, "C");
}

TEST(Adafactor, MatrixVectorConvThreeStepsFollowThePaperFormulas) {
  struct Case {
    const char* name;
    AdafactorOptions options;
    double lr;
  };
  AdafactorOptions with_beta1 = parse_adafactor_args({"beta1=0.9", "clip_threshold=0.3", "decay_rate=-0.5"});
  with_beta1.weight_decay = 0.05;
  std::vector<Case> cases = {
      {"kohya", kohya_options(), 0.02}, {"defaults", AdafactorOptions{}, 7.0}, {"beta1", with_beta1, 0.0}};
  for (const auto& cs : cases) {
    torch::manual_seed(5);
    std::vector<at::Tensor> params = {torch::randn({3, 4}), torch::randn({5}), torch::randn({4, 2, 3, 3})};
    std::vector<OptimParam> oparams;
    std::vector<std::vector<double>> x;
    std::vector<HandAdafactor> hand;
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].requires_grad_(true);
      oparams.push_back({"p" + std::to_string(i), params[i], cs.options.weight_decay});
      x.push_back(to_vec(params[i]));
      const int64_t rows = params[i].dim() >= 2 ? params[i].size(0) : 0;
      hand.emplace_back(cs.options, rows, rows ? params[i].numel() / rows : 0);
    }
    Adafactor opt(oparams, cs.options, {});
    for (int64_t t = 1; t <= 3; ++t) {
      for (size_t i = 0; i < params.size(); ++i) {
        // step 3 has a spike so that update clipping is active
        at::Tensor g = torch::randn(params[i].sizes()) * (t == 3 ? 40.0 : 1.0);
        params[i].mutable_grad() = g;
        hand[i].step(x[i], to_vec(g), t, cs.lr);
      }
      opt.step(cs.lr);
      for (size_t i = 0; i < params.size(); ++i) {
        expect_close(params[i], x[i], 2e-6,
                     std::string(cs.name) + " step " + std::to_string(t) + " param " + std::to_string(i));
      }
    }
  }
}

TEST(Adafactor, ConvKernelIsFactoredAsOutByFanIn) {
  EXPECT_EQ(Adafactor::factored_shape({8, 4, 3, 3}), (std::vector<int64_t>{8, 36}));
  EXPECT_EQ(Adafactor::factored_shape({6, 5}), (std::vector<int64_t>{6, 5}));
  EXPECT_TRUE(Adafactor::factored_shape({7}).empty());
  EXPECT_TRUE(Adafactor::factored_shape({}).empty());
  EXPECT_TRUE(Adafactor::factored_shape({0, 3}).empty());
  auto w = torch::randn({8, 4, 3, 3}).requires_grad_(true);
  Adafactor opt({{"conv.weight", w, 0.0}}, AdafactorOptions{}, {});
  w.mutable_grad() = torch::randn({8, 4, 3, 3});
  opt.step(0);
  auto st = opt.state_tensors();
  std::map<std::string, at::Tensor> by_name(st.begin(), st.end());
  ASSERT_EQ(by_name.size(), 2u);
  EXPECT_EQ(by_name.at("conv.weight.exp_avg_sq_row").sizes(), at::IntArrayRef({8}));
  EXPECT_EQ(by_name.at("conv.weight.exp_avg_sq_col").sizes(), at::IntArrayRef({36}));
  // 44 fp32 numbers for 288 weights (over the last two dims it would be 8*4*(3+3) = 192).
  EXPECT_EQ(opt.state_bytes(), 44 * 4);
}

TEST(Adafactor, MatchesPythonReferenceTrajectories) {
  std::ifstream in(std::string(SHOESTRING_TEST_DATA) + "/optim/adafactor_reference.json");
  ASSERT_TRUE(in.good());
  auto ref = nlohmann::json::parse(in);
  ASSERT_EQ(ref["configs"].size(), 3u);
  for (const auto& cfg : ref["configs"]) {
    const std::string name = cfg["name"];
    AdafactorOptions o;
    o.scale_parameter = cfg["scale_parameter"];
    o.relative_step = cfg["relative_step"];
    o.warmup_init = cfg["warmup_init"];
    o.clip_threshold = cfg["clip_threshold"];
    o.decay_rate = cfg["decay_rate"];
    o.weight_decay = cfg["weight_decay"];
    if (!cfg["beta1"].is_null()) o.beta1 = cfg["beta1"].get<double>();
    const auto& shapes = cfg["shapes"];
    std::vector<at::Tensor> params;
    std::vector<OptimParam> oparams;
    for (size_t i = 0; i < shapes.size(); ++i) {
      params.push_back(from_list(cfg["initial"][i], shapes[i]).requires_grad_(true));
      oparams.push_back({"p" + std::to_string(i), params.back(), o.weight_decay});
    }
    Adafactor opt(oparams, o, {});
    int checked = 0;
    for (size_t s = 0; s < cfg["steps"].size(); ++s) {
      const auto& rec = cfg["steps"][s];
      for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = from_list(rec["grads"][i], shapes[i]);
      opt.step(cfg["lr"].get<double>());
      if (!rec.contains("params")) continue;
      for (size_t i = 0; i < params.size(); ++i) {
        auto expected = from_list(rec["params"][i], shapes[i]);
        auto err = ((params[i].detach() - expected).abs() / expected.abs().clamp_min(1.0)).max().item<double>();
        EXPECT_LT(err, 2e-6) << name << " step " << s + 1 << " param " << i;
        ++checked;
      }
    }
    EXPECT_EQ(checked, 12) << name;
    auto st = opt.state_tensors();
    std::map<std::string, at::Tensor> by_name(st.begin(), st.end());
    for (size_t i = 0; i < params.size(); ++i) {
      for (const auto& [sname, values] : cfg["final_state"][i].items()) {
        const std::string key = "p" + std::to_string(i) + "." + sname;
        ASSERT_TRUE(by_name.count(key)) << name << " missing " << key;
        auto expected = torch::tensor(values.get<std::vector<float>>());
        auto actual = by_name.at(key).flatten();
        ASSERT_EQ(actual.numel(), expected.numel()) << key;
        auto err = ((actual - expected).abs() / expected.abs().clamp_min(1e-3)).max().item<double>();
        EXPECT_LT(err, 1e-5) << name << " " << key;
      }
      EXPECT_EQ(by_name.size(), [&] {
        size_t n = 0;
        for (size_t j = 0; j < params.size(); ++j) n += cfg["final_state"][j].size();
        return n;
      }()) << name;
    }
  }
}

TEST(Adafactor, RelativeStepIgnoresTheGivenLearningRate) {
  auto run = [](double lr) {
    torch::manual_seed(3);
    auto w = torch::randn({4, 3}).requires_grad_(true);
    Adafactor opt({{"w", w, 0.0}}, AdafactorOptions{}, {});
    for (int s = 0; s < 3; ++s) {
      w.mutable_grad() = torch::randn({4, 3});
      opt.step(lr);
    }
    return w.detach().clone();
  };
  EXPECT_TRUE(torch::equal(run(1e-3), run(5.0)));
  // relative_step, no warmup: rho_t = min(1e-2, 1/sqrt t) = 1e-2 up to t = 10^4, times max(eps2, RMS(X)).
  Adafactor opt({}, AdafactorOptions{}, {});
  EXPECT_DOUBLE_EQ(opt.step_size(1, 9.0, 0.5), 0.5 * 1e-2);
  EXPECT_DOUBLE_EQ(opt.step_size(4, 9.0, 1e-6), 1e-3 * 1e-2);
  AdafactorOptions warm;
  warm.warmup_init = true;
  Adafactor opt_warm({}, warm, {});
  EXPECT_DOUBLE_EQ(opt_warm.step_size(100, 9.0, 2.0), 2.0 * 1e-4);  // min(1e-6*100, 1/10)
  Adafactor opt_kohya({}, kohya_options(), {});
  EXPECT_DOUBLE_EQ(opt_kohya.step_size(100, 3e-4, 2.0), 3e-4);
}

TEST(Adafactor, DecoupledWeightDecayWithZeroGradient) {
  // G = 0: V = eps1, U = 0, so only the decay acts: X1 = X0 (1 - wd lr).
  auto w = torch::tensor({2.0f, -4.0f, 8.0f}).requires_grad_(true);
  Adafactor opt({{"w", w, 0.5}}, kohya_options(), {});
  w.mutable_grad() = torch::zeros({3});
  opt.step(0.1);
  expect_close(w, {2.0 * 0.95, -4.0 * 0.95, 8.0 * 0.95}, 1e-7, "decayed");
}

TEST(Adafactor, Bf16WeightsAndStateWithStochasticRounding) {
  // Step lr = 1e-5 per update (|U| = 1): far below half a bf16 ulp of 1.0.
  const int64_t n = 4096;
  auto run = [&](at::ScalarType dtype, bool sr) {
    auto v = torch::ones({n}, dtype).requires_grad_(true);
    auto m = torch::ones({64, 64}, dtype).requires_grad_(true);
    OptimizerOptions o;
    o.stochastic_rounding = sr;
    o.seed = 4;
    o.state_dtype = dtype == torch::kFloat32 ? torch::kFloat32 : torch::kBFloat16;
    AdafactorOptions a = kohya_options();
    a.beta1 = 0.9;
    Adafactor opt({{"v", v, 0.0}, {"m", m, 0.0}}, a, o);
    for (int s = 0; s < 150; ++s) {
      v.mutable_grad() = torch::ones({n}, dtype);
      m.mutable_grad() = torch::ones({64, 64}, dtype);
      opt.step(1e-5);
    }
    if (dtype != torch::kFloat32) {
      for (auto& [name, t] : opt.state_tensors()) {
        if (t.numel() == n) {
          EXPECT_EQ(t.scalar_type(), torch::kBFloat16) << name;
        }
      }
    }
    return std::make_pair(v.detach().to(torch::kFloat32).mean().item<double>(),
                          m.detach().to(torch::kFloat32).mean().item<double>());
  };
  auto fp32 = run(torch::kFloat32, false);
  auto rtn = run(torch::kBFloat16, false);
  auto sr = run(torch::kBFloat16, true);
  EXPECT_LT(fp32.first, 1.0 - 1e-3);  // the fp32 run moved by ~150 * 1e-5 (minus the beta1 warm-up)
  EXPECT_EQ(rtn.first, 1.0);
  EXPECT_EQ(rtn.second, 1.0);
  EXPECT_NEAR(sr.first, fp32.first, 2e-4);
  EXPECT_NEAR(sr.second, fp32.second, 2e-4);
}

TEST(Adafactor, ParsesKohyaArguments) {
  AdafactorOptions o = parse_adafactor_args({"scale_parameter=False", "relative_step=False", "warmup_init=False"});
  EXPECT_FALSE(o.scale_parameter);
  EXPECT_FALSE(o.relative_step);
  EXPECT_FALSE(o.warmup_init);
  o = parse_adafactor_args({"eps=(1e-29, 2e-3)", "beta1=0.9", "clip_threshold=2", "decay_rate=-0.5",
                            "weight_decay=0.01", "relative_step=true"});
  EXPECT_DOUBLE_EQ(o.eps1, 1e-29);
  EXPECT_DOUBLE_EQ(o.eps2, 2e-3);
  ASSERT_TRUE(o.beta1.has_value());
  EXPECT_DOUBLE_EQ(*o.beta1, 0.9);
  EXPECT_DOUBLE_EQ(o.clip_threshold, 2.0);
  EXPECT_DOUBLE_EQ(o.decay_rate, -0.5);
  EXPECT_DOUBLE_EQ(o.weight_decay, 0.01);
  EXPECT_FALSE(parse_adafactor_args({"beta1=None"}).beta1.has_value());
  EXPECT_DOUBLE_EQ(parse_adafactor_args({"eps=1e-30,1e-3"}).eps2, 1e-3);
  try {
    parse_adafactor_args({"betas=0.9,0.99"});
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("betas"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("scale_parameter"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("clip_threshold"), std::string::npos);
  }
  EXPECT_THROW(parse_adafactor_args({"relative_step=maybe"}), Error);
  EXPECT_THROW(parse_adafactor_args({"eps=1e-30"}), Error);
  EXPECT_THROW(parse_adafactor_args({"clip_threshold"}), Error);
  EXPECT_THROW(parse_adafactor_args({"relative_step=False", "warmup_init=True"}), Error);
  EXPECT_THROW(parse_adafactor_args({"beta1=1.5"}), Error);
  EXPECT_THROW(parse_adafactor_args({"decay_rate=0.8"}), Error);
}

TEST(Adafactor, RejectsMismatchedGradientAndRestoredState) {
  auto w = torch::randn({3, 4}).requires_grad_(true);
  Adafactor opt({{"w", w, 0.0}}, AdafactorOptions{}, {});
  EXPECT_THROW(opt.update(0, torch::randn({4, 3}), 0.0, 1), Error);
  opt.load_state_tensors({{"w.exp_avg_sq_row", torch::ones({5})}, {"w.exp_avg_sq_col", torch::ones({4})}});
  try {
    opt.update(0, torch::randn({3, 4}), 0.0, 1);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("w.exp_avg_sq_row"), std::string::npos) << e.what();
  }
}

// The fused path (contiguous factored tensors without beta1) against the op
// chain, which a non-contiguous view of the same values takes: fp32 weights
// agree to rounding; bf16 weights with stochastic rounding (same keys) agree
// to one bf16 ulp; and the fused result does not depend on the thread count.
// Shapes: 70 x 300 (two row chunks) and 1200 x 1024 (more rows than 64
// chunks of the grain, so the sums pass uses its capped chunk count), the
// latter with a gradient whose top-left quadrant is 10x larger: the factored
// second moment then misjudges the other quadrants and RMS(U) is about 2.6,
// so the update clipping (computed from the weighted column sums) matters.
TEST(Adafactor, FusedFactoredPathMatchesOpChain) {
  struct Case {
    int64_t n, m;
    bool blocky;
  };
  for (const Case& shape : {Case{70, 300, false}, Case{1200, 1024, true}}) {
    torch::manual_seed(51);
    const int64_t n = shape.n, m = shape.m;
    auto x0 = torch::randn({n, m});
    std::vector<at::Tensor> grads;
    for (int s = 0; s < 3; ++s) {
      at::Tensor g = torch::randn({n, m}) * (s + 1) * 1e-2;
      if (shape.blocky) g.slice(0, 0, n / 2).slice(1, 0, m / 2).mul_(10);
      grads.push_back(g);
    }
    for (bool scale_parameter : {false, true}) {
      for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
        auto run = [&](bool contiguous, int threads) {
          const int before = at::get_num_threads();
          at::set_num_threads(threads);
          at::Tensor p = contiguous ? x0.to(dtype).clone() : x0.t().contiguous().to(dtype).t();
          p.requires_grad_(true);
          EXPECT_EQ(p.is_contiguous(), contiguous);
          OptimizerOptions o;
          o.seed = 8;
          AdafactorOptions a = kohya_options();
          a.scale_parameter = scale_parameter;
          Adafactor opt({{"w", p, 0.1}}, a, o);
          for (const auto& g : grads) {
            p.mutable_grad() = g.to(dtype);
            opt.step(1e-2);
          }
          at::set_num_threads(before);
          auto st = opt.state_tensors();
          return std::make_pair(p.detach().to(torch::kFloat32).contiguous(),
                                std::map<std::string, at::Tensor>(st.begin(), st.end()));
        };
        auto [fused, fused_state] = run(true, 1);
        auto [chain, chain_state] = run(false, 1);
        auto [fused2, fused2_state] = run(true, std::max(2, at::get_num_threads()));
        const std::string what = std::to_string(n) + "x" + std::to_string(m) + " " + std::string(c10::toString(dtype)) +
                                 (scale_parameter ? " scaled" : "");
        EXPECT_TRUE(torch::equal(fused, fused2)) << what;
        EXPECT_FALSE(torch::equal(fused, x0.to(dtype).to(torch::kFloat32))) << what;
        for (const char* k : {"w.exp_avg_sq_row", "w.exp_avg_sq_col"}) {
          EXPECT_TRUE(torch::allclose(fused_state.at(k), chain_state.at(k), 1e-5, 0)) << what << " " << k;
        }
        if (dtype == torch::kFloat32) {
          // Against the paper's formulas in double (HandAdafactor): within 32
          // fp32 ulps after three steps. The op chain's fp32 means drift as
          // far on the larger matrix, so the two paths are compared to each
          // other only on the small one.
          AdafactorOptions a = kohya_options();
          a.scale_parameter = scale_parameter;
          a.weight_decay = 0.1;
          HandAdafactor hand(a, n, m);
          std::vector<double> x = to_vec(x0);
          for (size_t t = 0; t < grads.size(); ++t) hand.step(x, to_vec(grads[t]), static_cast<int64_t>(t) + 1, 1e-2);
          at::Tensor ref = torch::tensor(x, torch::kFloat64).view({n, m});
          const double fused_err =
              ((fused.to(torch::kFloat64) - ref).abs() / ref.abs().clamp_min(1)).max().item<double>();
          EXPECT_LT(fused_err, 32 * std::ldexp(1.0, -23)) << what;
          if (!shape.blocky) {
            EXPECT_TRUE(torch::allclose(fused, chain, 1e-6, 1e-7)) << what;
          }
        } else {
          // one bf16 ulp (2^-7 relative) on the small matrix. On the larger
          // one, a few values near a rounding boundary round the other way in
          // one of the three steps, and a weight that then shrank towards
          // zero keeps the absolute difference of an earlier, larger ulp
          // (the weights are ~1, the updates ~0.05): two ulps or 1e-3.
          EXPECT_TRUE(torch::allclose(fused, chain, (shape.blocky ? 2.0 : 1.0) / 128, shape.blocky ? 1e-3 : 0)) << what;
          EXPECT_GT(torch::eq(fused, chain).to(torch::kFloat).mean().item<double>(), 0.99) << what;
        }
      }
    }
  }
}
