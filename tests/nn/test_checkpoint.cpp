// Gradient checkpointing: bitwise-equal gradients to the plain path.
#include <unordered_set>

#include <gtest/gtest.h>

#include <torch/torch.h>
#include "graph_testing.h"

#include "shoestring/core/error.h"
#include "shoestring/nn/checkpoint.h"

using namespace shoestring;

namespace {

struct Mlp : torch::nn::Module {
  Mlp() {
    fc1 = register_module("fc1", torch::nn::Linear(6, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 6));
  }
  torch::Tensor forward(const torch::Tensor& x, double p_drop) {
    auto h = torch::gelu(fc1->forward(x));
    if (p_drop > 0) h = torch::dropout(h, p_drop, /*train=*/true);
    return fc2->forward(h) + x;
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

struct Grads {
  torch::Tensor out, x_grad, after_rng;
  std::vector<torch::Tensor> params;
};

// Two stacked segments, loss = sum(out * w) for a fixed w.
Grads run(Mlp& m, bool use_checkpoint, double p_drop, bool x_requires_grad) {
  m.zero_grad();
  torch::manual_seed(123);
  auto x = torch::linspace(-2, 2, 24).view({4, 6}).requires_grad_(x_requires_grad);
  auto seg = [&m, p_drop](const torch::Tensor& in) { return m.forward(in, p_drop); };
  torch::Tensor h = x;
  for (int i = 0; i < 2; ++i) h = use_checkpoint ? nn::checkpoint(seg, h) : seg(h);
  auto w = torch::cos(torch::arange(24, torch::kFloat32)).view({4, 6});
  (h * w).sum().backward();
  Grads g;
  g.out = h.detach();
  g.x_grad = x_requires_grad ? x.grad().clone() : torch::Tensor();
  g.after_rng = torch::rand({4});  // the RNG stream continues as in the plain path
  for (auto& p : m.parameters()) g.params.push_back(p.grad().clone());
  return g;
}

void expect_bitwise_equal(const Grads& a, const Grads& b) {
  EXPECT_TRUE(torch::equal(a.out, b.out));
  if (a.x_grad.defined() || b.x_grad.defined()) {
    EXPECT_TRUE(torch::equal(a.x_grad, b.x_grad));
  }
  EXPECT_TRUE(torch::equal(a.after_rng, b.after_rng));
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t i = 0; i < a.params.size(); ++i) EXPECT_TRUE(torch::equal(a.params[i], b.params[i])) << "param " << i;
}

using shoestring::testing::count_graph_nodes;

}  // namespace

TEST(Checkpoint, GradientsBitwiseEqualPlainPath) {
  torch::manual_seed(0);
  Mlp m;
  expect_bitwise_equal(run(m, false, 0.0, true), run(m, true, 0.0, true));
}

TEST(Checkpoint, DropoutMasksReplayedFromSavedRngState) {
  torch::manual_seed(0);
  Mlp m;
  auto plain = run(m, false, 0.5, true);
  auto ckpt = run(m, true, 0.5, true);
  expect_bitwise_equal(plain, ckpt);
  // Dropout really is active: a different seed changes the output.
  auto other = run(m, false, 0.0, true);
  EXPECT_FALSE(torch::equal(plain.out, other.out));
}

TEST(Checkpoint, ParametersGetGradientsWhenNoInputRequiresGrad) {
  torch::manual_seed(0);
  Mlp m;
  auto plain = run(m, false, 0.0, false);
  auto ckpt = run(m, true, 0.0, false);
  expect_bitwise_equal(plain, ckpt);
  EXPECT_GT(ckpt.params[0].abs().sum().item<double>(), 0.0);
}

TEST(Checkpoint, MultipleInputsAndOutputsWithNonDifferentiableInput) {
  torch::manual_seed(0);
  auto w = torch::randn({5, 5}, torch::requires_grad());
  auto run_case = [&](bool ck) {
    w.mutable_grad() = torch::Tensor();
    torch::manual_seed(5);
    auto a = torch::randn({3, 5}, torch::requires_grad());
    auto b = torch::randn({3, 5}, torch::requires_grad());
    auto mask = torch::tensor({1, 0, 1}).to(torch::kBool);  // no grad, not floating
    nn::SegmentFn fn = [w](const std::vector<torch::Tensor>& in) {
      auto h = torch::tanh(torch::matmul(in[0], w)) * in[1];
      auto y = h.masked_fill(in[2].logical_not().unsqueeze(1), 0.0);
      return std::vector<torch::Tensor>{y, h.sum(1)};
    };
    auto outs = ck ? nn::checkpoint(fn, {a, b, mask}) : fn({a, b, mask});
    (outs[0].pow(2).sum() + outs[1].sum() * 0.5).backward();
    return std::vector<torch::Tensor>{outs[0].detach(), a.grad(), b.grad(), w.grad().clone()};
  };
  auto plain = run_case(false), ck = run_case(true);
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], ck[i])) << i;
}

TEST(Checkpoint, UnusedOutputGetsNoGradient) {
  auto w = torch::randn({4}, torch::requires_grad());
  auto x = torch::randn({4}, torch::requires_grad());
  auto outs = nn::checkpoint(
      [w](const std::vector<torch::Tensor>& in) {
        return std::vector<torch::Tensor>{in[0] * w, in[0] + w};
      },
      {x});
  outs[0].sum().backward();
  EXPECT_TRUE(torch::equal(x.grad(), w.detach()));
  EXPECT_TRUE(torch::equal(w.grad(), x.detach()));
}

TEST(Checkpoint, KeepsOnlyOneGraphNodePerSegment) {
  torch::manual_seed(0);
  Mlp m;
  auto x = torch::randn({4, 6}, torch::requires_grad());
  auto seg = [&m](const torch::Tensor& in) { return m.forward(in, 0.0); };
  const size_t plain = count_graph_nodes(seg(seg(x)));
  const size_t ck = count_graph_nodes(nn::checkpoint(seg, nn::checkpoint(seg, x)));
  EXPECT_EQ(ck, 3u);  // two checkpoint nodes + x's AccumulateGrad
  EXPECT_GT(plain, 10u);
}

TEST(Checkpoint, NoGradModeRunsFunctionDirectly) {
  auto x = torch::randn({3}, torch::requires_grad());
  torch::NoGradGuard no_grad;
  auto y = nn::checkpoint([](const torch::Tensor& t) { return t * 2; }, x);
  EXPECT_FALSE(y.requires_grad());
  EXPECT_TRUE(torch::equal(y, x.detach() * 2));
}

TEST(Checkpoint, RejectsUndefinedInput) {
  EXPECT_THROW(nn::checkpoint([](const torch::Tensor& t) { return t; }, torch::Tensor()), Error);
}
