// Fused backward versus the plain path (backward(), then Optimizer::step)
// with torch's autograd accumulation and the trainer's clipping formula.
#include <gtest/gtest.h>

#include <cmath>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/optim/adafactor.h"
#include "shoestring/optim/fused_backward.h"
#include "shoestring/optim/grad_hooks.h"
#include "shoestring/optim/sparkles.h"

using namespace shoestring;

namespace {

// A small MLP made of raw parameters: tanh layers, then a linear head.
struct Mlp {
  std::vector<at::Tensor> params;  // W0, b0, W1, b1, ...
  explicit Mlp(std::vector<int64_t> widths, uint64_t seed = 11, at::ScalarType dtype = torch::kFloat32) {
    torch::manual_seed(seed);
    for (size_t l = 0; l + 1 < widths.size(); ++l) {
      params.push_back(
          (torch::randn({widths[l + 1], widths[l]}) / std::sqrt(double(widths[l]))).to(dtype).requires_grad_(true));
      params.push_back((torch::randn({widths[l + 1]}) * 0.1).to(dtype).requires_grad_(true));
    }
  }
  at::Tensor forward(at::Tensor x) const {
    for (size_t l = 0; l < params.size(); l += 2) {
      x = torch::addmm(params[l + 1], x, params[l].t());
      if (l + 2 < params.size()) x = torch::tanh(x);
    }
    return x;
  }
  std::vector<OptimParam> optim_params() const {
    std::vector<OptimParam> out;
    for (size_t i = 0; i < params.size(); ++i) out.push_back({"p" + std::to_string(i), params[i], i % 2 ? 0.0 : 0.1});
    return out;
  }
};

struct Batch {
  at::Tensor x, y;
};

std::vector<Batch> make_batches(int64_t count, int64_t in, int64_t out, uint64_t seed) {
  torch::manual_seed(seed);
  std::vector<Batch> b;
  for (int64_t i = 0; i < count; ++i) b.push_back({torch::randn({4, in}), torch::randn({4, out})});
  return b;
}

at::Tensor loss_of(const Mlp& m, const Batch& b) {
  return torch::mse_loss(m.forward(b.x).to(torch::kFloat32), b.y.to(torch::kFloat32));
}

double global_norm(const std::vector<at::Tensor>& params) {
  double sq = 0;
  for (const auto& p : params) {
    if (p.grad().defined()) sq += p.grad().to(torch::kFloat32).pow(2).sum().item<double>();
  }
  return std::sqrt(sq);
}

double max_abs_diff(const Mlp& a, const Mlp& b) {
  double d = 0;
  for (size_t i = 0; i < a.params.size(); ++i) {
    d = std::max(d, (a.params[i] - b.params[i]).abs().max().item<double>());
  }
  return d;
}

enum class Clip { none, previous, exact };

// Reference: backward per micro-batch (autograd accumulates .grad), then the
// trainer's clipping and Optimizer::step.
void reference_train(Mlp& m, Optimizer& opt, const std::vector<Batch>& data, int64_t accum, int64_t steps, double lr,
                     Clip clip, double max_norm, std::vector<double>* norms = nullptr) {
  double prev = std::nan("");
  for (int64_t s = 0; s < steps; ++s) {
    for (int64_t k = 0; k < accum; ++k) (loss_of(m, data[s * accum + k]) / double(accum)).backward();
    const double norm = global_norm(m.params);
    if (norms) norms->push_back(norm);
    double basis = clip == Clip::exact ? norm : clip == Clip::previous ? prev : std::nan("");
    double scale = 1.0;
    if (std::isfinite(basis) && basis > max_norm) scale = max_norm / (basis + 1e-6);
    opt.step(lr, scale);
    prev = norm;
    for (auto& p : m.params) p.mutable_grad().reset();
  }
}

std::vector<FusedStepResult> fused_train(Mlp& m, FusedBackward& fb, const std::vector<Batch>& data, int64_t accum,
                                         int64_t steps, double lr) {
  std::vector<FusedStepResult> out;
  for (int64_t s = 0; s < steps; ++s) {
    fb.begin_step(lr);
    for (int64_t k = 0; k < accum; ++k) {
      fb.begin_micro_batch(k);
      const Batch& b = data[s * accum + k];
      (loss_of(m, b) / double(accum)).backward();
      for (const auto& p : m.params) EXPECT_FALSE(p.grad().defined()) << "gradient not freed";
      if (fb.needs_second_pass() && fb.begin_second_pass()) (loss_of(m, b) / double(accum)).backward();
    }
    out.push_back(fb.end_step());
  }
  return out;
}

}  // namespace

TEST(FusedBackward, MatchesBackwardThenStepWithoutAccumulation) {
  auto data = make_batches(4, 6, 3, 1);
  Mlp ref({6, 8, 8, 3}), fused({6, 8, 8, 3});
  AdamW ref_opt(ref.optim_params(), AdamWOptions{}, {});
  AdamW fused_opt(fused.optim_params(), AdamWOptions{}, {});
  reference_train(ref, ref_opt, data, 1, 4, 1e-2, Clip::none, 0);
  FusedBackward fb(fused_opt, {});
  auto results = fused_train(fused, fb, data, 1, 4, 1e-2);
  EXPECT_EQ(max_abs_diff(ref, fused), 0.0);
  EXPECT_EQ(fused_opt.step_count(), 4);
  EXPECT_EQ(results.back().params_stepped, 6);
  EXPECT_TRUE(results.back().finite);
}

TEST(FusedBackward, SparklesMatchesBackwardThenStep) {
  // SPARKLES needs only its own parameter's gradient (its centralization,
  // normalization and permutation are per tensor), so it runs inside backward.
  auto data = make_batches(8, 6, 3, 2);
  Mlp ref({6, 8, 8, 3}), fused({6, 8, 8, 3});
  SparklesOptions so;
  so.stochastic_threshold = 1e9;  // permute on every step after the first
  Sparkles ref_opt(ref.optim_params(), so, {});
  Sparkles fused_opt(fused.optim_params(), so, {});
  reference_train(ref, ref_opt, data, 2, 4, 1e-2, Clip::none, 0);
  FusedBackwardOptions o;
  o.accumulation_steps = 2;
  FusedBackward fb(fused_opt, o);
  auto results = fused_train(fused, fb, data, 2, 4, 1e-2);
  EXPECT_LT(max_abs_diff(ref, fused), 1e-6);
  EXPECT_EQ(fused_opt.step_count(), 4);
  EXPECT_EQ(results.back().params_stepped, 6);
  EXPECT_TRUE(fused_opt.permuted_last_step(0));
}

TEST(FusedBackward, AccumulationOverThreeMicroBatchesMatchesAutogradAccumulation) {
  auto data = make_batches(9, 6, 3, 2);
  Mlp ref({6, 8, 8, 3}), fused({6, 8, 8, 3});
  AdamW ref_opt(ref.optim_params(), AdamWOptions{}, {});
  AdamW fused_opt(fused.optim_params(), AdamWOptions{}, {});
  std::vector<double> norms;
  reference_train(ref, ref_opt, data, 3, 3, 1e-2, Clip::none, 0, &norms);
  FusedBackwardOptions o;
  o.accumulation_steps = 3;
  FusedBackward fb(fused_opt, o);
  auto results = fused_train(fused, fb, data, 3, 3, 1e-2);
  EXPECT_LT(max_abs_diff(ref, fused), 1e-7);
  EXPECT_EQ(fused_opt.step_count(), 3);
  for (size_t s = 0; s < norms.size(); ++s) EXPECT_NEAR(results[s].grad_norm, norms[s], 1e-6 * norms[s]);
  EXPECT_EQ(fb.buffer_bytes(), 0);
}

TEST(FusedBackward, PreviousStepNormClippingIsOneStepLate) {
  auto data = make_batches(8, 6, 3, 3);
  Mlp ref({6, 8, 3}), fused({6, 8, 3});
  AdamW ref_opt(ref.optim_params(), AdamWOptions{}, {});
  AdamW fused_opt(fused.optim_params(), AdamWOptions{}, {});
  std::vector<double> norms;
  const double max_norm = 0.05;  // below every gradient norm here: clipping active from step 2
  reference_train(ref, ref_opt, data, 2, 4, 1e-2, Clip::previous, max_norm, &norms);
  FusedBackwardOptions o;
  o.accumulation_steps = 2;
  o.max_grad_norm = max_norm;
  FusedBackward fb(fused_opt, o);
  auto results = fused_train(fused, fb, data, 2, 4, 1e-2);
  EXPECT_LT(max_abs_diff(ref, fused), 1e-6);
  EXPECT_EQ(results[0].clip_scale, 1.0);  // no previous norm yet
  for (size_t s = 1; s < results.size(); ++s) {
    ASSERT_GT(norms[s - 1], max_norm);
    EXPECT_NEAR(results[s].clip_scale, max_norm / (norms[s - 1] + 1e-6), 1e-9);
  }
  EXPECT_NEAR(fb.previous_grad_norm(), norms.back(), 1e-6 * norms.back());
}

TEST(FusedBackward, TwoPassClippingMatchesExactGlobalNormClipping) {
  auto data = make_batches(6, 6, 3, 4);
  Mlp ref({6, 8, 3}), fused({6, 8, 3});
  Adafactor ref_opt(ref.optim_params(), AdafactorOptions{}, {});
  Adafactor fused_opt(fused.optim_params(), AdafactorOptions{}, {});
  std::vector<double> norms;
  reference_train(ref, ref_opt, data, 2, 3, 0, Clip::exact, 0.05, &norms);
  FusedBackwardOptions o;
  o.accumulation_steps = 2;
  o.max_grad_norm = 0.05;
  o.clip_method = FusedClipMethod::two_pass;
  FusedBackward fb(fused_opt, o);
  auto results = fused_train(fused, fb, data, 2, 3, 0);
  EXPECT_LT(max_abs_diff(ref, fused), 1e-6);
  for (size_t s = 0; s < results.size(); ++s) {
    EXPECT_NEAR(results[s].grad_norm, norms[s], 1e-6 * norms[s]);
    EXPECT_LT(results[s].clip_scale, 1.0);
  }
}

TEST(FusedBackward, NonFiniteGradientLeavesThatParameterUnchangedAndIsReported) {
  auto a = torch::ones({3}).requires_grad_(true);
  auto b = torch::ones({3}).requires_grad_(true);
  AdamW opt({{"a", a, 0.0}, {"b", b, 0.0}}, AdamWOptions{}, {});
  FusedBackward fb(opt, {});
  fb.begin_step(0.1);
  fb.begin_micro_batch(0);
  const float inf = std::numeric_limits<float>::infinity();
  ((a * torch::tensor({1.0f, 2.0f, 3.0f})).sum() + (b * torch::tensor({1.0f, inf, 1.0f})).sum()).backward();
  FusedStepResult r = fb.end_step();
  EXPECT_FALSE(r.finite);
  EXPECT_EQ(r.params_stepped, 1);
  EXPECT_EQ(r.params_skipped_nonfinite, 1);
  EXPECT_TRUE(torch::equal(b, torch::ones({3})));
  EXPECT_LT(a.max().item<double>(), 1.0);  // stepped
  EXPECT_EQ(opt.step_count(), 1);
  EXPECT_TRUE(std::isnan(fb.previous_grad_norm()));  // a non-finite norm is never used for clipping
}

TEST(FusedBackward, TwoPassSkipsANonFiniteStepBeforeAnythingMoves) {
  auto a = torch::ones({3}).requires_grad_(true);
  auto b = torch::ones({3}).requires_grad_(true);
  AdamW opt({{"a", a, 0.0}, {"b", b, 0.0}}, AdamWOptions{}, {});
  FusedBackwardOptions o;
  o.clip_method = FusedClipMethod::two_pass;
  o.max_grad_norm = 1.0;
  FusedBackward fb(opt, o);
  fb.begin_step(0.1);
  fb.begin_micro_batch(0);
  ((a * 2.0).sum() + (b * std::nan("")).sum()).backward();
  ASSERT_TRUE(fb.needs_second_pass());
  EXPECT_FALSE(fb.begin_second_pass());
  FusedStepResult r = fb.end_step();
  EXPECT_FALSE(r.finite);
  EXPECT_EQ(r.params_stepped, 0);
  EXPECT_TRUE(torch::equal(a, torch::ones({3})));
  EXPECT_TRUE(torch::equal(b, torch::ones({3})));
  EXPECT_EQ(opt.step_count(), 0);
}

TEST(FusedBackward, Bf16WeightsAccumulateInABf16Buffer) {
  Mlp m({6, 16, 3}, 11, torch::kBFloat16);
  AdamW opt(m.optim_params(), AdamWOptions{}, {});
  FusedBackwardOptions o;
  o.accumulation_steps = 2;
  FusedBackward fb(opt, o);
  auto data = make_batches(2, 6, 3, 5);
  fb.begin_step(1e-3);
  fb.begin_micro_batch(0);
  (loss_of(m, {data[0].x.to(torch::kBFloat16), data[0].y.to(torch::kBFloat16)}) / 2.0).backward();
  int64_t n = 0;
  for (const auto& p : m.params) n += p.numel();
  EXPECT_EQ(fb.buffer_bytes(), n * 2);  // bf16 buffers: 2 bytes per parameter
  fb.begin_micro_batch(1);
  (loss_of(m, {data[1].x.to(torch::kBFloat16), data[1].y.to(torch::kBFloat16)}) / 2.0).backward();
  FusedStepResult r = fb.end_step();
  EXPECT_TRUE(r.finite);
  EXPECT_EQ(r.params_stepped, 4);
  EXPECT_EQ(fb.buffer_bytes(), 0);
}

TEST(FusedBackward, NoFullGradientSetIsAliveAtOnce) {
  MemoryLedger& ledger = MemoryLedger::global();
  ledger.install();
  const std::vector<int64_t> widths = {192, 192, 192, 192, 192};
  Mlp ref(widths), fused(widths);  // 4 x (192x192 + 192) parameters, ~580 KiB of fp32 gradients
  int64_t grad_bytes = 0, largest = 0;
  for (const auto& p : ref.params) {
    grad_bytes += p.numel() * 4;
    largest = std::max<int64_t>(largest, p.numel() * 4);
  }
  auto data = make_batches(2, 192, 192, 6);
  AdamW ref_opt(ref.optim_params(), AdamWOptions{}, {});
  AdamW fused_opt(fused.optim_params(), AdamWOptions{}, {});
  // Reference: .grad charged to "gradients" as soon as it exists (as the trainer does).
  PostAccumulateGradHooks charge;
  charge.install(ref.params, [&](size_t, at::Tensor& p) {
    if (p.grad().defined()) ledger.recharge(p.grad(), MemoryCategory::gradients);
  });
  reference_train(ref, ref_opt, data, 1, 1, 1e-3, Clip::none, 0);  // state allocated
  ledger.reset_peaks();
  const int64_t ref_base = ledger.current_total();
  {
    ScopedMemoryCategory cat(MemoryCategory::temporaries);
    reference_train(ref, ref_opt, {data[1]}, 1, 1, 1e-3, Clip::none, 0);
  }
  const int64_t ref_peak_grads = ledger.peak_bytes(MemoryCategory::gradients);
  const int64_t ref_peak_rise = ledger.peak_total() - ref_base;

  FusedBackward fb(fused_opt, {});
  fused_train(fused, fb, data, 1, 1, 1e-3);
  ledger.reset_peaks();
  const int64_t fused_base = ledger.current_total();
  {
    ScopedMemoryCategory cat(MemoryCategory::temporaries);
    fused_train(fused, fb, {data[1]}, 1, 1, 1e-3);
  }
  const int64_t fused_peak_grads = ledger.peak_bytes(MemoryCategory::gradients);
  const int64_t fused_peak_rise = ledger.peak_total() - fused_base;

  EXPECT_GE(ref_peak_grads, grad_bytes);
  EXPECT_LE(fused_peak_grads, largest);
  EXPECT_LT(fused_peak_grads, grad_bytes);
  EXPECT_LT(fused_peak_rise + grad_bytes / 2, ref_peak_rise)
      << "fused peak rise " << fused_peak_rise << " reference " << ref_peak_rise;
  EXPECT_LT(max_abs_diff(ref, fused), 1e-7);  // same two steps on both
}

TEST(FusedBackward, RejectsMisuse) {
  auto a = torch::ones({3}).requires_grad_(true);
  AdamW opt({{"a", a, 0.0}}, AdamWOptions{}, {});
  FusedBackwardOptions bad;
  bad.accumulation_steps = 0;
  EXPECT_THROW(FusedBackward(opt, bad), Error);
  FusedBackwardOptions o;
  o.accumulation_steps = 2;
  FusedBackward fb(opt, o);
  EXPECT_THROW(fb.begin_micro_batch(0), Error);  // no step open
  fb.begin_step(0.1);
  EXPECT_THROW(fb.begin_micro_batch(1), Error);  // out of order
  fb.begin_micro_batch(0);
  EXPECT_THROW(fb.end_step(), Error);  // micro-batch 1 missing
  EXPECT_THROW(fb.begin_step(0.1), Error);
  EXPECT_THROW(parse_fused_clip_method("global"), Error);
}

TEST(FusedBackward, BackwardOutsideAStepLeavesGradAlone) {
  auto a = torch::ones({3}).requires_grad_(true);
  AdamW opt({{"a", a, 0.0}}, AdamWOptions{}, {});
  FusedBackward idle(opt, {});
  (a * 3.0).sum().backward();
  ASSERT_TRUE(a.grad().defined());
  EXPECT_TRUE(torch::equal(a.grad(), torch::full({3}, 3.0)));
  EXPECT_TRUE(torch::equal(a, torch::ones({3})));
}
