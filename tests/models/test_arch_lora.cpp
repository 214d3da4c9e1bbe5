// LoRA on SD3.5's MMDiT-X and Stable Cascade stage C (tiny width, the
// released key layouts): kohya names of the default attention targets (fused
// attn.qkv / attn.proj for MMDiT as kohya networks/lora_sd3.py; the q/k/v
// thirds of the packed in_proj_weight as to_q / to_k / to_v plus out_proj for
// Stable Cascade, as OneTrainer / kohya's stable-cascade code name them),
// the kohya file's bit-exact round trip, and merge against the formula
// W + multiplier * alpha / rank * up @ down.
#include <set>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../io/temp_dir.h"
#include "arch_training.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/nn/lora.h"

using namespace shoestring;
namespace st = shoestring::testing;

namespace {

std::set<std::string> names_of(const nn::LoraNetworkImpl& net) {
  std::set<std::string> names;
  for (const auto& m : net.modules()) names.insert(m->layer().kohya_name);
  return names;
}

// Random adapter weights (up is zero after construction).
void randomize(nn::LoraNetworkImpl& net, uint64_t seed) {
  torch::manual_seed(seed);
  torch::NoGradGuard ng;
  for (auto& p : net.parameters()) p.copy_(torch::randn_like(p) * 0.1);
}

nn::LoraOptions options(int64_t rank, double alpha, bool ff = false) {
  nn::LoraOptions o;
  o.rank = rank;
  o.alpha = alpha;
  o.feed_forward = ff;
  return o;
}

}  // namespace

TEST(ArchLora, MMDiTTargetsFusedQkvAndProjUnderKohyaSd3Names) {
  st::TinyArch a = st::tiny_arch("sd35m");
  const auto& o = std::dynamic_pointer_cast<models::MMDiTImpl>(a.module)->options();
  nn::LoraNetwork net(*a.module, std::vector<nn::LoraComponent>{{"lora_unet", ""}}, options(4, 2.0));
  const auto names = names_of(*net);
  for (const char* n :
       {"lora_unet_joint_blocks_0_context_block_attn_qkv", "lora_unet_joint_blocks_0_context_block_attn_proj",
        "lora_unet_joint_blocks_0_x_block_attn_qkv", "lora_unet_joint_blocks_0_x_block_attn_proj",
        "lora_unet_joint_blocks_1_x_block_attn2_qkv", "lora_unet_joint_blocks_1_x_block_attn2_proj",
        "lora_unet_joint_blocks_2_context_block_attn_qkv"}) {
    EXPECT_TRUE(names.count(n)) << n;
  }
  // The last context block is pre-only (no proj, no MLP); attention only by default.
  EXPECT_FALSE(names.count("lora_unet_joint_blocks_2_context_block_attn_proj"));
  for (const auto& n : names) {
    EXPECT_EQ(n.find("mlp"), std::string::npos) << n;
    EXPECT_EQ(n.find("adaLN"), std::string::npos) << n;
  }
  // Per block: context qkv (+ proj unless last), x qkv + proj, attn2 qkv + proj where present.
  const std::set<int64_t> sa(o.x_block_self_attn_layers().begin(), o.x_block_self_attn_layers().end());
  size_t expected = 0;
  for (int64_t i = 0; i < o.depth(); ++i) expected += (i + 1 < o.depth() ? 2 : 1) + 2 + (sa.count(i) ? 2 : 0);
  EXPECT_EQ(names.size(), expected);
  // The fused qkv adapter spans all three projections: up [3 * hidden, rank].
  auto* qkv = net->find("lora_unet_joint_blocks_0_x_block_attn_qkv");
  ASSERT_NE(qkv, nullptr);
  EXPECT_EQ(qkv->up().sizes(), (std::vector<int64_t>{3 * o.hidden(), 4}));
  EXPECT_EQ(qkv->down().sizes(), (std::vector<int64_t>{4, o.hidden()}));

  // With train_ff: every Linear of every stream block (kohya lora_sd3's default set).
  st::TinyArch other = st::tiny_arch("sd35m");
  nn::LoraNetwork all(*other.module, std::vector<nn::LoraComponent>{{"lora_unet", ""}}, options(4, 2.0, true));
  size_t linears = 0;
  for (const auto& m : a.module->named_modules()) {
    if (m.key().rfind("joint_blocks.", 0) == 0 && dynamic_cast<nn::LinearImpl*>(m.value().get())) ++linears;
  }
  EXPECT_EQ(all->modules().size(), linears);
  const auto all_names = names_of(*all);
  EXPECT_TRUE(all_names.count("lora_unet_joint_blocks_0_x_block_mlp_fc1"));
  EXPECT_TRUE(all_names.count("lora_unet_joint_blocks_2_context_block_adaLN_modulation_1"));
  EXPECT_FALSE(all_names.count("lora_unet_final_layer_adaLN_modulation_1"));
}

TEST(ArchLora, StageCTargetsPackedInProjThirdsAndOutProj) {
  st::TinyArch a = st::tiny_arch("cascade-c");
  const auto& o = std::dynamic_pointer_cast<models::StageCImpl>(a.module)->options();
  nn::LoraNetwork net(*a.module, std::vector<nn::LoraComponent>{{"lora_prior_unet", ""}}, options(4, 4.0));
  const auto names = names_of(*net);
  for (const char* n :
       {"lora_prior_unet_down_blocks_0_2_attention_attn_to_q", "lora_prior_unet_down_blocks_0_2_attention_attn_to_k",
        "lora_prior_unet_down_blocks_0_2_attention_attn_to_v",
        "lora_prior_unet_down_blocks_0_2_attention_attn_out_proj",
        "lora_prior_unet_up_blocks_1_2_attention_attn_to_v"}) {
    EXPECT_TRUE(names.count(n)) << n;
  }
  for (const auto& n : names) EXPECT_EQ(n.find("kv_mapper"), std::string::npos) << n;
  int64_t attn_blocks = 0;
  for (size_t l = 0; l < o.hidden().size(); ++l) {
    const int64_t per_pattern = std::count(o.level_config()[l].begin(), o.level_config()[l].end(), 'A');
    attn_blocks += per_pattern * (o.down_blocks()[l] + o.up_blocks()[o.hidden().size() - 1 - l]);
  }
  EXPECT_EQ(static_cast<int64_t>(names.size()), 4 * attn_blocks);
  auto* q = net->find("lora_prior_unet_down_blocks_0_2_attention_attn_to_q");
  ASSERT_NE(q, nullptr);
  EXPECT_TRUE(q->layer().packed != nullptr);
  EXPECT_EQ(q->up().sizes(), (std::vector<int64_t>{o.hidden()[0], 4}));
  EXPECT_EQ(q->layer().path, "down_blocks.0.2.attention.attn.to_q");

  // Every adapter runs in a forward pass (none bypassed), and a non-zero
  // adapter changes the output.
  a.module->eval();
  st::FixedBatch b = st::fixed_batch(a, 8);
  torch::NoGradGuard ng;
  st::perturb(*a.module, 0.02, 4);
  const torch::Tensor before = a.forward(b.x_t(), b.sigma, b.cond);
  randomize(*net, 5);
  const torch::Tensor after = a.forward(b.x_t(), b.sigma, b.cond);
  EXPECT_TRUE(net->never_called().empty());
  EXPECT_GT((after - before).abs().max().item<double>(), 1e-4);
}

class ArchLoraFile : public ::testing::TestWithParam<std::string> {};

// save -> from_file on a fresh copy of the base model: the same tensors bit
// for bit and the same adapted output; merge() writes W + m * alpha / rank *
// up @ down into each adapted weight (for Stable Cascade into the rows of the
// packed in_proj_weight) and the merged plain model computes what the adapted
// one did.
TEST_P(ArchLoraFile, RoundTripAndMergeFormula) {
  const std::string arch = GetParam();
  const std::string prefix = arch == "sd35m" ? "lora_unet" : "lora_prior_unet";
  st::TinyArch a = st::tiny_arch(arch), fresh = st::tiny_arch(arch);
  st::perturb(*a.module, 0.02, 6);
  {
    torch::NoGradGuard ng;
    auto pf = fresh.module->named_parameters();
    for (const auto& p : a.module->named_parameters()) pf[p.key()].copy_(p.value());
  }
  const auto base = st::snapshot(*a.module);
  nn::LoraNetwork net(*a.module, std::vector<nn::LoraComponent>{{prefix, ""}}, options(3, 1.5));
  randomize(*net, 7);
  net->set_multiplier(0.75);

  st::TempDir dir;
  const std::string path = dir.file("lora.safetensors");
  net->save(path, nn::kohya_lora_metadata(net->options(), arch));
  auto file = load_safetensors(path);
  EXPECT_EQ(file.size(), 3 * net->modules().size());
  const std::string probe = arch == "sd35m" ? "lora_unet_joint_blocks_1_x_block_attn2_qkv"
                                            : "lora_prior_unet_up_blocks_0_2_attention_attn_to_k";
  EXPECT_TRUE(file.count(probe + ".lora_down.weight")) << probe;
  EXPECT_TRUE(file.count(probe + ".alpha")) << probe;

  auto loaded = nn::LoraNetworkImpl::from_file(*fresh.module, {{prefix, ""}}, path, /*multiplier=*/0.75);
  ASSERT_EQ(loaded->modules().size(), net->modules().size());
  auto original = net->named_parameters();
  for (const auto& p : loaded->named_parameters()) {
    ASSERT_TRUE(original.contains(p.key())) << p.key();
    EXPECT_TRUE(torch::equal(p.value(), original[p.key()])) << p.key();
  }
  for (const auto& m : loaded->modules()) EXPECT_EQ(m->alpha(), 1.5) << m->layer().kohya_name;

  a.module->eval();
  fresh.module->eval();
  st::FixedBatch b = st::fixed_batch(a, 8);
  torch::NoGradGuard ng;
  const torch::Tensor adapted = a.forward(b.x_t(), b.sigma, b.cond);
  EXPECT_TRUE(torch::equal(fresh.forward(b.x_t(), b.sigma, b.cond), adapted));

  // Expected merged weights from the formula, per adapted layer.
  std::map<std::string, torch::Tensor> expected;
  for (const auto& m : net->modules()) {
    torch::Tensor w = m->layer().weight().clone();
    expected[m->layer().path] = w + 0.75 * (1.5 / 3.0) * torch::matmul(m->up(), m->down());
  }
  EXPECT_EQ(net->merge(), static_cast<int64_t>(net->modules().size()));
  for (const auto& m : net->modules()) {
    EXPECT_TRUE(torch::allclose(m->layer().weight(), expected.at(m->layer().path), 1e-6, 1e-7)) << m->layer().path;
  }
  // For Stable Cascade, check the packed parameter itself: its q/k/v thirds
  // moved, the rest of the model did not.
  auto params = a.module->named_parameters();
  if (arch != "sd35m") {
    const std::string attn = "down_blocks.0.2.attention.attn.";
    torch::Tensor packed = params[attn + "in_proj_weight"];
    const int64_t c = packed.size(1);
    const char* thirds[] = {"to_q", "to_k", "to_v"};
    for (int64_t i = 0; i < 3; ++i) {
      EXPECT_TRUE(torch::allclose(packed.narrow(0, i * c, c), expected.at(attn + thirds[i]), 1e-6, 1e-7)) << thirds[i];
    }
    EXPECT_TRUE(torch::equal(params[attn + "in_proj_bias"], base.at(attn + "in_proj_bias")));
  }
  for (const auto& [key, value] : base) {
    const bool adapted_weight = key.find("in_proj_weight") != std::string::npos ||
                                (key.size() > 7 && key.compare(key.size() - 7, 7, ".weight") == 0 &&
                                 expected.count(key.substr(0, key.size() - 7)));
    if (!adapted_weight) {
      EXPECT_TRUE(torch::equal(params[key], value)) << key;
    }
  }
  const torch::Tensor merged = a.forward(b.x_t(), b.sigma, b.cond);
  EXPECT_TRUE(torch::allclose(merged, adapted, 1e-4, 1e-5)) << (merged - adapted).abs().max();
}

INSTANTIATE_TEST_SUITE_P(Tiny, ArchLoraFile, ::testing::Values("sd35m", "cascade-c"), [](const auto& info) {
  std::string n = info.param;
  for (auto& c : n) c = c == '-' ? '_' : c;
  return n;
});
