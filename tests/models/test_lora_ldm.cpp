// LoRA on the real architectures' module trees (tiny width: same blocks and
// key names as the released SDXL / SD 1.5 UNets): kohya names in the LDM
// layout, a few training steps that move only the adapters, and the kohya
// file's round trip.
#include <filesystem>
#include <set>

#include <unistd.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shoestring/io/safetensors.h"
#include "shoestring/models/architecture.h"
#include "shoestring/models/unet_ldm.h"
#include "shoestring/nn/lora.h"

using namespace shoestring;

namespace {

struct TinyLdm {
  std::shared_ptr<torch::nn::Module> root;  // keys "model.diffusion_model.*"
  models::LdmUNetImpl* unet = nullptr;
};

TinyLdm tiny_root(const std::string& arch) {
  TinyLdm t;
  t.root = models::build_checkpoint_root(arch, {}, /*tiny=*/true);
  for (const auto& child : t.root->named_modules("", /*include_self=*/false)) {
    if (auto* u = dynamic_cast<models::LdmUNetImpl*>(child.value().get())) t.unet = u;
  }
  return t;
}

}  // namespace

TEST(LoraLdm, SdxlNamesFollowKohyaLdmLayout) {
  TinyLdm m = tiny_root("sdxl");
  ASSERT_NE(m.unet, nullptr);
  nn::LoraNetwork net(*m.root, std::vector<nn::LoraComponent>{{"lora_unet", "model.diffusion_model."}},
                      nn::LoraOptions{});
  std::set<std::string> names;
  for (const auto& mod : net->modules()) names.insert(mod->layer().kohya_name);
  // SDXL's first attention level is input_blocks.4 (level 1, after the first downsample).
  for (const char* n : {"lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q",
                        "lora_unet_input_blocks_4_1_transformer_blocks_1_attn2_to_k",
                        "lora_unet_middle_block_1_transformer_blocks_0_attn1_to_out_0",
                        "lora_unet_output_blocks_0_1_transformer_blocks_0_attn2_to_v"}) {
    EXPECT_TRUE(names.count(n)) << n;
  }
  // Level 0 of SDXL has no attention: nothing named input_blocks_1_1.
  for (const auto& n : names) EXPECT_EQ(n.find("lora_unet_input_blocks_1_1"), std::string::npos) << n;
  // Four projections per attention; SDXL tiny keeps depth 2 at level 1, 10 at level 2 and in the middle.
  EXPECT_EQ(names.size() % 4, 0u);
}

TEST(LoraLdm, TrainingMovesOnlyAdaptersAndTheFileRoundTrips) {
  torch::manual_seed(5);
  TinyLdm m = tiny_root("sd15");
  ASSERT_NE(m.unet, nullptr);
  std::map<std::string, torch::Tensor> base;
  for (const auto& p : m.root->named_parameters()) {
    base[p.key()] = p.value().detach().clone();
    p.value().set_requires_grad(false);
  }
  {  // Non-zero output layers, so adapters receive gradients (released weights are not zero).
    torch::NoGradGuard g;
    for (const auto& p : m.root->parameters()) p.add_(torch::randn_like(p) * 0.02);
    for (const auto& p : m.root->named_parameters()) base[p.key()] = p.value().detach().clone();
  }
  nn::LoraNetwork net(*m.root, std::vector<nn::LoraComponent>{{"lora_unet", "model.diffusion_model."}},
                      nn::LoraOptions{});
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-2));
  const auto& o = m.unet->options();
  torch::Tensor x = torch::randn({2, 4, 16, 16}), t = torch::tensor({50.0, 700.0});
  torch::Tensor ctx = torch::randn({2, 5, o.context_dim()}), target = torch::randn({2, 4, 16, 16});
  double first = 0, last = 0;
  for (int step = 0; step < 6; ++step) {
    opt.zero_grad();
    torch::Tensor loss = (m.unet->forward(x, t, ctx) - target).pow(2).mean();
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_TRUE(std::isfinite(last));
  EXPECT_LT(last, first);
  for (const auto& p : m.root->named_parameters()) {
    if (base.count(p.key())) {
      EXPECT_TRUE(torch::equal(p.value(), base.at(p.key()))) << p.key();
    }
  }
  const std::string path =
      (std::filesystem::temp_directory_path() / ("shoestring_lora_ldm_" + std::to_string(::getpid()) + ".safetensors"))
          .string();
  net->save(path);
  auto file = load_safetensors(path);
  EXPECT_TRUE(file.count("lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_q.lora_down.weight"));
  EXPECT_TRUE(file.count("lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_q.alpha"));
  // Load into a fresh copy of the base model: same adapted output, bit for bit.
  TinyLdm fresh = tiny_root("sd15");
  {
    torch::NoGradGuard g;
    for (const auto& p : fresh.root->named_parameters()) p.value().copy_(base.at(p.key()));
  }
  auto loaded = nn::LoraNetworkImpl::from_file(*fresh.root, {{"lora_unet", "model.diffusion_model."}}, path);
  torch::NoGradGuard g;
  EXPECT_TRUE(torch::equal(fresh.unet->forward(x, t, ctx), m.unet->forward(x, t, ctx)));
  std::filesystem::remove(path);
}
