// Fused backward together with gradient checkpointing (nn/checkpoint.h).
// Lives under tests/train because it links both optim and nn.
#include <gtest/gtest.h>

#include <cmath>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/nn/checkpoint.h"
#include "shoestring/optim/fused_backward.h"

using namespace shoestring;

namespace {

struct Net {
  std::vector<at::Tensor> params;  // (W, b) x 3
  Net() {
    torch::manual_seed(21);
    const std::vector<int64_t> w = {6, 10, 10, 3};
    for (size_t l = 0; l + 1 < w.size(); ++l) {
      params.push_back((torch::randn({w[l + 1], w[l]}) / std::sqrt(double(w[l]))).requires_grad_(true));
      params.push_back((torch::randn({w[l + 1]}) * 0.1).requires_grad_(true));
    }
  }
  at::Tensor layer(size_t l, const at::Tensor& x, bool last) const {
    at::Tensor y = torch::addmm(params[2 * l + 1], x, params[2 * l].t());
    return last ? y : torch::tanh(y);
  }
  // Layers 0 and 1 each in their own checkpointed segment when `ckpt`.
  at::Tensor forward(at::Tensor x, bool ckpt) const {
    for (size_t l = 0; l < 2; ++l) {
      if (ckpt) {
        x = nn::checkpoint([this, l](const at::Tensor& in) { return layer(l, in, false); }, x);
      } else {
        x = layer(l, x, false);
      }
    }
    return layer(2, x, true);
  }
  std::vector<OptimParam> optim_params() const {
    std::vector<OptimParam> out;
    for (size_t i = 0; i < params.size(); ++i) out.push_back({"p" + std::to_string(i), params[i], 0.01});
    return out;
  }
};

}  // namespace

TEST(FusedBackwardCheckpoint, MatchesPlainBackwardAndStep) {
  torch::manual_seed(8);
  std::vector<at::Tensor> xs, ys;
  for (int i = 0; i < 6; ++i) {
    xs.push_back(torch::randn({4, 6}));
    ys.push_back(torch::randn({4, 3}));
  }
  Net ref, fused;
  AdamW ref_opt(ref.optim_params(), AdamWOptions{}, {});
  AdamW fused_opt(fused.optim_params(), AdamWOptions{}, {});
  FusedBackwardOptions o;
  o.accumulation_steps = 2;
  FusedBackward fb(fused_opt, o);
  for (int s = 0; s < 3; ++s) {
    for (int k = 0; k < 2; ++k) {
      (torch::mse_loss(ref.forward(xs[2 * s + k], false), ys[2 * s + k]) / 2.0).backward();
    }
    ref_opt.step(1e-2);
    for (auto& p : ref.params) p.mutable_grad().reset();

    fb.begin_step(1e-2);
    for (int k = 0; k < 2; ++k) {
      fb.begin_micro_batch(k);
      (torch::mse_loss(fused.forward(xs[2 * s + k], true), ys[2 * s + k]) / 2.0).backward();
      for (const auto& p : fused.params) EXPECT_FALSE(p.grad().defined());
    }
    FusedStepResult r = fb.end_step();
    EXPECT_TRUE(r.finite);
    EXPECT_EQ(r.params_stepped, 6);
  }
  for (size_t i = 0; i < ref.params.size(); ++i) {
    EXPECT_LT((ref.params[i] - fused.params[i]).abs().max().item<double>(), 1e-6) << "param " << i;
  }
  EXPECT_EQ(fused_opt.step_count(), 3);
}

TEST(FusedBackwardCheckpoint, ParameterUsedInTwoSegmentsIsRejected) {
  // The same layer in two checkpointed segments receives two partial
  // gradients (one per recompute); stepping on the first would be wrong.
  auto w = (torch::eye(4) * 0.5).requires_grad_(true);
  AdamW opt({{"w", w, 0.0}}, AdamWOptions{}, {});
  FusedBackward fb(opt, {});
  fb.begin_step(1e-3);
  fb.begin_micro_batch(0);
  auto seg = [&](const at::Tensor& in) { return torch::tanh(torch::mm(in, w)); };
  at::Tensor x = torch::randn({2, 4});
  at::Tensor y = nn::checkpoint(seg, nn::checkpoint(seg, x));
  try {
    y.sum().backward();
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("received its gradient twice"), std::string::npos) << e.what();
  }
}
