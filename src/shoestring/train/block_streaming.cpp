#include "shoestring/train/block_streaming.h"

#include <algorithm>
#include <unordered_set>

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include "shoestring/core/memory_ledger.h"

namespace shoestring {

std::vector<std::pair<const torch::nn::Module*, std::vector<size_t>>> checkpointed_block_groups(
    const std::vector<nn::BlockTable*>& tables, const std::vector<at::Tensor>& params) {
  std::unordered_map<const c10::TensorImpl*, size_t> index;
  for (size_t i = 0; i < params.size(); ++i) index.emplace(params[i].unsafeGetTensorImpl(), i);
  using Candidate = std::pair<const torch::nn::Module*, std::vector<size_t>>;
  std::vector<Candidate> candidates;
  for (nn::BlockTable* table : tables) {
    if (!table) continue;
    for (const torch::nn::Module* block : table->checkpointed_blocks()) {
      Candidate c{block, {}};
      for (const at::Tensor& p : block->parameters(/*recurse=*/true)) {
        const auto it = index.find(p.unsafeGetTensorImpl());
        if (it != index.end()) c.second.push_back(it->second);
      }
      std::sort(c.second.begin(), c.second.end());
      c.second.erase(std::unique(c.second.begin(), c.second.end()), c.second.end());
      if (!c.second.empty()) candidates.push_back(std::move(c));
    }
  }
  // Outer blocks first (more parameters), so a nested block's parameters go
  // to the outer group; then by first parameter, the same on every rank.
  std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    if (a.second.size() != b.second.size()) return a.second.size() > b.second.size();
    return a.second.front() < b.second.front();
  });
  std::vector<bool> taken(params.size(), false);
  std::vector<Candidate> groups;
  for (Candidate& c : candidates) {
    bool free = true;
    for (size_t i : c.second) free = free && !taken[i];
    if (!free) continue;  // nested inside a streamed block (or overlapping one): streams with it
    for (size_t i : c.second) taken[i] = true;
    groups.push_back(std::move(c));
  }
  std::sort(groups.begin(), groups.end(),
            [](const Candidate& a, const Candidate& b) { return a.second.front() < b.second.front(); });
  return groups;
}

std::shared_ptr<ZeroBlockStreaming> ZeroBlockStreaming::attach(
    dist::ZeroSharding& zero, const std::vector<nn::BlockTable*>& tables,
    const std::vector<std::pair<std::string, at::Tensor>>& trainable) {
  std::shared_ptr<ZeroBlockStreaming> self(new ZeroBlockStreaming(zero));
  std::vector<at::Tensor> params;
  for (const auto& [name, p] : trainable) params.push_back(p);
  for (const auto& [block, group] : checkpointed_block_groups(tables, params))
    self->group_of_.emplace(block, zero.add_streamed_group(group));
  for (nn::BlockTable* table : tables) {
    if (table) table->streaming = self;
  }
  return self;
}

std::shared_ptr<HostBlockStreaming> HostBlockStreaming::attach(
    const std::vector<nn::BlockTable*>& tables, const torch::nn::Module& module,
    const std::vector<std::pair<std::string, at::Tensor>>& trainable, c10::Device device) {
  std::shared_ptr<HostBlockStreaming> self(new HostBlockStreaming(device));
  std::unordered_set<const c10::TensorImpl*> trains;
  for (const auto& [name, p] : trainable) trains.insert(p.unsafeGetTensorImpl());
  const std::vector<at::Tensor> all = module.parameters(/*recurse=*/true);
  std::vector<int> slot(all.size(), -1);  // index into params_
  for (const auto& [block, group] : checkpointed_block_groups(tables, all)) {
    Group g;
    for (size_t i : group) {
      slot[i] = static_cast<int>(self->params_.size());
      g.params.push_back(self->params_.size());
      self->params_.push_back(all[i]);
      self->trainable_.push_back(trains.count(all[i].unsafeGetTensorImpl()) != 0);
    }
    self->group_of_.emplace(block, self->groups_.size());
    self->groups_.push_back(std::move(g));
  }
  self->host_.resize(self->params_.size());
  self->host_grad_.resize(self->params_.size());
  for (nn::BlockTable* table : tables) {
    if (table) table->streaming = self;
  }
  return self;
}

void HostBlockStreaming::empty(size_t i) {
  at::Tensor p = params_[i];
  p.set_data(at::empty({0}, p.options().device(device_)));
}

void HostBlockStreaming::start() {
  if (started_) return;
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor p = params_[i].detach();
    {
      ScopedMemoryCategory category(MemoryCategory::host_offload);
      host_[i] = at::empty(p.sizes(), p.options().device(at::kCPU).pinned_memory(device_.is_cuda()));
    }
    host_[i].copy_(p);
    empty(i);
  }
  started_ = true;
}

void HostBlockStreaming::fetch(const torch::nn::Module* block) {
  Group& g = groups_.at(group_of_.at(block));
  if (!started_ || stepping_ || (held_ && device_.is_cpu())) return;
  if (g.fetched++ > 0) return;
  at::NoGradGuard no_grad;
  ScopedMemoryCategory category(MemoryCategory::weights);
  for (size_t i : g.params) {
    // A copy on the CPU too: what a device copy costs, charged as device memory.
    params_[i].set_data(host_[i].to(device_, /*non_blocking=*/device_.is_cuda(), /*copy=*/true));
  }
}

void HostBlockStreaming::release(const torch::nn::Module* block, bool gradients_complete) {
  Group& g = groups_.at(group_of_.at(block));
  if (!started_ || stepping_ || (held_ && device_.is_cpu())) return;
  if (gradients_complete) {
    at::NoGradGuard no_grad;
    for (size_t i : g.params) {
      at::Tensor p = params_[i];
      if (!trainable_[i] || !p.grad().defined()) continue;
      const at::Tensor grad = p.grad();
      if (host_grad_[i].defined()) {
        host_grad_[i].add_(grad.to(at::kCPU));  // as autograd sums .grad over micro-batches
      } else {
        ScopedMemoryCategory category(MemoryCategory::host_offload);
        host_grad_[i] = at::empty(grad.sizes(), grad.options().device(at::kCPU).pinned_memory(device_.is_cuda()));
        host_grad_[i].copy_(grad);
      }
      p.mutable_grad().reset();
    }
  }
  if (g.fetched > 0 && --g.fetched > 0) return;
  for (size_t i : g.params) {
    if (held_) {
      params_[i].set_data(host_[i]);
    } else {
      empty(i);
    }
  }
}

int64_t HostBlockStreaming::streamed_elements() const {
  int64_t n = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (trainable_[i]) n += started_ ? host_[i].numel() : params_[i].numel();
  }
  return n;
}

int64_t HostBlockStreaming::streamed_bytes() const {
  int64_t n = 0;
  for (size_t i = 0; i < params_.size(); ++i)
    n += started_ ? host_[i].nbytes() : params_[i].numel() * params_[i].element_size();
  return n;
}

bool HostBlockStreaming::streams_parameter(const at::Tensor& param) const {
  return std::any_of(params_.begin(), params_.end(),
                     [&](const at::Tensor& p) { return p.unsafeGetTensorImpl() == param.unsafeGetTensorImpl(); });
}

void HostBlockStreaming::before_step() {
  if (!started_ || stepping_) return;
  stepping_ = true;
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor p = params_[i];
    p.set_data(host_[i]);  // the optimizer and EMA update the host copy in place
    if (trainable_[i] && host_grad_[i].defined()) {
      p.mutable_grad() = host_grad_[i];
      host_grad_[i] = at::Tensor();
    }
  }
}

void HostBlockStreaming::after_step() {
  if (!stepping_) return;
  stepping_ = false;
  for (size_t i = 0; i < params_.size(); ++i) {
    at::Tensor p = params_[i];
    if (p.grad().defined()) p.mutable_grad().reset();  // the gradient path frees them; never keep a host one
    if (!held_) empty(i);
  }
}

void HostBlockStreaming::hold_all() {
  if (!started_ || held_) return;
  held_ = true;
  for (size_t i = 0; i < params_.size(); ++i) params_[i].set_data(host_[i]);
}

void HostBlockStreaming::release_held() {
  if (!held_) return;
  held_ = false;
  for (size_t i = 0; i < params_.size(); ++i) empty(i);
}

}  // namespace shoestring
