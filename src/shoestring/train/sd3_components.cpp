#include "shoestring/train/sd3_components.h"

#include <algorithm>
#include <filesystem>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/text.h"
#include "shoestring/train/config.h"
#include "shoestring/nn/fp8_storage.h"
#include "shoestring/train/sampling.h"

namespace shoestring {
namespace {

/// [N, L, W] zero-padded on the feature axis to `width` (W <= width).
at::Tensor pad_features(const at::Tensor& x, int64_t width) {
  if (x.size(2) > width) fail("internal: text features {} wide, the MMDiT's context is {}", x.size(2), width);
  return x.size(2) == width ? x : torch::constant_pad_nd(x, {0, width - x.size(2)});
}

// CLIP-L (`g` false) or bigG from its file (HF layout, as the SD3.5 release
// ships them, or OpenCLIP's), or random for tiny runs.
models::ClipTextModel build_clip(bool g, const Sd3TextSources& s) {
  const WeightFiles* files = g ? s.clip_g : s.clip_l;
  const std::string& name = g ? s.clip_g_name : s.clip_l_name;
  if (!files) {
    if (!s.tiny) fail("internal: {} has no file", name);
    models::ClipTextOptions o =
        g ? models::ClipTextOptions::clip_g().tiny(32) : models::ClipTextOptions::clip_l().tiny(32);
    return with_seed(s.seed + (g ? 102 : 101), [&] { return models::ClipTextModel(o); });
  }
  // Where the encoder is: the SD3 file prefix, a file of the encoder alone,
  // or (bigG) an SDXL single file's embedder 1; in whichever layout it is.
  std::vector<std::string> prefixes{g ? models::kSd3ClipGPrefix : models::kSd3ClipLPrefix, ""};
  if (g) prefixes.emplace_back(models::kSdxlClipGPrefix);
  std::optional<models::ClipTextFileLayout> layout;
  std::string prefix, why;
  for (const std::string& p : prefixes) {
    try {
      layout = models::detect_clip_text_layout(*files, p);
      prefix = p;
      break;
    } catch (const Error& e) {
      why += fmt::format("{}under '{}': {}", why.empty() ? "" : "; ", p, e.what());
    }
  }
  if (!layout) fail("{}: no {} text encoder found: {}", name, g ? "OpenCLIP bigG" : "CLIP-L", why);
  models::ClipTextOptions o =
      layout->options(g ? models::ClipTextOptions::clip_g() : models::ClipTextOptions::clip_l());
  nn::LayerInit init;
  init.initialize = false;
  models::ClipTextModel te(o.init(init));
  try {
    models::load_clip_text_weights(*te, *files, prefix);
  } catch (const Error& e) {
    fail("{}: expected {} in Hugging Face or OpenCLIP layout: {}", name, g ? "OpenCLIP bigG" : "CLIP ViT-L/14",
         e.what());
  }
  return te;
}

// T5-XXL (4.76B) in bf16 as kohya loads it (fp32 would be 19 GB); the tiny test one in fp32.
models::T5Encoder build_t5(const Sd3TextSources& s, const T5Tokenizer& tokenizer) {
  nn::LayerInit init{torch::TensorOptions().dtype(s.tiny ? torch::kFloat32 : torch::kBFloat16)};
  init.initialize = false;
  models::T5EncoderOptions o = s.tiny ? models::T5EncoderOptions::tiny() : models::T5EncoderOptions::xxl();
  if (s.tiny) {
    // Test widths: the vocabulary is the test tokenizer's (the file's embedding rows).
    for (const auto& n : s.t5->names())
      if (has_suffix(n, "shared.weight") || has_suffix(n, "embed_tokens.weight")) o.vocab_size(s.t5->find(n)->shape.at(0));
  }
  bool has_embedding = false;
  for (const auto& n : s.t5->names())
    has_embedding = has_embedding || has_suffix(n, "shared.weight") || has_suffix(n, "embed_tokens.weight");
  if (!has_embedding)
    fail("{}: {} holds no T5 encoder (no 'shared.weight' or 'encoder.embed_tokens.weight', bare or under '{}')",
         s.t5_name, s.t5->path(), models::kSd3T5xxlPrefix);
  models::T5Encoder t5(o.init(init));
  try {
    models::load_t5_encoder_weights(*t5, *s.t5);
  } catch (const Error& e) {
    fail("{}: expected T5 v1.1 XXL's encoder{}: {}", s.t5_name, s.tiny ? " (the tiny test width)" : "", e.what());
  }
  if (tokenizer.piece_count() > o.vocab_size())
    fail("{}: {}'s {} pieces do not fit T5's vocabulary of {}", s.t5_name, tokenizer.path(), tokenizer.piece_count(),
         o.vocab_size());
  return t5;
}

}  // namespace

Sd3Text Sd3Text::select(const at::Tensor& rows) const {
  Sd3Text out;
  out.clip = clip.index_select(0, rows);
  if (t5.defined()) out.t5 = t5.index_select(0, rows);
  out.pooled = pooled.index_select(0, rows);
  return out;
}

int64_t Sd3Text::bytes() const {
  int64_t n = 0;
  for (const at::Tensor* t : {&clip, &t5, &pooled}) n += t->defined() ? t->nbytes() : 0;
  return n;
}

Sd3TextEncoders build_sd3_text_encoders(const Sd3TextSources& sources, LdmTokenizer tokenizer) {
  Sd3TextEncoders e;
  e.tokenizer = std::move(tokenizer);
  e.clip_l = build_clip(false, sources);
  e.clip_g = build_clip(true, sources);
  for (const models::ClipTextModel* te : {&e.clip_l, &e.clip_g}) {
    if (e.tokenizer.clip && e.tokenizer.clip->vocab_size() > (*te)->options().vocab_size())
      fail("the CLIP tokenizer (vocab.json) has ids up to {}, but {}'s vocabulary has {} entries",
           e.tokenizer.clip->vocab_size() - 1, te == &e.clip_l ? sources.clip_l_name : sources.clip_g_name,
           (*te)->options().vocab_size());
  }
  if (sources.t5) {
    e.t5_tokenizer.emplace(T5Tokenizer::load(sources.t5_spiece));
    e.t5.emplace(build_t5(sources, *e.t5_tokenizer));
  }
  return e;
}

void Sd3TextEncoders::to(at::Device device) {
  for (models::ClipTextModel* te : {&clip_l, &clip_g}) {
    (*te)->eval();
    (*te)->to(device);
  }
  if (t5) {
    (*t5)->eval();
    (*t5)->to(device);
  }
}

Sd3Text Sd3TextEncoders::encode(const std::vector<std::string>& texts, at::ScalarType dtype,
                                const models::MMDiTOptions& mmdit) {
  torch::NoGradGuard no_grad;
  const at::Device device = module_device(*clip_l);
  std::vector<at::Tensor> clips, t5s, pools;
  for (size_t i = 0; i < texts.size(); i += 16) {
    const std::vector<std::string> part(texts.begin() + static_cast<std::ptrdiff_t>(i),
                                        texts.begin() + static_cast<std::ptrdiff_t>(std::min(texts.size(), i + 16)));
    // CLIP-L pads with <|endoftext|>, bigG with 0 (Stability's SDXLClipGTokenizer pad_with_end=False).
    const models::ClipTextOutput l = clip_l->forward(tokenizer.encode(part, ClipPadding::kEndOfText).to(device), 2);
    const models::ClipTextOutput g = clip_g->forward(tokenizer.encode(part, ClipPadding::kZero).to(device), 2);
    clips.push_back(torch::cat({l.hidden, g.hidden}, 2).to(at::kCPU, dtype));
    if (t5) {
      const T5Tokens tokens = t5_tokenizer->tokenize(part, t5_max_length);
      t5s.push_back((*t5)->forward(tokens.ids.to(device)).to(at::kCPU, dtype));
    }
    pools.push_back(torch::cat({l.pooled_unprojected, g.pooled}, 1).to(at::kCPU, dtype));
  }
  Sd3Text out;
  out.clip = torch::cat(clips, 0);
  if (!t5s.empty()) out.t5 = torch::cat(t5s, 0);  // every text padded to t5_max_length
  out.pooled = torch::cat(pools, 0);
  if (out.clip.size(2) > mmdit.context_dim())
    fail("internal: CLIP states {} wide, the MMDiT's context is {}", out.clip.size(2), mmdit.context_dim());
  if (out.t5.defined() && out.t5.size(2) > mmdit.context_dim())
    fail("T5's states are {} wide, the MMDiT's context is {}", out.t5.size(2), mmdit.context_dim());
  if (out.pooled.size(1) != mmdit.adm_in_channels())
    fail("internal: pooled text {} wide, the MMDiT takes {}", out.pooled.size(1), mmdit.adm_in_channels());
  return out;
}

std::string sd3_t5_spiece(const std::string& tokenizer_dir, const std::string& t5_name, const std::string& dir_name) {
  if (tokenizer_dir.empty())
    fail("{} is set but {} is not: T5's SentencePiece model is read from {}/spiece.model", t5_name, dir_name,
         dir_name);
  const std::string spiece = (std::filesystem::path(expand_path(tokenizer_dir)) / "spiece.model").string();
  if (!std::filesystem::exists(spiece))
    fail(
        "{} is set but {} does not exist: put T5's SentencePiece model (spiece.model of google/t5-v1_1-xxl) in {} "
        "beside CLIP's vocab.json and merges.txt",
        t5_name, spiece, dir_name);
  return spiece;
}

at::Tensor sd3_context(const at::Tensor& clip, const at::Tensor& t5, int64_t width) {
  const at::Tensor t5_part = t5.defined() ? pad_features(t5, width)
                                          : torch::zeros({clip.size(0), kSd3ClipTokens, width}, clip.options());
  return torch::cat({pad_features(clip, width), t5_part}, 1);
}

void check_sd3_size(const models::MMDiTOptions& mmdit, int64_t height, int64_t width, const std::string& what,
                    const std::string& architecture) {
  const int64_t multiple = 8 * mmdit.patch_size();
  if (height % multiple != 0 || width % multiple != 0) {
    fail("{} {} x {} px: {} needs multiples of {} pixels (the VAE's factor 8 x the MMDiT's patch size {})", what,
         width, height, architecture, multiple, mmdit.patch_size());
  }
  const int64_t most = multiple * mmdit.pos_embed_max_size();
  if (height > most || width > most) {
    fail("{} {} x {} px: {} takes at most {} px a side (its position embedding covers {} x {} patches)", what, width,
         height, architecture, most, mmdit.pos_embed_max_size(), mmdit.pos_embed_max_size());
  }
}

models::AutoencoderKL build_sd3_vae(bool tiny, const WeightFiles* files, bool bare_keys_allowed, uint64_t seed) {
  models::VaeOptions o = models::VaeOptions::sd3();
  if (tiny) o = o.tiny();
  return build_vae_from(o, files, bare_keys_allowed, seed);
}

FlowGuidance sd3_sample_guidance(bool tiny, double cfg) {
  FlowGuidance g = FlowGuidance::sd35_medium();
  g.cfg_scale = cfg;
  if (tiny) g.slg_layers = {1};
  return g;
}

at::Tensor sample_sd3_latent(models::MMDiTImpl& mmdit, const at::Tensor& cond_context, const at::Tensor& cond_pooled,
                             const at::Tensor& uncond_context, const at::Tensor& uncond_pooled, uint64_t seed,
                             int64_t height, int64_t width, int64_t steps, const FlowGuidance& guidance) {
  torch::NoGradGuard no_grad;
  const auto dtype = nn::value_dtype(mmdit.context_embedder->weight);
  const at::Device device = mmdit.context_embedder->weight.device();
  const at::Tensor ctx_c = cond_context.to(device, dtype), y_c = cond_pooled.to(device, dtype);
  const at::Tensor ctx = torch::cat({ctx_c, uncond_context.to(device, dtype)});
  const at::Tensor y = torch::cat({y_c, uncond_pooled.to(device, dtype)});
  return with_seed(seed, [&] {
    const at::Tensor noise = torch::randn({1, mmdit.options().in_channels(), height / 8, width / 8});
    GuidedVelocityFn model = [&](const at::Tensor& x, const at::Tensor& t, const std::vector<int64_t>& skip) {
      const at::Tensor out =
          mmdit.forward(torch::cat({x, x}).to(device, dtype), torch::cat({t, t}).to(device), ctx, y)
              .to(at::kCPU, torch::kFloat32);
      GuidedVelocities v{out.slice(0, 0, 1), out.slice(0, 1, 2), {}};
      if (!skip.empty())
        v.cond_skip = mmdit.forward(x.to(device, dtype), t.to(device), ctx_c, y_c, skip).to(at::kCPU, torch::kFloat32);
      return v;
    };
    return sample_euler_guided(model, noise, sd3_sigmas(steps, kSd3SampleShift), guidance);
  });
}

}  // namespace shoestring
