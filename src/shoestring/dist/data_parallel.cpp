#include "shoestring/dist/data_parallel.h"

#include <algorithm>
#include <deque>

#include <fmt/format.h>

#include "shoestring/core/error.h"
#include "shoestring/core/units.h"

namespace shoestring::dist {

GradientReducer::GradientReducer(ProcessGroup& group, std::vector<at::Tensor> params, int64_t bucket_bytes)
    : group_(group), params_(std::move(params)) {
  if (bucket_bytes < 1) fail("GradientReducer: bucket size {} bytes, expected >= 1", bucket_bytes);
  const int64_t cap = std::max<int64_t>(1, bucket_bytes / 4);  // fp32 elements
  // Reverse parameter order, as DDP: backward produces the last layers' gradients first.
  bucket_of_.resize(params_.size());
  for (size_t k = params_.size(); k-- > 0;) {
    const int64_t n = params_[k].numel();
    if (buckets_.empty() || (buckets_.back().numel > 0 && buckets_.back().numel + n > cap)) buckets_.emplace_back();
    buckets_.back().params.push_back(k);
    buckets_.back().numel += n;
    bucket_of_[k] = buckets_.size() - 1;
  }
  arrived_.assign(params_.size(), 0);
  complete_.assign(buckets_.size(), 0);
}

void GradientReducer::start_overlap() {
  if (group_.size() == 1) return;
  armed_ = true;
  next_bucket_ = 0;
  started_in_backward_ = 0;
  std::fill(arrived_.begin(), arrived_.end(), 0);
  std::fill(complete_.begin(), complete_.end(), 0);
}

void GradientReducer::gradient_ready(size_t index) {
  if (!armed_ || index >= params_.size()) return;
  if (++arrived_[index] > 1) {
    if (!overlap_) return;  // the probing step counts; the plain reduction follows
    fail(
        "data parallel: trainable tensor {} of {} ({}) received a second gradient in one backward pass after its "
        "bucket of the gradient all-reduce had started; the all-reduce overlaps backward and needs each trainable "
        "tensor used once per backward (a static graph)",
        index, params_.size(), format_shape(params_[index].sizes()));
  }
  if (!overlap_) return;
  ++complete_[bucket_of_[index]];
  while (next_bucket_ < buckets_.size() && complete_[next_bucket_] == buckets_[next_bucket_].params.size()) {
    start_bucket(next_bucket_++);
    ++started_in_backward_;
  }
}

void GradientReducer::start_bucket(size_t b) {
  if (in_flight_.size() > 1) finish_oldest();  // two in flight: the next fills while this one is summed
  const GradientBucket& bucket = buckets_[b];
  at::Tensor flat = at::zeros({bucket.numel}, params_.front().options().dtype(at::kFloat));
  int64_t offset = 0;
  for (size_t i : bucket.params) {
    const at::Tensor& p = params_[i];
    const int64_t n = p.numel();
    if (p.grad().defined()) flat.narrow(0, offset, n).copy_(p.grad().reshape({n}));
    offset += n;
  }
  in_flight_.push_back({&bucket, flat, group_.all_reduce_sum_async(flat)});
}

void GradientReducer::finish_oldest() {
  InFlight f = std::move(in_flight_.front());
  in_flight_.pop_front();
  f.pending.wait();
  int64_t offset = 0;
  for (size_t i : f.bucket->params) {
    at::Tensor p = params_[i];
    const int64_t n = p.numel();
    if (p.grad().defined()) p.mutable_grad().copy_(f.flat.narrow(0, offset, n).view(p.grad().sizes()));
    offset += n;
  }
}

void GradientReducer::all_reduce_gradients() {
  if (group_.size() == 1) return;
  if (armed_) {
    armed_ = false;
    if (!probed_) {
      // Every rank runs the same graph, so every rank decides alike (and a
      // rank that decided otherwise would still start the same buckets in
      // the same order).
      probed_ = true;
      overlap_ = std::all_of(arrived_.begin(), arrived_.end(), [](int n) { return n <= 1; });
      next_bucket_ = 0;  // the probing step reduces every bucket below
    }
  } else {
    next_bucket_ = 0;  // not armed: a plain reduction of every bucket
  }
  try {
    while (next_bucket_ < buckets_.size()) start_bucket(next_bucket_++);
    while (!in_flight_.empty()) finish_oldest();
  } catch (...) {
    in_flight_.clear();  // waits for (and logs) what is still in flight
    throw;
  }
}

void reduce_gradient_buckets(ProcessGroup& group, const std::vector<at::Tensor>& params,
                             const std::vector<GradientBucket>& buckets, const StartBucketCollective& start,
                             const std::function<void(size_t, const at::Tensor&)>& receive) {
  if (params.empty()) return;
  const int rank = group.rank();
  struct InFlight {
    const GradientBucket* bucket;
    at::Tensor flat;  // [bucket->numel] fp32
    PendingCollective pending;
  };
  // The receiving rank(s) copy a summed bucket back into the gradients.
  auto finish = [&](InFlight& f) {
    f.pending.wait();
    if (f.bucket->root >= 0 && f.bucket->root != rank) return;  // the flat copy was scratch
    int64_t offset = 0;
    for (size_t i : f.bucket->params) {
      at::Tensor p = params[i];
      const int64_t n = p.numel();
      if (receive) {
        if (p.grad().defined()) receive(i, f.flat.narrow(0, offset, n).view(p.grad().sizes()));
      } else if (p.grad().defined()) {
        p.mutable_grad().copy_(f.flat.narrow(0, offset, n).view(p.grad().sizes()));
      }
      offset += n;
    }
  };
  std::deque<InFlight> in_flight;
  for (const GradientBucket& bucket : buckets) {
    at::Tensor flat = at::zeros({bucket.numel}, params.front().options().dtype(at::kFloat));
    const bool receives = bucket.root < 0 || bucket.root == rank;
    int64_t offset = 0;
    for (size_t i : bucket.params) {
      at::Tensor p = params[i];
      const int64_t n = p.numel();
      if (p.grad().defined()) {
        flat.narrow(0, offset, n).copy_(p.grad().reshape({n}));
        if (!receives) p.mutable_grad().reset();  // another rank's tensor: its owner keeps the sum
      }
      offset += n;
    }
    in_flight.push_back({&bucket, flat, start(flat, bucket)});
    if (in_flight.size() > 1) {  // two in flight: the next fills while this one is summed
      finish(in_flight.front());
      in_flight.pop_front();
    }
  }
  for (auto& f : in_flight) finish(f);
}

void broadcast_tensors(ProcessGroup& group, const std::vector<at::Tensor>& tensors, int root) {
  if (group.size() == 1) return;
  for (const at::Tensor& t : tensors) {
    at::Tensor data = t.detach();  // parameters are leaves that require grad
    group.broadcast(data, root);
  }
}

at::Tensor rank_rows(const at::Tensor& global, int rank, int world, const std::string& what) {
  if (global.dim() < 1 || global.size(0) % world != 0) {
    fail("{}: a global batch of {} rows cannot be split evenly over {} ranks (shape {})", what,
         global.dim() < 1 ? 0 : global.size(0), world, format_shape(global.sizes()));
  }
  const int64_t n = global.size(0) / world;
  return global.narrow(0, rank * n, n);
}

}  // namespace shoestring::dist
