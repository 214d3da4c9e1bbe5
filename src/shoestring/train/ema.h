// Exponential moving average of model weights (Polyak averaging; as in
// diffusers' EMAModel without warmup): shadow <- decay * shadow + (1 - decay) * param,
// kept in fp32 whatever the weights' storage dtype.
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
  /// shadow <- decay * shadow + (1 - decay) * param, for every parameter.
  void update();
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
