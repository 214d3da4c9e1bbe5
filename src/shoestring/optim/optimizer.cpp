#include "shoestring/optim/optimizer.h"

#include <atomic>
#include <sstream>

#include <torch/cuda.h>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/core/stochastic_rounding.h"
#include "shoestring/optim/fused_kernels.h"
#include "shoestring/optim/optimizer_args.h"

namespace shoestring {

namespace {
std::atomic<bool> g_force_generic{false};
}  // namespace

void force_device_generic_optimizers(bool generic) { g_force_generic.store(generic, std::memory_order_relaxed); }

bool fast_cpu_path(const at::Tensor& t) {
  return t.device().is_cpu() && !g_force_generic.load(std::memory_order_relaxed);
}

Optimizer::Optimizer(std::vector<OptimParam> params, OptimizerOptions options)
    : params_(std::move(params)), options_(options), state_(params_.size()) {}

void Optimizer::step(double lr, double grad_scale) {
  torch::NoGradGuard no_grad;
  ++step_count_;
  std::vector<size_t> indices;
  indices.reserve(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    if (updates(i) && params_[i].param.grad().defined()) indices.push_back(i);
  }
  if (options_.offload_state) {
    for (size_t i : indices) apply_update(i, scaled_grad(i, grad_scale), lr, step_count_);
    return;
  }
  update_many(indices, lr, step_count_, grad_scale);
}

at::Tensor Optimizer::scaled_grad(size_t index, double grad_scale) const {
  const at::Tensor& g = params_[index].param.grad();
  return grad_scale != 1.0 ? g.to(torch::kFloat32).mul_(grad_scale) : g;
}

void Optimizer::update_many(const std::vector<size_t>& indices, double lr, int64_t step, double grad_scale) {
  for (size_t i : indices) update(i, scaled_grad(i, grad_scale), lr, step);
}

void Optimizer::set_update_subset(std::vector<bool> updated) {
  if (updated.size() != params_.size())
    fail("Optimizer::set_update_subset: {} entries for {} parameters", updated.size(), params_.size());
  updated_ = std::move(updated);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!updated_[i]) state_[i].clear();
  }
}

void Optimizer::apply_update(size_t index, const at::Tensor& grad, double lr, int64_t step) {
  if (!options_.offload_state) {
    update(index, grad, lr, step);
    return;
  }
  torch::NoGradGuard no_grad;
  const at::Device device = params_[index].param.device();
  auto& slots = state_[index];
  // Stage in: a device copy of every host state tensor (on a CPU-only run a
  // clone, so host and device bytes are counted apart as they would be).
  {
    ScopedMemoryCategory category(MemoryCategory::optimizer_state);
    for (auto& [name, t] : slots) {
      if (t.defined()) t = t.to(device, t.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
    }
  }
  update(index, grad, lr, step);
  // Stage out: host copies (pinned for fast transfers when CUDA is present);
  // the device copies are freed when `t` is replaced.
  const bool pinned = torch::cuda::is_available();
  ScopedMemoryCategory category(MemoryCategory::host_offload);
  for (auto& [name, t] : slots) {
    if (!t.defined()) continue;
    at::Tensor host = torch::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(pinned));
    host.copy_(t);
    t = host;
  }
}

void Optimizer::write_param(size_t index, const at::Tensor& value, int64_t step) {
  at::Tensor& p = params_[index].param;
  if (p.scalar_type() == torch::kFloat32) {
    if (!value.is_same(p)) p.copy_(value);
    return;
  }
  if (options_.stochastic_rounding && (p.scalar_type() == torch::kBFloat16 || p.scalar_type() == torch::kFloat16)) {
    RoundingKey key = rounding_key(index, step);
    at::Tensor src = value.contiguous();
    if (p.is_contiguous()) {
      stochastic_round_into(src, p, key);
    } else {
      p.copy_(stochastic_round(src, p.scalar_type(), key));
    }
    return;
  }
  p.copy_(value);  // round-to-nearest
}

void Optimizer::write_state(size_t index, at::Tensor& dst, const at::Tensor& value, int64_t step, int slot) {
  if (dst.scalar_type() == torch::kFloat32) {
    if (!value.is_same(dst)) dst.copy_(value);
    return;
  }
  RoundingKey key = rounding_key(index, step, slot);
  stochastic_round_into(value.contiguous(), dst, key);
}

at::Tensor& Optimizer::state(size_t index, const std::string& name) { return state_[index][name]; }

void Optimizer::check_gradient(size_t index, const at::Tensor& grad, const char* optimizer) const {
  const at::Tensor& live = params_[index].param;
  if (grad.numel() != live.numel())
    fail("{}: gradient of '{}' has {} elements, expected {}", optimizer, params_[index].name, grad.numel(),
         live.numel());
}

void Optimizer::create_zero_state(size_t index, std::initializer_list<const char*> names) {
  if (names.size() == 0 || has_state(index, *names.begin())) return;
  ScopedMemoryCategory category(MemoryCategory::optimizer_state);
  const at::Tensor& live = params_[index].param;
  const auto opts = live.options().dtype(options_.state_dtype).requires_grad(false);
  for (const char* name : names) state(index, name) = torch::zeros(live.sizes(), opts);
}

bool Optimizer::has_state(size_t index, const std::string& name) const {
  auto it = state_[index].find(name);
  return it != state_[index].end() && it->second.defined();
}

std::vector<std::pair<std::string, at::Tensor>> Optimizer::state_tensors() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    for (const auto& [name, t] : state_[i]) {
      if (t.defined()) out.emplace_back(params_[i].name + "." + name, t);
    }
  }
  return out;
}

void Optimizer::load_state_tensors(const std::map<std::string, at::Tensor>& tensors) {
  torch::NoGradGuard no_grad;
  ScopedMemoryCategory category(options_.offload_state ? MemoryCategory::host_offload
                                                       : MemoryCategory::optimizer_state);
  std::map<std::string, std::pair<size_t, std::string>> expected;
  for (size_t i = 0; i < params_.size(); ++i) state_[i].clear();
  for (const auto& [key, t] : tensors) {
    // Keys are "<param name>.<state name>"; parameter names contain dots, so
    // match against the known parameter names rather than splitting.
    bool found = false;
    for (size_t i = 0; i < params_.size() && !found; ++i) {
      const std::string& pn = params_[i].name;
      if (key.size() > pn.size() + 1 && key.compare(0, pn.size(), pn) == 0 && key[pn.size()] == '.') {
        std::string sname = key.substr(pn.size() + 1);
        if (sname.find('.') != std::string::npos) continue;  // belongs to a longer parameter name
        found = true;
        if (!updates(i)) continue;  // another rank's tensor (set_update_subset)
        // On the parameter's device (a run resumed onto a GPU), or in host
        // memory when state is offloaded (apply_update streams it).
        const at::Device device = options_.offload_state ? at::Device(at::kCPU) : params_[i].param.device();
        state_[i][sname] = t.to(device, t.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
      }
    }
    if (!found) fail("optimizer state: tensor '{}' matches no trainable parameter", key);
  }
}

int64_t state_element_bytes(at::ScalarType state_dtype) { return c10::elementSize(state_dtype); }

OptimizerStateSize AdamW::state_size(at::IntArrayRef shape, const OptimizerOptions& options) {
  return {2 * c10::multiply_integers(shape) * state_element_bytes(options.state_dtype), 0};
}

int64_t Optimizer::state_bytes() const {
  int64_t bytes = 0;
  for (const auto& m : state_) {
    for (const auto& [name, t] : m) {
      if (t.defined()) bytes += t.numel() * t.element_size();
    }
  }
  return bytes;
}

AdamW::AdamW(std::vector<OptimParam> params, AdamWOptions adam, OptimizerOptions options)
    : Optimizer(std::move(params), options), adam_(adam) {}

std::optional<FusedAdamWTensor> AdamW::fused_task(size_t index, const at::Tensor& grad, double lr, int64_t step,
                                                  double grad_scale) {
  const at::Tensor& live = params_[index].param;
  create_zero_state(index, {"exp_avg", "exp_avg_sq"});
  const at::Tensor& m = state(index, "exp_avg");
  const at::Tensor& v = state(index, "exp_avg_sq");
  if (!fast_cpu_path(live) || !fused_adamw_supported(live, grad, m, v)) return std::nullopt;
  FusedAdamWTensor t{live, grad, m, v, {}, {}};
  t.scalars.lr = lr;
  t.scalars.beta1 = adam_.beta1;
  t.scalars.beta2 = adam_.beta2;
  t.scalars.eps = adam_.eps;
  t.scalars.weight_decay = params_[index].weight_decay;
  t.scalars.step = step;
  t.scalars.grad_scale = grad_scale;
  t.keys.stochastic_rounding = options_.stochastic_rounding;
  t.keys.param = rounding_key(index, step);
  t.keys.state1 = rounding_key(index, step, 1);
  t.keys.state2 = rounding_key(index, step, 2);
  return t;
}

void AdamW::update_many(const std::vector<size_t>& indices, double lr, int64_t step, double grad_scale) {
  update_many_fused<FusedAdamWTensor>(
      indices, lr, step, grad_scale,
      [this](size_t i, const at::Tensor& g, double l, int64_t s, double gs) { return fused_task(i, g, l, s, gs); },
      fused_adamw_step_many);
}

void AdamW::update(size_t index, const at::Tensor& grad_in, double lr, int64_t step) {
  // Fast path: one pass over memory (optim/fused_kernels.h), same numbers as
  // the op chain below, which remains the reference and the path for other
  // layouts and dtypes (fp16, non-contiguous, non-CPU).
  if (auto t = fused_task(index, grad_in, lr, step, 1.0)) {
    fused_adamw_step_many({std::move(*t)});
    return;
  }
  at::Tensor& live = params_[index].param;
  const double wd = params_[index].weight_decay;
  at::Tensor& m_stored = state(index, "exp_avg");
  at::Tensor& v_stored = state(index, "exp_avg_sq");
  // fp32 tensors are updated in place; low-precision ones through fp32 copies
  // that are stochastically rounded back (one parameter's worth at a time).
  auto fp32 = [](const at::Tensor& t) { return t.scalar_type() == torch::kFloat32 ? t : t.to(torch::kFloat32); };
  at::Tensor grad = fp32(grad_in);
  at::Tensor p = fp32(live);
  at::Tensor m = fp32(m_stored);
  at::Tensor v = fp32(v_stored);

  // Same operation order as torch.optim.AdamW (_single_tensor_adamw, 1.13).
  p.mul_(1.0 - lr * wd);
  m.mul_(adam_.beta1).add_(grad, 1.0 - adam_.beta1);
  v.mul_(adam_.beta2).addcmul_(grad, grad, 1.0 - adam_.beta2);
  const double bias_correction1 = 1.0 - std::pow(adam_.beta1, static_cast<double>(step));
  const double bias_correction2 = 1.0 - std::pow(adam_.beta2, static_cast<double>(step));
  const double step_size = lr / bias_correction1;
  at::Tensor denom = (v.sqrt() / std::sqrt(bias_correction2)).add_(adam_.eps);
  p.addcdiv_(m, denom, -step_size);
  write_state(index, m_stored, m, step, 1);
  write_state(index, v_stored, v, step, 2);
  write_param(index, p, step);
}

AdamWOptions parse_adamw_args(const std::vector<std::string>& args) {
  OptimizerArgs a(args, "AdamW", {"weight_decay", "betas", "eps"});
  AdamWOptions o;
  o.weight_decay = a.get_double("weight_decay", o.weight_decay);
  o.eps = a.get_double("eps", o.eps);
  std::tie(o.beta1, o.beta2) = a.get_pair("betas", {o.beta1, o.beta2});
  if (o.beta1 < 0 || o.beta1 >= 1 || o.beta2 < 0 || o.beta2 >= 1) {
    fail("optimizer_args: betas must be in [0, 1) (got {},{})", o.beta1, o.beta2);
  }
  if (o.eps <= 0) fail("optimizer_args: eps must be > 0 (got {})", o.eps);
  if (o.weight_decay < 0) fail("optimizer_args: weight_decay must be >= 0 (got {})", o.weight_decay);
  return o;
}

bool default_no_decay(const std::string& name, const at::Tensor& param) { return param.dim() < 2; }

}  // namespace shoestring
