// Stable Diffusion 3.5 Medium (sd35m) as a TrainingModel, the way kohya's
// sd3_train.py, diffusers' train_dreambooth_sd3.py and OneTrainer train it:
//  - images -> the SD3 VAE's 16-channel latents, (z - 0.0609) * 1.5305
//    (models/vae.h VaeOptions::sd3), captions -> CLIP-L and OpenCLIP bigG
//    penultimate states (no final LayerNorm) side by side, zero-padded to the
//    MMDiT's context width, followed by T5-XXL's last states (or, without a
//    T5 file, 77 zero tokens, as kohya and diffusers condition without T5);
//    the pooled vector is CLIP-L's unprojected EOS state beside bigG's
//    projected one (Stability's sd3.5 sd3_infer.py / other_impls.py). All of
//    it is encoded once before training into host memory; the encoders are
//    then freed;
//  - the objective is rectified flow (train/flow_matching.h): x_t = (1 - t)
//    x0 + t eps, velocity target eps - x0 (OneTrainer's; kohya and diffusers
//    precondition to x0, which only reweights by t^2), times drawn by
//    timestep_sampling (logit_normal / uniform / mode) with an optional
//    training_shift, per-sample loss weight by weighting_scheme;
//  - samples: Euler on SD3's shifted sigma schedule (shift 3, the SD3.5
//    release's scheduler) with classifier-free guidance, decoded by the VAE;
//  - the trained MMDiT is saved under model.diffusion_model. together with
//    the base file's other tensors (VAE, text encoders), a single file that
//    loads where sd3.5_medium.safetensors does.
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
#include "shoestring/core/text.h"
#include "shoestring/core/units.h"
#include "shoestring/data/dataset.h"
#include "shoestring/data/t5_tokenizer.h"
#include "shoestring/io/weight_files.h"
#include "shoestring/models/architecture.h"
#include "shoestring/models/clip_text.h"
#include "shoestring/models/mmdit.h"
#include "shoestring/models/t5_encoder.h"
#include "shoestring/models/vae.h"
#include "shoestring/train/checkpoint_io.h"
#include "shoestring/train/config.h"
#include "shoestring/train/diffusion_loss.h"
#include "shoestring/train/flow_matching.h"
#include "shoestring/train/ldm_cache.h"
#include "shoestring/train/ldm_components.h"
#include "shoestring/train/sampling.h"
#include "shoestring/train/sd3_components.h"
#include "shoestring/train/training_model_impl.h"

namespace shoestring {
namespace {

class Sd3TrainingModel final : public TrainingModel {
 public:
  Sd3TrainingModel(const TrainConfig& config, const ImageCaptionDataset& dataset, const ModelSource& source)
      : config_(config), dataset_(dataset), device_(source.device) {
    const std::string& arch = config.architecture;
    storage_ = config.full_bf16 ? torch::kBFloat16 : config.full_fp16 ? torch::kHalf : torch::kFloat32;
    cache_dtype_ = storage_ == torch::kHalf ? torch::kFloat32 : storage_;
    const bool text_on_disk = config.cache_text_encoder_outputs_to_disk || source.encode_only;
    const bool latents_on_disk = config.cache_latents_to_disk || source.encode_only;
    if (text_on_disk || latents_on_disk) cache_stats_.dir = ldm_cache_dir(config);
    cache_run_ = disk_cache_run(source);
    if (!source.pretrained.empty()) base_.emplace(open_file("pretrained_model_name_or_path", source.pretrained));
    if (!config.tiny && !base_) {
      fail(
          "model.architecture = \"{}\" needs pretrained_model_name_or_path (sd3.5_medium.safetensors); only "
          "model.tiny = true trains from random init",
          arch);
    }
    options_ = config.tiny ? models::MMDiTOptions::tiny() : models::MMDiTOptions::sd35_medium();
    warn_ignored(config);
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
    // Everything that can be refused from file headers, before the encoders run.
    {
      auto meta = build_root(nn::LayerInit{torch::TensorOptions().dtype(storage_).device(torch::kMeta)});
      if (base_) check_mmdit_file(*meta);
      if (source.check_module) source.check_module(*meta, lora_components(true));
    }
    if (config.tiny && (!config.clip_l.empty() || !config.clip_g.empty())) {
      fail(
          "{}: model.tiny = true trains with random test-width CLIP encoders (width 32, to fit the tiny MMDiT's "
          "64-wide inputs); a released encoder's file does not fit it: remove it, or set model.tiny = false",
          !config.clip_l.empty() ? "clip_l" : "clip_g");
    }
    vae_files_ = vae_source();
    clip_l_files_ = text_file("clip_l", config.clip_l, models::kSd3ClipLPrefix);
    clip_g_files_ = text_file("clip_g", config.clip_g, models::kSd3ClipGPrefix);
    if (!config.t5xxl.empty()) t5_files_ = open_file("t5xxl", config.t5xxl);

    tokenizer_ = build_text_tokenizer(config.tokenizer_dir, config.tiny, dataset.captions(), config.sample_prompts,
                                      "SD3's CLIP-L and bigG");
    if (t5_files_) t5_spiece_ = sd3_t5_spiece(config.tokenizer_dir, "t5xxl", "tokenizer_dir");
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
      spdlog::info("SD3 conditioning: CLIP-L + bigG{} ({}); latents {}; {} in memory; encoders freed",
                   t5_files_ ? " + T5-XXL" : ", T5 as zeros", text_cache_ ? "disk cache" : "in memory",
                   latent_cache_ ? "from the disk cache a batch at a time" : latents_.describe(), format_bytes(bytes));
    }
    {
      ScopedMemoryCategory category(MemoryCategory::weights);
      nn::LayerInit init{torch::TensorOptions().dtype(build_dtype(config, storage_))};
      init.initialize = !base_;
      root_ = build_root(init);
      if (base_) {
        LoadWeightsOptions lo;
        lo.key_map = [](const std::string& key) -> std::string {
          return has_prefix(key, kSd3MMDiTPrefix) ? key : std::string();
        };
        load_weights(*root_, *base_, lo);
      }
    }
  }

  torch::nn::Module& module() override { return *root_; }
  std::vector<nn::BlockTable*> block_tables() override { return {mmdit_->block_table()}; }
  std::vector<nn::LoraComponent> lora_components(bool) const override {
    // kohya's sd3 LoRA prefix for the MMDiT (networks/lora_sd3.py); text embeddings are cached.
    return {{"lora_unet", kSd3MMDiTPrefix}};
  }

  TrainBatch prepare(const std::vector<int64_t>& idx) override {
    const auto b = static_cast<int64_t>(idx.size());
    if (b == 0) fail("internal: empty batch");
    const auto [latents, mirror] = latent_cache_ ? read_cached_latents(*latent_cache_, latent_key_, idx, has_flip_)
                                                 : latents_.batch(dataset_, idx);
    // flip_aug, caption dropout (the empty caption's conditioning, the last row) and the noise.
    const LatentBatchDraws draws =
        draw_latent_batch(dataset_, config_, idx, latents, mirror,
                          caption_row_.index_select(0, torch::tensor(idx, torch::kInt64)), caption_rows_ - 1);
    const at::Tensor x0 = draws.x0, rows = draws.caption_rows, eps = draws.noise;
    const at::Tensor t = sample_flow_times(b, config_.timestep_sampling, config_.logit_mean, config_.logit_std,
                                           config_.mode_scale, config_.training_shift);
    TrainBatch batch;
    const Sd3Text text = text_cache_ ? cached_text(rows) : text_.select(rows);
    batch.inputs = {flow_interpolate(x0, eps, t), t, sd3_context(text.clip, text.t5, options_.context_dim()),
                    text.pooled};
    batch.inputs.push_back(draw_pos_embed_crop(x0.size(2), x0.size(3)));
    batch.target = flow_target(x0, eps);
    // kohya / diffusers take the loss on x0 = x_t - t v: t^2 times the velocity loss; weighting_scheme multiplies it.
    at::Tensor weight;
    if (config_.weighting_scheme != "none") weight = flow_loss_weight(t, config_.weighting_scheme);
    if (config_.precondition_outputs) weight = weight.defined() ? weight * t.square() : t.square();
    batch.loss_weight = weight;
    return batch;
  }

  at::Tensor forward(const TrainBatch& b) override {
    const auto dtype = nn::value_dtype(mmdit_->context_embedder->weight);
    const at::Tensor crop = b.inputs.at(4).cpu();
    return mmdit_->forward(b.inputs[0].to(dtype), b.inputs[1], b.inputs[2].to(dtype), b.inputs[3].to(dtype), {},
                           models::PosEmbedCrop{crop[0][0].item<int64_t>(), crop[0][1].item<int64_t>()});
  }

  at::Tensor sample(const SampleRequest& request) override;

  std::map<std::string, std::string> metadata(int64_t step) const override {
    std::map<std::string, std::string> meta = {
        {"format", "shoestring"},
        {"architecture", config_.architecture},
        {"tiny", config_.tiny ? "true" : "false"},
        {"layout", "sd3-single-file"},
        {"step", std::to_string(step)},
        {"config_hash", config_hash(config_)},
        {"objective", "flow_matching_velocity"},
        {"dtype", stored_dtype_name(*root_)},
        {"title", fmt::format("{} step {}", std::filesystem::path(config_.output_dir).filename().string(), step)}};
    if (tokenizer_.words) meta["tokenizer"] = tokenizer_.words->to_json().dump();
    return meta;
  }

  void save_final(const std::string& path, int64_t step, bool storage_dtype, const TensorsByImpl& instead) override {
    // The trained MMDiT plus the base file's other tensors (VAE, text encoders)
    // as they are, or, without a base file (tiny), the VAE in use.
    std::vector<std::pair<std::string, at::Tensor>> tensors = module_tensors(*root_);
    if (base_) {
      for (const auto& n : base_->names())
        if (!has_prefix(n, kSd3MMDiTPrefix)) tensors.emplace_back(n, base_->get_values(n));
    } else {
      models::AutoencoderKL vae = build_vae();
      for (const auto& [n, t] : module_tensors(*vae)) tensors.emplace_back(kSd3VaePrefix + n, t);
    }
    TrainConfig c = config_;
    if (storage_dtype) c.save_precision = "auto";
    save_module_tensors(path, tensors, metadata(step), c, instead);
  }
  bool base_reloadable() const override { return base_.has_value(); }

 private:
  // Keys of the LDM families that this one reads nothing of, set away from their defaults.
  static void warn_ignored(const TrainConfig& c) {
    const TrainConfig d;
    std::vector<std::string> ignored;
    if (c.clip_skip != d.clip_skip) ignored.push_back("clip_skip (SD3 conditions on the penultimate layers)");
    if (c.sample_sampler != d.sample_sampler)
      ignored.push_back("sample_sampler (SD3's Euler flow sampler with shift 3 is used)");
    if (c.mode_scale != d.mode_scale && c.timestep_sampling != "mode")
      ignored.push_back("mode_scale (only timestep_sampling = \"mode\" reads it)");
    if (!ignored.empty())
      spdlog::warn("model.architecture = \"{}\" ignores {}", c.architecture, fmt::join(ignored, ", "));
  }

  std::shared_ptr<torch::nn::Module> build_root(const nn::LayerInit& init) {
    auto root = std::make_shared<torch::nn::Module>("CheckpointRoot");
    models::MMDiT m(options_, init);
    std::string path = kSd3MMDiTPrefix;
    path.pop_back();
    nn::register_at(*root, path, m.ptr());
    if (init.options.device() != torch::kMeta) mmdit_ = m;
    return root;
  }

  // The base file must hold the MMDiT under model.diffusion_model. (pos_embed included, as the release has it).
  void check_mmdit_file(torch::nn::Module& meta) const {
    std::map<std::string, std::vector<int64_t>> expected, found;
    for (const auto& p : meta.named_parameters()) expected[p.key()] = p.value().sizes().vec();
    for (const auto& b : meta.named_buffers()) expected[b.key()] = b.value().sizes().vec();
    for (const auto& n : base_->names())
      if (has_prefix(n, kSd3MMDiTPrefix)) found[n] = base_->find(n)->shape;
    const KeyDiff diff = diff_keys(expected, found);
    if (diff.empty()) return;
    fail("pretrained_model_name_or_path {}: expected the {}{} MMDiT under '{}' (an SD3.5 Medium single file); {}",
         base_->path(), config_.architecture, config_.tiny ? " (tiny)" : "", kSd3MMDiTPrefix, diff.describe());
  }

  static WeightFiles open_file(const std::string& key, const std::string& value) {
    const std::string path = expand_path(value);
    try {
      return WeightFiles::open(path);
    } catch (const Error& e) {
      fail("{} = \"{}\": {}", key, value, e.what());
    }
  }

  void check_size(int64_t height, int64_t width, const std::string& what) const {
    check_sd3_size(options_, height, width, what,
                   config_.tiny ? config_.architecture + " (tiny)" : config_.architecture);
  }

  // The VAE's file: vae (a file of the VAE alone or under first_stage_model.), else the base file.
  std::optional<WeightFiles> vae_source() const {
    if (!config_.vae.empty()) return open_file("vae", config_.vae);
    if (base_) {
      for (const auto& n : base_->names())
        if (has_prefix(n, kSd3VaePrefix)) return open_file("pretrained_model_name_or_path", base_->path());
      fail("pretrained_model_name_or_path {}: holds no VAE (no '{}*' keys); set vae to the SD3 VAE's file",
           base_->path(), kSd3VaePrefix);
    }
    return std::nullopt;
  }

  models::AutoencoderKL build_vae() const {
    return build_sd3_vae(config_.tiny, vae_files_ ? &*vae_files_ : nullptr, /*bare_keys_allowed=*/!config_.vae.empty(),
                         static_cast<uint64_t>(config_.seed));
  }

  // The batch's crop of the position embedding as int64 [[top, left]] in
  // patches ([-1, -1]: centred): with pos_emb_random_crop_rate, a draw from
  // the global generator (so a resumed run replays it) whether to crop at
  // random, then top and left uniform over the positions that fit, as
  // kohya's MMDiT draws them per forward. No draw at rate 0.
  at::Tensor draw_pos_embed_crop(int64_t latent_h, int64_t latent_w) const {
    std::vector<int64_t> crop{-1, -1};
    if (config_.pos_emb_random_crop_rate > 0 &&
        torch::rand({1}, torch::kFloat64).item<double>() < config_.pos_emb_random_crop_rate) {
      const int64_t m = options_.pos_embed_max_size(), p = options_.patch_size();
      crop[0] = torch::randint(0, m - latent_h / p + 1, {1}, torch::kInt64).item<int64_t>();
      crop[1] = torch::randint(0, m - latent_w / p + 1, {1}, torch::kInt64).item<int64_t>();
    }
    // [1, 2]: one crop for the whole batch, never split into a rank's rows.
    return torch::tensor(crop, torch::kInt64).unsqueeze(0);
  }

  // A text encoder's file: its own key's file, else the base file when it
  // holds the encoder under `prefix` (SD3 files "incl_clips"); none for tiny.
  std::optional<WeightFiles> text_file(const char* key, const std::string& value, const char* prefix) const {
    if (!value.empty()) return open_file(key, value);
    if (base_) {
      for (const auto& n : base_->names())
        if (has_prefix(n, prefix)) return open_file("pretrained_model_name_or_path", base_->path());
    }
    if (!config_.tiny)
      fail(
          "model.architecture = \"{}\" needs {} (text_encoders/{}.safetensors of the SD3.5 release), or a base file "
          "that holds it under '{}'",
          config_.architecture, key, key, prefix);
    return std::nullopt;
  }

  Sd3TextEncoders build_text_encoders() const {
    Sd3TextSources sources;
    sources.clip_l = clip_l_files_ ? &*clip_l_files_ : nullptr;
    sources.clip_g = clip_g_files_ ? &*clip_g_files_ : nullptr;
    sources.t5 = t5_files_ ? &*t5_files_ : nullptr;
    sources.t5_spiece = t5_spiece_;
    sources.tiny = config_.tiny;
    sources.seed = static_cast<uint64_t>(config_.seed);
    Sd3TextEncoders encoders = build_sd3_text_encoders(sources, tokenizer_);
    encoders.t5_max_length = config_.t5xxl_max_token_length;
    encoders.to(device_);
    return encoders;
  }

  void encode_captions() {
    ScopedMemoryCategory category(MemoryCategory::other);
    Sd3TextEncoders encoders = build_text_encoders();
    const CaptionRows captions = caption_rows(dataset_.captions());
    caption_row_ = torch::tensor(captions.rows, torch::kInt64);
    caption_rows_ = static_cast<int64_t>(captions.texts.size());
    text_ = encoders.encode(captions.texts, cache_dtype_, options_);
    const std::vector<std::string> sample_texts = sample_prompt_texts(config_.sample_prompts, sample_row_);
    if (!sample_texts.empty()) sample_text_ = encoders.encode(sample_texts, cache_dtype_, options_);
  }

  // The identity of a text encoder's weights (cache keys): the base file's
  // tensors under `prefix`, a file of its own whole, or a tiny run's seed.
  std::string text_identity(const std::optional<WeightFiles>& files, const std::string& value, const char* prefix,
                            int64_t seed_offset) const {
    if (!files) return fmt::format("random seed {} tiny", config_.seed + seed_offset);
    return "file:" + weights_identity(*files, value.empty() ? prefix : "", cache_stats_.dir);
  }

  // The disk cache of the text conditioning (train/ldm_cache.h): one entry
  // per distinct caption, "" and sample text ("clip" [77, 2048], "pooled"
  // [2048], with T5 "t5" [T, 4096], cache dtype), keyed by the token ids
  // each encoder is fed, the encoders' identities, T5's length and dtype.
  void cache_captions() {
    ScopedMemoryCategory category(MemoryCategory::other);
    const CaptionRows captions = caption_rows(dataset_.captions());
    caption_row_ = torch::tensor(captions.rows, torch::kInt64);
    caption_rows_ = static_cast<int64_t>(captions.texts.size());
    const std::vector<std::string> samples = sample_prompt_texts(config_.sample_prompts, sample_row_);
    std::vector<std::string> texts = captions.texts;
    texts.insert(texts.end(), samples.begin(), samples.end());
    std::optional<T5Tokenizer> t5_tokenizer;
    if (t5_files_) t5_tokenizer.emplace(T5Tokenizer::load(t5_spiece_));
    const std::string head =
        fmt::format("{}|sd3-text|clip_l {}|clip_g {}|t5 {}|t5 length {}|{}|ids:", kLdmCacheVersion,
                    text_identity(clip_l_files_, config_.clip_l, models::kSd3ClipLPrefix, 101),
                    text_identity(clip_g_files_, config_.clip_g, models::kSd3ClipGPrefix, 102),
                    t5_files_ ? "file:" + weights_identity(*t5_files_, "", cache_stats_.dir) : std::string("none"),
                    config_.t5xxl_max_token_length, cache_dtype_key(cache_dtype_));
    std::vector<std::string> keys;
    for (const std::string& text : texts) {
      std::string canonical = head;
      std::vector<at::Tensor> ids = {tokenizer_.encode({text}, ClipPadding::kEndOfText),
                                     tokenizer_.encode({text}, ClipPadding::kZero)};
      if (t5_tokenizer) ids.push_back(t5_tokenizer->tokenize({text}, config_.t5xxl_max_token_length).ids);
      for (const at::Tensor& t : ids) {
        const at::Tensor c = t.to(torch::kInt64).contiguous();
        canonical.append(static_cast<const char*>(c.data_ptr()), static_cast<size_t>(c.nbytes()));
        canonical += '|';
      }
      keys.push_back(content_key128(canonical));
    }
    FilledCache filled = fill_disk_cache(
        (std::filesystem::path(cache_stats_.dir) / "text").string(), "text", "text", keys, cache_run_,
        cache_stats_.problems, [&](const std::vector<size_t>& missing, ShardWriter& shards) {
          Sd3TextEncoders encoders = build_text_encoders();
          // Captions, then sample texts, each encoded as encode_captions batches them.
          for_each_text_batch(
              missing, captions.texts.size(), texts, 0,
              [&](const std::vector<size_t>& rows, const std::vector<std::string>& part) {
                const Sd3Text encoded = encoders.encode(part, cache_dtype_, options_);
                for (size_t j = 0; j < rows.size(); ++j) {
                  const auto r = static_cast<int64_t>(j);
                  CacheEntry e{keys[rows[j]], {{"clip", encoded.clip[r]}, {"pooled", encoded.pooled[r]}}};
                  if (encoded.t5.defined()) e.tensors.emplace_back("t5", encoded.t5[r]);
                  shards.add(std::move(e));
                }
              });
        });
    text_cache_.emplace(std::move(filled.cache));
    cache_stats_.text_entries = filled.entries;
    cache_stats_.text_encoded = filled.encoded;
    cache_stats_.text_waited = filled.waited;
    text_key_.assign(keys.begin(), keys.begin() + static_cast<std::ptrdiff_t>(captions.texts.size()));
    // Sample texts stay in memory (a few rows, in sample_row_'s order).
    if (!samples.empty()) {
      std::vector<std::string> sample_keys(keys.begin() + static_cast<std::ptrdiff_t>(captions.texts.size()),
                                           keys.end());
      sample_text_ = read_text(sample_keys);
    }
  }

  // Text rows read from the disk cache, one per key.
  Sd3Text read_text(const std::vector<std::string>& keys) const {
    std::vector<at::Tensor> clips, pools, t5s;
    for (const std::string& k : keys) {
      const std::vector<at::Tensor> entry = text_cache_->read(k);
      clips.push_back(entry.at(0));
      pools.push_back(entry.at(1));
      if (entry.size() > 2) t5s.push_back(entry[2]);
    }
    Sd3Text out;
    out.clip = torch::stack(clips);
    out.pooled = torch::stack(pools);
    if (!t5s.empty()) out.t5 = torch::stack(t5s);
    return out;
  }

  // The batch's text rows (int64 [B], caption rows) from the disk cache.
  Sd3Text cached_text(const at::Tensor& rows) const {
    std::vector<std::string> keys;
    for (int64_t i = 0; i < rows.size(0); ++i)
      keys.push_back(text_key_.at(static_cast<size_t>(rows[i].item<int64_t>())));
    return read_text(keys);
  }

  // The disk cache of the SD3 VAE's latents, keyed as the LDM families' with this VAE's identity.
  void cache_images() {
    ScopedMemoryCategory category(MemoryCategory::other);
    const std::string vae =
        vae_files_ ? "file:" + weights_identity(*vae_files_, config_.vae.empty() ? kSd3VaePrefix : "", cache_stats_.dir)
                   : fmt::format("random seed {} tiny", config_.seed + 100);
    latent_key_ = latent_entry_keys(
        dataset_, fmt::format("{}|sd3-latent|vae {}|{}", kLdmCacheVersion, vae, cache_dtype_key(cache_dtype_)));
    FilledCache filled = fill_disk_cache(
        (std::filesystem::path(cache_stats_.dir) / "latents").string(), "latents", "latent", latent_key_, cache_run_,
        cache_stats_.problems, [&](const std::vector<size_t>& missing, ShardWriter& shards) {
          models::AutoencoderKL v = build_vae();
          v->to(device_);
          encode_missing_latents(dataset_, latent_key_, missing, shards, device_, cache_dtype_,
                                 [&](const at::Tensor& pixels) { return v->encode_latents(pixels, false); });
        });
    latent_cache_.emplace(std::move(filled.cache));
    cache_stats_.latent_entries = filled.entries;
    cache_stats_.latents_encoded = filled.encoded;
    cache_stats_.latents_waited = filled.waited;
  }

  void encode_images() {
    models::AutoencoderKL vae = build_vae();
    vae->to(device_);
    ScopedMemoryCategory category(MemoryCategory::other);
    // The posterior mean, as the LDM families cache it.
    latents_ = encode_bucket_latents(dataset_, has_flip_, device_, cache_dtype_, [&](const at::Tensor& pixels) {
      return vae->encode_latents(pixels, /*sample=*/false);
    });
  }

  TrainConfig config_;
  const ImageCaptionDataset& dataset_;
  c10::Device device_{c10::kCPU};
  torch::Dtype storage_ = torch::kFloat32, cache_dtype_ = torch::kFloat32;
  std::optional<WeightFiles> base_, vae_files_, clip_l_files_, clip_g_files_, t5_files_;
  models::MMDiTOptions options_;
  std::shared_ptr<torch::nn::Module> root_;
  models::MMDiT mmdit_{nullptr};
  LdmTokenizer tokenizer_;
  std::string t5_spiece_;  // T5's spiece.model (with t5xxl)
  BucketReso sample_size_;
  BucketLatents latents_;
  bool has_flip_ = false;
  // Conditioning [U + 1, tokens, context] and pooled [U + 1, adm] (the empty caption last), each image's row.
  Sd3Text text_, sample_text_;  // the captions' (the empty one last) and the sample prompts'
  at::Tensor caption_row_;
  int64_t caption_rows_ = 0;
  std::map<std::string, int64_t> sample_row_;
  // Disk caches (cache_latents_to_disk, cache_text_encoder_outputs_to_disk, `shoestring cache`).
  LdmCacheStats cache_stats_;
  DiskCacheRun cache_run_;
  std::optional<TensorCache> latent_cache_, text_cache_;
  std::vector<std::string> latent_key_, text_key_;  // per image; per caption row
};

at::Tensor Sd3TrainingModel::sample(const SampleRequest& request) {
  if (request.prompts.empty() || request.seeds.empty()) fail("sample: no prompts or no seeds");
  const EvalModeScope eval_mode(*root_);
  std::vector<at::Tensor> latents;
  for (size_t i = 0; i < request.prompts.size(); ++i) {
    const SamplePrompt p = parse_sample_prompt(request.prompts[i], fmt::format("sample prompt {}", i + 1));
    const auto cond = sample_row_.find(p.prompt), negative = sample_row_.find(p.negative);
    if (cond == sample_row_.end() || negative == sample_row_.end())
      fail("sample: prompt '{}' is not one of sample_prompts (encoded before training)", request.prompts[i]);
    const int64_t height = p.height > 0 ? p.height : sample_size_.height;
    const int64_t width = p.width > 0 ? p.width : sample_size_.width;
    check_size(height, width, "sample prompt '" + request.prompts[i] + "':");
    const FlowGuidance guidance = sd3_sample_guidance(config_.tiny, p.cfg.value_or(request.cfg));
    const Sd3Text c = sample_text_.select(torch::tensor({cond->second}, torch::kInt64));
    const Sd3Text u = sample_text_.select(torch::tensor({negative->second}, torch::kInt64));
    const int64_t w = options_.context_dim();
    for (const uint64_t seed : row_seeds(p, request)) {
      latents.push_back(sample_sd3_latent(*mmdit_, sd3_context(c.clip, c.t5, w), c.pooled, sd3_context(u.clip, u.t5, w),
                                          u.pooled, seed, height, width, p.steps > 0 ? p.steps : request.steps,
                                          guidance));
    }
  }
  const at::Device device = module_device(*root_);
  models::AutoencoderKL vae = build_vae();
  vae->to(device);
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> images;
  for (const at::Tensor& z : latents) images.push_back(vae->decode_latents(z.to(device)).to(at::kCPU, torch::kFloat32));
  return samples_to_uint8(torch::cat(images, 0), request);
}

}  // namespace

std::unique_ptr<TrainingModel> make_sd3_training_model(const TrainConfig& config, const ImageCaptionDataset& dataset,
                                                       const ModelSource& source) {
  return std::make_unique<Sd3TrainingModel>(config, dataset, source);
}

}  // namespace shoestring
