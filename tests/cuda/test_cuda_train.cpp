// A short training run on CUDA through the real executable
// (`shoestring train ... --device cuda`), on the tiny emoji model of the CLI
// tests. Skips when no CUDA device is present.
#include <unistd.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "../cli/run_cli.h"
#include "cuda_testing.h"

namespace fs = std::filesystem;

namespace shoestring {
namespace {

TEST(CudaTraining, ShortRunOnCudaFinishesAndWritesTheModel) {
  SHOESTRING_REQUIRE_CUDA();
  const std::string base =
      (fs::temp_directory_path() / ("shoestring_cuda_train_" + std::to_string(::getpid()))).string();
  fs::remove_all(base);
  fs::create_directories(base);
  const std::string cfg = base + "/config.toml";
  std::ofstream(cfg) << "train_data_dir = \"" << SHOESTRING_TEST_DATA << "/twemoji\"\n"
                     << "resolution = 16\ntrain_batch_size = 2\nmax_train_steps = 5\nnum_threads = 1\n"
                     << "sample_prompts = [\"red heart\"]\nsample_seeds = 1\nsample_steps = 2\n"
                     << "[model]\nbase_channels = 16\nchannel_mult = [1, 2]\nnum_res_blocks = 1\n"
                     << "attention_levels = [1]\nnum_heads = 2\nnorm_groups = 8\ntext_dim = 32\ntext_layers = 1\n";
  const auto r = testing::run_cli("train " + cfg + " --device cuda --output-dir " + base + "/run");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("step 5/5"), std::string::npos) << r.output;
  EXPECT_TRUE(fs::exists(base + "/run/model.safetensors")) << r.output;
  fs::remove_all(base);
}

}  // namespace
}  // namespace shoestring
