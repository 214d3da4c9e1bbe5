#include "shoestring/dist/data_parallel.h"

#include <deque>

#include <fmt/format.h>

#include "shoestring/core/error.h"
#include "shoestring/core/units.h"

namespace shoestring::dist {

GradientAverager::GradientAverager(ProcessGroup& group, std::vector<at::Tensor> params, int64_t bucket_bytes)
    : group_(group), params_(std::move(params)) {
  if (bucket_bytes < 1) fail("GradientAverager: bucket size {} bytes, expected >= 1", bucket_bytes);
  const int64_t cap = std::max<int64_t>(1, bucket_bytes / 4);  // fp32 elements
  for (size_t i = 0; i < params_.size(); ++i) {
    const int64_t n = params_[i].numel();
    if (buckets_.empty() || (buckets_.back().numel > 0 && buckets_.back().numel + n > cap)) buckets_.emplace_back();
    buckets_.back().params.push_back(i);
    buckets_.back().numel += n;
  }
}

void GradientAverager::all_reduce_gradients() {
  if (group_.size() == 1) return;
  reduce_gradient_buckets(group_, params_, buckets_, [this](const at::Tensor& flat, const GradientBucket&) {
    return group_.all_reduce_sum_async(flat);
  });
}

void reduce_gradient_buckets(ProcessGroup& group, const std::vector<at::Tensor>& params,
                             const std::vector<GradientBucket>& buckets, const StartBucketCollective& start) {
  if (params.empty()) return;
  const double inverse = 1.0 / group.size();
  const int rank = group.rank();
  struct InFlight {
    const GradientBucket* bucket;
    at::Tensor flat;  // [bucket->numel] fp32
    PendingCollective pending;
  };
  // The receiving rank(s) copy a summed bucket back into the gradients, averaged.
  auto finish = [&](InFlight& f) {
    f.pending.wait();
    if (f.bucket->root >= 0 && f.bucket->root != rank) return;  // the flat copy was scratch
    f.flat.mul_(inverse);
    int64_t offset = 0;
    for (size_t i : f.bucket->params) {
      at::Tensor p = params[i];
      const int64_t n = p.numel();
      if (p.grad().defined()) p.mutable_grad().copy_(f.flat.narrow(0, offset, n).view(p.grad().sizes()));
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
