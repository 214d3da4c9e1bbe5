// CLIP text encoders (models/clip_text.h): released key names and parameter
// counts, numerical agreement with an independent PyTorch implementation of
// both layouts (scripts/gen_clip_reference.py), loading from a prefixed
// single file, registry and detection.
#include <algorithm>
#include <cmath>
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
  EXPECT_THROW(ClipTextModel(micro_hf().projection_dim(8)), Error);
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
