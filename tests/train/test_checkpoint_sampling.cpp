// `shoestring sample` for SD3.5 Medium and Stable Cascade stage C files
// (train/sd3_sampling.h, train/cascade_sampling.h) on tiny runs: the grid
// drawn from a run's final file equals the grid the trainer drew at its
// last step (the trainer samples from its cached prompt conditioning and its
// live module; the file path rebuilds every part from files and the run's
// config); a step checkpoint (the denoiser alone) samples like the final
// file; a LoRA run's grid is redrawn by merging its file into the base; bad
// requests are refused by name.
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../error_testing.h"
#include "shoestring/core/error.h"
#include "shoestring/data/image.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/train/cascade_sampling.h"
#include "shoestring/train/config.h"
#include "shoestring/train/sd3_sampling.h"
#include "shoestring/train/trainer.h"
#include "train_testing.h"

namespace fs = std::filesystem;
using namespace shoestring;
using shoestring::testing::error_of;
using shoestring::testing::read_png;

namespace {

bool is_sd3(const std::string& arch) { return arch == "sd35m"; }

TrainConfig config_of(const std::string& arch, const std::string& out, const std::string& extra = "") {
  TrainConfig c = shoestring::testing::tiny_ldm_config(arch, out, extra);
  c.resolution = 64;  // SD3: 8 x 8 latents, 4 x 4 patches; stage C: 2 x 2 EfficientNet latents
  return c;
}

/// A tiny `arch` run of 2 steps whose last step draws a 1 x 1 grid of "red
/// heart" (2 steps) and saves a checkpoint at each step, then a LoRA run of
/// 2 steps on its final file. Trains once per architecture per test binary.
struct Runs {
  std::string base, lora;
};
const Runs& trained(const std::string& arch) {
  static std::map<std::string, Runs> runs;
  auto it = runs.find(arch);
  if (it != runs.end()) return it->second;
  Runs r;
  r.base = shoestring::testing::fresh_temp_dir("test_checkpoint_sampling", arch);
  TrainConfig c = config_of(arch, r.base);
  c.max_train_steps = 2;
  c.save_every_n_steps = 1;
  train(c, shoestring::testing::quiet());
  r.lora = shoestring::testing::fresh_temp_dir("test_checkpoint_sampling", arch + "_lora");
  TrainConfig l = config_of(arch, r.lora,
                            "pretrained_model_name_or_path = \"" + r.base +
                                "/model.safetensors\"\nnetwork_module = \"networks.lora\"\nnetwork_dim = 2\n"
                                "network_alpha = 2\n");
  l.max_train_steps = 2;
  l.learning_rate = 5e-2;  // adapters far from zero, so that the merge shows
  train(l, shoestring::testing::quiet());
  return runs.emplace(arch, r).first->second;
}

SampleRequest images_of(const std::string& prompt, double cfg = TrainConfig{}.sample_cfg) {
  SampleRequest r;
  r.prompts = {prompt};
  r.seeds = {0};
  r.steps = 2;
  r.cfg = cfg;
  return r;
}

/// What `arch`'s sampler draws from `path` for `images` (LoRA files with their multipliers).
CheckpointSamples draw(const std::string& arch, const std::string& path, const SampleRequest& images,
                       const std::vector<std::pair<std::string, double>>& loras = {}, int64_t width = 0) {
  if (is_sd3(arch)) {
    Sd3SampleRequest r;
    r.images = images;
    r.loras = loras;
    r.width = width;
    return sample_sd3_checkpoint(path, r);
  }
  CascadeSampleRequest r;
  r.images = images;
  r.loras = loras;
  r.width = width;
  return sample_cascade_checkpoint(path, r);
}


/// The grid PNG `drawn` makes, as the trainer writes it, read back.
at::Tensor grid_of(const CheckpointSamples& drawn, const SampleRequest& images, const std::string& png) {
  save_sample_grid(png, drawn.images, images);
  return read_png(png).to(torch::kInt32);
}

}  // namespace

class CheckpointSampling : public ::testing::TestWithParam<std::string> {};

TEST_P(CheckpointSampling, FinalFileDrawsTheTrainersGrid) {
  const std::string& run = trained(GetParam()).base;
  const SampleRequest images = images_of("red heart");
  const CheckpointSamples drawn = draw(GetParam(), run + "/model.safetensors", images);
  EXPECT_EQ(drawn.architecture, GetParam());
  EXPECT_TRUE(drawn.tiny);
  EXPECT_EQ(drawn.denoiser_dtype, "fp32");
  EXPECT_EQ(drawn.width, 64);  // the run's resolution
  const at::Tensor ours = grid_of(drawn, images, run + "/drawn.png");
  const at::Tensor trainers = read_png(run + "/samples/step-000002.png").to(torch::kInt32);
  ASSERT_EQ(ours.sizes(), trainers.sizes());
  // The same computation in the same dtype: the same pixels.
  EXPECT_EQ((ours - trainers).abs().max().item<int>(), 0);
  // The image is not flat (the comparison would be empty otherwise).
  EXPECT_GT(drawn.images.to(torch::kFloat32).std().item<double>(), 1.0);
}

TEST_P(CheckpointSampling, StepCheckpointSamplesLikeTheFinalFile) {
  // checkpoints/step-000002 holds the trained denoiser alone: text encoders,
  // VAE or previewer come from the run (a tiny run's random ones, by its seed).
  const std::string& run = trained(GetParam()).base;
  const SampleRequest images = images_of("red heart", 3.0);
  const at::Tensor final_file = draw(GetParam(), run + "/model.safetensors", images).images;
  const at::Tensor step = draw(GetParam(), run + "/checkpoints/step-000002/model.safetensors", images).images;
  EXPECT_TRUE(torch::equal(final_file, step));
  const at::Tensor first = draw(GetParam(), run + "/checkpoints/step-000001/model.safetensors", images).images;
  EXPECT_FALSE(torch::equal(first, step));  // another denoiser
  // Copied out of its run folder, a tiny file has no encoders to sample with.
  const std::string elsewhere = shoestring::testing::fresh_temp_dir("test_checkpoint_sampling", "lone");
  fs::create_directories(elsewhere);
  const std::string lone = elsewhere + "/model.safetensors";
  fs::copy_file(run + "/model.safetensors", lone);
  const std::string msg = error_of([&] { draw(GetParam(), lone, images); });
  EXPECT_NE(msg.find("outside its run folder"), std::string::npos) << msg;
  EXPECT_NE(msg.find(lone), std::string::npos) << msg;
  fs::remove_all(elsewhere);
}

TEST_P(CheckpointSampling, LoraMergedIntoTheBaseDrawsTheLoraRunsGrid) {
  const Runs& runs = trained(GetParam());
  const std::string base = runs.base + "/model.safetensors", lora = runs.lora + "/lora.safetensors";
  const SampleRequest images = images_of("red heart");
  const CheckpointSamples merged = draw(GetParam(), base, images, {{lora, 1.0}});
  // The LoRA run sampled with the adapters beside the frozen weights; merging
  // them into the weights rounds differently: at most a level in a few pixels.
  const at::Tensor ours = grid_of(merged, images, runs.lora + "/drawn.png");
  const at::Tensor trainers = read_png(runs.lora + "/samples/step-000002.png").to(torch::kInt32);
  ASSERT_EQ(ours.sizes(), trainers.sizes());
  EXPECT_LE((ours - trainers).abs().max().item<int>(), 2);
  EXPECT_LT((ours - trainers).abs().to(torch::kFloat64).mean().item<double>(), 0.05);
  // The merge changes the images; multiplier 0 leaves the base's.
  const at::Tensor plain = draw(GetParam(), base, images).images;
  EXPECT_FALSE(torch::equal(plain, merged.images));
  EXPECT_TRUE(torch::equal(plain, draw(GetParam(), base, images, {{lora, 0.0}}).images));
}

TEST_P(CheckpointSampling, RefusesWhatDoesNotFit) {
  const std::string& run = trained(GetParam()).base;
  const std::string file = run + "/model.safetensors";
  const SampleRequest images = images_of("red heart");
  // SD3: multiples of 16 px (VAE 8 x patch 2); tiny stage C: of 32 px x its downscales.
  const std::string size = error_of([&] { draw(GetParam(), file, images, {}, 72); });
  EXPECT_NE(size.find("--width / --height: 72 x 64 px"), std::string::npos) << size;
  // A LoRA file of the other family's modules is refused before any work, by name.
  const std::string other = run + "/other_lora.safetensors";
  const std::string key = is_sd3(GetParam()) ? "lora_prior_unet_down_blocks_0.lora_down.weight"
                                             : "lora_unet_joint_blocks_0_x_block_attn_qkv.lora_down.weight";
  save_safetensors(other, {{key, torch::zeros({2, 8}), std::nullopt}});
  const std::string lora = error_of([&] { draw(GetParam(), file, images, {{other, 1.0}}); });
  EXPECT_NE(lora.find(other), std::string::npos) << lora;
  EXPECT_NE(lora.find(key), std::string::npos) << lora;
  EXPECT_NE(lora.find(is_sd3(GetParam()) ? "lora_unet_*" : "lora_prior_unet_*"), std::string::npos) << lora;
  if (is_sd3(GetParam())) {
    // A file that is not an SD3 VAE given as --vae: refused by name before the text and MMDiT passes.
    Sd3SampleRequest r;
    r.images = images;
    r.vae = trained("cascade-c").base + "/model.safetensors";
    const std::string vae = error_of([&] { sample_sd3_checkpoint(file, r); });
    EXPECT_NE(vae.find("--vae '" + r.vae + "': expected the SD3 VAE (tiny)"), std::string::npos) << vae;
  } else {
    // Stage C's attention grows with the square of the latent count: at most 4096 px a side.
    const std::string big = error_of([&] { draw(GetParam(), file, images, {}, 8192); });
    EXPECT_NE(big.find("at most 4096 px a side"), std::string::npos) << big;
  }
  // An empty LoRA file merges nothing: refused rather than drawing the base's images.
  const std::string empty = run + "/empty_lora.safetensors";
  save_safetensors(empty, {});
  const std::string none = error_of([&] { draw(GetParam(), file, images, {{empty, 1.0}}); });
  EXPECT_NE(none.find("--lora " + empty + ": holds no tensors"), std::string::npos) << none;
  const std::string utf8 = error_of([&] { draw(GetParam(), file, images_of("bad \xff prompt")); });
  EXPECT_NE(utf8.find("UTF-8"), std::string::npos) << utf8;
  // Each family's test refuses the other's files and the LDM files.
  EXPECT_EQ(is_sd3_checkpoint(file), is_sd3(GetParam()));
  EXPECT_EQ(is_cascade_checkpoint(file), !is_sd3(GetParam()));
  const std::string wrong = error_of([&] { draw(is_sd3(GetParam()) ? "cascade-c" : "sd35m", file, images); });
  EXPECT_NE(wrong.find(is_sd3(GetParam()) ? "holds no Stable Cascade stage C" : "holds no SD3.5 Medium MMDiT"),
            std::string::npos)
      << wrong;
}

INSTANTIATE_TEST_SUITE_P(Architectures, CheckpointSampling, ::testing::Values("sd35m", "cascade-c"));
