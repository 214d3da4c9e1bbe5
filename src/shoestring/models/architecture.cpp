#include "shoestring/models/architecture.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <optional>
#include <unordered_map>

#include <fmt/format.h>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/units.h"
#include "shoestring/models/cascade.h"
#include "shoestring/models/clip_text.h"
#include "shoestring/models/mmdit.h"
#include "shoestring/models/tiny_unet.h"
#include "shoestring/models/unet_ldm.h"
#include "shoestring/models/vae.h"
#include "shoestring/nn/key_layout.h"

namespace shoestring::models {
namespace {

ArchitectureBuilder ldm_unet(LdmUNetOptions (*preset)()) {
  return [preset](const nn::LayerInit& init, bool tiny) -> std::shared_ptr<torch::nn::Module> {
    LdmUNetOptions o = preset();
    if (tiny) o = o.tiny();
    return LdmUNet(o.init(init)).ptr();
  };
}

std::shared_ptr<torch::nn::Module> build_vae(const nn::LayerInit& init, bool tiny) {
  VaeOptions o;
  if (tiny) o = o.tiny();
  return AutoencoderKL(o.init(init)).ptr();
}

std::shared_ptr<torch::nn::Module> build_sd3_vae(const nn::LayerInit& init, bool tiny) {
  VaeOptions o = VaeOptions::sd3();
  if (tiny) o = o.tiny();
  return AutoencoderKL(o.init(init)).ptr();
}

ArchitectureBuilder clip_text(ClipTextOptions (*preset)()) {
  return [preset](const nn::LayerInit& init, bool tiny) -> std::shared_ptr<torch::nn::Module> {
    ClipTextOptions o = preset();
    if (tiny) o = o.tiny();
    return ClipTextModel(o.init(init)).ptr();
  };
}

std::shared_ptr<torch::nn::Module> build_tiny_unet(const nn::LayerInit& init, bool tiny) {
  TinyUNetOptions o;
  if (tiny) o.base_channels(32).num_heads(2).context_dim(64);
  return TinyUNet(o.init(init)).ptr();
}

// Latent sides: the SD VAE and SD3.5's VAE downscale by 8; stage C's
// EfficientNet by 32, with resolution the image it sees (as the trainer feeds
// it, train/cascade_model.cpp): Stability trains at 768 px for 24 x 24
// latents, which stage B decodes to 1024 px.
int64_t vae8_latent_side(int64_t resolution) {
  if (resolution < 8 || resolution % 8 != 0)
    fail("resolution {} is not a positive multiple of 8 (VAE factor 8)", resolution);
  return resolution / 8;
}
int64_t stage_c_latent_side(int64_t resolution) {
  if (resolution < 32 || resolution % 32 != 0)
    fail("resolution {} is not a positive multiple of 32 (Stable Cascade's EfficientNet factor 32)", resolution);
  return resolution / 32;
}

// Sets the family-and-identity block of `a` (see Architecture) and returns it.
Architecture with(Architecture a, Family family, bool trainable, Objective objective, Conditioning conditioning,
                  std::string kohya = "", std::string modelspec = "", std::string modelspec_lora = "") {
  a.family = family;
  a.trainable_from_config = trainable;
  a.default_objective = objective;
  a.conditioning = conditioning;
  a.kohya_base_model_version = std::move(kohya);
  a.modelspec_architecture = std::move(modelspec);
  a.modelspec_lora_architecture = std::move(modelspec_lora);
  return a;
}

Architecture ldm(Architecture a, LdmUNetOptions (*preset)(), Conditioning conditioning, std::string kohya,
                 std::string modelspec, std::string modelspec_lora) {
  a.build = ldm_unet(preset);
  a.ldm_preset = preset;
  return with(std::move(a), Family::ldm_unet, /*trainable=*/true, Objective::epsilon, conditioning, std::move(kohya),
              std::move(modelspec), std::move(modelspec_lora));
}

// The registry. Parameter counts: LDM UNets and the VAE are the counts of the
// released checkpoints (sum of numel over the tensors under the prefix).
// Conditioning: {latent channels, VAE downscale, context tokens, context
// width, pooled / y width}, at full width.
std::vector<Architecture> make_registry() {
  std::vector<Architecture> rows = {
      ldm({"sd15", "Stable Diffusion 1.5 UNet (LDM layout)", "model.diffusion_model.", 859'520'964,
           "runwayml/stable-diffusion-v1-5 UNet (v1-5-pruned.safetensors; diffusers "
           "UNet2DConditionModel.num_parameters())"},
          &LdmUNetOptions::sd15, {4, 8, 77, 768, 0}, "sd_v1", "stable-diffusion-v1", "stable-diffusion-v1/lora"),
      ldm({"sdxl", "Stable Diffusion XL base 1.0 UNet (LDM layout)", "model.diffusion_model.", 2'567'463'684,
           "stabilityai/stable-diffusion-xl-base-1.0 UNet (sd_xl_base_1.0.safetensors; diffusers "
           "UNet2DConditionModel.num_parameters())"},
          &LdmUNetOptions::sdxl, {4, 8, 77, 2048, 2816}, "sdxl_base_v1-0", "stable-diffusion-xl-v1-base",
          "stable-diffusion-xl-v1-base/lora"),
      // SSD-1B LoRAs load as SDXL ones (same kohya and LoRA model-spec ids).
      ldm({"ssd1b", "Segmind SSD-1B UNet (SDXL with blocks removed, LDM layout)", "model.diffusion_model.",
           1'331'334'404,
           "segmind/SSD-1B ('1.3B'); exact: the SDXL count minus the removed blocks (34 transformer blocks at "
           "1280 ch, 2 at 640 ch, middle_block.1 shell and middle_block.2), see tests/models/test_architectures.cpp"},
          &LdmUNetOptions::ssd1b, {4, 8, 77, 2048, 2816}, "sdxl_base_v1-0", "segmind-ssd-1b",
          "stable-diffusion-xl-v1-base/lora"),
      with({"vae", "Stable Diffusion VAE (AutoencoderKL, LDM layout; SD 1.x and SDXL)", "first_stage_model.",
            83'653'863, "stabilityai/sd-vae-ft-mse / sdxl-vae AutoencoderKL (diffusers num_parameters())", &build_vae},
           Family::vae, false, Objective::none, {4, 8, 0, 0, 0}),
      with({"sd3-vae", "SD3 / SD3.5 VAE (AutoencoderKL, 16 latent channels, no quant convs)", "first_stage_model.",
            83'819'683,
            "Stability-AI/sd3.5 sd3_impls.py SDVAE with the diffusers vae config of stable-diffusion-3.5-medium "
            "(latent_channels 16, use_quant_conv false); the SD VAE's count without the quant convs, with 16 "
            "latent channels (tests/models/test_vae_sd3.cpp)",
            &build_sd3_vae},
           Family::vae, false, Objective::none, {16, 8, 0, 0, 0}),
      with({"cascade-c", "Stable Cascade stage C 3.6B (stage_c.safetensors; keys without prefix)", "", 3'589'103'632,
            "Stability-AI/StableCascade modules/stage_c.py with stabilityai/stable-cascade-prior prior/config.json "
            "(no exact public count; agrees with '3.6B' and the 14.4 GB fp32 file)",
            [](const nn::LayerInit& i, bool tiny) -> std::shared_ptr<torch::nn::Module> {
              return StageC(tiny ? StageCOptions::tiny() : StageCOptions::cascade_c(), i).ptr();
            }},
           Family::stage_c, true, Objective::epsilon, {16, 32, 77, 1280, 1280}),
      with({"cascade-c-lite", "Stable Cascade stage C lite 1B (stage_c_lite.safetensors; keys without prefix)", "",
            1'030'785'040,
            "StableCascade train/train_c.py '1B' = stable-cascade-prior prior_lite/config.json (no exact public "
            "count; agrees with '1B' and the 4.12 GB fp32 file)",
            [](const nn::LayerInit& i, bool tiny) -> std::shared_ptr<torch::nn::Module> {
              return StageC(tiny ? StageCOptions::tiny() : StageCOptions::cascade_c_lite(), i).ptr();
            }},
           Family::stage_c, true, Objective::epsilon, {16, 32, 77, 1280, 1280}),
      with({"sd35m", "Stable Diffusion 3.5 Medium MMDiT-X", "model.diffusion_model.", 2'243'171'520,
            "stabilityai/stable-diffusion-3.5-medium SD3Transformer2DModel parameter count; the file adds the "
            "226,492,416-element pos_embed buffer",
            [](const nn::LayerInit& i, bool tiny) -> std::shared_ptr<torch::nn::Module> {
              return MMDiT(tiny ? MMDiTOptions::tiny() : MMDiTOptions::sd35_medium(), i).ptr();
            }},
           Family::mmdit, true, Objective::flow_matching, {16, 8, 154, 4096, 2048}),
      // Pixel space; its caption length and width come from the run config.
      with({kTinyUNet, "shoestring TinyUNet with default options (the emoji example's model)", "unet.", 24'805'379,
            "this project's TinyUNetOptions defaults (printed by TinyUNet.DefaultsHaveTenToFortyMillionParameters)",
            &build_tiny_unet},
           Family::tiny_unet, true, Objective::flow_matching, {3, 1, 0, 0, 0}),
      with({"clip-l",
            "OpenAI CLIP ViT-L/14 text encoder (Hugging Face CLIPTextModel layout; SD 1.x, SDXL embedder 0)",
            kSd15ClipPrefix,
            123'060'480,
            "openai/clip-vit-large-patch14 text config (width 768, 12 layers, MLP 3072, vocab 49408, 77 positions); "
            "= diffusers text_encoder.num_parameters() of runwayml/stable-diffusion-v1-5; files may add the "
            "77-element position_ids buffer",
            clip_text(&ClipTextOptions::clip_l),
            {kSdxlClipLPrefix}},
           Family::text_encoder, false, Objective::none, {0, 0, 77, 768, 768}),
      with({"clip-g", "OpenCLIP ViT-bigG-14 text encoder (OpenCLIP layout; SDXL embedder 1)", kSdxlClipGPrefix,
            694'659'840,
            "open_clip ViT-bigG-14.json text_cfg (width 1280, 32 layers, MLP 5120) with the 1280x1280 "
            "text_projection; = diffusers text_encoder_2 (CLIPTextModelWithProjection) of "
            "stabilityai/stable-diffusion-xl-base-1.0; the file adds the scalar logit_scale",
            clip_text(&ClipTextOptions::clip_g)},
           Family::text_encoder, false, Objective::none, {0, 0, 77, 1280, 1280}),
  };
  // ---- planner: denoiser inputs and memory traces (models/<model>_trace.cpp), per family ----
  for (Architecture& a : rows) {
    switch (a.family) {
      case Family::ldm_unet:
        a.latent_side = &vae8_latent_side;
        a.example = &ldm_unet_example;
        a.trace = &trace_ldm_unet;
        break;
      case Family::mmdit:
        a.latent_side = &vae8_latent_side;
        a.example = &mmdit_example;
        a.trace = &trace_mmdit;
        break;
      case Family::stage_c:
        a.latent_side = &stage_c_latent_side;
        a.example = &stage_c_example;
        a.trace = &trace_stage_c;
        break;
      default:  // tiny-unet is planned from the run config (models::trace_text_to_image)
        break;
    }
  }
  return rows;
}

std::vector<TensorShape> shapes_of(const torch::nn::Module& m) {
  std::vector<TensorShape> out;
  for (const auto& p : m.named_parameters(/*recurse=*/true)) out.push_back({p.key(), p.value().sizes().vec(), true});
  for (const auto& b : m.named_buffers(/*recurse=*/true)) out.push_back({b.key(), b.value().sizes().vec(), false});
  return out;
}

}  // namespace

const std::vector<Architecture>& architectures() {
  static const std::vector<Architecture> registry = make_registry();
  return registry;
}

const char* to_string(Family family) {
  switch (family) {
    case Family::tiny_unet: return "tiny_unet";
    case Family::ldm_unet: return "ldm_unet";
    case Family::mmdit: return "mmdit";
    case Family::stage_c: return "stage_c";
    case Family::vae: return "vae";
    case Family::text_encoder: return "text_encoder";
  }
  return "?";
}

bool is_denoiser(Family family) {
  return family == Family::tiny_unet || family == Family::ldm_unet || family == Family::mmdit ||
         family == Family::stage_c;
}

const char* to_string(Objective objective) {
  switch (objective) {
    case Objective::none: return "none";
    case Objective::epsilon: return "epsilon";
    case Objective::flow_matching: return "flow_matching";
  }
  return "?";
}

std::vector<std::string> denoiser_architectures(bool trainable_only) {
  std::vector<std::string> names;
  for (Family f : {Family::tiny_unet, Family::ldm_unet, Family::mmdit, Family::stage_c}) {
    for (const auto& a : architectures()) {
      if (a.family == f && (a.trainable_from_config || !trainable_only)) names.push_back(a.name);
    }
  }
  return names;
}

std::string join_names(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

LdmUNetOptions ldm_unet_options(const std::string& name, bool tiny) {
  const Architecture& a = find_architecture(name);
  if (a.family != Family::ldm_unet || !a.ldm_preset) {
    fail("architecture '{}' is a {}, not an LDM UNet", name, to_string(a.family));
  }
  LdmUNetOptions o = a.ldm_preset();
  return tiny ? o.tiny() : o;
}

StageCOptions stage_c_options(const std::string& name, bool tiny) {
  const Architecture& a = find_architecture(name);
  if (a.family != Family::stage_c)
    fail("architecture '{}' is a {}, not Stable Cascade's stage C", name, to_string(a.family));
  if (tiny) return StageCOptions::tiny();
  return name == "cascade-c-lite" ? StageCOptions::cascade_c_lite() : StageCOptions::cascade_c();
}

const Architecture& find_architecture(const std::string& name) {
  std::string known;
  for (const auto& a : architectures()) {
    if (a.name == name) return a;
    known += (known.empty() ? "" : ", ") + a.name;
  }
  fail("unknown architecture '{}'; known: {}", name, known);
}

DenoiserBatch denoiser_batch(const Architecture& arch, int64_t batch, int64_t resolution) {
  if (!arch.trace || !arch.latent_side) fail("architecture '{}' is not a denoiser with known inputs", arch.name);
  DenoiserBatch b;
  b.batch = batch;
  b.latent_side = arch.latent_side(resolution);
  b.context_tokens = arch.conditioning.context_tokens;
  return b;
}

std::shared_ptr<torch::nn::Module> build_architecture(const std::string& name, const nn::LayerInit& init, bool tiny) {
  return find_architecture(name).build(init, tiny);
}

std::shared_ptr<torch::nn::Module> build_checkpoint_root(const std::string& name, const nn::LayerInit& init,
                                                         bool tiny) {
  const Architecture& a = find_architecture(name);
  auto root = std::make_shared<torch::nn::Module>("CheckpointRoot");
  std::string path = a.prefix;
  if (!path.empty() && path.back() == '.') path.pop_back();
  if (path.empty()) fail("architecture '{}' has no key prefix to register under", name);
  nn::register_at(*root, path, a.build(init, tiny));
  return root;
}

const std::vector<TensorShape>& architecture_tensors(const std::string& name, bool tiny) {
  static std::mutex mutex;
  static std::map<std::pair<std::string, bool>, std::vector<TensorShape>> cache;
  const Architecture& a = find_architecture(name);
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find({name, tiny});
  if (it == cache.end()) it = cache.emplace(std::make_pair(name, tiny), shapes_of(*a.build(torch::kMeta, tiny))).first;
  return it->second;
}

std::vector<Detection> detect_architectures(const std::vector<TensorShape>& tensors) {
  std::unordered_map<std::string, const std::vector<int64_t>*> by_name;
  for (const auto& t : tensors) by_name[t.name] = &t.shape;

  // Matches `arch` against the tensors stored under `prefix` ("" = bare file).
  auto match = [&](const Architecture& arch, bool tiny, const std::string& prefix) {
    Detection d;
    d.architecture = arch.name;
    d.tiny = tiny;
    d.prefix = prefix;
    const auto& expected = architecture_tensors(arch.name, tiny);
    std::unordered_map<std::string, const std::vector<int64_t>*> want;
    for (const auto& e : expected) want[e.name] = &e.shape;
    for (const auto& t : tensors) {
      if (t.name.compare(0, prefix.size(), prefix) != 0) continue;
      auto w = want.find(t.name.substr(prefix.size()));
      if (w == want.end()) {
        d.unexpected.push_back(t.name);
      } else if (*w->second == t.shape) {
        ++d.matched;
      } else {
        d.mismatched.push_back(
            fmt::format("{}: expected {}, got {}", t.name, format_shape(*w->second), format_shape(t.shape)));
      }
    }
    for (const auto& e : expected) {
      if (!by_name.count(prefix + e.name)) d.missing.push_back(prefix + e.name);
    }
    return d;
  };
  auto errors = [](const Detection& d) { return d.missing.size() + d.unexpected.size() + d.mismatched.size(); };

  auto stored_under = [](const Architecture& a, const std::string& prefix) {
    return a.prefix == prefix ||
           std::find(a.other_prefixes.begin(), a.other_prefixes.end(), prefix) != a.other_prefixes.end();
  };
  std::vector<std::string> prefixes;
  for (const auto& a : architectures()) {
    std::vector<std::string> all{a.prefix};
    all.insert(all.end(), a.other_prefixes.begin(), a.other_prefixes.end());
    for (const auto& p : all) {
      if (std::find(prefixes.begin(), prefixes.end(), p) == prefixes.end()) prefixes.push_back(p);
    }
  }
  std::vector<Detection> found;
  for (const auto& prefix : prefixes) {
    std::optional<Detection> best;
    for (const auto& a : architectures()) {
      if (!stored_under(a, prefix)) continue;
      for (bool tiny : {false, true}) {
        const int64_t n = static_cast<int64_t>(architecture_tensors(a.name, tiny).size());
        for (const std::string& p : {prefix, std::string()}) {
          Detection d = match(a, tiny, p);
          if (d.matched * 2 < n) continue;
          if (!best || errors(d) < errors(*best) || (errors(d) == errors(*best) && d.matched > best->matched)) {
            best = std::move(d);
          }
        }
      }
    }
    // A bare file matches under every prefix of its architecture: report it once.
    const bool seen = best && std::any_of(found.begin(), found.end(), [&](const Detection& f) {
                        return f.architecture == best->architecture && f.prefix == best->prefix;
                      });
    if (best && !seen) found.push_back(std::move(*best));
  }
  return found;
}

}  // namespace shoestring::models
