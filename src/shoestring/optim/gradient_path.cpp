#include "shoestring/optim/gradient_path.h"

#include <cmath>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/precision/master_weights.h"

namespace shoestring {

at::Tensor GradientPath::backward_loss(const at::Tensor& loss) const {
  const precision::LossScaler* scaler = loss_scaler();
  const at::Tensor scaled = scaler ? scaler->scale_loss(loss) : loss;
  return scaled / static_cast<double>(accumulation_steps_ * world_size_);
}

void GradientPath::add_reduced_gradient(size_t index, const at::Tensor&) {
  fail("the '{}' gradient path takes no gradients reduced outside .grad (parameter {})", name(), index);
}

namespace {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// sqrt(sum of squares) over the defined tensors, in fp32 (double sum);
/// `sum_parts` (GradientPathOptions::sum_squared_norm) adds the other
/// processes' sums of squares when set.
double global_norm(const std::vector<at::Tensor>& grads, const std::function<double(double)>& sum_parts) {
  torch::NoGradGuard no_grad;
  double sq = 0;
  for (const auto& g : grads) {
    if (g.defined()) sq += g.to(torch::kFloat32).pow(2).sum().item<double>();
  }
  return std::sqrt(sum_parts ? sum_parts(sq) : sq);
}

/// The paths whose optimizer runs after the last micro-batch on complete
/// gradients: they differ only in where those gradients are.
class StepAfterBackwardPath : public GradientPath {
 public:
  StepAfterBackwardPath(const GradientPathOptions& o, std::unique_ptr<Optimizer> optimizer)
      : GradientPath(o),
        max_grad_norm_(o.max_grad_norm),
        sum_squared_norm_(o.sum_squared_norm),
        optimizer_(std::move(optimizer)) {}

  Optimizer& optimizer() override { return *optimizer_; }

  GradientStepResult end_step(double lr, bool loss_finite) override {
    bool found_inf = false;
    const std::vector<at::Tensor> grads = gradients(found_inf);
    GradientStepResult r;
    r.grad_norm = global_norm(grads, sum_squared_norm_);
    r.finite = loss_finite && std::isfinite(r.grad_norm) && !found_inf;
    if (r.finite) {
      // Global-norm clipping as torch.nn.utils.clip_grad_norm_ (eps 1e-6).
      double scale = 1.0;
      if (max_grad_norm_ > 0 && r.grad_norm > max_grad_norm_) scale = max_grad_norm_ / (r.grad_norm + 1e-6);
      ScopedMemoryCategory category(MemoryCategory::temporaries);
      before_update(grads);
      optimizer_->step(lr, scale);
      after_update();
      r.stepped = true;
    }
    release(!r.finite);
    return r;
  }

 protected:
  /// The summed gradient of every optimizer tensor (undefined: none);
  /// `found_inf` is set when unscaling met inf/NaN.
  virtual std::vector<at::Tensor> gradients(bool& found_inf) = 0;
  /// Puts `grads` where the optimizer reads them (.grad of its tensors).
  virtual void before_update(const std::vector<at::Tensor>& grads) {}
  virtual void after_update() {}
  /// Frees every gradient; `skipped`: this step was not applied.
  virtual void release(bool skipped) = 0;

  double max_grad_norm_;
  std::function<double(double)> sum_squared_norm_;
  std::unique_ptr<Optimizer> optimizer_;
};

/// Autograd sums micro-batches into each weight's .grad.
class AutogradPath final : public StepAfterBackwardPath {
 public:
  AutogradPath(const NamedTensors& trainable, const GradientPathOptions& o, std::unique_ptr<Optimizer> opt)
      : StepAfterBackwardPath(o, std::move(opt)) {
    for (const auto& [n, p] : trainable) params_.push_back(p);
  }
  std::string name() const override { return "autograd"; }

 protected:
  std::vector<at::Tensor> gradients(bool&) override {
    std::vector<at::Tensor> grads;
    for (const auto& p : params_) grads.push_back(p.grad());
    return grads;
  }
  void release(bool) override {
    for (auto& p : params_) p.mutable_grad().reset();
  }

 private:
  std::vector<at::Tensor> params_;
};

/// Each micro-batch's .grad moves into a GradientAccumulator (fp32 or bf16 + SR).
/// With several ranks (reduced_across_ranks) the last micro-batch's stays
/// in .grad and sum_into_grad() adds the buffer to it in fp32 (the
/// accumulator's finish), the sum the ranks then average.
class AccumulatorPath final : public StepAfterBackwardPath {
 public:
  AccumulatorPath(const NamedTensors& trainable, const GradientPathOptions& o, std::unique_ptr<Optimizer> opt)
      : StepAfterBackwardPath(o, std::move(opt)), reduced_across_ranks_(o.reduced_across_ranks) {
    for (const auto& [n, p] : trainable) params_.push_back(p);
    accumulator_ = std::make_unique<GradientAccumulator>(params_, o.accumulation_mode, o.seed);
  }
  std::string name() const override { return "accumulator"; }

  void begin_micro_batch(int64_t micro) override { micro_ = micro; }
  void end_micro_batch(int64_t micro) override {
    if (reduced_across_ranks_ && micro + 1 == accumulation_steps_) return;  // sum_into_grad()
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      at::Tensor& g = params_[i].mutable_grad();
      if (g.defined()) accumulator_->add(i, g, micro_step(micro));
      g.reset();
    }
  }
  bool takes_reduced_gradients() const override { return reduced_across_ranks_; }
  void add_reduced_gradient(size_t index, const at::Tensor& sum) override {
    if (!reduced_across_ranks_) GradientPath::add_reduced_gradient(index, sum);
    torch::NoGradGuard no_grad;
    accumulator_->add(index, sum, micro_step(micro_));
  }
  bool sums_in_grad() const override { return !reduced_across_ranks_; }
  void sum_into_grad() override {
    if (!reduced_across_ranks_) return;
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < params_.size(); ++i) {
      at::Tensor& g = params_[i].mutable_grad();
      g = accumulator_->finish(i, g);  // fp32; frees the buffer
    }
  }

 protected:
  std::vector<at::Tensor> gradients(bool&) override {
    std::vector<at::Tensor> grads;
    for (size_t i = 0; i < params_.size(); ++i) {
      if (reduced_across_ranks_) {
        grads.push_back(params_[i].grad());  // the mean over ranks (ZeRO 2: on the owner only)
      } else {
        grads.push_back(accumulator_->has(i) ? accumulator_->get(i) : at::Tensor());
      }
    }
    return grads;
  }
  void before_update(const std::vector<at::Tensor>& grads) override {
    for (size_t i = 0; i < grads.size(); ++i) params_[i].mutable_grad() = grads[i];
  }
  void release(bool) override {
    for (auto& p : params_) p.mutable_grad().reset();
    accumulator_->reset();
  }

 private:
  /// A counter unique over the run keys the stochastic rounding of bf16
  /// buffers (as the fused backward's), so that no two steps round alike;
  /// step_count() is restored on resume.
  int64_t micro_step(int64_t micro) const { return optimizer_->step_count() * accumulation_steps_ + micro; }

  bool reduced_across_ranks_;
  int64_t micro_ = 0;
  std::vector<at::Tensor> params_;
  std::unique_ptr<GradientAccumulator> accumulator_;
};

/// fp32 masters and/or fp16 loss scaling: gradients unscaled into fp32.
class MasterWeightsPath final : public StepAfterBackwardPath {
 public:
  MasterWeightsPath(std::unique_ptr<precision::MasterWeights> masters, const GradientPathOptions& o,
                    std::unique_ptr<Optimizer> opt)
      : StepAfterBackwardPath(o, std::move(opt)), masters_(std::move(masters)), scaler_(o.loss_scaling) {}
  std::string name() const override { return "master weights"; }

  const precision::LossScaler* loss_scaler() const override { return scaler_.enabled() ? &scaler_ : nullptr; }
  int64_t master_count() const override { return masters_->master_count(); }
  int64_t master_bytes() const override { return masters_->master_bytes(); }

  GradientPathState state() const override {
    GradientPathState s;
    if (scaler_.enabled()) {
      s.loss_scale = scaler_.scale();
      s.loss_scale_growth_tracker = scaler_.growth_tracker();
    }
    s.masters = masters_->state_tensors();
    return s;
  }
  void load_state(const GradientPathState& s) override {
    if (scaler_.enabled() && s.loss_scale) scaler_.load_state(*s.loss_scale, s.loss_scale_growth_tracker);
    masters_->load_state_tensors({s.masters.begin(), s.masters.end()});
  }

 protected:
  std::vector<at::Tensor> gradients(bool& found_inf) override {
    // Unscaled fp32 gradients on the optimizer's tensors (masters or weights).
    found_inf = masters_->collect_grads(scaler_);
    std::vector<at::Tensor> grads;
    for (const auto& [n, p] : masters_->optimizer_params()) grads.push_back(p.grad());
    return grads;
  }
  void after_update() override { masters_->write_back(); }
  void release(bool skipped) override {
    masters_->zero_grads();  // the model's gradients and the masters
    scaler_.update(/*found_inf=*/skipped);
  }

 private:
  std::unique_ptr<precision::MasterWeights> masters_;
  precision::LossScaler scaler_;
};

/// The optimizer steps inside backward (optim/fused_backward.h).
class FusedBackwardPath final : public GradientPath {
 public:
  FusedBackwardPath(const GradientPathOptions& o, std::unique_ptr<Optimizer> opt)
      : GradientPath(o), optimizer_(std::move(opt)) {
    FusedBackwardOptions fo;
    fo.accumulation_steps = o.accumulation_steps;
    fo.max_grad_norm = o.max_grad_norm;
    fo.clip_method = o.fused_clip_method;
    if (o.low_precision_weights) fo.accumulation_mode = o.accumulation_mode;
    fo.seed = o.seed;
    fo.reduction = o.fused_reduction;
    fo.sum_over_ranks = o.sum_squared_norm;
    fused_ = std::make_unique<FusedBackward>(*optimizer_, fo);
  }
  std::string name() const override { return "fused backward"; }
  bool sums_in_grad() const override { return !fused_->options().reduction; }
  bool reduced_in_backward() const override { return fused_->options().reduction.has_value(); }
  Optimizer& optimizer() override { return *optimizer_; }

  void begin_step(double lr) override { fused_->begin_step(lr); }
  void begin_micro_batch(int64_t micro) override {
    fused_->begin_micro_batch(micro);
    repeated_ = false;
  }
  bool repeat_micro_batch() override {
    if (repeated_ || !fused_->needs_second_pass()) return false;
    repeated_ = true;
    return fused_->begin_second_pass();
  }
  GradientStepResult end_step(double, bool loss_finite) override {
    const FusedStepResult f = fused_->end_step();
    GradientStepResult r;
    r.grad_norm = f.grad_norm;
    r.finite = f.finite && loss_finite;
    r.stepped = f.params_stepped > 0;
    return r;
  }

  GradientPathState state() const override {
    GradientPathState s;
    s.previous_grad_norm = fused_->previous_grad_norm();
    return s;
  }
  void load_state(const GradientPathState& s) override {
    if (s.previous_grad_norm) fused_->set_previous_grad_norm(*s.previous_grad_norm);
  }

 private:
  std::unique_ptr<Optimizer> optimizer_;
  std::unique_ptr<FusedBackward> fused_;
  bool repeated_ = false;
};

}  // namespace

std::unique_ptr<GradientPath> make_gradient_path(const NamedTensors& trainable, const std::vector<bool>& use_master,
                                                 const OptimizerFactory& make_optimizer,
                                                 const GradientPathOptions& options) {
  std::unique_ptr<precision::MasterWeights> masters;
  {
    ScopedMemoryCategory category(MemoryCategory::optimizer_state);  // fp32 masters, as ZeRO counts them
    masters = std::make_unique<precision::MasterWeights>(trainable, use_master);
  }
  if (options.loss_scaling.enabled || masters->master_count() > 0) {
    if (options.fused_backward) {
      fail("fused_backward_pass cannot be combined with fp16 loss scaling or fp32 master weights");
    }
    auto optimizer = make_optimizer(masters->optimizer_params());
    return std::make_unique<MasterWeightsPath>(std::move(masters), options, std::move(optimizer));
  }
  masters.reset();
  auto optimizer = make_optimizer(trainable);
  if (options.fused_backward) return std::make_unique<FusedBackwardPath>(options, std::move(optimizer));
  if (options.low_precision_weights && options.accumulation_steps > 1) {
    return std::make_unique<AccumulatorPath>(trainable, options, std::move(optimizer));
  }
  return std::make_unique<AutogradPath>(trainable, options, std::move(optimizer));
}

}  // namespace shoestring
