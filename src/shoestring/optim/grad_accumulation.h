// Gradient accumulation across micro-batches, in a buffer separate from
// autograd's .grad, with a choice of precision:
//  - fp32: an fp32 buffer per parameter (4 bytes/parameter; exact to fp32).
//  - bf16_sr: a bf16 buffer (2 bytes/parameter); the first micro-batch copies
//    the gradient (stochastically rounded when it is wider than bf16), each
//    later one is added in fp32 and the sum stochastically rounded back, so
//    the expected buffer value equals the exact sum ("stochastic gradient
//    accumulation", torchastic's StochasticAccumulator).
//  - native: a buffer of the parameter's own dtype, added in place with
//    round-to-nearest, which is what autograd's own accumulation into .grad
//    does. For bf16 parameters, any addend below half an ulp of the running
//    sum is lost (1.0 + 1e-4 stays 1.0); kept for comparison.
// Memory: buffers are allocated on a parameter's first add() after reset(),
// charged to MemoryCategory::gradients, and freed by release()/finish()/reset().
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace shoestring {

/// Precision of a gradient accumulation buffer (see the file comment).
enum class GradAccumulationMode { fp32, bf16_sr, native };

/// "fp32", "bf16_sr", "native".
const char* to_string(GradAccumulationMode mode);
/// Inverse of to_string. Throws shoestring::Error listing the valid names.
GradAccumulationMode parse_grad_accumulation_mode(const std::string& name);

/// Per-parameter gradient accumulation buffers.
class GradientAccumulator {
 public:
  /// params: the parameters (only their shapes, dtypes and devices are used;
  /// any float dtype). seed: stochastic-rounding seed (bf16_sr), combined
  /// with the micro-step counter and parameter index.
  GradientAccumulator(std::vector<at::Tensor> params, GradAccumulationMode mode, uint64_t seed);

  /// Adds `grad` (same shape as parameter `index`, any float dtype) to the
  /// buffer of parameter `index`; the first add after reset()/release()
  /// allocates the buffer. micro_step: a counter unique over the run (e.g.
  /// (optimizer_step - 1) * accumulation_steps + micro_batch); it keys the
  /// rounding randomness so a resumed run rounds identically. may_alias: the
  /// caller gives up `grad` (will neither read nor modify it again), so a
  /// first add may adopt its storage instead of copying when the dtype
  /// already matches the buffer's (saves one gradient-sized copy).
  /// Throws shoestring::Error on a bad index or shape.
  void add(size_t index, const at::Tensor& grad, int64_t micro_step, bool may_alias = false);

  /// The buffer of parameter `index` (dtype: fp32 for fp32, bf16 for
  /// bf16_sr, the parameter's dtype for native); undefined if nothing was
  /// added since the last reset.
  const at::Tensor& get(size_t index) const;
  bool has(size_t index) const;

  /// Total gradient buffer + last_grad in fp32 (last_grad may be undefined:
  /// then the buffer alone; both undefined gives an undefined tensor), without
  /// rounding the final sum to the buffer dtype; frees the buffer. In fp32
  /// mode the buffer itself is returned with last_grad added in place.
  at::Tensor finish(size_t index, const at::Tensor& last_grad);

  /// Frees the buffer of parameter `index`.
  void release(size_t index);
  /// Frees every buffer (the next add() of each parameter starts afresh).
  void reset();

  /// Bytes held by buffers now.
  int64_t buffer_bytes() const;
  size_t size() const { return buffers_.size(); }
  GradAccumulationMode mode() const { return mode_; }
  /// The buffer dtype used for parameter `index`.
  at::ScalarType buffer_dtype(size_t index) const;

 private:
  void check(size_t index, const at::Tensor& grad) const;

  std::vector<at::Tensor> params_;
  GradAccumulationMode mode_;
  uint64_t seed_;
  std::vector<at::Tensor> buffers_;
};

}  // namespace shoestring
