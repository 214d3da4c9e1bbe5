// Lion (EvoLved Sign Momentum; Chen et al. 2023, "Symbolic Discovery of
// Optimization Algorithms", arXiv 2302.06675), with decoupled weight decay:
//   p <- p (1 - lr wd)
//   p <- p - lr * sign(b1 m + (1 - b1) g)
//   m <- b2 m + (1 - b2) g
// (sign(0) = 0). One state tensor, exp_avg: 4 bytes/parameter in fp32, 2 in
// bf16 with stochastic rounding (OptimizerOptions::state_dtype). Since every
// update has magnitude lr, the paper recommends an lr 3-10x smaller than
// AdamW's and a weight decay 3-10x larger.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "shoestring/optim/optimizer.h"

namespace shoestring {

/// Lion hyper-parameters (defaults of the paper and of lion-pytorch).
struct LionOptions {
  double beta1 = 0.9;         ///< interpolation for the update direction
  double beta2 = 0.99;        ///< momentum decay
  double weight_decay = 0.0;  ///< decoupled; callers copy it into OptimParam::weight_decay
};

class Lion : public Optimizer {
 public:
  /// options.state_dtype: kFloat or kBFloat16 (stochastically rounded);
  /// anything else throws shoestring::Error.
  Lion(std::vector<OptimParam> params, LionOptions lion, OptimizerOptions options);
  /// One Lion step for parameter `index` (grad: any float dtype, the
  /// parameter's shape). Weight decay is params()[index].weight_decay.
  void update(size_t index, const at::Tensor& grad, double lr, int64_t step) override;
  /// Every parameter the fused kernel takes (fast_cpu_path, fused_lion_supported)
  /// in one fused_lion_step_many; the others through update().
  void update_many(const std::vector<size_t>& indices, double lr, int64_t step, double grad_scale) override;

  /// State of a parameter of `shape`: exp_avg of the shape in options.state_dtype.
  static OptimizerStateSize state_size(at::IntArrayRef shape, const OptimizerOptions& options);

 private:
  /// Checks the gradient and creates the state of parameter `index`; returns
  /// its fused kernel call with `grad` (times grad_scale), or nothing when the
  /// op chain must run.
  std::optional<FusedLionTensor> fused_task(size_t index, const at::Tensor& grad, double lr, int64_t step,
                                            double grad_scale);
  LionOptions lion_;
};

/// Parses kohya-style optimizer_args for optimizer_type = "Lion":
/// weight_decay, betas ("b1,b2"). Throws shoestring::Error for an unknown
/// argument (listing the valid ones) or a bad value (naming the argument).
LionOptions parse_lion_args(const std::vector<std::string>& args);

}  // namespace shoestring
