// fp32 master weights and fp32 gradient unscaling for low-precision parameters.
//
// For every trainable parameter whose rule says master = "fp32" and whose
// storage is not fp32, this keeps an fp32 copy (the "master weight", as in
// Micikevicius et al. 2018, "Mixed Precision Training", arXiv 1710.03740, and
// apex O2): the optimizer updates the master, and the model's bf16/fp16 copy
// is refreshed from it (round to nearest) after each step. Other trainable
// parameters are handed to the optimizer as they are (fp32 weights, or
// bf16/fp16 weights updated with stochastic rounding).
//
// Gradients always reach the optimizer in fp32: collect_grads() takes each
// model parameter's gradient (any dtype, scaled by the loss scale), converts
// it to fp32, multiplies by 1/scale and hands it to the optimizer tensor
// (the master, or the parameter itself). PyTorch's GradScaler refuses to
// unscale fp16 gradients in place ("Attempting to unscale FP16 gradients",
// the diffusers/accelerate failure with fp16 weights); here no fp16 gradient
// is ever unscaled in fp16.
#pragma once
#include <map>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "shoestring/precision/loss_scaler.h"

namespace shoestring::precision {

class MasterWeights {
 public:
  /// `trainable`: (name, model parameter) pairs; `use_master[i]`: keep an fp32
  /// master for parameter i (ignored for fp32 parameters). Masters are
  /// created from the current values. Throws shoestring::Error when sizes differ.
  MasterWeights(std::vector<std::pair<std::string, at::Tensor>> trainable, const std::vector<bool>& use_master);

  /// The tensors the optimizer updates, in the same order and with the same
  /// names: the fp32 master where there is one, else the model parameter.
  const std::vector<std::pair<std::string, at::Tensor>>& optimizer_params() const { return targets_; }
  /// Number of parameters with an fp32 master, and their bytes.
  int64_t master_count() const;
  int64_t master_bytes() const;

  /// Moves the gradients: for each parameter with a defined gradient, the
  /// optimizer tensor's .grad becomes grad.to(fp32) * scaler.inv_scale(), and
  /// the model parameter's own gradient is released (for parameters without a
  /// master the fp32 gradient replaces it). Returns found_inf (any inf/NaN).
  bool collect_grads(const LossScaler& scaler);

  /// Copies every master into its model parameter (round to nearest).
  void write_back();

  /// Releases every gradient (model parameters and masters).
  void zero_grads();

  /// Masters as named tensors "<param name>" for the training state.
  std::vector<std::pair<std::string, at::Tensor>> state_tensors() const;
  /// Restores masters saved by state_tensors() and writes them back into the
  /// model. Throws shoestring::Error naming a missing or misshapen tensor.
  void load_state_tensors(const std::map<std::string, at::Tensor>& tensors);

 private:
  std::vector<std::pair<std::string, at::Tensor>> model_;
  std::vector<std::pair<std::string, at::Tensor>> targets_;
  std::vector<bool> has_master_;
};

}  // namespace shoestring::precision
