// 8-bit AdamW: AdamW whose two moments are stored block-wise quantized to
// 8 bits (Dettmers et al. 2021, "8-bit Optimizers via Block-wise
// Quantization", arXiv 2110.02861; behaviour of bitsandbytes' AdamW8bit).
//
// State per parameter of numel >= min_8bit_size (bitsandbytes' default 4096):
//   exp_avg_q      uint8, parameter shape   codes of m in the signed dynamic map
//   exp_avg_absmax fp32 [ceil(numel/256)]   per-block absmax of m
//   exp_avg_sq_q   uint8, parameter shape   codes of v in the unsigned dynamic map
//   exp_avg_sq_absmax fp32 [ceil(numel/256)]
// = 2 + 8/256 = 2.03 bytes per parameter (fp32 AdamW: 8). Smaller tensors
// (biases, norms) keep fp32 exp_avg / exp_avg_sq, as bitsandbytes does.
//
// One step works block by block (never more than one block of fp32 moments
// per thread): dequantize m and v, apply the AdamW update in fp32 exactly as
// the AdamW class does (decoupled weight decay, bias corrections, eps outside
// the square root), write the parameter (fp32 in place, or bf16/fp16 by
// stochastic rounding with the same random bits Optimizer::write_param
// uses), then requantize m and v with the block's new absmax.
// A non-finite gradient element leaves its parameter element and its moments
// unchanged (as bitsandbytes' kernels skip it); so does an element whose new
// moment or parameter would overflow to a non-finite value.
#pragma once
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "shoestring/optim/optimizer.h"

namespace shoestring {

/// Options of AdamW8bit.
struct AdamW8bitOptions {
  AdamWOptions adam;             ///< betas, eps, weight_decay as AdamW
  int64_t block_size = 256;      ///< quantization block (elements); bitsandbytes uses 256
  int64_t min_8bit_size = 4096;  ///< tensors with fewer elements keep fp32 state
};

class AdamW8bit : public Optimizer {
 public:
  /// Throws shoestring::Error if block_size < 1 or min_8bit_size < 0.
  /// options.state_dtype is not used: state is 8-bit, or fp32 for small tensors.
  AdamW8bit(std::vector<OptimParam> params, AdamW8bitOptions adam, OptimizerOptions options);

  /// One AdamW8bit step for parameter `index` (fp32, bf16 or fp16
  /// parameter; grad of any of these dtypes with the parameter's numel, on
  /// its device). CPU tensors take the fused kernel (or the per-element loop
  /// for fp16 and non-contiguous tensors); others a device-generic path of
  /// ATen ops with the same bits. Throws shoestring::Error for a gradient of
  /// another size, dtype or device, or inconsistent state.
  void update(size_t index, const at::Tensor& grad, double lr, int64_t step) override;
  /// Every parameter the fused kernel takes (8-bit state, fast_cpu_path,
  /// fused_adamw8bit_supported) in one fused_adamw8bit_step_many; the others
  /// through update().
  void update_many(const std::vector<size_t>& indices, double lr, int64_t step, double grad_scale) override;

  /// Base behaviour, then checks every parameter's state: either none, the
  /// fp32 pair (parameter shape), or the four 8-bit tensors with the dtypes and
  /// sizes above. Throws shoestring::Error naming the tensor otherwise.
  void load_state_tensors(const std::map<std::string, at::Tensor>& tensors) override;

  /// State of a parameter of `shape`: with numel >= min_8bit_size, two uint8
  /// tensors of the shape and two fp32 absmax vectors of ceil(numel /
  /// block_size) (about 2.03 bytes per element); below it, fp32 exp_avg and
  /// exp_avg_sq (8 bytes per element). options.state_dtype is not used.
  static OptimizerStateSize state_size(at::IntArrayRef shape, const AdamW8bitOptions& adam);

  /// True when parameter `index` has (or will get) 8-bit state.
  bool uses_8bit_state(size_t index) const;

  const AdamW8bitOptions& options() const { return adam8_; }

 private:
  void check_state(size_t index) const;
  /// update()'s checks of parameter `index` and `grad`, and its state
  /// (created on first use, then checked); returns uses_8bit_state(index).
  bool prepare(size_t index, const at::Tensor& grad);
  /// prepare(), then the fused kernel call of parameter `index` with `grad`
  /// (times grad_scale), or nothing when another path must run.
  std::optional<FusedAdamW8bitTensor> fused_task(size_t index, const at::Tensor& grad, double lr, int64_t step,
                                                 double grad_scale);
  AdamW8bitOptions adam8_;
};

/// Parses kohya-style optimizer_args for optimizer_type = "AdamW8bit":
/// weight_decay, betas ("b1,b2"), eps, min_8bit_size, block_size. Throws
/// shoestring::Error for an unknown argument (listing the valid ones) or a
/// bad value (naming the argument).
AdamW8bitOptions parse_adamw8bit_args(const std::vector<std::string>& args);

}  // namespace shoestring
