// Text-to-image with an SD3.5 Medium checkpoint (`shoestring sample`): a
// single file as the release ships it or `shoestring train` writes it (the
// MMDiT under model.diffusion_model., the VAE under first_stage_model., the
// text encoders under text_encoders.* when "incl_clips"), a step
// checkpoint, or a LoRA run's base with --lora.
//
// Memory-lean like train/ldm_sampling.h: the VAE (84 M parameters) is
// loaded first, so that a wrong file is refused before any long pass; the
// text encoders encode every prompt and are freed; then the MMDiT (LoRA
// merged) draws every latent (Euler on SD3's shift-3 sigmas with CFG and
// skip-layer guidance, train/sd3_components.h) and is freed; then the VAE
// decodes.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "shoestring/train/sampling.h"

namespace shoestring {

/// What to draw from an SD3 checkpoint. Empty fields come from the run the
/// file belongs to (RUN_DIR/config.toml: resolution, tokenizer_dir, clip_l,
/// clip_g, t5xxl, vae, pretrained_model_name_or_path, seed), then from the
/// file itself, then from defaults (1024 px).
struct Sd3SampleRequest {
  /// prompts (kohya's inline --n --w --h --s --l --d), seeds, steps, cfg (Stability's 5 for SD3.5 Medium)
  SampleRequest images;
  std::string negative_prompt;  ///< the unconditional prompt of classifier-free guidance
  int64_t width = 0, height = 0;  ///< pixels: multiples of 16 (VAE 8 x patch 2), at most 6144 (its position embedding, 384 patches)
  std::vector<std::pair<std::string, double>> loras;  ///< kohya LoRA files of the MMDiT (lora_unet_*) and multipliers
  std::string tokenizer_dir;  ///< CLIP's vocab.json and merges.txt (and T5's spiece.model with T5)
  /// Text encoder files: CLIP-L, OpenCLIP bigG (the checkpoint's own
  /// text_encoders.* when it holds them), T5-XXL (none: 77 zero tokens, as a
  /// run without t5xxl trained; may name the checkpoint when it holds T5).
  std::string clip_l, clip_g, t5xxl;
  std::string vae;  ///< the SD3 VAE's file (bare keys or first_stage_model.); default the checkpoint's own
  at::Device device = at::kCPU;
};

/// Whether `path` holds an SD3 MMDiT of a trainable architecture (sd35m).
bool is_sd3_checkpoint(const std::string& path);

/// Draws request.images.prompts x seeds images from the checkpoint at
/// `path` (noise from the CPU generator seeded by each seed: the same on
/// every device, and the same images the trainer drew for its sample_prompts
/// at that step). The MMDiT runs in sample_compute_dtype; encoders and VAE
/// in float32 (T5 in bf16). Throws shoestring::Error naming the file, option
/// or key: no MMDiT in the file; a size that does not fit; no tokenizer;
/// a text encoder or VAE found nowhere (a step checkpoint outside its run
/// folder; a tiny run's file without its config, whose random encoders came
/// from its seed); a LoRA file with other modules; bad prompts.
CheckpointSamples sample_sd3_checkpoint(const std::string& path, const Sd3SampleRequest& request);

}  // namespace shoestring
