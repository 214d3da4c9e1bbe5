// Compass: an AdamW variant with an amplified first moment, as the public
// Compass optimizer defines it (lodestone-rock/compass_optimizer, compass.py):
//   g  <- g - c * mean(g over dims >= 1)        (gradient centralization, c = centralization;
//                                                 a 0-d/1-d tensor uses its overall mean)
//   m  <- b1 m + (1 - b1) g
//   gh <- g + amp_fac * m
//   v  <- b2 v + (1 - b2) gh^2
//   s  =  lr / (1 - b1^t);  denom = sqrt(v) / sqrt(1 - b2^t) + eps
//   p  <- p (1 - s wd);     p <- p - s * gh / denom
// Note that weight decay is scaled by the bias-corrected step s, not lr.
// State exp_avg (m) and exp_avg_sq (v): 8 bytes/parameter in fp32, 4 in
// bf16 with stochastic rounding (OptimizerOptions::state_dtype).
#pragma once
#include <string>
#include <vector>

#include "shoestring/optim/optimizer.h"

namespace shoestring {

/// Compass hyper-parameters (defaults of compass.py).
struct CompassOptions {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double amp_fac = 2.0;         ///< amplification factor of the first moment
  double eps = 1e-8;            ///< added outside the square root
  double weight_decay = 0.0;    ///< decoupled; callers copy it into OptimParam::weight_decay
  double centralization = 0.0;  ///< gradient centralization strength (0 = off)
};

class Compass : public Optimizer {
 public:
  /// options.state_dtype: kFloat or kBFloat16 (stochastically rounded);
  /// anything else throws shoestring::Error.
  Compass(std::vector<OptimParam> params, CompassOptions compass, OptimizerOptions options);
  /// One Compass step for parameter `index` (grad: any float dtype, the
  /// parameter's shape; it is not modified). Weight decay is
  /// params()[index].weight_decay.
  void update(size_t index, const at::Tensor& grad, double lr, int64_t step) override;

  /// State of a parameter of `shape`: exp_avg and exp_avg_sq of the shape in
  /// options.state_dtype.
  static OptimizerStateSize state_size(at::IntArrayRef shape, const OptimizerOptions& options);

 private:
  CompassOptions compass_;
};

/// Parses kohya-style optimizer_args for optimizer_type = "Compass":
/// weight_decay, betas ("b1,b2"), eps, amp_fac, centralization. Throws
/// shoestring::Error for an unknown argument (listing the valid ones) or a
/// bad value (naming the argument).
CompassOptions parse_compass_args(const std::vector<std::string>& args);

}  // namespace shoestring
