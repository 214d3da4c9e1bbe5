// The memory planner behind `shoestring plan`: predicts the peak memory of a
// training step, per ledger category, for a config (model, resolution, batch,
// precision, optimizer and its state dtype, fused backward, gradient
// accumulation, checkpointing, chunked attention, offload) without building
// the model's storage: parameter shapes and the forward pass are derived
// analytically from the architecture's module tree (the emoji model's from
// its config; registered real architectures are built on the meta device and
// walked block by block; see plan/trace.h for the model of what autograd
// keeps), and the optimizer's state and scratch from its documented
// bytes per parameter (docs/optimizers/).
//
// With a budget, advise() searches the switches a user can flip, cheapest in
// expected speed first, and returns the config lines to paste.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "shoestring/plan/trace.h"
#include "shoestring/train/config.h"

namespace shoestring::plan {

/// Everything the plan predicts, bytes.
struct MemoryPlan {
  int64_t parameters = 0;             ///< trainable parameters (UNet + caption encoder)
  int64_t largest_parameter = 0;      ///< elements of the largest parameter tensor
  /// Steady-state peak of one optimizer step on the device (steps >= 2, when
  /// the optimizer state exists from the start of the step); excludes
  /// host_offload bytes and the dataset held in memory (ledger "other").
  int64_t predicted_peak_bytes = 0;
  /// Peak of the first step, whose optimizer state is created during its
  /// optimizer update (after forward and backward).
  int64_t first_step_peak_bytes = 0;
  Bytes at_peak{};                    ///< per category at the steady-state peak
  std::string peak_phase;             ///< where the peak happens ("backward conv1", "optimizer step", ...)
  int64_t host_bytes = 0;             ///< optimizer state held in host memory (offload)
  int64_t weights_bytes = 0;          ///< parameters in their storage dtype
  int64_t optimizer_state_bytes = 0;  ///< optimizer state on the device + EMA shadow (fp32)
  int64_t ema_bytes = 0;              ///< of which EMA
  int64_t activation_bytes = 0;       ///< kept by forward for backward (plus the batch), per micro-batch
  int64_t checkpointing_saving_bytes = 0;  ///< activations gradient checkpointing removes (0 when off)
  std::vector<std::string> notes;     ///< what the plan does not model for this config

  /// {"predicted_peak_bytes", "first_step_peak_bytes", "<category>_bytes" for
  /// weights, gradients, optimizer_state, activations, temporaries (at the
  /// peak), "host_bytes", "parameters", "peak_phase", ...}: stable names.
  nlohmann::json to_json() const;
};

/// What the trainer (latents and text-encoder outputs cached up front) and
/// bench/model_step feed the denoiser of a registered architecture at
/// `resolution` pixels.
struct DenoiserInputs {
  /// Side of the square latent: resolution / 8 for LDM UNets and SD3.5
  /// (VAE factor 8); for Stable Cascade stage C max(8, 3 * resolution / 128),
  /// i.e. resolution / 42.67 (24 at 1024 px, the stage C compression).
  int64_t latent_side = 0;
  /// Text tokens of the context: 77 (CLIP) for LDM UNets and stage C's
  /// clip_text, 154 (77 CLIP-L/G + 77 T5) for SD3.5.
  int64_t context_tokens = 0;
};

/// Inputs of architecture `name` ("sd15", "sdxl", "ssd1b", "sd35m",
/// "cascade-c", "cascade-c-lite"). Throws shoestring::Error for other names.
DenoiserInputs denoiser_inputs(const std::string& name, int64_t resolution);

/// True when plan_memory models `architecture`: "tiny-unet" (the emoji model
/// with its caption encoder) and the denoisers above.
bool planner_knows(const std::string& architecture);

/// Predicts the memory of a training step of `config`.
///
/// "tiny-unet": the emoji model and its caption encoder, as the trainer runs
/// it. Registered real architectures (sd15, sdxl, ssd1b, sd35m, cascade-c,
/// cascade-c-lite; config.tiny for their test widths): the denoiser only,
/// built on the meta device for its module tree and parameter shapes, on
/// the inputs of denoiser_inputs(), one forward, mse loss on an fp32 copy of
/// the output, backward and the optimizer update (bench/model_step's step;
/// the VAE and text encoders are not resident). `vocab_size` is the
/// caption tokenizer's (it sets the token embedding's size; the trainer knows
/// it, `shoestring plan` estimates it; unused for real architectures).
/// Throws shoestring::Error for an architecture the planner does not know,
/// LoRA configs (network_module), or invalid model options.
MemoryPlan plan_memory(const TrainConfig& config, int64_t vocab_size);

/// One proposal of advise().
struct Proposal {
  std::vector<std::string> config_lines;  ///< e.g. "fused_backward_pass = true"
  std::string cost;                       ///< expected speed cost in words
  double slowdown = 1.0;                  ///< expected time per image relative to the config (>= 1)
  MemoryPlan plan;
};

/// Result of advise().
struct Advice {
  bool fits_already = false;
  bool found = false;            ///< a proposal fits the budget
  Proposal best;                 ///< the cheapest fitting proposal (found) or the smallest one (floor)
  std::string floor_reason;      ///< when nothing fits: what the floor consists of
};

/// Searches combinations of fused_backward_pass, optimizer_type =
/// AdamW8bit / Adafactor, optimizer_state_dtype = bf16, full_bf16,
/// gradient_checkpointing, offload_optimizer_state, attention_chunk_mib and
/// smaller train_batch_size with gradient_accumulation_steps keeping the
/// images per step, and returns the fitting one with the lowest expected
/// slowdown (ties: fewest changes). Switches already on stay on.
Advice advise(const TrainConfig& config, int64_t vocab_size, int64_t budget_bytes);

/// Parses "8GiB", "512MiB", "1.5G", "2e9" (bytes) into bytes. Throws
/// shoestring::Error naming the text when it is not a size.
int64_t parse_byte_size(const std::string& text);

/// Default caption vocabulary assumed when the dataset is not read.
constexpr int64_t kDefaultVocabSize = 2048;

}  // namespace shoestring::plan
