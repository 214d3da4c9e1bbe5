// Exponential moving average of model weights (Polyak averaging), as
// diffusers' EMAModel does by default (training_utils.py, get_decay without
// use_ema_warmup): at the k-th optimizer step (k = 1, 2, ...)
//   d_k = 0 for k = 1, else min(ema_decay, (1 + (k - 1)) / (10 + (k - 1)))
//   shadow <- d_k * shadow + (1 - d_k) * param,
// kept in fp32 whatever the weights' storage dtype. The ramp matters for
// short runs: with a constant 0.99 a 135-step run's average still holds
// 0.99^135 = 26% of the random initial weights, and samples from it are noise.
#pragma once
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace shoestring {

/// fp32 shadow copies of a set of named parameters (4 bytes/parameter, charged
/// to the memory ledger's optimizer_state category).
class EMA {
 public:
  /// params: (name, tensor) pairs; decay in [0, 1).
  EMA(const std::vector<std::pair<std::string, at::Tensor>>& params, double decay);
  /// The decay of optimizer step `step` (1-based): d_k above.
  double decay_at(int64_t step) const;
  /// shadow <- d * shadow + (1 - d) * param for every parameter, with
  /// d = decay_at(step); `step` is the optimizer step just applied (1-based,
  /// counted across resumes). Throws shoestring::Error for step < 1.
  void update(int64_t step);
  /// Copies the shadow weights into the live parameters (rounded to their dtype)
  /// and returns the previous live values so restore() can put them back.
  std::vector<at::Tensor> swap_in();
  void restore(const std::vector<at::Tensor>& saved);
  /// Named shadow tensors ("<param name>"), for checkpoints.
  std::vector<std::pair<std::string, at::Tensor>> tensors() const;
  /// Throws shoestring::Error naming a missing or mis-shaped tensor.
  void load(const std::map<std::string, at::Tensor>& tensors);
  double decay() const { return decay_; }

 private:
  std::vector<std::pair<std::string, at::Tensor>> params_;
  std::vector<at::Tensor> shadow_;
  double decay_;
};

}  // namespace shoestring
