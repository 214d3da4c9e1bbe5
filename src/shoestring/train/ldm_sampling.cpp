#include "shoestring/train/ldm_sampling.h"

#include <filesystem>
#include <map>
#include <optional>

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "shoestring/core/device.h"
#include "shoestring/core/error.h"
#include "shoestring/core/text.h"
#include "shoestring/core/utf8.h"
#include "shoestring/io/weight_files.h"
#include "shoestring/models/architecture.h"
#include "shoestring/nn/fp8_storage.h"
#include "shoestring/nn/key_layout.h"
#include "shoestring/nn/lora.h"
#include "shoestring/train/config.h"
#include "shoestring/train/ddpm.h"
#include "shoestring/train/ldm_components.h"

namespace shoestring {

namespace fs = std::filesystem;

namespace {

constexpr const char* kUNetPrefix = "model.diffusion_model.";

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

bool is_ldm_checkpoint(const std::string& path) {
  return find_denoiser(WeightFiles::open(path), models::Family::ldm_unet).has_value();
}

LdmSamples sample_ldm_checkpoint(const std::string& path, const LdmSampleRequest& request) {
  const SampleRequest& req = request.images;
  const SampleTexts table = sample_texts(req, request.negative_prompt);
  const std::vector<SamplePrompt>& prompts = table.prompts;
  const std::vector<std::string>& texts = table.texts;
  const std::map<std::string, int64_t>& text_row = table.row;
  const WeightFiles file = WeightFiles::open(path);
  const std::optional<FoundDenoiser> found = find_denoiser(file, models::Family::ldm_unet);
  if (!found) {
    fail("{}: holds no SD 1.5 / SDXL / SSD-1B UNet (`shoestring inspect {}` shows what it holds)", path, path);
  }
  const std::optional<TrainConfig> run = run_config_beside(path);
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
  std::tie(out.width, out.height) = table.size(request.width, request.height, run_size > 0 ? run_size : default_size);
  const int64_t levels = static_cast<int64_t>(unet_options.channel_mult().size());
  const int64_t multiple = 8 * (int64_t{1} << (levels - 1));
  if (out.width % multiple != 0 || out.height % multiple != 0) {
    fail("--width {} --height {}: {} needs multiples of {} pixels (VAE factor 8 x {} UNet downsamplings)", out.width,
         out.height, found->architecture, multiple, levels - 1);
  }
  const int64_t clip_skip = request.clip_skip > 0 ? request.clip_skip : run ? run->clip_skip : 1;
  const LdmTokenizer tokenizer =
      sampling_tokenizer(file, request.tokenizer_dir, run ? &*run : nullptr, found->architecture);
  for (const auto& [lora, scale] : request.loras) check_denoiser_lora(lora, "lora_unet");
  const uint64_t seed = run ? static_cast<uint64_t>(run->seed) : 0;

  // Text encoders and VAE: the file's (a final file holds them beside the
  // UNet); for a step checkpoint (the UNet only) the run's base file and
  // vae, or, for a tiny run without one, the random ones its seed made.
  auto holds = [](const WeightFiles& f, const char* prefix) {
    for (const auto& n : f.names()) {
      if (has_prefix(n, prefix)) return true;
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
  const at::ScalarType dtype = sample_compute_dtype(request.device, file, found->prefix);
  out.unet_dtype = precision::name_of(dtype);
  std::vector<at::Tensor> latents;
  {
    nn::LayerInit init{torch::TensorOptions().dtype(dtype)};
    init.initialize = false;
    models::LdmUNet unet(models::LdmUNetOptions(unet_options).init(init));
    auto root = std::make_shared<torch::nn::Module>("CheckpointRoot");
    nn::register_at(*root, "model.diffusion_model", unet);
    LoadWeightsOptions o;
    o.key_map = [prefix = found->prefix](const std::string& key) -> std::string {
      if (!has_prefix(key, prefix)) return "";
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
