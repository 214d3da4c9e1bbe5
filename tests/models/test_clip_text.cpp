// CLIP text encoders (models/clip_text.h): released key names and parameter
// counts, numerical agreement with an independent PyTorch implementation of
// both layouts (scripts/gen_clip_reference.py), loading from a prefixed
// single file, registry and detection.
#include <algorithm>
#include <cmath>
#include <functional>
#include <iostream>
#include <set>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../io/temp_dir.h"
#include "model_testing.h"
#include "shoestring/core/error.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/io/weight_files.h"
#include "shoestring/models/architecture.h"
#include "shoestring/models/clip_text.h"
#include "shoestring/nn/block_precision.h"
#include "shoestring/nn/layers.h"

using namespace shoestring;
using models::ClipTextLayout;
using models::ClipTextModel;
using models::ClipTextOptions;

namespace {

std::string data(const std::string& name) { return std::string(SHOESTRING_TEST_DATA) + "/models/" + name; }

// The micro configurations of scripts/gen_clip_reference.py.
ClipTextOptions micro_hf() {
  return ClipTextOptions::clip_l().vocab_size(100).width(32).layers(3).heads(4).mlp_width(48);
}
ClipTextOptions micro_openclip() {
  return ClipTextOptions::clip_g().vocab_size(100).width(40).layers(3).heads(5).mlp_width(80).projection_dim(24);
}

double max_diff(const torch::Tensor& a, const torch::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  if (a.sizes() != b.sizes()) return 1e9;
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

void expect_matches_reference(const ClipTextOptions& options, const std::string& name, const std::string& prefix) {
  torch::NoGradGuard no_grad;
  ClipTextModel model(options);
  const WeightFiles files = WeightFiles::open(data(name + ".safetensors"));
  const LoadWeightsReport report = models::load_clip_text_weights(*model, files, prefix);
  EXPECT_EQ(report.loaded, static_cast<int64_t>(model->parameters().size() + model->buffers().size()));
  const auto ref = shoestring::testing::load_case(name);
  const torch::Tensor ids = ref.at("input.ids").to(torch::kLong);
  double worst = 0;
  for (int64_t skip = 1; skip <= options.layers(); ++skip) {
    const models::ClipTextOutput out = model->forward(ids, skip);
    const double d[] = {max_diff(out.last_hidden, ref.at("last_hidden")), max_diff(out.pooled, ref.at("pooled")),
                        max_diff(out.hidden, ref.at("hidden." + std::to_string(skip))),
                        max_diff(out.hidden_normed, ref.at("hidden_normed." + std::to_string(skip)))};
    EXPECT_LT(d[0], 1e-5) << name << " last_hidden";
    EXPECT_LT(d[1], 1e-5) << name << " pooled";
    EXPECT_LT(d[2], 1e-5) << name << " hidden, skip " << skip;
    EXPECT_LT(d[3], 1e-5) << name << " hidden_normed, skip " << skip;
    for (double x : d) worst = std::max(worst, x);
  }
  std::cout << name << ": largest difference to the PyTorch reference " << worst << "\n";
  // The comparison can fail: the other activation or pooling at the last position is far off.
  ClipTextModel other(ClipTextOptions(options).activation(options.activation() == models::ClipActivation::kGelu
                                                              ? models::ClipActivation::kQuickGelu
                                                              : models::ClipActivation::kGelu));
  models::load_clip_text_weights(*other, files, prefix);
  EXPECT_GT(max_diff(other->forward(ids).last_hidden, ref.at("last_hidden")), 1e-3);
  const torch::Tensor at_end = model->forward(ids).last_hidden.select(1, ids.size(1) - 1);
  const torch::Tensor expected_pooled = ref.at("pooled");
  if (!model->text_projection.defined()) {
    EXPECT_GT(max_diff(at_end, expected_pooled), 1e-2);
  }
  // The outputs differ from each other, so the comparisons above can tell them apart.
  EXPECT_GT(max_diff(ref.at("hidden.1"), ref.at("hidden.2")), 1e-2);
  EXPECT_GT(max_diff(ref.at("hidden.2"), ref.at("hidden_normed.2")), 1e-2);
}

std::map<std::string, std::vector<int64_t>> tensors_of(const torch::nn::Module& m) {
  return shoestring::testing::module_keys(m);
}

}  // namespace

// ---- released key names and parameter counts ---------------------------------

// CLIP-L text (openai/clip-vit-large-patch14): 123,060,480 = diffusers
// text_encoder.num_parameters() of runwayml/stable-diffusion-v1-5. Derived here
// from the published config: token 49408x768, position 77x768, 12 layers of
// (2 LayerNorms, q/k/v/out 768x768+768, fc1 768->3072, fc2 3072->768), final LayerNorm.
TEST(ClipText, ClipLParameterCountIsPublished) {
  const int64_t w = 768, m = 3072;
  const int64_t layer = 4 * w + 4 * (w * w + w) + (w * m + m) + (m * w + w);
  const int64_t expected = 49408 * w + 77 * w + 12 * layer + 2 * w;
  EXPECT_EQ(expected, 123'060'480);
  ClipTextModel model(ClipTextOptions::clip_l().init(torch::kMeta));
  EXPECT_EQ(nn::parameter_count(*model), expected);
  EXPECT_EQ(models::find_architecture("clip-l").parameters, expected);
}

// OpenCLIP ViT-bigG-14 text: 694,659,840 = diffusers text_encoder_2
// (CLIPTextModelWithProjection) of stabilityai/stable-diffusion-xl-base-1.0.
// Derived from open_clip's ViT-bigG-14.json text_cfg: width 1280, 32 layers,
// MLP 5120 (mlp_ratio 4), packed in_proj 3*1280x1280, text_projection 1280x1280.
TEST(ClipText, ClipGParameterCountIsPublished) {
  const int64_t w = 1280, m = 5120;
  const int64_t layer = 4 * w + (3 * w * w + 3 * w) + (w * w + w) + (w * m + m) + (m * w + w);
  const int64_t expected = 49408 * w + 77 * w + 32 * layer + 2 * w + w * w;
  EXPECT_EQ(expected, 694'659'840);
  ClipTextModel model(ClipTextOptions::clip_g().init(torch::kMeta));
  EXPECT_EQ(nn::parameter_count(*model), expected);
  EXPECT_EQ(models::find_architecture("clip-g").parameters, expected);
}

TEST(ClipText, HuggingFaceKeysAreTheReleasedOnes) {
  ClipTextModel model(ClipTextOptions::clip_l().init(torch::kMeta));
  const auto keys = tensors_of(*model);
  // 2 embeddings + 12 layers x 16 + final norm 2 parameters, + position_ids.
  EXPECT_EQ(keys.size(), 2u + 12u * 16u + 2u + 1u);
  const std::map<std::string, std::vector<int64_t>> expected = {
      {"text_model.embeddings.token_embedding.weight", {49408, 768}},
      {"text_model.embeddings.position_embedding.weight", {77, 768}},
      {"text_model.embeddings.position_ids", {1, 77}},
      {"text_model.encoder.layers.0.layer_norm1.weight", {768}},
      {"text_model.encoder.layers.0.layer_norm1.bias", {768}},
      {"text_model.encoder.layers.0.self_attn.q_proj.weight", {768, 768}},
      {"text_model.encoder.layers.0.self_attn.k_proj.bias", {768}},
      {"text_model.encoder.layers.0.self_attn.v_proj.weight", {768, 768}},
      {"text_model.encoder.layers.0.self_attn.out_proj.weight", {768, 768}},
      {"text_model.encoder.layers.11.layer_norm2.bias", {768}},
      {"text_model.encoder.layers.11.mlp.fc1.weight", {3072, 768}},
      {"text_model.encoder.layers.11.mlp.fc2.weight", {768, 3072}},
      {"text_model.final_layer_norm.weight", {768}},
      {"text_model.final_layer_norm.bias", {768}},
  };
  for (const auto& [k, shape] : expected) {
    auto it = keys.find(k);
    ASSERT_NE(it, keys.end()) << k;
    EXPECT_EQ(it->second, shape) << k;
  }
  for (const auto& b : model->named_buffers()) {
    EXPECT_EQ(b.key(), "text_model.embeddings.position_ids");
    EXPECT_EQ(b.value().scalar_type(), torch::kLong);
  }
  for (const auto& p : model->parameters()) EXPECT_TRUE(p.is_meta());
}

TEST(ClipText, OpenClipKeysAreTheReleasedOnes) {
  ClipTextModel model(ClipTextOptions::clip_g().init(torch::kMeta));
  const auto keys = tensors_of(*model);
  // token + positional, 32 layers x 12, ln_final 2, text_projection, logit_scale.
  EXPECT_EQ(keys.size(), 2u + 32u * 12u + 2u + 1u + 1u);
  const std::map<std::string, std::vector<int64_t>> expected = {
      {"token_embedding.weight", {49408, 1280}},
      {"positional_embedding", {77, 1280}},
      {"transformer.resblocks.0.ln_1.weight", {1280}},
      {"transformer.resblocks.0.attn.in_proj_weight", {3840, 1280}},
      {"transformer.resblocks.0.attn.in_proj_bias", {3840}},
      {"transformer.resblocks.0.attn.out_proj.weight", {1280, 1280}},
      {"transformer.resblocks.0.attn.out_proj.bias", {1280}},
      {"transformer.resblocks.31.ln_2.bias", {1280}},
      {"transformer.resblocks.31.mlp.c_fc.weight", {5120, 1280}},
      {"transformer.resblocks.31.mlp.c_proj.weight", {1280, 5120}},
      {"ln_final.weight", {1280}},
      {"text_projection", {1280, 1280}},
      {"logit_scale", {}},
  };
  for (const auto& [k, shape] : expected) {
    auto it = keys.find(k);
    ASSERT_NE(it, keys.end()) << k;
    EXPECT_EQ(it->second, shape) << k;
  }
}

// ---- numerics against the independent PyTorch reference ------------------------

TEST(ClipText, HuggingFaceLayoutMatchesPyTorchReference) {
  expect_matches_reference(micro_hf(), "clip_hf_micro", models::kSd15ClipPrefix);
}

TEST(ClipText, OpenClipLayoutMatchesPyTorchReference) {
  expect_matches_reference(micro_openclip(), "clip_openclip_micro", models::kSdxlClipGPrefix);
}

// Stable Cascade's use of bigG: the last layer's states without the final
// LayerNorm (skip 1) and the projected pooled vector, with the tokenizer's
// attention mask (padding with EOS, mask 1 through the first EOS) against
// torch's key_padding_mask in the reference.
TEST(ClipText, AttentionMaskMatchesPyTorchReference) {
  torch::NoGradGuard no_grad;
  ClipTextModel model(micro_openclip());
  models::load_clip_text_weights(*model, WeightFiles::open(data("clip_openclip_micro.safetensors")),
                                 models::kSdxlClipGPrefix);
  const auto ref = shoestring::testing::load_case("clip_openclip_micro_masked");
  const torch::Tensor ids = ref.at("input.ids").to(torch::kLong);
  const torch::Tensor mask = models::clip_attention_mask(ids, /*eos_id=*/99);  // the micro vocabulary's EOS
  EXPECT_TRUE(torch::equal(mask, ref.at("input.attention_mask").to(torch::kLong)));
  const auto out = model->forward(ids, 1, mask);
  EXPECT_LT(max_diff(out.hidden, ref.at("hidden.1")), 1e-4);
  EXPECT_LT(max_diff(out.pooled, ref.at("pooled")), 1e-4);
  // The mask matters after EOS only: without it the padding positions differ.
  const auto unmasked = model->forward(ids, 1);
  EXPECT_GT(max_diff(unmasked.hidden, ref.at("hidden.1")), 1e-2);
  EXPECT_LT(max_diff(unmasked.hidden.select(1, 0), ref.at("hidden.1").select(1, 0)), 1e-4);
  EXPECT_LT(max_diff(unmasked.pooled, ref.at("pooled")), 1e-4);

  EXPECT_THROW(model->forward(ids, 1, mask.slice(1, 0, 76)), Error);  // shape
  EXPECT_THROW(model->forward(ids, 1, mask * 2), Error);               // values
  torch::Tensor no_bos = mask.clone();
  no_bos.select(1, 0).fill_(0);
  EXPECT_THROW(model->forward(ids, 1, no_bos), Error);
  // A row without EOS (truncated without one) is all tokens.
  EXPECT_TRUE(models::clip_attention_mask(torch::ones({1, 5}, torch::kLong)).eq(1).all().item<bool>());
  EXPECT_THROW(models::clip_attention_mask(ids.to(torch::kFloat32)), Error);
}

// Inside a bf16 block (nn/block_precision.h) the encoder computes in bf16 and
// stays close to the fp32 reference (bf16 keeps 8 bits of mantissa).
TEST(ClipText, RunsInABf16Block) {
  torch::NoGradGuard no_grad;
  ClipTextModel model(micro_openclip());
  models::load_clip_text_weights(*model, WeightFiles::open(data("clip_openclip_micro.safetensors")),
                                 models::kSdxlClipGPrefix);
  const auto ref = shoestring::testing::load_case("clip_openclip_micro");
  nn::ComputeDtypeGuard bf16(torch::kBFloat16);
  const auto out = model->forward(ref.at("input.ids").to(torch::kLong));
  EXPECT_EQ(out.last_hidden.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(out.pooled.scalar_type(), torch::kBFloat16);
  EXPECT_LT(max_diff(out.hidden, ref.at("hidden.2")), 0.25);
  EXPECT_LT(max_diff(out.pooled, ref.at("pooled")), 0.25);
}

// Causality: changing a token changes no earlier position's hidden state.
TEST(ClipText, AttentionIsCausal) {
  torch::manual_seed(1);
  torch::NoGradGuard no_grad;
  ClipTextModel model(micro_openclip());
  torch::Tensor a = torch::randint(0, 98, {1, 77}, torch::kLong);
  torch::Tensor b = a.clone();
  b[0][40] = (a[0][40].item<int64_t>() + 1) % 98;
  const auto oa = model->forward(a), ob = model->forward(b);
  EXPECT_LT(max_diff(oa.last_hidden.slice(1, 0, 40), ob.last_hidden.slice(1, 0, 40)), 1e-6);
  EXPECT_GT(max_diff(oa.last_hidden.slice(1, 40, 41), ob.last_hidden.slice(1, 40, 41)), 1e-4);
}

// ---- loading -------------------------------------------------------------------

TEST(ClipText, LoadToleratesMissingOptionalBuffersOnly) {
  shoestring::testing::TempDir dir;
  torch::NoGradGuard no_grad;
  ClipTextModel source(micro_hf());
  std::vector<NamedTensor> tensors;
  for (const auto& p : source->named_parameters()) tensors.push_back({"te." + p.key(), p.value(), {}});
  const std::string path = dir.file("no_position_ids.safetensors");
  save_safetensors(path, tensors);
  ClipTextModel target(micro_hf());
  models::load_clip_text_weights(*target, WeightFiles::open(path), "te.");
  const torch::Tensor ids = torch::randint(0, 100, {2, 77}, torch::kLong);
  EXPECT_LT(max_diff(source->forward(ids).pooled, target->forward(ids).pooled), 1e-7);
  EXPECT_TRUE(torch::equal(target->named_buffers()["text_model.embeddings.position_ids"],
                           torch::arange(77, torch::kLong).unsqueeze(0)));

  // Any other missing tensor is an error naming the file and the key.
  tensors.erase(tensors.begin());
  const std::string bad = dir.file("missing.safetensors");
  save_safetensors(bad, tensors);
  try {
    models::load_clip_text_weights(*target, WeightFiles::open(bad), "te.");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing.safetensors"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(source->named_parameters().begin()->key()), std::string::npos) << e.what();
  }
}

TEST(ClipText, LoadRejectsWrongPrefixAndWrongLayout) {
  const WeightFiles files = WeightFiles::open(data("clip_hf_micro.safetensors"));
  ClipTextModel hf(micro_hf());
  EXPECT_THROW(models::load_clip_text_weights(*hf, files, models::kSdxlClipGPrefix), Error);
  ClipTextModel openclip(micro_openclip());
  try {
    models::load_clip_text_weights(*openclip, files, models::kSd15ClipPrefix);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("clip_hf_micro.safetensors"), std::string::npos) << e.what();
  }
  ClipTextModel meta(micro_hf().init(torch::kMeta));
  EXPECT_THROW(models::load_clip_text_weights(*meta, files, models::kSd15ClipPrefix), Error);
}

// ---- inputs --------------------------------------------------------------------

TEST(ClipText, RejectsBadInputsAndOptions) {
  ClipTextModel model(micro_hf());
  const torch::Tensor ids = torch::zeros({1, 77}, torch::kLong);
  EXPECT_THROW(model->forward(ids.to(torch::kFloat32)), Error);
  EXPECT_THROW(model->forward(torch::zeros({1, 78}, torch::kLong)), Error);
  EXPECT_THROW(model->forward(torch::zeros({77}, torch::kLong)), Error);
  EXPECT_THROW(model->forward(torch::full({1, 77}, 100, torch::kLong)), Error);
  EXPECT_THROW(model->forward(ids, 0), Error);
  EXPECT_THROW(model->forward(ids, 4), Error);
  EXPECT_NO_THROW(model->forward(torch::zeros({2, 5}, torch::kLong)));  // shorter sequences are fine
  EXPECT_THROW(ClipTextModel(micro_hf().heads(5)), Error);
  // HF CLIPTextModelWithProjection has a projection but no logit_scale.
  EXPECT_THROW(ClipTextModel(micro_hf().logit_scale(true)), Error);
  EXPECT_EQ(ClipTextModel(micro_hf().projection_dim(8))->forward(ids).pooled.sizes(), (std::vector<int64_t>{1, 8}));
}

TEST(ClipText, TinyKeepsVocabularyAndLayout) {
  const ClipTextOptions g = ClipTextOptions::clip_g().tiny();
  EXPECT_EQ(g.vocab_size(), 49408);
  EXPECT_EQ(g.max_positions(), 77);
  EXPECT_EQ(g.width(), 32);
  EXPECT_EQ(g.projection_dim(), 32);
  EXPECT_EQ(g.layout(), ClipTextLayout::kOpenClip);
  ClipTextModel model(ClipTextOptions::clip_l().tiny(64));
  const auto out = model->forward(torch::full({2, 77}, 49407, torch::kLong));
  EXPECT_EQ(out.last_hidden.sizes(), (std::vector<int64_t>{2, 77, 64}));
  EXPECT_EQ(out.pooled.sizes(), (std::vector<int64_t>{2, 64}));
}

// ---- registry and detection ------------------------------------------------------

namespace {
std::vector<models::TensorShape> prefixed(const std::string& arch, const std::string& prefix, bool tiny = false) {
  std::vector<models::TensorShape> out;
  for (const auto& t : models::architecture_tensors(arch, tiny)) out.push_back({prefix + t.name, t.shape, t.parameter});
  return out;
}
}  // namespace

TEST(ClipText, DetectsBothEncodersInAnSdxlFileAndClipLInAnSd15File) {
  auto sdxl = prefixed("clip-l", models::kSdxlClipLPrefix);
  for (auto& t : prefixed("clip-g", models::kSdxlClipGPrefix)) sdxl.push_back(t);
  for (auto& t : prefixed("vae", "first_stage_model.")) sdxl.push_back(t);
  auto found = models::detect_architectures(sdxl);
  ASSERT_EQ(found.size(), 3u);
  EXPECT_EQ(found[0].architecture, "vae");
  std::set<std::pair<std::string, std::string>> got;
  for (const auto& d : found) {
    EXPECT_TRUE(d.exact()) << d.architecture;
    got.insert({d.architecture, d.prefix});
  }
  EXPECT_TRUE(got.count({"clip-l", models::kSdxlClipLPrefix}));
  EXPECT_TRUE(got.count({"clip-g", models::kSdxlClipGPrefix}));

  auto sd15 = models::detect_architectures(prefixed("clip-l", models::kSd15ClipPrefix));
  ASSERT_EQ(sd15.size(), 1u);
  EXPECT_EQ(sd15[0].prefix, models::kSd15ClipPrefix);
  EXPECT_TRUE(sd15[0].exact());

  // A bare encoder file is reported once, and the tiny width is recognised.
  auto bare = models::detect_architectures(prefixed("clip-l", "", true));
  ASSERT_EQ(bare.size(), 1u);
  EXPECT_EQ(bare[0].architecture, "clip-l");
  EXPECT_TRUE(bare[0].tiny);
  EXPECT_EQ(bare[0].prefix, "");
}

TEST(ClipText, CheckpointRootHasTheSingleFileKeys) {
  auto root = models::build_checkpoint_root("clip-g", torch::kMeta);
  const auto keys = shoestring::testing::module_keys(*root);
  EXPECT_TRUE(keys.count("conditioner.embedders.1.model.transformer.resblocks.31.attn.in_proj_weight"));
  EXPECT_TRUE(keys.count("conditioner.embedders.1.model.logit_scale"));
}

// ---- Hugging Face CLIPTextModelWithProjection layout (SD3 / SD3.5 clip_g, clip_l) -------

namespace {

using KeyShapes = std::map<std::string, std::vector<int64_t>>;

// The released key set of CLIPTextModelWithProjection (transformers modeling_clip.py:
// CLIPTextTransformer under text_model + text_projection = nn.Linear(width, P, bias=False)),
// written out independently of the model.
KeyShapes hf_with_projection_keys(int64_t vocab, int64_t positions, int64_t w, int64_t layers, int64_t m, int64_t p) {
  KeyShapes k = {{"text_model.embeddings.token_embedding.weight", {vocab, w}},
                 {"text_model.embeddings.position_embedding.weight", {positions, w}},
                 {"text_model.embeddings.position_ids", {1, positions}},
                 {"text_model.final_layer_norm.weight", {w}},
                 {"text_model.final_layer_norm.bias", {w}},
                 {"text_projection.weight", {p, w}}};
  for (int64_t i = 0; i < layers; ++i) {
    const std::string l = "text_model.encoder.layers." + std::to_string(i) + ".";
    for (const char* n : {"layer_norm1", "layer_norm2"}) {
      k[l + n + ".weight"] = {w};
      k[l + n + ".bias"] = {w};
    }
    for (const char* n : {"q_proj", "k_proj", "v_proj", "out_proj"}) {
      k[l + "self_attn." + n + ".weight"] = {w, w};
      k[l + "self_attn." + n + ".bias"] = {w};
    }
    k[l + "mlp.fc1.weight"] = {m, w};
    k[l + "mlp.fc1.bias"] = {m};
    k[l + "mlp.fc2.weight"] = {w, m};
    k[l + "mlp.fc2.bias"] = {w};
  }
  return k;
}

// A bigG-style micro model (exact GELU, projection 24 != width 40, so a transposed
// projection cannot pass as the right one) in the OpenCLIP layout, with every
// tensor perturbed off its init (LayerNorm 1/0, zero biases) so that swapped or
// misplaced tensors change the outputs.
ClipTextModel perturbed_openclip(uint64_t seed) {
  torch::manual_seed(seed);
  ClipTextModel m(micro_openclip());
  torch::NoGradGuard no_grad;
  for (auto& t : m->parameters()) t.add_(torch::randn_like(t) * 0.1);
  return m;
}

// The independent reference conversion OpenCLIP -> HF CLIPTextModelWithProjection
// (as transformers' convert scripts / kohya's bigG conversion do it): in_proj_weight
// and in_proj_bias split into q | k | v rows, ln_1/ln_2/ln_final and c_fc/c_proj
// renamed, text_projection [W, P] transposed into the Linear weight [P, W].
// logit_scale has no HF counterpart and is dropped.
std::vector<NamedTensor> openclip_to_hf(const torch::nn::Module& openclip, const std::string& prefix,
                                        int64_t layers) {
  const auto src = openclip.named_parameters();
  std::vector<NamedTensor> out;
  auto put = [&](const std::string& name, const torch::Tensor& t) {
    out.push_back({prefix + name, t.contiguous().clone(), {}});
  };
  put("text_model.embeddings.token_embedding.weight", src["token_embedding.weight"]);
  put("text_model.embeddings.position_embedding.weight", src["positional_embedding"]);
  for (int64_t i = 0; i < layers; ++i) {
    const std::string o = "transformer.resblocks." + std::to_string(i) + ".";
    const std::string h = "text_model.encoder.layers." + std::to_string(i) + ".";
    const auto w = src[o + "attn.in_proj_weight"].chunk(3, 0);
    const auto b = src[o + "attn.in_proj_bias"].chunk(3, 0);
    const char* names[] = {"q_proj", "k_proj", "v_proj"};
    for (int j = 0; j < 3; ++j) {
      put(h + "self_attn." + names[j] + ".weight", w[j]);
      put(h + "self_attn." + names[j] + ".bias", b[j]);
    }
    for (const char* s : {"weight", "bias"}) {
      put(h + "self_attn.out_proj." + s, src[o + "attn.out_proj." + s]);
      put(h + "layer_norm1." + s, src[o + "ln_1." + s]);
      put(h + "layer_norm2." + s, src[o + "ln_2." + s]);
      put(h + "mlp.fc1." + s, src[o + "mlp.c_fc." + s]);
      put(h + "mlp.fc2." + s, src[o + "mlp.c_proj." + s]);
    }
  }
  put("text_model.final_layer_norm.weight", src["ln_final.weight"]);
  put("text_model.final_layer_norm.bias", src["ln_final.bias"]);
  put("text_projection.weight", src["text_projection"].t());
  return out;
}

std::vector<NamedTensor> named_tensors(const torch::nn::Module& m, const std::string& prefix) {
  std::vector<NamedTensor> out;
  for (const auto& p : m.named_parameters()) out.push_back({prefix + p.key(), p.value(), {}});
  for (const auto& b : m.named_buffers()) out.push_back({prefix + b.key(), b.value(), {}});
  return out;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an error";
  return "";
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

// SD3's clip_g: OpenCLIP bigG's text tower in transformers' CLIPTextModelWithProjection
// layout. 694,659,840 parameters, as the OpenCLIP layout without logit_scale (a
// buffer here): the packed in_proj 3W x W + 3W equals q/k/v W x W + W each, and
// the projection W x P is stored as P x W.
TEST(ClipText, ClipGHfKeysAndParameterCountAreTheReleasedOnes) {
  const ClipTextOptions o = ClipTextOptions::clip_g_hf();
  EXPECT_EQ(o.layout(), ClipTextLayout::kHuggingFace);
  EXPECT_EQ(o.activation(), models::ClipActivation::kGelu);
  EXPECT_FALSE(o.logit_scale());
  EXPECT_EQ(o.heads(), 20);
  ClipTextModel model(ClipTextOptions(o).init(torch::kMeta));
  const int64_t w = 1280, m = 5120, p = 1280, layers = 32;
  const KeyShapes expected = hf_with_projection_keys(49408, 77, w, layers, m, p);
  EXPECT_EQ(tensors_of(*model), expected);
  const int64_t layer = 2 * 2 * w + 4 * (w * w + w) + (w * m + m) + (m * w + w);
  const int64_t count = 49408 * w + 77 * w + layers * layer + 2 * w + p * w;
  EXPECT_EQ(count, 694'659'840);
  EXPECT_EQ(nn::parameter_count(*model), count);
  EXPECT_EQ(nn::parameter_count(*ClipTextModel(ClipTextOptions::clip_g().init(torch::kMeta))), count);
  for (const auto& t : model->parameters()) EXPECT_TRUE(t.is_meta());
  EXPECT_EQ(model->projection_matrix().sizes(), (std::vector<int64_t>{w, p}));

  // CLIP-L with its 768 x 768 projection (SD3's clip_l when the file has one):
  // 123,060,480 + 768 * 768 = 123,650,304, one key more than CLIP-L.
  ClipTextModel l(ClipTextOptions::clip_l().projection_dim(768).init(torch::kMeta));
  EXPECT_EQ(tensors_of(*l), hf_with_projection_keys(49408, 77, 768, 12, 3072, 768));
  EXPECT_EQ(nn::parameter_count(*l), 123'060'480 + 768 * 768);

  const ClipTextOptions tiny = o.tiny();
  EXPECT_EQ(tiny.layout(), ClipTextLayout::kHuggingFace);
  EXPECT_EQ(tiny.projection_dim(), 32);
}

// The same weights in both layouts give the same outputs: the OpenCLIP micro
// model against its conversion (openclip_to_hf above, the reference) saved as an
// SD3.5 single file would hold clip_g, detected and loaded from there.
TEST(ClipText, HfLayoutWithProjectionMatchesOpenClipLayout) {
  shoestring::testing::TempDir dir;
  torch::NoGradGuard no_grad;
  ClipTextModel openclip = perturbed_openclip(7);
  const ClipTextOptions o = micro_openclip();
  std::vector<NamedTensor> tensors = openclip_to_hf(*openclip, models::kSd3ClipGPrefix, o.layers());
  // Other tensors of the file (another encoder, the denoiser) are ignored.
  for (auto& t : named_tensors(*ClipTextModel(micro_hf()), models::kSd3ClipLPrefix)) tensors.push_back(t);
  tensors.push_back({"model.diffusion_model.x_embedder.proj.weight", torch::zeros({4, 4}), {}});
  const std::string path = dir.file("sd3_single.safetensors");
  save_safetensors(path, tensors);
  const WeightFiles files = WeightFiles::open(path);

  const models::ClipTextFileLayout layout = models::detect_clip_text_layout(files, models::kSd3ClipGPrefix);
  EXPECT_EQ(layout.layout, ClipTextLayout::kHuggingFace);
  EXPECT_EQ(layout.projection_dim, 24);
  EXPECT_FALSE(layout.logit_scale);
  ClipTextModel hf(layout.options(o));
  EXPECT_EQ(hf->options().layout(), ClipTextLayout::kHuggingFace);
  const LoadWeightsReport report = models::load_clip_text_weights(*hf, files, models::kSd3ClipGPrefix);
  EXPECT_EQ(report.loaded, static_cast<int64_t>(hf->parameters().size()));  // all but position_ids
  EXPECT_EQ(hf->text_projection.sizes(), (std::vector<int64_t>{24, 40}));  // as the file stores it

  torch::manual_seed(3);
  torch::Tensor ids = torch::randint(1, 98, {3, 77}, torch::kLong);
  ids.index_put_({0, 10}, 99);  // EOS (the largest id) at different positions
  ids.index_put_({1, 76}, 99);
  ids.index_put_({2, 40}, 99);
  double worst = 0;
  for (int64_t skip = 1; skip <= o.layers(); ++skip) {
    const auto a = openclip->forward(ids, skip), b = hf->forward(ids, skip);
    const double d[] = {max_diff(a.last_hidden, b.last_hidden), max_diff(a.hidden, b.hidden),
                        max_diff(a.hidden_normed, b.hidden_normed), max_diff(a.pooled, b.pooled),
                        max_diff(a.pooled_unprojected, b.pooled_unprojected)};
    for (double x : d) {
      EXPECT_LT(x, 1e-5) << "skip " << skip;
      worst = std::max(worst, x);
    }
    EXPECT_EQ(b.pooled.sizes(), (std::vector<int64_t>{3, 24}));
  }
  std::cout << "HF-with-projection vs OpenCLIP layout: largest difference " << worst << "\n";
  // pooled = EOS state @ weight^T (nn.Linear), computed here from the file's tensor.
  const auto out = hf->forward(ids);
  const torch::Tensor eos = out.last_hidden.index({torch::arange(3), torch::tensor({10, 76, 40}, torch::kLong)});
  EXPECT_TRUE(torch::equal(out.pooled_unprojected, eos));
  const torch::Tensor weight = files.get(std::string(models::kSd3ClipGPrefix) + "text_projection.weight");
  EXPECT_LT(max_diff(out.pooled, torch::linear(eos, weight)), 1e-5);
  EXPECT_GT(out.pooled.abs().max().item<double>(), 1e-2);

  // The projection follows the parameter through Module::to().
  hf->to(torch::kFloat64);
  EXPECT_EQ(hf->projection_matrix().scalar_type(), torch::kFloat64);
  EXPECT_LT(max_diff(hf->forward(ids).pooled, out.pooled), 1e-5);
}

// The comparison above can fail: an untransposed square projection or swapped q/k
// rows give other outputs.
TEST(ClipText, LayoutConversionMistakesAreVisible) {
  shoestring::testing::TempDir dir;
  torch::NoGradGuard no_grad;
  ClipTextModel openclip = perturbed_openclip(11);
  const torch::Tensor ids = torch::randint(1, 99, {2, 77}, torch::kLong);
  const auto expected = openclip->forward(ids);
  auto load_variant = [&](const std::function<void(std::vector<NamedTensor>&)>& edit, int64_t projection) {
    std::vector<NamedTensor> t = openclip_to_hf(*openclip, "", 3);
    edit(t);
    const std::string path = dir.file("variant.safetensors");
    save_safetensors(path, t);
    ClipTextModel hf(micro_openclip().layout(ClipTextLayout::kHuggingFace).logit_scale(false).projection_dim(projection));
    models::load_clip_text_weights(*hf, WeightFiles::open(path), "");
    return hf->forward(ids);
  };
  // Swapping q and k of layer 0.
  const auto swapped = load_variant(
      [](std::vector<NamedTensor>& t) {
        NamedTensor *q = nullptr, *k = nullptr;
        for (auto& x : t) {
          if (x.name == "text_model.encoder.layers.0.self_attn.q_proj.weight") q = &x;
          if (x.name == "text_model.encoder.layers.0.self_attn.k_proj.weight") k = &x;
        }
        std::swap(q->tensor, k->tensor);
      },
      24);
  EXPECT_GT(max_diff(swapped.last_hidden, expected.last_hidden), 1e-3);
  // A square projection stored without the transpose.
  const torch::Tensor square = torch::randn({40, 40});
  auto with_square = [&](bool transpose) {
    return load_variant(
        [&](std::vector<NamedTensor>& t) {
          for (auto& x : t) {
            if (x.name == "text_projection.weight") x.tensor = transpose ? square.t().contiguous() : square;
          }
        },
        40);
  };
  const auto right = with_square(true), wrong = with_square(false);
  EXPECT_LT(max_diff(right.pooled, torch::matmul(expected.pooled_unprojected, square)), 1e-4);
  EXPECT_GT(max_diff(wrong.pooled, right.pooled), 1e-2);
}

TEST(ClipText, DetectsTheLayoutOfEachFile) {
  shoestring::testing::TempDir dir;
  torch::NoGradGuard no_grad;
  struct Case {
    std::string name;
    ClipTextOptions options;
    std::string prefix;
  };
  const std::vector<Case> cases = {
      {"hf", micro_hf(), models::kSd15ClipPrefix},
      {"hf_projection", micro_openclip().layout(ClipTextLayout::kHuggingFace).logit_scale(false),
       models::kSd3ClipGPrefix},
      {"clip_l_projection", micro_hf().projection_dim(32), models::kSd3ClipLPrefix},
      {"openclip", micro_openclip(), models::kSdxlClipGPrefix},
      {"openclip_bare", micro_openclip().projection_dim(0).logit_scale(false), ""},
  };
  for (const Case& c : cases) {
    ClipTextModel source(c.options);
    const std::string path = dir.file(c.name + ".safetensors");
    std::vector<NamedTensor> t = named_tensors(*source, c.prefix);
    if (!c.prefix.empty()) t.push_back({"first_stage_model.decoder.conv_in.weight", torch::zeros({2}), {}});
    save_safetensors(path, t);
    const WeightFiles files = WeightFiles::open(path);
    const models::ClipTextFileLayout d = models::detect_clip_text_layout(files, c.prefix);
    EXPECT_EQ(d.layout, c.options.layout()) << c.name;
    EXPECT_EQ(d.projection_dim, c.options.projection_dim()) << c.name;
    EXPECT_EQ(d.logit_scale, c.options.logit_scale()) << c.name;
    EXPECT_EQ(d.vocab_size, 100) << c.name;
    EXPECT_EQ(d.max_positions, 77) << c.name;
    EXPECT_EQ(d.width, c.options.width()) << c.name;
    EXPECT_EQ(d.layers, 3) << c.name;
    EXPECT_EQ(d.mlp_width, c.options.mlp_width()) << c.name;
    // A model built from the detected options (sizes from the preset) loads the file.
    const ClipTextOptions base = c.options.layout() == ClipTextLayout::kHuggingFace && c.options.width() == 32
                                     ? micro_hf()
                                     : micro_openclip();
    ClipTextModel target(d.options(base));
    models::load_clip_text_weights(*target, files, c.prefix);
    const torch::Tensor ids = torch::randint(0, 100, {2, 77}, torch::kLong);
    EXPECT_LT(max_diff(source->forward(ids).pooled, target->forward(ids).pooled), 1e-7) << c.name;
  }
  // The reference files of the tests above.
  const auto hf = models::detect_clip_text_layout(WeightFiles::open(data("clip_hf_micro.safetensors")),
                                                  models::kSd15ClipPrefix);
  EXPECT_EQ(hf.layout, ClipTextLayout::kHuggingFace);
  EXPECT_EQ(hf.projection_dim, 0);
  const auto oc = models::detect_clip_text_layout(WeightFiles::open(data("clip_openclip_micro.safetensors")),
                                                  models::kSdxlClipGPrefix);
  EXPECT_EQ(oc.layout, ClipTextLayout::kOpenClip);
  EXPECT_EQ(oc.projection_dim, 24);
}

TEST(ClipText, DetectionErrorsNameTheFileAndKey) {
  shoestring::testing::TempDir dir;
  torch::NoGradGuard no_grad;
  const std::string prefix = models::kSd3ClipGPrefix;
  const std::vector<NamedTensor> good = named_tensors(
      *ClipTextModel(micro_openclip().layout(ClipTextLayout::kHuggingFace).logit_scale(false)), prefix);
  int n = 0;
  // Saves `tensors` and returns the detection error (and that it names the file).
  auto detect_error = [&](const std::vector<NamedTensor>& tensors, const std::string& under) {
    const std::string name = "case" + std::to_string(n++) + ".safetensors";
    save_safetensors(dir.file(name), tensors);
    const std::string e =
        error_of([&] { models::detect_clip_text_layout(WeightFiles::open(dir.file(name)), under); });
    EXPECT_TRUE(contains(e, name)) << e;
    return e;
  };
  auto edited = [&](const std::function<void(std::vector<NamedTensor>&)>& edit) {
    std::vector<NamedTensor> t = good;
    edit(t);
    return t;
  };
  auto drop = [&](const std::string& key) {
    return edited([&](std::vector<NamedTensor>& t) {
      t.erase(std::remove_if(t.begin(), t.end(), [&](const NamedTensor& x) { return x.name == prefix + key; }),
              t.end());
    });
  };
  auto replace = [&](const std::string& key, const std::string& new_key, const torch::Tensor& value) {
    return edited([&](std::vector<NamedTensor>& t) {
      for (auto& x : t) {
        if (x.name == prefix + key) x = {prefix + new_key, value, {}};
      }
    });
  };

  // Nothing under the prefix.
  EXPECT_TRUE(contains(detect_error(good, models::kSd3ClipLPrefix), models::kSd3ClipLPrefix));
  // Neither layout's keys.
  EXPECT_TRUE(contains(detect_error(drop("text_model.embeddings.token_embedding.weight"), prefix),
                       "text_model.embeddings.token_embedding.weight"));
  // A key the layout needs.
  EXPECT_TRUE(contains(detect_error(drop("text_model.embeddings.position_embedding.weight"), prefix),
                       prefix + "text_model.embeddings.position_embedding.weight"));
  // OpenCLIP's projection key in an HF encoder.
  EXPECT_TRUE(contains(detect_error(replace("text_projection.weight", "text_projection", torch::zeros({40, 24})),
                                    prefix),
                       prefix + "text_projection"));
  // A projection whose input is not the width (stored [W, P] instead of [P, W]).
  EXPECT_TRUE(contains(detect_error(replace("text_projection.weight", "text_projection.weight",
                                            torch::zeros({40, 24})),
                                    prefix),
                       prefix + "text_projection.weight"));
  // A gap in the layer numbers.
  const std::string gap = detect_error(
      edited([&](std::vector<NamedTensor>& t) {
        for (auto& x : t) {
          const std::string l1 = prefix + "text_model.encoder.layers.1.";
          if (x.name.compare(0, l1.size(), l1) == 0)
            x.name = prefix + "text_model.encoder.layers.7." + x.name.substr(l1.size());
        }
      }),
      prefix);
  EXPECT_TRUE(contains(gap, "text_model.encoder.layers.")) << gap;
  // Both layouts under one prefix.
  std::vector<NamedTensor> both = good;
  for (auto& t : named_tensors(*ClipTextModel(micro_openclip()), prefix)) both.push_back(t);
  EXPECT_TRUE(contains(detect_error(both, prefix), "both")) << "both layouts";
}

// Loading an HF encoder with a projection into a model built otherwise names the
// file, the key and the layout difference.
TEST(ClipText, LoadErrorsForTheHfProjectionLayout) {
  shoestring::testing::TempDir dir;
  torch::NoGradGuard no_grad;
  const ClipTextOptions with = micro_openclip().layout(ClipTextLayout::kHuggingFace).logit_scale(false);
  const std::string path = dir.file("clip_g.safetensors");
  save_safetensors(path, named_tensors(*ClipTextModel(with), ""));
  const WeightFiles files = WeightFiles::open(path);

  ClipTextModel without(ClipTextOptions(with).projection_dim(0));
  std::string e = error_of([&] { models::load_clip_text_weights(*without, files, ""); });
  EXPECT_TRUE(contains(e, "clip_g.safetensors")) << e;
  EXPECT_TRUE(contains(e, "unexpected keys: text_projection.weight")) << e;
  EXPECT_TRUE(contains(e, "Hugging Face layout with a 24-wide projection")) << e;

  ClipTextModel wider(ClipTextOptions(with).projection_dim(40));
  e = error_of([&] { models::load_clip_text_weights(*wider, files, ""); });
  EXPECT_TRUE(contains(e, "text_projection.weight (file 24x40, model 40x40)")) << e;

  ClipTextModel openclip(micro_openclip());
  e = error_of([&] { models::load_clip_text_weights(*openclip, files, ""); });
  EXPECT_TRUE(contains(e, "the model has the OpenCLIP layout")) << e;

  // An HF file without the projection into a model with one: the projection is missing.
  const std::string bare = dir.file("clip_l.safetensors");
  save_safetensors(bare, named_tensors(*ClipTextModel(ClipTextOptions(with).projection_dim(0)), ""));
  ClipTextModel model(with);
  e = error_of([&] { models::load_clip_text_weights(*model, WeightFiles::open(bare), ""); });
  EXPECT_TRUE(contains(e, "clip_l.safetensors")) << e;
  EXPECT_TRUE(contains(e, "missing keys: text_projection.weight")) << e;
}
