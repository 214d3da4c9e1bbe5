#include "shoestring/optim/fused_backward.h"

#include <cmath>
#include <deque>
#include <limits>
#include <map>
#include <set>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"

namespace shoestring {

namespace {

/// Each receiving rank's bucket: bucket_bytes shared between the distinct
/// roots (-1, every rank, counts as one).
int64_t root_bucket_bytes(const std::vector<int>& roots, int64_t bucket_bytes) {
  const std::set<int> distinct(roots.begin(), roots.end());
  return bucket_bytes / std::max<int64_t>(1, static_cast<int64_t>(distinct.size()));
}

}  // namespace

const char* to_string(FusedClipMethod method) {
  switch (method) {
    case FusedClipMethod::previous_step_norm: return "previous_step_norm";
    case FusedClipMethod::two_pass: return "two_pass";
  }
  return "unknown";
}

FusedClipMethod parse_fused_clip_method(const std::string& name) {
  if (name == "previous_step_norm") return FusedClipMethod::previous_step_norm;
  if (name == "two_pass") return FusedClipMethod::two_pass;
  fail("fused backward clip method '{}' is not valid (valid: previous_step_norm, two_pass)", name);
}

FusedBackward::FusedBackward(Optimizer& optimizer, FusedBackwardOptions options)
    : optimizer_(optimizer),
      options_(options),
      self_(std::make_shared<FusedBackward*>(this)),
      previous_norm_(std::numeric_limits<double>::quiet_NaN()) {
  if (options_.accumulation_steps < 1) {
    fail("fused backward: accumulation_steps must be >= 1 (got {})", options_.accumulation_steps);
  }
  if (options_.reduction)
    root_bucket_bytes_ = root_bucket_bytes(options_.reduction->root_of, options_.reduction->bucket_bytes);
  std::vector<at::Tensor> params;
  for (const auto& p : optimizer_.params()) params.push_back(p.param);
  const size_t n = params.size();
  done_.assign(n, 0);
  accumulator_of_.assign(n, nullptr);
  // One accumulator per buffer mode in use, each indexed like the optimizer's
  // parameters (buffers are allocated lazily, so unused slots cost nothing).
  std::vector<std::pair<GradAccumulationMode, GradientAccumulator*>> by_mode;
  for (size_t i = 0; i < n; ++i) {
    GradAccumulationMode mode = options_.accumulation_mode.value_or(params[i].scalar_type() == torch::kFloat32 ||
                                                                            params[i].scalar_type() == torch::kFloat64
                                                                        ? GradAccumulationMode::fp32
                                                                        : GradAccumulationMode::bf16_sr);
    GradientAccumulator* acc = nullptr;
    for (auto& [m, a] : by_mode) {
      if (m == mode) acc = a;
    }
    if (!acc) {
      accumulators_.push_back(std::make_unique<GradientAccumulator>(params, mode, options_.seed));
      acc = accumulators_.back().get();
      by_mode.emplace_back(mode, acc);
    }
    accumulator_of_[i] = acc;
  }
  std::shared_ptr<FusedBackward*> self = self_;
  hooks_.install(params, [self](size_t index, at::Tensor& param) {
    if (*self) (*self)->on_gradient(index, param);
  });
}

FusedBackward::~FusedBackward() { *self_ = nullptr; }

FusedBucketSizes fused_bucket_sizes(const std::vector<int64_t>& bytes, const std::vector<int>& roots,
                                    int64_t bucket_bytes) {
  if (bytes.size() != roots.size())
    fail("fused_bucket_sizes: {} gradient sizes for {} roots", bytes.size(), roots.size());
  const int64_t cap = root_bucket_bytes(roots, bucket_bytes);
  FusedBucketSizes out;
  std::map<int, int64_t> filling;
  std::deque<int64_t> in_flight;
  int64_t held = 0;  // filling + in flight
  auto send = [&](int root) {
    const int64_t size = filling[root];
    if (size == 0) return;
    out.largest = std::max(out.largest, size);
    out.peak = std::max(out.peak, held + size);  // the flat copy beside the gradients it packs
    filling[root] = 0;
    in_flight.push_back(size);  // the gradients go, the flat stays: held is unchanged
    while (in_flight.size() > 2) {
      held -= in_flight.front();
      in_flight.pop_front();
    }
  };
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (filling[roots[i]] > 0 && filling[roots[i]] + bytes[i] > cap) send(roots[i]);
    filling[roots[i]] += bytes[i];
    held += bytes[i];
    out.peak = std::max(out.peak, held);
  }
  for (const auto& [root, size] : filling) send(root);
  return out;
}

double FusedBackward::clip_scale_for(double norm) const {
  if (options_.max_grad_norm > 0 && std::isfinite(norm) && norm > options_.max_grad_norm) {
    return options_.max_grad_norm / (norm + 1e-6);  // same formula as the trainer's clipping
  }
  return 1.0;
}

void FusedBackward::begin_step(double lr, double grad_multiplier) {
  if (step_open_) fail("fused backward: begin_step called while step {} is still open (call end_step)", step_);
  step_open_ = true;
  step_ = optimizer_.step_count() + 1;
  micro_ = -1;
  lr_ = lr;
  multiplier_ = grad_multiplier;
  sumsq_ = measured_sumsq_ = 0;
  finite_ = true;
  skip_step_ = false;
  stepped_ = skipped_ = 0;
  pass_ = Pass::idle;
  scale_ = options_.clip_method == FusedClipMethod::previous_step_norm ? clip_scale_for(previous_norm_) : 1.0;
}

void FusedBackward::begin_micro_batch(int64_t micro) {
  if (!step_open_) fail("fused backward: begin_micro_batch({}) without begin_step", micro);
  if (micro != micro_ + 1 || micro >= options_.accumulation_steps) {
    fail("fused backward: micro-batch {} out of order (expected {} of 0..{})", micro, micro_ + 1,
         options_.accumulation_steps - 1);
  }
  if (every_micro_batch()) flush_buckets();  // the last micro-batch's sums
  micro_ = micro;
  std::fill(done_.begin(), done_.end(), 0);
  const bool last = micro == options_.accumulation_steps - 1;
  if (!last) {
    pass_ = Pass::accumulate;
  } else {
    pass_ = options_.clip_method == FusedClipMethod::two_pass ? Pass::measure : Pass::apply;
  }
}

bool FusedBackward::needs_second_pass() const { return step_open_ && pass_ == Pass::measure; }

bool FusedBackward::begin_second_pass() {
  if (!needs_second_pass()) fail("fused backward: begin_second_pass outside the measuring pass of two_pass clipping");
  torch::NoGradGuard no_grad;
  // Parameters that got no gradient in the last micro-batch but hold a
  // buffer: this rank's part of their sum (stages 0-2: reduced here; stage
  // 3: the receiver's buffer is the sum already).
  for (size_t i = 0; i < done_.size(); ++i) {
    GradientAccumulator* acc = accumulator_of_[i];
    if (done_[i] || !acc->has(i)) continue;
    if (options_.reduction && !every_micro_batch()) {
      reduce_and_apply(i, acc->get(i).to(torch::kFloat32, /*non_blocking=*/false, /*copy=*/true));
    } else {
      add_measured_norm(acc->get(i).to(torch::kFloat32));
    }
  }
  if (options_.reduction) {
    flush_buckets();
    // Every rank the same norm: the owners' parts summed (stage 0: every
    // rank measured every sum).
    if (options_.sum_over_ranks) sumsq_ = options_.sum_over_ranks(sumsq_);
  }
  measured_sumsq_ = sumsq_;
  sumsq_ = 0;
  const double norm = std::sqrt(measured_sumsq_);
  std::fill(done_.begin(), done_.end(), 0);
  if (!std::isfinite(norm)) {
    finite_ = false;
    skip_step_ = true;
    pass_ = Pass::idle;
    return false;
  }
  scale_ = clip_scale_for(norm);
  pass_ = Pass::apply;
  return true;
}

void FusedBackward::on_gradient(size_t index, at::Tensor& param) {
  if (!step_open_ || pass_ == Pass::idle) return;  // not ours: leave .grad alone
  at::Tensor grad = param.grad();
  if (!grad.defined()) return;
  torch::NoGradGuard no_grad;
  MemoryLedger::global().recharge(grad, MemoryCategory::gradients);
  param.mutable_grad().reset();
  GradientAccumulator* acc = accumulator_of_[index];
  const std::string& name = optimizer_.params()[index].name;
  switch (pass_) {
    case Pass::idle: return;
    case Pass::accumulate:
      if (every_micro_batch()) {
        reduce_and_apply(index, grad.to(torch::kFloat32), micro_);  // summed over the ranks into the receiver's buffer
        return;
      }
      acc->add(index, grad, (step_ - 1) * options_.accumulation_steps + micro_, /*may_alias=*/true);
      return;
    case Pass::measure: {
      if (done_[index]) {
        fail(
            "fused backward: parameter '{}' received its gradient twice in one backward (used in several "
            "checkpointed segments?); fused backward needs one gradient per parameter per backward",
            name);
      }
      done_[index] = 1;
      // Out of place: the buffer must stay as it is for the second pass.
      if (every_micro_batch()) {
        // Stage 3: the step gradient's sum reaches its receiver, which adds its buffer (finish_oldest_bucket).
        reduce_and_apply(index, grad.to(torch::kFloat32, /*non_blocking=*/false, /*copy=*/true));
        return;
      }
      at::Tensor total = acc->has(index) ? acc->get(index).to(torch::kFloat32) + grad
                                         : grad.to(torch::kFloat32, /*non_blocking=*/false, /*copy=*/true);
      if (options_.reduction) {
        reduce_and_apply(index, total);  // measured where the sum arrives
      } else {
        add_measured_norm(total);
      }
      return;
    }
    case Pass::apply: {
      if (done_[index]) {
        fail(
            "fused backward: parameter '{}' received its gradient twice in one backward (used in several "
            "checkpointed segments?); it was already stepped with a partial gradient",
            name);
      }
      done_[index] = 1;
      if (every_micro_batch()) {
        // The buffer (the earlier micro-batches' sums) is the receiver's, added on arrival.
        reduce_and_apply(index, grad.to(torch::kFloat32));
        return;
      }
      reduce_and_apply(index, acc->finish(index, grad));
      return;
    }
  }
}

void FusedBackward::reduce_and_apply(size_t index, at::Tensor grad_fp32, int64_t accumulate_micro) {
  if (!options_.reduction) {
    apply(index, grad_fp32);
    return;
  }
  const FusedReduction& r = *options_.reduction;
  const int root = r.root_of.at(index);
  const int64_t bytes = grad_fp32.numel() * static_cast<int64_t>(sizeof(float));
  {
    const Bucket& filling = filling_[root];
    if (!filling.grads.empty() && filling.bytes + bytes > root_bucket_bytes_) send_bucket(root);
  }
  Bucket& filling = filling_[root];
  filling.root = root;
  filling.measure = pass_ == Pass::measure;
  filling.micro = accumulate_micro;
  filling.bytes += bytes;
  filling.grads.emplace_back(index, grad_fp32);
}

void FusedBackward::send_bucket(int root) {
  const auto it = filling_.find(root);
  if (it == filling_.end()) return;
  Bucket b = std::move(it->second);
  filling_.erase(it);
  if (b.grads.empty()) return;
  {
    ScopedMemoryCategory category(MemoryCategory::gradients);
    std::vector<at::Tensor> flat_parts;
    for (const auto& [index, g] : b.grads) {
      flat_parts.push_back(g.reshape({-1}));
      b.params.push_back(index);
    }
    b.flat = at::cat(flat_parts);  // fp32 step gradients: contiguous fp32
  }
  b.grads.clear();  // the flat copy holds them now
  b.wait = options_.reduction->start(b.flat, b.root);
  in_flight_.push_back(std::move(b));
  while (in_flight_.size() > 2) finish_oldest_bucket();
}

void FusedBackward::finish_oldest_bucket() {
  Bucket b = std::move(in_flight_.front());
  in_flight_.pop_front();
  try {
    b.wait();
  } catch (...) {
    // A peer failed: the other buckets' collectives are dropped now, while
    // the group they wait on still exists (their waits end in errors too).
    in_flight_.clear();
    filling_.clear();
    throw;
  }
  if (b.root >= 0 && b.root != options_.reduction->rank) return;  // another rank's tensors
  int64_t offset = 0;
  for (size_t index : b.params) {
    const at::Tensor& p = optimizer_.params()[index].param;
    const int64_t n = p.numel();
    const at::Tensor sum = b.flat.narrow(0, offset, n).view(p.sizes());
    GradientAccumulator* acc = accumulator_of_[index];
    if (b.measure) {
      // two_pass's measuring pass: the norm of the step gradient, nothing
      // applied (stage 3: this micro-batch's sum + the receiver's buffer).
      add_measured_norm(every_micro_batch() && acc->has(index) ? acc->get(index).to(torch::kFloat32) + sum : sum);
    } else if (b.micro >= 0) {
      acc->add(index, sum, (step_ - 1) * options_.accumulation_steps + b.micro);  // copied
    } else if (acc->has(index)) {
      // every_micro_batch: the earlier micro-batches' sums + this one, in fp32
      // (otherwise finish() freed the buffer before packing)
      apply(index, acc->finish(index, sum));
    } else {
      apply(index, sum);
    }
    offset += n;
  }
}

void FusedBackward::add_measured_norm(const at::Tensor& grad_fp32) {
  const double n = grad_fp32.norm().item<double>() * std::abs(multiplier_);
  sumsq_ += n * n;
}

void FusedBackward::apply(size_t index, const at::Tensor& grad_fp32) {
  at::Tensor g = grad_fp32;
  const double n = g.norm().item<double>() * std::abs(multiplier_);
  if (!std::isfinite(n)) {
    // Non-finite: this parameter (and its state) stays unchanged; others may
    // already have been stepped and cannot be undone. Reported via finite.
    finite_ = false;
    ++skipped_;
    sumsq_ += n * n;
    return;
  }
  if (options_.clip_method == FusedClipMethod::previous_step_norm) sumsq_ += n * n;
  const double factor = multiplier_ * scale_;
  if (factor != 1.0) g.mul_(factor);  // g is this step's own gradient (freed .grad or buffer)
  optimizer_.apply_update(index, g, lr_, step_);
  ++stepped_;
}

void FusedBackward::flush_buckets() {
  // Root by root in order: the same collectives in the same order on every rank.
  while (!filling_.empty()) send_bucket(filling_.begin()->first);
  while (!in_flight_.empty()) finish_oldest_bucket();
}

FusedStepResult FusedBackward::end_step() {
  if (!step_open_) fail("fused backward: end_step without begin_step");
  if (micro_ != options_.accumulation_steps - 1) {
    fail("fused backward: end_step after micro-batch {} of {}", micro_ + 1, options_.accumulation_steps);
  }
  if (pass_ == Pass::measure) fail("fused backward: end_step before the second pass of two_pass clipping");
  torch::NoGradGuard no_grad;
  if (every_micro_batch()) flush_buckets();  // every sum has arrived: the buffers left are complete
  if (!skip_step_) {
    // Buffers whose parameter got no gradient in the last micro-batch
    // (every_micro_batch: on their receiver, already summed over the ranks).
    for (size_t i = 0; i < done_.size(); ++i) {
      GradientAccumulator* acc = accumulator_of_[i];
      if (!acc->has(i)) continue;
      if (every_micro_batch()) {
        apply(i, acc->finish(i, at::Tensor()));
      } else {
        reduce_and_apply(i, acc->finish(i, at::Tensor()));
      }
    }
  }
  if (options_.reduction) flush_buckets();
  for (auto& acc : accumulators_) acc->reset();
  if (options_.sum_over_ranks) {
    sumsq_ = options_.sum_over_ranks(sumsq_);
    stepped_ = static_cast<int64_t>(options_.sum_over_ranks(static_cast<double>(stepped_)));
  }
  FusedStepResult r;
  r.step = step_;
  // two_pass: the norm measured before the updates (summed over the ranks
  // there); the apply pass adds only non-finite parameters' (inf / NaN).
  r.grad_norm =
      options_.clip_method == FusedClipMethod::two_pass ? std::sqrt(measured_sumsq_ + sumsq_) : std::sqrt(sumsq_);
  r.clip_scale = scale_;
  r.finite = finite_ && std::isfinite(r.grad_norm);
  r.params_stepped = stepped_;
  r.params_skipped_nonfinite = skipped_;
  if (skip_step_) {
    r.params_skipped_nonfinite = static_cast<int64_t>(done_.size());
  }
  if (stepped_ > 0) optimizer_.set_step_count(step_);
  if (r.finite) previous_norm_ = r.grad_norm;
  step_open_ = false;
  pass_ = Pass::idle;
  return r;
}

int64_t FusedBackward::buffer_bytes() const {
  int64_t bytes = 0;
  for (const auto& acc : accumulators_) bytes += acc->buffer_bytes();
  return bytes;
}

}  // namespace shoestring
