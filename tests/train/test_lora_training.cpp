// LoRA training end to end (network_module = "networks.lora") on the committed
// Twemoji fixtures: only the adapters train, the base weights stay bit for bit,
// the kohya file loads back, and a resumed run equals the uninterrupted one.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/data/tokenizer.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/nn/lora.h"
#include "shoestring/train/checkpoint_io.h"
#include "shoestring/train/config.h"
#include "shoestring/train/tiny_unet_model.h"
#include "shoestring/train/trainer.h"
#include "train_testing.h"

namespace fs = std::filesystem;
using namespace shoestring;
using shoestring::testing::losses_of;
using shoestring::testing::quiet;

namespace {

std::string temp_dir(const std::string& name) { return shoestring::testing::fresh_temp_dir("test_lora", name); }

/// lora = false: the plain (full) training config of the same model.
TrainConfig lora_config(const std::string& out, const std::string& extra = "", bool lora = true) {
  std::string text = fmt::format(
      "train_data_dir = \"{}/twemoji\"\n"
      "resolution = 16\n"
      "train_batch_size = 4\n"
      "max_train_steps = 4\n"
      "learning_rate = 1e-2\n"
      "seed = 3\n"
      "num_threads = 1\n"
      "sample_prompts = [\"red heart\"]\n"
      "sample_seeds = 1\n"
      "sample_steps = 2\n"
      "output_dir = \"{}\"\n"
      "{}"
      "{}"
      "[model]\n"
      "base_channels = 16\nchannel_mult = [1, 2]\nnum_res_blocks = 1\nattention_levels = [1]\n"
      "num_heads = 2\nnorm_groups = 8\ntext_dim = 32\ntext_layers = 1\n",
      SHOESTRING_TEST_DATA, out,
      lora ? "network_module = \"networks.lora\"\nnetwork_dim = 4\nnetwork_alpha = 2.0\n"
             "network_args = [\"conv_dim=2\", \"conv_alpha=1\"]\n"
           : "",
      extra);
  return parse_config(text, "lora.toml");
}

/// A base model trained (all weights) for 3 steps, so that its zero-initialised
/// output layers (conv_out, proj_out, conv2) are no longer zero and LoRA
/// layers upstream receive gradients. Trained once per test process.
std::string base_model() {
  static const std::string path = [] {
    TrainRunOptions o;
    o.quiet = true;
    TrainConfig c = lora_config(temp_dir("base"), "", /*lora=*/false);
    c.max_train_steps = 3;
    return train(c, o).run_dir + "/model.safetensors";
  }();
  return path;
}

std::string pretrained_line() { return "pretrained_model_name_or_path = \"" + base_model() + "\"\n"; }

}  // namespace

TEST(LoraTraining, TrainsOnlyTheAdapterAndWritesAKohyaFile) {
  TrainConfig cfg = lora_config(temp_dir("run"), pretrained_line());
  cfg.save_every_n_steps = 2;
  auto summary = train(cfg, quiet());
  auto losses = losses_of(summary.run_dir + "/metrics.jsonl");
  ASSERT_EQ(losses.size(), 4u);
  for (double l : losses) EXPECT_TRUE(std::isfinite(l));

  // Base weights: the final model and the step-2 checkpoint equal the
  // pretrained base bit for bit.
  const std::string final_model = summary.run_dir + "/model.safetensors";
  auto base = load_safetensors(base_model());
  auto saved = load_safetensors(final_model);
  auto at_step2 = load_safetensors(summary.run_dir + "/checkpoints/step-000002/model.safetensors");
  ASSERT_EQ(saved.size(), base.size());
  for (const auto& [k, v] : base) {
    ASSERT_TRUE(saved.count(k)) << k;
    EXPECT_TRUE(torch::equal(saved[k], v)) << k;
    EXPECT_TRUE(torch::equal(at_step2[k], v)) << k;
  }
  auto file = SafetensorsFile::open(final_model);
  auto options = TinyUNetModelOptions::from_json(nlohmann::json::parse(file.metadata().at("model_config")));
  TinyUNetModel fresh(options);
  load_module(*fresh, base, base_model());

  // The kohya LoRA file.
  const std::string lora_path = summary.run_dir + "/lora.safetensors";
  ASSERT_TRUE(fs::exists(lora_path));
  ASSERT_TRUE(fs::exists(summary.run_dir + "/checkpoints/step-000002/lora.safetensors"));
  auto lora = SafetensorsFile::open(lora_path);
  EXPECT_EQ(lora.metadata().at("ss_network_module"), "networks.lora");
  EXPECT_EQ(lora.metadata().at("ss_network_dim"), "4");
  EXPECT_EQ(lora.metadata().at("ss_network_alpha"), "2.0");
  EXPECT_EQ(lora.metadata().at("ss_steps"), "4");
  EXPECT_EQ(lora.metadata().at("ss_base_model_version"), "shoestring_tiny-unet");
  const TensorInfo* q = lora.find("lora_unet_mid_attn_blocks_0_attn1_to_q.lora_up.weight");
  ASSERT_NE(q, nullptr);
  EXPECT_GT(lora.get(*q).abs().max().item<float>(), 0.0f);  // trained
  ASSERT_NE(lora.find("lora_te_layers_0_attn_to_k.lora_down.weight"), nullptr);
  const TensorInfo* conv = lora.find("lora_unet_down_0_res_0_conv1.lora_down.weight");
  ASSERT_NE(conv, nullptr);
  EXPECT_EQ(conv->shape, (std::vector<int64_t>{2, 16, 3, 3}));
  EXPECT_EQ(lora.get("lora_unet_down_0_res_0_conv1.alpha").item<float>(), 1.0f);
  EXPECT_EQ(lora.get("lora_unet_mid_attn_blocks_0_attn1_to_q.alpha").item<float>(), 2.0f);

  // It loads back onto the base model, from the file alone or into a network
  // built from the same options, with the same values.
  auto from_file =
      nn::LoraNetworkImpl::from_file(*fresh, {{"lora_unet", "unet."}, {"lora_te", "text_encoder."}}, lora_path);
  EXPECT_EQ(from_file->modules().size() * 3, lora.tensors().size());
  auto values = load_safetensors(lora_path);
  for (const auto& p : from_file->named_parameters()) EXPECT_TRUE(torch::equal(p.value(), values.at(p.key())));
  from_file->detach();
  nn::LoraOptions o = nn::apply_network_args({}, cfg.network_args);
  o.rank = 4;
  o.alpha = 2.0;
  const std::vector<nn::LoraComponent> components = {{"lora_unet", "unet."}, {"lora_te", "text_encoder."}};
  nn::LoraNetwork again(*fresh, components, o);
  EXPECT_NO_THROW(again->load(lora_path));
}

TEST(LoraTraining, UnetOnlyAndResume) {
  TrainConfig full =
      lora_config(temp_dir("full"), pretrained_line() + "network_train_unet_only = true\nsave_precision = \"bf16\"\n");
  auto a = train(full, quiet());
  // save_precision applies to the final LoRA file only; checkpoints keep fp32.
  EXPECT_EQ(SafetensorsFile::open(a.run_dir + "/lora.safetensors").tensors()[0].dtype, StDtype::BF16);
  EXPECT_EQ(SafetensorsFile::open(a.run_dir + "/checkpoints/step-000004/lora.safetensors").tensors()[0].dtype,
            StDtype::F32);
  auto lora_a = load_safetensors(a.run_dir + "/lora.safetensors");
  for (const auto& [k, v] : lora_a) EXPECT_EQ(k.rfind("lora_unet_", 0), 0u) << k;
  EXPECT_GT(lora_a.at("lora_unet_mid_attn_blocks_0_attn2_to_v.lora_up.weight").abs().max().item<float>(), 0.0f);

  TrainConfig part = full;
  part.output_dir = temp_dir("part");
  part.max_train_steps = 2;
  auto b = train(part, quiet());
  TrainRunOptions resume = quiet();
  resume.resume_dir = b.run_dir;
  part.max_train_steps = 4;
  train(part, resume);
  EXPECT_EQ(losses_of(a.run_dir + "/metrics.jsonl"), losses_of(b.run_dir + "/metrics.jsonl"));
  auto lora_b = load_safetensors(b.run_dir + "/lora.safetensors");
  ASSERT_EQ(lora_a.size(), lora_b.size());
  for (const auto& [k, v] : lora_a) EXPECT_TRUE(torch::equal(v, lora_b.at(k))) << k;
}

TEST(LoraTraining, ConfigErrors) {
  auto msg = [](const std::string& text) {
    try {
      parse_config(text, "x.toml");
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  EXPECT_NE(msg("network_module = \"networks.lora\"\nnetwork_args = [\"rank=3\"]\n").find("unknown key 'rank'"),
            std::string::npos);
  EXPECT_NE(msg("network_module = \"networks.loha\"\n").find("network_module"), std::string::npos);
  EXPECT_NE(msg("network_args = [\"conv_dim=3\"]\n").find("need network_module"), std::string::npos);
}
