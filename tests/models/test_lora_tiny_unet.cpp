// LoRA (nn/lora.h) on the TinyUNet: kohya names of its module tree, forward
// unchanged at initialisation, trained adapters equal to merged weights
// (checked against the explicit formula), gradient checkpointing.
#include <gtest/gtest.h>

#include <set>

#include <torch/torch.h>

#include "model_testing.h"
#include "shoestring/models/tiny_unet.h"
#include "shoestring/nn/lora.h"

using namespace shoestring;
using namespace shoestring::models;
using shoestring::nn::LoraNetwork;
using shoestring::nn::LoraOptions;

namespace {

TinyUNetOptions small_options() { return shoestring::testing::small_tiny_unet_options(); }

// conv_out and the ResBlocks' conv2 start at zero; perturb everything so the
// output depends on every layer.
TinyUNet perturbed_unet(uint64_t seed) {
  torch::manual_seed(seed);
  TinyUNet unet(small_options());
  torch::NoGradGuard no_grad;
  for (auto& p : unet->parameters()) p.add_(torch::randn_like(p) * 0.05);
  return unet;
}

struct Inputs {
  torch::Tensor x, t, ctx;
};

Inputs inputs(uint64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({2, 3, 8, 8}), torch::rand({2}), torch::randn({2, 5, 12})};
}

const std::vector<nn::LoraComponent> kUnetOnly = {{"lora_unet", ""}};

}  // namespace

TEST(LoraTinyUNet, KohyaNames) {
  TinyUNet unet(small_options());
  LoraNetwork attn_only(*unet, kUnetOnly, LoraOptions{});
  std::set<std::string> names;
  for (const auto& m : attn_only->modules()) names.insert(m->layer().kohya_name);
  // 4 SpatialTransformers (down.1, mid, up.1 x2) x (attn1, attn2) x (q, k, v, out).
  EXPECT_EQ(names.size(), 32u);
  for (const char* n : {"lora_unet_down_1_attn_0_blocks_0_attn1_to_q", "lora_unet_down_1_attn_0_blocks_0_attn2_to_k",
                        "lora_unet_mid_attn_blocks_0_attn2_to_out", "lora_unet_up_1_attn_1_blocks_0_attn1_to_v"}) {
    EXPECT_TRUE(names.count(n)) << n;
  }
  EXPECT_EQ(attn_only->find("lora_unet_mid_attn_blocks_0_attn1_to_q")->layer().path, "mid.attn.blocks.0.attn1.to_q");
  attn_only->detach();

  LoraOptions o;
  o.feed_forward = true;
  o.conv_rank = 2;
  LoraNetwork all(*unet, kUnetOnly, o);
  std::map<std::string, int64_t> ranks;
  for (const auto& m : all->modules()) ranks[m->layer().kohya_name] = m->rank();
  EXPECT_EQ(ranks.at("lora_unet_down_0_res_0_conv1"), 2);
  EXPECT_EQ(ranks.at("lora_unet_down_0_downsample"), 2);
  EXPECT_EQ(ranks.at("lora_unet_up_1_upsample"), 2);
  EXPECT_EQ(ranks.at("lora_unet_up_0_res_0_conv_shortcut"), 4);  // 1x1: network_dim
  EXPECT_EQ(ranks.at("lora_unet_mid_attn_proj_in"), 4);
  EXPECT_EQ(ranks.at("lora_unet_mid_attn_blocks_0_ff_proj"), 4);
  EXPECT_EQ(ranks.at("lora_unet_mid_attn_blocks_0_ff_out"), 4);
  EXPECT_FALSE(ranks.count("lora_unet_conv_in"));
  EXPECT_FALSE(ranks.count("lora_unet_conv_out"));
  EXPECT_FALSE(ranks.count("lora_unet_time_embed_linear_1"));
  EXPECT_TRUE(all->not_adaptable().empty()) << all->not_adaptable()[0];
}

TEST(LoraTinyUNet, ForwardEqualsBaseAtInit) {
  TinyUNet unet = perturbed_unet(1);
  Inputs in = inputs(2);
  torch::NoGradGuard no_grad;
  torch::Tensor base = unet->forward(in.x, in.t, in.ctx);
  LoraOptions o;
  o.feed_forward = true;
  o.conv_rank = 4;
  LoraNetwork net(*unet, kUnetOnly, o);
  EXPECT_GT(net->modules().size(), 40u);
  EXPECT_TRUE(torch::equal(unet->forward(in.x, in.t, in.ctx), base));  // up = 0
  // Every adapter took part (no layer's forward is bypassed by the model).
  EXPECT_EQ(net->never_called(), std::vector<std::string>{});
}

TEST(LoraTinyUNet, TrainedAdaptersEqualMergedWeights) {
  TinyUNet unet = perturbed_unet(3);
  Inputs in = inputs(4);
  torch::Tensor target = torch::randn({2, 3, 8, 8});
  torch::Tensor before;
  {
    torch::NoGradGuard no_grad;
    before = unet->forward(in.x, in.t, in.ctx);
  }
  nn::freeze_parameters(*unet);
  std::map<std::string, torch::Tensor> base;
  for (const auto& p : unet->named_parameters()) base[p.key()] = p.value().clone();

  LoraOptions o;
  o.rank = 3;
  o.alpha = 2.0;
  o.multiplier = 0.8;
  o.feed_forward = true;
  o.conv_rank = 2;
  o.conv_alpha = 4.0;
  LoraNetwork net(*unet, kUnetOnly, o);
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    torch::Tensor loss = torch::mse_loss(unet->forward(in.x, in.t, in.ctx), target);
    loss.backward();
    ASSERT_TRUE(std::isfinite(loss.item<double>()));
    opt.step();
  }
  // Base weights: untouched bit for bit, no gradients.
  for (const auto& p : unet->named_parameters()) {
    EXPECT_TRUE(torch::equal(p.value(), base[p.key()])) << p.key();
    EXPECT_FALSE(p.value().grad().defined()) << p.key();
  }
  for (const auto& m : net->modules()) EXPECT_GT(m->up().abs().max().item<float>(), 0.0f) << m->layer().kohya_name;

  torch::NoGradGuard no_grad;
  torch::Tensor adapted = unet->forward(in.x, in.t, in.ctx);
  EXPECT_GT((adapted - before).abs().max().item<float>(), 1e-3);

  // Expected merged weights by the explicit formula W + multiplier * alpha / rank * up @ down
  // (3x3 convs: kohya's conv2d(down^T, up)^T composition), in float64.
  std::map<std::string, torch::Tensor> expected;
  for (const auto& m : net->modules()) {
    torch::Tensor up = m->up().to(torch::kFloat64), down = m->down().to(torch::kFloat64);
    torch::Tensor dw =
        down.dim() == 2 ? torch::matmul(up, down) : torch::conv2d(down.permute({1, 0, 2, 3}), up).permute({1, 0, 2, 3});
    const double alpha = m->rank() == 2 && down.dim() == 4 && down.size(2) == 3 ? 4.0 : 2.0;
    expected[m->layer().path + ".weight"] =
        base[m->layer().path + ".weight"].to(torch::kFloat64) + 0.8 * alpha / m->rank() * dw;
  }
  EXPECT_EQ(net->merge(), static_cast<int64_t>(expected.size()));
  auto params = unet->named_parameters();
  for (const auto& [key, w] : expected) {
    EXPECT_TRUE(torch::allclose(params[key].to(torch::kFloat64), w, 1e-6, 1e-6)) << key;
  }
  torch::Tensor merged = unet->forward(in.x, in.t, in.ctx);  // plain model, merged weights
  EXPECT_TRUE(torch::allclose(merged, adapted, 1e-4, 1e-5)) << (merged - adapted).abs().max();
}

TEST(LoraTinyUNet, GradientCheckpointingGivesTheSameAdapterGradients) {
  TinyUNet unet = perturbed_unet(5);
  nn::freeze_parameters(*unet);
  Inputs in = inputs(6);
  LoraOptions o;
  o.conv_rank = 2;
  LoraNetwork net(*unet, kUnetOnly, o);
  torch::manual_seed(7);
  {
    torch::NoGradGuard no_grad;
    for (auto& p : net->parameters()) p.normal_(0.0, 0.1);
  }
  unet->train();
  auto grads = [&](bool checkpointing) {
    shoestring::testing::checkpoint_by_rule(*unet, checkpointing);
    for (auto& p : net->parameters()) p.mutable_grad().reset();
    unet->forward(in.x, in.t, in.ctx).pow(2).mean().backward();
    std::vector<torch::Tensor> g;
    for (auto& p : net->parameters()) g.push_back(p.grad().clone());
    return g;
  };
  auto plain = grads(false), ckpt = grads(true);
  ASSERT_EQ(plain.size(), ckpt.size());
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_GT(plain[i].abs().sum().item<float>(), 0.0f) << i;
    EXPECT_TRUE(torch::allclose(plain[i], ckpt[i], 1e-5, 1e-7)) << i;
  }
}
