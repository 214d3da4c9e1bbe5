// train/ema.h against diffusers' EMAModel (src/diffusers/training_utils.py):
// step() increments optimization_step, get_decay(optimization_step) is
//   step = max(0, optimization_step - update_after_step - 1)   (update_after_step = 0)
//   0 if step <= 0, else min(decay, (1 + step) / (10 + step))   (use_ema_warmup = False)
// and the shadow moves as s <- s - (1 - d) * (s - p).
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "../error_testing.h"
#include "shoestring/train/ema.h"

using namespace shoestring;

namespace {

/// diffusers' get_decay, transcribed from its definition above.
double diffusers_decay(int64_t optimization_step, double decay) {
  const int64_t step = std::max<int64_t>(0, optimization_step - 0 - 1);
  if (step <= 0) return 0.0;
  return std::min(decay, (1.0 + static_cast<double>(step)) / (10.0 + static_cast<double>(step)));
}

}  // namespace

TEST(EMA, FollowsDiffusersDecayRampAndShadowUpdate) {
  at::Tensor p = torch::zeros({3});
  EMA ema({{"w", p}}, 0.99);
  double reference[3] = {0, 0, 0};
  for (int64_t k = 1; k <= 400; ++k) {
    {
      torch::NoGradGuard no_grad;
      p.copy_(torch::tensor({std::sin(0.1 * k), 1.0 + k, -2.0 * k}, torch::kFloat));
    }
    ema.update(k);
    const double d = diffusers_decay(k, 0.99);
    EXPECT_DOUBLE_EQ(ema.decay_at(k), d) << "step " << k;
    auto pa = p.accessor<float, 1>();
    for (int i = 0; i < 3; ++i) reference[i] -= (1 - d) * (reference[i] - pa[i]);
  }
  const at::Tensor shadow = ema.tensors().at(0).second;
  for (int i = 0; i < 3; ++i) {
    EXPECT_NEAR(shadow[i].item<double>(), reference[i], 1e-4 * std::max(1.0, std::abs(reference[i]))) << i;
  }
  // The first step copies the weights; the ramp stays below ema_decay until
  // (1 + s) / (10 + s) reaches it (s = 890 for 0.99).
  EXPECT_EQ(ema.decay_at(1), 0.0);
  EXPECT_DOUBLE_EQ(ema.decay_at(2), 2.0 / 11.0);
  EXPECT_LT(ema.decay_at(136), 0.99);
  EXPECT_DOUBLE_EQ(ema.decay_at(100000), 0.99);
  EXPECT_NE(shoestring::testing::error_of([&] { ema.update(0); }).find("step must be >= 1"), std::string::npos);
}
