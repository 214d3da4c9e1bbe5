#include "shoestring/train/ldm_sampling.h"

#include <filesystem>
#include <map>
#include <optional>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "shoestring/core/cpu_features.h"
#include "shoestring/core/device.h"
#include "shoestring/core/error.h"
#include "shoestring/core/text.h"
#include "shoestring/core/utf8.h"
#include "shoestring/io/weight_files.h"
#include "shoestring/models/architecture.h"
#include "shoestring/nn/fp8_storage.h"
#include "shoestring/nn/key_layout.h"
#include "shoestring/nn/lora.h"
#include "shoestring/precision/compute_choice.h"
#include "shoestring/train/config.h"
#include "shoestring/train/ddpm.h"
#include "shoestring/train/ldm_components.h"

namespace shoestring {

namespace fs = std::filesystem;

namespace {

constexpr const char* kUNetPrefix = "model.diffusion_model.";

bool starts_with(const std::string& s, const std::string& p) { return s.compare(0, p.size(), p) == 0; }

struct FoundUNet {
  std::string architecture;
  bool tiny = false;
  std::string prefix;
};

/// The trainable LDM UNet the file holds, if any: the detection its
/// metadata's architecture names, else the first LDM UNet detected.
std::optional<FoundUNet> find_ldm_unet(const WeightFiles& file) {
  std::vector<models::TensorShape> shapes;
  for (const auto& name : file.names()) shapes.emplace_back(name, file.find(name)->shape);
  const auto meta = file.metadata().find("architecture");
  std::optional<FoundUNet> first;
  for (const auto& d : models::detect_architectures(shapes)) {
    const models::Architecture& a = models::find_architecture(d.architecture);
    if (a.family != models::Family::ldm_unet || !a.trainable_from_config) continue;
    FoundUNet f{d.architecture, d.tiny, d.prefix};
    if (meta != file.metadata().end() && meta->second == d.architecture) return f;
    if (!first) first = f;
  }
  return first;
}

/// The config of the run `path` belongs to: RUN_DIR/config.toml for a final
/// file (RUN_DIR/model.safetensors) or a step checkpoint's
/// (RUN_DIR/checkpoints/step-N/model.safetensors).
std::optional<TrainConfig> run_config_of(const std::string& path) {
  const fs::path folder = fs::absolute(fs::path(path)).parent_path();
  fs::path config = folder / "config.toml";
  if (!fs::exists(config) && folder.parent_path().filename() == "checkpoints") {
    config = folder.parent_path().parent_path() / "config.toml";
  }
  if (!fs::exists(config)) return std::nullopt;
  try {
    return load_config(config.string());
  } catch (const Error& e) {
    spdlog::warn("{}: not used for sampling defaults: {}", config.string(), e.what());
    return std::nullopt;
  }
}

/// The UNet's compute dtype (see sample_ldm_checkpoint).
at::ScalarType unet_dtype(const at::Device& device, const WeightFiles& file, const std::string& prefix) {
  if (device.is_cuda()) {
    const auto cc = cuda_compute_capability(device);
    return cc && cuda_capability_has_bf16(cc->first, cc->second) ? torch::kBFloat16 : torch::kHalf;
  }
  at::ScalarType stored = torch::kFloat32;
  for (const auto& name : file.names()) {
    if (starts_with(name, prefix)) {
      stored = file.find(name)->dtype == StDtype::BF16 ? torch::kBFloat16 : torch::kFloat32;
      break;
    }
  }
  const bool fast_bf16 =
      !precision::choose_bf16_compute(precision::Bf16Compute::automatic, precision::cpu_hardware(cpu_features()))
           .has_value();
  return stored == torch::kBFloat16 && fast_bf16 ? torch::kBFloat16 : torch::kFloat32;
}

const char* dtype_name(at::ScalarType t) {
  return t == torch::kBFloat16 ? "bf16" : t == torch::kHalf ? "fp16" : "fp32";
}

/// Refuses a LoRA file with modules outside the UNet before any merge.
void check_unet_lora(const std::string& path) {
  const WeightFiles lora = WeightFiles::open(path);
  int64_t text_keys = 0;
  std::string example;
  for (const auto& name : lora.names()) {
    if (starts_with(name, "lora_unet_")) continue;
    if (starts_with(name, "lora_te")) {
      if (text_keys++ == 0) example = name;
      continue;
    }
    fail("--lora {}: key '{}' is not a kohya LoRA module of the UNet (lora_unet_*)", path, name);
  }
  if (text_keys > 0) {
    fail(
        "--lora {}: holds {} text-encoder tensors (e.g. '{}'); `shoestring sample` merges UNet LoRA modules "
        "(lora_unet_*) only, which is what shoestring trains for the LDM UNets; text-encoder LoRA is not applied yet",
        path, text_keys, example);
  }
}

}  // namespace

at::Tensor sample_ldm_latents(models::LdmUNetImpl& unet, const at::Tensor& context, const at::Tensor& y, double cfg,
                              const std::vector<uint64_t>& seeds, int64_t height, int64_t width, SamplerKind sampler,
                              const std::vector<NoiseLevel>& levels, bool v_prediction) {
  const bool guided = cfg != 1.0;
  const int64_t g = context.size(0);
  if (g != (guided ? 2 : 1)) fail("internal: {} conditioning rows for cfg {}", g, cfg);
  torch::NoGradGuard no_grad;
  const at::Tensor& weight = unet.out_conv->weight;
  const at::ScalarType dtype = nn::value_dtype(weight);
  const at::Device device = weight.device();
  std::vector<at::Tensor> out;
  for (const uint64_t s : seeds) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(s);
    at::Tensor noise = torch::randn({1, 4, height / 8, width / 8}, gen, torch::kFloat32).to(device);
    auto step_gen = at::make_generator<at::CPUGeneratorImpl>(s + 1);
    DenoiseFn denoise = [&](const at::Tensor& x, const NoiseLevel& level) {
      at::Tensor in = model_input(x, level.sigma);
      if (guided) in = torch::cat({in, in}, 0);
      at::Tensor t = torch::full({g}, level.timestep, x.options());
      at::Tensor eps = unet.forward(in.to(dtype), t, context, y).to(torch::kFloat32);
      if (guided) eps = (eps[1] + cfg * (eps[0] - eps[1])).unsqueeze(0);
      return denoised_from_output(x, eps, level.sigma, v_prediction);
    };
    out.push_back(run_sampler(sampler, denoise, noise, levels, &step_gen).to(at::kCPU));
  }
  return torch::cat(out, 0);
}

bool is_ldm_checkpoint(const std::string& path) { return find_ldm_unet(WeightFiles::open(path)).has_value(); }

LdmSamples sample_ldm_checkpoint(const std::string& path, const LdmSampleRequest& request) {
  const SampleRequest& req = request.images;
  if (req.prompts.empty() || req.seeds.empty()) fail("sample: no prompts or no seeds given");
  require_utf8_prompt(request.negative_prompt, "the negative prompt");
  std::vector<SamplePrompt> prompts;
  for (size_t i = 0; i < req.prompts.size(); ++i) {
    require_utf8_prompt(req.prompts[i], fmt::format("prompt {}", i + 1));
    prompts.push_back(parse_sample_prompt(req.prompts[i], fmt::format("prompt {}", i + 1)));
    if (prompts.back().negative.empty()) prompts.back().negative = request.negative_prompt;
    const SamplePrompt& p = prompts.back();
    if (i > 0 && (p.width != prompts[0].width || p.height != prompts[0].height)) {
      fail("prompt {}: --w {} --h {} differs from prompt 1's --w {} --h {}: the rows of one grid share a size", i + 1,
           p.width, p.height, prompts[0].width, prompts[0].height);
    }
  }
  // Every text to encode once: prompts, then negatives.
  std::vector<std::string> texts;
  std::map<std::string, int64_t> text_row;
  auto row_of = [&](const std::string& t) {
    auto [it, added] = text_row.emplace(t, static_cast<int64_t>(texts.size()));
    if (added) texts.push_back(t);
    return it->second;
  };
  for (const SamplePrompt& p : prompts) row_of(p.prompt);
  for (const SamplePrompt& p : prompts) row_of(p.negative);
  const WeightFiles file = WeightFiles::open(path);
  const std::optional<FoundUNet> found = find_ldm_unet(file);
  if (!found) {
    fail("{}: holds no SD 1.5 / SDXL / SSD-1B UNet (`shoestring inspect {}` shows what it holds)", path, path);
  }
  const std::optional<TrainConfig> run = run_config_of(path);
  const models::LdmUNetOptions unet_options = models::ldm_unet_options(found->architecture, found->tiny);
  const bool sdxl = unet_options.adm_in_channels() > 0;

  LdmSamples out;
  out.architecture = found->architecture;
  out.tiny = found->tiny;

  // ---- settings: the request, else the run's config, else the file, else defaults ----
  const auto& meta = file.metadata();
  auto meta_is = [&](const char* key, const char* value) {
    auto it = meta.find(key);
    return it != meta.end() && it->second == value;
  };
  switch (request.prediction) {
    case LdmSampleRequest::Prediction::epsilon: out.v_prediction = false; break;
    case LdmSampleRequest::Prediction::v: out.v_prediction = true; break;
    case LdmSampleRequest::Prediction::automatic:
      out.v_prediction = meta_is("objective", "v_prediction") || meta_is("modelspec.prediction_type", "v") ||
                         (run && run->v_parameterization);
      break;
  }
  const int64_t default_size = found->tiny ? (sdxl ? 32 : 64) : (sdxl ? 1024 : 512);
  const int64_t run_size = run ? run->resolution : 0;
  out.width = prompts[0].width > 0 ? prompts[0].width
              : request.width > 0  ? request.width
              : run_size > 0       ? run_size
                                   : default_size;
  out.height = prompts[0].height > 0 ? prompts[0].height
               : request.height > 0  ? request.height
               : run_size > 0        ? run_size
                                     : default_size;
  const int64_t levels = static_cast<int64_t>(unet_options.channel_mult().size());
  const int64_t multiple = 8 * (int64_t{1} << (levels - 1));
  if (out.width % multiple != 0 || out.height % multiple != 0) {
    fail("--width {} --height {}: {} needs multiples of {} pixels (VAE factor 8 x {} UNet downsamplings)", out.width,
         out.height, found->architecture, multiple, levels - 1);
  }
  const int64_t clip_skip = request.clip_skip > 0 ? request.clip_skip : run ? run->clip_skip : 1;
  LdmTokenizer tokenizer;
  const std::string tokenizer_dir = !request.tokenizer_dir.empty() ? request.tokenizer_dir
                                    : run                          ? expand_path(run->tokenizer_dir)
                                                                   : "";
  if (!tokenizer_dir.empty()) {
    tokenizer.clip.emplace(ClipTokenizer::load(tokenizer_dir));
  } else if (auto it = meta.find("tokenizer"); it != meta.end()) {
    try {
      tokenizer.words.emplace(WordTokenizer::from_json(nlohmann::json::parse(it->second)));
    } catch (const nlohmann::json::exception& e) {
      fail("{}: metadata 'tokenizer' is not valid JSON: {}", path, e.what());
    }
  } else {
    fail(
        "{}: no tokenizer: {} conditions on CLIP, whose tokenizer files (vocab.json and merges.txt) are not stored "
        "in checkpoints; pass --tokenizer-dir DIR (e.g. ComfyUI's comfy/sd1_tokenizer, or a diffusers model's "
        "tokenizer/ folder)",
        path, found->architecture);
  }
  for (const auto& [lora, scale] : request.loras) check_unet_lora(lora);
  const uint64_t seed = run ? static_cast<uint64_t>(run->seed) : 0;

  // Text encoders and VAE: the file's (a final file holds them beside the
  // UNet); for a step checkpoint (the UNet only) the run's base file and
  // vae, or, for a tiny run without one, the random ones its seed made.
  auto holds = [](const WeightFiles& f, const char* prefix) {
    for (const auto& n : f.names()) {
      if (starts_with(n, prefix)) return true;
    }
    return false;
  };
  const char* text_prefix = sdxl ? models::kSdxlClipLPrefix : models::kSd15ClipPrefix;
  std::optional<WeightFiles> base, vae_file;
  const bool own_text = holds(file, text_prefix), own_vae = holds(file, "first_stage_model.");
  if ((!own_text || !own_vae) && run && !run->pretrained_model_name_or_path.empty()) {
    base.emplace(WeightFiles::open(expand_path(run->pretrained_model_name_or_path)));
  }
  if (!own_vae && run && !run->vae.empty()) vae_file.emplace(WeightFiles::open(expand_path(run->vae)));
  const bool random_parts = found->tiny && run && !base;  // a tiny run without a base file
  if ((!own_text || !own_vae) && !base && !random_parts && !vae_file) {
    fail(
        "{}: holds the UNet without {}; a step checkpoint samples with its run's base file, but no run config "
        "(RUN_DIR/config.toml) names one: sample from the run's final RUN_DIR/model.safetensors, which holds VAE "
        "and text encoders beside the UNet",
        path,
        !own_text && !own_vae ? "text encoders or VAE"
        : !own_text           ? "text encoders"
                              : "a VAE");
  }
  const WeightFiles* text_files = own_text ? &file : base ? &*base : nullptr;
  const WeightFiles* vae_files = own_vae ? &file : vae_file ? &*vae_file : base ? &*base : nullptr;
  if (!own_text && !text_files && !random_parts) fail("{}: holds no text encoder ('{}*')", path, text_prefix);

  // ---- 1. text encoders: encode every prompt and the negative one, then free them ----
  at::Tensor context, y;
  {
    std::vector<models::ClipTextModel> encoders =
        build_ldm_text_encoders(unet_options, found->tiny, text_files, seed, clip_skip, tokenizer, found->architecture);
    for (auto& te : encoders) te->to(request.device);
    at::Tensor pooled;
    std::tie(context, pooled) = encode_ldm_text(encoders, tokenizer, texts, clip_skip, request.device, torch::kFloat32);
    if (sdxl) {
      // original = target = the image size, crop (0, 0), as training-time samples.
      std::vector<double> sizes;
      const auto h = static_cast<double>(out.height), w = static_cast<double>(out.width);
      for (int64_t i = 0; i < pooled.size(0); ++i) sizes.insert(sizes.end(), {h, w, 0.0, 0.0, h, w});
      y = sdxl_vector_y(pooled, sizes, unet_options.adm_in_channels(), torch::kFloat32);
    }
  }

  // ---- 2. the UNet (LoRA merged): denoise every image, then free it ----
  const at::ScalarType dtype = unet_dtype(request.device, file, found->prefix);
  out.unet_dtype = dtype_name(dtype);
  std::vector<at::Tensor> latents;
  {
    nn::LayerInit init{torch::TensorOptions().dtype(dtype)};
    init.initialize = false;
    models::LdmUNet unet(models::LdmUNetOptions(unet_options).init(init));
    auto root = std::make_shared<torch::nn::Module>("CheckpointRoot");
    nn::register_at(*root, "model.diffusion_model", unet);
    LoadWeightsOptions o;
    o.key_map = [prefix = found->prefix](const std::string& key) -> std::string {
      if (!starts_with(key, prefix)) return "";
      return kUNetPrefix + key.substr(prefix.size());
    };
    load_weights(*root, file, o);
    for (const auto& [lora, scale] : request.loras) {
      const int64_t merged = nn::merge_lora_file(*root, {{"lora_unet", kUNetPrefix}}, lora, scale);
      spdlog::info("merged {} LoRA modules of {} (multiplier {})", merged, lora, scale);
    }
    root->to(request.device);
    root->eval();
    torch::NoGradGuard no_grad;
    const DdpmSchedule schedule = DdpmSchedule::stable_diffusion();
    for (const SamplePrompt& p : prompts) {
      const double cfg = p.cfg.value_or(req.cfg);
      const int64_t steps = p.steps > 0 ? p.steps : req.steps;
      std::vector<int64_t> rows{text_row.at(p.prompt)};
      if (cfg != 1.0) rows.push_back(text_row.at(p.negative));
      const at::Tensor index = torch::tensor(rows, torch::kInt64);
      const at::Tensor ctx = context.index_select(0, index).to(request.device, dtype);
      const at::Tensor yy = y.defined() ? y.index_select(0, index).to(request.device, dtype) : at::Tensor();
      latents.push_back(sample_ldm_latents(*unet, ctx, yy, cfg, row_seeds(p, req), out.height, out.width,
                                           request.sampler, sampling_levels(schedule, request.sampler, steps),
                                           out.v_prediction));
    }
  }

  // ---- 3. the VAE: decode ----
  std::vector<at::Tensor> images;
  {
    models::AutoencoderKL vae = build_ldm_vae(sdxl, found->tiny, vae_files,
                                              /*bare_keys_allowed=*/vae_file && vae_files == &*vae_file, seed);
    vae->to(request.device);
    torch::NoGradGuard no_grad;
    for (const at::Tensor& z : latents) {
      for (int64_t i = 0; i < z.size(0); ++i) {
        images.push_back(vae->decode_latents(z.slice(0, i, i + 1).to(request.device)).to(at::kCPU));
      }
    }
  }
  out.images = samples_to_uint8(torch::cat(images, 0).to(torch::kFloat32), req);
  return out;
}

}  // namespace shoestring
