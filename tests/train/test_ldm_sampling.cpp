// `shoestring sample` for the LDM UNets (train/ldm_sampling.h) on tiny SD 1.5
// and SDXL runs: the grid drawn from the run's final file equals the DDIM
// grid the trainer drew at its last step (an independent path: cached
// prompt embeddings, variance-preserving DDIM steps); a step checkpoint
// (UNet only) samples like the final file; every sampler gives finite,
// seed-determined images of the requested size; bad requests are refused
// by name.
#include <filesystem>
#include <fstream>
#include <sstream>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../error_testing.h"
#include "shoestring/core/error.h"
#include "shoestring/data/image.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/train/config.h"
#include "shoestring/train/ldm_sampling.h"
#include "shoestring/train/trainer.h"
#include "train_testing.h"

namespace fs = std::filesystem;
using namespace shoestring;
using shoestring::testing::error_of;
using shoestring::testing::read_png;

namespace {

/// A tiny `arch` run of 2 steps whose last step draws a 1 x 1 DDIM grid of
/// "red heart" (2 steps, cfg 4) and saves a checkpoint at each step.
/// Returns the run folder; trains once per architecture per test binary.
const std::string& trained_run(const std::string& arch) {
  static std::map<std::string, std::string> runs;
  auto it = runs.find(arch);
  if (it != runs.end()) return it->second;
  const std::string out = shoestring::testing::fresh_temp_dir("test_ldm_sampling", arch);
  TrainConfig c = shoestring::testing::tiny_ldm_config(arch, out);
  c.max_train_steps = 2;
  c.save_every_n_steps = 1;
  train(c, shoestring::testing::quiet());
  return runs.emplace(arch, out).first->second;
}

LdmSampleRequest request_of(const std::string& prompt, SamplerKind sampler, double cfg = 4.0) {
  LdmSampleRequest r;
  r.images.prompts = {prompt};
  r.images.seeds = {0};
  r.images.steps = 2;
  r.images.cfg = cfg;
  r.sampler = sampler;
  return r;
}


}  // namespace

class LdmSampling : public ::testing::TestWithParam<std::string> {};

TEST_P(LdmSampling, FinalFileDrawsTheTrainersGrid) {
  const std::string& run = trained_run(GetParam());
  LdmSampleRequest r = request_of("red heart", SamplerKind::ddim);
  const LdmSamples drawn = sample_ldm_checkpoint(run + "/model.safetensors", r);
  EXPECT_EQ(drawn.architecture, GetParam());
  EXPECT_TRUE(drawn.tiny);
  EXPECT_EQ(drawn.unet_dtype, "fp32");
  const std::string png = run + "/drawn.png";
  save_sample_grid(png, drawn.images, r.images);
  const at::Tensor ours = read_png(png).to(torch::kInt32);
  const at::Tensor trainers = read_png(run + "/samples/step-000002.png").to(torch::kInt32);
  ASSERT_EQ(ours.sizes(), trainers.sizes());
  // Rounding differs (sigma vs alpha-bar coordinates): at most one level in a few pixels.
  EXPECT_LE((ours - trainers).abs().max().item<int>(), 2);
  EXPECT_LT((ours - trainers).abs().to(torch::kFloat64).mean().item<double>(), 0.05);
  // The image is not flat (the comparison would be empty otherwise).
  EXPECT_GT(drawn.images.to(torch::kFloat32).std().item<double>(), 1.0);
}

TEST_P(LdmSampling, StepCheckpointSamplesLikeTheFinalFile) {
  // checkpoints/step-000002 holds the final UNet without VAE or text
  // encoders: they come from the run (a tiny run's random ones, by its seed).
  const std::string& run = trained_run(GetParam());
  const LdmSampleRequest r = request_of("red heart", SamplerKind::euler);
  const at::Tensor final_file = sample_ldm_checkpoint(run + "/model.safetensors", r).images;
  const at::Tensor step = sample_ldm_checkpoint(run + "/checkpoints/step-000002/model.safetensors", r).images;
  EXPECT_TRUE(torch::equal(final_file, step));
  const at::Tensor first = sample_ldm_checkpoint(run + "/checkpoints/step-000001/model.safetensors", r).images;
  EXPECT_FALSE(torch::equal(first, step));  // another UNet
  // Copied out of its run folder, a step checkpoint has nothing to sample with.
  const std::string elsewhere = shoestring::testing::fresh_temp_dir("test_ldm_sampling", "lone");
  fs::create_directories(elsewhere);
  const std::string lone = elsewhere + "/model.safetensors";
  fs::copy_file(run + "/checkpoints/step-000002/model.safetensors", lone);
  const std::string msg = error_of([&] { sample_ldm_checkpoint(lone, r); });
  EXPECT_NE(msg.find("holds the UNet without"), std::string::npos) << msg;
  EXPECT_NE(msg.find("RUN_DIR/model.safetensors"), std::string::npos) << msg;
  fs::remove_all(elsewhere);
}

TEST_P(LdmSampling, EverySamplerDrawsSeededImagesOfTheRequestedSize) {
  const std::string& run = trained_run(GetParam());
  const int64_t m = GetParam() == "sd15" ? 64 : 32;  // the UNet's pixel multiple
  std::vector<at::Tensor> by_sampler;
  for (SamplerKind k : {SamplerKind::ddim, SamplerKind::euler, SamplerKind::euler_a, SamplerKind::dpmpp_2m}) {
    LdmSampleRequest r = request_of("red heart", k, 3.0);
    r.images.seeds = {3, 4};
    r.images.steps = 3;
    r.width = 2 * m;
    r.height = m;
    r.negative_prompt = "blurry";
    const LdmSamples a = sample_ldm_checkpoint(run + "/model.safetensors", r);
    ASSERT_EQ(a.images.sizes(), (std::vector<int64_t>{2, 3, m, 2 * m})) << sampler_name(k);
    EXPECT_EQ(a.width, 2 * m);
    if (k == SamplerKind::euler_a) {
      // Its per-step noise too comes from the seed.
      const LdmSamples b = sample_ldm_checkpoint(run + "/model.safetensors", r);
      EXPECT_TRUE(torch::equal(a.images, b.images)) << sampler_name(k);
    }
    EXPECT_FALSE(torch::equal(a.images[0], a.images[1])) << sampler_name(k) << ": seeds 3 and 4 drew the same";
    by_sampler.push_back(a.images);
  }
  for (size_t i = 1; i < by_sampler.size(); ++i) EXPECT_FALSE(torch::equal(by_sampler[0], by_sampler[i])) << i;
}

TEST_P(LdmSampling, RefusesWhatDoesNotFit) {
  const std::string& run = trained_run(GetParam());
  const std::string file = run + "/model.safetensors";
  LdmSampleRequest r = request_of("red heart", SamplerKind::ddim);
  r.width = GetParam() == "sd15" ? 96 : 48;
  const std::string size = error_of([&] { sample_ldm_checkpoint(file, r); });
  EXPECT_NE(size.find(GetParam() == "sd15" ? "multiples of 64" : "multiples of 32"), std::string::npos) << size;

  // A LoRA with text-encoder modules is refused by name before any work.
  const std::string lora = run + "/te.safetensors";
  save_safetensors(
      lora, {{"lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight", torch::zeros({4, 8}), std::nullopt}});
  r = request_of("red heart", SamplerKind::ddim);
  r.loras = {{lora, 1.0}};
  const std::string te = error_of([&] { sample_ldm_checkpoint(file, r); });
  EXPECT_NE(te.find(lora), std::string::npos) << te;
  EXPECT_NE(te.find("text-encoder"), std::string::npos) << te;

  r = request_of("bad \xff prompt", SamplerKind::ddim);
  const std::string utf8 = error_of([&] { sample_ldm_checkpoint(file, r); });
  EXPECT_NE(utf8.find("UTF-8"), std::string::npos) << utf8;
  r = request_of("red heart", SamplerKind::ddim);
  r.negative_prompt = "\xc3";
  EXPECT_NE(error_of([&] { sample_ldm_checkpoint(file, r); }).find("negative prompt"), std::string::npos);
  EXPECT_FALSE(is_ldm_checkpoint(lora));
}

INSTANTIATE_TEST_SUITE_P(Architectures, LdmSampling, ::testing::Values("sd15", "sdxl"));
