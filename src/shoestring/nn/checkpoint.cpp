#include "shoestring/nn/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/torch_compat.h"

namespace shoestring::nn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Carries the segment function through AutogradContext::saved_data (an IValue
// map) as a capsule.
struct SegmentHolder : torch::CustomClassHolder {
  SegmentFn fn;
  std::function<void()> after_backward;  // optional
  size_t num_inputs = 0;  // real inputs; a trailing dummy input may follow
};

at::Tensor get_cpu_rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_cpu_rng_state(const at::Tensor& state) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

struct CheckpointFunction : torch::autograd::Function<CheckpointFunction> {
  // `inputs` must be passed as at::TensorList so that autograd sees each
  // element as a differentiable input.
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<SegmentHolder> holder, at::TensorList inputs) {
    ctx->set_materialize_grads(false);
    ctx->saved_data["rng"] = get_cpu_rng_state();
    ctx->saved_data["fn"] = c10::IValue::make_capsule(holder);
    ctx->save_for_backward(inputs.vec());
    std::vector<at::Tensor> real(inputs.begin(), inputs.begin() + holder->num_inputs);
    auto outputs = holder->fn(real);  // autograd is off here (Function::apply)
    if (outputs.empty()) fail("checkpoint: the segment function returned no tensors");
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    auto capsule = ctx->saved_data["fn"].toCapsule();
    auto* holder = static_cast<SegmentHolder*>(capsule.get());
    const variable_list saved = ctx->get_saved_variables();

    std::vector<at::Tensor> detached;
    detached.reserve(holder->num_inputs);
    for (size_t i = 0; i < holder->num_inputs; ++i) {
      at::Tensor d = saved[i].detach();
      if (saved[i].requires_grad()) d.requires_grad_(true);
      detached.push_back(std::move(d));
    }

    // Recompute with the forward's RNG state, then put back the current one.
    std::vector<at::Tensor> outputs;
    const at::Tensor rng_now = get_cpu_rng_state();
    set_cpu_rng_state(ctx->saved_data["rng"].toTensor());
    try {
      at::AutoGradMode grad_on(true);
      outputs = holder->fn(detached);
    } catch (...) {
      set_cpu_rng_state(rng_now);
      throw;
    }
    set_cpu_rng_state(rng_now);

    variable_list roots, root_grads;
    for (size_t i = 0; i < outputs.size() && i < grad_outputs.size(); ++i) {
      if (grad_outputs[i].defined() && outputs[i].requires_grad()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grad_outputs[i]);
      }
    }
    // Accumulates parameter .grad through their AccumulateGrad nodes, and the
    // detached inputs' .grad.
    if (!roots.empty()) torch::autograd::backward(roots, root_grads);
    outputs.clear();  // the recomputed graph goes before after_backward runs
    roots.clear();
    if (holder->after_backward) holder->after_backward();

    // One slot for the holder argument, then one per tensor input.
    variable_list grads(1 + saved.size());
    for (size_t i = 0; i < detached.size(); ++i) {
      if (detached[i].requires_grad()) grads[1 + i] = detached[i].grad();
    }
    return grads;
  }
};

}  // namespace

std::vector<at::Tensor> checkpoint(const SegmentFn& fn, const std::vector<at::Tensor>& inputs,
                                   std::function<void()> after_backward) {
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].defined()) fail("checkpoint: input {} is an undefined tensor", i);
  }
  if (!at::GradMode::is_enabled()) return fn(inputs);

  auto holder = c10::make_intrusive<SegmentHolder>();
  holder->fn = fn;
  holder->after_backward = std::move(after_backward);
  holder->num_inputs = inputs.size();
  std::vector<at::Tensor> all = inputs;
  const bool any_requires_grad =
      std::any_of(inputs.begin(), inputs.end(), [](const at::Tensor& t) { return t.requires_grad(); });
  if (!any_requires_grad) {
    // Without an input that requires grad autograd would not record the
    // segment, and parameters inside it would silently get no gradient.
    all.push_back(torch::empty({0}, torch::TensorOptions().requires_grad(true)));
  }
  return apply_autograd_function<CheckpointFunction>(holder, at::TensorList(all));
}

at::Tensor checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& input) {
  return checkpoint([fn](const std::vector<at::Tensor>& xs) { return std::vector<at::Tensor>{fn(xs[0])}; },
                    std::vector<at::Tensor>{input})[0];
}

}  // namespace shoestring::nn
