// The gradient paths (optim/gradient_path.h) against plain SGD written out
// by hand: w <- w - lr * clip * sum_micro(g), with torch.nn.utils.
// clip_grad_norm_'s factor clip = max_norm / (||g|| + 1e-6) when ||g|| > max_norm.
#include <gtest/gtest.h>

#include <cmath>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/optim/gradient_path.h"

using namespace shoestring;

namespace {

/// Plain SGD: the update the paths are checked against.
class Sgd final : public Optimizer {
 public:
  using Optimizer::Optimizer;
  void update(size_t index, const at::Tensor& grad, double lr, int64_t step) override {
    at::Tensor p = params_[index].param.to(torch::kFloat32);
    write_param(index, p - lr * grad.to(torch::kFloat32), step);
  }
};

using Named = std::vector<std::pair<std::string, at::Tensor>>;

OptimizerFactory sgd_factory() {
  return [](const Named& params) {
    std::vector<OptimParam> ps;
    for (const auto& [n, p] : params) ps.push_back({n, p, 0.0});
    OptimizerOptions o;
    o.stochastic_rounding = false;
    return std::make_unique<Sgd>(ps, o);
  };
}

/// Two leaf parameters of `dtype`, values fixed by a seed.
Named make_params(at::ScalarType dtype) {
  torch::manual_seed(3);
  return {{"a", torch::randn({4, 3}).to(dtype).set_requires_grad(true)},
          {"b", torch::randn({5}).to(dtype).set_requires_grad(true)}};
}

/// The loss of micro-batch `k`: sum(c_k * a) + sum(d_k * b), so d loss / d a = c_k exactly.
at::Tensor micro_loss(const Named& params, int64_t k, std::vector<at::Tensor>& grads_out) {
  torch::manual_seed(100 + k);
  at::Tensor ca = torch::randn({4, 3}), cb = torch::randn({5});
  grads_out = {ca, cb};
  return (params[0].second.to(torch::kFloat32) * ca).sum() + (params[1].second.to(torch::kFloat32) * cb).sum();
}

struct Expected {
  std::vector<at::Tensor> weights;
  double norm;
};

/// w - lr * clip * (sum of micro-batch gradients) / micro_batches, in float64.
Expected sgd_reference(const Named& params, int64_t micro_batches, double lr, double max_norm) {
  std::vector<at::Tensor> sum = {torch::zeros({4, 3}, torch::kFloat64), torch::zeros({5}, torch::kFloat64)};
  for (int64_t k = 0; k < micro_batches; ++k) {
    std::vector<at::Tensor> g;
    micro_loss(params, k, g);
    for (size_t i = 0; i < 2; ++i) sum[i] += g[i].to(torch::kFloat64) / static_cast<double>(micro_batches);
  }
  double sq = 0;
  for (const auto& g : sum) sq += g.pow(2).sum().item<double>();
  const double norm = std::sqrt(sq);
  const double clip = max_norm > 0 && norm > max_norm ? max_norm / (norm + 1e-6) : 1.0;
  Expected e;
  e.norm = norm;
  for (size_t i = 0; i < 2; ++i)
    e.weights.push_back(params[i].second.detach().to(torch::kFloat64) - lr * clip * sum[i]);
  return e;
}

/// The accumulator path's options: bf16 weights, `micro_batches` summed in
/// `mode` buffers, no clipping.
GradientPathOptions bf16_accumulation(int64_t micro_batches, GradAccumulationMode mode) {
  GradientPathOptions o;
  o.accumulation_steps = micro_batches;
  o.max_grad_norm = 0;
  o.low_precision_weights = true;
  o.accumulation_mode = mode;
  return o;
}

/// Runs one optimizer step of `micro_batches` through `path`.
GradientStepResult run_step(GradientPath& path, const Named& params, int64_t micro_batches, double lr) {
  path.begin_step(lr);
  for (int64_t k = 0; k < micro_batches; ++k) {
    path.begin_micro_batch(k);
    std::vector<at::Tensor> unused;
    path.backward_loss(micro_loss(params, k, unused)).backward();
    EXPECT_FALSE(path.repeat_micro_batch());
    path.end_micro_batch(k);
  }
  return path.end_step(lr, /*loss_finite=*/true);
}

}  // namespace

TEST(GradientPath, ChoosesThePathFromTheOptions) {
  auto choose = [](at::ScalarType dtype, GradientPathOptions o, bool master) {
    Named params = make_params(dtype);
    return make_gradient_path(params, {master, master}, sgd_factory(), o)->name();
  };
  GradientPathOptions o;
  EXPECT_EQ(choose(torch::kFloat32, o, false), "autograd");
  o.accumulation_steps = 2;
  EXPECT_EQ(choose(torch::kFloat32, o, false), "autograd");  // fp32 weights: autograd sums in fp32
  o.low_precision_weights = true;
  EXPECT_EQ(choose(torch::kBFloat16, o, false), "accumulator");
  EXPECT_EQ(choose(torch::kBFloat16, o, true), "master weights");
  GradientPathOptions scaled;
  scaled.loss_scaling.enabled = true;
  EXPECT_EQ(choose(torch::kFloat16, scaled, false), "master weights");
  GradientPathOptions fused;
  fused.fused_backward = true;
  EXPECT_EQ(choose(torch::kFloat32, fused, false), "fused backward");
  fused.loss_scaling.enabled = true;
  EXPECT_THROW(choose(torch::kFloat16, fused, false), Error);
}

TEST(GradientPath, AutogradPathIsClippedSgdOverTheMeanMicroBatchGradient) {
  for (double max_norm : {0.0, 1.0}) {
    Named params = make_params(torch::kFloat32);
    GradientPathOptions o;
    o.accumulation_steps = 3;
    o.max_grad_norm = max_norm;
    const Expected e = sgd_reference(params, 3, 0.1, max_norm);
    auto path = make_gradient_path(params, {false, false}, sgd_factory(), o);
    const GradientStepResult r = run_step(*path, params, 3, 0.1);
    EXPECT_TRUE(r.finite);
    EXPECT_TRUE(r.stepped);
    EXPECT_NEAR(r.grad_norm, e.norm, 1e-5 * e.norm);
    EXPECT_GT(e.norm, 1.0);  // so max_norm = 1 really clips
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_TRUE(torch::allclose(params[i].second.detach().to(torch::kFloat64), e.weights[i], 1e-6, 1e-6))
          << "max_norm " << max_norm << " param " << i;
      EXPECT_FALSE(params[i].second.grad().defined());  // released after the step
    }
    EXPECT_EQ(path->optimizer().step_count(), 1);
  }
}

TEST(GradientPath, AccumulatorPathSumsBf16MicroBatchesInFp32) {
  Named params = make_params(torch::kBFloat16);
  const GradientPathOptions o = bf16_accumulation(4, GradAccumulationMode::fp32);
  const Expected e = sgd_reference(params, 4, 0.05, 0);
  auto path = make_gradient_path(params, {false, false}, sgd_factory(), o);
  ASSERT_EQ(path->name(), "accumulator");
  const GradientStepResult r = run_step(*path, params, 4, 0.05);
  // Each micro-batch gradient is bf16 (the weights' dtype): one rounding of
  // 2^-8 relative each, summed in fp32.
  EXPECT_NEAR(r.grad_norm, e.norm, 4 * std::ldexp(1.0, -8) * e.norm);
  for (size_t i = 0; i < 2; ++i) {
    // The update lands in bf16 by round-to-nearest (SR off): within one bf16
    // ulp of the float64 result, plus the gradients' rounding times lr.
    const at::Tensor got = params[i].second.detach().to(torch::kFloat64);
    const double ulp = std::ldexp(1.0, -7) * e.weights[i].abs().max().item<double>();
    EXPECT_LE((got - e.weights[i]).abs().max().item<double>(), ulp + 0.05 * 4 * std::ldexp(1.0, -8) * 4)
        << "param " << i;
  }
}

// bf16 accumulation buffers round stochastically, keyed by a micro-batch
// count over the whole run (as the fused path's): two optimizer steps over
// the same micro-batch gradients (lr 0 keeps the weights, and these
// gradients do not depend on them) draw other random bits, so their
// buffers, and the norms measured on them, differ; each stays within the
// rounding of the exact norm. Keyed by the micro-batch index alone (as
// before 2026-12-06), every step rounded alike.
TEST(GradientPath, AccumulatorPathDrawsFreshRoundingBitsEachStep) {
  Named params = make_params(torch::kBFloat16);
  GradientPathOptions o = bf16_accumulation(2, GradAccumulationMode::bf16_sr);
  o.seed = 11;
  const Expected e = sgd_reference(params, 2, 0.0, 0);
  auto path = make_gradient_path(params, {false, false}, sgd_factory(), o);
  ASSERT_EQ(path->name(), "accumulator");
  const GradientStepResult first = run_step(*path, params, 2, 0.0);
  const GradientStepResult second = run_step(*path, params, 2, 0.0);
  EXPECT_NE(first.grad_norm, second.grad_norm);
  for (const double norm : {first.grad_norm, second.grad_norm}) {
    EXPECT_NEAR(norm, e.norm, 4 * std::ldexp(1.0, -8) * e.norm);
  }
}

TEST(GradientPath, NonFiniteGradientSkipsTheStepAndReleasesGradients) {
  Named params = make_params(torch::kFloat32);
  const at::Tensor before = params[0].second.detach().clone();
  auto path = make_gradient_path(params, {false, false}, sgd_factory(), {});
  path->begin_step(0.1);
  path->begin_micro_batch(0);
  path->backward_loss((params[0].second * std::numeric_limits<float>::infinity()).sum()).backward();
  path->end_micro_batch(0);
  const GradientStepResult r = path->end_step(0.1, true);
  EXPECT_FALSE(r.finite);
  EXPECT_FALSE(r.stepped);
  EXPECT_FALSE(std::isfinite(r.grad_norm));
  EXPECT_TRUE(torch::equal(params[0].second.detach(), before));
  EXPECT_FALSE(params[0].second.grad().defined());
  EXPECT_EQ(path->optimizer().step_count(), 0);
}

TEST(GradientPath, LossScalingScalesBackwardAndBacksOffOnOverflow) {
  Named params = make_params(torch::kFloat16);
  GradientPathOptions o;
  o.accumulation_steps = 2;
  o.loss_scaling.enabled = true;
  o.loss_scaling.init_scale = 1024;
  auto path = make_gradient_path(params, {false, false}, sgd_factory(), o);
  ASSERT_NE(path->loss_scaler(), nullptr);
  // loss * scale / accumulation_steps, as GradScaler.scale(loss / accum).
  EXPECT_DOUBLE_EQ(path->backward_loss(torch::full({}, 3.0)).item<double>(), 3.0 * 1024 / 2);
  // fp16 gradients of 1e5 * 1024 overflow (fp16 max 65504): skipped, scale halves (GradScaler backoff_factor 0.5).
  path->begin_step(0.1);
  for (int64_t k = 0; k < 2; ++k) {
    path->begin_micro_batch(k);
    path->backward_loss((params[1].second.to(torch::kFloat32) * 1e5f).sum()).backward();
    path->end_micro_batch(k);
  }
  const GradientStepResult r = path->end_step(0.1, true);
  EXPECT_FALSE(r.finite);
  EXPECT_FALSE(r.stepped);
  EXPECT_DOUBLE_EQ(path->loss_scaler()->scale(), 512.0);
  EXPECT_EQ(path->state().loss_scale.value_or(0), 512.0);
}

TEST(GradientPath, MasterWeightsPathStepsFp32MastersAndRoundsBackToBf16) {
  Named params = make_params(torch::kBFloat16);
  GradientPathOptions o;
  o.max_grad_norm = 0;
  const Expected e = sgd_reference(params, 1, 0.1, 0);
  auto path = make_gradient_path(params, {true, false}, sgd_factory(), o);
  ASSERT_EQ(path->name(), "master weights");
  EXPECT_EQ(path->master_count(), 1);
  EXPECT_EQ(path->master_bytes(), 12 * 4);
  run_step(*path, params, 1, 0.1);
  const GradientPathState s = path->state();
  ASSERT_EQ(s.masters.size(), 1u);
  EXPECT_EQ(s.masters[0].second.scalar_type(), torch::kFloat32);
  // The master holds the fp32 update (bf16 gradient: 2^-8 relative), the weight its bf16 rounding.
  EXPECT_TRUE(torch::allclose(s.masters[0].second.to(torch::kFloat64), e.weights[0], 1e-2, 1e-3));
  EXPECT_TRUE(torch::equal(params[0].second.detach(), s.masters[0].second.to(torch::kBFloat16)));
}
