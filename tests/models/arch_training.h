// Shared harness for tests that run the registered architectures at tiny
// width (models::build_architecture(name, {}, /*tiny=*/true)): one handle per
// architecture with a uniform forward over fixed random inputs of the right
// shapes, its block table (precision rules, checkpointing), and a short training
// loop on a fixed batch (the loss must fall when the same batch repeats).
//
// Inputs per family (see each forward's docstring):
//   LDM (sd15, sdxl, ssd1b): x [B, 4, h, w], timesteps [B] on 0..1000,
//     context [B, L, context_dim], y [B, adm_in_channels] (SDXL / SSD-1B only);
//   MMDiT (sd35m): x [B, 16, h, w], t [B] in [0, 1], context [B, L, context_dim], y [B, adm_in_channels];
//   StageC (cascade-c, cascade-c-lite): x [B, 16, h, w], r [B] in [0, 1],
//     clip_text [B, L, 1280], clip_text_pooled [B, 1, 1280], clip_img [B, 1, 768].
// The objective is noise prediction: x_t = x0 + sigma * eps with fixed x0, eps
// and sigma; the model's time input is sigma (MMDiT, StageC) or 1000 * sigma
// (LDM); loss = mean((model(x_t, ...) - eps)^2) in fp32.
#pragma once
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/models/architecture.h"
#include "shoestring/models/cascade.h"
#include "shoestring/models/mmdit.h"
#include "shoestring/models/unet_ldm.h"
#include "shoestring/nn/block_precision.h"
#include "shoestring/optim/factory.h"

namespace shoestring::testing {

/// A tiny-width architecture behind a uniform interface.
struct TinyArch {
  std::string name;
  std::shared_ptr<torch::nn::Module> module;
  nn::BlockTable* table = nullptr;
  /// forward(x_t, sigma [B] in [0, 1], conditioning tensors) -> [B, C, h, w].
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&, const std::vector<torch::Tensor>&)> forward;
  int64_t latent_channels = 4;
  /// Shapes of the conditioning tensors (batch size first).
  std::vector<std::vector<int64_t>> cond_shapes;
};

/// Builds `arch` ("sd15", "sdxl", "ssd1b", "sd35m", "cascade-c", "cascade-c-lite")
/// at tiny width with batch size `batch` and `tokens` text tokens; the
/// initial weights are drawn after torch::manual_seed(seed).
inline TinyArch tiny_arch(const std::string& arch, int64_t batch = 2, int64_t tokens = 6, uint64_t seed = 0) {
  TinyArch a;
  a.name = arch;
  torch::manual_seed(seed);
  a.module = models::build_architecture(arch, {}, /*tiny=*/true);
  if (auto u = std::dynamic_pointer_cast<models::LdmUNetImpl>(a.module)) {
    a.table = u->block_table();
    const auto& o = u->options();
    a.latent_channels = o.in_channels();
    a.cond_shapes = {{batch, tokens, o.context_dim()}};
    if (o.adm_in_channels() > 0) a.cond_shapes.push_back({batch, o.adm_in_channels()});
    a.forward = [u](const torch::Tensor& x, const torch::Tensor& sigma, const std::vector<torch::Tensor>& c) {
      return u->forward(x, sigma * 1000.0, c[0], c.size() > 1 ? c[1] : torch::Tensor());
    };
  } else if (auto m = std::dynamic_pointer_cast<models::MMDiTImpl>(a.module)) {
    a.table = m->block_table();
    const auto& o = m->options();
    a.latent_channels = o.in_channels();
    a.cond_shapes = {{batch, tokens, o.context_dim()}, {batch, o.adm_in_channels()}};
    a.forward = [m](const torch::Tensor& x, const torch::Tensor& sigma, const std::vector<torch::Tensor>& c) {
      return m->forward(x, sigma, c[0], c[1]);
    };
  } else if (auto s = std::dynamic_pointer_cast<models::StageCImpl>(a.module)) {
    a.table = s->block_table();
    const auto& o = s->options();
    a.latent_channels = o.in_channels();
    a.cond_shapes = {
        {batch, tokens, o.clip_text_dim()}, {batch, 1, o.clip_text_pooled_dim()}, {batch, 1, o.clip_image_dim()}};
    a.forward = [s](const torch::Tensor& x, const torch::Tensor& sigma, const std::vector<torch::Tensor>& c) {
      return s->forward(x, sigma, c[0], c[1], c[2]);
    };
  } else {
    fail("tiny_arch: '{}' is not an LDM UNet, MMDiT or StageC", arch);
  }
  return a;
}

/// A fixed batch: clean latents x0, noise eps, noise levels sigma and the conditioning.
struct FixedBatch {
  torch::Tensor x0, eps, sigma;
  std::vector<torch::Tensor> cond;
  /// x0 + sigma * eps, computed in fp32, in x0's dtype.
  torch::Tensor x_t() const {
    return (x0.to(torch::kFloat32) + sigma.view({-1, 1, 1, 1}) * eps.to(torch::kFloat32)).to(x0.scalar_type());
  }
  /// The same batch with every floating tensor in `dtype` (sigma stays fp32).
  FixedBatch to(torch::Dtype dtype) const {
    FixedBatch b = *this;
    b.x0 = x0.to(dtype);
    b.eps = eps.to(dtype);
    for (auto& c : b.cond) c = c.to(dtype);
    return b;
  }
};

/// Random batch of `a`'s shapes from seed `seed`: x0 ~ N(0, 1) [B, C, side, side],
/// eps ~ N(0, 1), sigma evenly spread over [0.2, 0.8], conditioning ~ N(0, 1).
inline FixedBatch fixed_batch(const TinyArch& a, int64_t side = 16, uint64_t seed = 7) {
  torch::manual_seed(seed);
  FixedBatch b;
  const int64_t B = a.cond_shapes[0][0];
  b.x0 = torch::randn({B, a.latent_channels, side, side});
  b.eps = torch::randn({B, a.latent_channels, side, side});
  b.sigma = torch::linspace(0.2, 0.8, B);
  for (const auto& shape : a.cond_shapes) b.cond.push_back(torch::randn(shape));
  return b;
}

/// Noise-prediction loss of `a` on `b`, in fp32 (the model runs in the batch's dtype).
inline torch::Tensor eps_loss(const TinyArch& a, const FixedBatch& b) {
  torch::Tensor pred = a.forward(b.x_t(), b.sigma, b.cond);
  return (pred.to(torch::kFloat32) - b.eps.to(torch::kFloat32)).pow(2).mean();
}

/// Named trainable parameters of `m` (requires_grad only).
inline std::vector<std::pair<std::string, at::Tensor>> trainable(const torch::nn::Module& m) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& p : m.named_parameters()) {
    if (p.value().requires_grad()) out.emplace_back(p.key(), p.value());
  }
  return out;
}

/// Trains `params` for `steps` AdamW steps (optim/factory.h, weight decay
/// 0.01, stochastic rounding into bf16 / fp16 parameters) at learning rate
/// `lr` on the fixed batch; returns the loss of every step (before its update).
/// Fails the test if a loss is not finite.
inline std::vector<double> train_steps(const TinyArch& a, const FixedBatch& b,
                                       const std::vector<std::pair<std::string, at::Tensor>>& params, double lr,
                                       int steps) {
  OptimizerOptions oo;
  oo.stochastic_rounding = true;
  oo.seed = 3;
  auto opt = make_optimizer("AdamW", {"weight_decay=0.01"}, params, oo);
  a.module->train();
  std::vector<double> losses;
  for (int s = 0; s < steps; ++s) {
    for (const auto& p : params) p.second.mutable_grad() = torch::Tensor();
    torch::Tensor loss = eps_loss(a, b);
    const double v = loss.item<double>();
    EXPECT_TRUE(std::isfinite(v)) << a.name << " step " << s << " loss " << v;
    losses.push_back(v);
    loss.backward();
    opt->step(lr);
  }
  return losses;
}

/// Mean of the last `n` values.
inline double tail_mean(const std::vector<double>& v, size_t n = 3) {
  double s = 0;
  for (size_t i = v.size() - n; i < v.size(); ++i) s += v[i];
  return s / static_cast<double>(n);
}

/// Adds N(0, std^2) noise to every parameter (no grad), e.g. so that the
/// zero-initialised output layers and adaLN gates pass gradients to
/// adapters; rounded to `dtype` values when given (bit-identical in fp32 and
/// after a cast to that dtype).
inline void perturb(torch::nn::Module& m, double std, uint64_t seed,
                    std::optional<torch::Dtype> representable_in = std::nullopt) {
  torch::manual_seed(seed);
  torch::NoGradGuard ng;
  for (auto& p : m.parameters()) {
    torch::Tensor v = p + torch::randn_like(p) * std;
    if (representable_in) v = v.to(*representable_in).to(p.scalar_type());
    p.copy_(v);
  }
}

/// Copies of every parameter (for bit-unchanged checks).
inline std::map<std::string, torch::Tensor> snapshot(const torch::nn::Module& m) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

}  // namespace shoestring::testing
