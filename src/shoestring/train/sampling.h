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
/// generator per seed). Throws shoestring::Error for an empty request.
at::Tensor generate_images(TinyUNetModel& model, const WordTokenizer& tokenizer, const SampleRequest& request);

/// Writes a grid (rows = prompts, columns = seeds) with each prompt printed
/// under its row, and a sidecar `<path minus .png>.txt` listing row prompts and
/// seeds. Images smaller than 64 px are enlarged (nearest) for legibility.
/// Both files are written atomically.
void save_sample_grid(const std::string& path, const at::Tensor& images, const SampleRequest& request);

}  // namespace shoestring
