// Optimizer interface shared by every optimizer in optim/.
//
// Parameters are updated one at a time (never a temporary the size of the
// whole model). A parameter's storage dtype decides how an update lands:
//  - fp32: the update is applied in place (fp32 master weights);
//  - bf16 / fp16 with stochastic_rounding: the new value is computed in fp32
//    and stochastically rounded back (unbiased; see core/stochastic_rounding.h),
//    keyed by (seed, step, parameter id) so a resumed run rounds identically;
//  - bf16 / fp16 without it: round-to-nearest (kept for comparison only:
//    updates below half an ulp are lost).
// Weight decay is decoupled (Loshchilov & Hutter 2019) and applied in fp32
// inside the same rounding, so it is never silently lost.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "shoestring/core/stochastic_rounding.h"
#include "shoestring/optim/fused_kernels.h"

namespace shoestring {

/// One trainable parameter as the optimizer sees it.
struct OptimParam {
  std::string name;     ///< dotted module path, e.g. "unet.down.0.res.0.conv1.weight"
  at::Tensor param;     ///< the live parameter (fp32, bf16 or fp16)
  double weight_decay;  ///< decoupled weight decay for this parameter (0 for norms and biases)
};

/// Options common to all optimizers.
struct OptimizerOptions {
  bool stochastic_rounding = true;  ///< SR for low-precision weights (else round-to-nearest)
  uint64_t seed = 0;                ///< rounding seed (combined with step and parameter index)
  /// dtype of full-size optimizer state tensors: kFloat32, or kBFloat16 (each
  /// update computed in fp32 and stochastically rounded back; see write_state).
  at::ScalarType state_dtype = at::kFloat;
  /// Keep optimizer state in host memory between steps (config
  /// `offload_optimizer_state`; DeepSpeed's offload_optimizer, OneTrainer's
  /// optimizer offloading): see Optimizer::apply_update.
  bool offload_state = false;
};

/// What an optimizer holds for one parameter, bytes: `state` kept between
/// steps (what state_tensors() holds for it after its first update), and
/// `scratch`, the transient bytes one update allocates beyond the gradient
/// and an fp32 working copy of it (the memory planner's per-update peak).
/// Each optimizer gives its own through a static state_size(); the memory
/// planner and `plan --explain` use optimizer_state_size() (optim/factory.h).
struct OptimizerStateSize {
  int64_t state = 0;
  int64_t scratch = 0;
};

/// Bytes per element of a full-size state tensor of dtype `state_dtype`
/// (kFloat 4, kBFloat16 / kHalf 2).
int64_t state_element_bytes(at::ScalarType state_dtype);

/// Base class. Subclasses implement update() for one parameter.
class Optimizer {
 public:
  Optimizer(std::vector<OptimParam> params, OptimizerOptions options);
  virtual ~Optimizer() = default;

  /// Applies one optimizer step to every parameter whose gradient is defined
  /// (and that set_update_subset leaves to this optimizer), through
  /// update_many (apply_update one parameter at a time when state is
  /// offloaded). lr: learning rate for this step. grad_scale: multiplier
  /// applied to every gradient first (global-norm clipping; 1 = none).
  /// Increments step_count().
  void step(double lr, double grad_scale = 1.0);

  /// Updates parameter `index` from `grad` (any float dtype, same shape) at
  /// optimizer step `step` (1-based, as torch.optim counts). Called through
  /// apply_update().
  virtual void update(size_t index, const at::Tensor& grad, double lr, int64_t step) = 0;

  /// update() with state offloading: when options().offload_state is set,
  /// parameter `index`'s state tensors live in host memory (pinned when CUDA
  /// is available; ledger category host_offload) and are streamed around the
  /// update: copied to the parameter's device (category optimizer_state),
  /// updated there, copied back, and the device copies freed. State created by
  /// the update (first step) is moved to host memory the same way. So at most
  /// one parameter's state is on the device at a time; the numbers are exactly
  /// those of the non-offloaded update (the copies are bit-exact). Costs two
  /// transfers of the state per step (on a GPU: PCIe bandwidth). Used by step()
  /// and by FusedBackward.
  void apply_update(size_t index, const at::Tensor& grad, double lr, int64_t step);

  /// Optimizer state as named tensors ("<param name>.<state name>") for the
  /// training-state checkpoint, plus the step counter.
  virtual std::vector<std::pair<std::string, at::Tensor>> state_tensors() const;
  /// Restores state saved by state_tensors(). Throws shoestring::Error naming
  /// the tensor when one is missing or has the wrong shape or dtype.
  virtual void load_state_tensors(const std::map<std::string, at::Tensor>& tensors);

  /// Restricts the optimizer to the parameters with `updated[i]` set
  /// (`updated` has one entry per parameter, in params() order); the others
  /// keep their values and never hold state: step() skips them (their
  /// gradients are not read), state_tensors() has none of them, and
  /// load_state_tensors() checks their tensors' names but keeps none of them.
  /// Stochastic-rounding keys stay those of the full list, so the updated
  /// parameters get the same bits as without a subset. ZeRO stages 1 and 2
  /// (dist/zero.h) give each rank the tensors it owns. Default: all. Drops
  /// the state already held by parameters left out. Throws shoestring::Error
  /// when `updated` does not have params().size() entries.
  void set_update_subset(std::vector<bool> updated);
  /// True when parameter `index` is updated (see set_update_subset).
  bool updates(size_t index) const { return updated_.empty() || updated_[index]; }

  int64_t step_count() const { return step_count_; }
  void set_step_count(int64_t s) { step_count_ = s; }
  const std::vector<OptimParam>& params() const { return params_; }
  /// Bytes of optimizer state currently held.
  int64_t state_bytes() const;
  const OptimizerOptions& optimizer_options() const { return options_; }

 protected:
  /// Updates the parameters `indices` (ascending, each with a defined .grad)
  /// from their .grad times `grad_scale` at step `step`: the same results as
  /// update() on each with the scaled gradient. The default does exactly that,
  /// one parameter at a time (a scaled gradient is an fp32 copy of one
  /// parameter's size, freed before the next). Optimizers with fused CPU
  /// kernels override it to run all their fused tensors in one parallel
  /// region (fused_kernels.h, *_step_many), passing grad_scale to the kernel
  /// instead of copying the gradient, and the others through update().
  virtual void update_many(const std::vector<size_t>& indices, double lr, int64_t step, double grad_scale);
  /// update_many of an optimizer with fused CPU kernels: `task_of(index,
  /// grad, lr, step, grad_scale)` gives a parameter's kernel task (nullopt
  /// for what the kernels do not take, which goes through update() with the
  /// scaled gradient); `step_many` runs every task in one parallel region.
  template <typename Task, typename TaskOf>
  void update_many_fused(const std::vector<size_t>& indices, double lr, int64_t step, double grad_scale,
                         const TaskOf& task_of, void (*step_many)(const std::vector<Task>&)) {
    std::vector<Task> fused;
    fused.reserve(indices.size());
    for (size_t i : indices) {
      if (std::optional<Task> t = task_of(i, params_[i].param.grad(), lr, step, grad_scale)) {
        fused.push_back(std::move(*t));
      } else {
        update(i, scaled_grad(i, grad_scale), lr, step);
      }
    }
    step_many(fused);
  }
  /// params_[index].param.grad() times `grad_scale` (the gradient itself when
  /// it is 1; else an fp32 copy, or the fp32 gradient scaled in place).
  at::Tensor scaled_grad(size_t index, double grad_scale) const;

  /// Throws shoestring::Error naming `optimizer` and the parameter when
  /// `grad` does not hold the parameter's element count.
  void check_gradient(size_t index, const at::Tensor& grad, const char* optimizer) const;
  /// On first use, state tensors `names` of parameter `index`: zeros of its
  /// shape on its device in options_.state_dtype, charged to the ledger's
  /// optimizer_state. Does nothing once the first of them exists.
  void create_zero_state(size_t index, std::initializer_list<const char*> names);
  /// Writes `value` (fp32, same shape) into params_[index].param, rounding as
  /// documented above.
  void write_param(size_t index, const at::Tensor& value, int64_t step);
  /// Writes `value` (fp32) into the state tensor `dst` (fp32: copy; bf16/fp16:
  /// stochastic rounding keyed by (seed, step, parameter index, slot), where
  /// `slot` tells apart the state tensors of one parameter, 1..15).
  void write_state(size_t index, at::Tensor& dst, const at::Tensor& value, int64_t step, int slot);
  /// The stochastic-rounding key of parameter `index` at `step`: slot 0 is
  /// the weight, slots 1..15 its state tensors (tensor id = index * 16 + slot).
  /// Every optimizer and fused kernel rounds with these keys, so all paths
  /// give the same bits and a resumed run rounds like the uninterrupted one.
  RoundingKey rounding_key(size_t index, int64_t step, int slot = 0) const {
    return {options_.seed, static_cast<uint64_t>(step),
            static_cast<uint64_t>(index) * 16 + static_cast<uint64_t>(slot)};
  }
  /// State tensor `name` of parameter `index` (undefined until assigned).
  /// State names contain no '.', so checkpoint keys "<param>.<state>" split unambiguously.
  at::Tensor& state(size_t index, const std::string& name);
  bool has_state(size_t index, const std::string& name) const;

  std::vector<OptimParam> params_;
  OptimizerOptions options_;
  int64_t step_count_ = 0;
  std::vector<std::map<std::string, at::Tensor>> state_;

 private:
  std::vector<bool> updated_;  ///< empty: every parameter (set_update_subset)
};

/// AdamW with decoupled weight decay (Loshchilov & Hutter 2019,
/// arXiv 1711.05101), matching torch.optim.AdamW (amsgrad=False):
///   p <- p (1 - lr wd); m <- b1 m + (1-b1) g; v <- b2 v + (1-b2) g^2;
///   p <- p - lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps).
/// State: exp_avg, exp_avg_sq in fp32 (8 bytes/parameter).
struct AdamWOptions {
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
};

class AdamW : public Optimizer {
 public:
  AdamW(std::vector<OptimParam> params, AdamWOptions adam, OptimizerOptions options);
  void update(size_t index, const at::Tensor& grad, double lr, int64_t step) override;
  /// Every parameter the fused kernel takes (fast_cpu_path, fused_adamw_supported)
  /// in one fused_adamw_step_many; the others through update().
  void update_many(const std::vector<size_t>& indices, double lr, int64_t step, double grad_scale) override;

  /// State of a parameter of `shape`: exp_avg and exp_avg_sq of the shape in
  /// options.state_dtype (2 x 4 bytes per element in fp32, 2 x 2 in bf16).
  static OptimizerStateSize state_size(at::IntArrayRef shape, const OptimizerOptions& options);

 private:
  /// Creates the state of parameter `index` if needed; returns its fused
  /// kernel call with `grad` (times grad_scale), or nothing when the op chain
  /// must run (not a CPU tensor, or a layout / dtype the kernel lacks).
  std::optional<FusedAdamWTensor> fused_task(size_t index, const at::Tensor& grad, double lr, int64_t step,
                                             double grad_scale);
  AdamWOptions adam_;
};

/// Parses kohya-style optimizer_args ("weight_decay=0.01", "betas=0.9,0.999",
/// "eps=1e-8") for `optimizer_type`. Throws shoestring::Error for an unknown
/// optimizer (listing valid names) or argument (listing valid arguments).
AdamWOptions parse_adamw_args(const std::vector<std::string>& args);

/// For tests: true makes every optimizer take its device-generic path (ATen
/// ops only: what tensors on a GPU take) on CPU tensors too, instead of the
/// fused CPU kernels, so the two can be compared on a machine without a GPU.
/// Process-wide; false by default.
void force_device_generic_optimizers(bool generic);

/// True when the fused CPU kernels may run on `t`: a CPU tensor, and the
/// generic path is not forced (force_device_generic_optimizers).
bool fast_cpu_path(const at::Tensor& t);

/// True for parameters that take no weight decay by default: biases and
/// normalization weights (every tensor with fewer than 2 dimensions).
bool default_no_decay(const std::string& name, const at::Tensor& param);

}  // namespace shoestring
