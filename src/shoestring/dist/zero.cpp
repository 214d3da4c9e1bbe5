#include "shoestring/dist/zero.h"

#include <algorithm>
#include <map>

#include <ATen/core/grad_mode.h>
#include <c10/util/accumulate.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/core/units.h"

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
    : group_(group),
      params_(std::move(params)),
      stage_(stage),
      ownership_(numels_of(params_), group.size()),
      bucket_bytes_(bucket_bytes),
      tensors_(tensors_of(params_)) {
  if (stage < 1 || stage > 3) fail("ZeroSharding: zero_stage = {}, expected 1, 2 or 3", stage);
  if (bucket_bytes < 1) fail("ZeroSharding: bucket size {} bytes, expected >= 1", bucket_bytes);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!index_of_.emplace(params_[i].first, i).second)
      fail("ZeroSharding: two parameters named '{}'", params_[i].first);
    shapes_.push_back(params_[i].second.sizes().vec());
  }
  group_of_.assign(params_.size(), -1);
  step_gradient_.resize(params_.size());
  if (stage_ == 1) reducer_ = std::make_unique<GradientReducer>(group_, tensors_, bucket_bytes);
  make_resident_buckets();
}

void ZeroSharding::make_resident_buckets() {
  std::vector<size_t> resident;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (group_of_[i] < 0) resident.push_back(i);
  }
  gradient_buckets_.clear();
  if (stage_ >= 2) {
    for (Bucket& b : make_buckets(resident, /*by_dtype=*/false, bucket_bytes_))
      gradient_buckets_.push_back({std::move(b.params), b.numel, b.owner});
  }
  weight_buckets_ = make_buckets(resident, /*by_dtype=*/true, bucket_bytes_);
}

std::vector<ZeroSharding::Bucket> ZeroSharding::make_buckets(const std::vector<size_t>& which, bool by_dtype,
                                                             int64_t cap_bytes) const {
  // Per (owner, dtype) the bucket that is filling, in parameter order.
  std::vector<Bucket> done;
  std::map<std::pair<int, int>, Bucket> filling;
  for (size_t i : which) {
    const at::Tensor& p = params_[i].second;
    const int64_t numel = c10::multiply_integers(shapes_[i]);
    const int owner = ownership_.owner(i);
    const at::ScalarType dtype = by_dtype ? p.scalar_type() : at::kFloat;
    const int64_t cap = std::max<int64_t>(1, cap_bytes / static_cast<int64_t>(c10::elementSize(dtype)));
    Bucket& b = filling[{owner, static_cast<int>(dtype)}];
    if (b.numel > 0 && b.numel + numel > cap) {
      done.push_back(std::move(b));
      b = Bucket{};
    }
    b.owner = owner;
    b.dtype = dtype;
    b.params.push_back(i);
    b.numel += numel;
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
    reducer_->all_reduce_gradients();
    return;
  }
  reduce_to_owners();
  // Stage 3: the streamed tensors' gradients were reduced block by block in
  // backward; the owner's sum over the micro-batches becomes its .grad.
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!step_gradient_[i].defined()) continue;
    tensors_[i].mutable_grad() = step_gradient_[i];
    step_gradient_[i] = at::Tensor();
  }
}

void ZeroSharding::reduce_to_owners() {
  reduce_gradient_buckets(group_, tensors_, gradient_buckets_,
                          [this](const at::Tensor& flat, const GradientBucket& bucket) {
                            return group_.reduce_sum_async(flat, bucket.root);
                          });
}

double ZeroSharding::sum_over_ranks(double value) { return group_.size() == 1 ? value : group_.all_reduce_sum(value); }

void ZeroSharding::broadcast_updated_parameters() {
  if (group_.size() == 1) return;
  for (const Bucket& bucket : weight_buckets_) gather_bucket(bucket, -1);
}

at::Tensor ZeroSharding::pack_bucket(const Bucket& bucket, MemoryCategory category) const {
  at::NoGradGuard no_grad;
  at::Tensor flat;
  {
    ScopedMemoryCategory scope(category);
    flat = at::empty({bucket.numel}, at::TensorOptions().dtype(bucket.dtype).device(group_.device()));
  }
  if (bucket.owner != group_.rank()) return flat;
  int64_t offset = 0;
  for (size_t i : bucket.params) {
    const at::Tensor& p = tensors_[i];
    flat.narrow(0, offset, p.numel()).copy_(p.detach().reshape({p.numel()}));
    offset += p.numel();
  }
  return flat;
}

void ZeroSharding::gather_bucket(const Bucket& bucket, int root) {
  at::NoGradGuard no_grad;
  const int rank = group_.rank();
  at::Tensor flat = pack_bucket(bucket, MemoryCategory::temporaries);
  group_.broadcast(flat, bucket.owner);
  if (bucket.owner == rank || (root >= 0 && root != rank)) return;
  int64_t offset = 0;
  for (size_t i : bucket.params) {
    at::Tensor p = tensors_[i];
    const int64_t n = c10::multiply_integers(shapes_[i]);
    const at::Tensor values = flat.narrow(0, offset, n).view(shapes_[i]);
    if (p.numel() == n) {
      p.detach().copy_(values);  // a resident parameter, or one already present
    } else {
      ScopedMemoryCategory category(MemoryCategory::weights);
      p.set_data(values.clone());
    }
    offset += n;
  }
}

size_t ZeroSharding::add_streamed_group(const std::vector<size_t>& params) {
  if (stage_ < 3) fail("ZeroSharding: streamed parameter groups need zero_stage = 3 (this is stage {})", stage_);
  if (streaming_) fail("ZeroSharding: add_streamed_group after start_streaming");
  StreamGroup g;
  for (size_t i : params) {
    if (i >= params_.size()) fail("ZeroSharding: parameter index {} of {}", i, params_.size());
    if (group_of_[i] >= 0)
      fail("ZeroSharding: parameter '{}' is already in streamed group {}", params_[i].first, group_of_[i]);
    g.params.push_back(i);
  }
  std::sort(g.params.begin(), g.params.end());
  if (std::adjacent_find(g.params.begin(), g.params.end()) != g.params.end())
    fail("ZeroSharding: a streamed group lists a parameter twice");
  for (size_t i : g.params) group_of_[i] = static_cast<int>(groups_.size());  // all checked: none taken on failure
  g.fetch_buckets = make_buckets(g.params, /*by_dtype=*/true, bucket_bytes_);
  for (Bucket& b : make_buckets(g.params, /*by_dtype=*/false, bucket_bytes_))
    g.gradient_buckets.push_back({std::move(b.params), b.numel, b.owner});
  groups_.push_back(std::move(g));
  make_resident_buckets();
  return groups_.size() - 1;
}

void ZeroSharding::free_unowned(const StreamGroup& g) {
  at::NoGradGuard no_grad;
  for (size_t i : g.params) {
    if (owns(i)) continue;
    at::Tensor p = tensors_[i];
    // On the group's device: a parameter may still be in host memory here
    // (the run leaves other ranks' streamed weights there at the start).
    if (p.numel() > 0 || p.device() != group_.device()) p.set_data(at::empty({0}, p.options().device(group_.device())));
  }
}

void ZeroSharding::start_streaming() {
  if (stage_ < 3 || streaming_) return;
  streaming_ = true;
  if (group_.size() == 1) return;
  for (const StreamGroup& g : groups_) free_unowned(g);
}

void ZeroSharding::fetch(size_t group) {
  StreamGroup& g = groups_.at(group);
  if (!streaming_ || group_.size() == 1 || held_on_ == group_.rank()) return;
  if (g.fetched++ > 0) return;
  const bool in_order = follow_order(group);
  if (prefetch_ && prefetch_->group == group) {
    finish_prefetch(/*use=*/true);
  } else {
    if (prefetch_) finish_prefetch(/*use=*/false);  // left the order: every rank drops it alike
    for (const Bucket& b : g.fetch_buckets) gather_bucket(b, -1);
  }
  if (in_order) start_prefetch(group);
}

bool ZeroSharding::follow_order(size_t group) {
  if (!order_known_) {
    fetch_order_.push_back(group);
    return false;
  }
  if (order_followed_ && order_pos_ < fetch_order_.size() && fetch_order_[order_pos_] == group) {
    ++order_pos_;
    return true;
  }
  order_followed_ = false;
  return false;
}

void ZeroSharding::start_prefetch(size_t current) {
  if (!prefetch_on_ || order_pos_ >= fetch_order_.size()) return;  // the step's last gather: never across steps
  const size_t next = fetch_order_[order_pos_];
  // A group in use (e.g. the last block, whose backward recompute follows its
  // forward) is gathered again when it is fetched next.
  if (next == current || groups_.at(next).fetched > 0) return;
  Prefetch p;
  p.group = next;
  for (const Bucket& b : groups_[next].fetch_buckets) {
    // Category weights: the buffers become the parameters (finish_prefetch);
    // an owner's own bucket is only sent, a temporary.
    const bool own = b.owner == group_.rank();
    p.flats.push_back(pack_bucket(b, own ? MemoryCategory::temporaries : MemoryCategory::weights));
    p.pending.push_back(group_.broadcast_async(p.flats.back(), b.owner));
  }
  prefetch_ = std::move(p);
}

void ZeroSharding::finish_prefetch(bool use) {
  if (!prefetch_) return;
  Prefetch p = std::move(*prefetch_);
  prefetch_.reset();
  for (PendingCollective& pending : p.pending) pending.wait();
  if (!use) return;
  at::NoGradGuard no_grad;
  const StreamGroup& g = groups_.at(p.group);
  for (size_t b = 0; b < g.fetch_buckets.size(); ++b) {
    const Bucket& bucket = g.fetch_buckets[b];
    if (bucket.owner == group_.rank()) continue;
    int64_t offset = 0;
    for (size_t i : bucket.params) {
      const int64_t n = c10::multiply_integers(shapes_[i]);
      // A view of the buffer: it is freed with the last of its parameters.
      tensors_[i].set_data(p.flats[b].narrow(0, offset, n).view(shapes_[i]));
      offset += n;
    }
  }
  ++prefetched_gathers_;
}

void ZeroSharding::end_step_fetches() {
  finish_prefetch(/*use=*/false);
  if (streaming_ && !order_known_ && !fetch_order_.empty()) {
    order_known_ = true;
    if (prefetch_on_ && group_.rank() == 0) {
      spdlog::info(
          "ZeRO stage 3: {} block gathers per step recorded; from the next step on, each one prefetches the "
          "next block",
          fetch_order_.size());
    }
  }
  order_pos_ = 0;
  order_followed_ = true;
}

void ZeroSharding::release(size_t group, bool gradients_complete) {
  StreamGroup& g = groups_.at(group);
  if (!streaming_ || group_.size() == 1 || held_on_ == group_.rank()) return;
  if (gradients_complete && !streamed_reduced_in_backward_) {
    // The sum over ranks into the owner's .grad (others' reset), then into
    // the owner's sum over this step's micro-batches (or its sink's).
    {
      ScopedMemoryCategory category(MemoryCategory::temporaries);  // the buckets
      reduce_gradient_buckets(
          group_, tensors_, g.gradient_buckets,
          [this](const at::Tensor& flat, const GradientBucket& bucket) {
            return group_.reduce_sum_async(flat, bucket.root);
          },
          streamed_gradient_sink_);
    }
    for (size_t i : g.params) {
      if (streamed_gradient_sink_) {
        tensors_[i].mutable_grad().reset();  // the sink has this backward's sum
        continue;
      }
      at::Tensor p = tensors_[i];
      if (!owns(i) || !p.grad().defined()) continue;
      if (step_gradient_[i].defined()) {
        step_gradient_[i].add_(p.grad());
      } else {
        step_gradient_[i] = p.grad();
      }
      p.mutable_grad().reset();
    }
  }
  if (g.fetched > 0 && --g.fetched > 0) return;
  free_unowned(g);
}

void ZeroSharding::set_streamed_gradient_sink(StreamedGradientSink sink) {
  if (stage_ < 3) fail("ZeroSharding: a streamed gradient sink needs zero_stage = 3 (this is stage {})", stage_);
  streamed_gradient_sink_ = std::move(sink);
}

void ZeroSharding::set_streamed_gradients_reduced_in_backward() {
  if (stage_ < 3) fail("ZeroSharding: streamed gradients need zero_stage = 3 (this is stage {})", stage_);
  streamed_reduced_in_backward_ = true;
}

void ZeroSharding::hold_all_on(int root) {
  if (root < 0 || root >= group_.size()) fail("ZeroSharding::hold_all_on: rank {} of {}", root, group_.size());
  if (!streaming_ || group_.size() == 1 || held_on_ >= 0) return;
  finish_prefetch(/*use=*/false);
  for (const StreamGroup& g : groups_) {
    if (g.fetched > 0) fail("ZeroSharding::hold_all_on: a streamed group is in use (fetched)");
    for (const Bucket& b : g.fetch_buckets) gather_bucket(b, root);
  }
  held_on_ = root;
}

void ZeroSharding::hold_on(int root, const std::map<std::string, at::Tensor>& values) {
  if (root < 0 || root >= group_.size()) fail("ZeroSharding::hold_on: rank {} of {}", root, group_.size());
  if (!streaming_ || group_.size() == 1 || held_on_ >= 0) return;
  finish_prefetch(/*use=*/false);
  if (root == group_.rank()) {
    at::NoGradGuard no_grad;
    for (const StreamGroup& g : groups_) {
      if (g.fetched > 0) fail("ZeroSharding::hold_on: a streamed group is in use (fetched)");
      for (size_t i : g.params) {
        if (owns(i)) continue;
        const std::string& name = params_[i].first;
        const auto it = values.find(name);
        if (it == values.end())
          fail("streamed weights: no values for parameter '{}' (owned by rank {})", name, ownership_.owner(i));
        at::Tensor p = tensors_[i];
        if (it->second.sizes().vec() != shapes_[i] || it->second.scalar_type() != p.scalar_type()) {
          fail("streamed weights: parameter '{}' is {} {}, its values {} {}", name, c10::toString(p.scalar_type()),
               format_shape(shapes_[i]), c10::toString(it->second.scalar_type()), format_shape(it->second.sizes()));
        }
        p.set_data(it->second.to(p.device()));
      }
    }
  }
  held_on_ = root;
}

NamedTensors ZeroSharding::owned_streamed() const {
  NamedTensors out;
  if (!streaming_ || group_.size() == 1) return out;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (group_of_[i] >= 0 && owns(i)) out.emplace_back(params_[i].first, tensors_[i].detach());
  }
  return out;
}

std::vector<std::string> ZeroSharding::streamed_names() const {
  std::vector<std::string> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (group_of_[i] >= 0) out.push_back(params_[i].first);
  }
  return out;
}

void ZeroSharding::release_held() {
  if (held_on_ < 0) return;
  const bool was_root = held_on_ == group_.rank();
  held_on_ = -1;
  if (!was_root) return;
  for (const StreamGroup& g : groups_) free_unowned(g);
}

int64_t ZeroSharding::streamed_elements() const {
  int64_t n = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (group_of_[i] >= 0) n += c10::multiply_integers(shapes_[i]);
  }
  return n;
}

std::optional<size_t> ZeroSharding::parameter_of_state(const std::string& key) const {
  const size_t dot = key.rfind('.');
  if (dot == std::string::npos) return std::nullopt;
  const auto it = index_of_.find(key.substr(0, dot));
  if (it == index_of_.end()) return std::nullopt;
  return it->second;
}

}  // namespace shoestring::dist
