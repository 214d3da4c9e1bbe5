// Stable Cascade stage C: the released key layout and parameter counts (on
// the meta device), the forward pass against PyTorch, and a few CPU training
// steps of the tiny variant.
//
// Reference data: scripts/gen_dit_reference.py writes tests/data/models/
// cascade-c.keys.txt and cascade-c-lite.keys.txt (every tensor name and shape,
// from the module layout of Stability-AI/StableCascade modules/stage_c.py with
// torch.nn's own layer names) and cascade_small.{json,bin} (a small stage C
// run in PyTorch, attention by torch.nn.MultiheadAttention).
#include <unistd.h>
#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <unordered_set>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <torch/torch.h>
#include "../nn/graph_testing.h"

#include "model_testing.h"
#include "shoestring/core/error.h"
#include "shoestring/models/cascade.h"

using namespace shoestring;
using models::StageC;
using models::StageCOptions;

namespace {

using shoestring::testing::load_case;
using shoestring::testing::load_keys;
using shoestring::testing::module_keys;
using shoestring::testing::resident_bytes;

// The configuration of cascade_small in scripts/gen_dit_reference.py.
StageCOptions small_options() {
  return StageCOptions()
      .r_dim(16)
      .cond_dim(24)
      .hidden({16, 24})
      .heads({2, 3})
      .down_blocks({1, 2})
      .up_blocks({2, 1})
      .clip_text_dim(20)
      .clip_text_pooled_dim(12)
      .clip_image_dim(10)
      .clip_seq(2)
      .dropout(0.0);
}

using shoestring::testing::expect_shape;

using shoestring::testing::count_graph_nodes;

}  // namespace

// Exact counts of the released files. No public source states them to the
// parameter; they follow from the published architecture (StableCascade
// modules/stage_c.py, defaults = stabilityai/stable-cascade-prior
// prior/config.json; lite = train/train_c.py "1B" = prior_lite/config.json)
// and agree with the published rounded figures: "3.6B" / "1B" (model card)
// and the file sizes stage_c.safetensors 14.4 GB (fp32: 4 x 3,589,103,632 B),
// stage_c_bf16 7.18 GB, stage_c_lite 4.12 GB, stage_c_lite_bf16 2.06 GB
// (huggingface.co/stabilityai/stable-cascade file listing).
TEST(StageC, ReleasedParameterCountsOnMeta) {
  const int64_t before = resident_bytes();
  StageC big = models::build_cascade_c(nn::LayerInit{torch::kMeta});
  StageC lite = models::build_cascade_c_lite(nn::LayerInit{torch::kMeta});
  EXPECT_EQ(nn::parameter_count(*big), 3589103632LL);
  EXPECT_EQ(nn::parameter_count(*lite), 1030785040LL);
  // 3.6B fp32 would be 14 GB: the meta build must not allocate it.
  for (const auto& p : big->parameters()) ASSERT_TRUE(p.is_meta());
  EXPECT_LT(resident_bytes() - before, int64_t{256} << 20);
}

TEST(StageC, KeysAndShapesMatchReleasedLayout) {
  for (const auto& [name, opts] : {std::pair<std::string, StageCOptions>{"cascade-c", StageCOptions::cascade_c()},
                                   {"cascade-c-lite", StageCOptions::cascade_c_lite()}}) {
    StageC net(opts, nn::LayerInit{torch::kMeta});
    const auto expected = load_keys(name);
    const auto actual = module_keys(*net);
    EXPECT_EQ(actual.size(), expected.size()) << name;
    for (const auto& [key, shape] : expected) {
      auto it = actual.find(key);
      if (it == actual.end()) {
        ADD_FAILURE() << name << ": missing " << key;
      } else {
        EXPECT_EQ(it->second, shape) << name << ": " << key;
      }
    }
    for (const auto& kv : actual) EXPECT_TRUE(expected.count(kv.first)) << name << ": unexpected " << kv.first;
  }
}

// A handful of keys written out by hand from modules/stage_c.py + common.py
// (3.6B: 8 + 24 CTA triples down, 24 + 8 up; block 3k is C, 3k+1 T, 3k+2 A).
TEST(StageC, SpotCheckReleasedKeys) {
  StageC net = models::build_cascade_c(nn::LayerInit{torch::kMeta});
  const auto keys = module_keys(*net);
  expect_shape(keys, "clip_txt_mapper.weight", {2048, 1280});
  expect_shape(keys, "clip_txt_pooled_mapper.weight", {8192, 1280});
  expect_shape(keys, "clip_img_mapper.bias", {8192});
  expect_shape(keys, "embedding.1.weight", {2048, 16, 1, 1});
  expect_shape(keys, "down_blocks.0.0.depthwise.weight", {2048, 1, 3, 3});
  expect_shape(keys, "down_blocks.0.0.channelwise.0.weight", {8192, 2048});
  expect_shape(keys, "down_blocks.0.0.channelwise.2.gamma", {1, 1, 1, 8192});
  expect_shape(keys, "down_blocks.0.0.channelwise.4.weight", {2048, 8192});
  expect_shape(keys, "down_blocks.0.1.mapper_crp.weight", {4096, 64});
  expect_shape(keys, "down_blocks.0.2.attention.attn.in_proj_weight", {6144, 2048});
  expect_shape(keys, "down_blocks.0.2.attention.attn.out_proj.bias", {2048});
  expect_shape(keys, "down_blocks.0.2.kv_mapper.1.weight", {2048, 2048});
  expect_shape(keys, "down_blocks.1.71.attention.attn.in_proj_bias", {6144});
  expect_shape(keys, "down_downscalers.1.1.blocks.0.weight", {2048, 2048, 1, 1});
  expect_shape(keys, "up_upscalers.0.1.blocks.1.weight", {2048, 2048, 1, 1});
  expect_shape(keys, "up_blocks.1.0.channelwise.0.weight", {8192, 4096});  // skip connection
  expect_shape(keys, "up_blocks.1.3.channelwise.0.weight", {8192, 2048});
  expect_shape(keys, "up_blocks.0.71.kv_mapper.1.bias", {2048});
  expect_shape(keys, "clf.1.weight", {16, 2048, 1, 1});
  EXPECT_FALSE(keys.count("down_blocks.0.24.depthwise.weight"));
  EXPECT_FALSE(keys.count("up_blocks.1.24.depthwise.weight"));
}

TEST(StageC, ForwardMatchesPyTorchReference) {
  auto ref = load_case("cascade_small");
  StageC net(small_options());
  net->eval();
  {
    torch::NoGradGuard no_grad;
    size_t n = 0;
    for (auto& p : net->named_parameters()) {
      auto it = ref.find("param." + p.key());
      ASSERT_NE(it, ref.end()) << p.key();
      ASSERT_EQ(it->second.sizes(), p.value().sizes()) << p.key();
      p.value().copy_(it->second);
      ++n;
    }
    size_t in_ref = 0;
    for (const auto& kv : ref) in_ref += kv.first.rfind("param.", 0) == 0;
    EXPECT_EQ(n, in_ref);
  }
  torch::Tensor out = net->forward(ref.at("input.x"), ref.at("input.r"), ref.at("input.clip_text"),
                                   ref.at("input.clip_text_pooled"), ref.at("input.clip_img"), {ref.at("input.sca")});
  ASSERT_EQ(out.sizes(), ref.at("output").sizes());
  EXPECT_TRUE(torch::allclose(out, ref.at("output"), 3e-5, 3e-5))
      << "max abs diff " << (out - ref.at("output")).abs().max().item<float>();
}

TEST(StageC, TinyVariantTrainsOnCpu) {
  torch::manual_seed(0);
  StageC net(StageCOptions::tiny());
  EXPECT_LT(nn::parameter_count(*net), 2'000'000);
  const int64_t B = 2;
  torch::Tensor x0 = torch::randn({B, 16, 8, 8}), noise = torch::randn({B, 16, 8, 8});
  torch::Tensor r = torch::tensor({0.3f, 0.7f});
  torch::Tensor xt = (1 - r).view({B, 1, 1, 1}) * x0 + r.view({B, 1, 1, 1}) * noise;
  torch::Tensor text = torch::randn({B, 8, 32}), pooled = torch::randn({B, 1, 32}), img = torch::randn({B, 1, 32});
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.0));
  std::vector<float> losses;
  for (int step = 0; step < 12; ++step) {
    torch::Tensor loss = torch::mse_loss(net->forward(xt, r, text, pooled, img), noise);
    opt.zero_grad();
    loss.backward();
    opt.step();
    losses.push_back(loss.item<float>());
    ASSERT_TRUE(std::isfinite(losses.back())) << "step " << step;
  }
  EXPECT_LT(losses.back(), 0.8f * losses.front()) << losses.front() << " -> " << losses.back();
}

TEST(StageC, TinyVariantRunsInBf16) {
  torch::manual_seed(3);
  StageC net(StageCOptions::tiny());
  {
    torch::NoGradGuard no_grad;  // make the zero-initialised output conv and mappers non-trivial
    for (auto& p : net->parameters()) p.add_(torch::randn_like(p) * 0.02);
  }
  torch::Tensor x = torch::randn({1, 16, 6, 6}), r = torch::rand({1});
  torch::Tensor text = torch::randn({1, 4, 32}), pooled = torch::randn({1, 1, 32}), img = torch::randn({1, 32});
  torch::NoGradGuard no_grad;
  torch::Tensor ref = net->forward(x, r, text, pooled, img);
  net->to(torch::kBFloat16);
  torch::Tensor out = net->forward(x.to(torch::kBFloat16), r, text.to(torch::kBFloat16), pooled.to(torch::kBFloat16),
                                   img.to(torch::kBFloat16));
  EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
  const float scale = ref.abs().max().item<float>();
  EXPECT_LT((out.to(torch::kFloat32) - ref).abs().max().item<float>(), 0.1f * scale + 1e-3f);
}

TEST(StageC, RejectsBadInputsAndOptions) {
  StageC net(StageCOptions::tiny());
  torch::Tensor x = torch::randn({1, 16, 4, 4}), r = torch::rand({1});
  torch::Tensor text = torch::randn({1, 3, 32}), pooled = torch::randn({1, 1, 32}), img = torch::randn({1, 1, 32});
  EXPECT_THROW(net->forward(torch::randn({1, 8, 4, 4}), r, text, pooled, img), Error);
  EXPECT_THROW(net->forward(x, torch::rand({2}), text, pooled, img), Error);
  EXPECT_THROW(net->forward(x, r, torch::randn({1, 3, 768}), pooled, img), Error);
  EXPECT_THROW(net->forward(x, r, text, pooled, torch::randn({1, 1, 1280})), Error);
  EXPECT_THROW(net->forward(x, r, text, pooled, img, {r, r, r}), Error);
  EXPECT_THROW(StageC(StageCOptions::tiny().level_config({"CTX", "CTA"})), Error);
  EXPECT_THROW(StageC(StageCOptions::tiny().heads({3, 2})), Error);
  EXPECT_THROW(StageC(StageCOptions::tiny().down_blocks({1})), Error);
}

// Options the releases do not use: resampling between levels, block repeats
// with their 1x1 repeat mappers, FeedForwardBlocks, patch size 2; with an odd
// latent size the up path resizes to the skip connection.
TEST(StageC, ResamplingRepeatsAndPatchesRun) {
  torch::manual_seed(6);
  StageC net(
      StageCOptions::tiny().patch_size(2).switch_level({true}).down_repeat({2, 1}).up_repeat({1, 3}).level_config(
          {"CTAF", "CTA"}));
  const auto keys = module_keys(*net);
  expect_shape(keys, "down_repeat_mappers.0.0.weight", {32, 32, 1, 1});
  expect_shape(keys, "up_repeat_mappers.1.1.bias", {32});
  EXPECT_FALSE(keys.count("up_repeat_mappers.1.2.bias"));
  expect_shape(keys, "down_blocks.0.3.channelwise.2.beta", {1, 1, 1, 128});
  expect_shape(keys, "embedding.1.weight", {32, 64, 1, 1});
  expect_shape(keys, "clf.1.weight", {64, 32, 1, 1});
  {
    torch::NoGradGuard no_grad;
    for (auto& p : net->parameters()) p.add_(torch::randn_like(p) * 0.02);
  }
  torch::Tensor x = torch::randn({2, 16, 10, 14}, torch::requires_grad());
  torch::Tensor out = net->forward(x, torch::rand({2}), torch::randn({2, 3, 32}), torch::randn({2, 1, 32}),
                                   torch::randn({2, 1, 32}));
  EXPECT_EQ(out.sizes(), x.sizes());
  out.square().mean().backward();
  EXPECT_GT(x.grad().abs().sum().item<float>(), 0.0f);
}

// Checkpointed blocks give the gradients of the plain forward.
TEST(StageC, GradientCheckpointingKeepsGradients) {
  torch::manual_seed(7);
  StageC net(StageCOptions::tiny());
  {
    torch::NoGradGuard no_grad;
    for (auto& p : net->parameters()) p.add_(torch::randn_like(p) * 0.02);
  }
  torch::Tensor x = torch::randn({2, 16, 6, 6}), r = torch::rand({2});
  torch::Tensor text = torch::randn({2, 3, 32}), pooled = torch::randn({2, 1, 32}), img = torch::randn({2, 1, 32});
  auto grads = [&](bool ckpt) {
    shoestring::testing::checkpoint_by_rule(*net, ckpt);
    net->zero_grad();
    net->forward(x, r, text, pooled, img).square().mean().backward();
    std::vector<torch::Tensor> g;
    for (const auto& p : net->parameters()) g.push_back(p.grad().clone());
    return g;
  };
  const auto plain = grads(false), ckpt = grads(true);
  shoestring::testing::checkpoint_by_rule(*net, false);
  const size_t nodes_plain = count_graph_nodes(net->forward(x, r, text, pooled, img));
  shoestring::testing::checkpoint_by_rule(*net, true);
  EXPECT_LT(count_graph_nodes(net->forward(x, r, text, pooled, img)), nodes_plain / 2);
  ASSERT_EQ(plain.size(), ckpt.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::allclose(plain[i], ckpt[i], 1e-5, 1e-6)) << i;
}

// Activation rescaling (the fp16 fix) is the reference function: with every
// TimestepBlock of the last up group multiplying the stream by 1/4 (three
// TimestepBlocks, two repeats through a repeat mapper, a FeedForwardBlock
// and a skip-fed first ResBlock), output and weight gradients equal the
// unscaled model's, with and without checkpointed blocks (the recompute must
// see the scales of the first run).
TEST(StageC, ActivationRescaleKeepsTheFunction) {
  torch::manual_seed(8);
  StageC net(StageCOptions::tiny().up_blocks({1, 3}).up_repeat({1, 2}).level_config({"CTAF", "CTA"}));
  {
    torch::NoGradGuard no_grad;  // non-zero TimestepBlock mappers and output conv, and biases everywhere
    for (auto& p : net->parameters()) p.add_(torch::randn_like(p) * 0.05);
  }
  torch::Tensor x = torch::randn({2, 16, 6, 6}), r = torch::rand({2});
  torch::Tensor text = torch::randn({2, 3, 32}), pooled = torch::randn({2, 1, 32}), img = torch::randn({2, 1, 32});
  auto run = [&](double factor, bool ckpt) {
    net->set_activation_rescale(factor);
    shoestring::testing::checkpoint_by_rule(*net, ckpt);
    net->zero_grad();
    torch::Tensor out = net->forward(x, r, text, pooled, img);
    out.square().mean().backward();
    std::vector<torch::Tensor> g{out.detach()};
    for (const auto& p : net->parameters()) g.push_back(p.grad().clone());
    return g;
  };
  const auto plain = run(1.0, false);
  for (bool ckpt : {false, true}) {
    const auto scaled = run(0.25, ckpt);
    ASSERT_EQ(plain.size(), scaled.size());
    EXPECT_LT((plain[0] - scaled[0]).abs().max().item<float>(), 1e-5f * plain[0].abs().max().item<float>())
        << "checkpoint " << ckpt << ": max abs diff " << (plain[0] - scaled[0]).abs().max().item<float>();
    for (size_t i = 1; i < plain.size(); ++i)
      EXPECT_TRUE(torch::allclose(plain[i], scaled[i], 1e-3, 1e-6)) << "checkpoint " << ckpt << " parameter " << i;
  }
  // Inside the group the stream really is held smaller: a TimestepBlock
  // given the stream at scale 1/4 returns it at 1/16 (s_out (h (1 + a) + b)).
  {
    torch::NoGradGuard no_grad;
    auto& ts = *net->up_blocks->ptr<torch::nn::ModuleListImpl>(1)->ptr<models::CascadeTimestepBlockImpl>(1);
    torch::Tensor h = torch::randn({2, 32, 3, 3}) * 100, t = torch::randn({2, 64 * 3});
    torch::Tensor ref = ts.forward(h, t), scaled = ts.forward(h * 0.25, t, 0.25, 1.0 / 16);
    EXPECT_TRUE(torch::allclose(scaled * 16, ref, 1e-5, 1e-4));
    EXPECT_THROW(ts.forward(h, t, 0.0, 1.0), Error);
  }
  EXPECT_EQ(net->activation_rescale(), 0.25);
  EXPECT_THROW(net->set_activation_rescale(0.0), Error);
  EXPECT_THROW(net->set_activation_rescale(1.5), Error);
  EXPECT_THROW(net->set_activation_rescale(std::nan("")), Error);
  net->set_activation_rescale(1.0);
  shoestring::testing::checkpoint_by_rule(*net, false);
}
