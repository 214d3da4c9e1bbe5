#include "shoestring/dist/zero.h"

#include <algorithm>
#include <map>

#include <ATen/core/grad_mode.h>
#include <fmt/format.h>

#include "shoestring/core/error.h"

namespace shoestring::dist {

TensorOwnership::TensorOwnership(const std::vector<int64_t>& numels, int world) {
  if (world < 1) fail("TensorOwnership: world size {}, expected >= 1", world);
  elements_.assign(static_cast<size_t>(world), 0);
  owner_.reserve(numels.size());
  for (size_t i = 0; i < numels.size(); ++i) {
    if (numels[i] < 0) fail("TensorOwnership: tensor {} has {} elements", i, numels[i]);
    // min_element returns the first (lowest) rank among equals.
    const auto least = std::min_element(elements_.begin(), elements_.end());
    owner_.push_back(static_cast<int>(least - elements_.begin()));
    *least += numels[i];
  }
}

std::vector<bool> TensorOwnership::owned_by(int rank) const {
  std::vector<bool> out(owner_.size());
  for (size_t i = 0; i < owner_.size(); ++i) out[i] = owner_[i] == rank;
  return out;
}

namespace {

std::vector<int64_t> numels_of(const NamedTensors& params) {
  std::vector<int64_t> out;
  for (const auto& [n, p] : params) out.push_back(p.numel());
  return out;
}

std::vector<at::Tensor> tensors_of(const NamedTensors& params) {
  std::vector<at::Tensor> out;
  for (const auto& [n, p] : params) out.push_back(p);
  return out;
}

}  // namespace

ZeroSharding::ZeroSharding(ProcessGroup& group, NamedTensors params, int stage, int64_t bucket_bytes)
    : group_(group), params_(std::move(params)), stage_(stage), ownership_(numels_of(params_), group.size()) {
  if (stage != 1 && stage != 2) fail("ZeroSharding: zero_stage = {}, expected 1 or 2", stage);
  if (bucket_bytes < 1) fail("ZeroSharding: bucket size {} bytes, expected >= 1", bucket_bytes);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!index_of_.emplace(params_[i].first, i).second)
      fail("ZeroSharding: two parameters named '{}'", params_[i].first);
  }
  if (stage_ == 1) averager_ = std::make_unique<GradientAverager>(group_, tensors_of(params_), bucket_bytes);
  if (stage_ == 2) {
    for (Bucket& b : make_buckets(/*by_dtype=*/false, bucket_bytes))
      gradient_buckets_.push_back({std::move(b.params), b.numel, b.owner});
  }
  weight_buckets_ = make_buckets(/*by_dtype=*/true, bucket_bytes);
}

std::vector<ZeroSharding::Bucket> ZeroSharding::make_buckets(bool by_dtype, int64_t cap_bytes) const {
  // Per (owner, dtype) the bucket that is filling, in parameter order.
  std::vector<Bucket> done;
  std::map<std::pair<int, int>, Bucket> filling;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i].second;
    const int owner = ownership_.owner(i);
    const at::ScalarType dtype = by_dtype ? p.scalar_type() : at::kFloat;
    const int64_t cap = std::max<int64_t>(1, cap_bytes / static_cast<int64_t>(c10::elementSize(dtype)));
    Bucket& b = filling[{owner, static_cast<int>(dtype)}];
    if (b.numel > 0 && b.numel + p.numel() > cap) {
      done.push_back(std::move(b));
      b = Bucket{};
    }
    b.owner = owner;
    b.dtype = dtype;
    b.params.push_back(i);
    b.numel += p.numel();
  }
  for (auto& [key, b] : filling) {
    if (!b.params.empty()) done.push_back(std::move(b));
  }
  // Every rank issues the collectives in this same order.
  std::stable_sort(done.begin(), done.end(),
                   [](const Bucket& x, const Bucket& y) { return x.params.front() < y.params.front(); });
  return done;
}

void ZeroSharding::reduce_gradients() {
  if (group_.size() == 1) return;
  if (stage_ == 1) {
    averager_->all_reduce_gradients();
    return;
  }
  reduce_to_owners();
}

void ZeroSharding::reduce_to_owners() {
  reduce_gradient_buckets(group_, tensors_of(params_), gradient_buckets_,
                          [this](const at::Tensor& flat, const GradientBucket& bucket) {
                            return group_.reduce_sum_async(flat, bucket.root);
                          });
}

double ZeroSharding::sum_over_ranks(double value) { return group_.size() == 1 ? value : group_.all_reduce_sum(value); }

void ZeroSharding::broadcast_updated_parameters() {
  if (group_.size() == 1) return;
  at::NoGradGuard no_grad;
  const int rank = group_.rank();
  for (const Bucket& bucket : weight_buckets_) {
    at::Tensor flat = at::empty({bucket.numel}, params_.front().second.options().dtype(bucket.dtype));
    int64_t offset = 0;
    if (bucket.owner == rank) {
      for (size_t i : bucket.params) {
        const at::Tensor& p = params_[i].second;
        flat.narrow(0, offset, p.numel()).copy_(p.detach().reshape({p.numel()}));
        offset += p.numel();
      }
    }
    group_.broadcast(flat, bucket.owner);
    if (bucket.owner == rank) continue;
    offset = 0;
    for (size_t i : bucket.params) {
      at::Tensor p = params_[i].second.detach();
      p.copy_(flat.narrow(0, offset, p.numel()).view(p.sizes()));
      offset += p.numel();
    }
  }
}

std::optional<size_t> ZeroSharding::parameter_of_state(const std::string& key) const {
  const size_t dot = key.rfind('.');
  if (dot == std::string::npos) return std::nullopt;
  const auto it = index_of_.find(key.substr(0, dot));
  if (it == index_of_.end()) return std::nullopt;
  return it->second;
}

}  // namespace shoestring::dist
