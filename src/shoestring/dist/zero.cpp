#include "shoestring/dist/zero.h"

#include <algorithm>
#include <deque>
#include <map>
#include <sstream>

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

/// "key\tdtype\td0,d1,...\n" per tensor: what receivers allocate.
std::string describe_tensors(const NamedTensors& tensors) {
  std::string out;
  for (const auto& [key, t] : tensors) {
    std::vector<std::string> dims;
    for (int64_t d : t.sizes()) dims.push_back(std::to_string(d));
    out += fmt::format("{}\t{}\t{}\n", key, static_cast<int>(t.scalar_type()), fmt::join(dims, ","));
  }
  return out;
}

struct TensorDescription {
  std::string key;
  at::ScalarType dtype;
  std::vector<int64_t> shape;
};

std::vector<TensorDescription> parse_descriptions(const std::string& text) {
  std::vector<TensorDescription> out;
  std::istringstream lines(text);
  std::string line;
  while (std::getline(lines, line)) {
    const size_t a = line.find('\t');
    const size_t b = line.find('\t', a + 1);
    TensorDescription d;
    d.key = line.substr(0, a);
    d.dtype = static_cast<at::ScalarType>(std::stoi(line.substr(a + 1, b - a - 1)));
    std::istringstream dims(line.substr(b + 1));
    std::string dim;
    while (std::getline(dims, dim, ',')) d.shape.push_back(std::stoll(dim));
    out.push_back(std::move(d));
  }
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
  if (stage_ == 2) gradient_buckets_ = make_buckets(/*by_dtype=*/false, bucket_bytes);
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
  const double inverse = 1.0 / group_.size();
  const int rank = group_.rank();
  struct InFlight {
    const Bucket* bucket;
    at::Tensor flat;
    PendingCollective pending;
  };
  // The owner copies a summed bucket back into its gradients, averaged.
  auto finish = [&](InFlight& f) {
    f.pending.wait();
    if (f.bucket->owner != rank) return;  // the flat copy was scratch
    f.flat.mul_(inverse);
    int64_t offset = 0;
    for (size_t i : f.bucket->params) {
      at::Tensor& p = params_[i].second;
      const int64_t n = p.numel();
      if (p.grad().defined()) p.mutable_grad().copy_(f.flat.narrow(0, offset, n).view(p.grad().sizes()));
      offset += n;
    }
  };
  std::deque<InFlight> in_flight;
  for (const Bucket& bucket : gradient_buckets_) {
    at::Tensor flat = at::zeros({bucket.numel}, params_.front().second.options().dtype(at::kFloat));
    int64_t offset = 0;
    for (size_t i : bucket.params) {
      at::Tensor& p = params_[i].second;
      const int64_t n = p.numel();
      if (p.grad().defined()) {
        flat.narrow(0, offset, n).copy_(p.grad().reshape({n}));
        if (bucket.owner != rank) p.mutable_grad().reset();  // another rank's tensor: its owner keeps the sum
      }
      offset += n;
    }
    in_flight.push_back({&bucket, flat, group_.reduce_sum_async(flat, bucket.owner)});
    if (in_flight.size() > 1) {  // two in flight: the next fills while this one is summed
      finish(in_flight.front());
      in_flight.pop_front();
    }
  }
  for (auto& f : in_flight) finish(f);
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

size_t ZeroSharding::param_of(const std::string& key) const {
  const size_t dot = key.rfind('.');
  if (dot != std::string::npos) {
    const auto it = index_of_.find(key.substr(0, dot));
    if (it != index_of_.end()) return it->second;
  }
  fail("ZeRO: tensor '{}' on {} belongs to no trainable parameter (expected '<parameter name>.<state name>')", key,
       group_.where());
}

NamedTensors ZeroSharding::gather_to_rank_zero(const NamedTensors& local) {
  const int rank = group_.rank();
  for (const auto& [key, t] : local) {
    const size_t i = param_of(key);
    if (ownership_.owner(i) != rank) {
      fail("ZeRO: {} holds '{}' of parameter '{}', which rank {} owns", group_.where(), key, params_[i].first,
           ownership_.owner(i));
    }
  }
  NamedTensors gathered;
  if (rank == 0) gathered = local;
  for (int root = 1; root < group_.size(); ++root) {
    // The list first (its length, then its text), so that receivers can allocate.
    const std::string text = rank == root ? describe_tensors(local) : std::string();
    at::Tensor length = at::full({1}, static_cast<int64_t>(text.size()), at::TensorOptions().dtype(at::kLong));
    group_.broadcast(length, root);
    at::Tensor bytes = at::empty({length.item<int64_t>()}, at::TensorOptions().dtype(at::kByte));
    if (rank == root) std::copy(text.begin(), text.end(), bytes.data_ptr<uint8_t>());
    group_.broadcast(bytes, root);
    const std::vector<TensorDescription> list =
        parse_descriptions(std::string(bytes.data_ptr<uint8_t>(), bytes.data_ptr<uint8_t>() + bytes.numel()));
    for (size_t k = 0; k < list.size(); ++k) {
      at::Tensor t =
          rank == root ? local[k].second.detach() : at::empty(list[k].shape, at::TensorOptions().dtype(list[k].dtype));
      group_.broadcast(t, root);
      if (rank == 0) gathered.emplace_back(list[k].key, t);
    }
  }
  if (rank != 0) return {};
  std::vector<std::pair<size_t, size_t>> order;  // (parameter, position in `gathered`)
  for (size_t k = 0; k < gathered.size(); ++k) order.emplace_back(param_of(gathered[k].first), k);
  std::sort(order.begin(), order.end());
  NamedTensors sorted;
  for (const auto& [param, k] : order) sorted.push_back(std::move(gathered[k]));
  return sorted;
}

}  // namespace shoestring::dist
