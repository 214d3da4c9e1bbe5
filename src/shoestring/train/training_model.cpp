#include "shoestring/train/training_model.h"

#include <cstdio>
#include <set>

#include <spdlog/spdlog.h>

#include "shoestring/core/error.h"
#include "shoestring/core/units.h"
#include "shoestring/data/dataset.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/models/architecture.h"
#include "shoestring/models/cascade.h"
#include "shoestring/models/unet_ldm.h"
#include "shoestring/precision/dtype.h"
#include "shoestring/precision/save_guard.h"
#include "shoestring/train/cascade_components.h"
#include "shoestring/train/config.h"
#include "shoestring/train/dataset_config.h"
#include "shoestring/train/sampling.h"
#include "shoestring/train/training_model_impl.h"

namespace shoestring {

namespace {

/// Warns about keys set away from their defaults that this family ignores
/// (the schema's kEmojiModelOnly / kReleasedModelOnly flags).
void warn_ignored_keys(const TrainConfig& c) {
  const std::vector<std::string> ignored =
      ignored_keys(c, models::find_architecture(c.architecture).family == models::Family::tiny_unet);
  if (!ignored.empty()) {
    spdlog::warn("model.architecture = \"{}\" ignores {} (docs/config.md)", c.architecture, fmt::join(ignored, ", "));
  }
}

}  // namespace

void check_training_config(const TrainConfig& config) {
  const models::Architecture& a = models::find_architecture(config.architecture);
  if (a.family != models::Family::tiny_unet && (config.shuffle_caption || config.caption_tag_dropout_rate > 0)) {
    fail(
        "{}: model.architecture = \"{}\" encodes each caption once and caches the text-encoder output, so it "
        "cannot change captions per step; remove it (kohya refuses it with cached text-encoder outputs too)",
        config.shuffle_caption ? "shuffle_caption" : "caption_tag_dropout_rate", config.architecture);
  }
  if (config.keep_tokens > 0 && !config.shuffle_caption && !(config.caption_tag_dropout_rate > 0))
    spdlog::warn(
        "keep_tokens = {} has no effect without shuffle_caption or caption_tag_dropout_rate (it only protects the "
        "leading tags from them)",
        config.keep_tokens);
  if (a.family != models::Family::tiny_unet && config.adaptive_noise_scale != 0 && !(config.noise_offset > 0))
    fail("adaptive_noise_scale = {} needs noise_offset > 0 (it is added to the offset; kohya refuses it too)",
         config.adaptive_noise_scale);
  const bool huber = config.loss_type == "huber" || config.loss_type == "smooth_l1";
  if (!huber && (config.huber_schedule != TrainConfig{}.huber_schedule || config.huber_c != TrainConfig{}.huber_c ||
                 config.huber_scale != TrainConfig{}.huber_scale))
    spdlog::warn(
        "huber_schedule, huber_c and huber_scale apply to loss_type huber or smooth_l1 only; loss_type = "
        "\"{}\" ignores them",
        config.loss_type);
  if (huber && config.huber_schedule != "constant" && !(config.huber_c > 0 && config.huber_c <= 1))
    fail(
        "huber_c = {} with huber_schedule = \"{}\": that schedule needs huber_c in (0, 1] (it is the threshold at "
        "the noisiest timestep); use huber_schedule = \"constant\" for a fixed threshold of any size",
        config.huber_c, config.huber_schedule);
  if (a.family == models::Family::tiny_unet && uses_kohya_datasets(config)) {
    fail(
        "{}: the emoji example's tiny-unet trains square images from train_data_dir only (its sample grids and "
        "Twemoji layout are square); aspect-ratio buckets, dataset_config and in_json are for the released "
        "architectures (model.architecture = \"sd15\", \"sdxl\", \"ssd1b\"); remove it",
        !config.dataset_config.empty()                                ? std::string("dataset_config")
        : !config.in_json.empty()                                     ? "in_json"
        : config.enable_bucket                                        ? "enable_bucket"
        : config.flip_aug                                             ? "flip_aug"
        : config.random_crop                                          ? "random_crop"
        : config.caption_extension != TrainConfig{}.caption_extension ? "caption_extension"
        : config.dataset_repeats != TrainConfig{}.dataset_repeats     ? "dataset_repeats"
                                                                      : "train_data_dir " + config.train_data_dir +
                                                                        "'s <repeats>_<class tokens> subfolders "
                                                                        "(kohya's DreamBooth layout)");
  }
  if (a.family == models::Family::tiny_unet) {
    if (huber && config.huber_schedule != "constant")
      fail(
          "loss_type = \"{}\" with huber_schedule = \"{}\"{}: that schedule follows the DDPM timesteps of the "
          "released UNets; the emoji model (flow matching) needs huber_schedule = \"constant\"",
          config.loss_type, config.huber_schedule,
          config.huber_schedule == TrainConfig{}.huber_schedule ? " (the default, as kohya's)" : "");
    if (config.tiny) fail("model.tiny applies to released architectures; tiny-unet is sized by model.base_channels");
    for (size_t i = 0; i < config.sample_prompts.size(); ++i) {
      const SamplePrompt p = parse_sample_prompt(config.sample_prompts[i], fmt::format("sample_prompts[{}]", i));
      if (!p.negative.empty() || p.width > 0 || p.height > 0) {
        fail(
            "sample_prompts[{}] = \"{}\": --{} applies to the LDM UNets; the emoji model samples square images at "
            "its training resolution and guides with the empty caption",
            i, config.sample_prompts[i],
            !p.negative.empty() ? "n"
            : p.width > 0       ? "w"
                                : "h");
      }
    }
  } else if (a.family == models::Family::stage_c || a.family == models::Family::mmdit) {
    const char* ldm_only = config.v_parameterization                      ? "v_parameterization"
                           : config.min_snr_gamma > 0                     ? "min_snr_gamma"
                           : config.debiased_estimation_loss              ? "debiased_estimation_loss"
                           : huber && config.huber_schedule != "constant" ? "huber_schedule"
                                                                          : nullptr;
    if (ldm_only)
      fail("{}: model.architecture = \"{}\" trains on {}; that key follows the DDPM timesteps of the LDM UNets{}",
           ldm_only, config.architecture,
           a.family == models::Family::mmdit
               ? "rectified flow (train/flow_matching.h; weighting_scheme sets the loss weight)"
               : "GDF's epsilon objective with the P2 loss weight (train/gdf.h)",
           std::string(ldm_only) == "huber_schedule" ? "; use huber_schedule = \"constant\"" : "");
  } else if (!a.trainable_from_config) {
    fail(
        "model.architecture = \"{}\": training it from a config is not supported; supported: {}. `shoestring "
        "plan`, `inspect --arch` and bench/model_step do cover it",
        config.architecture, models::join_names(models::denoiser_architectures(/*trainable_only=*/true)));
  }
  if (a.family != models::Family::stage_c && config.activation_rescale != 1.0) {
    fail(
        "precision.activation_rescale = {}: it rescales Stable Cascade stage C's TimestepBlocks (the fp16 fix for "
        "model.architecture = \"cascade-c\" / \"cascade-c-lite\"); \"{}\" has none: remove it, or use "
        "precision.auto_upcast for fp16 overflow",
        config.activation_rescale, config.architecture);
  }
  warn_ignored_keys(config);
}

void check_training_datasets(const TrainConfig& config, const std::vector<DatasetSpec>& specs) {
  const models::Architecture& a = models::find_architecture(config.architecture);
  // tiny-unet refuses kohya datasets in check_training_config.
  if (a.family != models::Family::ldm_unet && a.family != models::Family::stage_c && a.family != models::Family::mmdit)
    return;
  int64_t multiple = 0;
  std::string why;
  if (a.family == models::Family::ldm_unet) {
    const models::LdmUNetOptions unet = models::ldm_unet_options(config.architecture, config.tiny);
    multiple = 8 * (int64_t{1} << (static_cast<int64_t>(unet.channel_mult().size()) - 1));
    why = "VAE factor 8 x its UNet downsamplings";
  } else if (a.family == models::Family::mmdit) {
    multiple = 16;
    why = "the SD3 VAE's factor 8 x the MMDiT's patch size 2";
  } else {
    multiple = cascade_pixel_multiple(models::stage_c_options(config.architecture, config.tiny));
    why = "EfficientNet's factor 32 x stage C's downscales";
  }
  for (const DatasetSpec& d : specs) {
    const BucketSettings& b = d.buckets;
    if (b.enable_bucket && b.bucket_reso_steps % multiple != 0) {
      fail(
          "{}: bucket_reso_steps = {}: {} needs bucket sides that are multiples of {} pixels ({}); use a multiple "
          "of {}",
          d.where, b.bucket_reso_steps, config.architecture, multiple, why, multiple);
    }
    if (b.resolution.width % multiple != 0 || b.resolution.height % multiple != 0) {
      fail("{}: resolution {}: {} needs a multiple of {} pixels on each side ({})", d.where, to_string(b.resolution),
           config.architecture, multiple, why);
    }
    for (const DatasetSubset& s : d.subsets) {
      if (s.random_crop) {
        fail(
            "{}: random_crop: model.architecture = \"{}\" encodes each image to latents once, before training, so "
            "a crop cannot change per step (kohya refuses random_crop with cache_latents too); remove it",
            s.where, config.architecture);
      }
      if (s.shuffle_caption || s.caption_tag_dropout_rate > 0) {
        fail(
            "{}: {}: model.architecture = \"{}\" encodes each caption once and caches the text-encoder output, "
            "so it cannot change captions per step; remove it (kohya refuses it with cached text-encoder outputs "
            "too)",
            s.where, s.shuffle_caption ? "shuffle_caption" : "caption_tag_dropout_rate", config.architecture);
      }
    }
  }
}

std::unique_ptr<TrainingModel> make_training_model(const TrainConfig& config, const ImageCaptionDataset& dataset,
                                                   const ModelSource& source) {
  switch (models::find_architecture(config.architecture).family) {
    case models::Family::tiny_unet: return make_tiny_unet_training_model(config, dataset, source);
    case models::Family::ldm_unet: return make_ldm_training_model(config, dataset, source);
    case models::Family::stage_c: return make_cascade_training_model(config, dataset, source);
    case models::Family::mmdit: return make_sd3_training_model(config, dataset, source);
    default: break;
  }
  check_training_config(config);  // throws: not trainable from a config
  fail("model.architecture = \"{}\": no training model", config.architecture);
}

nn::LoraOptions lora_options(const TrainConfig& c) {
  nn::LoraOptions o;
  o.rank = c.network_dim;
  o.alpha = c.network_alpha;
  o.dtype = c.full_bf16 ? torch::kBFloat16 : torch::kFloat32;
  return nn::apply_network_args(o, c.network_args);
}

torch::Dtype build_dtype(const TrainConfig& config, torch::Dtype storage) {
  for (const auto& r : config.precision_rules) {
    if (r.storage && *r.storage == "fp32") return torch::kFloat32;
  }
  return storage;
}

std::string config_hash(const TrainConfig& config) {
  const std::string text = to_toml(config);
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a 64 offset basis
  for (unsigned char ch : text) {
    h ^= ch;
    h *= 0x100000001b3ull;  // FNV-1a 64 prime
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

void for_each_text_batch(
    const std::vector<size_t>& missing, size_t caption_count, const std::vector<std::string>& texts, size_t chunk,
    const std::function<void(const std::vector<size_t>& indices, const std::vector<std::string>& part)>& encode) {
  std::vector<size_t> phases[2];  // captions, sample prompts
  for (const size_t i : missing) phases[i < caption_count ? 0 : 1].push_back(i);
  for (const std::vector<size_t>& phase : phases) {
    const size_t step = chunk == 0 ? std::max<size_t>(phase.size(), 1) : chunk;
    for (size_t begin = 0; begin < phase.size(); begin += step) {
      const size_t end = std::min(phase.size(), begin + step);
      const std::vector<size_t> indices(phase.begin() + static_cast<std::ptrdiff_t>(begin),
                                        phase.begin() + static_cast<std::ptrdiff_t>(end));
      std::vector<std::string> part;
      for (const size_t i : indices) part.push_back(texts.at(i));
      encode(indices, part);
    }
  }
}

std::string stored_dtype_name(const torch::nn::Module& module) {
  std::set<at::ScalarType> dtypes;
  for (const auto& p : module.parameters(/*recurse=*/true)) dtypes.insert(p.scalar_type());
  if (dtypes.empty()) return "fp32";
  const at::ScalarType t = *dtypes.begin();
  return dtypes.size() == 1 && (t == at::kFloat || t == at::kBFloat16 || t == at::kHalf) ? precision::name_of(t)
                                                                                         : "mixed";
}

void save_module_tensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors_in,
                         std::map<std::string, std::string> metadata, const TrainConfig& config,
                         const TensorsByImpl& instead) {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  tensors.reserve(tensors_in.size());
  for (const auto& [name, t] : tensors_in) {
    const auto it = t.defined() ? instead.find(t.unsafeGetTensorImpl()) : instead.end();
    if (it == instead.end()) {
      tensors.emplace_back(name, t);
      continue;
    }
    if (it->second.sizes() != t.sizes()) {
      fail("final model file: the fp32 source of '{}' has shape {}, the weight {}", name,
           format_shape(it->second.sizes()), format_shape(t.sizes()));
    }
    tensors.emplace_back(name, it->second);
  }
  // kohya's save_precision ("auto": as trained), behind the save-time range guard (docs/precision.md).
  std::optional<precision::Dtype> target;
  if (config.save_precision != "auto") target = precision::parse_save_precision(config.save_precision);
  precision::SaveGuardOptions guard;
  guard.force = config.save_precision_force;
  precision::save_with_guard(path, tensors, target, guard, std::move(metadata),
                             path + " (the checkpoints keep full precision)");
}

DiskCacheRun disk_cache_run(const ModelSource& source) {
  DiskCacheRun run;
  run.share = source.cache_share;
  run.writer = fmt::format("r{}", source.cache_share.rank);
  run.tidy = source.encode_only;
  run.quiet = source.quiet;
  return run;
}

}  // namespace shoestring
