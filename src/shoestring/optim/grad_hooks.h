// Post-accumulate-grad hooks: a callback that runs for a leaf parameter right
// after autograd has accumulated its gradient into .grad, while the rest of
// the backward pass is still running.
//
// Built on the AccumulateGrad node's post hooks (libtorch >= 1.13), the same
// mechanism PyTorch's DistributedDataParallel uses for gradient bucketing and
// that torch 2.1's Tensor.register_post_accumulate_grad_hook wraps. The
// AccumulateGrad node is only weakly owned by its tensor, so this class keeps
// a strong reference for every hooked parameter; otherwise the node (and its
// hook) would be dropped between iterations.
//
// Uses: charging gradients to the memory ledger the moment they exist, and
// the fused backward pass (step and free each gradient as soon as it is ready).
#pragma once
#include <functional>
#include <memory>
#include <vector>

#include <ATen/ATen.h>

namespace torch::autograd {
struct Node;
}

namespace shoestring {

/// Owns post-accumulate-grad hooks for a set of parameters. Hooks stay
/// installed while this object lives.
class PostAccumulateGradHooks {
 public:
  /// Called with the parameter index and the parameter (its .grad is set).
  using Callback = std::function<void(size_t index, at::Tensor& param)>;

  PostAccumulateGradHooks() = default;
  ~PostAccumulateGradHooks();
  PostAccumulateGradHooks(const PostAccumulateGradHooks&) = delete;
  PostAccumulateGradHooks& operator=(const PostAccumulateGradHooks&) = delete;

  /// Installs `callback` on every parameter (each must be a leaf that
  /// requires grad; throws shoestring::Error naming the index otherwise).
  void install(const std::vector<at::Tensor>& params, Callback callback);

 private:
  struct Entry {
    std::shared_ptr<torch::autograd::Node> accumulator;
    uintptr_t key = 0;
  };
  std::vector<Entry> entries_;
};

}  // namespace shoestring
