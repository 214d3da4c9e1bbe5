#include "shoestring/train/cascade_sampling.h"

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
#include "shoestring/train/cascade_components.h"
#include "shoestring/train/config.h"

namespace shoestring {
bool is_cascade_checkpoint(const std::string& path) {
  return find_denoiser(WeightFiles::open(path), models::Family::stage_c).has_value();
}

CheckpointSamples sample_cascade_checkpoint(const std::string& path, const CascadeSampleRequest& request) {
  const SampleRequest& req = request.images;
  const SampleTexts table = sample_texts(req, request.negative_prompt);
  const WeightFiles file = WeightFiles::open(path);
  const std::optional<FoundDenoiser> found = find_denoiser(file, models::Family::stage_c);
  if (!found) fail("{}: holds no Stable Cascade stage C (`shoestring inspect {}` shows what it holds)", path, path);
  const std::optional<TrainConfig> run = run_config_beside(path);
  const models::StageCOptions options = models::stage_c_options(found->architecture, found->tiny);
  const std::string arch = found->architecture + (found->tiny ? " (tiny)" : "");
  CheckpointSamples out;
  out.architecture = found->architecture;
  out.tiny = found->tiny;
  std::tie(out.width, out.height) = table.size(request.width, request.height, run ? run->resolution : 768);
  check_cascade_size(options, out.height, out.width, "--width / --height:", arch);
  for (const auto& [lora, scale] : request.loras) check_denoiser_lora(lora, "lora_prior_unet");
  const uint64_t seed = run ? static_cast<uint64_t>(run->seed) : 0;
  const LdmTokenizer tokenizer = sampling_tokenizer(file, request.tokenizer_dir, run ? &*run : nullptr, arch);

  // The frozen parts' files: the option, else the run's key; a tiny run's random parts by its seed.
  std::deque<WeightFiles> opened;
  auto source = [&](const std::string& option, const std::string& given, const std::string& key,
                    const std::string& run_value, const char* what) -> const WeightFiles* {
    if (!given.empty()) return &opened.emplace_back(open_named_weights(option, given));
    if (!run_value.empty()) return &opened.emplace_back(open_named_weights("the run's " + key, expand_path(run_value)));
    if (found->tiny && run) return nullptr;
    if (found->tiny) fail_tiny_part_without_run(path, found->architecture, what);
    fail("{}: stage C files hold no {}, and no run config names one: pass {} FILE", path, what, option);
  };
  const WeightFiles* bigg = source("--clip-g", request.clip_g, "text_model_checkpoint_path",
                                   run ? run->text_model_checkpoint_path : "", "OpenCLIP bigG text encoder");
  const WeightFiles* previewer_file = source("--previewer", request.previewer, "previewer_checkpoint_path",
                                             run ? run->previewer_checkpoint_path : "", "previewer");
  // Refused now rather than after the stage C pass.
  models::Previewer previewer = build_cascade_previewer(previewer_file, "--previewer", found->tiny, seed);
  out.notes = fmt::format("previews {} x {} px", out.width / 32 * 8, out.height / 32 * 8);

  // ---- 1. bigG: encode every prompt and negative, then free it ----
  CascadeText text;
  {
    models::ClipTextModel te = build_cascade_text_encoder(bigg, "--clip-g", found->tiny, options.clip_text_dim(), seed);
    te->eval();
    te->to(request.device);
    text = encode_cascade_text(te, tokenizer, table.texts, torch::kFloat32);
  }

  // ---- 2. stage C (LoRA merged): draw every latent, then free it ----
  const at::ScalarType dtype = sample_compute_dtype(request.device, file, found->prefix);
  out.denoiser_dtype = precision::name_of(dtype);
  std::vector<at::Tensor> latents;
  {
    nn::LayerInit init{torch::TensorOptions().dtype(dtype)};
    init.initialize = false;
    models::StageC stage_c(options, init);
    LoadWeightsOptions o;
    o.key_map = [prefix = found->prefix](const std::string& key) -> std::string {
      return has_prefix(key, prefix) ? key.substr(prefix.size()) : std::string();
    };
    load_weights(*stage_c, file, o);
    for (const auto& [lora, scale] : request.loras) {
      const int64_t merged = nn::merge_lora_file(*stage_c, {{"lora_prior_unet", ""}}, lora, scale);
      spdlog::info("merged {} LoRA modules of {} (multiplier {})", merged, lora, scale);
    }
    if (dtype == torch::kHalf && run && run->activation_rescale != 1.0) {
      stage_c->set_activation_rescale(run->activation_rescale);
      out.notes += fmt::format(", activation_rescale {}", run->activation_rescale);
    }
    stage_c->to(request.device);
    stage_c->eval();
    for (const SamplePrompt& p : table.prompts) {
      const CascadeText c = text.select(torch::tensor({table.row.at(p.prompt)}, torch::kInt64));
      const CascadeText u = text.select(torch::tensor({table.row.at(p.negative)}, torch::kInt64));
      for (const uint64_t s : row_seeds(p, req)) {
        latents.push_back(sample_stage_c_latent(*stage_c, c, u, s, out.height, out.width,
                                                p.steps > 0 ? p.steps : req.steps, p.cfg.value_or(req.cfg)));
      }
    }
  }

  // ---- 3. the previewer: decode ----
  previewer->to(request.device);
  std::vector<at::Tensor> images;
  for (const at::Tensor& z : latents) images.push_back(preview_images(*previewer, z));
  out.images = samples_to_uint8(torch::cat(images, 0), req);
  return out;
}

}  // namespace shoestring
