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
};

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
