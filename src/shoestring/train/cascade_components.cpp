#include "shoestring/train/cascade_components.h"

#include <algorithm>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/nn/fp8_storage.h"
#include "shoestring/train/gdf.h"
#include "shoestring/train/sampling.h"

namespace shoestring {
namespace {

// The SDXL single-file prefix of bigG (the same laion2b weights Stable Cascade conditions on), then bare keys.
constexpr const char* kBigGPrefixes[] = {models::kSdxlClipGPrefix, ""};

// A frozen coder (EfficientNetEncoder, Previewer) from `files`, or random from seed + `seed_offset`.
template <class Coder, class Options>
Coder build_coder(Options o, const WeightFiles* files, const std::string& name, bool tiny, uint64_t seed,
                  uint64_t seed_offset, const char* released_file) {
  Coder coder{nullptr};
  if (!files) {
    coder = with_seed(seed + seed_offset, [&] { return Coder(o); });
  } else {
    nn::LayerInit init;
    init.initialize = false;
    coder = Coder(o.init(init));
    try {
      models::load_cascade_coder(*coder, *files);
    } catch (const Error& e) {
      fail("{}: expected Stable Cascade's {}{}: {}", name, released_file, tiny ? " (the tiny test width)" : "",
           e.what());
    }
  }
  coder->eval();
  return coder;
}

}  // namespace

int64_t cascade_pixel_multiple(const models::StageCOptions& o) {
  int64_t multiple = 32 * o.patch_size();
  for (const bool s : o.switch_level()) multiple *= s ? 2 : 1;
  return multiple;
}

void check_cascade_size(const models::StageCOptions& o, int64_t height, int64_t width, const std::string& what,
                        const std::string& architecture) {
  const int64_t multiple = cascade_pixel_multiple(o);
  if (height % multiple != 0 || width % multiple != 0) {
    fail(
        "{} {} x {} px: {} needs multiples of {} pixels (EfficientNet's factor 32 x stage C's downscales); "
        "Stability trains stage C at 768 px",
        what, width, height, architecture, multiple);
  }
  if (height > kCascadeMaxSide || width > kCascadeMaxSide) {
    fail("{} {} x {} px: {} takes at most {} px a side ({} x {} latents; Stability trains at 768 px, 24 x 24)", what,
         width, height, architecture, kCascadeMaxSide, kCascadeMaxSide / 32, kCascadeMaxSide / 32);
  }
}

CascadeText CascadeText::select(const at::Tensor& rows) const {
  return {text.index_select(0, rows), pooled.index_select(0, rows)};
}

int64_t CascadeText::bytes() const {
  return (text.defined() ? text.nbytes() : 0) + (pooled.defined() ? pooled.nbytes() : 0);
}

models::ClipTextModel build_cascade_text_encoder(const WeightFiles* files, const std::string& name, bool tiny,
                                                 int64_t tiny_width, uint64_t seed) {
  models::ClipTextOptions o =
      tiny ? models::ClipTextOptions::clip_g().tiny(tiny_width) : models::ClipTextOptions::clip_g();
  if (!files) {
    if (!tiny) fail("internal: {} has no file", name);
    return with_seed(seed + 101, [&] { return models::ClipTextModel(o); });
  }
  const char* prefix = nullptr;
  for (const char* p : kBigGPrefixes) {
    if (files->find(std::string(p) + "token_embedding.weight")) {
      prefix = p;
      break;
    }
  }
  if (!prefix) {
    fail(
        "{} {}: holds no OpenCLIP text tower (no '{}token_embedding.weight' or 'token_embedding.weight'); give an "
        "SDXL single file or open_clip's ViT-bigG-14 text weights",
        name, files->path(), models::kSdxlClipGPrefix);
  }
  nn::LayerInit init;
  init.initialize = false;
  models::ClipTextModel te(o.init(init));
  try {
    models::load_clip_text_weights(*te, *files, prefix);
  } catch (const Error& e) {
    fail("{}: expected OpenCLIP bigG's text tower{}: {}", name, tiny ? " (the tiny test width)" : "", e.what());
  }
  return te;
}

CascadeText encode_cascade_text(models::ClipTextModel& te, const LdmTokenizer& tokenizer,
                                const std::vector<std::string>& texts, at::ScalarType dtype) {
  if (tokenizer.clip && tokenizer.clip->vocab_size() > te->options().vocab_size()) {
    fail("the CLIP tokenizer (vocab.json) has ids up to {}, but bigG's vocabulary has {} entries",
         tokenizer.clip->vocab_size() - 1, te->options().vocab_size());
  }
  torch::NoGradGuard no_grad;
  const at::Device device = module_device(*te);
  std::vector<at::Tensor> states, pools;
  for (size_t i = 0; i < texts.size(); i += 16) {
    const std::vector<std::string> part(texts.begin() + static_cast<std::ptrdiff_t>(i),
                                        texts.begin() + static_cast<std::ptrdiff_t>(std::min(texts.size(), i + 16)));
    const at::Tensor ids = tokenizer.encode(part, ClipPadding::kEndOfText);
    at::Tensor mask;
    if (tokenizer.clip) {
      mask = models::clip_attention_mask(ids);
    } else {
      mask = ids.ne(WordTokenizer::kPad).to(torch::kLong);
      mask.select(1, 0).fill_(1);
    }
    const models::ClipTextOutput out = te->forward(ids.to(device), /*skip=*/1, mask.to(device));
    states.push_back(out.hidden.to(at::kCPU, dtype));
    pools.push_back(out.pooled.unsqueeze(1).to(at::kCPU, dtype));
  }
  return {torch::cat(states, 0), torch::cat(pools, 0)};
}

models::Previewer build_cascade_previewer(const WeightFiles* files, const std::string& name, bool tiny,
                                          uint64_t seed) {
  return build_coder<models::Previewer>(models::PreviewerOptions().hidden_channels(tiny ? 32 : 512), files, name,
                                        tiny, seed, 102, "previewer.safetensors");
}

models::EfficientNetEncoder build_cascade_effnet(const WeightFiles* files, const std::string& name, bool tiny,
                                                 uint64_t seed) {
  return build_coder<models::EfficientNetEncoder>(
      tiny ? models::EfficientNetEncoderOptions::micro() : models::EfficientNetEncoderOptions(), files, name, tiny,
      seed, 100, "effnet_encoder.safetensors");
}

at::Tensor sample_stage_c_latent(models::StageCImpl& stage_c, const CascadeText& cond, const CascadeText& uncond,
                                 uint64_t seed, int64_t height, int64_t width, int64_t steps, double cfg) {
  torch::NoGradGuard no_grad;
  const auto dtype = nn::value_dtype(stage_c.clip_txt_mapper->weight);
  const at::Device device = stage_c.clip_txt_mapper->weight.device();
  const models::StageCOptions& o = stage_c.options();
  const at::Tensor text_c = cond.text.slice(0, 0, 1).to(device, dtype);
  const at::Tensor pooled_c = cond.pooled.slice(0, 0, 1).to(device, dtype);
  const at::Tensor text = torch::cat({text_c, uncond.text.slice(0, 0, 1).to(device, dtype)});
  const at::Tensor pooled = torch::cat({pooled_c, uncond.pooled.slice(0, 0, 1).to(device, dtype)});
  const at::Tensor img = torch::zeros({2, 1, o.clip_image_dim()}, torch::TensorOptions(dtype).device(device));
  const GdfCosineSchedule schedule;
  // The seed's noise and the sampler's per-step noise from the global
  // generator seeded by it, restored after.
  return with_seed(seed, [&] {
    const at::Tensor noise = torch::randn({1, o.in_channels(), height / 32, width / 32});
    GdfPredictFn predict = [&](const at::Tensor& x, const at::Tensor& r) {
      if (cfg == 1.0) {
        return stage_c.forward(x.to(device, dtype), r.to(device), text_c, pooled_c, img.slice(0, 0, 1))
            .to(at::kCPU, torch::kFloat32);
      }
      const at::Tensor out =
          stage_c.forward(torch::cat({x, x}).to(device, dtype), torch::cat({r, r}).to(device), text, pooled, img)
              .to(at::kCPU, torch::kFloat32);
      return gdf_guidance(out.slice(0, 0, 1), out.slice(0, 1, 2), cfg, kCascadeGuidanceRho);
    };
    return gdf_sample(predict, noise, schedule, steps, kCascadeSampleShift);
  });
}

at::Tensor preview_images(models::PreviewerImpl& previewer, const at::Tensor& latents) {
  torch::NoGradGuard no_grad;
  const at::Device device = module_device(previewer);
  return previewer.forward(latents.to(device)).to(at::kCPU, torch::kFloat32).clamp(0, 1) * 2 - 1;
}

}  // namespace shoestring
