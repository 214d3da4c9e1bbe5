// Measures what the memory planner predicts: runs real training steps of a
// config through the trainer (train/trainer.h), or one denoiser step of a
// registered real architecture (measure_model_step), and reads the memory
// ledger after each step. Used by tests/plan (accuracy of plan_memory),
// bench/plan_accuracy and bench/model_step.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "shoestring/models/tiny_unet.h"
#include "shoestring/plan/memory_plan.h"
#include "shoestring/train/config.h"

namespace shoestring::plan {

/// Ledger readings of one training step.
struct MeasuredStep {
  /// Device peak of the step (ledger device_peak_total) minus the bytes of
  /// the "other" category left after the step (the dataset held in memory),
  /// i.e. what MemoryPlan::predicted_peak_bytes predicts.
  int64_t peak_bytes = 0;
  Bytes at_peak{};            ///< per category at the total peak (ledger peak_breakdown)
  Bytes peak_per_category{};  ///< each category's own peak during the step
};

/// Result of measure_training().
struct Measurement {
  int64_t vocab_size = 0;           ///< the tokenizer's, to plan with the same embedding
  std::vector<MeasuredStep> steps;  ///< one per step run
  MemoryPlan plan;                  ///< plan_memory(config, vocab_size), computed inside the run
};

/// Trains `steps` optimizer steps of `config` in a temporary run folder
/// (removed afterwards; no checkpoints or samples except the final ones,
/// which happen after the last measurement) and returns the ledger readings
/// per step. Throws whatever train() throws (dataset missing, bad config).
Measurement measure_training(TrainConfig config, int64_t steps);

/// One training step of a registered architecture's denoiser, as a user
/// fine-tunes it with latents and text embeddings cached (for "tiny-unet":
/// the UNet of `tiny_unet`, e.g. the emoji example's, on pixels [B, 3, R, R],
/// t in [0, 1) and caption states [B, tiny_unet_context_tokens,
/// context_dim], without its caption encoder): random weights
/// (the memory does not depend on values), random inputs of the shapes of
/// its registry row (models::Architecture::example and denoiser_batch), mse loss on an fp32 copy of the output,
/// backward, optimizer update. Shared by bench/model_step and tests/plan.
struct ModelStepOptions {
  std::string architecture = "sd15";  ///< a registered denoiser (a registry row with `example`)
  bool tiny = false;                  ///< the architecture's tiny-width variant
  int64_t resolution = 512;           ///< image side in pixels
  int64_t batch = 1;
  int64_t steps = 2;                    ///< steps run; the last one is reported
  std::string optimizer = "Adafactor";  ///< optimizer_type (Adafactor gets scale_parameter etc. off)
  bool checkpointing = true;            ///< gradient checkpointing
  bool fused = true;                    ///< fused backward pass (else backward, then Optimizer::step)
  bool bf16 = true;                     ///< bf16 weights + stochastic rounding and bf16 state (else fp32)
  /// offload_params: the checkpointed blocks' weights, gradients and
  /// optimizer state in host memory (train/block_streaming.h); needs
  /// checkpointing and no fused backward (throws shoestring::Error otherwise).
  bool offload_params = false;
  /// Attention score matrices above this many MiB are computed in query
  /// blocks (nn/chunked_attention.h; 64 is libshoestring's default, 0 = never).
  int64_t attention_chunk_mib = 64;
  /// The UNet built for architecture "tiny-unet" (its init is replaced by
  /// the step's dtype); ignored for other architectures.
  models::TinyUNetOptions tiny_unet{};
  /// Caption tokens of the tiny-unet's cross-attention context.
  int64_t tiny_unet_context_tokens = 16;
};

/// Result of measure_model_step().
struct ModelStepResult {
  int64_t parameters = 0;
  double seconds_per_step = 0;       ///< of the last step
  std::vector<double> step_seconds;  ///< wall seconds of every step, in order
  double loss = 0;                   ///< of the last step
  /// Ledger readings of the last step (peaks reset at each step's start).
  MeasuredStep step;
};

/// Runs `o.steps` steps, each measured by the memory ledger (installed here
/// if it is not), with nn::attention_chunk_bytes() set from
/// o.attention_chunk_mib (restored afterwards). Weights are charged to `weights`, inputs and forward to
/// `activations`, backward to `temporaries`. Throws shoestring::Error for an
/// unknown architecture or optimizer.
ModelStepResult measure_model_step(const ModelStepOptions& o);

/// The config plan_memory needs to predict measure_model_step(o): the
/// architecture, resolution, batch, precision (full_bf16, bf16 state),
/// optimizer, fused backward, checkpointing and attention chunking of `o`;
/// no EMA, accumulation or offload.
TrainConfig model_step_config(const ModelStepOptions& o);

}  // namespace shoestring::plan
