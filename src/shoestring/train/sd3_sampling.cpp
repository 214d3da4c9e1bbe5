#include "shoestring/train/sd3_sampling.h"

#include <deque>
#include <optional>

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/text.h"
#include "shoestring/io/weight_files.h"
#include "shoestring/models/architecture.h"
#include "shoestring/nn/key_layout.h"
#include "shoestring/nn/lora.h"
#include "shoestring/train/config.h"
#include "shoestring/train/sd3_components.h"

namespace shoestring {
namespace {

bool holds(const WeightFiles& f, const std::string& prefix) {
  for (const auto& n : f.names())
    if (has_prefix(n, prefix)) return true;
  return false;
}

}  // namespace

bool is_sd3_checkpoint(const std::string& path) {
  return find_denoiser(WeightFiles::open(path), models::Family::mmdit).has_value();
}

CheckpointSamples sample_sd3_checkpoint(const std::string& path, const Sd3SampleRequest& request) {
  const SampleRequest& req = request.images;
  const SampleTexts table = sample_texts(req, request.negative_prompt);
  const WeightFiles file = WeightFiles::open(path);
  const std::optional<FoundDenoiser> found = find_denoiser(file, models::Family::mmdit);
  if (!found) fail("{}: holds no SD3.5 Medium MMDiT (`shoestring inspect {}` shows what it holds)", path, path);
  const std::optional<TrainConfig> run = run_config_beside(path);
  const models::MMDiTOptions options = found->tiny ? models::MMDiTOptions::tiny() : models::MMDiTOptions::sd35_medium();
  const std::string arch = found->architecture + (found->tiny ? " (tiny)" : "");
  CheckpointSamples out;
  out.architecture = found->architecture;
  out.tiny = found->tiny;
  std::tie(out.width, out.height) = table.size(request.width, request.height,
                                               run           ? run->resolution
                                               : found->tiny ? 64
                                                             : 1024);
  check_sd3_size(options, out.height, out.width, "--width / --height:", arch);
  for (const auto& [lora, scale] : request.loras) check_denoiser_lora(lora, "lora_unet");
  const uint64_t seed = run ? static_cast<uint64_t>(run->seed) : 0;

  // The frozen parts' files: the option, else the checkpoint's own, else the
  // run's key, else the run's base file; a tiny run's random parts by its seed.
  std::optional<WeightFiles> base;
  if (run && !run->pretrained_model_name_or_path.empty())
    base.emplace(
        open_named_weights("the run's pretrained_model_name_or_path", expand_path(run->pretrained_model_name_or_path)));
  const bool random_parts = found->tiny && run && !base;
  std::deque<WeightFiles> opened;  // the files the options and the run name (stable addresses)
  auto source = [&](const std::string& option, const std::string& given, const char* prefix, const std::string& key,
                    const std::string& run_value, const char* what) -> const WeightFiles* {
    if (!given.empty()) return &opened.emplace_back(open_named_weights(option, given));
    if (holds(file, prefix)) return &file;
    if (!run_value.empty()) return &opened.emplace_back(open_named_weights("the run's " + key, expand_path(run_value)));
    if (base && holds(*base, prefix)) return &*base;
    if (random_parts) return nullptr;
    if (found->tiny) fail_tiny_part_without_run(path, found->architecture, what);
    fail("{}: holds no {} (no '{}*' keys) and no run config names one: pass {} FILE", path, what, prefix, option);
  };
  Sd3TextSources sources;
  sources.tiny = found->tiny;
  sources.seed = seed;
  sources.clip_l_name = "--clip-l";
  sources.clip_g_name = "--clip-g";
  sources.t5_name = "--t5xxl";
  sources.clip_l = source("--clip-l", request.clip_l, models::kSd3ClipLPrefix, "clip_l", run ? run->clip_l : "",
                          "CLIP-L text encoder");
  sources.clip_g = source("--clip-g", request.clip_g, models::kSd3ClipGPrefix, "clip_g", run ? run->clip_g : "",
                          "OpenCLIP bigG text encoder");
  const std::string t5_file = !request.t5xxl.empty() ? request.t5xxl : run ? expand_path(run->t5xxl) : "";
  const LdmTokenizer tokenizer = sampling_tokenizer(file, request.tokenizer_dir, run ? &*run : nullptr, arch);
  if (!t5_file.empty()) {
    sources.t5 =
        &opened.emplace_back(open_named_weights(request.t5xxl.empty() ? "the run's t5xxl" : "--t5xxl", t5_file));
    const std::string dir = !request.tokenizer_dir.empty() ? request.tokenizer_dir : run ? run->tokenizer_dir : "";
    sources.t5_spiece =
        sd3_t5_spiece(dir, request.t5xxl.empty() ? "the run's t5xxl" : "--t5xxl",
                      !request.tokenizer_dir.empty() || !run ? "--tokenizer-dir" : "the run's tokenizer_dir");
  }
  const WeightFiles* vae_file = source("--vae", request.vae, kSd3VaePrefix, "vae", run ? run->vae : "", "SD3 VAE");
  out.notes = sources.t5 ? "CLIP-L + bigG + T5-XXL" : "CLIP-L + bigG, T5 as zeros";
  // The VAE (84 M parameters) first, so that a wrong file is refused before the text and MMDiT passes.
  const std::string vae_name = !request.vae.empty() ? "--vae '" + request.vae + "'"
                               : vae_file == &file  ? path
                               : vae_file           ? "the run's VAE file " + vae_file->path()
                                                    : "the tiny run's random VAE";
  models::AutoencoderKL vae{nullptr};
  try {
    vae = build_sd3_vae(found->tiny, vae_file,
                        /*bare_keys_allowed=*/vae_file && vae_file != &file && (!base || vae_file != &*base), seed);
  } catch (const Error& e) {
    fail("{}: expected the SD3 VAE{}: {}", vae_name, found->tiny ? " (tiny)" : "", e.what());
  }

  // ---- 1. text encoders: encode every prompt and negative, then free them ----
  Sd3Text text;
  {
    Sd3TextEncoders encoders = build_sd3_text_encoders(sources, tokenizer);
    encoders.t5_max_length = run ? run->t5xxl_max_token_length : TrainConfig{}.t5xxl_max_token_length;
    encoders.to(request.device);
    text = encoders.encode(table.texts, torch::kFloat32, options);
  }

  // ---- 2. the MMDiT (LoRA merged): draw every latent, then free it ----
  const at::ScalarType dtype = sample_compute_dtype(request.device, file, found->prefix);
  out.denoiser_dtype = precision::name_of(dtype);
  std::vector<at::Tensor> latents;
  {
    nn::LayerInit init{torch::TensorOptions().dtype(dtype)};
    init.initialize = false;
    models::MMDiT mmdit(options, init);
    auto root = std::make_shared<torch::nn::Module>("CheckpointRoot");
    std::string at = kSd3MMDiTPrefix;
    at.pop_back();
    nn::register_at(*root, at, mmdit.ptr());
    LoadWeightsOptions o;
    o.key_map = [prefix = found->prefix](const std::string& key) -> std::string {
      return has_prefix(key, prefix) ? kSd3MMDiTPrefix + key.substr(prefix.size()) : std::string();
    };
    load_weights(*root, file, o);
    for (const auto& [lora, scale] : request.loras) {
      const int64_t merged = nn::merge_lora_file(*root, {{"lora_unet", kSd3MMDiTPrefix}}, lora, scale);
      spdlog::info("merged {} LoRA modules of {} (multiplier {})", merged, lora, scale);
    }
    root->to(request.device);
    root->eval();
    for (const SamplePrompt& p : table.prompts) {
      const Sd3Text c = text.select(torch::tensor({table.row.at(p.prompt)}, torch::kInt64));
      const Sd3Text u = text.select(torch::tensor({table.row.at(p.negative)}, torch::kInt64));
      const int64_t w = options.context_dim();
      const FlowGuidance guidance = sd3_sample_guidance(found->tiny, p.cfg.value_or(req.cfg));
      for (const uint64_t s : row_seeds(p, req)) {
        latents.push_back(sample_sd3_latent(*mmdit, sd3_context(c.clip, c.t5, w), c.pooled,
                                            sd3_context(u.clip, u.t5, w), u.pooled, s, out.height, out.width,
                                            p.steps > 0 ? p.steps : req.steps, guidance));
      }
    }
  }

  // ---- 3. the VAE: decode ----
  std::vector<at::Tensor> images;
  {
    vae->to(request.device);
    torch::NoGradGuard no_grad;
    for (const at::Tensor& z : latents) images.push_back(vae->decode_latents(z.to(request.device)).to(at::kCPU));
  }
  out.images = samples_to_uint8(torch::cat(images, 0).to(torch::kFloat32), req);
  return out;
}

}  // namespace shoestring
