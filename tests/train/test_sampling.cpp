// Sampling guards: non-finite model output is an error naming the prompt and
// seed, never a black PNG.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "../error_testing.h"
#include "shoestring/core/error.h"
#include "shoestring/core/text.h"
#include "shoestring/data/tokenizer.h"
#include "shoestring/train/sampling.h"
#include "shoestring/train/tiny_unet_model.h"
#include "train_testing.h"

using namespace shoestring;

using shoestring::testing::error_of;

namespace {

SampleRequest two_by_two() {
  SampleRequest req;
  req.prompts = {"red heart", "sun"};
  req.seeds = {7, 8};
  req.steps = 2;
  return req;
}

}  // namespace

TEST(Sampling, FiniteSamplesConvertToBytes) {
  // Values and their bytes by (clamp(x, -1, 1) + 1) * 127.5, rounded: worked by hand.
  at::Tensor x = torch::tensor({-1.0f, 1.0f, 2.0f, -3.0f, -0.5f, 0.5f}).reshape({1, 3, 1, 2}).repeat({4, 1, 1, 1});
  at::Tensor bytes = samples_to_uint8(x, two_by_two());
  ASSERT_EQ(bytes.scalar_type(), torch::kUInt8);
  ASSERT_EQ(bytes.sizes(), (std::vector<int64_t>{4, 3, 1, 2}));
  const std::vector<int64_t> want = {0, 255, 255, 0, 64, 191};
  for (int64_t i = 0; i < 4; ++i) {
    at::Tensor row = bytes[i].flatten().to(torch::kLong);
    EXPECT_EQ(std::vector<int64_t>(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + 6), want) << i;
  }
  EXPECT_NE(error_of([&] { samples_to_uint8(x.narrow(0, 0, 3), two_by_two()); }).find("3 images for 2 prompts x 2"),
            std::string::npos);
}

TEST(Sampling, NonFiniteSamplesAreAnErrorNamingPromptAndSeed) {
  at::Tensor x = torch::zeros({4, 3, 4, 4});
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  // Image 2 = prompt "sun", seed 7: NaN in 3 pixels (one of them in two channels).
  x[2][0][0][0] = nan;
  x[2][1][0][0] = nan;
  x[2][2][1][3] = nan;
  x[2][0][3][3] = nan;
  // Image 3 = "sun", seed 8: an infinite pixel.
  x[3][1][2][2] = -inf;
  const std::string msg = error_of([&] { samples_to_uint8(x, two_by_two()); });
  EXPECT_NE(msg.find("NaN and inf"), std::string::npos) << msg;
  EXPECT_NE(msg.find("in 3 of 16 pixels for prompt 'sun' seed 7"), std::string::npos) << msg;
  EXPECT_NE(msg.find("2 of 4 images"), std::string::npos) << msg;

  at::Tensor only_inf = torch::zeros({4, 3, 4, 4});
  only_inf[0][0][1][1] = inf;
  const std::string msg2 = error_of([&] { samples_to_uint8(only_inf, two_by_two()); });
  EXPECT_NE(msg2.find("produced inf in 1 of 16 pixels for prompt 'red heart' seed 7 (1 of 4"), std::string::npos)
      << msg2;
}

// The path of `shoestring sample` and of the trainer's sample grids
// (TinyUNetTrainingModel::sample): NaN weights give an error, not black images.
TEST(Sampling, NanWeightsMakeGenerateImagesFail) {
  auto cfg = shoestring::testing::tiny_emoji_config("unused");
  auto tok = WordTokenizer::build({"red heart", "sun"}, cfg.max_caption_length);
  TinyUNetModel model(TinyUNetModelOptions::from_config(cfg, tok.vocab_size()));
  {
    torch::NoGradGuard ng;
    for (auto& p : model->parameters()) p.fill_(std::numeric_limits<float>::quiet_NaN());
  }
  const std::string msg = error_of([&] { generate_images(model, tok, two_by_two()); });
  EXPECT_NE(msg.find("produced NaN in 256 of 256 pixels for prompt 'red heart' seed 7 (4 of 4 images"),
            std::string::npos)
      << msg;
}

// A prompt with newlines and escape sequences keeps to its own line of the
// sidecar (line 1 + row), as core/text.h's printable writes it.
TEST(Sampling, SidecarHasOneEscapedLinePerPrompt) {
  const std::string dir = shoestring::testing::fresh_temp_dir("sampling", "sidecar");
  std::filesystem::create_directories(dir);
  SampleRequest req = two_by_two();
  req.prompts = {"red\nheart\x1b[31m", "sun"};
  save_sample_grid(dir + "/grid.png", torch::zeros({4, 3, 8, 8}, torch::kUInt8), req);
  std::ifstream in(dir + "/grid.txt");
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[1], printable(req.prompts[0]));
  EXPECT_EQ(lines[1], "red\\nheart\\x1b[31m");
  EXPECT_EQ(lines[2], "sun");
  std::filesystem::remove_all(dir);
}

TEST(Sampling, InvalidUtf8PromptIsAnErrorNamingIt) {
  auto cfg = shoestring::testing::tiny_emoji_config("unused");
  auto tok = WordTokenizer::build({"red heart", "sun"}, cfg.max_caption_length);
  TinyUNetModel model(TinyUNetModelOptions::from_config(cfg, tok.vocab_size()));
  SampleRequest req = two_by_two();
  req.prompts[1] = "su\xffn";
  const std::string msg = error_of([&] { generate_images(model, tok, req); });
  EXPECT_NE(msg.find("prompt 2 is not valid UTF-8 (byte 2): 'su\\xffn'"), std::string::npos) << msg;
}
