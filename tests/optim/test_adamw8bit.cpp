#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <limits>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/optim/adamw8bit.h"
#include "shoestring/optim/quantization.h"

using namespace shoestring;

namespace {
at::Tensor a8_from_list(const nlohmann::json& values, const nlohmann::json& shape) {
  std::vector<float> v = values.get<std::vector<float>>();
  return torch::tensor(v).view(shape.get<std::vector<int64_t>>());
}

std::map<std::string, at::Tensor> state_map(const Optimizer& opt) {
  auto st = opt.state_tensors();
  return {st.begin(), st.end()};
}

/// Least-squares problem min_X 0.5/128 |X A - Y|^2 with X [128, 128] the
/// concatenation of two 8192-element parameters (64 rows each), A well
/// conditioned (I + 0.3 N(0,1)/sqrt(128)) and Y = X* A for a random X*.
struct LeastSquares {
  at::Tensor a, y;
  LeastSquares() {
    torch::manual_seed(21);
    a = torch::eye(128) + torch::randn({128, 128}) * (0.3 / std::sqrt(128.0));
    y = torch::mm(torch::randn({128, 128}), a);
  }
  at::Tensor residual(const at::Tensor& x1, const at::Tensor& x2) const {
    auto x = torch::cat({x1.detach().to(torch::kFloat).view({64, 128}), x2.detach().to(torch::kFloat).view({64, 128})});
    return torch::mm(x, a) - y;
  }
  std::pair<at::Tensor, at::Tensor> grads(const at::Tensor& x1, const at::Tensor& x2) const {
    auto g = torch::mm(residual(x1, x2), a.t()) / 128.0;
    return {g.narrow(0, 0, 64).reshape(x1.sizes()).clone(), g.narrow(0, 64, 64).reshape(x2.sizes()).clone()};
  }
  double loss(const at::Tensor& x1, const at::Tensor& x2) const {
    return 0.5 / 128 * residual(x1, x2).pow(2).sum().item<double>();
  }
};
}  // namespace

// Tensors under min_8bit_size keep fp32 state and follow AdamW: the golden
// torch.optim.AdamW trajectory of test_adamw (30- and 5-element tensors). The
// tolerance leaves room for torch builds whose vectorized add_ is not a fused
// multiply-add (with AVX2/AVX-512 the difference is < 1e-6).
TEST(AdamW8bit, SmallTensorsMatchTorchAdamW) {
  std::ifstream in(std::string(SHOESTRING_TEST_DATA) + "/optim/adamw_reference.json");
  ASSERT_TRUE(in.good());
  auto ref = nlohmann::json::parse(in);
  std::vector<at::Tensor> params;
  std::vector<OptimParam> oparams;
  for (int i = 0; i < 2; ++i) {
    params.push_back(a8_from_list(ref["initial"][i], ref["shapes"][i]).requires_grad_(true));
    oparams.push_back({"p" + std::to_string(i), params.back(), ref["weight_decay"][i].get<double>()});
  }
  AdamW8bitOptions o;
  o.adam.beta1 = ref["betas"][0];
  o.adam.beta2 = ref["betas"][1];
  o.adam.eps = ref["eps"];
  AdamW8bit opt(oparams, o, {});
  const double lr = ref["lr"];
  int checked = 0;
  for (size_t s = 0; s < ref["steps"].size(); ++s) {
    const auto& rec = ref["steps"][s];
    for (int i = 0; i < 2; ++i) params[i].mutable_grad() = a8_from_list(rec["grads"][i], ref["shapes"][i]);
    opt.step(lr);
    if (!rec.contains("params")) continue;
    for (int i = 0; i < 2; ++i) {
      auto expected = a8_from_list(rec["params"][i], ref["shapes"][i]);
      auto rel = ((params[i].detach() - expected).abs() / expected.abs().clamp_min(1e-3)).max().item<double>();
      EXPECT_LT(rel, 3e-6) << "step " << s + 1 << " param " << i;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 20);
  auto st = state_map(opt);
  ASSERT_EQ(st.size(), 4u);
  EXPECT_EQ(st.at("p0.exp_avg").scalar_type(), torch::kFloat);
  EXPECT_EQ(st.at("p1.exp_avg_sq").scalar_type(), torch::kFloat);
}

TEST(AdamW8bit, StateLayoutAndBytesPerParameter) {
  auto small = torch::zeros({4095}).requires_grad_(true);
  auto big = torch::zeros({256, 256}).requires_grad_(true);
  auto odd = torch::zeros({4096 + 100}).requires_grad_(true);  // short last block
  AdamW8bit opt({{"small", small, 0.0}, {"big", big, 0.0}, {"odd", odd, 0.0}}, {}, {});
  EXPECT_FALSE(opt.uses_8bit_state(0));
  EXPECT_TRUE(opt.uses_8bit_state(1));
  for (auto* p : {&small, &big, &odd}) p->mutable_grad() = torch::randn(p->sizes());
  opt.step(1e-3);
  auto st = state_map(opt);
  ASSERT_EQ(st.size(), 2u + 4u + 4u);
  EXPECT_EQ(st.at("small.exp_avg").scalar_type(), torch::kFloat);
  EXPECT_EQ(st.at("big.exp_avg_q").scalar_type(), torch::kByte);
  EXPECT_EQ(st.at("big.exp_avg_q").sizes(), big.sizes());
  EXPECT_EQ(st.at("big.exp_avg_absmax").numel(), 256);
  EXPECT_EQ(st.at("big.exp_avg_sq_q").scalar_type(), torch::kByte);
  EXPECT_EQ(st.at("big.exp_avg_sq_absmax").scalar_type(), torch::kFloat);
  EXPECT_EQ(st.at("odd.exp_avg_absmax").numel(), 17);
  const int64_t big_bytes = 65536 * 2 + 256 * 4 * 2;
  EXPECT_DOUBLE_EQ(big_bytes / 65536.0, 2.03125);  // ~2.03 bytes/parameter (fp32 AdamW: 8)
  EXPECT_EQ(opt.state_bytes(), 4095 * 8 + big_bytes + 4196 * 2 + 17 * 8);
  // step 1 from zero state: m = (1-b1) g, so the dequantized m matches within the quantization error
  auto m = dequantize_blockwise(st.at("big.exp_avg_q"), st.at("big.exp_avg_absmax"), signed_dynamic_map());
  auto m_exact = big.grad() * 0.1;
  EXPECT_LT((m - m_exact).abs().max().item<double>(), 0.0071 * m_exact.abs().max().item<double>());
}

TEST(AdamW8bit, TrajectoryStaysCloseToFp32AdamW) {
  LeastSquares ls;
  torch::manual_seed(22);
  auto init1 = torch::randn({64, 128}) * 0.1;
  auto init2 = torch::randn({8192}) * 0.1;
  auto run = [&](bool eight_bit) {
    auto x1 = init1.clone().requires_grad_(true);
    auto x2 = init2.clone().requires_grad_(true);
    std::vector<OptimParam> ps{{"x1", x1, 0.01}, {"x2", x2, 0.01}};
    std::unique_ptr<Optimizer> opt;
    if (eight_bit) {
      opt = std::make_unique<AdamW8bit>(ps, AdamW8bitOptions{}, OptimizerOptions{});
    } else {
      opt = std::make_unique<AdamW>(ps, AdamWOptions{}, OptimizerOptions{});
    }
    for (int s = 0; s < 100; ++s) {
      auto [g1, g2] = ls.grads(x1, x2);
      x1.mutable_grad() = g1;
      x2.mutable_grad() = g2;
      opt->step(1e-2);
    }
    return std::make_tuple(x1.detach(), x2.detach(), ls.loss(x1, x2));
  };
  const double loss0 = ls.loss(init1, init2);
  auto [a1, a2, loss32] = run(false);
  auto [q1, q2, loss8] = run(true);
  EXPECT_LT(loss32, 0.5 * loss0);
  EXPECT_NEAR(loss8, loss32, 0.03 * (loss0 - loss32));
  const double moved = torch::cat({(a1 - init1).flatten(), a2 - init2}).norm().item<double>();
  const double dist = torch::cat({(q1 - a1).flatten(), q2 - a2}).norm().item<double>();
  EXPECT_GT(moved, 1.0);
  EXPECT_LT(dist / moved, 0.05) << "relative parameter distance to fp32 AdamW";
}

TEST(AdamW8bit, NonFiniteGradientElementsLeaveParamAndStateUntouched) {
  torch::manual_seed(23);
  auto big = torch::randn({8192}).requires_grad_(true);
  auto small = torch::randn({100}).requires_grad_(true);
  AdamW8bit opt({{"big", big, 0.1}, {"small", small, 0.1}}, {}, {});
  for (int s = 0; s < 3; ++s) {
    big.mutable_grad() = torch::randn({8192});
    small.mutable_grad() = torch::randn({100});
    opt.step(1e-2);
  }
  auto before = state_map(opt);
  for (auto& [k, t] : before) t = t.clone();
  auto big_before = big.detach().clone();
  auto small_before = small.detach().clone();

  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  auto gb = torch::randn({8192});
  auto gs = torch::randn({100});
  const std::vector<int64_t> bad = {3, 700, 4000, 8191};
  for (size_t k = 0; k < bad.size(); ++k) gb[bad[k]] = (k % 2 ? inf : nan);
  gb.narrow(0, 5 * 256, 256).fill_(-inf);  // a whole block
  gs[7] = nan;
  gs[50] = -inf;
  big.mutable_grad() = gb;
  small.mutable_grad() = gs;
  opt.step(1e-2);
  auto after = state_map(opt);

  for (int64_t i : bad) EXPECT_EQ(big[i].item<float>(), big_before[i].item<float>()) << i;
  EXPECT_TRUE(torch::equal(big.detach().narrow(0, 1280, 256), big_before.narrow(0, 1280, 256)));
  EXPECT_FALSE(torch::equal(big.detach().narrow(0, 0, 256), big_before.narrow(0, 0, 256)));
  EXPECT_TRUE(torch::isfinite(big.detach()).all().item<bool>());
  // the all-non-finite block keeps its codes and absmax bit for bit
  for (const char* s : {"big.exp_avg_q", "big.exp_avg_sq_q"}) {
    EXPECT_TRUE(torch::equal(after.at(s).narrow(0, 1280, 256), before.at(s).narrow(0, 1280, 256))) << s;
  }
  for (const char* s : {"big.exp_avg_absmax", "big.exp_avg_sq_absmax"}) {
    EXPECT_EQ(after.at(s)[5].item<float>(), before.at(s)[5].item<float>()) << s;
    EXPECT_TRUE(torch::isfinite(after.at(s)).all().item<bool>()) << s;
  }
  // scattered elements: their moment keeps its value up to requantization with the block's new absmax
  auto m_before =
      dequantize_blockwise(before.at("big.exp_avg_q"), before.at("big.exp_avg_absmax"), signed_dynamic_map());
  auto m_after = dequantize_blockwise(after.at("big.exp_avg_q"), after.at("big.exp_avg_absmax"), signed_dynamic_map());
  auto absmax_after = after.at("big.exp_avg_absmax");
  for (int64_t i : bad) {
    EXPECT_LE(std::abs(m_after[i].item<float>() - m_before[i].item<float>()),
              0.0071 * absmax_after[i / 256].item<float>())
        << i;
  }
  // fp32 state (small tensor): exactly untouched
  EXPECT_EQ(small[7].item<float>(), small_before[7].item<float>());
  EXPECT_EQ(small[50].item<float>(), small_before[50].item<float>());
  EXPECT_NE(small[8].item<float>(), small_before[8].item<float>());
  for (const char* s : {"small.exp_avg", "small.exp_avg_sq"}) {
    EXPECT_EQ(after.at(s)[7].item<float>(), before.at(s)[7].item<float>()) << s;
    EXPECT_EQ(after.at(s)[50].item<float>(), before.at(s)[50].item<float>()) << s;
    EXPECT_NE(after.at(s)[8].item<float>(), before.at(s)[8].item<float>()) << s;
  }
}

TEST(AdamW8bit, StateRoundTripGivesIdenticalSteps) {
  torch::manual_seed(24);
  auto p = torch::randn({40, 128}).requires_grad_(true);
  auto b = torch::randn({40}).requires_grad_(true);
  AdamW8bit opt({{"layer.weight", p, 0.01}, {"layer.bias", b, 0.0}}, {}, {});
  for (int s = 0; s < 3; ++s) {
    p.mutable_grad() = torch::randn({40, 128});
    b.mutable_grad() = torch::randn({40});
    opt.step(1e-3);
  }
  auto saved = state_map(opt);
  auto q = p.detach().clone().requires_grad_(true);
  auto c = b.detach().clone().requires_grad_(true);
  AdamW8bit opt2({{"layer.weight", q, 0.01}, {"layer.bias", c, 0.0}}, {}, {});
  opt2.load_state_tensors(saved);
  opt2.set_step_count(opt.step_count());
  for (int s = 0; s < 2; ++s) {
    auto g = torch::randn({40, 128});
    auto gb = torch::randn({40});
    p.mutable_grad() = g.clone();
    q.mutable_grad() = g.clone();
    b.mutable_grad() = gb.clone();
    c.mutable_grad() = gb.clone();
    opt.step(1e-3);
    opt2.step(1e-3);
  }
  EXPECT_TRUE(torch::equal(p, q));
  EXPECT_TRUE(torch::equal(b, c));
  auto s1 = state_map(opt), s2 = state_map(opt2);
  ASSERT_EQ(s1.size(), s2.size());
  for (const auto& [k, t] : s1) EXPECT_TRUE(torch::equal(t, s2.at(k))) << k;

  auto wrong = saved;
  wrong["layer.weight.exp_avg_absmax"] = torch::zeros({3});
  EXPECT_THROW(opt2.load_state_tensors(wrong), Error);
  wrong = saved;
  wrong["layer.weight.exp_avg_q"] = wrong["layer.weight.exp_avg_q"].to(torch::kFloat);
  EXPECT_THROW(opt2.load_state_tensors(wrong), Error);
  wrong = saved;
  wrong.erase("layer.weight.exp_avg_sq_q");
  EXPECT_THROW(opt2.load_state_tensors(wrong), Error);
}

TEST(AdamW8bit, Bf16WeightsWithStochasticRoundingFollowFp32) {
  // lr * update (~1e-5) is far below half a bf16 ulp of 1.0: round-to-nearest
  // never moves the weight; stochastic rounding follows fp32 on average.
  const int64_t n = 8192;
  auto run = [&](at::ScalarType dtype, bool sr) {
    auto p = torch::ones({n}, dtype).requires_grad_(true);
    AdamW8bitOptions a;
    OptimizerOptions o;
    o.stochastic_rounding = sr;
    o.seed = 9;
    AdamW8bit opt({{"w", p, 0.0}}, a, o);
    for (int s = 0; s < 200; ++s) {
      p.mutable_grad() = torch::ones({n}, dtype);
      opt.step(1e-5);
    }
    return p.detach().to(torch::kFloat32).mean().item<double>();
  };
  const double fp32 = run(torch::kFloat32, false);
  EXPECT_NEAR(fp32, 1.0 - 200 * 1e-5, 1e-5);
  EXPECT_EQ(run(torch::kBFloat16, false), 1.0);
  EXPECT_NEAR(run(torch::kBFloat16, true), fp32, 2e-4);
  EXPECT_NEAR(run(torch::kHalf, true), fp32, 2e-4);

  // The bf16 path on the least-squares problem ends near the fp32 8-bit path.
  LeastSquares ls;
  torch::manual_seed(25);
  auto init1 = torch::randn({64, 128}) * 0.1;
  auto init2 = torch::randn({8192}).to(torch::kBFloat16).to(torch::kFloat) * 0.1;
  init1 = init1.to(torch::kBFloat16).to(torch::kFloat);
  auto solve = [&](at::ScalarType dtype) {
    auto x1 = init1.to(dtype, false, true).requires_grad_(true);
    auto x2 = init2.to(dtype, false, true).requires_grad_(true);
    AdamW8bit opt({{"x1", x1, 0.01}, {"x2", x2, 0.01}}, {}, {});
    for (int s = 0; s < 60; ++s) {
      auto [g1, g2] = ls.grads(x1, x2);
      x1.mutable_grad() = g1.to(dtype);
      x2.mutable_grad() = g2.to(dtype);
      opt.step(1e-2);
    }
    return ls.loss(x1, x2);
  };
  const double loss0 = ls.loss(init1, init2);
  const double loss32 = solve(torch::kFloat);
  const double loss16 = solve(torch::kBFloat16);
  EXPECT_LT(loss32, 0.7 * loss0);
  EXPECT_NEAR(loss16, loss32, 0.05 * (loss0 - loss32));
}

TEST(AdamW8bit, ParsesKohyaArgs) {
  auto o = parse_adamw8bit_args(
      {"weight_decay=0.05", "betas=0.8,0.95", "eps=1e-6", "min_8bit_size=16384", "block_size=2048"});
  EXPECT_DOUBLE_EQ(o.adam.weight_decay, 0.05);
  EXPECT_DOUBLE_EQ(o.adam.beta1, 0.8);
  EXPECT_DOUBLE_EQ(o.adam.beta2, 0.95);
  EXPECT_DOUBLE_EQ(o.adam.eps, 1e-6);
  EXPECT_EQ(o.min_8bit_size, 16384);
  EXPECT_EQ(o.block_size, 2048);
  auto d = parse_adamw8bit_args({});
  EXPECT_EQ(d.block_size, 256);
  EXPECT_EQ(d.min_8bit_size, 4096);
  try {
    parse_adamw8bit_args({"percentile_clipping=100"});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("valid: weight_decay, betas, eps, min_8bit_size, block_size"),
              std::string::npos)
        << e.what();
  }
  try {
    parse_adamw8bit_args({"eps=1e-8e"});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("eps"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_adamw8bit_args({"block_size=0"}), Error);
  EXPECT_THROW(parse_adamw8bit_args({"block_size=2.5"}), Error);
  EXPECT_THROW(parse_adamw8bit_args({"betas=0.9;0.99"}), Error);
  AdamW8bitOptions bad;
  bad.block_size = 0;
  auto p = torch::zeros({2}).requires_grad_(true);
  EXPECT_THROW(AdamW8bit({{"w", p, 0.0}}, bad, {}), Error);
}

TEST(AdamW8bit, StochasticRoundingUsesWriteParamBits) {
  // With fp32 state (small tensor) the update equals AdamW's, so rounding the
  // bf16 weight with the same (seed, step, parameter) stream must give the
  // same bf16 values as AdamW, which goes through Optimizer::write_param.
  torch::manual_seed(26);
  auto init = torch::randn({1024}).to(torch::kBFloat16);
  auto p8 = init.clone().requires_grad_(true);
  auto p32 = init.clone().requires_grad_(true);
  OptimizerOptions o;
  o.seed = 77;
  AdamW8bit opt8({{"other", torch::zeros({1}).requires_grad_(true), 0.0}, {"w", p8, 0.01}}, {}, o);
  AdamW opt32({{"other", torch::zeros({1}).requires_grad_(true), 0.0}, {"w", p32, 0.01}}, {}, o);
  for (int s = 0; s < 3; ++s) {
    auto g = torch::randn({1024}).to(torch::kBFloat16);
    p8.mutable_grad() = g.clone();
    p32.mutable_grad() = g.clone();
    opt8.step(1e-3);
    opt32.step(1e-3);
  }
  EXPECT_FALSE(torch::equal(p8, init));
  EXPECT_TRUE(torch::equal(p8, p32));
}

TEST(AdamW8bit, ResultDoesNotDependOnThreadCount) {
  // 300K elements: several parallel chunks of 64K elements.
  torch::manual_seed(27);
  auto init = torch::randn({300000});
  auto grads = std::vector<at::Tensor>{torch::randn({300000}), torch::randn({300000})};
  const int threads = at::get_num_threads();
  auto run = [&](int n_threads) {
    at::set_num_threads(n_threads);
    auto p = init.to(torch::kBFloat16).requires_grad_(true);
    AdamW8bit opt({{"w", p, 0.01}}, {}, {});
    for (const auto& g : grads) {
      p.mutable_grad() = g.clone();
      opt.step(1e-3);
    }
    return std::make_pair(p.detach().clone(), state_map(opt));
  };
  auto [p1, s1] = run(1);
  auto [p2, s2] = run(std::max(2, threads));
  at::set_num_threads(threads);
  EXPECT_TRUE(torch::equal(p1, p2));
  for (const auto& [k, t] : s1) EXPECT_TRUE(torch::equal(t, s2.at(k))) << k;
}
