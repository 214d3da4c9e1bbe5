#include "shoestring/train/ema.h"

#include <algorithm>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"

namespace shoestring {

EMA::EMA(const std::vector<std::pair<std::string, at::Tensor>>& params, double decay, std::vector<bool> owned)
    : decay_(decay) {
  if (decay < 0 || decay >= 1) fail("ema_decay must be in [0, 1) (got {})", decay);
  if (!owned.empty() && owned.size() != params.size()) {
    fail("EMA: the ownership mask has {} entries for {} parameters", owned.size(), params.size());
  }
  torch::NoGradGuard no_grad;
  ScopedMemoryCategory category(MemoryCategory::optimizer_state);
  for (size_t i = 0; i < params.size(); ++i) {
    if (!owned.empty() && !owned[i]) continue;
    params_.push_back(params[i]);
    shadow_.push_back(params[i].second.detach().to(torch::kFloat32).clone());
  }
}

double EMA::decay_at(int64_t step) const {
  if (step < 1) fail("EMA step must be >= 1 (got {})", step);
  const double k = static_cast<double>(step - 1);
  return step == 1 ? 0.0 : std::min(decay_, (1 + k) / (10 + k));
}

void EMA::update(int64_t step) {
  const double d = decay_at(step);
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i].second;
    // A weight and its shadow on different devices (offload_params keeps a
    // streamed weight's shadow in host memory; the weight is its host copy
    // while the optimizer steps, so they meet there): averaged where the shadow is.
    shadow_[i].mul_(d).add_(p.to(shadow_[i].device(), torch::kFloat32), 1.0 - d);
  }
}

void EMA::move_shadows_to_host(const std::function<bool(const at::Tensor& param)>& in_host_memory) {
  torch::NoGradGuard no_grad;
  ScopedMemoryCategory category(MemoryCategory::host_offload);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!in_host_memory(params_[i].second)) continue;
    // A copy on a CPU run too (as HostBlockStreaming's), so that the ledger
    // shows the device / host split a GPU would see; the bits are the same.
    const bool pinned = shadow_[i].is_cuda();
    at::Tensor host = at::empty(shadow_[i].sizes(), shadow_[i].options().device(at::kCPU).pinned_memory(pinned));
    host.copy_(shadow_[i]);
    shadow_[i] = host;
  }
}

std::vector<at::Tensor> EMA::swap_in() {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> saved;
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor p = params_[i].second;
    saved.push_back(p.detach().clone());
    p.copy_(shadow_[i]);
  }
  return saved;
}

void EMA::restore(const std::vector<at::Tensor>& saved) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor p = params_[i].second;
    p.copy_(saved[i]);
  }
}

std::vector<std::pair<std::string, at::Tensor>> EMA::tensors() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t i = 0; i < params_.size(); ++i) out.emplace_back(params_[i].first, shadow_[i]);
  return out;
}

void EMA::load(const std::map<std::string, at::Tensor>& tensors) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    auto it = tensors.find(params_[i].first);
    if (it == tensors.end()) fail("EMA state: tensor '{}' is missing", params_[i].first);
    if (it->second.sizes() != shadow_[i].sizes()) {
      fail("EMA state: tensor '{}' has shape {} but the model expects {}", params_[i].first,
           fmt::join(it->second.sizes(), "x"), fmt::join(shadow_[i].sizes(), "x"));
    }
    shadow_[i].copy_(it->second);
  }
}

}  // namespace shoestring
