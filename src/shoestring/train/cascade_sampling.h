// Text-to-image previews with a Stable Cascade stage C checkpoint (`shoestring
// sample`): stage_c.safetensors / stage_c_lite.safetensors as released, a
// file `shoestring train` wrote (the same keys), a step checkpoint, or a
// LoRA run's base with --lora.
//
// Stage C draws the 16-channel semantic latents (GDF's DDPM sampler with
// CFG, train/cascade_components.h); the released previewer decodes them to
// an image 8x the latent size (a preview: 192 px for the 24 x 24 latents of
// a 1024 px image; stage B + A's full decode is not part of shoestring).
// Memory-lean: bigG encodes every prompt and is freed, then stage C draws
// and is freed, then the previewer decodes.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "shoestring/train/sampling.h"

namespace shoestring {

/// What to draw from a stage C checkpoint. Empty fields come from the run the
/// file belongs to (RUN_DIR/config.toml: resolution, tokenizer_dir,
/// text_model_checkpoint_path, previewer_checkpoint_path, seed,
/// activation_rescale), then from defaults (768 px, Stability's stage C
/// training size: 24 x 24 latents).
struct CascadeSampleRequest {
  /// prompts (kohya's inline --n --w --h --s --l --d), seeds, steps, cfg (4 as Stability's and kohya's)
  SampleRequest images;
  std::string negative_prompt;
  /// Pixels at the EfficientNet's scale (latent side x 32); multiples of the
  /// architecture's pixel multiple (cascade_pixel_multiple).
  int64_t width = 0, height = 0;
  std::vector<std::pair<std::string, double>> loras;  ///< kohya / OneTrainer stage C LoRA (lora_prior_unet_*)
  std::string tokenizer_dir;                           ///< CLIP's vocab.json and merges.txt
  std::string clip_g;     ///< OpenCLIP bigG's file (an SDXL single file, or open_clip's text weights)
  std::string previewer;  ///< previewer.safetensors
  at::Device device = at::kCPU;
};

/// Whether `path` holds a trainable Stable Cascade stage C (cascade-c, cascade-c-lite).
bool is_cascade_checkpoint(const std::string& path);

/// Draws request.images.prompts x seeds previews from the stage C at `path`
/// (noise from the CPU generator seeded by each seed: the same on every
/// device, and the same images the trainer drew for its sample_prompts at
/// that step). Stage C runs in sample_compute_dtype (with the run's
/// activation_rescale in fp16), bigG and the previewer in float32. Returns
/// images of 8x the latent size, i.e. width / 4 x height / 4. Throws
/// shoestring::Error naming the file or option: no stage C in the file; a
/// size that does not fit; no tokenizer; bigG or the previewer found nowhere
/// (a tiny run's file outside its run folder: its random parts came from its
/// seed); a LoRA file with other modules; bad prompts.
CheckpointSamples sample_cascade_checkpoint(const std::string& path, const CascadeSampleRequest& request);

}  // namespace shoestring
