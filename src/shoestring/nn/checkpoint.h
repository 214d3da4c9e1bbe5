// Gradient checkpointing (Chen et al. 2016, "Training Deep Nets with Sublinear
// Memory Cost", arXiv 1604.06174): a segment of the network keeps only its
// inputs during the forward pass and is recomputed, with autograd on, during
// the backward pass. Costs about one extra forward per checkpointed segment;
// saves every activation inside the segment.
#pragma once
#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>

namespace shoestring::nn {

/// A checkpointable segment: maps input tensors to output tensors. It may use
/// module parameters captured by reference (they are not inputs) and tensors
/// captured by value that need no gradient (e.g. a bool mask).
using SegmentFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

/// Runs `fn(inputs)` without keeping its intermediate activations for backward.
///
/// - When autograd is off (GradMode disabled), this is exactly `fn(inputs)`.
/// - Otherwise the forward runs under no-grad; only `inputs` (and the CPU RNG
///   state) are saved. The backward restores the CPU RNG state of the forward,
///   re-runs `fn` with autograd on over detached copies of the inputs (with
///   the same requires_grad), back-propagates the incoming gradients through
///   that recomputed graph, which accumulates `.grad` of every parameter used
///   inside `fn` (through their AccumulateGrad nodes, as PyTorch's reentrant
///   `torch.utils.checkpoint` does), and returns the inputs' gradients. The RNG
///   state after the forward is restored afterwards, so dropout masks in the
///   recompute equal those of the forward and later draws are undisturbed.
///   Only the default CPU generator is saved (no CUDA RNG).
/// - Inputs may have any dtype; those that do not require grad get no
///   gradient. If no input requires grad, parameters inside `fn` still get
///   their gradients (an internal dummy input carries the graph edge).
/// - The outputs of `fn` must be new tensors (not inputs or views of inputs);
///   outputs that do not depend on anything requiring grad get no gradient.
/// - `fn` must be deterministic given the inputs and RNG state, and must not
///   call `backward` itself. It is stored and called again during backward,
///   after checkpoint() has returned: capture by value whatever might not
///   outlive the backward pass.
///
/// Inputs: any number of defined tensors. Returns fn's outputs (same shapes and
/// dtypes). Throws shoestring::Error if an input is undefined or fn returns no
/// tensors.
///
/// `after_backward` (optional) runs in the backward pass right after the
/// recomputed segment's backward (so the gradients of the parameters used
/// inside `fn` are complete for this pass), also when no gradient reached
/// the segment; used to release streamed parameters (BlockParameterStreaming).
/// It does not run when autograd is off (fn runs once, plainly).
std::vector<at::Tensor> checkpoint(const SegmentFn& fn, const std::vector<at::Tensor>& inputs,
                                   std::function<void()> after_backward = {});

/// Single-tensor convenience: `checkpoint([&](x) { return {fn(x[0])}; }, {input})[0]`.
at::Tensor checkpoint(const std::function<at::Tensor(const at::Tensor&)>& fn, const at::Tensor& input);

}  // namespace shoestring::nn
