// Exponential moving average of model weights (Polyak averaging), as
// diffusers' EMAModel does by default (training_utils.py, get_decay without
// use_ema_warmup): at the k-th optimizer step (k = 1, 2, ...)
//   d_k = 0 for k = 1, else min(ema_decay, (1 + (k - 1)) / (10 + (k - 1)))
//   shadow <- d_k * shadow + (1 - d_k) * param,
// kept in fp32 whatever the weights' storage dtype. The ramp matters for
// short runs: with a constant 0.99 a 135-step run's average still holds
// 0.99^135 = 26% of the random initial weights, and samples from it are noise.
#pragma once
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace shoestring {

/// fp32 shadow copies of a set of named parameters (4 bytes/parameter, charged
/// to the memory ledger's optimizer_state category).
///
/// Sharded (ZeRO stages 1-3 on several ranks): with an `owned` mask, a rank
/// keeps the shadows of the parameters it owns only (the ones its optimizer
/// updates, dist::ZeroSharding::owned()), so the EMA costs each rank about
/// 1/world of it, as the optimizer state; update, swap_in, restore, tensors
/// and load then touch those only (the trainer gathers the swapped-in
/// weights onto rank 0 itself).
class EMA {
 public:
  /// params: (name, tensor) pairs; decay in [0, 1); `owned`: empty (every
  /// parameter) or one entry per parameter. Throws shoestring::Error for a
  /// decay outside [0, 1) or an `owned` of another size.
  EMA(const std::vector<std::pair<std::string, at::Tensor>>& params, double decay, std::vector<bool> owned = {});
  /// The decay of optimizer step `step` (1-based): d_k above.
  double decay_at(int64_t step) const;
  /// shadow <- d * shadow + (1 - d) * param for every parameter, with
  /// d = decay_at(step); `step` is the optimizer step just applied (1-based,
  /// counted across resumes). Throws shoestring::Error for step < 1.
  void update(int64_t step);
  /// Moves the shadows of the parameters `in_host_memory` picks to host
  /// memory (pinned when the parameter's device is CUDA; charged to the
  /// ledger's host_offload), where offload_params keeps those weights
  /// (train/block_streaming.h): update() then averages them there. On a
  /// CPU run a copy too, charged to host_offload (the split a GPU would see).
  void move_shadows_to_host(const std::function<bool(const at::Tensor& param)>& in_host_memory);
  /// Copies the shadow weights into the live parameters (rounded to their dtype)
  /// and returns the previous live values so restore() can put them back.
  std::vector<at::Tensor> swap_in();
  void restore(const std::vector<at::Tensor>& saved);
  /// Named shadow tensors ("<param name>") of the kept parameters, for checkpoints.
  std::vector<std::pair<std::string, at::Tensor>> tensors() const;
  /// The shadows of the kept parameters from `tensors` (others are ignored,
  /// so a checkpoint of any world size re-shards). Throws shoestring::Error
  /// naming a missing or mis-shaped tensor.
  void load(const std::map<std::string, at::Tensor>& tensors);
  double decay() const { return decay_; }

 private:
  std::vector<std::pair<std::string, at::Tensor>> params_;  ///< the kept ones
  std::vector<at::Tensor> shadow_;
  double decay_;
};

}  // namespace shoestring
