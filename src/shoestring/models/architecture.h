// The registry of model architectures: build one by name (on any device,
// including meta), its expected parameter count and the source of that
// number, the checkpoint key prefix it lives under, and detection of the
// architecture of a checkpoint from its tensor names and shapes.
//
// Adding an architecture is one entry in the table in architecture.cpp.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/nn/module.h>

#include "shoestring/models/denoiser_io.h"
#include "shoestring/nn/block_precision.h"
#include "shoestring/nn/layers.h"

namespace shoestring::models {

/// Builds a model. `tiny`: the same block structure with small widths (for
/// tests that train a few steps on the CPU).
using ArchitectureBuilder = std::function<std::shared_ptr<torch::nn::Module>(const nn::LayerInit& init, bool tiny)>;

/// One registered architecture.
struct Architecture {
  /// Registry name: "sd15", "sdxl", "ssd1b", "vae", "tiny-unet", ...
  std::string name;
  /// One line for humans.
  std::string description;
  /// Key prefix of the model inside the checkpoints it ships in, with the
  /// trailing dot ("model.diffusion_model." for LDM UNets, "first_stage_model."
  /// for the VAE); files holding only this model may omit it.
  std::string prefix;
  /// Expected number of parameters at full width (0: not pinned).
  int64_t parameters = 0;
  /// Where that number comes from.
  std::string parameters_source;
  ArchitectureBuilder build;
  /// Further prefixes the same model is stored under in other checkpoints
  /// (CLIP-L: SD 1.5's "cond_stage_model.transformer." and SDXL's
  /// "conditioner.embedders.0.transformer."); detection tries each.
  std::vector<std::string> other_prefixes{};

  // ---- planner: denoiser inputs and memory trace (plan/, bench/model_step) ----
  // Set for the denoisers (sd15, sdxl, ssd1b, sd35m, cascade-c,
  // cascade-c-lite); null / 0 / false for other models.
  /// Side of the square latent the VAE (or stage C's compression) makes of
  /// an image of `resolution` px; throws shoestring::Error for a resolution
  /// that does not fit (LDM / SD3.5: not divisible by 8).
  int64_t (*latent_side)(int64_t resolution) = nullptr;
  /// Text tokens of the cached conditioning: 77 (CLIP) for LDM UNets and
  /// stage C, 154 (77 CLIP-L/G + 77 T5) for SD3.5.
  int64_t context_tokens = 0;
  /// Random example inputs bound to the forward (models/denoiser_io.h).
  DenoiserExampleFn example = nullptr;
  /// The forward's memory trace (models/<model>_trace.cpp).
  DenoiserTraceFn trace = nullptr;
  /// Planned as the emoji model (train/DiffusionModel: caption encoder and a
  /// TinyUNet sized by the config's [model] keys; models::trace_text_to_image)
  /// rather than through `trace` (tiny-unet).
  bool planned_as_text_to_image = false;
};

/// The inputs of `arch`'s denoiser for `batch` images of `resolution` px
/// (latent side and context tokens of its row). Throws shoestring::Error when
/// `arch` is not a denoiser (no trace) or the resolution does not fit.
DenoiserBatch denoiser_batch(const Architecture& arch, int64_t batch, int64_t resolution);

/// The block tables (precision rules, checkpointing) of every denoiser in
/// `model`'s tree (itself or a submodule, e.g. under a checkpoint root), in
/// named_modules() order; empty when it holds none.
std::vector<nn::BlockTable*> block_tables(torch::nn::Module& model);

/// Every registered architecture, in table order.
const std::vector<Architecture>& architectures();

/// The architecture called `name`. Throws shoestring::Error listing the known names.
const Architecture& find_architecture(const std::string& name);

/// Builds architecture `name`; the module's named_parameters() are the keys
/// below the architecture's prefix. On LayerInit{torch::kMeta} no parameter
/// has storage. Throws shoestring::Error for unknown names.
std::shared_ptr<torch::nn::Module> build_architecture(const std::string& name, const nn::LayerInit& init = {},
                                                      bool tiny = false);

/// As build_architecture, registered under the architecture's prefix in an
/// otherwise empty root module, so that named_parameters() are the full
/// single-file checkpoint keys (e.g. "model.diffusion_model.out.2.weight").
std::shared_ptr<torch::nn::Module> build_checkpoint_root(const std::string& name, const nn::LayerInit& init = {},
                                                         bool tiny = false);

/// A tensor's name and shape (from a checkpoint header or a module).
struct TensorShape {
  TensorShape() = default;
  TensorShape(std::string n, std::vector<int64_t> s, bool is_parameter = true)
      : name(std::move(n)), shape(std::move(s)), parameter(is_parameter) {}
  std::string name;
  std::vector<int64_t> shape;
  /// False for buffers stored in checkpoints but not trained (e.g. MMDiT's pos_embed).
  bool parameter = true;
};

/// Parameter names (without the prefix) and shapes of `name`, built on meta
/// and cached. Throws shoestring::Error for unknown names.
const std::vector<TensorShape>& architecture_tensors(const std::string& name, bool tiny = false);

/// How well a checkpoint matches one architecture.
struct Detection {
  std::string architecture;
  bool tiny = false;
  /// The prefix the checkpoint stores the model under ("" when bare).
  std::string prefix;
  /// Expected tensors present with the expected shape.
  int64_t matched = 0;
  /// Expected tensors that are absent (full checkpoint names).
  std::vector<std::string> missing;
  /// Tensors under the prefix that the architecture does not have (for bare
  /// files: every tensor not expected).
  std::vector<std::string> unexpected;
  /// "name: expected [a, b], got [c, d]" for present tensors of another shape.
  std::vector<std::string> mismatched;
  /// True when nothing is missing, unexpected or mismatched.
  bool exact() const { return missing.empty() && unexpected.empty() && mismatched.empty(); }
};

/// Detects which registered architectures a checkpoint holds, from its tensor
/// names and shapes. For each key prefix (one model slot of a checkpoint, e.g.
/// the UNet and the VAE of an SD single file) reports the best-matching
/// architecture and width, if it matches at least half of that architecture's
/// tensors; best match = fewest missing + unexpected + mismatched tensors.
/// Prefixes are the registered ones plus each architecture's other_prefixes;
/// a bare file (no prefix) is reported once. Results are ordered by prefix as
/// registered (UNets before the VAE, the text encoders last).
std::vector<Detection> detect_architectures(const std::vector<TensorShape>& tensors);

}  // namespace shoestring::models
