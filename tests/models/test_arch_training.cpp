// A few training steps of every released architecture at tiny width (same
// block structure and input widths as the releases): full fine-tuning in
// fp32, in bf16 weights with stochastic rounding, and LoRA with a frozen base.
// Each run repeats one fixed batch (noise prediction, arch_training.h), so
// the loss must fall: the mean of the last three losses must be below
// (1 - margin) times the first, and every loss must be finite.
#include <string>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "arch_training.h"
#include "shoestring/models/vae.h"
#include "shoestring/nn/lora.h"

using namespace shoestring;
namespace st = shoestring::testing;

namespace {

bool is_ldm(const std::string& arch) { return arch == "sd15" || arch == "sdxl" || arch == "ssd1b"; }

// Steps: 8 for the (slower) UNets, 12 for the others.
int steps(const std::string& arch) { return is_ldm(arch) ? 8 : 12; }

// Full fine-tuning learning rate: MMDiT's zero adaLN gates and final layer
// and stage C's zero clf conv and 0.02-gain embedding conv start slower than
// the UNets (whose only zero layer is out.2).
double full_lr(const std::string& arch) { return is_ldm(arch) ? 1e-3 : 5e-3; }

// Latent side: 8 for SDXL / SSD-1B (their 10-deep transformer stacks
// dominate the time), 16 for the others.
int64_t side(const std::string& arch) { return arch == "sdxl" || arch == "ssd1b" ? 8 : 16; }

// LoRA learning rate: MMDiT's adapters sit behind small (perturbed) gates.
double lora_lr(const std::string& arch) { return arch == "sd35m" ? 3e-2 : 1e-2; }

std::string test_name(const ::testing::TestParamInfo<std::string>& info) {
  std::string n = info.param;
  for (auto& c : n) c = c == '-' ? '_' : c;
  return n;
}

void expect_falls(const std::vector<double>& losses, double margin, const std::string& what) {
  ASSERT_FALSE(losses.empty());
  std::string all;
  for (double l : losses) all += fmt::format(" {:.4f}", l);
  ::testing::Test::RecordProperty("losses", all);  // in --gtest_output=xml
  EXPECT_LT(st::tail_mean(losses), (1.0 - margin) * losses.front()) << what << ": losses" << all;
}

}  // namespace

class ArchTraining : public ::testing::TestWithParam<std::string> {};

// Full fine-tuning, fp32 weights, AdamW: the loss falls by at least 10%.
// (cascade-c-lite is not listed: its tiny variant is StageCOptions::tiny(),
// the same model as cascade-c's.)
TEST_P(ArchTraining, FullFp32LossFalls) {
  const std::string arch = GetParam();
  torch::manual_seed(1);
  st::TinyArch a = st::tiny_arch(arch);
  st::FixedBatch b = st::fixed_batch(a, side(arch));
  auto losses = st::train_steps(a, b, st::trainable(*a.module), full_lr(arch), steps(arch));
  expect_falls(losses, 0.10, arch + " full fp32");
}

// LoRA (rank 4, alpha 4, default attention targets, kohya prefix of the
// architecture): only the adapters train, the frozen base stays bit for bit,
// and the loss falls by at least 3%. The base is perturbed first so that its
// zero-initialised output layers and gates (as in a fresh model, unlike the
// released weights) pass gradients to the adapters.
TEST_P(ArchTraining, LoraTrainsOnlyAdaptersAndLossFalls) {
  const std::string arch = GetParam();
  st::TinyArch a = st::tiny_arch(arch);
  st::perturb(*a.module, 0.05, 2);
  const auto base = st::snapshot(*a.module);
  EXPECT_EQ(nn::freeze_parameters(*a.module), static_cast<int64_t>(base.size()));
  const std::string prefix = arch.rfind("cascade", 0) == 0 ? "lora_prior_unet" : "lora_unet";
  nn::LoraOptions lo;
  lo.rank = 4;
  lo.alpha = 4;
  nn::LoraNetwork net(*a.module, std::vector<nn::LoraComponent>{{prefix, ""}}, lo);
  EXPECT_TRUE(st::trainable(*a.module).empty());
  st::FixedBatch b = st::fixed_batch(a, side(arch));
  auto losses = st::train_steps(a, b, st::trainable(*net), lora_lr(arch), steps(arch));
  EXPECT_TRUE(net->never_called().empty());
  expect_falls(losses, 0.03, arch + " LoRA");
  for (const auto& p : a.module->named_parameters()) {
    EXPECT_TRUE(torch::equal(p.value(), base.at(p.key()))) << arch << " base weight moved: " << p.key();
  }
  double up_norm = 0;
  for (const auto& m : net->modules()) up_norm += m->up().norm().item<double>();
  EXPECT_GT(up_norm, 0.0);
}

INSTANTIATE_TEST_SUITE_P(Tiny, ArchTraining, ::testing::Values("sd15", "sdxl", "ssd1b", "sd35m", "cascade-c"),
                         test_name);

class ArchTrainingBf16 : public ::testing::TestWithParam<std::string> {};

// bf16 weights (whole model cast, inputs in bf16), AdamW with stochastic
// rounding into the bf16 weights: every weight stays bf16, the loss falls
// by at least 10%.
TEST_P(ArchTrainingBf16, Bf16StochasticRoundingLossFalls) {
  const std::string arch = GetParam();
  torch::manual_seed(1);
  st::TinyArch a = st::tiny_arch(arch);
  a.module->to(torch::kBFloat16);
  st::FixedBatch b = st::fixed_batch(a, side(arch)).to(torch::kBFloat16);
  auto losses = st::train_steps(a, b, st::trainable(*a.module), full_lr(arch), steps(arch));
  expect_falls(losses, 0.10, arch + " bf16 + SR");
  for (const auto& p : a.module->named_parameters()) EXPECT_EQ(p.value().scalar_type(), torch::kBFloat16) << p.key();
}

INSTANTIATE_TEST_SUITE_P(Tiny, ArchTrainingBf16, ::testing::Values("sd15", "sd35m", "cascade-c"), test_name);

// The tiny VAE (vae architecture, channels 32): a few AdamW steps of plain
// reconstruction (decode(encode(x).mean) vs x, one fixed 32 x 32 image in
// [-1, 1]) lower the loss by at least 10%.
TEST(ArchTrainingVae, ReconstructionLossFalls) {
  torch::manual_seed(0);
  auto vae = std::dynamic_pointer_cast<models::AutoencoderKLImpl>(models::build_architecture("vae", {}, /*tiny=*/true));
  ASSERT_NE(vae, nullptr);
  torch::manual_seed(1);
  const torch::Tensor x = torch::rand({1, 3, 32, 32}) * 2 - 1;
  auto params = st::trainable(*vae);
  OptimizerOptions oo;
  auto opt = make_optimizer("AdamW", {"weight_decay=0.01"}, params, oo);
  vae->train();
  std::vector<double> losses;
  for (int s = 0; s < 8; ++s) {
    for (const auto& p : params) p.second.mutable_grad() = torch::Tensor();
    torch::Tensor loss = (vae->decode(vae->encode(x).mean) - x).pow(2).mean();
    losses.push_back(loss.item<double>());
    EXPECT_TRUE(std::isfinite(losses.back())) << "step " << s;
    loss.backward();
    opt->step(1e-3);
  }
  expect_falls(losses, 0.10, "vae reconstruction");
}
