// The one interface of every denoiser the trainer, the planner and
// `plan --explain` run, whatever its family: LdmUNetImpl (SD 1.x, SDXL,
// SSD-1B), MMDiTImpl (SD3.5), StageCImpl (Stable Cascade) and TinyUNetImpl
// (the emoji example). Code outside models/ reaches a denoiser's common
// parts through it instead of casting to the concrete classes.
#pragma once
#include <vector>

#include <torch/nn/module.h>

#include "shoestring/nn/block_precision.h"

namespace shoestring::models {

/// Implemented by every denoiser module (alongside torch::nn::Module).
class Denoiser {
 public:
  virtual ~Denoiser() = default;

  /// The model's blocks for per-block compute dtype and checkpointing
  /// (precision::resolve / apply, OverflowMonitor; nn/block_precision.h).
  /// Owned by the model and alive as long as it is; never nullptr.
  /// Gradient checkpointing is configured only here, by precision rules
  /// (`checkpoint = true`, or the `gradient_checkpointing` shorthand).
  virtual nn::BlockTable* block_table() const = 0;
};

/// `module` as a Denoiser, or nullptr when it is none (a VAE, a text
/// encoder, a root module that only holds a denoiser).
Denoiser* as_denoiser(torch::nn::Module& module);
const Denoiser* as_denoiser(const torch::nn::Module& module);

/// Block tables of every denoiser in `root`'s module tree (root included),
/// in named_modules() order; e.g. the UNet's table of a build_checkpoint_root
/// tree. Empty when there is none.
std::vector<nn::BlockTable*> denoiser_block_tables(const torch::nn::Module& root);

}  // namespace shoestring::models
