// Text-to-image sampling with a trained TinyUNetModel: Euler integration of
// the flow-matching ODE with classifier-free guidance (see flow_matching.h),
// and the sample grid written during training and by `shoestring sample`.
#pragma once
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "shoestring/train/tiny_unet_model.h"

namespace shoestring {

class WordTokenizer;

/// What to sample: every prompt with every seed.
struct SampleRequest {
  std::vector<std::string> prompts;
  std::vector<uint64_t> seeds;  ///< the noise of seed s is the same for every prompt
  int64_t steps = 30;           ///< sampler steps (Euler; DDIM for the LDM UNets)
  double cfg = 4.0;             ///< guidance scale; 1 disables the unconditional pass
  int64_t max_batch = 64;       ///< images per forward pass (memory bound)
};

/// Generates prompts.size() x seeds.size() images, row-major by prompt.
/// Returns uint8 [P*S, 3, R, R] with R the model's training resolution.
/// The model is put in eval mode for the duration and restored after; runs
/// under no-grad; does not touch libtorch's global RNG (noise comes from a
/// generator per seed). Throws shoestring::Error for an empty request, a
/// prompt that is not valid UTF-8 (naming it and the byte), or when the model
/// produced a non-finite value (see samples_to_uint8).
/// Runs on the model's device (module_device); noise is drawn on the CPU and
/// moved, so a seed gives the same starting noise on every device; the
/// result is on the CPU.
at::Tensor generate_images(TinyUNetModel& model, const WordTokenizer& tokenizer, const SampleRequest& request);

/// The device of a module's first parameter (else its first buffer; the CPU
/// for a module with neither).
at::Device module_device(const torch::nn::Module& module);

/// Sampled images, floating [P*S, 3, R, R] in about [-1, 1] (row-major by
/// prompt as generate_images), to uint8 [P*S, 3, R, R]: (clamp(x, -1, 1) + 1)
/// * 127.5, rounded. Throws shoestring::Error if any value is NaN or
/// infinite (a cast would turn them into black or arbitrary pixels), naming
/// the first such image's prompt and seed, how many of its R*R pixels are
/// non-finite (a pixel: any of its channels), and how many of the images are
/// affected; also if the tensor's first dimension is not P*S.
at::Tensor samples_to_uint8(const at::Tensor& images, const SampleRequest& request);

/// Writes a grid (rows = prompts, columns = seeds) with each prompt printed
/// under its row, and a sidecar `<path minus .png>.txt` listing row prompts and
/// seeds: a header line, then one line per prompt, with newlines and other
/// control characters escaped (core/text.h printable) so that line i + 1 is
/// always row i's prompt. Images smaller than 64 px are enlarged (nearest) for legibility.
/// Both files are written atomically.
void save_sample_grid(const std::string& path, const at::Tensor& images, const SampleRequest& request);

}  // namespace shoestring
