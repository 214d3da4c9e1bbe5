// The released LDM UNets (sd15, sdxl, ssd1b) as a TrainingModel: latents and
// text embeddings are computed once before training (kohya's cache_latents +
// cache_text_encoder_outputs), the VAE and text encoders are then freed, and
// the UNet trains on the DDPM epsilon (or v) objective. See training_model.h.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <optional>
#include <set>

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "shoestring/core/content_hash.h"
#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/core/text.h"
#include "shoestring/core/units.h"
#include "shoestring/data/clip_tokenizer.h"
#include "shoestring/data/dataset.h"
#include "shoestring/data/tokenizer.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/io/tensor_cache.h"
#include "shoestring/io/weight_files.h"
#include "shoestring/models/architecture.h"
#include "shoestring/models/clip_text.h"
#include "shoestring/models/unet_ldm.h"
#include "shoestring/models/vae.h"
#include "shoestring/nn/key_layout.h"
#include "shoestring/nn/timestep.h"
#include "shoestring/train/checkpoint_io.h"
#include "shoestring/train/config.h"
#include "shoestring/train/ddpm.h"
#include "shoestring/train/diffusion_loss.h"
#include "shoestring/train/ldm_cache.h"
#include "shoestring/train/ldm_components.h"
#include "shoestring/train/ldm_sampling.h"
#include "shoestring/train/samplers.h"
#include "shoestring/train/sampling.h"
#include "shoestring/train/training_model_impl.h"

namespace shoestring {
namespace fs = std::filesystem;

namespace {

constexpr const char* kUNetPrefix = "model.diffusion_model.";
constexpr const char* kVaePrefix = "first_stage_model.";
constexpr int64_t kTextLength = 77;

class LdmTrainingModel final : public TrainingModel {
 public:
  LdmTrainingModel(const TrainConfig& config, const ImageCaptionDataset& dataset, const ModelSource& source)
      : config_(config), dataset_(dataset), schedule_(DdpmSchedule::stable_diffusion()), device_(source.device) {
    const std::string& arch = config.architecture;
    storage_ = config.full_bf16 ? torch::kBFloat16 : config.full_fp16 ? torch::kHalf : torch::kFloat32;
    if (!source.pretrained.empty()) base_.emplace(WeightFiles::open(source.pretrained));
    if (!config.tiny && !base_) {
      fail(
          "model.architecture = \"{}\" needs base weights: set pretrained_model_name_or_path to a single-file "
          "checkpoint (e.g. a ComfyUI / A1111 .safetensors); only model.tiny = true trains from random init",
          arch);
    }

    // The UNet's options from the registry, and the checks that need only
    // the file header, before any slow work. SDXL-style conditioning (two
    // text encoders, vector y) is what the UNet's y input says.
    unet_options_ = models::ldm_unet_options(arch, config.tiny);
    sdxl_ = unet_options_.adm_in_channels() > 0;
    // Samples are drawn at the (first) dataset's resolution.
    sample_size_ =
        dataset.bucketed() ? dataset.dataset_resolution(0) : BucketReso{config.resolution, config.resolution};
    for (int64_t i = 0; i < dataset.size() && dataset.bucketed(); ++i) has_flip_ = has_flip_ || dataset.flip_aug(i);
    check_resolution();
    if (base_) unet_prefix_ = detect_unet_prefix();
    if (source.check_module) {
      // The run's checks of the module tree (network_weights against the
      // LoRA network), on a meta-device UNet: nothing allocated.
      auto meta_root = build_unet_root(nn::LayerInit{torch::TensorOptions().dtype(storage_).device(torch::kMeta)});
      source.check_module(*meta_root, lora_components(config.network_train_unet_only));
    }

    // ---- frozen parts first, one at a time, each freed after use, so the
    // run never holds them beside the UNet: text encoders, then the VAE ----
    const bool text_on_disk = config.cache_text_encoder_outputs_to_disk || source.encode_only;
    const bool latents_on_disk = config.cache_latents_to_disk || source.encode_only;
    if (text_on_disk || latents_on_disk) cache_stats_.dir = ldm_cache_dir(config);
    cache_run_ = disk_cache_run(source);
    build_tokenizer();
    if (text_on_disk) {
      cache_captions(source.quiet);
    } else {
      load_text_encoders();
      encode_captions();
    }
    text_encoders_.clear();
    if (latents_on_disk) {
      cache_images(source.quiet);
    } else {
      encode_images();
    }
    if (source.cache_stats) *source.cache_stats = cache_stats_;
    if (source.encode_only) return;

    // ---- the UNet, built directly in its storage dtype, then loaded ----
    {
      ScopedMemoryCategory category(MemoryCategory::weights);
      nn::LayerInit init{torch::TensorOptions().dtype(build_dtype(config, storage_))};
      init.initialize = !base_;
      root_ = build_unet_root(init, &unet_);
      if (base_) load_unet();
    }
    if (!source.quiet && !latent_cache_ && !text_cache_) {
      const int64_t bytes = latents_.bytes() + context_.nbytes() + (pooled_.defined() ? pooled_.nbytes() : 0);
      spdlog::info("cached latents {} and {} text embeddings {} ({}); VAE and text encoders freed", latents_.describe(),
                   context_.size(0), format_shape(context_.sizes().slice(1)), format_bytes(bytes));
    } else if (!source.quiet) {
      spdlog::info("{} read from disk a batch at a time ({}); VAE and text encoders freed",
                   latent_cache_ && text_cache_ ? "latents and text embeddings"
                   : latent_cache_              ? "latents (text embeddings in memory)"
                                                : "text embeddings (latents in memory)",
                   cache_stats_.dir);
    }
  }

  torch::nn::Module& module() override { return *root_; }
  std::vector<nn::BlockTable*> block_tables() override { return {unet_->block_table()}; }
  std::vector<nn::LoraComponent> lora_components(bool) const override {
    // Text-encoder outputs are cached: only the UNet can carry a LoRA.
    return {{"lora_unet", kUNetPrefix}};
  }

  TrainBatch prepare(const std::vector<int64_t>& idx) override {
    const auto b = static_cast<int64_t>(idx.size());
    if (b == 0) fail("internal: empty batch");
    at::Tensor index = torch::tensor(idx, torch::kInt64);
    // The batch's bucket (a batch never mixes buckets: BatchSampler).
    const int64_t bucket = dataset_.bucketed() ? dataset_.bucket_of(idx.front()) : 0;
    for (const int64_t i : idx) {
      if (dataset_.bucketed() && dataset_.bucket_of(i) != bucket) {
        fail("internal: images {} and {} of one batch are in different buckets", idx.front(), i);
      }
    }
    // Latents [B, 4, h, w] (fp32) and, with flip_aug, their mirror images'.
    at::Tensor x0, mirror;
    if (latent_cache_) {
      std::tie(x0, mirror) = read_cached_latents(*latent_cache_, latent_key_, idx, has_flip_);
    } else {
      std::tie(x0, mirror) = latents_.batch(dataset_, idx);
    }
    // flip_aug, caption dropout (the empty caption is the last cached row) and the noise.
    LatentBatchDraws draws =
        draw_latent_batch(dataset_, config_, idx, x0, mirror, caption_row_.index_select(0, index), caption_rows_ - 1);
    x0 = draws.x0;
    const at::Tensor rows = draws.caption_rows, eps = draws.noise;
    const std::vector<bool>& flipped = draws.flipped;
    at::Tensor t = schedule_.sample_timesteps(b);
    at::Tensor x_t = schedule_.add_noise(x0, eps, t);
    at::Tensor target = config_.v_parameterization ? schedule_.v_target(x0, eps, t) : eps;
    at::Tensor context, pooled;
    if (text_cache_) {
      // Text embeddings of the batch's rows, read from the disk cache.
      std::vector<at::Tensor> contexts, pools;
      for (int64_t i = 0; i < b; ++i) {
        std::vector<at::Tensor> entry = text_cache_->read(text_key_[static_cast<size_t>(rows[i].item<int64_t>())]);
        contexts.push_back(entry[0]);
        if (sdxl_) pools.push_back(entry.at(1));
      }
      context = torch::stack(contexts);
      if (sdxl_) pooled = torch::stack(pools);
    } else {
      context = context_.index_select(0, rows);
      if (sdxl_) pooled = pooled_.index_select(0, rows);
    }
    at::Tensor y;
    if (sdxl_) {
      // SDXL's size conditioning per image, as kohya's: original (h, w), crop
      // top-left (kohya's get_crop_ltrb; mirrored: left = width - right), target (h, w).
      std::vector<double> sizes;
      for (int64_t i = 0; i < b; ++i) {
        const int64_t image = idx[static_cast<size_t>(i)];
        if (!dataset_.bucketed()) {
          const auto r = static_cast<double>(config_.resolution);
          sizes.insert(sizes.end(), {r, r, 0.0, 0.0, r, r});
          continue;
        }
        const ImageGeometry& g = dataset_.geometry(image);
        const BucketReso target = dataset_.buckets()[static_cast<size_t>(bucket)].reso;
        const double left =
            flipped[static_cast<size_t>(i)] ? static_cast<double>(target.width) - g.crop_ltrb.right : g.crop_ltrb.left;
        sizes.insert(sizes.end(), {static_cast<double>(g.original.height), static_cast<double>(g.original.width),
                                   std::trunc(g.crop_ltrb.top), std::trunc(left), static_cast<double>(target.height),
                                   static_cast<double>(target.width)});
      }
      y = sdxl_y(pooled, sizes);
    }
    TrainBatch batch;
    batch.inputs = {x_t, t.to(torch::kFloat32), context, y};
    batch.target = target;
    // kohya's loss weights by SNR (min-SNR-gamma, then debiased estimation).
    if (config_.min_snr_gamma > 0 || config_.debiased_estimation_loss) {
      const at::Tensor snr = snr_of_timesteps(schedule_.alphas_cumprod(), t);
      at::Tensor w = torch::ones({b}, torch::kFloat32);
      if (config_.min_snr_gamma > 0) w = w * min_snr_weight(snr, config_.min_snr_gamma, config_.v_parameterization);
      if (config_.debiased_estimation_loss) w = w * debiased_weight(snr, config_.v_parameterization);
      batch.loss_weight = w;
    }
    if (config_.loss_type == "huber" || config_.loss_type == "smooth_l1")
      batch.huber_c =
          huber_threshold(config_.huber_schedule, config_.huber_c, config_.huber_scale, t, schedule_.alphas_cumprod());
    return batch;
  }

  at::Tensor forward(const TrainBatch& b) override {
    const auto dtype = nn::value_dtype(unet_->out_conv->weight);
    const at::Tensor& y = b.inputs[3];
    return unet_->forward(b.inputs[0].to(dtype), b.inputs[1], b.inputs[2].to(dtype), y.defined() ? y.to(dtype) : y);
  }

  at::Tensor sample(const SampleRequest& request) override;

  std::map<std::string, std::string> metadata(int64_t step) const override {
    const std::string& a = config_.architecture;
    const std::string& spec = models::find_architecture(a).modelspec_architecture;
    std::map<std::string, std::string> meta = {
        {"format", "shoestring"},
        {"architecture", a},
        {"tiny", config_.tiny ? "true" : "false"},
        {"layout", "ldm"},
        {"step", std::to_string(step)},
        {"config_hash", config_hash(config_)},
        {"objective", config_.v_parameterization ? "v_prediction" : "epsilon"},
        {"dtype", stored_dtype_name(*root_)},
        // Stability's model-spec fields, as kohya writes them.
        {"modelspec.sai_model_spec", "1.0.0"},
        {"modelspec.architecture", spec},
        {"modelspec.implementation", "https://github.com/Stability-AI/generative-models"},
        {"modelspec.title", fmt::format("{} step {}", fs::path(config_.output_dir).filename().string(), step)},
        {"modelspec.prediction_type", config_.v_parameterization ? "v" : "epsilon"}};
    // A tiny run's word tokenizer (built from its captions): `shoestring sample` needs it.
    if (tokenizer_.words) meta["tokenizer"] = tokenizer_.words->to_json().dump();
    return meta;
  }

  void save_final(const std::string& path, int64_t step, bool storage_dtype, const TensorsByImpl& instead) override;
  bool base_reloadable() const override { return base_.has_value(); }

 private:
  /// The key prefix the configured UNet is stored under in the base file.
  /// Throws shoestring::Error naming what the file holds instead.
  std::string detect_unet_prefix() const;
  /// The UNet (unet_options_, parameters as `init` says) under its
  /// single-file prefix in a new root, as models::build_checkpoint_root
  /// names it; `unet` receives the UNet when non-null.
  std::shared_ptr<torch::nn::Module> build_unet_root(const nn::LayerInit& init,
                                                     std::shared_ptr<models::LdmUNetImpl>* unet = nullptr) const;
  void load_unet();
  void check_resolution() const;
  /// Refuses a sample size the UNet cannot take, naming the prompt.
  void check_sample_size(int64_t height, int64_t width, const std::string& prompt) const;
  /// SDXL's vector y [B, adm]: pooled [B, P] (fp32) beside the sinusoidal
  /// embeddings of the 6 size values of each row (original h, w, crop top,
  /// left, target h, w; `sizes` holds 6 x B), in the cache dtype.
  at::Tensor sdxl_y(const at::Tensor& pooled, const std::vector<double>& sizes) const;
  /// The text encoders' tokenizer (tokenizer_dir, or a tiny run's words).
  void build_tokenizer();
  /// Builds text_encoders_ (build_tokenizer first) and loads their weights.
  void load_text_encoders();
  /// The identity of the text encoders' weights, one per encoder (cache keys).
  std::vector<std::string> text_encoder_identities() const;
  models::AutoencoderKL build_vae(bool for_decoding);
  void encode_captions();
  void encode_images();
  /// The caption rows: each distinct caption once, in dataset order, then ""
  /// (caption dropout); fills caption_row_ (each image's row) and caption_rows_.
  std::vector<std::string> caption_texts();
  /// The distinct texts of the sample prompts and their negatives, each
  /// given its row in sample_row_.
  std::vector<std::string> sample_texts();
  /// The disk caches (train/ldm_cache.h): key every entry the run needs,
  /// verify what the cache holds, encode what is missing shard by shard,
  /// keep only the keys in memory (prepare reads a batch at a time).
  void cache_captions(bool quiet);
  void cache_images(bool quiet);
  /// The identity of the VAE's weights (cache keys).
  std::string vae_identity();
  /// Context [N, 77, D] (cache dtype) and (SDXL) bigG's pooled output [N, P]
  /// (fp32) of `captions`, in no-grad, in host memory.
  std::pair<at::Tensor, at::Tensor> encode_text(const std::vector<std::string>& captions);
  /// The tensors saved beside the UNet: VAE and text encoders (and anything
  /// else of the base file), under their single-file keys.
  std::vector<std::pair<std::string, at::Tensor>> companion_tensors();

  TrainConfig config_;
  const ImageCaptionDataset& dataset_;
  DdpmSchedule schedule_;
  bool sdxl_ = false;
  torch::Dtype storage_ = torch::kFloat32;
  c10::Device device_{c10::kCPU};  // where the dataset is encoded (caches go to host memory)
  std::optional<WeightFiles> base_;
  std::shared_ptr<torch::nn::Module> root_;
  std::shared_ptr<models::LdmUNetImpl> unet_;
  models::LdmUNetOptions unet_options_;
  std::string unet_prefix_;
  // Text encoders (freed after encode_captions) and their tokenizer.
  std::vector<models::ClipTextModel> text_encoders_;
  LdmTokenizer tokenizer_;
  // Caches: latents per bucket [n_b, 4, H/8, W/8] (one bucket of all N
  // images without buckets), their mirror images with flip_aug, and each
  // image's row in its bucket; context [U + 1, 77, D] and (SDXL) pooled
  // [U + 1, P] for U distinct captions plus the empty caption last; caption_row_ [N].
  BucketLatents latents_;
  at::Tensor context_, pooled_, caption_row_;
  int64_t caption_rows_ = 0;  // U + 1 (the empty caption is row U)
  // Disk caches (cache_latents_to_disk / cache_text_encoder_outputs_to_disk):
  // the key of each image's latents and of each caption row's embeddings.
  std::optional<TensorCache> latent_cache_, text_cache_;
  std::vector<std::string> latent_key_, text_key_;
  LdmCacheStats cache_stats_;
  DiskCacheRun cache_run_;  // this process's part in filling the disk caches (ldm_cache.h)
  BucketReso sample_size_;
  bool has_flip_ = false;
  // Sample prompts and their negatives: context [T, 77, D] and (SDXL) pooled
  // [T, P] of each distinct text, and its row.
  at::Tensor sample_context_, sample_pooled_;
  std::map<std::string, int64_t> sample_row_;
};

std::shared_ptr<torch::nn::Module> LdmTrainingModel::build_unet_root(const nn::LayerInit& init,
                                                                     std::shared_ptr<models::LdmUNetImpl>* unet) const {
  models::LdmUNet built(models::LdmUNetOptions(unet_options_).init(init));
  auto root = std::make_shared<torch::nn::Module>("CheckpointRoot");
  nn::register_at(*root, "model.diffusion_model", built);  // kUNetPrefix without its dot
  if (unet) *unet = built.ptr();
  return root;
}

std::string LdmTrainingModel::detect_unet_prefix() const {
  const auto shapes = [&] {
    std::vector<models::TensorShape> s;
    for (const auto& name : base_->names()) s.emplace_back(name, base_->find(name)->shape);
    return s;
  }();
  std::string prefix;
  bool found = false;
  std::vector<std::string> seen;
  for (const auto& d : models::detect_architectures(shapes)) {
    seen.push_back(fmt::format("{}{} under '{}'", d.architecture, d.tiny ? " (tiny)" : "", d.prefix));
    if (d.architecture == config_.architecture && d.tiny == config_.tiny) {
      prefix = d.prefix;
      found = true;
    }
  }
  if (!found) {
    for (const auto& d : models::detect_architectures(shapes)) {
      if (d.architecture == config_.architecture) {
        fail("{}: holds a {}{} UNet; set model.tiny = {}", base_->path(), d.architecture, d.tiny ? " (tiny)" : "",
             d.tiny ? "true" : "false");
      }
    }
    fail("{}: holds no {}{} UNet (found: {}); set model.architecture to the checkpoint's architecture{}", base_->path(),
         config_.architecture, config_.tiny ? " (tiny)" : "",
         seen.empty() ? std::string("nothing recognisable") : fmt::format("{}", fmt::join(seen, ", ")),
         " (shoestring inspect FILE shows it; a diffusers-layout UNet converts with `shoestring convert --to ldm`)");
  }
  return prefix;
}

void LdmTrainingModel::load_unet() {
  LoadWeightsOptions o;
  o.key_map = [prefix = unet_prefix_](const std::string& key) -> std::string {
    if (!has_prefix(key, prefix)) return "";
    return kUNetPrefix + key.substr(prefix.size());
  };
  // Other models' keys (VAE, text encoders) live under other prefixes; with
  // a bare UNet file every key maps.
  load_weights(*root_, *base_, o);
}

void LdmTrainingModel::check_resolution() const {
  if (dataset_.bucketed()) return;  // kohya datasets: check_training_datasets
  const int64_t r = config_.resolution;
  const int64_t levels = static_cast<int64_t>(unet_options_.channel_mult().size());
  const int64_t multiple = 8 * (int64_t{1} << (levels - 1));
  if (r % multiple != 0) {
    fail("resolution = {}: {} needs a multiple of {} pixels (VAE factor 8 x {} UNet downsamplings)", r,
         config_.architecture, multiple, levels - 1);
  }
}

void LdmTrainingModel::build_tokenizer() {
  tokenizer_ = build_text_tokenizer(config_.tokenizer_dir, config_.tiny, dataset_.captions(), config_.sample_prompts,
                                    config_.architecture);
}

void LdmTrainingModel::load_text_encoders() {
  try {
    text_encoders_ = build_ldm_text_encoders(unet_options_, config_.tiny, base_ ? &*base_ : nullptr,
                                             static_cast<uint64_t>(config_.seed), config_.clip_skip, tokenizer_,
                                             config_.architecture);
  } catch (const Error& e) {
    if (!tokenizer_.clip || std::string(e.what()).find("vocab.json") == std::string::npos) throw;
    fail("tokenizer_dir '{}': {}", config_.tokenizer_dir, e.what());
  }
}

std::pair<at::Tensor, at::Tensor> LdmTrainingModel::encode_text(const std::vector<std::string>& captions) {
  const auto cache_dtype = storage_ == torch::kHalf ? torch::kFloat32 : storage_;
  return encode_ldm_text(text_encoders_, tokenizer_, captions, config_.clip_skip, device_, cache_dtype);
}

at::Tensor LdmTrainingModel::sdxl_y(const at::Tensor& pooled, const std::vector<double>& sizes) const {
  const auto cache_dtype = storage_ == torch::kHalf ? torch::kFloat32 : storage_;
  return sdxl_vector_y(pooled, sizes, unet_options_.adm_in_channels(), cache_dtype);
}

std::vector<std::string> LdmTrainingModel::caption_texts() {
  CaptionRows c = caption_rows(dataset_.captions());
  caption_row_ = torch::tensor(c.rows, torch::kInt64);
  caption_rows_ = static_cast<int64_t>(c.texts.size());
  return std::move(c.texts);
}

void LdmTrainingModel::encode_captions() {
  ScopedMemoryCategory category(MemoryCategory::other);
  for (auto& te : text_encoders_) te->to(device_);
  const std::vector<std::string> unique = caption_texts();
  std::vector<at::Tensor> contexts, ys;
  const size_t chunk = 16;
  for (size_t i = 0; i < unique.size(); i += chunk) {
    std::vector<std::string> part(unique.begin() + static_cast<std::ptrdiff_t>(i),
                                  unique.begin() + static_cast<std::ptrdiff_t>(std::min(unique.size(), i + chunk)));
    auto [c, y] = encode_text(part);
    contexts.push_back(c);
    if (y.defined()) ys.push_back(y);
  }
  context_ = torch::cat(contexts, 0);
  if (!ys.empty()) pooled_ = torch::cat(ys, 0);
  std::tie(sample_context_, sample_pooled_) = encode_text(sample_texts());
}

std::vector<std::string> LdmTrainingModel::sample_texts() {
  return sample_prompt_texts(config_.sample_prompts, sample_row_);
}

std::vector<std::string> LdmTrainingModel::text_encoder_identities() const {
  const std::vector<std::string> prefixes =
      sdxl_ ? std::vector<std::string>{models::kSdxlClipLPrefix, models::kSdxlClipGPrefix}
            : std::vector<std::string>{models::kSd15ClipPrefix};
  std::vector<std::string> out;
  for (size_t i = 0; i < prefixes.size(); ++i) {
    // build_ldm_text_encoders: from the base file, else (tiny) seeded random init.
    out.push_back(base_ ? "file:" + weights_identity(*base_, prefixes[i], cache_stats_.dir)
                        : fmt::format("random seed {} tiny {}", config_.seed + 101 + static_cast<int64_t>(i),
                                      config_.architecture));
  }
  return out;
}

models::AutoencoderKL LdmTrainingModel::build_vae(bool for_decoding) {
  (void)for_decoding;
  std::optional<WeightFiles> vae_file;
  if (!config_.vae.empty()) vae_file.emplace(WeightFiles::open(expand_path(config_.vae)));
  const WeightFiles* files = vae_file ? &*vae_file : base_ ? &*base_ : nullptr;
  if (!files && !config_.tiny) {
    fail("(none): holds no VAE (no '{}*' keys); set vae = FILE to a VAE safetensors", kVaePrefix);
  }
  try {
    // A separate VAE file may hold bare keys.
    return build_ldm_vae(sdxl_, config_.tiny, files, vae_file.has_value(), static_cast<uint64_t>(config_.seed));
  } catch (const Error& e) {
    if (std::string(e.what()).find("holds no VAE") == std::string::npos) throw;
    fail("{}; set vae = FILE to a VAE safetensors", e.what());
  }
}

void LdmTrainingModel::encode_images() {
  models::AutoencoderKL vae = build_vae(false);
  vae->to(device_);
  ScopedMemoryCategory category(MemoryCategory::other);
  const auto cache_dtype = storage_ == torch::kHalf ? torch::kFloat32 : storage_;
  // The distribution's mean, scaled: deterministic latents (OneTrainer and
  // kohya sample once instead; the difference is the VAE's tiny variance).
  latents_ = encode_bucket_latents(dataset_, has_flip_, device_, cache_dtype, [&](const at::Tensor& pixels) {
    return vae->encode_latents(pixels, /*sample=*/false);
  });
}

std::string LdmTrainingModel::vae_identity() {
  const std::string scale = sdxl_ ? "0.13025" : "0.18215";
  if (!config_.vae.empty()) {
    WeightFiles f = WeightFiles::open(expand_path(config_.vae));
    bool prefixed = false;
    for (const auto& n : f.names()) prefixed = prefixed || has_prefix(n, kVaePrefix);
    return "file:" + weights_identity(f, prefixed ? kVaePrefix : "", cache_stats_.dir) + " scale " + scale;
  }
  if (base_) return "file:" + weights_identity(*base_, kVaePrefix, cache_stats_.dir) + " scale " + scale;
  // A tiny run without weights: the VAE is build_vae's seeded random init.
  return fmt::format("random seed {} tiny {} scale {}", config_.seed + 100, config_.architecture, scale);
}

void LdmTrainingModel::cache_captions(bool quiet) {
  ScopedMemoryCategory category(MemoryCategory::other);
  const auto cache_dtype = storage_ == torch::kHalf ? torch::kFloat32 : storage_;
  // Caption rows as encode_captions makes them.
  const std::vector<std::string> unique = caption_texts();
  const std::vector<std::string> prompts = sample_texts();

  // What a text entry depends on: the encoders' weights, clip_skip, dtype and
  // the token ids each encoder is fed.
  // A base file without text encoders: build_ldm_text_encoders' error.
  bool has_text_encoder = !base_;
  for (const auto& n : base_ ? base_->names() : std::vector<std::string>{}) {
    has_text_encoder = has_text_encoder || has_prefix(n, sdxl_ ? models::kSdxlClipLPrefix : models::kSd15ClipPrefix);
  }
  if (!has_text_encoder) load_text_encoders();
  std::string encoders;
  for (const std::string& id : text_encoder_identities()) encoders += id + ";";
  const int64_t skip = sdxl_ ? 2 : config_.clip_skip;
  const std::string head = fmt::format("{}|text|{}|{}|clip_skip {}|{}|ids:", kLdmCacheVersion, sdxl_ ? "sdxl" : "sd",
                                       encoders, skip, cache_dtype_key(cache_dtype));
  auto key_of = [&](const std::string& text) {
    std::string canonical = head;
    std::vector<ClipPadding> pads = {ClipPadding::kEndOfText};
    if (sdxl_) pads.push_back(ClipPadding::kZero);
    for (ClipPadding pad : pads) {
      const at::Tensor ids = tokenizer_.encode({text}, pad).to(torch::kInt64).contiguous();
      canonical.append(static_cast<const char*>(ids.data_ptr()), static_cast<size_t>(ids.nbytes()));
    }
    return content_key128(canonical);
  };
  text_key_.clear();
  for (const std::string& t : unique) text_key_.push_back(key_of(t));
  std::vector<std::string> sample_keys;
  for (const std::string& p : prompts) sample_keys.push_back(key_of(p));

  const std::string dir = (fs::path(cache_stats_.dir) / "text").string();
  std::vector<std::string> all = text_key_;
  all.insert(all.end(), sample_keys.begin(), sample_keys.end());
  std::vector<std::string> texts = unique;
  texts.insert(texts.end(), prompts.begin(), prompts.end());
  FilledCache filled =
      fill_disk_cache(dir, "text", "text", all, cache_run_, cache_stats_.problems,
                      [&](const std::vector<size_t>& missing, ShardWriter& shards) {
                        load_text_encoders();
                        for (auto& te : text_encoders_) te->to(device_);
                        // In the chunks encode_captions makes (16 rows).
                        for_each_text_batch(missing, unique.size(), texts, 16,
                                            [&](const std::vector<size_t>& rows, const std::vector<std::string>& part) {
                                              auto [context, pooled] = encode_text(part);
                                              for (size_t j = 0; j < rows.size(); ++j) {
                                                const auto r = static_cast<int64_t>(j);
                                                CacheEntry e{all[rows[j]], {{"context", context[r]}}};
                                                if (pooled.defined()) e.tensors.emplace_back("pooled", pooled[r]);
                                                shards.add(std::move(e));
                                              }
                                            });
                        text_encoders_.clear();
                      });
  text_cache_.emplace(std::move(filled.cache));
  cache_stats_.text_entries = filled.entries;
  cache_stats_.text_encoded = filled.encoded;
  cache_stats_.text_waited = filled.waited;
  // Sample prompts stay in memory (a few rows, in sample_row_'s order).
  std::vector<at::Tensor> contexts, pools;
  for (const std::string& k : sample_keys) {
    std::vector<at::Tensor> entry = text_cache_->read(k);
    contexts.push_back(entry[0]);
    if (sdxl_) pools.push_back(entry.at(1));
  }
  if (!contexts.empty()) sample_context_ = torch::stack(contexts);
  if (!pools.empty()) sample_pooled_ = torch::stack(pools);
}

void LdmTrainingModel::cache_images(bool quiet) {
  ScopedMemoryCategory category(MemoryCategory::other);
  torch::NoGradGuard no_grad;
  const auto cache_dtype = storage_ == torch::kHalf ? torch::kFloat32 : storage_;
  // What a latent entry depends on: the image file's bytes, how it was
  // fitted to its training size, the VAE, flip and dtype.
  const std::string head =
      fmt::format("{}|latent|vae {}|{}", kLdmCacheVersion, vae_identity(), cache_dtype_key(cache_dtype));
  latent_key_ = latent_entry_keys(dataset_, head);
  const std::string dir = (fs::path(cache_stats_.dir) / "latents").string();
  FilledCache filled = fill_disk_cache(
      dir, "latents", "latent", latent_key_, cache_run_, cache_stats_.problems,
      [&](const std::vector<size_t>& missing, ShardWriter& shards) {
        models::AutoencoderKL vae = build_vae(false);
        vae->to(device_);
        encode_missing_latents(dataset_, latent_key_, missing, shards, device_, cache_dtype,
                               [&](const at::Tensor& pixels) { return vae->encode_latents(pixels, false); });
      });
  latent_cache_.emplace(std::move(filled.cache));
  cache_stats_.latent_entries = filled.entries;
  cache_stats_.latents_encoded = filled.encoded;
  cache_stats_.latents_waited = filled.waited;
}

at::Tensor LdmTrainingModel::sample(const SampleRequest& request) {
  if (request.prompts.empty() || request.seeds.empty()) fail("sample: no prompts or no seeds");
  const EvalModeScope eval_mode(*root_);
  torch::NoGradGuard no_grad;
  const auto dtype = nn::value_dtype(unet_->out_conv->weight);
  const at::Device device = unet_->out_conv->weight.device();
  const SamplerKind sampler = parse_sampler(config_.sample_sampler, "sample_sampler");
  // Prompts were encoded before the text encoders were freed.
  std::vector<at::Tensor> latents;
  int64_t height = 0, width = 0;
  for (size_t i = 0; i < request.prompts.size(); ++i) {
    const SamplePrompt p = parse_sample_prompt(request.prompts[i], fmt::format("sample prompt {}", i + 1));
    const auto cond = sample_row_.find(p.prompt), negative = sample_row_.find(p.negative);
    if (cond == sample_row_.end() || negative == sample_row_.end())
      fail("sample: prompt '{}' is not one of sample_prompts (encoded before training)", request.prompts[i]);
    // The rows of one grid share a size (the config's check): --w / --h, else the dataset's.
    height = p.height > 0 ? p.height : sample_size_.height;
    width = p.width > 0 ? p.width : sample_size_.width;
    check_sample_size(height, width, request.prompts[i]);
    const double cfg = p.cfg.value_or(request.cfg);
    std::vector<int64_t> rows{cond->second};
    if (cfg != 1.0) rows.push_back(negative->second);
    const at::Tensor index = torch::tensor(rows, torch::kInt64);
    at::Tensor y;
    if (sdxl_) {
      // original = target = the sample size, crop (0, 0).
      const auto h = static_cast<double>(height), w = static_cast<double>(width);
      std::vector<double> sizes;
      for (size_t k = 0; k < rows.size(); ++k) sizes.insert(sizes.end(), {h, w, 0.0, 0.0, h, w});
      y = sdxl_y(sample_pooled_.index_select(0, index), sizes).to(device, dtype);
    }
    const int64_t steps = p.steps > 0 ? p.steps : request.steps;
    latents.push_back(sample_ldm_latents(*unet_, sample_context_.index_select(0, index).to(device, dtype), y, cfg,
                                         row_seeds(p, request), height, width, sampler,
                                         sampling_levels(schedule_, sampler, steps), config_.v_parameterization));
  }
  models::AutoencoderKL vae = build_vae(true);
  vae->to(device);
  std::vector<at::Tensor> images;
  for (const at::Tensor& z : latents) {
    for (int64_t k = 0; k < z.size(0); ++k) {
      images.push_back(vae->decode_latents(z.slice(0, k, k + 1).to(device)).to(at::kCPU, torch::kFloat32));
    }
  }
  return samples_to_uint8(torch::cat(images, 0), request);
}

void LdmTrainingModel::check_sample_size(int64_t height, int64_t width, const std::string& prompt) const {
  const int64_t levels = static_cast<int64_t>(unet_options_.channel_mult().size());
  const int64_t multiple = 8 * (int64_t{1} << (levels - 1));
  if (height % multiple != 0 || width % multiple != 0) {
    fail("sample prompt '{}': {} x {} px; {} needs multiples of {} pixels (VAE factor 8 x {} UNet downsamplings)",
         prompt, width, height, config_.architecture, multiple, levels - 1);
  }
}

std::vector<std::pair<std::string, at::Tensor>> LdmTrainingModel::companion_tensors() {
  std::vector<std::pair<std::string, at::Tensor>> out;
  const bool own_vae = !config_.vae.empty();
  if (base_) {
    // Everything of the base file but its UNet (VAE, text encoders, buffers),
    // memory-mapped, as it is.
    std::string unet_prefix;
    for (const auto& n : base_->names()) {
      if (has_prefix(n, kUNetPrefix)) unet_prefix = kUNetPrefix;
    }
    for (const auto& n : base_->names()) {
      if (unet_prefix.empty()) break;  // a bare UNet file: nothing beside it
      if (has_prefix(n, kUNetPrefix) || (own_vae && has_prefix(n, kVaePrefix))) continue;
      out.emplace_back(n, base_->get_values(n));  // fp8 bytes (libtorch < 2.1) as bf16 values
    }
  }
  if (own_vae || !base_) {
    // The VAE in use (a separate file, or the tiny random one) under its key prefix.
    models::AutoencoderKL vae = build_vae(true);
    for (const auto& [n, t] : module_tensors(*vae)) out.emplace_back(kVaePrefix + n, t);
  }
  if (!base_) {
    load_text_encoders();
    const std::vector<std::string> prefixes =
        sdxl_ ? std::vector<std::string>{models::kSdxlClipLPrefix, models::kSdxlClipGPrefix}
              : std::vector<std::string>{models::kSd15ClipPrefix};
    for (size_t i = 0; i < text_encoders_.size(); ++i) {
      for (const auto& [n, t] : module_tensors(*text_encoders_[i])) out.emplace_back(prefixes[i] + n, t);
    }
    text_encoders_.clear();
  }
  return out;
}

void LdmTrainingModel::save_final(const std::string& path, int64_t step, bool storage_dtype,
                                  const TensorsByImpl& instead) {
  // The trained UNet under model.diffusion_model. plus the base checkpoint's
  // VAE and text encoders: a single file ComfyUI / A1111 / kohya load as is.
  std::vector<std::pair<std::string, at::Tensor>> tensors = module_tensors(*root_);
  for (auto& item : companion_tensors()) tensors.push_back(std::move(item));
  TrainConfig c = config_;
  if (storage_dtype) c.save_precision = "auto";
  save_module_tensors(path, tensors, metadata(step), c, instead);
}

}  // namespace

std::unique_ptr<TrainingModel> make_ldm_training_model(const TrainConfig& config, const ImageCaptionDataset& dataset,
                                                       const ModelSource& source) {
  return std::make_unique<LdmTrainingModel>(config, dataset, source);
}

}  // namespace shoestring
