#include "shoestring/precision/master_weights.h"

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/units.h"

namespace shoestring::precision {

MasterWeights::MasterWeights(std::vector<std::pair<std::string, at::Tensor>> trainable,
                             const std::vector<bool>& use_master)
    : model_(std::move(trainable)) {
  if (use_master.size() != model_.size()) {
    fail("MasterWeights: {} parameters but {} master flags", model_.size(), use_master.size());
  }
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < model_.size(); ++i) {
    const auto& [name, p] = model_[i];
    const bool master = use_master[i] && p.scalar_type() != at::kFloat;
    has_master_.push_back(master);
    if (master) {
      at::Tensor m = p.detach().to(at::kFloat, false, /*copy=*/true);
      targets_.emplace_back(name, m);
    } else {
      targets_.emplace_back(name, p);
    }
  }
}

int64_t MasterWeights::master_count() const {
  int64_t n = 0;
  for (bool b : has_master_) n += b;
  return n;
}

int64_t MasterWeights::master_bytes() const {
  int64_t n = 0;
  for (size_t i = 0; i < targets_.size(); ++i) {
    if (has_master_[i]) n += targets_[i].second.numel() * 4;
  }
  return n;
}

bool MasterWeights::collect_grads(const LossScaler& scaler) {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  grads.reserve(model_.size());
  for (auto& [name, p] : model_) grads.push_back(p.grad());
  const bool found_inf = scaler.unscale(grads);
  for (size_t i = 0; i < model_.size(); ++i) {
    at::Tensor& model_grad = model_[i].second.mutable_grad();
    if (!grads[i].defined()) continue;
    if (has_master_[i]) {
      targets_[i].second.mutable_grad() = grads[i];
      model_grad.reset();
    } else {
      model_grad = grads[i];  // fp32, unscaled
    }
  }
  return found_inf;
}

void MasterWeights::write_back() {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < model_.size(); ++i) {
    if (has_master_[i]) model_[i].second.copy_(targets_[i].second);
  }
}

void MasterWeights::zero_grads() {
  for (size_t i = 0; i < model_.size(); ++i) {
    model_[i].second.mutable_grad().reset();
    if (has_master_[i]) targets_[i].second.mutable_grad().reset();
  }
}

std::vector<std::pair<std::string, at::Tensor>> MasterWeights::state_tensors() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t i = 0; i < targets_.size(); ++i) {
    if (has_master_[i]) out.emplace_back(targets_[i].first, targets_[i].second);
  }
  return out;
}

void MasterWeights::load_state_tensors(const std::map<std::string, at::Tensor>& tensors) {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < targets_.size(); ++i) {
    if (!has_master_[i]) continue;
    const auto& [name, m] = targets_[i];
    auto it = tensors.find(name);
    if (it == tensors.end()) fail("training state: fp32 master weight '{}' is missing", name);
    if (it->second.sizes() != m.sizes()) {
      fail("training state: fp32 master weight '{}' has shape {}, expected {}", name, format_shape(it->second.sizes()),
           format_shape(m.sizes()));
    }
    targets_[i].second.copy_(it->second);
  }
  write_back();
}

}  // namespace shoestring::precision
