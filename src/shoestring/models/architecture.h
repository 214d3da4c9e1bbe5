// The registry of model architectures: build one by name (on any device,
// including meta), its expected parameter count and the source of that
// number, the checkpoint key prefix it lives under, its family, whether a run
// config can train it, the identifiers written into saved files (kohya and
// Stability model-spec), its default objective and its conditioning shapes,
// and detection of the architecture of a checkpoint from its tensor names
// and shapes.
//
// Adding an architecture is one entry in the table in architecture.cpp. Code
// outside models/ asks the entry (family, flags, identifiers) instead of
// comparing architecture names.
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

struct LdmUNetOptions;
struct StageCOptions;

/// Registry name of the emoji example's model (the default model.architecture).
inline constexpr const char* kTinyUNet = "tiny-unet";

/// What kind of network an architecture is; each family has one module class.
enum class Family {
  tiny_unet,     ///< the emoji example's pixel-space TinyUNet (models/tiny_unet.h)
  ldm_unet,      ///< a Latent Diffusion UNet: SD 1.x, SDXL, SSD-1B (models/unet_ldm.h)
  mmdit,         ///< an SD3-style MMDiT (models/mmdit.h)
  stage_c,       ///< Stable Cascade's stage C (models/cascade.h)
  vae,           ///< an AutoencoderKL (models/vae.h)
  text_encoder,  ///< a CLIP text encoder (models/clip_text.h)
};

/// "tiny_unet", "ldm_unet", "mmdit", "stage_c", "vae", "text_encoder".
const char* to_string(Family family);

/// True for the families that are denoisers (tiny_unet, ldm_unet, mmdit,
/// stage_c): their modules implement models::Denoiser (models/denoiser.h).
bool is_denoiser(Family family);

/// The regression target an architecture is trained on by default.
enum class Objective {
  none,           ///< not a denoiser (VAE, text encoders)
  epsilon,        ///< DDPM noise prediction (SD 1.x / SDXL; v-prediction is a config switch); Stable Cascade's stage C
  flow_matching,  ///< rectified flow, velocity eps - x0 (SD3; the emoji example)
};

/// "none", "epsilon", "flow_matching" (the spelling of the saved files' `objective` metadata).
const char* to_string(Objective objective);

/// Static shapes of a denoiser's inputs at full width (0: not static or not
/// applicable; tiny widths differ). Units: channels, pixels per latent
/// pixel, tokens, features.
struct Conditioning {
  /// Channels of the denoiser's input x (latent channels; 3 for pixel space).
  int64_t latent_channels = 0;
  /// Image pixels per latent pixel along one side (8 for the SD VAE, 1 for
  /// pixel space, 32 for Stable Cascade's EfficientNet: 768 px -> 24).
  int64_t vae_downscale = 0;
  /// Text tokens of the cross-attention context (CLIP: 77; SD3: 77 CLIP + 77 T5 = 154).
  int64_t context_tokens = 0;
  /// Width of the cross-attention context (for text encoders: their hidden width).
  int64_t context_width = 0;
  /// Width of the vector conditioning (LDM `y` / adm_in_channels, MMDiT pooled
  /// text, Stable Cascade clip_text_pooled; for text encoders: the pooled output).
  int64_t pooled_width = 0;
};

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
  ArchitectureBuilder build{};
  /// Further prefixes the same model is stored under in other checkpoints
  /// (CLIP-L: SD 1.5's "cond_stage_model.transformer." and SDXL's
  /// "conditioner.embedders.0.transformer."); detection tries each.
  std::vector<std::string> other_prefixes{};

  // ---- family, training and saved-file identity ----
  Family family = Family::ldm_unet;
  /// True when `shoestring train` can train it from a run config
  /// (make_training_model): tiny-unet, sd15, sdxl, ssd1b.
  bool trainable_from_config = false;
  /// kohya's `ss_base_model_version` for LoRA files of this base ("sd_v1",
  /// "sdxl_base_v1-0": A1111 and ComfyUI tell SDXL LoRAs by it); "" where
  /// kohya has none (the caller writes "shoestring_<name>").
  std::string kohya_base_model_version{};
  /// Stability's model-spec `modelspec.architecture` of full model files
  /// ("stable-diffusion-v1", "stable-diffusion-xl-v1-base", "segmind-ssd-1b");
  /// "" = no model-spec metadata.
  std::string modelspec_architecture{};
  /// The same for LoRA files ("stable-diffusion-v1/lora",
  /// "stable-diffusion-xl-v1-base/lora", also for SSD-1B); "" = none.
  std::string modelspec_lora_architecture{};
  /// What it is trained on by default.
  Objective default_objective = Objective::none;
  /// Static input shapes at full width.
  Conditioning conditioning{};
  /// The LDM UNet preset (Family::ldm_unet only; nullptr otherwise); see ldm_unet_options().
  LdmUNetOptions (*ldm_preset)() = nullptr;

  // ---- planner: denoiser inputs and memory trace (plan/, bench/model_step) ----
  // Set per family for the ldm_unet, mmdit and stage_c denoisers (null for
  // other models; tiny-unet is planned from the run config through
  // models::trace_text_to_image). Context tokens: conditioning.context_tokens.
  /// Side of the square latent the VAE (or stage C's compression) makes of
  /// an image of `resolution` px; throws shoestring::Error for a resolution
  /// that does not fit (LDM / SD3.5: not divisible by 8).
  int64_t (*latent_side)(int64_t resolution) = nullptr;
  /// Random example inputs bound to the forward (models/denoiser_io.h).
  DenoiserExampleFn example = nullptr;
  /// The forward's memory trace (models/<model>_trace.cpp).
  DenoiserTraceFn trace = nullptr;
};

/// The inputs of `arch`'s denoiser for `batch` images of `resolution` px
/// (latent side and context tokens of its row). Throws shoestring::Error when
/// `arch` is not a denoiser (no trace) or the resolution does not fit.
DenoiserBatch denoiser_batch(const Architecture& arch, int64_t batch, int64_t resolution);

/// Every registered architecture, in table order.
const std::vector<Architecture>& architectures();

/// The architecture called `name`. Throws shoestring::Error listing the known names.
const Architecture& find_architecture(const std::string& name);

/// Names of the denoiser architectures (is_denoiser(family)), grouped by family
/// in Family order (tiny_unet, ldm_unet, mmdit, stage_c), in table order within
/// a family; with `trainable_only`, only those trainable_from_config.
/// E.g. {"tiny-unet", "sd15", "sdxl", "ssd1b", "sd35m", "cascade-c", "cascade-c-lite"}.
std::vector<std::string> denoiser_architectures(bool trainable_only = false);

/// `names` joined by ", " (for messages: "sd15, sdxl, ssd1b").
std::string join_names(const std::vector<std::string>& names);

/// The LdmUNetOptions of LDM UNet architecture `name` (its preset; with
/// `tiny`, LdmUNetOptions::tiny() of it). Throws shoestring::Error for
/// unknown names and for architectures of another family.
LdmUNetOptions ldm_unet_options(const std::string& name, bool tiny = false);

/// The StageCOptions of Stable Cascade architecture `name` (cascade-c,
/// cascade-c-lite; with `tiny`, StageCOptions::tiny()). Throws
/// shoestring::Error for unknown names and architectures of another family.
StageCOptions stage_c_options(const std::string& name, bool tiny = false);

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
