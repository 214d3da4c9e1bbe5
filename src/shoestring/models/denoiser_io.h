// What the memory planner (plan/) and bench/model_step need from a denoiser
// besides its module tree: the shapes of the inputs the trainer feeds it
// (latents and text-encoder outputs cached up front), random example inputs
// of those shapes, and its memory trace (the ops of its training forward for
// the memory simulator, nn/memory_trace.h). Each denoiser implements these
// next to its forward (models/<model>_trace.cpp); the architecture registry
// (models/architecture.h) names them in its row.
#pragma once
#include <cstdint>
#include <functional>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "shoestring/nn/memory_trace.h"

namespace shoestring::models {

/// The inputs of one training forward of a denoiser.
struct DenoiserBatch {
  int64_t batch = 1;           ///< images per micro-batch
  int64_t latent_side = 0;     ///< side of the square latent (Architecture::latent_side of the resolution)
  int64_t context_tokens = 0;  ///< text tokens of the context (Architecture::context_tokens)
};

/// A denoiser's forward on random inputs, and the regression target (the
/// latent input itself: memory does not depend on values).
struct DenoiserExample {
  std::function<at::Tensor()> forward;
  at::Tensor target;
};

/// Random inputs of the shapes of `in` in `dtype` (timesteps as the model
/// expects them) bound to `model`'s forward. `model` must be the registry
/// row's architecture; throws shoestring::Error otherwise.
using DenoiserExampleFn = DenoiserExample (*)(torch::nn::Module& model, const DenoiserBatch& in, at::ScalarType dtype);

/// Emits into `tracer` the ops of `model`'s training forward on inputs of
/// the shapes of `in` (inputs persistent, then the layers, then mse_loss on
/// an fp32 copy of the output against the latent input). Throws
/// shoestring::Error when `model` is not the row's architecture or the
/// shapes do not fit it (e.g. latents not divisible by the UNet's levels).
using DenoiserTraceFn = void (*)(torch::nn::Module& model, nn::MemoryTracer& tracer, const DenoiserBatch& in);

}  // namespace shoestring::models
