// MMDiT-X (SD3.5 Medium): the released key layout and parameter count (on
// the meta device), grouped-query attention, the forward pass against
// PyTorch, and a few CPU training steps of the tiny variant.
//
// Reference data: scripts/gen_dit_reference.py writes tests/data/models/
// sd35m.keys.txt (every MMDiT tensor of sd3.5_medium.safetensors below
// "model.diffusion_model.", from the module layout of Stability-AI/sd3.5
// mmditx.py) and mmdit_small{,_gqa}.{json,bin} (a small MMDiT-X run in
// PyTorch; grouped-query attention by repeating key/value heads).
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
#include "shoestring/models/mmdit.h"

using namespace shoestring;
using models::MMDiT;
using models::MMDiTOptions;

namespace {

using shoestring::testing::load_case;
using shoestring::testing::load_keys;
using shoestring::testing::module_keys;
using shoestring::testing::resident_bytes;

// The configuration of mmdit_small in scripts/gen_dit_reference.py.
MMDiTOptions small_options(int64_t kv_heads) {
  return MMDiTOptions()
      .in_channels(4)
      .out_channels(4)
      .depth(3)
      .hidden_size(32)
      .num_heads(4)
      .num_kv_heads(kv_heads)
      .adm_in_channels(10)
      .context_dim(12)
      .pos_embed_max_size(6)
      .x_block_self_attn_layers({0, 2});
}

void load_into(MMDiT& net, const std::map<std::string, torch::Tensor>& ref) {
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
  net->pos_embed.copy_(ref.at("buffer.pos_embed"));
}

using shoestring::testing::expect_shape;

using shoestring::testing::count_graph_nodes;

}  // namespace

// 2,243,171,520 parameters: SD3Transformer2DModel of
// stabilityai/stable-diffusion-3.5-medium as counted by PyTorch in public
// training code (a flow_grpo training script annotates
// `pipeline.transformer ... # 2,243,171,520`; an SD3.5 Medium FP8/NVFP4
// measurement report states "真实 checkpoint 有 2,243,171,520 个参数").
// 2,469,663,936 elements with the pos_embed buffer: a public checkpoint audit
// of an SD3.5M-based transformer safetensors ("elements": 2469663936).
TEST(MMDiT, SD35MediumParameterCountOnMeta) {
  const int64_t before = resident_bytes();
  MMDiT net = models::build_sd35_medium(nn::LayerInit{torch::kMeta});
  EXPECT_EQ(nn::parameter_count(*net), 2243171520LL);
  EXPECT_EQ(net->pos_embed.numel(), 226492416);  // 384^2 x 1536
  EXPECT_EQ(nn::parameter_count(*net) + net->pos_embed.numel(), 2469663936LL);
  for (const auto& p : net->parameters()) ASSERT_TRUE(p.is_meta());
  EXPECT_TRUE(net->pos_embed.is_meta());
  EXPECT_LT(resident_bytes() - before, int64_t{256} << 20);
}

// The same report lists the SD3.5 Medium transformer's linear layers it
// quantises: attention + MLP, 337 linears holding 1,460,404,224 weights; MLP
// only, 94 linears with 887,095,296 weights. In the single-file layout those
// are the qkv / proj (attn, attn2) and mlp.fc1 / fc2 weights of the joint blocks.
TEST(MMDiT, SD35MediumLinearWeightTotalsMatchPublishedAudit) {
  MMDiT net = models::build_sd35_medium(nn::LayerInit{torch::kMeta});
  int64_t attn_mlp = 0, mlp = 0, mlp_count = 0;
  for (const auto& p : net->named_parameters()) {
    const std::string& k = p.key();
    if (k.rfind("joint_blocks.", 0) != 0 || k.size() < 7 || k.compare(k.size() - 7, 7, ".weight") != 0) continue;
    const bool is_mlp = k.find(".mlp.fc") != std::string::npos;
    const bool is_attn = k.find(".qkv.") != std::string::npos || k.find(".proj.") != std::string::npos;
    if (is_mlp) {
      mlp += p.value().numel();
      ++mlp_count;
    }
    if (is_mlp || is_attn) attn_mlp += p.value().numel();
  }
  EXPECT_EQ(mlp_count, 94);
  EXPECT_EQ(mlp, 887095296LL);
  EXPECT_EQ(attn_mlp, 1460404224LL);
}

TEST(MMDiT, KeysAndShapesMatchReleasedLayout) {
  MMDiT net = models::build_sd35_medium(nn::LayerInit{torch::kMeta});
  const auto expected = load_keys("sd35m");
  const auto actual = module_keys(*net);
  EXPECT_EQ(actual.size(), expected.size());
  for (const auto& [key, shape] : expected) {
    auto it = actual.find(key);
    if (it == actual.end()) {
      ADD_FAILURE() << "missing " << key;
    } else {
      EXPECT_EQ(it->second, shape) << key;
    }
  }
  for (const auto& kv : actual) EXPECT_TRUE(expected.count(kv.first)) << "unexpected " << kv.first;
  EXPECT_STREQ(models::kMMDiTCheckpointPrefix, "model.diffusion_model.");
}

// Written out by hand from mmditx.py: hidden 64 * 24 = 1536, attn2 in x_blocks
// 0..12 (9 adaLN chunks), the last context_block pre_only (2 chunks, no proj/mlp).
TEST(MMDiT, SpotCheckReleasedKeys) {
  MMDiT net = models::build_sd35_medium(nn::LayerInit{torch::kMeta});
  const auto keys = module_keys(*net);
  expect_shape(keys, "x_embedder.proj.weight", {1536, 16, 2, 2});
  expect_shape(keys, "pos_embed", {1, 147456, 1536});
  expect_shape(keys, "t_embedder.mlp.0.weight", {1536, 256});
  expect_shape(keys, "t_embedder.mlp.2.bias", {1536});
  expect_shape(keys, "y_embedder.mlp.0.weight", {1536, 2048});
  expect_shape(keys, "context_embedder.weight", {1536, 4096});
  expect_shape(keys, "joint_blocks.0.x_block.attn.qkv.weight", {4608, 1536});
  expect_shape(keys, "joint_blocks.0.x_block.attn.ln_q.weight", {64});
  expect_shape(keys, "joint_blocks.0.x_block.attn2.qkv.bias", {4608});
  expect_shape(keys, "joint_blocks.12.x_block.attn2.proj.weight", {1536, 1536});
  expect_shape(keys, "joint_blocks.0.x_block.adaLN_modulation.1.weight", {13824, 1536});
  expect_shape(keys, "joint_blocks.13.x_block.adaLN_modulation.1.weight", {9216, 1536});
  expect_shape(keys, "joint_blocks.5.context_block.mlp.fc1.weight", {6144, 1536});
  expect_shape(keys, "joint_blocks.5.context_block.mlp.fc2.weight", {1536, 6144});
  expect_shape(keys, "joint_blocks.23.context_block.attn.ln_k.weight", {64});
  expect_shape(keys, "joint_blocks.23.context_block.adaLN_modulation.1.weight", {3072, 1536});
  expect_shape(keys, "final_layer.linear.weight", {64, 1536});
  expect_shape(keys, "final_layer.adaLN_modulation.1.weight", {3072, 1536});
  EXPECT_FALSE(keys.count("joint_blocks.13.x_block.attn2.qkv.weight"));
  EXPECT_FALSE(keys.count("joint_blocks.23.context_block.attn.proj.weight"));
  EXPECT_FALSE(keys.count("joint_blocks.23.context_block.mlp.fc1.weight"));
  EXPECT_FALSE(keys.count("joint_blocks.24.x_block.attn.qkv.weight"));
}

// With 8 key/value heads every qkv projection (attn and attn2, both streams)
// loses 2 * (24 - 8) * 64 output rows, weights and biases.
TEST(MMDiT, GroupedQueryAttentionShrinksQkv) {
  MMDiT gqa(MMDiTOptions::sd35_medium().num_kv_heads(8), nn::LayerInit{torch::kMeta});
  const auto keys = module_keys(*gqa);
  expect_shape(keys, "joint_blocks.0.x_block.attn.qkv.weight", {2560, 1536});
  expect_shape(keys, "joint_blocks.3.x_block.attn2.qkv.weight", {2560, 1536});
  expect_shape(keys, "joint_blocks.23.context_block.attn.qkv.bias", {2560});
  const int64_t qkv_modules = 24 + 24 + 13;
  EXPECT_EQ(nn::parameter_count(*gqa), 2243171520LL - qkv_modules * 2 * 16 * 64 * (1536 + 1));
  EXPECT_THROW(MMDiT(MMDiTOptions::sd35_medium().num_kv_heads(5), nn::LayerInit{torch::kMeta}), Error);
}

TEST(MMDiT, ForwardMatchesPyTorchReference) {
  for (const auto& [name, kv] : {std::pair<std::string, int64_t>{"mmdit_small", 0}, {"mmdit_small_gqa", 2}}) {
    auto ref = load_case(name);
    MMDiT net(small_options(kv));
    load_into(net, ref);
    torch::NoGradGuard no_grad;
    torch::Tensor out = net->forward(ref.at("input.x"), ref.at("input.t"), ref.at("input.context"), ref.at("input.y"));
    ASSERT_EQ(out.sizes(), ref.at("output").sizes()) << name;
    EXPECT_TRUE(torch::allclose(out, ref.at("output"), 3e-5, 3e-5))
        << name << ": max abs diff " << (out - ref.at("output")).abs().max().item<float>();
  }
}

// The fixed sin-cos table a fresh model fills pos_embed with equals the
// reference's get_2d_sincos_pos_embed (stored by the generator).
TEST(MMDiT, PosEmbedIsReferenceSinCos) {
  auto ref = load_case("mmdit_small");
  MMDiT net(small_options(0));
  EXPECT_TRUE(torch::allclose(net->pos_embed, ref.at("buffer.pos_embed"), 1e-5, 1e-6));
}

// Grouped-query attention equals plain multi-head attention whose key/value
// projections repeat each kv head for its group of query heads.
TEST(MMDiT, GroupedQueryAttentionEqualsRepeatedKvHeads) {
  torch::manual_seed(5);
  const MMDiTOptions o = small_options(2);
  MMDiT gqa(o);
  MMDiT mha(MMDiTOptions(o).num_kv_heads(0));
  torch::NoGradGuard no_grad;
  for (auto& p : gqa->parameters()) p.copy_(torch::randn_like(p) * 0.2);
  const int64_t H = 4, G = 2, D = 8, R = H / G;
  auto mha_params = mha->named_parameters();
  for (const auto& p : gqa->named_parameters()) {
    torch::Tensor dst = mha_params[p.key()];
    const bool qkv = p.key().find(".qkv.") != std::string::npos;
    if (!qkv) {
      dst.copy_(p.value());
      continue;
    }
    // [q (H*D) | k (G*D) | v (G*D)] -> [q | k repeated | v repeated]
    auto parts = p.value().split({H * D, G * D, G * D}, 0);
    auto repeat = [&](const torch::Tensor& t) {  // [G*D, ...] -> [H*D, ...], head g -> heads g*R..g*R+R-1
      std::vector<int64_t> grouped{G, D}, full{H * D};
      for (int64_t i = 1; i < t.dim(); ++i) {
        grouped.push_back(t.size(i));
        full.push_back(t.size(i));
      }
      return t.reshape(grouped).repeat_interleave(R, 0).reshape(full);
    };
    torch::Tensor k = repeat(parts[1]), v = repeat(parts[2]);
    dst.copy_(torch::cat({parts[0], k, v}, 0));
  }
  mha->pos_embed.copy_(gqa->pos_embed);
  torch::Tensor x = torch::randn({2, 4, 6, 4}), t = torch::rand({2}), ctx = torch::randn({2, 3, 12}),
                y = torch::randn({2, 10});
  torch::Tensor a = gqa->forward(x, t, ctx, y), b = mha->forward(x, t, ctx, y);
  EXPECT_GT(a.abs().max().item<float>(), 1e-3f);
  EXPECT_TRUE(torch::allclose(a, b, 1e-5, 1e-5)) << (a - b).abs().max().item<float>();
}

TEST(MMDiT, TinyVariantTrainsOnCpu) {
  torch::manual_seed(0);
  MMDiT net(MMDiTOptions::tiny());
  EXPECT_LT(nn::parameter_count(*net), 2'000'000);
  const int64_t B = 2;
  torch::Tensor x0 = torch::randn({B, 16, 8, 8}), noise = torch::randn({B, 16, 8, 8});
  torch::Tensor t = torch::tensor({0.3f, 0.7f});
  torch::Tensor xt = (1 - t).view({B, 1, 1, 1}) * x0 + t.view({B, 1, 1, 1}) * noise;
  torch::Tensor target = noise - x0;  // rectified-flow velocity
  torch::Tensor ctx = torch::randn({B, 6, 64}), y = torch::randn({B, 64});
  torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.0));
  std::vector<float> losses;
  for (int step = 0; step < 12; ++step) {
    torch::Tensor loss = torch::mse_loss(net->forward(xt, t, ctx, y), target);
    opt.zero_grad();
    loss.backward();
    opt.step();
    losses.push_back(loss.item<float>());
    ASSERT_TRUE(std::isfinite(losses.back())) << "step " << step;
  }
  EXPECT_LT(losses.back(), 0.8f * losses.front()) << losses.front() << " -> " << losses.back();
}

TEST(MMDiT, TinyVariantRunsInBf16) {
  torch::manual_seed(4);
  MMDiT net(MMDiTOptions::tiny());
  {
    torch::NoGradGuard no_grad;  // make the zero-initialised modulations non-trivial
    for (auto& p : net->parameters()) p.add_(torch::randn_like(p) * 0.02);
  }
  torch::Tensor x = torch::randn({1, 16, 4, 6}), t = torch::rand({1});
  torch::Tensor ctx = torch::randn({1, 3, 64}), y = torch::randn({1, 64});
  torch::NoGradGuard no_grad;
  torch::Tensor ref = net->forward(x, t, ctx, y);
  net->to(torch::kBFloat16);
  torch::Tensor out = net->forward(x.to(torch::kBFloat16), t, ctx.to(torch::kBFloat16), y.to(torch::kBFloat16));
  EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
  const float scale = ref.abs().max().item<float>();
  EXPECT_LT((out.to(torch::kFloat32) - ref).abs().max().item<float>(), 0.1f * scale + 1e-3f);
}

TEST(MMDiT, RejectsBadInputsAndOptions) {
  MMDiT net(small_options(0));
  torch::Tensor x = torch::randn({1, 4, 4, 4}), t = torch::rand({1}), ctx = torch::randn({1, 2, 12}),
                y = torch::randn({1, 10});
  EXPECT_NO_THROW(net->forward(x, t, ctx, y));
  EXPECT_THROW(net->forward(torch::randn({1, 4, 5, 4}), t, ctx, y), Error);   // not divisible by patch
  EXPECT_THROW(net->forward(torch::randn({1, 4, 14, 4}), t, ctx, y), Error);  // 7 patches > max 6
  EXPECT_THROW(net->forward(torch::randn({1, 3, 4, 4}), t, ctx, y), Error);
  EXPECT_THROW(net->forward(x, torch::rand({2}), ctx, y), Error);
  EXPECT_THROW(net->forward(x, t, torch::randn({1, 2, 11}), y), Error);
  EXPECT_THROW(net->forward(x, t, ctx, torch::randn({1, 9})), Error);
  EXPECT_THROW(MMDiT(small_options(3)), Error);                                // 3 does not divide 4
  EXPECT_THROW(MMDiT(small_options(0).x_block_self_attn_layers({3})), Error);  // depth 3
  EXPECT_THROW(MMDiT(small_options(0).hidden_size(30)), Error);                // not divisible by 4 heads
}

// Skip-layer guidance's forward: skipped joint blocks pass both streams
// through unchanged (sd3.5 mmditx.py `if i in skip_layers: continue`). A
// joint block whose adaLN modulations are zero is exactly the identity (every
// residual branch is gated by a zero), so skipping block i of a model equals
// the same model with block i's modulations zeroed.
TEST(MMDiT, SkipLayersActAsIdentityBlocks) {
  torch::manual_seed(6);
  MMDiT net(small_options(0));
  torch::NoGradGuard no_grad;
  for (auto& p : net->parameters()) p.copy_(torch::randn_like(p) * 0.2);
  const torch::Tensor x = torch::randn({2, 4, 4, 6}), t = torch::rand({2}), ctx = torch::randn({2, 3, 12}),
                      y = torch::randn({2, 10});
  const torch::Tensor full = net->forward(x, t, ctx, y);
  EXPECT_TRUE(torch::equal(net->forward(x, t, ctx, y, {}), full));  // no skips: the plain forward

  auto with_identity_blocks = [&](const std::vector<int64_t>& ids) {
    MMDiT copy(small_options(0));
    for (const auto& p : net->named_parameters()) copy->named_parameters()[p.key()].copy_(p.value());
    copy->pos_embed.copy_(net->pos_embed);
    for (int64_t i : ids) {
      auto& block = *copy->joint_blocks[static_cast<size_t>(i)]->as<models::MMDiTJointBlockImpl>();
      for (auto* s : {&block.context_block, &block.x_block}) {
        (*s)->adaLN_modulation->weight.zero_();
        (*s)->adaLN_modulation->bias.zero_();
      }
    }
    return copy->forward(x, t, ctx, y);
  };
  for (const std::vector<int64_t>& ids : std::vector<std::vector<int64_t>>{{1}, {0}, {2}, {0, 2}, {0, 1, 2}}) {
    const torch::Tensor skipped = net->forward(x, t, ctx, y, ids);
    EXPECT_GT((skipped - full).abs().max().item<float>(), 1e-4f) << ids.size();  // skipping changes the output
    EXPECT_TRUE(torch::allclose(skipped, with_identity_blocks(ids), 1e-6, 1e-6)) << ids.size() << " " << ids[0];
  }
  // Order and repeats do not matter.
  EXPECT_TRUE(torch::equal(net->forward(x, t, ctx, y, {2, 0, 2}), net->forward(x, t, ctx, y, {0, 2})));
  // The same under precision rules (the root scope and per-block checkpointing).
  shoestring::testing::checkpoint_by_rule(*net, true);
  EXPECT_TRUE(torch::allclose(net->forward(x, t, ctx, y, {1}), with_identity_blocks({1}), 1e-6, 1e-6));
  EXPECT_THROW(net->forward(x, t, ctx, y, {3}), Error);
  shoestring::testing::checkpoint_by_rule(*net, false);
  EXPECT_THROW(net->forward(x, t, ctx, y, {3}), Error);  // depth 3
  EXPECT_THROW(net->forward(x, t, ctx, y, {-1}), Error);
  EXPECT_THROW(net->forward(x, t, ctx, y, {0, 7}), Error);
}

// A placed crop of the position embedding (SD3.5's random crop, kohya's
// pos_emb_random_crop_rate) is the centred forward of a model whose table
// holds, at the centre, what the original holds at that place.
TEST(MMDiT, PosEmbedCropPlacesThePatchGrid) {
  torch::manual_seed(8);
  MMDiT net(small_options(0));
  torch::NoGradGuard no_grad;
  for (auto& p : net->parameters()) p.copy_(torch::randn_like(p) * 0.2);
  const torch::Tensor x = torch::randn({2, 4, 4, 6}), t = torch::rand({2}), ctx = torch::randn({2, 3, 12}),
                      y = torch::randn({2, 10});
  const int64_t M = net->options().pos_embed_max_size(), h = 2, w = 3;  // 4 x 6 latents, patch 2
  ASSERT_GT(M, w);
  const models::PosEmbedCrop crop{0, M - w};  // top row, right edge
  MMDiT moved(small_options(0));
  for (const auto& p : net->named_parameters()) moved->named_parameters()[p.key()].copy_(p.value());
  const torch::Tensor table = net->pos_embed.view({1, M, M, -1});
  torch::Tensor shifted = table.clone();
  const int64_t top = (M - h) / 2, left = (M - w) / 2;  // the centre the reference crops by default
  shifted.slice(1, top, top + h).slice(2, left, left + w).copy_(table.slice(1, 0, h).slice(2, M - w, M));
  moved->pos_embed.copy_(shifted.view_as(net->pos_embed));
  const torch::Tensor placed = net->forward(x, t, ctx, y, {}, crop);
  EXPECT_TRUE(torch::equal(placed, moved->forward(x, t, ctx, y)));
  EXPECT_GT((placed - net->forward(x, t, ctx, y)).abs().max().item<float>(), 1e-4f);
  // The centre placed explicitly is the default.
  EXPECT_TRUE(torch::equal(net->forward(x, t, ctx, y, {}, models::PosEmbedCrop{top, left}), net->forward(x, t, ctx, y)));
  // The same through the precision rules' root scope.
  shoestring::testing::checkpoint_by_rule(*net, true);
  EXPECT_TRUE(torch::allclose(net->forward(x, t, ctx, y, {}, crop), placed, 1e-6, 1e-6));
  shoestring::testing::checkpoint_by_rule(*net, false);
  // A crop that leaves the table is refused.
  EXPECT_THROW(net->forward(x, t, ctx, y, {}, models::PosEmbedCrop{0, M - w + 1}), Error);
  EXPECT_THROW(net->forward(x, t, ctx, y, {}, models::PosEmbedCrop{M - h + 1, 0}), Error);
}

// Checkpointed joint blocks give the gradients of the plain forward.
TEST(MMDiT, GradientCheckpointingKeepsGradients) {
  torch::manual_seed(8);
  MMDiT net(MMDiTOptions::tiny());
  {
    torch::NoGradGuard no_grad;
    for (auto& p : net->parameters()) p.add_(torch::randn_like(p) * 0.02);
  }
  torch::Tensor x = torch::randn({2, 16, 4, 4}), t = torch::rand({2});
  torch::Tensor ctx = torch::randn({2, 3, 64}), y = torch::randn({2, 64});
  auto grads = [&](bool ckpt) {
    shoestring::testing::checkpoint_by_rule(*net, ckpt);
    net->zero_grad();
    net->forward(x, t, ctx, y).square().mean().backward();
    std::vector<torch::Tensor> g;
    for (const auto& p : net->parameters()) g.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
    return g;
  };
  const auto plain = grads(false), ckpt = grads(true);
  shoestring::testing::checkpoint_by_rule(*net, false);
  const size_t nodes_plain = count_graph_nodes(net->forward(x, t, ctx, y));
  shoestring::testing::checkpoint_by_rule(*net, true);
  EXPECT_LT(count_graph_nodes(net->forward(x, t, ctx, y)), nodes_plain / 2);
  ASSERT_EQ(plain.size(), ckpt.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::allclose(plain[i], ckpt[i], 1e-5, 1e-6)) << i;
}
