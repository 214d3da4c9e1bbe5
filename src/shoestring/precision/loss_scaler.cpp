#include "shoestring/precision/loss_scaler.h"

#include <cmath>

#include <torch/torch.h>

#include "shoestring/core/error.h"

namespace shoestring::precision {

LossScaler::LossScaler(LossScalerOptions options) : options_(options), scale_(static_cast<float>(options.init_scale)) {
  if (!(options_.init_scale > 0) || !std::isfinite(scale_))
    fail("loss scaler: init_scale must be a positive fp32 value, got {}", options_.init_scale);
  if (!(options_.growth_factor > 1)) fail("loss scaler: growth_factor must be > 1, got {}", options_.growth_factor);
  if (!(options_.backoff_factor > 0 && options_.backoff_factor < 1)) {
    fail("loss scaler: backoff_factor must lie in (0, 1), got {}", options_.backoff_factor);
  }
  if (options_.growth_interval < 1) fail("loss scaler: growth_interval must be >= 1, got {}", options_.growth_interval);
}

double LossScaler::inv_scale() const {
  if (!options_.enabled) return 1.0;
  return static_cast<double>(static_cast<float>(1.0 / static_cast<double>(scale_)));
}

at::Tensor LossScaler::scale_loss(const at::Tensor& loss) const {
  if (!options_.enabled) return loss;
  return loss * static_cast<double>(scale_);
}

bool LossScaler::unscale(std::vector<at::Tensor>& grads) const {
  torch::NoGradGuard no_grad;
  const double inv = inv_scale();
  bool found_inf = false;
  for (auto& g : grads) {
    if (!g.defined()) continue;
    at::Tensor f = g.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    if (inv != 1.0) f.mul_(inv);
    if (!found_inf && !f.isfinite().all().item<bool>()) found_inf = true;
    g = f;
  }
  return found_inf;
}

void LossScaler::update(bool found_inf) {
  if (!options_.enabled) return;
  if (found_inf) {
    scale_ = static_cast<float>(scale_ * options_.backoff_factor);
    growth_tracker_ = 0;
    return;
  }
  const int64_t successful = growth_tracker_ + 1;
  if (successful == options_.growth_interval) {
    const float grown = static_cast<float>(scale_ * options_.growth_factor);
    if (std::isfinite(grown)) scale_ = grown;
    growth_tracker_ = 0;
  } else {
    growth_tracker_ = successful;
  }
}

void LossScaler::load_state(double scale, int64_t growth_tracker) {
  if (!(scale > 0) || !std::isfinite(static_cast<float>(scale)))
    fail("loss scaler state: scale {} is not a positive fp32 value", scale);
  if (growth_tracker < 0) fail("loss scaler state: growth tracker {} is negative", growth_tracker);
  scale_ = static_cast<float>(scale);
  growth_tracker_ = growth_tracker;
}

}  // namespace shoestring::precision
