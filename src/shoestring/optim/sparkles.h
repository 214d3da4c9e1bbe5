// SPARKLES ("Stochastic Parameter Adjustment with Randomized Kick for
// Learning Enhancement Strategy"): Compass moments with amplification, plus
// gradient centralization and normalization and a random permutation of the
// update when consecutive amplified gradients barely change. Source: the
// public implementation rakki194/SPARKLES (sparkles.py); its defects are fixed
// here as docs/optimizers/sparkles.md lists (what it does, what we do, why).
// Per parameter, g its gradient, t the 1-based step:
//   g  <- g - c * mean(g over dims >= 1)         (c = centralization; tensors with >= 2 dims only)
//   g  <- lerp(g, g / (std(g) + 1e-8), a)        (a = normalization; std unbiased, over dims >= 1
//                                                  per slice of dim 0 when normalize_channels and each
//                                                  slice has >= 2 elements, else over the whole tensor
//                                                  when it has > 2 elements, else no normalization)
//   g  <- g + wd * p                             (coupled weight decay, the default)
//   m  <- b1 m + (1 - b1) g;  gh = g + amp_fac * m;  v <- b2 v + (1 - b2) gh^2
//   s  =  lr / (1 - b1^t);  denom = sqrt(v) / sqrt(1 - b2^t) + eps
//   p  <- p (1 - s wd)                           (decouple_weight_decay instead of the coupled form)
//   u  =  gh / denom * s
//   t > 1 and ||gh - prev_grad||_2 < stochastic_threshold: u <- u permuted along dim 0 (the rows
//                                                  of a matrix, the elements of a vector)
//   clip_gradients: u <- clamp(u, -t^0.25, t^0.25)
//   p  <- p - u;  prev_grad <- gh
// The permutation is a Fisher-Yates shuffle driven by the counter-based
// random words of core/counter_rng.h (counter_random32), keyed as stochastic
// rounding keys a tensor, by (seed, step, parameter, slot 15): a resumed run
// permutes exactly as the uninterrupted one.
// State ema (m), ema_squared (v), prev_grad: 12 bytes/parameter in fp32, 6 in
// bf16 with stochastic rounding (OptimizerOptions::state_dtype).
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "shoestring/optim/optimizer.h"

namespace shoestring {

/// SPARKLES hyper-parameters (defaults of sparkles.py).
struct SparklesOptions {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;                   ///< added outside the square root
  double weight_decay = 0.0;           ///< callers copy it into OptimParam::weight_decay
  double centralization = 0.5;         ///< gradient centralization strength (0 = off)
  double normalization = 0.5;          ///< interpolation weight towards g / std(g) (0 = off)
  bool normalize_channels = true;      ///< std per slice of dim 0 (else of the whole tensor)
  double amp_fac = 2.0;                ///< amplification factor of the first moment
  bool decouple_weight_decay = false;  ///< p (1 - s wd) instead of g + wd p
  bool clip_gradients = false;         ///< clamp the update to +-t^0.25
  double stochastic_threshold = 1e-6;  ///< permute when ||gh - prev_grad|| is below this (0 = never)
};

class Sparkles : public Optimizer {
 public:
  /// The stochastic-rounding slot whose random words drive the permutation.
  static constexpr int kPermutationSlot = 15;

  /// options.state_dtype: kFloat or kBFloat16 (stochastically rounded);
  /// anything else throws shoestring::Error.
  Sparkles(std::vector<OptimParam> params, SparklesOptions sparkles, OptimizerOptions options);
  /// One SPARKLES step for parameter `index` (grad: any float dtype, the
  /// parameter's numel; it is not modified). Weight decay is
  /// params()[index].weight_decay. Throws shoestring::Error on a gradient of
  /// the wrong size, naming the parameter.
  void update(size_t index, const at::Tensor& grad, double lr, int64_t step) override;
  /// update() on each: CPU tensors that fused_sparkles_supported accepts in
  /// one fused_sparkles_step_many (one parallel region), the rest, and any
  /// whose update is permuted, through the op chain.
  void update_many(const std::vector<size_t>& indices, double lr, int64_t step, double grad_scale) override;

  /// True when the last update of parameter `index` permuted its update
  /// (sparkles.py's state["stochastic_applied"]; not saved in checkpoints).
  bool permuted_last_step(size_t index) const { return permuted_.at(index) != 0; }

  /// State of a parameter of `shape`: ema, ema_squared and prev_grad of the
  /// shape in options.state_dtype (3 x 4 bytes per element in fp32, 3 x 2 in
  /// bf16); scratch: the fp32 update buffer (4 bytes per element).
  static OptimizerStateSize state_size(at::IntArrayRef shape, const OptimizerOptions& options);

  /// The permutation of [0, n) that step `key` applies: a Fisher-Yates
  /// shuffle where swap i (i = n-1 down to 1) takes j = (w_i * (i + 1)) >> 32,
  /// w_i = counter_random32(counter_rng_key(key.seed, key.step,
  /// key.tensor_id), i) (core/counter_rng.h). int64 tensor [n] on the CPU.
  static at::Tensor permutation(int64_t n, RoundingKey key);

 private:
  /// Checks the gradient and creates or checks the state; false when the
  /// parameter is empty (nothing to do).
  bool prepare(size_t index, const at::Tensor& grad);
  /// The fused kernel's task for parameter `index` (its gradient times
  /// grad_scale), or nullopt when the kernel does not take its tensors
  /// (prepare() first).
  std::optional<FusedSparklesTensor> fused_task(size_t index, const at::Tensor& grad, double lr, int64_t step,
                                                double grad_scale);
  /// The ATen op chain (any device and dtype; the permutation).
  void update_op_chain(size_t index, const at::Tensor& grad, double lr, int64_t step);

  SparklesOptions sparkles_;
  std::vector<char> permuted_;
};

/// Parses kohya-style optimizer_args for optimizer_type = "SPARKLES":
/// weight_decay, betas ("b1,b2"), eps, centralization, normalization,
/// normalize_channels, amp_fac, decouple_weight_decay, clip_gradients,
/// stochastic_threshold, permutation_strategy (only "global"). Throws
/// shoestring::Error for an unknown argument (listing the valid ones) or a bad
/// value (naming the argument and what is expected).
SparklesOptions parse_sparkles_args(const std::vector<std::string>& args);

}  // namespace shoestring
