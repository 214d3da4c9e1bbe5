#include "shoestring/optim/grad_hooks.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "shoestring/core/error.h"

namespace shoestring {
namespace {

class CallbackHook : public torch::autograd::FunctionPostHook {
 public:
  CallbackHook(size_t index, at::Tensor param, PostAccumulateGradHooks::Callback cb)
      : index_(index), param_(std::move(param)), cb_(std::move(cb)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    cb_(index_, param_);
    return outputs;
  }

 private:
  size_t index_;
  at::Tensor param_;
  PostAccumulateGradHooks::Callback cb_;
};

}  // namespace

void PostAccumulateGradHooks::install(const std::vector<at::Tensor>& params, Callback callback) {
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    if (!p.requires_grad() || !p.is_leaf()) {
      fail("post-accumulate-grad hook: parameter {} is not a leaf that requires grad", i);
    }
    auto acc = torch::autograd::impl::grad_accumulator(p);
    if (!acc) fail("post-accumulate-grad hook: parameter {} has no gradient accumulator", i);
    uintptr_t key = acc->add_post_hook(std::make_unique<CallbackHook>(i, p, callback));
    entries_.push_back({std::move(acc), key});
  }
}

PostAccumulateGradHooks::~PostAccumulateGradHooks() = default;

}  // namespace shoestring
