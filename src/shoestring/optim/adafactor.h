// Adafactor (Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates with
// Sublinear Memory Cost", arXiv 1804.04235), with the semantics of the widely
// used Hugging Face transformers implementation (transformers.optimization.
// Adafactor, the one kohya-ss sd-scripts instantiates), plus one deliberate
// deviation in how tensors of rank > 2 are factored (see below).
//
// Per parameter X with gradient G at step t (1-based):
//   beta2t = 1 - t^decay_rate                          (decay_rate -0.8)
//   rho_t  = relative_step ? min(warmup_init ? 1e-6 t : 1e-2, 1/sqrt(t)) : lr
//   a_t    = rho_t * (scale_parameter ? max(eps2, RMS(X)) : 1)
//   factored (X has >= 2 dims, viewed as an n x m matrix):
//     R <- beta2t R + (1-beta2t) rowmean(G^2 + eps1)       [n]
//     C <- beta2t C + (1-beta2t) colmean(G^2 + eps1)       [m]
//     U  = G / sqrt(R C^T / mean(R))
//   unfactored (vectors, scalars):
//     V <- beta2t V + (1-beta2t) (G^2 + eps1);  U = G / sqrt(V)
//   U <- U / max(1, RMS(U) / clip_threshold)
//   U <- a_t U
//   with beta1: M <- beta1 M + (1-beta1) U;  U = M
//   X <- X - wd a_t X - U     (decoupled weight decay, in fp32, rounded once)
//
// Deviation (documented in docs/optimizers/adafactor.md): transformers factors
// over the LAST TWO dims, so a conv kernel [out, in, kh, kw] gets statistics
// of shape [out, in, kh] and [out, in, kw]: for a 3x3 kernel that is 6 numbers
// per 9 weights, almost no saving. Here every tensor with >= 2 dims is viewed
// as the matrix [shape[0], numel / shape[0]] (out x in*kh*kw for a conv
// kernel, the usual "fan-out x fan-in" view), so its second moment costs
// out + in*kh*kw numbers. For 2-D tensors both are identical.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include "shoestring/optim/optimizer.h"

namespace shoestring {

/// Adafactor hyper-parameters. Defaults are transformers' (and the paper's):
/// eps (1e-30, 1e-3), clip_threshold 1, decay_rate -0.8, no beta1, no weight
/// decay, scale_parameter, relative_step, no warmup_init.
struct AdafactorOptions {
  double eps1 = 1e-30;          ///< added to G^2 before averaging (regularizes 1/sqrt(V))
  double eps2 = 1e-3;           ///< lower bound of RMS(X) in the parameter scale
  double clip_threshold = 1.0;  ///< update clipping threshold d (on RMS(U))
  double decay_rate = -0.8;     ///< beta2t = 1 - t^decay_rate; must be <= 0
  std::optional<double> beta1;  ///< first-moment decay; nullopt = no first moment (kohya default)
  double weight_decay = 0.0;    ///< decoupled weight decay (the trainer copies it into OptimParam)
  /// Multiply the step size by max(eps2, RMS(X)) (relative update size).
  bool scale_parameter = true;
  /// Use rho_t = min(1e-2, 1/sqrt(t)) as step size and IGNORE the lr passed to
  /// update()/step() (kohya: use lr_scheduler "adafactor" / constant).
  bool relative_step = true;
  /// With relative_step: rho_t = min(1e-6 t, 1/sqrt(t)) (linear warm-up).
  bool warmup_init = false;
};

/// Adafactor optimizer (see the file comment for the formulas and source).
///
/// State per parameter (names as in transformers): "exp_avg_sq_row" [n] and
/// "exp_avg_sq_col" [m] for factored tensors (always fp32: n + m numbers, 4
/// bytes each), "exp_avg_sq" (unfactored, same shape as the parameter) and
/// "exp_avg" (only with beta1, same shape as the parameter); the full-size
/// ones use OptimizerOptions::state_dtype (fp32, or bf16 with stochastic
/// rounding). The step counter t is the optimizer's step (not per-parameter).
/// Parameters with zero elements are skipped.
class Adafactor : public Optimizer {
 public:
  /// Throws shoestring::Error when `adafactor` is invalid (see
  /// validate_adafactor_options).
  Adafactor(std::vector<OptimParam> params, AdafactorOptions adafactor, OptimizerOptions options);

  /// One Adafactor update of parameter `index` from `grad` (same shape, any
  /// float dtype) at step `step` (>= 1). `lr` is rho_t when relative_step is
  /// false, and ignored when it is true. Throws shoestring::Error naming the
  /// parameter when the gradient's shape or a restored state tensor's shape
  /// does not match.
  void update(size_t index, const at::Tensor& grad, double lr, int64_t step) override;

  /// The matrix shape {n, m} the second moment of a tensor of shape `shape` is
  /// factored over: {shape[0], numel / shape[0]} for >= 2 dims with numel > 0;
  /// empty (unfactored) otherwise.
  static std::vector<int64_t> factored_shape(at::IntArrayRef shape);

  /// State and update scratch of a parameter of `shape` stored in
  /// `param_dtype`: factored (>= 2 dims): fp32 row and column vectors (n + m
  /// numbers), plus exp_avg of the shape in options.state_dtype with beta1;
  /// unfactored: exp_avg_sq (and with beta1 exp_avg) of the shape in
  /// options.state_dtype; nothing for zero elements. Scratch: the op chain's
  /// four fp32 copies (gradient, weights, update, moment) where the fused
  /// factored path does not apply (beta1, or unfactored); on the fused path an
  /// fp32 copy of 2-byte weights (RMS of the weights).
  static OptimizerStateSize state_size(at::IntArrayRef shape, const AdafactorOptions& adafactor,
                                       const OptimizerOptions& options, at::ScalarType param_dtype);

  /// The step size a_t (before weight decay) used at step `step` for a
  /// parameter whose RMS is `param_rms`, given the scheduler's `lr`.
  double step_size(int64_t step, double lr, double param_rms) const;

  const AdafactorOptions& adafactor_options() const { return adafactor_; }

 private:
  AdafactorOptions adafactor_;
};

/// Throws shoestring::Error unless: eps1 >= 0, eps2 >= 0, clip_threshold > 0,
/// decay_rate <= 0, beta1 (if set) in [0, 1), weight_decay >= 0, and
/// warmup_init only together with relative_step (as transformers requires).
void validate_adafactor_options(const AdafactorOptions& options);

/// Parses kohya-style optimizer_args, e.g. {"scale_parameter=False",
/// "relative_step=False", "warmup_init=False"}. Keys: scale_parameter,
/// relative_step, warmup_init (True/False/true/false/1/0), clip_threshold,
/// decay_rate, weight_decay (numbers), beta1 (number or None), eps (two
/// numbers "1e-30,1e-3", optionally in () or []). Throws shoestring::Error for
/// a malformed string, an unknown key (listing the valid ones) or an invalid
/// value (see validate_adafactor_options).
AdafactorOptions parse_adafactor_args(const std::vector<std::string>& args);

}  // namespace shoestring
