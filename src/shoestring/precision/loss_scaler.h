// Dynamic loss scaling for fp16 training, with the semantics and defaults of
// PyTorch's torch.cuda.amp.GradScaler (torch/cuda/amp/grad_scaler.py and the
// `_amp_update_scale_` kernel, aten/src/ATen/native/cuda/AmpKernels.cu):
//
//   the loss is multiplied by `scale` before backward;
//   gradients are unscaled (multiplied by 1/scale, in fp32) before the step;
//   if any gradient holds inf or NaN the optimizer step is skipped and
//     scale <- scale * backoff_factor (0.5), growth tracker <- 0;
//   otherwise tracker <- tracker + 1, and when it reaches growth_interval (2000)
//     scale <- scale * growth_factor (2.0) if that product is finite in fp32,
//     tracker <- 0.
//   init_scale 65536 (2^16). The scale is an fp32 value, as in PyTorch.
//
// Unscaling writes fp32 gradients, so fp16 parameters are never asked to hold
// an unscaled fp16 gradient (PyTorch's "Attempting to unscale FP16 gradients"
// error cannot occur: see precision/master_weights.h).
#pragma once
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace shoestring::precision {

struct LossScalerOptions {
  bool enabled = true;
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

class LossScaler {
 public:
  /// Throws shoestring::Error unless init_scale > 0, growth_factor > 1,
  /// 0 < backoff_factor < 1 and growth_interval >= 1.
  explicit LossScaler(LossScalerOptions options = {});

  bool enabled() const { return options_.enabled; }
  /// Current scale (1 when disabled).
  double scale() const { return options_.enabled ? static_cast<double>(scale_) : 1.0; }
  /// 1 / scale computed as PyTorch does (double reciprocal, rounded to fp32).
  double inv_scale() const;
  /// Consecutive finite steps since the last growth or backoff.
  int64_t growth_tracker() const { return growth_tracker_; }

  /// `loss * scale()` (the loss itself when disabled).
  at::Tensor scale_loss(const at::Tensor& loss) const;

  /// Unscales in place: each defined gradient becomes `grad.to(fp32) * inv_scale()`
  /// (a new fp32 tensor assigned into the vector). Returns true when any
  /// element is inf or NaN (found_inf).
  bool unscale(std::vector<at::Tensor>& grads) const;

  /// Updates the scale after a step (see the file comment). No-op when disabled.
  void update(bool found_inf);

  /// Restores state saved from scale() and growth_tracker().
  void load_state(double scale, int64_t growth_tracker);

  const LossScalerOptions& options() const { return options_; }

 private:
  LossScalerOptions options_;
  float scale_;
  int64_t growth_tracker_ = 0;
};

}  // namespace shoestring::precision
