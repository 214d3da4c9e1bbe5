// Text-to-image with a single-file LDM checkpoint (SD 1.5, SDXL, SSD-1B: a
// file `shoestring train` wrote, or one from ComfyUI / A1111 / kohya):
// `shoestring sample` for the released architectures.
//
// Memory-lean, so that sampling fits where training fits: the text encoders
// are built, encode the prompts and are freed; then the UNet denoises every
// image (LoRA files merged into its weights) and is freed; then the VAE
// decodes. Only one of the three is in memory at a time.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "shoestring/train/samplers.h"
#include "shoestring/train/sampling.h"

namespace shoestring {

/// What to draw from an LDM checkpoint. Fields left at 0 / "" / auto come
/// from the run folder the file sits in (RUN_DIR/config.toml beside
/// RUN_DIR/model.safetensors: resolution, tokenizer_dir, clip_skip,
/// v_parameterization), then from the file's metadata, then from the
/// architecture's defaults (512 px for SD 1.5, 1024 for SDXL / SSD-1B).
struct LdmSampleRequest {
  /// prompts (with kohya's inline --n --w --h --s --l --d, parse_sample_prompt, which override the fields
  /// here for their row), seeds, steps, cfg (the grid: prompts x seeds)
  SampleRequest images;
  std::string negative_prompt;  ///< the unconditional prompt of classifier-free guidance
  int64_t width = 0;            ///< pixels; a multiple of the UNet's (8 x 2^(levels-1))
  int64_t height = 0;
  SamplerKind sampler = SamplerKind::ddim;
  /// kohya LoRA files (UNet modules, lora_unet_*) merged with their multiplier.
  std::vector<std::pair<std::string, double>> loras;
  std::string tokenizer_dir;  ///< folder with CLIP's vocab.json and merges.txt
  int64_t clip_skip = 0;      ///< SD 1.x; 0 = the run's, else 1
  enum class Prediction { automatic, epsilon, v } prediction = Prediction::automatic;
  at::Device device = at::kCPU;
};

/// What sample_ldm_checkpoint drew.
struct LdmSamples {
  at::Tensor images;  ///< uint8 [P*S, 3, H, W], row-major by prompt, on the CPU
  std::string architecture;
  bool tiny = false;
  int64_t width = 0, height = 0;
  bool v_prediction = false;
  std::string unet_dtype;  ///< the UNet's compute dtype ("fp32", "bf16", "fp16")
};

namespace models {
class LdmUNetImpl;
}

/// Draws one latent per seed, float32 [S, 4, height / 8, width / 8] on the
/// CPU, with `unet` (eval mode, no-grad; its weights' dtype and device) and
/// `sampler` over `levels` (sampling_levels): noise of seed s drawn on the
/// CPU, euler_a's per-step noise from a generator seeded s + 1. `context`
/// [G, 77, D] and (SDXL) `y` [G, adm] hold the prompt's conditioning first
/// and, when cfg != 1 (G = 2), the negative prompt's second; guidance
/// combines the two outputs as uncond + cfg (cond - uncond).
/// `v_prediction`: the UNet predicts v instead of epsilon. Throws
/// shoestring::Error when G does not fit cfg.
at::Tensor sample_ldm_latents(models::LdmUNetImpl& unet, const at::Tensor& context, const at::Tensor& y, double cfg,
                              const std::vector<uint64_t>& seeds, int64_t height, int64_t width, SamplerKind sampler,
                              const std::vector<NoiseLevel>& levels, bool v_prediction);

/// Whether `path` holds an LDM UNet of a trainable architecture (sd15,
/// sdxl, ssd1b; from its metadata or its tensor names and shapes).
bool is_ldm_checkpoint(const std::string& path);

/// Draws request.images.prompts x seeds images from the checkpoint at
/// `path`. The noise of seed s is drawn on the CPU (the same on every
/// device); euler_a's per-step noise comes from a generator seeded s + 1.
/// The UNet runs in bf16 on a CUDA device with native bf16 (fp16 on older
/// ones) and on a CPU with fast bf16 units when the file is bf16, else in
/// fp32; text encoders and VAE run in fp32.
/// Throws shoestring::Error naming the file (and the key) when it holds no
/// LDM UNet, VAE or text encoder (a step checkpoint's model.safetensors holds
/// the UNet only: sample from RUN_DIR/model.safetensors), when no tokenizer
/// is known (CLIP's files are not stored in checkpoints: pass
/// tokenizer_dir), when width / height do not fit the UNet, when a LoRA file
/// does not fit or holds text-encoder modules, and as generate_images for
/// bad prompts and non-finite output.
LdmSamples sample_ldm_checkpoint(const std::string& path, const LdmSampleRequest& request);

}  // namespace shoestring
