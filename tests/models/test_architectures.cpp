// Real architectures: SD 1.5 / SDXL / SSD-1B UNets and the SD VAE in the LDM
// single-file layout. Parameter counts against published numbers, exact key
// names and shapes, meta builds, tiny-width training steps, detection, and
// the LDM <-> diffusers key map.
#include <chrono>
#include <set>
#include <unordered_map>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../nn/reference_data.h"
#include "model_testing.h"
#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/io/key_map.h"
#include "shoestring/models/architecture.h"
#include "shoestring/models/unet_ldm.h"
#include "shoestring/models/vae.h"

using namespace shoestring;
using models::LdmUNet;
using models::LdmUNetOptions;

namespace {

std::unordered_map<std::string, std::vector<int64_t>> checkpoint_shapes(const std::string& arch) {
  std::unordered_map<std::string, std::vector<int64_t>> out;
  auto root = models::build_checkpoint_root(arch, torch::kMeta);
  for (const auto& p : root->named_parameters()) out[p.key()] = p.value().sizes().vec();
  return out;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Closed-form parameter counts of LDM blocks (weights + biases), written from
// the layer shapes in openaimodel.py / attention.py, independent of the
// module code under test.
int64_t transformer_block_params(int64_t c, int64_t ctx) {
  const int64_t attn1 = 4 * c * c + c;                       // to_q, to_k, to_v (no bias), to_out.0
  const int64_t attn2 = 2 * c * c + 2 * ctx * c + c;         // to_k / to_v read the context
  const int64_t ff = (c * 8 * c + 8 * c) + (4 * c * c + c);  // GEGLU proj c -> 8c, out 4c -> c
  return attn1 + attn2 + ff + 3 * 2 * c;                     // norm1..3
}
int64_t resblock_params(int64_t in, int64_t out, int64_t temb) {
  int64_t n = 2 * in + (9 * in * out + out) + (temb * out + out) + 2 * out + (9 * out * out + out);
  if (in != out) n += in * out + out;
  return n;
}

}  // namespace

// ---- parameter counts -------------------------------------------------------

// SD 1.5 UNet: 859,520,964 (diffusers UNet2DConditionModel.num_parameters() of
// runwayml/stable-diffusion-v1-5; the model card's "860M").
TEST(Architectures, Sd15ParameterCountIsPublished) {
  auto m = models::build_architecture("sd15", torch::kMeta);
  EXPECT_EQ(nn::parameter_count(*m), 859'520'964);
  EXPECT_EQ(models::find_architecture("sd15").parameters, 859'520'964);
}

// SDXL base 1.0 UNet: 2,567,463,684 (diffusers num_parameters() of
// stabilityai/stable-diffusion-xl-base-1.0/unet; the SDXL report's "2.6B").
TEST(Architectures, SdxlParameterCountIsPublished) {
  auto m = models::build_architecture("sdxl", torch::kMeta);
  EXPECT_EQ(nn::parameter_count(*m), 2'567'463'684);
}

// SSD-1B: the model card (huggingface.co/segmind/SSD-1B) says "1.3B". Layout
// from its diffusers UNet config (transformer_layers_per_block [[1],[2,2],[4,4]],
// reverse_transformer_layers_per_block [[4,4,10],[2,1,1],1], mid_block_type
// UNetMidBlock2D), also in ComfyUI supported_models.SSD1B (transformer_depth
// 0,0,2,2,4,4) and stable-diffusion.cpp unet.hpp (VERSION_SDXL_SSD1B). The exact
// count is the published SDXL count minus the removed blocks, in closed form.
TEST(Architectures, Ssd1bParameterCountIsSdxlMinusRemovedBlocks) {
  const int64_t removed_1280 = (10 - 4) * 2                       // input level 2: depth 10 -> 4 in two blocks
                               + (10 - 4) * 2                     // output level 2: blocks 0 and 1 depth 10 -> 4
                               + 10;                              // middle_block.1: all 10 blocks
  const int64_t removed_640 = 2;                                  // output level 1: blocks 1 and 2 depth 2 -> 1
  const int64_t mid_shell = 2 * 1280 + 2 * (1280 * 1280 + 1280);  // middle_block.1 norm, proj_in, proj_out
  const int64_t expected = 2'567'463'684 - removed_1280 * transformer_block_params(1280, 2048) -
                           removed_640 * transformer_block_params(640, 2048) - mid_shell -
                           resblock_params(1280, 1280, 1280);  // middle_block.2
  EXPECT_EQ(expected, 1'331'334'404);
  auto m = models::build_architecture("ssd1b", torch::kMeta);
  EXPECT_EQ(nn::parameter_count(*m), expected);
  EXPECT_EQ(models::find_architecture("ssd1b").parameters, expected);
}

// SD VAE (AutoencoderKL, identical for SD 1.x and SDXL): 83,653,863 (diffusers
// num_parameters() of stabilityai/sd-vae-ft-mse).
TEST(Architectures, VaeParameterCountIsPublished) {
  auto m = models::build_architecture("vae", torch::kMeta);
  EXPECT_EQ(nn::parameter_count(*m), 83'653'863);
}

TEST(Architectures, RegistryCountsMatchBuilds) {
  for (const auto& a : models::architectures()) {
    if (a.parameters == 0) continue;
    EXPECT_EQ(nn::parameter_count(*a.build(torch::kMeta, false)), a.parameters) << a.name;
  }
  EXPECT_THROW(models::find_architecture("sd14"), Error);
}

// ---- exact keys and shapes --------------------------------------------------

TEST(Architectures, Sd15KeysAndShapes) {
  auto s = checkpoint_shapes("sd15");
  const std::string p = "model.diffusion_model.";
  const std::vector<std::pair<std::string, std::vector<int64_t>>> want = {
      {"time_embed.0.weight", {1280, 320}},
      {"time_embed.2.bias", {1280}},
      {"input_blocks.0.0.weight", {320, 4, 3, 3}},
      {"input_blocks.1.0.in_layers.0.weight", {320}},
      {"input_blocks.1.0.in_layers.2.weight", {320, 320, 3, 3}},
      {"input_blocks.1.0.emb_layers.1.weight", {320, 1280}},
      {"input_blocks.1.0.out_layers.3.weight", {320, 320, 3, 3}},
      {"input_blocks.1.1.proj_in.weight", {320, 320, 1, 1}},
      {"input_blocks.1.1.norm.weight", {320}},
      {"input_blocks.1.1.transformer_blocks.0.attn2.to_k.weight", {320, 768}},
      {"input_blocks.1.1.transformer_blocks.0.attn1.to_out.0.bias", {320}},
      {"input_blocks.1.1.transformer_blocks.0.ff.net.0.proj.weight", {2560, 320}},
      {"input_blocks.1.1.transformer_blocks.0.ff.net.2.weight", {320, 1280}},
      {"input_blocks.3.0.op.weight", {320, 320, 3, 3}},
      {"input_blocks.4.0.skip_connection.weight", {640, 320, 1, 1}},
      {"input_blocks.4.1.transformer_blocks.0.attn1.to_q.weight", {640, 640}},
      {"input_blocks.11.0.out_layers.3.weight", {1280, 1280, 3, 3}},
      {"middle_block.1.transformer_blocks.0.norm3.weight", {1280}},
      {"middle_block.2.emb_layers.1.bias", {1280}},
      {"output_blocks.0.0.in_layers.0.weight", {2560}},
      {"output_blocks.2.1.conv.weight", {1280, 1280, 3, 3}},
      {"output_blocks.3.1.proj_out.weight", {1280, 1280, 1, 1}},
      {"output_blocks.5.2.conv.weight", {1280, 1280, 3, 3}},
      {"output_blocks.8.2.conv.weight", {640, 640, 3, 3}},
      {"output_blocks.11.0.skip_connection.weight", {320, 640, 1, 1}},
      {"out.0.weight", {320}},
      {"out.2.weight", {4, 320, 3, 3}},
  };
  for (const auto& [k, shape] : want) {
    auto it = s.find(p + k);
    ASSERT_NE(it, s.end()) << k;
    EXPECT_EQ(it->second, shape) << k;
  }
  EXPECT_TRUE(s.count(p + "input_blocks.8.1.norm.weight"));    // level 2 has attention
  EXPECT_FALSE(s.count(p + "input_blocks.10.1.norm.weight"));  // level 3 has none
  EXPECT_FALSE(s.count(p + "label_emb.0.0.weight"));
  EXPECT_FALSE(s.count(p + "input_blocks.1.0.skip_connection.weight"));  // identity skip
}

TEST(Architectures, SdxlKeysAndShapes) {
  auto s = checkpoint_shapes("sdxl");
  const std::string p = "model.diffusion_model.";
  const std::vector<std::pair<std::string, std::vector<int64_t>>> want = {
      {"label_emb.0.0.weight", {1280, 2816}},
      {"label_emb.0.2.weight", {1280, 1280}},
      {"input_blocks.4.1.proj_in.weight", {640, 640}},
      {"input_blocks.4.1.transformer_blocks.1.attn2.to_k.weight", {640, 2048}},
      {"input_blocks.7.1.transformer_blocks.9.ff.net.0.proj.weight", {10240, 1280}},
      {"input_blocks.6.0.op.weight", {640, 640, 3, 3}},
      {"middle_block.1.transformer_blocks.9.attn1.to_v.weight", {1280, 1280}},
      {"output_blocks.2.2.conv.weight", {1280, 1280, 3, 3}},
      {"output_blocks.5.2.conv.weight", {640, 640, 3, 3}},
      {"output_blocks.8.0.skip_connection.weight", {320, 640, 1, 1}},
      {"out.2.weight", {4, 320, 3, 3}},
  };
  for (const auto& [k, shape] : want) {
    auto it = s.find(p + k);
    ASSERT_NE(it, s.end()) << k;
    EXPECT_EQ(it->second, shape) << k;
  }
  EXPECT_FALSE(s.count(p + "input_blocks.1.1.norm.weight"));  // level 0 has no attention
  EXPECT_FALSE(s.count(p + "input_blocks.7.1.transformer_blocks.10.norm1.weight"));
  EXPECT_FALSE(s.count(p + "input_blocks.9.0.op.weight"));  // three levels: two downsamples
}

TEST(Architectures, Ssd1bRemovesTheDocumentedBlocks) {
  auto s = checkpoint_shapes("ssd1b");
  const std::string p = "model.diffusion_model.";
  EXPECT_TRUE(s.count(p + "middle_block.0.in_layers.0.weight"));
  EXPECT_FALSE(s.count(p + "middle_block.1.norm.weight"));
  EXPECT_FALSE(s.count(p + "middle_block.2.in_layers.0.weight"));
  EXPECT_TRUE(s.count(p + "input_blocks.7.1.transformer_blocks.3.attn1.to_q.weight"));
  EXPECT_FALSE(s.count(p + "input_blocks.7.1.transformer_blocks.4.attn1.to_q.weight"));
  EXPECT_TRUE(s.count(p + "output_blocks.2.1.transformer_blocks.9.attn1.to_q.weight"));
  EXPECT_FALSE(s.count(p + "output_blocks.1.1.transformer_blocks.4.attn1.to_q.weight"));
  EXPECT_TRUE(s.count(p + "output_blocks.3.1.transformer_blocks.1.attn1.to_q.weight"));
  EXPECT_FALSE(s.count(p + "output_blocks.4.1.transformer_blocks.1.attn1.to_q.weight"));
  EXPECT_TRUE(s.count(p + "output_blocks.5.2.conv.weight"));
}

TEST(Architectures, VaeKeysAndShapes) {
  auto s = checkpoint_shapes("vae");
  const std::string p = "first_stage_model.";
  const std::vector<std::pair<std::string, std::vector<int64_t>>> want = {
      {"encoder.conv_in.weight", {128, 3, 3, 3}},
      {"encoder.down.0.block.0.norm1.weight", {128}},
      {"encoder.down.0.downsample.conv.weight", {128, 128, 3, 3}},
      {"encoder.down.1.block.0.nin_shortcut.weight", {256, 128, 1, 1}},
      {"encoder.mid.attn_1.q.weight", {512, 512, 1, 1}},
      {"encoder.mid.attn_1.proj_out.bias", {512}},
      {"encoder.mid.block_2.conv2.weight", {512, 512, 3, 3}},
      {"encoder.norm_out.weight", {512}},
      {"encoder.conv_out.weight", {8, 512, 3, 3}},
      {"quant_conv.weight", {8, 8, 1, 1}},
      {"post_quant_conv.weight", {4, 4, 1, 1}},
      {"decoder.conv_in.weight", {512, 4, 3, 3}},
      {"decoder.up.3.block.2.conv1.weight", {512, 512, 3, 3}},
      {"decoder.up.3.upsample.conv.weight", {512, 512, 3, 3}},
      {"decoder.up.1.block.0.nin_shortcut.weight", {256, 512, 1, 1}},
      {"decoder.up.0.block.0.nin_shortcut.weight", {128, 256, 1, 1}},
      {"decoder.conv_out.weight", {3, 128, 3, 3}},
  };
  for (const auto& [k, shape] : want) {
    auto it = s.find(p + k);
    ASSERT_NE(it, s.end()) << k;
    EXPECT_EQ(it->second, shape) << k;
  }
  EXPECT_FALSE(s.count(p + "decoder.up.0.upsample.conv.weight"));
  EXPECT_FALSE(s.count(p + "encoder.down.3.downsample.conv.weight"));
  EXPECT_FALSE(s.count(p + "decoder.up.3.block.3.conv1.weight"));
}

// ---- meta builds ------------------------------------------------------------

TEST(Architectures, SdxlBuildsOnMetaFastWithoutAllocating) {
  auto& ledger = MemoryLedger::global();
  ledger.install();
  ledger.reset_peaks();
  const int64_t before = ledger.current_total();
  const auto t0 = std::chrono::steady_clock::now();
  auto m = models::build_architecture("sdxl", torch::kMeta);
  const double secs = seconds_since(t0);
  EXPECT_LT(ledger.peak_total() - before, 64 * 1024) << "tensor bytes allocated by a meta build";
  for (const auto& p : m->parameters()) ASSERT_TRUE(p.is_meta());
  std::cout << "sdxl meta build: " << secs << " s, " << m->parameters().size() << " tensors\n";
}

// ---- forward / backward at tiny width ---------------------------------------

namespace {
// One training-like step: forward, MSE against a random target, backward.
// Every parameter is perturbed first so zero-initialised outputs pass gradients.
void tiny_unet_step(const std::string& arch) {
  const auto t0 = std::chrono::steady_clock::now();
  torch::manual_seed(3);
  auto module = models::build_architecture(arch, {}, /*tiny=*/true);
  auto unet = std::dynamic_pointer_cast<models::LdmUNetImpl>(module);
  ASSERT_TRUE(unet);
  {
    torch::NoGradGuard g;
    for (auto& p : unet->parameters()) p.add_(torch::randn_like(p) * 0.02);
  }
  const auto& o = unet->options();
  const int64_t B = 2, S = 16;
  torch::Tensor x = torch::randn({B, 4, S, S});
  torch::Tensor t = torch::tensor({10.0, 900.0});
  torch::Tensor ctx = torch::randn({B, 7, o.context_dim()});
  torch::Tensor y = o.adm_in_channels() > 0 ? torch::randn({B, o.adm_in_channels()}) : torch::Tensor();
  torch::Tensor out = unet->forward(x, t, ctx, y);
  ASSERT_EQ(out.sizes(), x.sizes());
  torch::Tensor loss = (out - torch::randn_like(out)).pow(2).mean();
  loss.backward();
  EXPECT_TRUE(std::isfinite(loss.item<double>()));
  int64_t with_grad = 0, total = 0;
  for (const auto& p : unet->parameters()) {
    ++total;
    if (p.grad().defined() && p.grad().abs().sum().item<double>() > 0) ++with_grad;
  }
  EXPECT_EQ(with_grad, total) << arch;
  const double secs = seconds_since(t0);
  std::cout << arch << " tiny: " << nn::parameter_count(*unet) << " params, loss " << loss.item<double>() << ", "
            << secs << " s\n";
}
}  // namespace

TEST(Architectures, TinySd15TrainsOneStep) { tiny_unet_step("sd15"); }
TEST(Architectures, TinySdxlTrainsOneStep) { tiny_unet_step("sdxl"); }
TEST(Architectures, TinySsd1bTrainsOneStep) { tiny_unet_step("ssd1b"); }

TEST(Architectures, TinyVaeEncodesDecodesAndBackpropagates) {
  torch::manual_seed(4);
  auto vae = std::dynamic_pointer_cast<models::AutoencoderKLImpl>(models::build_architecture("vae", {}, true));
  ASSERT_TRUE(vae);
  torch::Tensor img = torch::rand({2, 3, 32, 32}) * 2 - 1;
  models::VaePosterior post = vae->encode(img);
  EXPECT_EQ(post.mean.sizes(), (std::vector<int64_t>{2, 4, 4, 4}));
  EXPECT_LE(post.logvar.max().item<double>(), 20.0);
  torch::Tensor z = vae->encode_latents(img, /*sample=*/false);
  EXPECT_TRUE(torch::allclose(z, post.mean * 0.18215));
  torch::Tensor rec = vae->decode_latents(z);
  EXPECT_EQ(rec.sizes(), img.sizes());
  torch::Tensor loss = (rec - img).pow(2).mean();
  loss.backward();
  EXPECT_TRUE(std::isfinite(loss.item<double>()));
  EXPECT_TRUE(vae->encoder->conv_in->weight.grad().defined());
  EXPECT_GT(vae->encoder->conv_in->weight.grad().abs().sum().item<double>(), 0.0);
}

// A micro SDXL-structured UNet (label_emb, linear projections, depth-2
// transformers, skip concatenation, resampling) and a micro VAE against
// PyTorch functional references (scripts/gen_ldm_reference.py), loaded by
// their LDM keys: names, wiring and math at once.
TEST(Architectures, MicroUNetMatchesPyTorchReference) {
  auto ref = shoestring::testing::load_reference("ldm_unet_micro");
  LdmUNet unet(LdmUNetOptions::sdxl()
                   .model_channels(8)
                   .channel_mult({1, 2})
                   .num_res_blocks(1)
                   .transformer_depth({0, 2})
                   .transformer_depth_output({2, 2, 0, 0})
                   .transformer_depth_middle(1)
                   .num_head_channels(8)
                   .context_dim(6)
                   .adm_in_channels(5)
                   .groups(4));
  shoestring::testing::load_params(*unet, ref);
  torch::NoGradGuard g;
  torch::Tensor out = unet->forward(ref.at("input.x"), ref.at("input.t"), ref.at("input.context"), ref.at("input.y"));
  const double err = (out - ref.at("output")).abs().max().item<double>();
  EXPECT_TRUE(torch::allclose(out, ref.at("output"), 1e-4, 1e-4)) << "max abs error " << err;
}

TEST(Architectures, MicroVaeMatchesPyTorchReference) {
  auto ref = shoestring::testing::load_reference("ldm_vae_micro");
  models::AutoencoderKL vae(models::VaeOptions().ch(8).ch_mult({1, 2}).num_res_blocks(1).groups(4));
  shoestring::testing::load_params(*vae, ref);
  torch::NoGradGuard g;
  models::VaePosterior post = vae->encode(ref.at("input.image"));
  EXPECT_TRUE(torch::allclose(post.mean, ref.at("output.mean"), 1e-4, 1e-4));
  EXPECT_TRUE(torch::allclose(post.logvar, ref.at("output.logvar"), 1e-4, 1e-4));
  torch::Tensor rec = vae->decode(post.mean);
  const double err = (rec - ref.at("output.decoded")).abs().max().item<double>();
  EXPECT_TRUE(torch::allclose(rec, ref.at("output.decoded"), 1e-4, 1e-4)) << "max abs error " << err;
}

// The VAE's attention against the formula of LDM's AttnBlock, written with einsum.
TEST(Architectures, VaeAttentionMatchesFormula) {
  torch::manual_seed(5);
  models::VaeAttention attn(8, 4, nn::LayerInit{});
  torch::Tensor x = torch::randn({2, 8, 3, 5});
  torch::NoGradGuard g;
  torch::Tensor h = torch::group_norm(x, 4, attn->norm->weight, attn->norm->bias, 1e-6);
  auto proj = [](const nn::Conv2d& c, const torch::Tensor& t) {
    return torch::einsum("oc,bchw->bohw", {c->weight.flatten(1), t}) + c->bias.view({1, -1, 1, 1});
  };
  torch::Tensor q = proj(attn->q, h).flatten(2), k = proj(attn->k, h).flatten(2), v = proj(attn->v, h).flatten(2);
  torch::Tensor w = (torch::einsum("bci,bcj->bij", {q, k}) / std::sqrt(8.0)).softmax(-1);
  torch::Tensor o = torch::einsum("bij,bcj->bci", {w, v}).view({2, 8, 3, 5});
  torch::Tensor want = x + proj(attn->proj_out, o);
  EXPECT_TRUE(torch::allclose(attn->forward(x), want, 1e-5, 1e-5));
}

// The layout only renames: an LDM-named ResBlock with the same weights (same
// registration order) computes what the shoestring-named one does.
TEST(Architectures, LdmLayoutOnlyRenames) {
  torch::manual_seed(6);
  nn::ResBlock a(nn::ResBlockOptions(8, 16, 12).groups(4));
  nn::ResBlock b(nn::ResBlockOptions(8, 16, 12).groups(4).layout(nn::KeyLayout::kLdm));
  auto pa = a->parameters(), pb = b->parameters();
  ASSERT_EQ(pa.size(), pb.size());
  torch::NoGradGuard g;
  for (size_t i = 0; i < pa.size(); ++i) pb[i].copy_(pa[i] + 0.01 * static_cast<double>(i));
  for (size_t i = 0; i < pa.size(); ++i) pa[i].copy_(pb[i]);
  torch::Tensor x = torch::randn({2, 8, 6, 6}), temb = torch::randn({2, 12});
  EXPECT_TRUE(torch::equal(a->forward(x, temb), b->forward(x, temb)));
  std::set<std::string> names;
  for (const auto& p : b->named_parameters()) names.insert(p.key());
  EXPECT_EQ(names, (std::set<std::string>{"in_layers.0.weight", "in_layers.0.bias", "in_layers.2.weight",
                                          "in_layers.2.bias", "emb_layers.1.weight", "emb_layers.1.bias",
                                          "out_layers.0.weight", "out_layers.0.bias", "out_layers.3.weight",
                                          "out_layers.3.bias", "skip_connection.weight", "skip_connection.bias"}));
}

TEST(Architectures, RejectsBadInputs) {
  LdmUNet unet(LdmUNetOptions::sdxl().tiny());
  torch::Tensor x = torch::randn({1, 4, 8, 8}), t = torch::tensor({1.0}), ctx = torch::randn({1, 3, 64});
  EXPECT_THROW(unet->forward(x, t, ctx), Error);  // SDXL needs y
  EXPECT_THROW(unet->forward(x, t, torch::randn({1, 3, 65}), torch::randn({1, 64})), Error);
  EXPECT_THROW(unet->forward(torch::randn({1, 4, 6, 6}), t, ctx, torch::randn({1, 64})), Error);
  EXPECT_THROW(LdmUNet(LdmUNetOptions::sd15().transformer_depth({1, 1})), Error);
}

// ---- detection --------------------------------------------------------------

namespace {
std::vector<models::TensorShape> checkpoint_of(const std::string& arch, const std::string& prefix) {
  std::vector<models::TensorShape> out;
  for (const auto& t : models::architecture_tensors(arch)) out.push_back({prefix + t.name, t.shape});
  return out;
}
}  // namespace

TEST(Architectures, DetectsEachArchitectureExactly) {
  for (const std::string arch : {"sd15", "sdxl", "ssd1b", "sd35m"}) {
    auto found = models::detect_architectures(checkpoint_of(arch, "model.diffusion_model."));
    ASSERT_EQ(found.size(), 1u) << arch;
    EXPECT_EQ(found[0].architecture, arch);
    EXPECT_TRUE(found[0].exact()) << arch;
    EXPECT_FALSE(found[0].tiny);
  }
  // A bare VAE file (no first_stage_model. prefix).
  auto vae = models::detect_architectures(checkpoint_of("vae", ""));
  ASSERT_EQ(vae.size(), 1u);
  EXPECT_EQ(vae[0].architecture, "vae");
  EXPECT_EQ(vae[0].prefix, "");
  EXPECT_TRUE(vae[0].exact());
  // SD3's VAE (16 channels, no quant convs) under an SD3.5 single file's prefix is told from the SD one.
  auto sd3_vae = models::detect_architectures(checkpoint_of("sd3-vae", "first_stage_model."));
  ASSERT_EQ(sd3_vae.size(), 1u);
  EXPECT_EQ(sd3_vae[0].architecture, "sd3-vae");
  EXPECT_TRUE(sd3_vae[0].exact());
  // Stable Cascade files store stage C without a prefix.
  for (const std::string arch : {"cascade-c", "cascade-c-lite"}) {
    auto found = models::detect_architectures(checkpoint_of(arch, ""));
    ASSERT_EQ(found.size(), 1u) << arch;
    EXPECT_EQ(found[0].architecture, arch);
    EXPECT_TRUE(found[0].exact()) << arch;
  }
}

TEST(Architectures, DetectsUNetAndVaeOfASingleFileAndReportsDifferences) {
  auto ckpt = checkpoint_of("sdxl", "model.diffusion_model.");
  for (auto& t : checkpoint_of("vae", "first_stage_model.")) ckpt.push_back(t);
  ckpt.push_back({"conditioner.embedders.0.transformer.text_model.final_layer_norm.weight", {768}});
  // One tensor missing, one extra, one with another shape.
  ckpt.erase(std::remove_if(ckpt.begin(), ckpt.end(),
                            [](const auto& t) { return t.name == "model.diffusion_model.out.2.bias"; }),
             ckpt.end());
  ckpt.push_back({"model.diffusion_model.extra.weight", {3}});
  for (auto& t : ckpt) {
    if (t.name == "model.diffusion_model.label_emb.0.0.weight") t.shape = {1280, 2048};
  }
  auto found = models::detect_architectures(ckpt);
  ASSERT_EQ(found.size(), 2u);
  EXPECT_EQ(found[0].architecture, "sdxl");
  EXPECT_EQ(found[0].missing, std::vector<std::string>{"model.diffusion_model.out.2.bias"});
  EXPECT_EQ(found[0].unexpected, std::vector<std::string>{"model.diffusion_model.extra.weight"});
  ASSERT_EQ(found[0].mismatched.size(), 1u);
  EXPECT_NE(found[0].mismatched[0].find("label_emb.0.0.weight: expected [1280, 2816], got [1280, 2048]"),
            std::string::npos)
      << found[0].mismatched[0];
  EXPECT_EQ(found[1].architecture, "vae");
  EXPECT_TRUE(found[1].exact());
}

TEST(Architectures, DetectsTinyWidthAndNothingInUnrelatedFiles) {
  std::vector<models::TensorShape> tiny;
  const std::string sd15 = "sd15";  // an lvalue: see test_registry.cpp on -Wdangling-reference
  for (const auto& t : models::architecture_tensors(sd15, true))
    tiny.push_back({"model.diffusion_model." + t.name, t.shape});
  auto found = models::detect_architectures(tiny);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].architecture, "sd15");
  EXPECT_TRUE(found[0].tiny);
  EXPECT_TRUE(models::detect_architectures({{"foo.weight", {3, 3}}}).empty());
}

// ---- LDM <-> diffusers key map ------------------------------------------------

namespace {
void expect_round_trip(const std::vector<models::TensorShape>& keys,
                       const std::function<std::string(const std::string&)>& to_diffusers,
                       const std::function<std::string(const std::string&)>& to_ldm, const std::string& what) {
  std::set<std::string> diffusers;
  for (const auto& t : keys) {
    const std::string d = to_diffusers(t.name);
    EXPECT_TRUE(diffusers.insert(d).second) << what << ": two keys map to " << d;
    EXPECT_EQ(to_ldm(d), t.name) << what;
  }
  EXPECT_EQ(diffusers.size(), keys.size());
}
}  // namespace

TEST(KeyMap, UNetsRoundTripThroughDiffusers) {
  for (const auto& [arch, opts] : std::vector<std::pair<std::string, LdmUNetOptions>>{
           {"sd15", LdmUNetOptions::sd15()}, {"sdxl", LdmUNetOptions::sdxl()}, {"ssd1b", LdmUNetOptions::ssd1b()}}) {
    const io::UNetKeyLayout layout = models::unet_key_layout(opts);
    expect_round_trip(
        models::architecture_tensors(arch), [&](const std::string& k) { return io::unet_ldm_to_diffusers(k, layout); },
        [&](const std::string& k) { return io::unet_diffusers_to_ldm(k, layout); }, arch);
  }
}

// Names as in diffusers' UNet2DConditionModel state dicts of
// runwayml/stable-diffusion-v1-5 and stabilityai/stable-diffusion-xl-base-1.0.
TEST(KeyMap, UNetKnownDiffusersNames) {
  const auto sd = models::unet_key_layout(LdmUNetOptions::sd15());
  const std::vector<std::pair<std::string, std::string>> sd_pairs = {
      {"time_embed.0.weight", "time_embedding.linear_1.weight"},
      {"input_blocks.0.0.bias", "conv_in.bias"},
      {"input_blocks.1.0.in_layers.0.weight", "down_blocks.0.resnets.0.norm1.weight"},
      {"input_blocks.1.1.proj_in.weight", "down_blocks.0.attentions.0.proj_in.weight"},
      {"input_blocks.3.0.op.weight", "down_blocks.0.downsamplers.0.conv.weight"},
      {"input_blocks.4.0.skip_connection.bias", "down_blocks.1.resnets.0.conv_shortcut.bias"},
      {"input_blocks.11.0.emb_layers.1.weight", "down_blocks.3.resnets.1.time_emb_proj.weight"},
      {"middle_block.1.transformer_blocks.0.ff.net.0.proj.weight",
       "mid_block.attentions.0.transformer_blocks.0.ff.net.0.proj.weight"},
      {"middle_block.2.out_layers.3.weight", "mid_block.resnets.1.conv2.weight"},
      {"output_blocks.2.1.conv.weight", "up_blocks.0.upsamplers.0.conv.weight"},
      {"output_blocks.5.2.conv.weight", "up_blocks.1.upsamplers.0.conv.weight"},
      {"output_blocks.11.1.transformer_blocks.0.attn2.to_out.0.bias",
       "up_blocks.3.attentions.2.transformer_blocks.0.attn2.to_out.0.bias"},
      {"output_blocks.11.0.skip_connection.weight", "up_blocks.3.resnets.2.conv_shortcut.weight"},
      {"out.0.weight", "conv_norm_out.weight"},
      {"out.2.weight", "conv_out.weight"},
  };
  for (const auto& [ldm, diff] : sd_pairs) {
    EXPECT_EQ(io::unet_ldm_to_diffusers(ldm, sd), diff);
    EXPECT_EQ(io::unet_diffusers_to_ldm(diff, sd), ldm);
  }
  const auto xl = models::unet_key_layout(LdmUNetOptions::sdxl());
  EXPECT_EQ(io::unet_ldm_to_diffusers("label_emb.0.2.bias", xl), "add_embedding.linear_2.bias");
  EXPECT_EQ(io::unet_ldm_to_diffusers("input_blocks.7.1.transformer_blocks.9.attn1.to_q.weight", xl),
            "down_blocks.2.attentions.0.transformer_blocks.9.attn1.to_q.weight");
  EXPECT_EQ(io::unet_ldm_to_diffusers("output_blocks.2.2.conv.weight", xl), "up_blocks.0.upsamplers.0.conv.weight");
  EXPECT_THROW(io::unet_ldm_to_diffusers("label_emb.0.0.weight", sd), Error);
  EXPECT_THROW(io::unet_ldm_to_diffusers("input_blocks.1.0.bogus.weight", sd), Error);
  EXPECT_THROW(io::unet_diffusers_to_ldm("down_blocks.9.resnets.0.norm1.weight", sd), Error);
}

TEST(KeyMap, VaeRoundTripsAndKnownNames) {
  expect_round_trip(
      models::architecture_tensors("vae"), [](const std::string& k) { return io::vae_ldm_to_diffusers(k); },
      [](const std::string& k) { return io::vae_diffusers_to_ldm(k); }, "vae");
  // Names of diffusers' AutoencoderKL (stabilityai/sd-vae-ft-mse).
  EXPECT_EQ(io::vae_ldm_to_diffusers("encoder.mid.attn_1.q.weight"), "encoder.mid_block.attentions.0.to_q.weight");
  EXPECT_EQ(io::vae_ldm_to_diffusers("decoder.mid.attn_1.proj_out.bias"),
            "decoder.mid_block.attentions.0.to_out.0.bias");
  EXPECT_EQ(io::vae_ldm_to_diffusers("decoder.mid.attn_1.norm.weight"),
            "decoder.mid_block.attentions.0.group_norm.weight");
  EXPECT_EQ(io::vae_ldm_to_diffusers("decoder.up.3.upsample.conv.weight"),
            "decoder.up_blocks.0.upsamplers.0.conv.weight");
  EXPECT_EQ(io::vae_ldm_to_diffusers("decoder.up.0.block.0.nin_shortcut.weight"),
            "decoder.up_blocks.3.resnets.0.conv_shortcut.weight");
  EXPECT_EQ(io::vae_ldm_to_diffusers("encoder.down.2.downsample.conv.bias"),
            "encoder.down_blocks.2.downsamplers.0.conv.bias");
  EXPECT_EQ(io::vae_ldm_to_diffusers("encoder.norm_out.weight"), "encoder.conv_norm_out.weight");
  EXPECT_EQ(io::vae_ldm_to_diffusers("quant_conv.weight"), "quant_conv.weight");
  EXPECT_THROW(io::vae_ldm_to_diffusers("encoder.down.4.block.0.norm1.weight"), Error);
}

namespace {

// Parameter gradients of one tiny-width step with or without checkpointing.
std::vector<torch::Tensor> tiny_unet_grads(const std::string& arch, bool checkpointing) {
  torch::manual_seed(11);
  auto unet = std::dynamic_pointer_cast<models::LdmUNetImpl>(models::build_architecture(arch, {}, /*tiny=*/true));
  {
    torch::NoGradGuard g;
    for (auto& p : unet->parameters()) p.add_(torch::randn_like(p) * 0.02);
  }
  shoestring::testing::checkpoint_by_rule(*unet, checkpointing);
  unet->train();
  const auto& o = unet->options();
  torch::Tensor x = torch::randn({2, 4, 16, 16}), t = torch::tensor({10.0, 900.0});
  torch::Tensor ctx = torch::randn({2, 7, o.context_dim()});
  torch::Tensor y = o.adm_in_channels() > 0 ? torch::randn({2, o.adm_in_channels()}) : torch::Tensor();
  unet->forward(x, t, ctx, y).pow(2).mean().backward();
  std::vector<torch::Tensor> grads;
  for (const auto& p : unet->parameters()) grads.push_back(p.grad().clone());
  return grads;
}

}  // namespace

// SDXL's deep blocks (transformer depth 2 and 10) are checkpointed layer by
// layer, SD 1.5's depth-1 blocks whole; both must give the gradients of the
// plain backward (no dropout, so bit-equal up to recompute order: 1e-6).
TEST(Architectures, GradientCheckpointingKeepsGradients) {
  for (const std::string arch : {"sd15", "sdxl"}) {
    auto plain = tiny_unet_grads(arch, false), ckpt = tiny_unet_grads(arch, true);
    ASSERT_EQ(plain.size(), ckpt.size());
    for (size_t i = 0; i < plain.size(); ++i) {
      EXPECT_TRUE(torch::allclose(plain[i], ckpt[i], 1e-5, 1e-7)) << arch << " parameter " << i;
    }
  }
}
