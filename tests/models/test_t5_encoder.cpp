// T5 v1.1 text encoder (models/t5_encoder.h): the released key names and the
// XXL parameter count from the published config, the relative-position
// buckets against the research note's table and a Python reference, numerical
// agreement with an independent functional PyTorch implementation
// (scripts/gen_t5_reference.py) in fp32 and bf16, and loading (bare HF keys,
// SD3's single-file prefix, the embed_tokens alias, errors).
#include <algorithm>
#include <cmath>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../error_testing.h"
#include "../io/temp_dir.h"
#include "model_testing.h"
#include "shoestring/core/error.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/io/weight_files.h"
#include "shoestring/models/t5_encoder.h"
#include "shoestring/nn/block_precision.h"
#include "shoestring/nn/layers.h"

using namespace shoestring;
using models::T5Encoder;
using models::T5EncoderOptions;

namespace {

std::string data(const std::string& name) { return std::string(SHOESTRING_TEST_DATA) + "/models/" + name; }

// The configurations of scripts/gen_t5_reference.py.
T5EncoderOptions micro() {
  return T5EncoderOptions::xxl().vocab_size(64).d_model(32).num_heads(4).d_kv(6).d_ff(40).num_layers(3);
}
T5EncoderOptions micro_b() {
  return T5EncoderOptions::xxl()
      .vocab_size(64)
      .d_model(16)
      .num_heads(2)
      .d_kv(8)
      .d_ff(24)
      .num_layers(1)
      .num_buckets(16)
      .max_distance(24);
}

double max_diff(const torch::Tensor& a, const torch::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  if (a.sizes() != b.sizes()) return 1e9;
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

T5Encoder loaded_micro() {
  T5Encoder model(micro());
  models::load_t5_encoder_weights(*model, WeightFiles::open(data("t5_micro.safetensors")));
  return model;
}

int64_t bucket(int64_t r, int64_t num_buckets = 32, int64_t max_distance = 128) {
  return models::t5_relative_position_bucket(torch::tensor({r}, torch::kLong), num_buckets, max_distance)
      .item<int64_t>();
}

// A copy of t5_micro.safetensors' tensors with renamed keys and extra tensors.
void write_variant(const std::string& path, const std::string& prefix, bool shared_as_embed_tokens,
                   const std::map<std::string, torch::Tensor>& extra = {}) {
  std::vector<NamedTensor> tensors;
  for (const auto& [key, t] : load_safetensors(data("t5_micro.safetensors"))) {
    const std::string name = (shared_as_embed_tokens && key == "shared.weight") ? "encoder.embed_tokens.weight" : key;
    tensors.push_back({prefix + name, t, {}});
  }
  for (const auto& [key, t] : extra) tensors.push_back({key, t, {}});
  save_safetensors(path, tensors);
}

}  // namespace

// ---- released key names and parameter count -----------------------------------

// google/t5-v1_1-xxl's encoder: embedding 32128 x 4096, 24 blocks of (q, k, v,
// o 4096 x 4096; wi_0, wi_1 10240 x 4096; wo 4096 x 10240; two RMSNorm
// weights), block 0's relative bias 32 x 64, final RMSNorm.
TEST(T5Encoder, XxlParameterCountFollowsTheConfig) {
  const int64_t vocab = 32128, d = 4096, ff = 10240, layers = 24, heads = 64, buckets = 32;
  const int64_t block = 4 * d * d + 3 * d * ff + 2 * d;
  const int64_t expected = vocab * d + layers * block + buckets * heads + d;
  EXPECT_EQ(vocab * d, 131'596'288);
  EXPECT_EQ(block, 192'946'176);
  EXPECT_EQ(expected, 4'762'310'656);
  T5Encoder model(T5EncoderOptions::xxl().init(torch::kMeta));
  EXPECT_EQ(nn::parameter_count(*model), expected);
  EXPECT_EQ(model->named_parameters().size(), 219u);  // 1 + 24 x 9 + 1 + 1
  EXPECT_TRUE(model->named_buffers().is_empty());
  for (const auto& p : model->parameters()) EXPECT_TRUE(p.is_meta());
}

TEST(T5Encoder, KeysAreHuggingFaceT5EncoderModels) {
  T5Encoder model(T5EncoderOptions::xxl().init(torch::kMeta));
  const auto keys = shoestring::testing::module_keys(*model);
  const std::map<std::string, std::vector<int64_t>> expected = {
      {"shared.weight", {32128, 4096}},
      {"encoder.block.0.layer.0.layer_norm.weight", {4096}},
      {"encoder.block.0.layer.0.SelfAttention.q.weight", {4096, 4096}},
      {"encoder.block.0.layer.0.SelfAttention.k.weight", {4096, 4096}},
      {"encoder.block.0.layer.0.SelfAttention.v.weight", {4096, 4096}},
      {"encoder.block.0.layer.0.SelfAttention.o.weight", {4096, 4096}},
      {"encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", {32, 64}},
      {"encoder.block.0.layer.1.layer_norm.weight", {4096}},
      {"encoder.block.0.layer.1.DenseReluDense.wi_0.weight", {10240, 4096}},
      {"encoder.block.0.layer.1.DenseReluDense.wi_1.weight", {10240, 4096}},
      {"encoder.block.0.layer.1.DenseReluDense.wo.weight", {4096, 10240}},
      {"encoder.block.23.layer.0.SelfAttention.o.weight", {4096, 4096}},
      {"encoder.block.23.layer.1.DenseReluDense.wo.weight", {4096, 10240}},
      {"encoder.block.23.layer.1.layer_norm.weight", {4096}},
      {"encoder.final_layer_norm.weight", {4096}},
  };
  for (const auto& [k, shape] : expected) shoestring::testing::expect_shape(keys, k, shape);
  // Only block 0 has the bias table; every other key is one of the per-block names.
  int64_t bias_tables = 0;
  for (const auto& [k, shape] : keys) {
    if (k.find("relative_attention_bias") != std::string::npos) ++bias_tables;
  }
  EXPECT_EQ(bias_tables, 1);
  EXPECT_EQ(keys.count("encoder.embed_tokens.weight"), 0u);
  EXPECT_EQ(keys.size(), 219u);
}

// A head width that differs from d_model / heads (t5-v1_1-small: 512, 6 x 64).
TEST(T5Encoder, InnerWidthIsHeadsTimesDkv) {
  T5Encoder model(micro().init(torch::kMeta));
  const auto keys = shoestring::testing::module_keys(*model);
  shoestring::testing::expect_shape(keys, "encoder.block.2.layer.0.SelfAttention.q.weight", {24, 32});
  shoestring::testing::expect_shape(keys, "encoder.block.2.layer.0.SelfAttention.o.weight", {32, 24});
}

// ---- relative position buckets ---------------------------------------------------

// The research note (models-next.md 3.3): first |key - query| of each bucket
// with 32 buckets and max_distance 128; keys after the query add 16.
TEST(T5Encoder, BucketsMatchTheResearchNoteTable) {
  for (int64_t r = 0; r < 8; ++r) {
    EXPECT_EQ(bucket(-r), r);
    if (r > 0) {
      EXPECT_EQ(bucket(r), r + 16);
    }
  }
  const std::vector<std::pair<int64_t, int64_t>> firsts = {{8, 8},   {12, 9},  {16, 10}, {23, 11},
                                                           {32, 12}, {46, 13}, {64, 14}, {91, 15}};
  for (const auto& [distance, b] : firsts) {
    EXPECT_EQ(bucket(-distance), b) << distance;
    EXPECT_EQ(bucket(distance), b + 16) << distance;
    EXPECT_EQ(bucket(-(distance - 1)), b - 1) << distance;  // the first distance of its bucket
    EXPECT_EQ(bucket(distance - 1), b + 15) << distance;
  }
  // Beyond max_distance everything shares the last bucket of its side.
  for (int64_t r : {127, 128, 129, 500, 100000}) {
    EXPECT_EQ(bucket(-r), 15) << r;
    EXPECT_EQ(bucket(r), 31) << r;
  }
  // Shape and dtype follow the input.
  const torch::Tensor grid = torch::arange(-3, 3, torch::kInt).view({2, 3});
  const torch::Tensor b = models::t5_relative_position_bucket(grid, 32, 128);
  EXPECT_EQ(b.sizes(), grid.sizes());
  EXPECT_EQ(b.scalar_type(), torch::kLong);
  EXPECT_THROW(models::t5_relative_position_bucket(grid.to(torch::kFloat32), 32, 128), Error);
  EXPECT_THROW(models::t5_relative_position_bucket(grid, 2, 128), Error);
  EXPECT_THROW(models::t5_relative_position_bucket(grid, 32, 8), Error);
}

// Every relative position in [-300, 300] for three bucket settings, against
// the reference's float64 formula (which the generator checked against float32).
TEST(T5Encoder, BucketsMatchPythonReference) {
  const auto ref = shoestring::testing::load_case("t5_micro");
  const torch::Tensor r = torch::arange(-300, 301, torch::kLong);
  for (const auto& [nb, md] : std::vector<std::pair<int64_t, int64_t>>{{32, 128}, {16, 24}, {8, 20}}) {
    const torch::Tensor expected = ref.at(fmt::format("buckets.{}.{}", nb, md)).to(torch::kLong);
    EXPECT_TRUE(torch::equal(models::t5_relative_position_bucket(r, nb, md), expected)) << nb << " " << md;
  }
}

// ---- numerics against the independent PyTorch reference ------------------------

TEST(T5Encoder, MatchesPyTorchReferenceInFp32) {
  torch::NoGradGuard no_grad;
  T5Encoder model = loaded_micro();
  const auto ref = shoestring::testing::load_case("t5_micro");
  const torch::Tensor ids = ref.at("input.ids").to(torch::kLong);  // [2, 140]
  const torch::Tensor mask = ref.at("input.attention_mask").to(torch::kLong);
  ASSERT_EQ(ids.size(1), 140);  // > max_distance 128: the clamp to the last bucket is reached
  const torch::Tensor plain = model->forward(ids);
  const torch::Tensor masked = model->forward(ids, mask);
  EXPECT_EQ(plain.scalar_type(), torch::kFloat32);
  EXPECT_EQ(plain.sizes(), (std::vector<int64_t>{2, 140, 32}));
  const double d_plain = max_diff(plain, ref.at("last_hidden"));
  const double d_masked = max_diff(masked, ref.at("last_hidden_masked"));
  std::cout << "t5_micro fp32: largest difference to the PyTorch reference " << d_plain << " (no mask), " << d_masked
            << " (mask)\n";
  EXPECT_LT(d_plain, 1e-5);
  EXPECT_LT(d_masked, 1e-5);
  // The mask matters for the padded row only; a bool mask works the same.
  EXPECT_GT(max_diff(plain[1], masked[1]), 1e-2);
  EXPECT_LT(max_diff(plain[0], masked[0]), 1e-6);
  EXPECT_LT(max_diff(model->forward(ids, mask.to(torch::kBool)), masked), 1e-7);
  // The comparison can fail: with 1/sqrt(d_kv) scaling the outputs are far off.
  {
    T5Encoder scaled = loaded_micro();
    for (size_t i = 0; i < scaled->blocks->size(); ++i)
      scaled->blocks->at<models::T5BlockImpl>(i).q->weight.mul_(1.0 / std::sqrt(6.0));
    EXPECT_GT(max_diff(scaled->forward(ids), ref.at("last_hidden")), 1e-2);
  }
}

TEST(T5Encoder, OtherBucketSettingsMatchPyTorchReference) {
  torch::NoGradGuard no_grad;
  T5Encoder model(micro_b());
  models::load_t5_encoder_weights(*model, WeightFiles::open(data("t5_micro_b.safetensors")), "");
  const auto ref = shoestring::testing::load_case("t5_micro_b");
  const double d = max_diff(model->forward(ref.at("input.ids").to(torch::kLong)), ref.at("last_hidden"));
  std::cout << "t5_micro_b fp32: largest difference " << d << "\n";
  EXPECT_LT(d, 1e-5);
}

// bf16 weights and activations (the model cast), and fp32 weights inside a
// bf16 compute block: close to the fp32 reference within bf16's precision.
TEST(T5Encoder, RunsInBf16) {
  torch::NoGradGuard no_grad;
  const auto ref = shoestring::testing::load_case("t5_micro");
  const torch::Tensor ids = ref.at("input.ids").to(torch::kLong);
  const torch::Tensor mask = ref.at("input.attention_mask").to(torch::kLong);
  T5Encoder model = loaded_micro();
  models::cast_t5_encoder(*model, torch::kBFloat16);
  for (const auto& p : model->parameters()) EXPECT_EQ(p.scalar_type(), torch::kBFloat16);
  const torch::Tensor out = model->forward(ids, mask);
  EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
  const double d_cast = max_diff(out, ref.at("last_hidden_masked"));

  T5Encoder guarded = loaded_micro();
  torch::Tensor out_guard;
  {
    nn::ComputeDtypeGuard bf16(torch::kBFloat16);
    out_guard = guarded->forward(ids, mask);
  }
  EXPECT_EQ(out_guard.scalar_type(), torch::kBFloat16);
  const double d_guard = max_diff(out_guard, ref.at("last_hidden_masked"));

  // HF's fp16 recipe with bf16: wo kept in fp32, the residual stream fp32 after it.
  T5Encoder keep = loaded_micro();
  models::cast_t5_encoder(*keep, torch::kBFloat16, /*keep_wo_fp32=*/true);
  EXPECT_EQ(keep->blocks->at<models::T5BlockImpl>(0).wo->weight.scalar_type(), torch::kFloat32);
  EXPECT_EQ(keep->blocks->at<models::T5BlockImpl>(0).wi_0->weight.scalar_type(), torch::kBFloat16);
  const torch::Tensor out_keep = keep->forward(ids, mask);
  EXPECT_EQ(out_keep.scalar_type(), torch::kBFloat16);
  const double d_keep = max_diff(out_keep, ref.at("last_hidden_masked"));
  std::cout << "t5_micro bf16: largest difference to the fp32 reference " << d_cast << " (bf16 weights), " << d_guard
            << " (bf16 compute block), " << d_keep << " (wo fp32)\n";
  // Outputs are RMS-normed (|x| up to ~4, bf16 spacing 2^-6 at 2..4): rounding the weights to bf16
  // alone moves the float64 reference by 0.055; bf16 arithmetic adds a little.
  EXPECT_LT(d_cast, 0.1);
  EXPECT_LT(d_guard, 0.1);
  EXPECT_LT(d_keep, 0.1);
  EXPECT_GT(d_cast, 0.0);  // it did compute in bf16

  // fp16 has no CPU kernels in libtorch 1.13: refused with a clear error.
  T5Encoder half = loaded_micro();
  models::cast_t5_encoder(*half, torch::kHalf);
  EXPECT_NE(shoestring::testing::error_of([&] { half->forward(ids); }).find("fp16"), std::string::npos);
  EXPECT_THROW(models::cast_t5_encoder(*half, torch::kLong), Error);
}

// ---- loading -------------------------------------------------------------------

// SD3's incl_clips single file: the encoder under text_encoders.t5xxl.transformer.,
// beside other models' tensors, with the tied embed_tokens copy instead of shared.
TEST(T5Encoder, LoadsSd3PrefixAndEmbedTokensAlias) {
  shoestring::testing::TempDir dir;
  torch::NoGradGuard no_grad;
  const auto ref = shoestring::testing::load_case("t5_micro");
  const torch::Tensor ids = ref.at("input.ids").to(torch::kLong);
  const std::string sd3 = dir.file("sd3_incl_clips.safetensors");
  write_variant(sd3, models::kSd3T5xxlPrefix, /*shared_as_embed_tokens=*/true,
                {{"model.diffusion_model.x_embedder.proj.weight", torch::zeros({2, 2})},
                 {"text_encoders.clip_l.transformer.text_model.final_layer_norm.weight", torch::ones({3})}});
  T5Encoder model(micro());
  const LoadWeightsReport report = models::load_t5_encoder_weights(*model, WeightFiles::open(sd3));  // prefix found
  EXPECT_EQ(report.loaded, static_cast<int64_t>(model->parameters().size()));
  EXPECT_LT(max_diff(model->forward(ids), ref.at("last_hidden")), 1e-5);
  T5Encoder explicit_prefix(micro());
  models::load_t5_encoder_weights(*explicit_prefix, WeightFiles::open(sd3), models::kSd3T5xxlPrefix);
  EXPECT_LT(max_diff(explicit_prefix->forward(ids), ref.at("last_hidden")), 1e-5);

  // A whole T5ForConditionalGeneration file: both copies of the embedding
  // (shared.weight wins), decoder and lm_head ignored.
  const std::string full = dir.file("t5_full.safetensors");
  write_variant(full, "", false,
                {{"encoder.embed_tokens.weight", torch::zeros({64, 32})},
                 {"decoder.block.0.layer.0.SelfAttention.q.weight", torch::zeros({24, 32})},
                 {"decoder.embed_tokens.weight", torch::zeros({64, 32})},
                 {"lm_head.weight", torch::zeros({64, 32})}});
  T5Encoder bare(micro());
  models::load_t5_encoder_weights(*bare, WeightFiles::open(full));
  EXPECT_LT(max_diff(bare->forward(ids), ref.at("last_hidden")), 1e-5);
}

TEST(T5Encoder, LoadErrorsNameTheFileAndTensor) {
  shoestring::testing::TempDir dir;
  const std::string prefix = models::kSd3T5xxlPrefix;
  auto load = [&](const std::string& path) {
    return shoestring::testing::error_of([&] {
      T5Encoder model(micro());
      models::load_t5_encoder_weights(*model, WeightFiles::open(path));
    });
  };
  // A missing block tensor.
  std::vector<NamedTensor> tensors;
  for (const auto& [key, t] : load_safetensors(data("t5_micro.safetensors"))) {
    if (key != "encoder.block.1.layer.1.DenseReluDense.wo.weight") tensors.push_back({prefix + key, t, {}});
  }
  const std::string missing = dir.file("missing_wo.safetensors");
  save_safetensors(missing, tensors);
  std::string e = load(missing);
  EXPECT_NE(e.find("missing_wo.safetensors"), std::string::npos) << e;
  EXPECT_NE(e.find(prefix + "encoder.block.1.layer.1.DenseReluDense.wo.weight"), std::string::npos) << e;

  // Neither shared.weight nor its alias.
  tensors.clear();
  for (const auto& [key, t] : load_safetensors(data("t5_micro.safetensors"))) {
    if (key != "shared.weight") tensors.push_back({key, t, {}});
  }
  const std::string no_embedding = dir.file("no_embedding.safetensors");
  save_safetensors(no_embedding, tensors);
  e = load(no_embedding);
  EXPECT_NE(e.find("shared.weight"), std::string::npos) << e;
  EXPECT_NE(e.find("encoder.embed_tokens.weight"), std::string::npos) << e;

  // A file of another width (the micro_b encoder into the micro model): shape mismatches named.
  e = shoestring::testing::error_of([&] {
    T5Encoder model(micro());
    models::load_t5_encoder_weights(*model, WeightFiles::open(data("t5_micro_b.safetensors")), "");
  });
  EXPECT_NE(e.find("t5_micro_b.safetensors"), std::string::npos) << e;
  EXPECT_NE(e.find("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight (file 16x2, model 32x4)"),
            std::string::npos)
      << e;

  // An unknown tensor under the prefix; a prefix that matches nothing.
  const std::string extra = dir.file("extra.safetensors");
  write_variant(extra, "", false, {{"encoder.block.0.layer.2.something.weight", torch::zeros({2})}});
  e = load(extra);
  EXPECT_NE(e.find("encoder.block.0.layer.2.something.weight"), std::string::npos) << e;
  e = shoestring::testing::error_of([&] {
    T5Encoder model(micro());
    models::load_t5_encoder_weights(*model, WeightFiles::open(data("t5_micro.safetensors")), prefix);
  });
  EXPECT_NE(e.find("no tensor starts with"), std::string::npos) << e;

  // NaN in a weight; a meta model.
  tensors.clear();
  for (const auto& [key, t] : load_safetensors(data("t5_micro.safetensors"))) {
    tensors.push_back({key, key == "encoder.final_layer_norm.weight" ? t.clone().fill_(NAN) : t, {}});
  }
  const std::string nan = dir.file("nan.safetensors");
  save_safetensors(nan, tensors);
  e = load(nan);
  EXPECT_NE(e.find("encoder.final_layer_norm.weight"), std::string::npos) << e;
  T5Encoder meta(micro().init(torch::kMeta));
  EXPECT_THROW(models::load_t5_encoder_weights(*meta, WeightFiles::open(data("t5_micro.safetensors"))), Error);
}

// ---- inputs and options ------------------------------------------------------------

TEST(T5Encoder, RejectsBadInputsAndOptions) {
  torch::NoGradGuard no_grad;
  T5Encoder model(T5EncoderOptions::tiny());
  const torch::Tensor ids = torch::ones({2, 5}, torch::kLong);
  EXPECT_EQ(model->forward(ids).sizes(), (std::vector<int64_t>{2, 5, 32}));
  EXPECT_THROW(model->forward(ids.to(torch::kFloat32)), Error);
  EXPECT_THROW(model->forward(torch::ones({5}, torch::kLong)), Error);
  EXPECT_THROW(model->forward(torch::ones({2, 0}, torch::kLong)), Error);
  EXPECT_NE(shoestring::testing::error_of([&] {
              model->forward(torch::full({1, 3}, 64, torch::kLong));
            }).find("64"),
            std::string::npos);
  EXPECT_THROW(model->forward(torch::full({1, 3}, -1, torch::kLong)), Error);
  EXPECT_THROW(model->forward(ids, torch::ones({2, 4})), Error);     // mask shape
  EXPECT_THROW(model->forward(ids, torch::full({2, 5}, 2)), Error);  // mask values
  EXPECT_NO_THROW(model->forward(ids, torch::zeros({2, 5})));        // all padding: no keys left, still finite
  EXPECT_TRUE(torch::isfinite(model->forward(ids, torch::zeros({2, 5}))).all().item<bool>());
  EXPECT_THROW(T5Encoder(T5EncoderOptions::tiny().num_buckets(2)), Error);
  EXPECT_THROW(T5Encoder(T5EncoderOptions::tiny().max_distance(8)), Error);
  EXPECT_THROW(T5Encoder(T5EncoderOptions::tiny().d_kv(0)), Error);
}

TEST(T5Encoder, TinyIsSmallAndXxlIsTheRelease) {
  const T5EncoderOptions t = T5EncoderOptions::tiny();
  EXPECT_EQ(t.vocab_size(), 64);
  EXPECT_EQ(t.d_model(), 32);
  EXPECT_EQ(t.num_heads() * t.d_kv(), 32);
  EXPECT_EQ(t.d_ff(), 48);
  EXPECT_EQ(t.num_layers(), 2);
  const T5EncoderOptions x = T5EncoderOptions::xxl();
  EXPECT_EQ(x.vocab_size(), 32128);
  EXPECT_EQ(x.num_buckets(), 32);
  EXPECT_EQ(x.max_distance(), 128);
  EXPECT_DOUBLE_EQ(x.eps(), 1e-6);
}
