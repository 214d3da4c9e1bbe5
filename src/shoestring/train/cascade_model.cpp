// Stable Cascade stage C (cascade-c, cascade-c-lite) as a TrainingModel, the
// way Stability's train/train_c.py, kohya's stable-cascade branch
// (stable_cascade_train_stage_c.py) and OneTrainer train it:
//  - images -> EfficientNet latents [16, H/32, W/32] (models/cascade_coders.h),
//    captions -> OpenCLIP bigG's last-layer states with the tokenizer's
//    attention mask and its projected pooled vector (models/clip_text.h),
//    each once before training, in host memory; the encoders are then freed;
//  - the image embedding clip_img is zeros (text-to-image fine-tuning: kohya
//    and OneTrainer always pass zeros; Stability swaps in a CLIP image
//    embedding for 10 % of its pretraining samples);
//  - the objective is GDF's (train/gdf.h): variance-preserving noise on the
//    cosine schedule, epsilon target, the model's time input r, P2 loss weight;
//  - samples: GDF's DDPM sampler with classifier-free guidance (rho 0.7) and
//    shift 2 (kohya's stage C sampling default), decoded by the previewer
//    (8x the latent size: a preview, not stage B + A's full decode);
//  - the trained stage C is saved with its released keys (no prefix), so the
//    file loads where stage_c.safetensors does.
// The image that the EfficientNet sees is the dataset's: Stability trains at
// 768 px (24 x 24 latents, decoded by stage B to 1024 px); set resolution
// (or the buckets) accordingly.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "shoestring/core/content_hash.h"
#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/core/units.h"
#include "shoestring/data/dataset.h"
#include "shoestring/io/weight_files.h"
#include "shoestring/models/architecture.h"
#include "shoestring/models/cascade.h"
#include "shoestring/models/cascade_coders.h"
#include "shoestring/models/clip_text.h"
#include "shoestring/train/cascade_components.h"
#include "shoestring/train/checkpoint_io.h"
#include "shoestring/train/config.h"
#include "shoestring/train/diffusion_loss.h"
#include "shoestring/train/gdf.h"
#include "shoestring/train/ldm_cache.h"
#include "shoestring/train/ldm_components.h"
#include "shoestring/train/sampling.h"
#include "shoestring/train/training_model_impl.h"

namespace shoestring {
namespace {

class CascadeTrainingModel final : public TrainingModel {
 public:
  CascadeTrainingModel(const TrainConfig& config, const ImageCaptionDataset& dataset, const ModelSource& source)
      : config_(config), dataset_(dataset), device_(source.device) {
    const std::string& arch = config.architecture;
    storage_ = config.full_bf16 ? torch::kBFloat16 : config.full_fp16 ? torch::kHalf : torch::kFloat32;
    cache_dtype_ = storage_ == torch::kHalf ? torch::kFloat32 : storage_;
    const bool text_on_disk = config.cache_text_encoder_outputs_to_disk || source.encode_only;
    const bool latents_on_disk = config.cache_latents_to_disk || source.encode_only;
    if (text_on_disk || latents_on_disk) cache_stats_.dir = ldm_cache_dir(config);
    cache_run_ = disk_cache_run(source);
    if (!source.pretrained.empty()) base_.emplace(open_file("pretrained_model_name_or_path", source.pretrained));
    if (!config.tiny) {
      const char* missing = !base_                                      ? "pretrained_model_name_or_path"
                            : config.effnet_checkpoint_path.empty()     ? "effnet_checkpoint_path"
                            : config.text_model_checkpoint_path.empty() ? "text_model_checkpoint_path"
                                                                        : nullptr;
      if (missing) {
        fail(
            "model.architecture = \"{}\" needs {} (stage_c.safetensors, effnet_encoder.safetensors and OpenCLIP "
            "bigG: pretrained_model_name_or_path, effnet_checkpoint_path, text_model_checkpoint_path); only "
            "model.tiny = true trains from random init",
            arch, missing);
      }
    }
    options_ = models::stage_c_options(arch, config.tiny);
    sample_size_ =
        dataset.bucketed() ? dataset.dataset_resolution(0) : BucketReso{config.resolution, config.resolution};
    for (int64_t i = 0; i < dataset.size() && dataset.bucketed(); ++i) has_flip_ = has_flip_ || dataset.flip_aug(i);
    check_size(sample_size_.height, sample_size_.width, "resolution");
    for (const DatasetBucket& b : dataset.buckets()) check_size(b.reso.height, b.reso.width, "bucket");
    for (size_t i = 0; i < config.sample_prompts.size(); ++i) {
      const SamplePrompt p = parse_sample_prompt(config.sample_prompts[i], fmt::format("sample_prompts[{}]", i));
      check_size(p.height > 0 ? p.height : sample_size_.height, p.width > 0 ? p.width : sample_size_.width,
                 fmt::format("sample_prompts[{}] (--w / --h)", i));
    }
    warn_ignored(config);
    // Everything that can be refused from file headers, before the encoders run.
    {
      models::StageC meta(options_, nn::LayerInit{torch::TensorOptions().dtype(storage_).device(torch::kMeta)});
      if (base_) check_stage_c_file(*meta);
      if (source.check_module) source.check_module(*meta, lora_components(true));
    }
    // The frozen parts' files, checked now rather than after minutes of encoding.
    if (!config.previewer_checkpoint_path.empty()) build_previewer();  // a bad file is refused now, not at sample time
    if (!config.tiny && config.previewer_checkpoint_path.empty() && !config.sample_prompts.empty()) {
      fail(
          "sample_prompts are set but previewer_checkpoint_path is not: {} decodes sample grids with Stable "
          "Cascade's previewer (previewer.safetensors); set it, or remove sample_prompts",
          arch);
    }
    if (!config.effnet_checkpoint_path.empty()) build_effnet();

    tokenizer_ = build_text_tokenizer(config.tokenizer_dir, config.tiny, dataset.captions(), config.sample_prompts,
                                      "Stable Cascade's OpenCLIP bigG");
    if (text_on_disk) {
      cache_captions();
    } else {
      encode_captions();
    }
    if (latents_on_disk) {
      cache_images();
    } else {
      encode_images();
    }
    if (source.cache_stats) *source.cache_stats = cache_stats_;
    if (source.encode_only) return;
    if (!source.quiet) {
      const int64_t bytes = (text_cache_ ? 0 : text_.bytes()) + sample_text_.bytes() + latents_.bytes();
      spdlog::info("bigG text embeddings {}; EfficientNet latents {}; {} in memory; encoders freed",
                   text_cache_ ? "from the disk cache" : "in memory",
                   latent_cache_ ? "from the disk cache a batch at a time" : latents_.describe(), format_bytes(bytes));
    }
    {
      ScopedMemoryCategory category(MemoryCategory::weights);
      nn::LayerInit init{torch::TensorOptions().dtype(build_dtype(config, storage_))};
      init.initialize = !base_;
      stage_c_ = models::StageC(options_, init);
      if (base_) load_weights(*stage_c_, *base_);
    }
    if (config.activation_rescale != 1.0) {
      stage_c_->set_activation_rescale(config.activation_rescale);
      if (!source.quiet)
        spdlog::info(
            "precision.activation_rescale = {}: each TimestepBlock of up_blocks.{} scales the hidden state by it at "
            "run time (fp16 overflow fix; weights and saved files are unchanged)",
            config.activation_rescale, options_.hidden().size() - 1);
    }
  }

  torch::nn::Module& module() override { return *stage_c_; }
  std::vector<nn::BlockTable*> block_tables() override { return {stage_c_->block_table()}; }
  std::vector<nn::LoraComponent> lora_components(bool) const override {
    // OneTrainer's and kohya's stage C LoRA prefix; text embeddings are cached, so only stage C carries one.
    return {{"lora_prior_unet", ""}};
  }

  TrainBatch prepare(const std::vector<int64_t>& idx) override {
    const auto b = static_cast<int64_t>(idx.size());
    if (b == 0) fail("internal: empty batch");
    const auto [latents, mirror] = latent_cache_ ? read_cached_latents(*latent_cache_, latent_key_, idx, has_flip_)
                                                 : latents_.batch(dataset_, idx);
    // flip_aug, caption dropout (the empty caption's row, the last, as Stability
    // replaces the caption by "" in train_c.py) and the noise.
    const LatentBatchDraws draws =
        draw_latent_batch(dataset_, config_, idx, latents, mirror,
                          caption_row_.index_select(0, torch::tensor(idx, torch::kInt64)), caption_rows_ - 1);
    const at::Tensor x0 = draws.x0, rows = draws.caption_rows, eps = draws.noise;
    const at::Tensor t = gdf_sample_times(b);
    const at::Tensor log_snr = schedule_.log_snr(t);
    TrainBatch batch;
    const at::Tensor clip_img = torch::zeros({b, 1, options_.clip_image_dim()}, cache_dtype_);
    const CascadeText text = text_cache_ ? cached_text(rows) : text_.select(rows);
    batch.inputs = {gdf_diffuse(x0, eps, log_snr), schedule_.noise_cond(log_snr), text.text, text.pooled, clip_img};
    batch.target = eps;
    batch.loss_weight = gdf_p2_weight(log_snr);
    return batch;
  }

  at::Tensor forward(const TrainBatch& b) override {
    const auto dtype = nn::value_dtype(stage_c_->clip_txt_mapper->weight);
    return stage_c_->forward(b.inputs[0].to(dtype), b.inputs[1], b.inputs[2].to(dtype), b.inputs[3].to(dtype),
                             b.inputs[4].to(dtype));
  }

  at::Tensor sample(const SampleRequest& request) override;

  std::map<std::string, std::string> metadata(int64_t step) const override {
    std::map<std::string, std::string> meta = {
        {"format", "shoestring"},
        {"architecture", config_.architecture},
        {"tiny", config_.tiny ? "true" : "false"},
        {"layout", "stable-cascade"},
        {"step", std::to_string(step)},
        {"config_hash", config_hash(config_)},
        {"objective", "gdf_epsilon"},
        {"dtype", stored_dtype_name(*stage_c_)},
        {"title", fmt::format("{} step {}", std::filesystem::path(config_.output_dir).filename().string(), step)}};
    if (tokenizer_.words) meta["tokenizer"] = tokenizer_.words->to_json().dump();
    return meta;
  }

  void save_final(const std::string& path, int64_t step, bool storage_dtype, const TensorsByImpl& instead) override {
    TrainConfig c = config_;
    if (storage_dtype) c.save_precision = "auto";
    save_module_tensors(path, module_tensors(*stage_c_), metadata(step), c, instead);
  }
  bool base_reloadable() const override { return base_.has_value(); }

 private:
  // Keys of the LDM families that this one reads nothing of, set away from their defaults.
  static void warn_ignored(const TrainConfig& c) {
    const TrainConfig d;
    std::vector<std::string> ignored;
    if (c.clip_skip != d.clip_skip) ignored.push_back("clip_skip (bigG's last layer is stage C's input)");
    if (c.sample_sampler != d.sample_sampler) ignored.push_back("sample_sampler (GDF's DDPM sampler is used)");
    if (!ignored.empty())
      spdlog::warn("model.architecture = \"{}\" ignores {}", c.architecture, fmt::join(ignored, ", "));
    if ((c.full_fp16 || c.mixed_precision == "fp16") && c.activation_rescale == 1.0)
      spdlog::warn(
          "{}: Stable Cascade's stage C overflows fp16 in its last up-block group (Stability: bf16 or fp32 only); "
          "the loss scaler skips overflowing steps, but a full-width run may skip most of them; set "
          "precision.activation_rescale (docs/architectures.md) or prefer bf16",
          c.full_fp16 ? "full_fp16" : "mixed_precision = \"fp16\"");
  }

  // The base file must hold stage C under its released keys (no prefix): refused
  // from the header, naming what the file holds instead.
  void check_stage_c_file(torch::nn::Module& meta) const {
    std::map<std::string, std::vector<int64_t>> expected, found;
    for (const auto& p : meta.named_parameters()) expected[p.key()] = p.value().sizes().vec();
    std::vector<models::TensorShape> shapes;
    for (const auto& n : base_->names()) {
      found[n] = base_->find(n)->shape;
      shapes.emplace_back(n, base_->find(n)->shape);
    }
    const KeyDiff diff = diff_keys(expected, found);
    if (diff.empty()) return;
    std::vector<std::string> held;
    for (const auto& d : models::detect_architectures(shapes)) {
      held.push_back(fmt::format("{}{}{}", d.architecture, d.tiny ? " (tiny)" : "",
                                 d.prefix.empty() ? "" : " under '" + d.prefix + "'"));
    }
    fail("pretrained_model_name_or_path {}: expected {}{} stage C with the released keys (no prefix){}; {}",
         base_->path(), config_.architecture, config_.tiny ? " (tiny)" : "",
         held.empty() ? "" : fmt::format(", found {}", fmt::join(held, ", ")), diff.describe());
  }

  // WeightFiles::open of a config key's path, errors naming the key.
  static WeightFiles open_file(const std::string& key, const std::string& value) {
    const std::string path = expand_path(value);
    try {
      return WeightFiles::open(path);
    } catch (const Error& e) {
      fail("{} = \"{}\": {}", key, value, e.what());
    }
  }

  void check_size(int64_t height, int64_t width, const std::string& what) const {
    check_cascade_size(options_, height, width, what, config_.architecture);
  }

  // A frozen part's file from its config key, or none (tiny runs' random parts).
  static std::optional<WeightFiles> file_of(const char* key, const std::string& value) {
    if (value.empty()) return std::nullopt;
    return open_file(key, value);
  }

  models::ClipTextModel build_text_encoder() const {
    const std::optional<WeightFiles> files = file_of("text_model_checkpoint_path", config_.text_model_checkpoint_path);
    models::ClipTextModel te =
        build_cascade_text_encoder(files ? &*files : nullptr, "text_model_checkpoint_path", config_.tiny,
                                   options_.clip_text_dim(), static_cast<uint64_t>(config_.seed));
    te->eval();
    te->to(device_);
    return te;
  }

  // The identity of a frozen part's weights (cache keys): its file's tensors
  // (under `prefix` when the file holds them there, e.g. bigG in an SDXL file),
  // or a tiny run's seed.
  std::string part_identity(const char* key, const std::string& value, const std::string& prefix,
                            int64_t seed_offset) const {
    if (value.empty()) return fmt::format("random seed {} tiny {}", config_.seed + seed_offset, config_.architecture);
    const WeightFiles files = open_file(key, value);
    bool prefixed = false;
    for (const auto& n : files.names()) prefixed = prefixed || (!prefix.empty() && n.rfind(prefix, 0) == 0);
    return "file:" + weights_identity(files, prefixed ? prefix : "", cache_stats_.dir);
  }

  // The disk cache of bigG's conditioning (train/ldm_cache.h): one entry per
  // distinct caption, "" and sample text ("text" [77, 1280], "pooled" [1,
  // 1280], cache dtype), keyed by the token ids, bigG's identity and dtype.
  void cache_captions() {
    ScopedMemoryCategory category(MemoryCategory::other);
    const CaptionRows captions = caption_rows(dataset_.captions());
    caption_row_ = torch::tensor(captions.rows, torch::kInt64);
    caption_rows_ = static_cast<int64_t>(captions.texts.size());
    const std::vector<std::string> samples = sample_prompt_texts(config_.sample_prompts, sample_row_);
    std::vector<std::string> texts = captions.texts;
    texts.insert(texts.end(), samples.begin(), samples.end());
    const std::string head = fmt::format(
        "{}|cascade-text|bigG {}|{}|ids:", kLdmCacheVersion,
        part_identity("text_model_checkpoint_path", config_.text_model_checkpoint_path, models::kSdxlClipGPrefix, 101),
        cache_dtype_key(cache_dtype_));
    std::vector<std::string> keys;
    for (const std::string& text : texts) {
      const at::Tensor ids = tokenizer_.encode({text}, ClipPadding::kEndOfText).to(torch::kInt64).contiguous();
      keys.push_back(content_key128(
          head + std::string(static_cast<const char*>(ids.data_ptr()), static_cast<size_t>(ids.nbytes()))));
    }
    FilledCache filled = fill_disk_cache(
        (std::filesystem::path(cache_stats_.dir) / "text").string(), "text", "text", keys, cache_run_,
        cache_stats_.problems, [&](const std::vector<size_t>& missing, ShardWriter& shards) {
          models::ClipTextModel te = build_text_encoder();
          // Captions, then sample texts, each encoded as encode_captions batches them.
          for_each_text_batch(
              missing, captions.texts.size(), texts, 0,
              [&](const std::vector<size_t>& rows, const std::vector<std::string>& part) {
                const CascadeText encoded = encode_cascade_text(te, tokenizer_, part, cache_dtype_);
                for (size_t j = 0; j < rows.size(); ++j) {
                  const auto r = static_cast<int64_t>(j);
                  shards.add(CacheEntry{keys[rows[j]], {{"text", encoded.text[r]}, {"pooled", encoded.pooled[r]}}});
                }
              });
        });
    text_cache_.emplace(std::move(filled.cache));
    cache_stats_.text_entries = filled.entries;
    cache_stats_.text_encoded = filled.encoded;
    cache_stats_.text_waited = filled.waited;
    text_key_.assign(keys.begin(), keys.begin() + static_cast<std::ptrdiff_t>(captions.texts.size()));
    // Sample texts stay in memory (a few rows, in sample_row_'s order).
    if (!samples.empty())
      sample_text_ = read_text({keys.begin() + static_cast<std::ptrdiff_t>(captions.texts.size()), keys.end()});
  }

  // Text rows read from the disk cache, one per key.
  CascadeText read_text(const std::vector<std::string>& keys) const {
    std::vector<at::Tensor> texts, pools;
    for (const std::string& k : keys) {
      const std::vector<at::Tensor> entry = text_cache_->read(k);
      texts.push_back(entry.at(0));
      pools.push_back(entry.at(1));
    }
    return {torch::stack(texts), torch::stack(pools)};
  }

  // The batch's text rows (int64 [B], caption rows) from the disk cache.
  CascadeText cached_text(const at::Tensor& rows) const {
    std::vector<std::string> keys;
    for (int64_t i = 0; i < rows.size(0); ++i)
      keys.push_back(text_key_.at(static_cast<size_t>(rows[i].item<int64_t>())));
    return read_text(keys);
  }

  // The disk cache of the EfficientNet latents, keyed as the LDM families' with the encoder's identity.
  void cache_images() {
    ScopedMemoryCategory category(MemoryCategory::other);
    const std::string effnet = part_identity("effnet_checkpoint_path", config_.effnet_checkpoint_path, "", 100);
    latent_key_ = latent_entry_keys(dataset_, fmt::format("{}|cascade-latent|effnet {}|{}", kLdmCacheVersion, effnet,
                                                          cache_dtype_key(cache_dtype_)));
    FilledCache filled = fill_disk_cache(
        (std::filesystem::path(cache_stats_.dir) / "latents").string(), "latents", "latent", latent_key_, cache_run_,
        cache_stats_.problems, [&](const std::vector<size_t>& missing, ShardWriter& shards) {
          models::EfficientNetEncoder e = build_effnet();
          e->to(device_);
          encode_missing_latents(dataset_, latent_key_, missing, shards, device_, cache_dtype_,
                                 [&](const at::Tensor& pixels) { return e->encode(pixels); });
        });
    latent_cache_.emplace(std::move(filled.cache));
    cache_stats_.latent_entries = filled.entries;
    cache_stats_.latents_encoded = filled.encoded;
    cache_stats_.latents_waited = filled.waited;
  }

  void encode_captions() {
    ScopedMemoryCategory category(MemoryCategory::other);
    models::ClipTextModel te = build_text_encoder();
    const CaptionRows captions = caption_rows(dataset_.captions());
    caption_row_ = torch::tensor(captions.rows, torch::kInt64);
    caption_rows_ = static_cast<int64_t>(captions.texts.size());
    text_ = encode_cascade_text(te, tokenizer_, captions.texts, cache_dtype_);
    const std::vector<std::string> sample_texts = sample_prompt_texts(config_.sample_prompts, sample_row_);
    if (!sample_texts.empty()) sample_text_ = encode_cascade_text(te, tokenizer_, sample_texts, cache_dtype_);
  }

  models::EfficientNetEncoder build_effnet() const {
    const std::optional<WeightFiles> files = file_of("effnet_checkpoint_path", config_.effnet_checkpoint_path);
    return build_cascade_effnet(files ? &*files : nullptr, "effnet_checkpoint_path", config_.tiny,
                                static_cast<uint64_t>(config_.seed));
  }

  models::Previewer build_previewer() const {
    const std::optional<WeightFiles> files = file_of("previewer_checkpoint_path", config_.previewer_checkpoint_path);
    return build_cascade_previewer(files ? &*files : nullptr, "previewer_checkpoint_path", config_.tiny,
                                   static_cast<uint64_t>(config_.seed));
  }

  void encode_images() {
    models::EfficientNetEncoder effnet = build_effnet();
    effnet->eval();
    effnet->to(device_);
    ScopedMemoryCategory category(MemoryCategory::other);
    latents_ = encode_bucket_latents(dataset_, has_flip_, device_, cache_dtype_,
                                     [&](const at::Tensor& pixels) { return effnet->encode(pixels); });
  }

  TrainConfig config_;
  const ImageCaptionDataset& dataset_;
  c10::Device device_{c10::kCPU};
  torch::Dtype storage_ = torch::kFloat32, cache_dtype_ = torch::kFloat32;
  std::optional<WeightFiles> base_;
  models::StageCOptions options_;
  models::StageC stage_c_{nullptr};
  GdfCosineSchedule schedule_;
  LdmTokenizer tokenizer_;
  BucketReso sample_size_;
  // Latents per bucket [n_b, 16, H/32, W/32] and each image's row in its bucket;
  // text [U + 1, 77, W] and pooled [U + 1, 1, P] (the empty caption last), each image's caption row.
  BucketLatents latents_;
  bool has_flip_ = false;
  CascadeText text_, sample_text_;  // the captions' (the empty one last) and the sample prompts'
  at::Tensor caption_row_;
  int64_t caption_rows_ = 0;
  std::map<std::string, int64_t> sample_row_;
  // Disk caches (cache_latents_to_disk, cache_text_encoder_outputs_to_disk, `shoestring cache`).
  LdmCacheStats cache_stats_;
  DiskCacheRun cache_run_;
  std::optional<TensorCache> latent_cache_, text_cache_;
  std::vector<std::string> latent_key_, text_key_;  // per image; per caption row
};

at::Tensor CascadeTrainingModel::sample(const SampleRequest& request) {
  if (request.prompts.empty() || request.seeds.empty()) fail("sample: no prompts or no seeds");
  const EvalModeScope eval_mode(*stage_c_);
  std::vector<at::Tensor> latents;
  for (size_t i = 0; i < request.prompts.size(); ++i) {
    const SamplePrompt p = parse_sample_prompt(request.prompts[i], fmt::format("sample prompt {}", i + 1));
    const auto cond = sample_row_.find(p.prompt), negative = sample_row_.find(p.negative);
    if (cond == sample_row_.end() || negative == sample_row_.end())
      fail("sample: prompt '{}' is not one of sample_prompts (encoded before training)", request.prompts[i]);
    const int64_t height = p.height > 0 ? p.height : sample_size_.height;
    const int64_t width = p.width > 0 ? p.width : sample_size_.width;
    check_size(height, width, "sample prompt '" + request.prompts[i] + "':");
    const CascadeText c = sample_text_.select(torch::tensor({cond->second}, torch::kInt64));
    const CascadeText u = sample_text_.select(torch::tensor({negative->second}, torch::kInt64));
    for (const uint64_t seed : row_seeds(p, request)) {
      latents.push_back(sample_stage_c_latent(*stage_c_, c, u, seed, height, width,
                                              p.steps > 0 ? p.steps : request.steps, p.cfg.value_or(request.cfg)));
    }
  }
  models::Previewer previewer = build_previewer();
  previewer->to(module_device(*stage_c_));
  std::vector<at::Tensor> images;
  for (const at::Tensor& z : latents) images.push_back(preview_images(*previewer, z));
  return samples_to_uint8(torch::cat(images, 0), request);
}

}  // namespace

std::unique_ptr<TrainingModel> make_cascade_training_model(const TrainConfig& config,
                                                           const ImageCaptionDataset& dataset,
                                                           const ModelSource& source) {
  return std::make_unique<CascadeTrainingModel>(config, dataset, source);
}

}  // namespace shoestring
