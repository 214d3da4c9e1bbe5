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

#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/core/units.h"
#include "shoestring/data/dataset.h"
#include "shoestring/io/weight_files.h"
#include "shoestring/models/architecture.h"
#include "shoestring/models/cascade.h"
#include "shoestring/models/cascade_coders.h"
#include "shoestring/models/clip_text.h"
#include "shoestring/train/checkpoint_io.h"
#include "shoestring/train/config.h"
#include "shoestring/train/diffusion_loss.h"
#include "shoestring/train/gdf.h"
#include "shoestring/train/ldm_components.h"
#include "shoestring/train/sampling.h"
#include "shoestring/train/training_model_impl.h"

namespace shoestring {
namespace {

// kohya's stage C sampling (stable_cascade_utils sample_image_inference) and ComfyUI's default shift.
constexpr double kSampleShift = 2.0;
// GDF.sample's default cfg_rho.
constexpr double kGuidanceRho = 0.7;
// The SDXL single-file prefix of bigG (the same laion2b weights Stable Cascade conditions on).
constexpr const char* kBigGPrefixes[] = {models::kSdxlClipGPrefix, ""};

class CascadeTrainingModel final : public TrainingModel {
 public:
  CascadeTrainingModel(const TrainConfig& config, const ImageCaptionDataset& dataset, const ModelSource& source)
      : config_(config), dataset_(dataset), device_(source.device) {
    const std::string& arch = config.architecture;
    storage_ = config.full_bf16 ? torch::kBFloat16 : config.full_fp16 ? torch::kHalf : torch::kFloat32;
    cache_dtype_ = storage_ == torch::kHalf ? torch::kFloat32 : storage_;
    if (config.cache_latents_to_disk || config.cache_text_encoder_outputs_to_disk || source.encode_only) {
      fail(
          "{}: model.architecture = \"{}\" keeps its latents and text embeddings in memory; disk caches are not "
          "implemented for Stable Cascade yet: remove it",
          config.cache_latents_to_disk                ? "cache_latents_to_disk"
          : config.cache_text_encoder_outputs_to_disk ? "cache_text_encoder_outputs_to_disk"
                                                      : "shoestring cache",
          arch);
    }
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
    encode_captions();
    encode_images();
    if (!source.quiet) {
      int64_t bytes = clip_text_.nbytes() + clip_pooled_.nbytes() +
                      (sample_text_.defined() ? sample_text_.nbytes() : 0) +
                      (sample_pooled_.defined() ? sample_pooled_.nbytes() : 0);
      bytes += latents_.bytes();
      spdlog::info(
          "cached EfficientNet latents {} and bigG text embeddings {} for {} captions + the empty one (caption "
          "dropout){} ({}); encoders freed",
          latents_.describe(),
          format_shape(clip_text_.sizes().slice(1)), clip_text_.size(0) - 1,
          sample_row_.empty() ? "" : fmt::format(" and {} sample texts", sample_row_.size()), format_bytes(bytes));
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
    const auto [latents, mirror] = latents_.batch(dataset_, idx);
    // flip_aug, caption dropout (the empty caption's row, the last, as Stability
    // replaces the caption by "" in train_c.py) and the noise.
    const LatentBatchDraws draws = draw_latent_batch(dataset_, config_, idx, latents, mirror,
                                                     caption_row_.index_select(0, torch::tensor(idx, torch::kInt64)),
                                                     caption_rows_ - 1);
    const at::Tensor x0 = draws.x0, rows = draws.caption_rows, eps = draws.noise;
    const at::Tensor t = gdf_sample_times(b);
    const at::Tensor log_snr = schedule_.log_snr(t);
    TrainBatch batch;
    const at::Tensor clip_img = torch::zeros({b, 1, options_.clip_image_dim()}, cache_dtype_);
    batch.inputs = {gdf_diffuse(x0, eps, log_snr), schedule_.noise_cond(log_snr), clip_text_.index_select(0, rows),
                    clip_pooled_.index_select(0, rows), clip_img};
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
        {"dtype", config_.full_bf16   ? "bf16"
                  : config_.full_fp16 ? "fp16"
                                      : "fp32"},
        {"title", fmt::format("{} step {}", std::filesystem::path(config_.output_dir).filename().string(), step)}};
    if (tokenizer_.words) meta["tokenizer"] = tokenizer_.words->to_json().dump();
    return meta;
  }

  void save_final(const std::string& path, int64_t step, bool storage_dtype) override {
    TrainConfig c = config_;
    if (storage_dtype) c.save_precision = "auto";
    save_module_tensors(path, module_tensors(*stage_c_), metadata(step), c);
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

  // Latent sides must survive the effnet's /32 and stage C's downscales.
  void check_size(int64_t height, int64_t width, const std::string& what) const {
    const int64_t multiple = cascade_pixel_multiple(options_);
    if (height % multiple != 0 || width % multiple != 0) {
      fail(
          "{} {} x {} px: {} needs multiples of {} pixels (EfficientNet's factor 32 x stage C's downscales); "
          "Stability trains stage C at 768 px",
          what, width, height, config_.architecture, multiple);
    }
  }

  models::ClipTextModel build_text_encoder() const {
    models::ClipTextOptions o = config_.tiny ? models::ClipTextOptions::clip_g().tiny(options_.clip_text_dim())
                                             : models::ClipTextOptions::clip_g();
    if (config_.text_model_checkpoint_path.empty()) {
      return with_seed(static_cast<uint64_t>(config_.seed) + 101, [&] { return models::ClipTextModel(o); });
    }
    const std::string path = expand_path(config_.text_model_checkpoint_path);
    const WeightFiles files = open_file("text_model_checkpoint_path", config_.text_model_checkpoint_path);
    std::string prefix;
    bool found = false;
    for (const char* p : kBigGPrefixes) {
      if (files.find(std::string(p) + "token_embedding.weight")) {
        prefix = p;
        found = true;
        break;
      }
    }
    if (!found) {
      fail(
          "text_model_checkpoint_path {}: holds no OpenCLIP text tower (no '{}token_embedding.weight' or "
          "'token_embedding.weight'); give an SDXL single file or open_clip's ViT-bigG-14 text weights",
          path, models::kSdxlClipGPrefix);
    }
    nn::LayerInit init;
    init.initialize = false;
    models::ClipTextModel te(o.init(init));
    models::load_clip_text_weights(*te, files, prefix);
    return te;
  }

  // Token ids [N, 77] and their attention mask (1 through EOS; the word
  // tokenizer of tiny runs: 1 for <bos> and words, 0 for <pad>).
  std::pair<at::Tensor, at::Tensor> tokens(const std::vector<std::string>& captions) const {
    at::Tensor ids = tokenizer_.encode(captions, ClipPadding::kEndOfText);
    at::Tensor mask;
    if (tokenizer_.clip) {
      mask = models::clip_attention_mask(ids);
    } else {
      mask = ids.ne(WordTokenizer::kPad).to(torch::kLong);
      mask.select(1, 0).fill_(1);
    }
    return {ids, mask};
  }

  // Last-layer states [N, 77, W] and pooled [N, 1, P] of `captions` (cache dtype, host memory).
  std::pair<at::Tensor, at::Tensor> encode_text(models::ClipTextModel& te, const std::vector<std::string>& captions) {
    torch::NoGradGuard no_grad;
    auto [ids, mask] = tokens(captions);
    const models::ClipTextOutput out = te->forward(ids.to(device_), /*skip=*/1, mask.to(device_));
    return {out.hidden.to(at::kCPU, cache_dtype_), out.pooled.unsqueeze(1).to(at::kCPU, cache_dtype_)};
  }

  void encode_captions() {
    ScopedMemoryCategory category(MemoryCategory::other);
    models::ClipTextModel te = build_text_encoder();
    te->eval();
    te->to(device_);
    if (tokenizer_.clip && tokenizer_.clip->vocab_size() > te->options().vocab_size()) {
      fail("the CLIP tokenizer (vocab.json) has ids up to {}, but bigG's vocabulary has {} entries",
           tokenizer_.clip->vocab_size() - 1, te->options().vocab_size());
    }
    const CaptionRows captions = caption_rows(dataset_.captions());
    const std::vector<std::string>& unique = captions.texts;
    caption_row_ = torch::tensor(captions.rows, torch::kInt64);
    caption_rows_ = static_cast<int64_t>(unique.size());
    std::vector<at::Tensor> texts, pools;
    for (size_t i = 0; i < unique.size(); i += 16) {
      std::vector<std::string> part(unique.begin() + static_cast<std::ptrdiff_t>(i),
                                    unique.begin() + static_cast<std::ptrdiff_t>(std::min(unique.size(), i + 16)));
      auto [t, p] = encode_text(te, part);
      texts.push_back(t);
      pools.push_back(p);
    }
    clip_text_ = torch::cat(texts, 0);
    clip_pooled_ = torch::cat(pools, 0);
    const std::vector<std::string> sample_texts = sample_prompt_texts(config_.sample_prompts, sample_row_);
    if (!sample_texts.empty()) std::tie(sample_text_, sample_pooled_) = encode_text(te, sample_texts);
  }

  // A frozen coder (EfficientNetEncoder, Previewer) from the file config key
  // `key` names, or random from seed + `seed_offset` when it is "" (tiny).
  template <class Coder, class Options>
  Coder build_coder(Options o, const char* key, const std::string& path, uint64_t seed_offset,
                    const char* released_file) const {
    if (path.empty()) return with_seed(static_cast<uint64_t>(config_.seed) + seed_offset, [&] { return Coder(o); });
    nn::LayerInit init;
    init.initialize = false;
    Coder coder(o.init(init));
    const WeightFiles files = open_file(key, path);
    try {
      models::load_cascade_coder(*coder, files);
    } catch (const Error& e) {
      fail("{}: expected Stable Cascade's {}{}: {}", key, released_file, config_.tiny ? " (the tiny test width)" : "",
           e.what());
    }
    return coder;
  }

  models::EfficientNetEncoder build_effnet() const {
    return build_coder<models::EfficientNetEncoder>(
        config_.tiny ? models::EfficientNetEncoderOptions::micro() : models::EfficientNetEncoderOptions(),
        "effnet_checkpoint_path", config_.effnet_checkpoint_path, 100, "effnet_encoder.safetensors");
  }

  models::Previewer build_previewer() const {
    return build_coder<models::Previewer>(models::PreviewerOptions().hidden_channels(config_.tiny ? 32 : 512),
                                          "previewer_checkpoint_path", config_.previewer_checkpoint_path, 102,
                                          "previewer.safetensors");
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
  at::Tensor clip_text_, clip_pooled_, caption_row_;
  int64_t caption_rows_ = 0;
  at::Tensor sample_text_, sample_pooled_;
  std::map<std::string, int64_t> sample_row_;
};

at::Tensor CascadeTrainingModel::sample(const SampleRequest& request) {
  if (request.prompts.empty() || request.seeds.empty()) fail("sample: no prompts or no seeds");
  const EvalModeScope eval_mode(*stage_c_);
  torch::NoGradGuard no_grad;
  const auto dtype = nn::value_dtype(stage_c_->clip_txt_mapper->weight);
  const at::Device device = stage_c_->clip_txt_mapper->weight.device();
  std::vector<at::Tensor> latents;
  for (size_t i = 0; i < request.prompts.size(); ++i) {
    const SamplePrompt p = parse_sample_prompt(request.prompts[i], fmt::format("sample prompt {}", i + 1));
    const auto cond = sample_row_.find(p.prompt), negative = sample_row_.find(p.negative);
    if (cond == sample_row_.end() || negative == sample_row_.end())
      fail("sample: prompt '{}' is not one of sample_prompts (encoded before training)", request.prompts[i]);
    const int64_t height = p.height > 0 ? p.height : sample_size_.height;
    const int64_t width = p.width > 0 ? p.width : sample_size_.width;
    check_size(height, width, "sample prompt '" + request.prompts[i] + "':");
    const double cfg = p.cfg.value_or(request.cfg);
    const int64_t steps = p.steps > 0 ? p.steps : request.steps;
    auto rows_of = [&](int64_t row) {
      return std::make_pair(sample_text_.slice(0, row, row + 1).to(device, dtype),
                            sample_pooled_.slice(0, row, row + 1).to(device, dtype));
    };
    const auto [text_c, pooled_c] = rows_of(cond->second);
    const auto [text_u, pooled_u] = rows_of(negative->second);
    for (const uint64_t seed : row_seeds(p, request)) {
      // The seed's noise and the sampler's per-step noise from the global
      // generator seeded by it, restored after (training's stream is untouched).
      latents.push_back(with_seed(seed, [&] {
        const at::Tensor noise = torch::randn({1, options_.in_channels(), height / 32, width / 32});
        const at::Tensor img =
            torch::zeros({2, 1, options_.clip_image_dim()}, torch::TensorOptions(dtype).device(device));
        GdfPredictFn predict = [&](const at::Tensor& x, const at::Tensor& r) {
          if (cfg == 1.0) {
            return stage_c_->forward(x.to(device, dtype), r.to(device), text_c, pooled_c, img.slice(0, 0, 1))
                .to(at::kCPU, torch::kFloat32);
          }
          const at::Tensor out = stage_c_
                                     ->forward(torch::cat({x, x}).to(device, dtype), torch::cat({r, r}).to(device),
                                               torch::cat({text_c, text_u}), torch::cat({pooled_c, pooled_u}), img)
                                     .to(at::kCPU, torch::kFloat32);
          return gdf_guidance(out.slice(0, 0, 1), out.slice(0, 1, 2), cfg, kGuidanceRho);
        };
        return gdf_sample(predict, noise, schedule_, steps, kSampleShift);
      }));
    }
  }
  models::Previewer previewer = build_previewer();
  previewer->eval();
  previewer->to(device);
  std::vector<at::Tensor> images;
  for (const at::Tensor& z : latents) {
    // The previewer's RGB is about [0, 1]; samples are [-1, 1].
    images.push_back(previewer->forward(z.to(device)).to(at::kCPU, torch::kFloat32).clamp(0, 1) * 2 - 1);
  }
  return samples_to_uint8(torch::cat(images, 0), request);
}

}  // namespace

int64_t cascade_pixel_multiple(const models::StageCOptions& o) {
  int64_t multiple = 32 * o.patch_size();
  for (const bool s : o.switch_level()) multiple *= s ? 2 : 1;
  return multiple;
}

std::unique_ptr<TrainingModel> make_cascade_training_model(const TrainConfig& config,
                                                           const ImageCaptionDataset& dataset,
                                                           const ModelSource& source) {
  return std::make_unique<CascadeTrainingModel>(config, dataset, source);
}

}  // namespace shoestring
