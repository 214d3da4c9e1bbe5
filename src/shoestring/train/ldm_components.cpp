#include "shoestring/train/ldm_components.h"

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/text.h"
#include "shoestring/core/units.h"
#include "shoestring/data/dataset.h"
#include "shoestring/nn/timestep.h"
#include "shoestring/train/checkpoint_io.h"
#include "shoestring/train/config.h"
#include "shoestring/train/diffusion_loss.h"
#include "shoestring/train/sampling.h"

namespace shoestring {

namespace {

constexpr const char* kVaePrefix = "first_stage_model.";
constexpr int64_t kTextLength = 77;


}  // namespace

at::Tensor LdmTokenizer::encode(const std::vector<std::string>& captions, ClipPadding pad) const {
  if (clip) return clip->encode_batch(captions, kTextLength, pad);
  if (words) return words->encode_batch(captions);
  fail("internal: LDM text encoding without a tokenizer");
}

LdmTokenizer sampling_tokenizer(const WeightFiles& file, const std::string& tokenizer_dir, const TrainConfig* run,
                                const std::string& model) {
  LdmTokenizer tokenizer;
  const std::string dir = !tokenizer_dir.empty()             ? tokenizer_dir
                          : run && !run->tokenizer_dir.empty() ? expand_path(run->tokenizer_dir)
                                                               : "";
  const auto& meta = file.metadata();
  if (!dir.empty()) {
    try {
      tokenizer.clip.emplace(ClipTokenizer::load(dir));
    } catch (const Error& e) {
      fail("{} '{}': {}", !tokenizer_dir.empty() ? "--tokenizer-dir" : "the run's tokenizer_dir", dir, e.what());
    }
  } else if (auto it = meta.find("tokenizer"); it != meta.end()) {
    try {
      tokenizer.words.emplace(WordTokenizer::from_json(nlohmann::json::parse(it->second)));
    } catch (const nlohmann::json::exception& e) {
      fail("{}: metadata 'tokenizer' is not valid JSON: {}", file.path(), e.what());
    }
  } else {
    fail(
        "{}: no tokenizer: {} conditions on CLIP, whose tokenizer files (vocab.json and merges.txt) are not stored "
        "in checkpoints; pass --tokenizer-dir DIR (e.g. ComfyUI's comfy/sd1_tokenizer, or a diffusers model's "
        "tokenizer/ folder)",
        file.path(), model);
  }
  return tokenizer;
}

LdmTokenizer build_text_tokenizer(const std::string& tokenizer_dir, bool tiny, const std::vector<std::string>& captions,
                                  const std::vector<std::string>& sample_prompts, const std::string& model) {
  LdmTokenizer tokenizer;
  if (!tokenizer_dir.empty()) {
    tokenizer.clip.emplace(ClipTokenizer::load(expand_path(tokenizer_dir)));
  } else if (tiny) {
    std::vector<std::string> texts = captions;
    for (size_t i = 0; i < sample_prompts.size(); ++i) {
      const SamplePrompt p = parse_sample_prompt(sample_prompts[i], fmt::format("sample_prompts[{}]", i));
      texts.push_back(p.prompt);
      texts.push_back(p.negative);
    }
    tokenizer.words.emplace(WordTokenizer::build(texts, kTextLength));
  } else {
    fail(
        "tokenizer_dir is not set: {} conditions on CLIP, whose tokenizer files (vocab.json and merges.txt) are "
        "not stored in checkpoints; point tokenizer_dir at a folder holding them (e.g. ComfyUI's "
        "comfy/sd1_tokenizer, or a diffusers model's tokenizer/ folder)",
        model);
  }
  return tokenizer;
}

CaptionRows caption_rows(const std::vector<std::string>& captions) {
  CaptionRows out;
  std::map<std::string, int64_t> row;
  for (const auto& c : captions) {
    auto [it, inserted] = row.emplace(c, static_cast<int64_t>(out.texts.size()));
    if (inserted) out.texts.push_back(c);
    out.rows.push_back(it->second);
  }
  out.texts.push_back("");  // caption dropout
  return out;
}

std::vector<std::string> sample_prompt_texts(const std::vector<std::string>& sample_prompts,
                                             std::map<std::string, int64_t>& row_of) {
  std::vector<std::string> texts;
  row_of.clear();
  for (size_t i = 0; i < sample_prompts.size(); ++i) {
    const SamplePrompt p = parse_sample_prompt(sample_prompts[i], fmt::format("sample_prompts[{}]", i));
    for (const std::string& t : {p.prompt, p.negative}) {
      if (row_of.emplace(t, static_cast<int64_t>(texts.size())).second) texts.push_back(t);
    }
  }
  return texts;
}

std::vector<models::ClipTextModel> build_ldm_text_encoders(const models::LdmUNetOptions& unet, bool tiny,
                                                           const WeightFiles* files, uint64_t seed, int64_t clip_skip,
                                                           const LdmTokenizer& tokenizer,
                                                           const std::string& architecture) {
  const int64_t context_dim = unet.context_dim();
  const int64_t adm = unet.adm_in_channels();
  const bool sdxl = adm > 0;
  std::vector<models::ClipTextOptions> opts;
  std::vector<std::string> prefixes;
  if (!sdxl) {
    opts.push_back(tiny ? models::ClipTextOptions::clip_l().tiny(context_dim) : models::ClipTextOptions::clip_l());
    prefixes.push_back(models::kSd15ClipPrefix);
  } else {
    // CLIP-L (768) + OpenCLIP bigG (1280) = context 2048; tiny: 48 + 16 = 64.
    const int64_t g = tiny ? 16 : 1280;
    opts.push_back(tiny ? models::ClipTextOptions::clip_l().tiny(context_dim - g) : models::ClipTextOptions::clip_l());
    opts.push_back(tiny ? models::ClipTextOptions::clip_g().tiny(g) : models::ClipTextOptions::clip_g());
    prefixes.push_back(models::kSdxlClipLPrefix);
    prefixes.push_back(models::kSdxlClipGPrefix);
    if ((adm - g) % 6 != 0 || adm <= g) fail("internal: adm_in_channels {} does not fit pooled {} + 6 sizes", adm, g);
  }
  bool from_file = false;
  if (files) {
    for (const auto& n : files->names()) from_file = from_file || has_prefix(n, prefixes[0]);
    if (!from_file) {
      fail("{}: holds no text encoder (no '{}*' keys); {} needs the checkpoint's CLIP text encoder{}", files->path(),
           prefixes[0], architecture, sdxl ? "s" : "");
    }
  } else if (!tiny) {
    fail("internal: {} text encoders without a checkpoint", architecture);
  }
  if (clip_skip > opts[0].layers()) {
    fail("clip_skip = {}: the text encoder has {} layers (clip_skip counts layers from the last, 1 = the last)",
         clip_skip, opts[0].layers());
  }
  if (sdxl && clip_skip != 1) {
    spdlog::warn("clip_skip = {} is ignored for {}: SDXL conditions on both encoders' penultimate layers", clip_skip,
                 architecture);
  }
  if (tokenizer.clip && tokenizer.clip->vocab_size() > opts[0].vocab_size()) {
    fail("the CLIP tokenizer (vocab.json) has ids up to {}, but the text encoder's vocabulary has {} entries",
         tokenizer.clip->vocab_size() - 1, opts[0].vocab_size());
  }
  std::vector<models::ClipTextModel> out;
  for (size_t i = 0; i < opts.size(); ++i) {
    models::ClipTextModel te = with_seed(seed + 101 + i, [&] {
      nn::LayerInit init;
      init.initialize = !from_file;
      return models::ClipTextModel(opts[i].init(init));
    });
    if (from_file) models::load_clip_text_weights(*te, *files, prefixes[i]);
    te->eval();
    out.push_back(te);
  }
  return out;
}

std::pair<at::Tensor, at::Tensor> encode_ldm_text(std::vector<models::ClipTextModel>& encoders,
                                                  const LdmTokenizer& tokenizer,
                                                  const std::vector<std::string>& captions, int64_t clip_skip,
                                                  at::Device device, at::ScalarType dtype) {
  torch::NoGradGuard no_grad;
  if (encoders.size() == 1) {
    at::Tensor ids = tokenizer.encode(captions, ClipPadding::kEndOfText).to(device);
    auto out = encoders[0]->forward(ids, clip_skip);
    return {out.hidden_normed.to(at::kCPU, dtype), at::Tensor()};
  }
  if (encoders.size() != 2) fail("internal: {} LDM text encoders", encoders.size());
  auto l = encoders[0]->forward(tokenizer.encode(captions, ClipPadding::kEndOfText).to(device), 2);
  auto g = encoders[1]->forward(tokenizer.encode(captions, ClipPadding::kZero).to(device), 2);
  at::Tensor context = torch::cat(std::vector<at::Tensor>{l.hidden, g.hidden}, -1);
  return {context.to(at::kCPU, dtype), g.pooled.to(at::kCPU, torch::kFloat32)};
}

at::Tensor sdxl_vector_y(const at::Tensor& pooled, const std::vector<double>& sizes, int64_t adm_in_channels,
                         at::ScalarType dtype) {
  const int64_t per = (adm_in_channels - pooled.size(1)) / 6;
  const int64_t b = pooled.size(0);
  if (static_cast<int64_t>(sizes.size()) != 6 * b) fail("internal: {} size values for {} rows", sizes.size(), b);
  at::Tensor values = torch::tensor(sizes, torch::kFloat64);
  at::Tensor size_emb = nn::timestep_embedding(values, per).view({b, 6 * per});
  return torch::cat(std::vector<at::Tensor>{pooled.to(torch::kFloat32), size_emb}, 1).to(dtype);
}

models::AutoencoderKL build_ldm_vae(bool sdxl, bool tiny, const WeightFiles* files, bool bare_keys_allowed,
                                    uint64_t seed) {
  models::VaeOptions o;
  o.scaling_factor(sdxl ? 0.13025 : 0.18215);
  if (tiny) o = o.tiny();
  return build_vae_from(o, files, bare_keys_allowed, seed);
}

models::AutoencoderKL build_vae_from(const models::VaeOptions& o, const WeightFiles* files, bool bare_keys_allowed,
                                     uint64_t seed) {
  const bool tiny = o.ch() < models::VaeOptions().ch();
  bool has = false;
  if (files) {
    for (const auto& n : files->names()) {
      if (has_prefix(n, kVaePrefix)) has = true;
    }
    if (bare_keys_allowed) has = true;
    if (!has) fail("{}: holds no VAE (no '{}*' keys)", files->path(), kVaePrefix);
  } else if (!tiny) {
    fail("internal: a VAE without a checkpoint");
  }
  models::AutoencoderKL vae = with_seed(seed + 100, [&] {
    nn::LayerInit init;
    init.initialize = !has;
    models::VaeOptions built = o;
    return models::AutoencoderKL(built.init(init));
  });
  if (has) models::load_vae(*vae, *files);  // first_stage_model.* when present, else bare keys
  vae->eval();
  return vae;
}

LatentBatchDraws draw_latent_batch(const ImageCaptionDataset& dataset, const TrainConfig& config,
                                   const std::vector<int64_t>& idx, at::Tensor x0, const at::Tensor& mirror,
                                   const at::Tensor& rows, int64_t empty_row) {
  const auto b = static_cast<int64_t>(idx.size());
  LatentBatchDraws d;
  d.flipped.assign(static_cast<size_t>(b), false);
  if (mirror.defined()) {
    const at::Tensor draw = torch::rand({b});
    for (int64_t i = 0; i < b; ++i) {
      d.flipped[static_cast<size_t>(i)] = dataset.flip_aug(idx[static_cast<size_t>(i)]) && draw[i].item<double>() < 0.5;
      if (d.flipped[static_cast<size_t>(i)]) x0[i] = mirror[i];
    }
  }
  d.caption_rows = rows.clone();
  const at::Tensor drop = torch::rand({b});
  for (int64_t i = 0; i < b; ++i) {
    const int64_t image = idx[static_cast<size_t>(i)];
    const double rate = dataset.bucketed() ? dataset.caption_dropout_rate(image) : config.caption_dropout_rate;
    if (drop[i].item<double>() < rate) d.caption_rows[i] = empty_row;
  }
  at::Tensor eps = torch::randn_like(x0);
  if (config.noise_offset > 0) eps = apply_noise_offset(eps, x0, config.noise_offset, config.adaptive_noise_scale);
  if (config.multires_noise_iterations > 0)
    eps = pyramid_noise(eps, config.multires_noise_iterations, config.multires_noise_discount);
  d.x0 = x0;
  d.noise = eps;
  return d;
}

std::pair<at::Tensor, at::Tensor> BucketLatents::batch(const ImageCaptionDataset& dataset,
                                                       const std::vector<int64_t>& idx) const {
  const int64_t bucket = dataset.bucketed() ? dataset.bucket_of(idx.front()) : 0;
  std::vector<int64_t> rows;
  for (const int64_t i : idx) {
    if (dataset.bucketed() && dataset.bucket_of(i) != bucket)
      fail("internal: images {} and {} of one batch are in different buckets", idx.front(), i);
    rows.push_back(row[static_cast<size_t>(i)]);
  }
  const at::Tensor r = torch::tensor(rows, torch::kInt64);
  const auto b = static_cast<size_t>(bucket);
  return {latents[b].index_select(0, r).to(torch::kFloat32),
          flipped.empty() ? at::Tensor() : flipped[b].index_select(0, r).to(torch::kFloat32)};
}

int64_t BucketLatents::bytes() const {
  int64_t n = 0;
  for (const auto* group : {&latents, &flipped})
    for (const at::Tensor& t : *group) n += t.nbytes();
  return n;
}

std::string BucketLatents::describe() const {
  std::vector<std::string> shapes;
  for (const at::Tensor& t : latents)
    shapes.push_back(fmt::format("{} x {}", t.size(0), format_shape(t.sizes().slice(1))));
  return fmt::format("{}{}", fmt::join(shapes, ", "), flipped.empty() ? "" : " (and their mirror images, flip_aug)");
}

std::vector<std::vector<int64_t>> latent_groups(const ImageCaptionDataset& dataset) {
  std::vector<std::vector<int64_t>> groups;
  if (dataset.bucketed()) {
    for (const DatasetBucket& b : dataset.buckets()) groups.push_back(b.images);
  } else {
    groups.emplace_back();
    for (int64_t i = 0; i < dataset.size(); ++i) groups.back().push_back(i);
  }
  return groups;
}

int64_t latent_chunk_size(const ImageCaptionDataset& dataset, const std::vector<int64_t>& group) {
  const BucketReso size = dataset.bucketed() && !group.empty()
                              ? dataset.buckets()[static_cast<size_t>(dataset.bucket_of(group.front()))].reso
                              : BucketReso{dataset.resolution(), dataset.resolution()};
  return std::max<int64_t>(1, (256 * 256 * 4) / (size.width * size.height));
}

BucketLatents encode_bucket_latents(const ImageCaptionDataset& dataset, bool flip, at::Device device,
                                    at::ScalarType cache_dtype,
                                    const std::function<at::Tensor(const at::Tensor&)>& encode) {
  torch::NoGradGuard no_grad;
  const std::vector<std::vector<int64_t>> groups = latent_groups(dataset);
  BucketLatents out;
  out.row.assign(static_cast<size_t>(dataset.size()), 0);
  for (const std::vector<int64_t>& images : groups) {
    const auto n = static_cast<int64_t>(images.size());
    for (int64_t k = 0; k < n; ++k) out.row[static_cast<size_t>(images[static_cast<size_t>(k)])] = k;
    const int64_t chunk = latent_chunk_size(dataset, images);
    std::vector<at::Tensor> parts, mirrored;
    for (int64_t i = 0; i < n; i += chunk) {
      const std::vector<int64_t> idx(images.begin() + i, images.begin() + std::min(n, i + chunk));
      const at::Tensor pixels = dataset.batch_images(idx).to(device);
      parts.push_back(encode(pixels).to(at::kCPU, cache_dtype));
      if (flip) mirrored.push_back(encode(pixels.flip({3})).to(at::kCPU, cache_dtype));
    }
    out.latents.push_back(torch::cat(parts, 0));
    if (flip) out.flipped.push_back(torch::cat(mirrored, 0));
  }
  return out;
}

}  // namespace shoestring
