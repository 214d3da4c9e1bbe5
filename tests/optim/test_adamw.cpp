#include <gtest/gtest.h>

#include <fstream>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/optim/grad_hooks.h"
#include "shoestring/optim/optimizer.h"
#include "shoestring/optim/optimizer_args.h"

using namespace shoestring;

namespace {
at::Tensor from_list(const nlohmann::json& values, const nlohmann::json& shape) {
  std::vector<float> v = values.get<std::vector<float>>();
  return torch::tensor(v).view(shape.get<std::vector<int64_t>>());
}
}  // namespace

// Golden values from torch.optim.AdamW (scripts/gen_adamw_reference.py).
TEST(AdamW, MatchesTorchOptimOver100Steps) {
  std::ifstream in(std::string(SHOESTRING_TEST_DATA) + "/optim/adamw_reference.json");
  ASSERT_TRUE(in.good());
  auto ref = nlohmann::json::parse(in);
  std::vector<at::Tensor> params;
  std::vector<OptimParam> oparams;
  for (int i = 0; i < 2; ++i) {
    params.push_back(from_list(ref["initial"][i], ref["shapes"][i]).requires_grad_(true));
    oparams.push_back({"p" + std::to_string(i), params.back(), ref["weight_decay"][i].get<double>()});
  }
  AdamWOptions adam;
  adam.beta1 = ref["betas"][0];
  adam.beta2 = ref["betas"][1];
  adam.eps = ref["eps"];
  AdamW opt(oparams, adam, {});
  const double lr = ref["lr"];
  int checked = 0;
  for (size_t s = 0; s < ref["steps"].size(); ++s) {
    const auto& rec = ref["steps"][s];
    for (int i = 0; i < 2; ++i) params[i].mutable_grad() = from_list(rec["grads"][i], ref["shapes"][i]);
    opt.step(lr);
    if (rec.contains("params")) {
      for (int i = 0; i < 2; ++i) {
        auto expected = from_list(rec["params"][i], ref["shapes"][i]);
        auto rel = ((params[i].detach() - expected).abs() / expected.abs().clamp_min(1e-3)).max().item<double>();
        EXPECT_LT(rel, 1e-6) << "step " << s + 1 << " param " << i;
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 20);
  EXPECT_EQ(opt.step_count(), 100);
}

TEST(AdamW, Bf16StochasticRoundingKeepsSmallUpdates) {
  // lr * update (~1e-5) is far below half a bf16 ulp of 1.0 (2^-8 / 2 = 2e-3):
  // round-to-nearest never moves the weight; stochastic rounding follows fp32 on average.
  const int64_t n = 4096;
  auto run = [&](at::ScalarType dtype, bool sr) {
    auto p = torch::ones({n}, dtype).requires_grad_(true);
    AdamWOptions a;
    a.weight_decay = 0;
    OptimizerOptions o;
    o.stochastic_rounding = sr;
    o.seed = 9;
    AdamW opt({{"w", p, 0.0}}, a, o);
    for (int s = 0; s < 200; ++s) {
      p.mutable_grad() = torch::ones({n}, dtype);  // Adam's normalized step is ~lr each time
      opt.step(1e-5);
    }
    return p.detach().to(torch::kFloat32).mean().item<double>();
  };
  const double fp32 = run(torch::kFloat32, false);
  const double rtn = run(torch::kBFloat16, false);
  const double sr = run(torch::kBFloat16, true);
  EXPECT_NEAR(fp32, 1.0 - 200 * 1e-5, 1e-5);
  EXPECT_EQ(rtn, 1.0);
  EXPECT_NEAR(sr, fp32, 2e-4);
}

TEST(AdamW, StateRoundTripAndArgs) {
  auto p = torch::randn({3, 4}).requires_grad_(true);
  AdamW opt({{"layer.weight", p, 0.01}}, {}, {});
  p.mutable_grad() = torch::randn({3, 4});
  opt.step(1e-3);
  auto state = opt.state_tensors();
  ASSERT_EQ(state.size(), 2u);
  std::map<std::string, at::Tensor> m(state.begin(), state.end());
  EXPECT_TRUE(m.count("layer.weight.exp_avg"));
  auto q = p.detach().clone().requires_grad_(true);
  AdamW opt2({{"layer.weight", q, 0.01}}, {}, {});
  opt2.load_state_tensors(m);
  opt2.set_step_count(1);
  auto g = torch::randn({3, 4});
  p.mutable_grad() = g.clone();
  q.mutable_grad() = g.clone();
  opt.step(1e-3);
  opt2.step(1e-3);
  EXPECT_TRUE(torch::equal(p, q));
  m["bogus.exp_avg"] = torch::zeros({1});
  EXPECT_THROW(opt2.load_state_tensors(m), Error);

  auto args = parse_adamw_args({"weight_decay=0.05", "betas=0.8,0.95", "eps=1e-6"});
  EXPECT_DOUBLE_EQ(args.weight_decay, 0.05);
  EXPECT_DOUBLE_EQ(args.beta1, 0.8);
  EXPECT_DOUBLE_EQ(args.beta2, 0.95);
  EXPECT_DOUBLE_EQ(args.eps, 1e-6);
  try {
    parse_adamw_args({"momentum=0.9"});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("valid: weight_decay, betas, eps"), std::string::npos);
  }
  EXPECT_THROW(parse_adamw_args({"betas=0.9"}), Error);
  EXPECT_THROW(parse_adamw_args({"eps=abc"}), Error);
  EXPECT_TRUE(default_no_decay("norm.weight", torch::ones({4})));
  EXPECT_FALSE(default_no_decay("conv.weight", torch::ones({4, 4, 3, 3})));
}

TEST(GradHooks, FireAfterAccumulationWithGradSet) {
  auto a = torch::randn({3}).requires_grad_(true);
  auto b = torch::randn({3}).requires_grad_(true);
  std::vector<size_t> order;
  std::vector<double> seen;
  PostAccumulateGradHooks hooks;
  hooks.install({a, b}, [&](size_t i, at::Tensor& p) {
    order.push_back(i);
    seen.push_back(p.grad().sum().item<double>());
  });
  for (int iter = 0; iter < 2; ++iter) {  // hooks survive across iterations
    ((a * 2).sum() + (b * 3).sum()).backward();
  }
  ASSERT_EQ(order.size(), 4u);
  // Second iteration sees accumulated gradients: 2*3*2 = 12 for a, 18 for b.
  double a_total = 0, b_total = 0;
  for (size_t k = 2; k < 4; ++k) (order[k] == 0 ? a_total : b_total) = seen[k];
  EXPECT_DOUBLE_EQ(a_total, 12.0);
  EXPECT_DOUBLE_EQ(b_total, 18.0);
  auto c = torch::randn({2});  // not requiring grad
  EXPECT_THROW(hooks.install({c}, [](size_t, at::Tensor&) {}), Error);
}

TEST(OptimizerArgs, ParsesKohyaStyleValues) {
  OptimizerArgs a({"lr_like=1e-3", "flag=False", "betas=(0.9, 0.99)", "beta1=None"}, "X",
                  {"lr_like", "flag", "betas", "beta1", "unused"});
  EXPECT_DOUBLE_EQ(a.get_double("lr_like", 0), 1e-3);
  EXPECT_FALSE(a.get_bool("flag", true));
  EXPECT_EQ(a.get_pair("betas", {0, 0}), std::make_pair(0.9, 0.99));
  EXPECT_FALSE(a.get_optional_double("beta1", 0.5).has_value());
  EXPECT_DOUBLE_EQ(a.get_double("unused", 7.0), 7.0);
  EXPECT_THROW(OptimizerArgs({"a=1", "a=2"}, "X", {"a"}), Error);
  EXPECT_THROW(OptimizerArgs({"a"}, "X", {"a"}), Error);
  OptimizerArgs b({"flag=maybe", "n=1x"}, "X", {"flag", "n"});
  EXPECT_THROW(b.get_bool("flag", true), Error);
  EXPECT_THROW(b.get_double("n", 0), Error);
}
