// The memory planner behind `shoestring plan`: predicts the peak memory of a
// training step, per ledger category, for a config (model, resolution, batch,
// precision, optimizer and its state dtype, fused backward, gradient
// accumulation, checkpointing, chunked attention, offload) without building
// the model's storage: parameter shapes and the forward pass come from the
// architecture's memory trace (models/<model>_trace.cpp, reached through its
// registry row; the emoji model's from its config, registered real
// architectures built on the meta device and walked block by block), replayed
// by the memory simulator (nn/memory_simulator.h: what autograd keeps), and
// the optimizer's state and scratch from its documented bytes per parameter
// (docs/optimizers/).
//
// With a budget, advise() (plan/advise.cpp) searches the switches a user can
// flip, cheapest in expected speed first, and returns the config lines to
// paste.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "shoestring/nn/memory_simulator.h"
#include "shoestring/train/config.h"

namespace shoestring::plan {

/// Bytes per ledger category (nn/memory_simulator.h).
using Bytes = nn::Bytes;

/// Everything the plan predicts, bytes.
struct MemoryPlan {
  int64_t parameters = 0;         ///< trainable parameters (UNet + caption encoder; LoRA: the adapters)
  int64_t largest_parameter = 0;  ///< elements of the largest parameter tensor
  /// Steady-state peak of one optimizer step on the device (steps >= 2, when
  /// the optimizer state exists from the start of the step); excludes
  /// host_offload bytes and the dataset held in memory (ledger "other").
  int64_t predicted_peak_bytes = 0;
  /// Peak of the first step, whose optimizer state is created during its
  /// optimizer update (after forward and backward).
  int64_t first_step_peak_bytes = 0;
  Bytes at_peak{};                         ///< per category at the steady-state peak
  std::string peak_phase;                  ///< where the peak happens ("backward conv1", "optimizer step", ...)
  int64_t host_bytes = 0;                  ///< optimizer state held in host memory (offload)
  int64_t weights_bytes = 0;               ///< parameters in their storage dtype
  int64_t optimizer_state_bytes = 0;       ///< optimizer state on the device + EMA shadow (fp32) + fp32 masters
  int64_t ema_bytes = 0;                   ///< of which EMA
  int64_t activation_bytes = 0;            ///< kept by forward for backward (plus the batch), per micro-batch
  int64_t checkpointing_saving_bytes = 0;  ///< activations gradient checkpointing removes (0 when off)
  std::vector<std::string> notes;          ///< what the plan approximates or does not model for this config
  /// Tensors resident at the peak: every weight, and a gradient and up to two
  /// optimizer-state tensors per trained tensor (the CUDA allocator's
  /// rounding applies per tensor; plan/device_costs.h).
  int64_t resident_tensors = 0;
  /// Device costs beyond the tensors (plan/device_costs.h, CUDA only),
  /// already included in the peaks; 0 on the CPU.
  int64_t device_fixed_bytes = 0;
  /// Several processes: the world size planned for and the ZeRO stage in
  /// effect (0 with one process); the bytes are one rank's (the rank owning
  /// the most optimizer state).
  int world_size = 1;
  int64_t zero_stage = 0;
  /// fp32 gradient buckets of the reduction over ranks held at once (two in
  /// flight), counted as temporaries of the optimizer-step phase; 0 for one
  /// process.
  int64_t communication_bytes = 0;

  /// {"predicted_peak_bytes", "first_step_peak_bytes", "<category>_bytes" for
  /// weights, gradients, optimizer_state, activations, temporaries (at the
  /// peak), "host_bytes", "parameters", "peak_phase", ...}: stable names.
  nlohmann::json to_json() const;
};

/// Predicts the memory of a training step of `config`.
///
/// "tiny-unet": the emoji model and its caption encoder, as the trainer runs
/// it. Registered real architectures (sd15, sdxl, ssd1b, sd35m, cascade-c,
/// cascade-c-lite; config.tiny for their test widths): the denoiser only,
/// built on the meta device for its module tree and parameter shapes, on
/// the inputs of its registry row (models::denoiser_batch), one forward, mse
/// loss on an fp32 copy of the output, backward and the optimizer update
/// (bench/model_step's step; the VAE and text encoders are not resident).
///
/// Planned from the resolved precision policy (train/config.h
/// precision_policy: the shorthands, LoRA's frozen base and the
/// [[precision.rule]] entries, resolved with precision::resolve over the
/// meta-built model and its block tables, as the trainer does): each
/// parameter's storage dtype, trainable flag and fp32 master set the weights,
/// gradients, optimizer state and masters; fp16 or masters add the fp32
/// gradient bridge of loss scaling. The emoji model's trace takes each
/// block's compute dtype (fp16 emulated in fp32 on the CPU) and checkpoint
/// flag from its rule; real architectures' traces take the policy's dominant
/// compute dtype and checkpointing (a note says so when rules are present).
/// `vocab_size` is the caption tokenizer's (it sets the token embedding's
/// size; the trainer knows it, `shoestring plan` estimates it; unused for
/// real architectures). Throws shoestring::Error for an architecture the
/// planner does not know, LoRA on tiny-unet, invalid model options or an
/// invalid policy (precision::resolve's errors).
///
/// `world_size` > 1 plans one rank of a data-parallel run of that many
/// processes (the launcher's WORLD_SIZE): zero_stage >= 1 shards the
/// optimizer state by whole tensors as dist::TensorOwnership does (the plan
/// is of the rank owning the most), and the gradient reduction's fp32
/// buckets join the optimizer-step phase's temporaries. With the ZeRO
/// paper's notation (Rajbhandari et al., arXiv 1910.02054) and bf16 weights
/// and gradients, AdamW's fp32 state (K = 8 bytes per parameter) gives
/// 2Psi + 2Psi + 8Psi/N at stage 1 (plus at most the largest tensor's state);
/// stage 2 holds the same at its peak (see the plan's notes). Throws
/// shoestring::Error for world_size < 1.
MemoryPlan plan_memory(const TrainConfig& config, int64_t vocab_size, int world_size = 1);

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
  bool found = false;        ///< a proposal fits the budget
  Proposal best;             ///< the cheapest fitting proposal (found) or the smallest one (floor)
  std::string floor_reason;  ///< when nothing fits: what the floor consists of
};

/// Searches combinations of fused_backward_pass, optimizer_type =
/// AdamW8bit / Adafactor, optimizer_state_dtype = bf16, full_bf16,
/// gradient_checkpointing, offload_optimizer_state, attention_chunk_mib and
/// smaller train_batch_size with gradient_accumulation_steps keeping the
/// images per step, and returns the fitting one with the lowest expected
/// slowdown (ties: fewest changes). Switches already on stay on. Every
/// proposal is planned for one rank of `world_size` (plan_memory's).
Advice advise(const TrainConfig& config, int64_t vocab_size, int64_t budget_bytes, int world_size = 1);

/// Parses "8GiB", "512MiB", "1.5G", "2e9" (bytes) into bytes. Throws
/// shoestring::Error naming the text when it is not a size.
int64_t parse_byte_size(const std::string& text);

/// Default caption vocabulary assumed when the dataset is not read.
constexpr int64_t kDefaultVocabSize = 2048;

}  // namespace shoestring::plan
