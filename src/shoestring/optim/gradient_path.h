// The gradient path: where the gradients of a training step live, how the
// micro-batches of one optimizer step are summed, how the global gradient
// norm is computed and clipped, and when the optimizer runs.
//
// One path is chosen once, at setup (make_gradient_path), from the precision
// policy and the config:
//  - AutogradPath: autograd sums every micro-batch into the weights' own .grad
//    (fp32 weights, or low-precision weights without accumulation); the
//    optimizer steps once after the last micro-batch.
//  - AccumulatorPath: low-precision (bf16) weights with accumulation: each
//    micro-batch's gradient is moved into a GradientAccumulator (fp32, or bf16
//    with stochastic rounding) and .grad is freed, so autograd never sums in
//    bf16 (kohya's full_bf16 + gradient_accumulation_steps).
//  - MasterWeightsPath: fp32 master weights and/or fp16 dynamic loss scaling
//    (the "bridge", docs/precision.md): gradients are unscaled into fp32 and
//    handed to the masters (or the fp32 weights); overflowing steps are
//    skipped and the loss scale backs off (torch.cuda.amp.GradScaler).
//  - FusedBackwardPath: the optimizer runs inside backward, one parameter at a
//    time as its gradient is ready (optim/fused_backward.h, kohya's
//    fused_backward_pass); no full gradient ever exists.
// ZeRO's sharded gradients (reduce-scatter into the owning rank's shard) are
// meant to be one more implementation of the same interface.
//
// The loop calls, per optimizer step:
//   begin_step(lr)
//   for each micro-batch: begin_micro_batch(m); backward(backward_loss(loss));
//                         [while repeat_micro_batch(): rerun forward+backward]
//                         end_micro_batch(m)
//   end_step(lr, loss_finite)
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "shoestring/optim/fused_backward.h"
#include "shoestring/optim/grad_accumulation.h"
#include "shoestring/optim/optimizer.h"
#include "shoestring/precision/loss_scaler.h"

namespace shoestring {

/// What one optimizer step did.
struct GradientStepResult {
  /// Global L2 norm of the step's (unscaled, summed) gradient before
  /// clipping; inf/NaN when a gradient was non-finite.
  double grad_norm = 0;
  /// False when the step was skipped: a non-finite loss or gradient.
  bool finite = true;
  /// The optimizer updated at least one parameter (EMA follows it).
  bool stepped = false;
};

/// State of a path that a checkpoint keeps, beside the optimizer's.
struct GradientPathState {
  std::optional<double> loss_scale;          ///< fp16 dynamic loss scale (enabled loss scaling only)
  int64_t loss_scale_growth_tracker = 0;     ///< clean steps since the scale last changed
  std::optional<double> previous_grad_norm;  ///< fused clipping's norm of the previous step
  /// fp32 master weights by trainable-parameter name (MasterWeights::state_tensors).
  std::vector<std::pair<std::string, at::Tensor>> masters;
};

/// Chooses and configures a path (see the file comment).
struct GradientPathOptions {
  int64_t accumulation_steps = 1;  ///< micro-batches per optimizer step (>= 1)
  /// Ranks whose gradients are summed into the step's (data parallel, ZeRO):
  /// each backpropagates its share of the global batch's mean loss, its
  /// rows' mean / world_size (backward_loss), so that every activation
  /// gradient is as large as one process's over the whole global batch
  /// (fp16's range: the loss scale overflows where one process's would).
  int64_t world_size = 1;
  double max_grad_norm = 1.0;   ///< global-norm clip; 0 disables
  bool fused_backward = false;  ///< FusedBackwardPath (excludes masters and loss scaling)
  FusedClipMethod fused_clip_method = FusedClipMethod::previous_step_norm;
  /// Low-precision (bf16) trainable weights: micro-batch sums then go through
  /// a GradientAccumulator in `accumulation_mode` (fused: its buffers).
  bool low_precision_weights = false;
  GradAccumulationMode accumulation_mode = GradAccumulationMode::fp32;
  uint64_t seed = 0;                                             ///< stochastic-rounding seed of accumulation buffers
  precision::LossScalerOptions loss_scaling{/*enabled=*/false};  ///< enabled: fp16 dynamic loss scaling
  /// Set when this process holds only part of the step's gradients (ZeRO
  /// stage 2, dist/zero.h: each rank the gradients of the tensors it owns):
  /// end_step passes the squared L2 norm of the gradients held here through
  /// it and takes the square root of the answer, the sum over every part, as
  /// the global norm, so that clipping and the skip of non-finite steps agree
  /// on every process. Called once per end_step. Unset: the gradients here
  /// are the whole step's. The fused path (with fused_reduction, each rank
  /// stepping its own tensors) sums its norm and stepped count through it
  /// (FusedBackwardOptions::sum_over_ranks).
  std::function<double(double)> sum_squared_norm;
  /// Set when several processes reduce the step's gradients after its last
  /// micro-batch (data parallel, ZeRO stages 1-2): the accumulator path then
  /// keeps the last micro-batch's gradient in .grad and sum_into_grad() adds
  /// the earlier ones to it in fp32, so that the reduction averages fp32
  /// sums (never a bf16-rounded one) and the optimizer reads its result.
  bool reduced_across_ranks = false;
  /// Several ranks, the fused backward path: how each parameter's step
  /// gradient is summed over the ranks inside backward (FusedReduction).
  std::optional<FusedReduction> fused_reduction;
};

/// The interface the training step talks to (see the file comment for the
/// call order). Owns the optimizer it steps.
class GradientPath {
 public:
  virtual ~GradientPath() = default;

  /// "autograd", "accumulator", "master weights" or "fused backward".
  virtual std::string name() const = 0;
  /// The optimizer this path steps (its state goes into checkpoints).
  virtual Optimizer& optimizer() = 0;

  /// Before the first micro-batch of an optimizer step at learning rate `lr`.
  virtual void begin_step(double lr) {}
  /// The scalar to call backward() on for a micro-batch's mean loss (fp32,
  /// shape []): loss / (accumulation_steps x world_size), times the loss
  /// scale when loss scaling is on.
  virtual at::Tensor backward_loss(const at::Tensor& loss) const;
  /// Before micro-batch `micro` (0-based) runs forward and backward.
  virtual void begin_micro_batch(int64_t micro) {}
  /// After a micro-batch's backward: true when the same micro-batch must run
  /// forward and backward once more, with the RNG replayed (fused two-pass
  /// clipping: the first pass measured the norm, the second applies updates).
  virtual bool repeat_micro_batch() { return false; }
  /// After a micro-batch's last backward: moves its gradients where the path sums them.
  virtual void end_micro_batch(int64_t micro) {}
  /// False when the step's summed gradient reaches .grad only through
  /// sum_into_grad(), after the last backward: a reduction across ranks must
  /// then not start during that backward. True: autograd sums into .grad.
  virtual bool sums_in_grad() const { return true; }
  /// True when this path reduces the gradients across ranks itself, inside
  /// backward (the fused path with several ranks): nothing is left to reduce
  /// after the micro-batches.
  virtual bool reduced_in_backward() const { return false; }
  /// Several ranks (GradientPathOptions::reduced_across_ranks), after the
  /// last micro-batch and before the gradients are reduced across ranks:
  /// leaves the step's summed gradient of every trainable weight in its
  /// .grad (undefined where none), which the reduction reads and overwrites
  /// with the mean over ranks. Nothing to do where autograd summed into .grad.
  virtual void sum_into_grad() {}
  /// True when gradients summed over the ranks outside .grad may be handed
  /// to add_reduced_gradient() (ZeRO stage 3's streamed blocks, reduced
  /// after each backward, dist::ZeroSharding::set_streamed_gradient_sink):
  /// the accumulator path, whose buffers then sum the micro-batches.
  virtual bool takes_reduced_gradients() const { return false; }
  /// The current micro-batch's gradient of trainable weight `index` (in the
  /// order of make_gradient_path's `trainable`), summed over the ranks:
  /// fp32, the weight's shape; copied, not kept. Added to the step's sum,
  /// which sum_into_grad() leaves in .grad. Throws shoestring::Error where
  /// takes_reduced_gradients() is false.
  virtual void add_reduced_gradient(size_t index, const at::Tensor& sum);
  /// Ends the optimizer step: global norm, clipping, the optimizer update
  /// (skipped when `loss_finite` is false or a gradient is non-finite), and
  /// freeing of every gradient. Throws what the optimizer throws.
  virtual GradientStepResult end_step(double lr, bool loss_finite) = 0;

  /// The dynamic loss scaler when this path scales the loss (fp16), else nullptr.
  virtual const precision::LossScaler* loss_scaler() const { return nullptr; }
  /// Number and bytes of fp32 master weights (0 without masters).
  virtual int64_t master_count() const { return 0; }
  virtual int64_t master_bytes() const { return 0; }

  /// What a checkpoint keeps of this path (besides the optimizer's state).
  virtual GradientPathState state() const { return {}; }
  /// Restores state(). Throws shoestring::Error for master tensors that do not
  /// match (names, shapes).
  virtual void load_state(const GradientPathState& state) {}

 protected:
  explicit GradientPath(const GradientPathOptions& o)
      : accumulation_steps_(o.accumulation_steps), world_size_(o.world_size) {}
  int64_t accumulation_steps_;
  int64_t world_size_;
};

/// Builds the optimizer from the tensors it updates (the trainable weights,
/// or their fp32 masters).
using OptimizerFactory =
    std::function<std::unique_ptr<Optimizer>(const std::vector<std::pair<std::string, at::Tensor>>& params)>;

/// Chooses the path for `trainable` (named leaf tensors that require grad):
/// MasterWeightsPath when any `use_master[i]` is set or loss scaling is
/// enabled; else FusedBackwardPath when options.fused_backward; else
/// AccumulatorPath when low-precision weights are accumulated over more than
/// one micro-batch; else AutogradPath. Master weights are charged to the
/// ledger's optimizer_state category (as ZeRO counts them).
/// Throws shoestring::Error when fused_backward is combined with masters or
/// loss scaling, and what the optimizer factory throws.
std::unique_ptr<GradientPath> make_gradient_path(const std::vector<std::pair<std::string, at::Tensor>>& trainable,
                                                 const std::vector<bool>& use_master,
                                                 const OptimizerFactory& make_optimizer,
                                                 const GradientPathOptions& options);

}  // namespace shoestring
