// kohya's dataset TOML (train/dataset_config.h): keys resolved subset ->
// dataset -> [general] -> main config as kohya resolves them, the errors
// naming file, table and key; the families' checks; and an end-to-end tiny
// SDXL run over two aspect-ratio buckets from a dataset TOML with a
// DreamBooth-style subset and a fine-tuning metadata subset.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <torch/torch.h>

#include "../error_testing.h"
#include "shoestring/core/error.h"
#include "shoestring/data/image.h"
#include "shoestring/train/config.h"
#include "shoestring/train/dataset_config.h"
#include "shoestring/train/trainer.h"
#include "shoestring/train/training_model.h"
#include "train_testing.h"

namespace fs = std::filesystem;
using namespace shoestring;
using shoestring::testing::error_of;

namespace {

void write_text(const fs::path& p, const std::string& text) { std::ofstream(p) << text; }

TrainConfig sdxl_main(const std::string& extra = "") {
  return parse_config(extra + "[model]\narchitecture = \"sdxl\"\ntiny = true\n", "main.toml");
}

std::string message_of(const std::string& toml, const TrainConfig& c = sdxl_main()) {
  return error_of([&] { parse_dataset_config(toml, "d.toml", c); });
}

/// A w x h image of smooth colours (a different one per `seed`).
void write_image(const fs::path& p, int w, int h, int seed) {
  auto g = torch::linspace(0, 1, w).view({1, w, 1}) * torch::linspace(1, 0, h).view({h, 1, 1});
  auto img = (torch::cat({g, 1 - g, g * 0 + 0.1 * seed}, 2).clamp(0, 1) * 255).to(torch::kUInt8);
  save_png(p.string(), img);
}

}  // namespace

TEST(DatasetConfig, KeysFallBackAsKohyaResolvesThem) {
  const TrainConfig main = sdxl_main("train_batch_size = 3\ncaption_extension = \".cap\"\n");
  const auto specs = parse_dataset_config(R"(
[general]
enable_bucket = true
num_repeats = 2
flip_aug = true

[[datasets]]
resolution = [64, 96]
min_bucket_reso = 32

  [[datasets.subsets]]
  image_dir = "/data/a"
  num_repeats = 5
  class_tokens = "sks dog"

  [[datasets.subsets]]
  image_dir = "/data/b"
  flip_aug = false
  caption_extension = ".txt"

[[datasets]]
resolution = 128
batch_size = 1
enable_bucket = false

  [[datasets.subsets]]
  metadata_file = "/data/meta.json"
  image_dir = "/data/c"
)",
                                          "d.toml", main);
  ASSERT_EQ(specs.size(), 2u);
  EXPECT_EQ(specs[0].buckets.resolution, (BucketReso{64, 96}));
  EXPECT_TRUE(specs[0].buckets.enable_bucket);        // [general]
  EXPECT_EQ(specs[0].buckets.min_bucket_reso, 32);    // dataset
  EXPECT_EQ(specs[0].buckets.max_bucket_reso, 1024);  // kohya's default, through the main config
  EXPECT_EQ(specs[0].buckets.bucket_reso_steps, 64);
  EXPECT_EQ(specs[0].batch_size, 3);  // main config's train_batch_size
  ASSERT_EQ(specs[0].subsets.size(), 2u);
  EXPECT_EQ(specs[0].subsets[0].num_repeats, 5);
  EXPECT_EQ(specs[0].subsets[1].num_repeats, 2);
  EXPECT_EQ(specs[0].subsets[0].class_tokens, "sks dog");
  EXPECT_TRUE(specs[0].subsets[0].flip_aug);
  EXPECT_FALSE(specs[0].subsets[1].flip_aug);
  EXPECT_EQ(specs[0].subsets[0].caption_extension, ".cap");  // main config
  EXPECT_EQ(specs[0].subsets[1].caption_extension, ".txt");
  EXPECT_FALSE(specs[0].subsets[0].recursive);  // kohya's glob_images
  EXPECT_EQ(specs[1].buckets.resolution, (BucketReso{128, 128}));
  EXPECT_FALSE(specs[1].buckets.enable_bucket);
  EXPECT_EQ(specs[1].batch_size, 1);
  EXPECT_EQ(specs[1].subsets[0].metadata_file, "/data/meta.json");
  EXPECT_NE(specs[1].subsets[0].where.find("d.toml: datasets[1].subsets[0]"), std::string::npos);
}

TEST(DatasetConfig, ErrorsNameTheFileTableAndKey) {
  auto has = [](const std::string& m, const std::string& part) {
    EXPECT_NE(m.find(part), std::string::npos) << "expected \"" << part << "\" in: " << m;
  };
  has(message_of("[general]\nenable_buckets = true\n[[datasets]]\n[[datasets.subsets]]\nimage_dir = \"x\"\n"),
      "d.toml:2: [general]: unknown key 'enable_buckets' (did you mean 'enable_bucket'?)");
  has(message_of("[[datasets]]\ncolor_aug = true\n[[datasets.subsets]]\nimage_dir = \"x\"\n"),
      "datasets[0]: 'color_aug' is a kohya dataset key shoestring does not implement");
  has(message_of("[general]\nimage_dir = \"x\"\n[[datasets]]\n[[datasets.subsets]]\nimage_dir = \"x\"\n"),
      "[general]: 'image_dir' cannot be set here; kohya takes it in [[datasets.subsets]]");
  has(message_of("[[datasets]]\n[[datasets.subsets]]\nimage_dir = \"x\"\nbatch_size = 2\n"),
      "datasets[0].subsets[0]: 'batch_size' cannot be set here");
  has(message_of("[[datasets]]\nresolution = [64]\n[[datasets.subsets]]\nimage_dir = \"x\"\n"),
      "invalid value for 'resolution': expected an integer or [width, height]");
  has(message_of("[[datasets]]\n[[datasets.subsets]]\nnum_repeats = \"3\"\nimage_dir = \"x\"\n"),
      "d.toml:3: datasets[0].subsets[0]: invalid value for 'num_repeats': expected an integer");
  has(message_of("[[datasets]]\n[[datasets.subsets]]\nnum_repeats = 3\n"), "datasets[0].subsets[0]: needs image_dir");
  has(message_of("[[datasets]]\n[[datasets.subsets]]\nimage_dir = \"x\"\n[[datasets.subsets]]\nmetadata_file = "
                 "\"m.json\"\n"),
      "datasets[0] mixes fine-tuning subsets");
  has(message_of("[[datasets]]\n[[datasets.subsets]]\nmetadata_file = \"m.json\"\nclass_tokens = \"x\"\n"),
      "'class_tokens' does not apply to a fine-tuning subset");
  has(message_of("resolution = 512\n[[datasets]]\n"), "unknown top-level key 'resolution'");
  has(message_of("[general]\n"), "no [[datasets]]");
  has(message_of("[[datasets]]\nresolution = 64\n"), "datasets[0] has no [[datasets.subsets]]");
  // Main-config contradictions, and the families' checks.
  has(error_of([] { dataset_specs(sdxl_main("dataset_config = \"d.toml\"\nin_json = \"m.json\"\n")); }),
      "dataset_config and in_json are both set");
  has(error_of([] { dataset_specs(sdxl_main("dataset_config = \"d.toml\"\ntrain_data_dir = \"/x\"\n")); }),
      "dataset_config and train_data_dir are both set");
  const TrainConfig main = sdxl_main("resolution = 64\n");
  auto specs_of = [&](const std::string& toml) { return parse_dataset_config(toml, "d.toml", main); };
  has(error_of([&] {
        check_training_datasets(main, specs_of("[[datasets]]\nenable_bucket = true\nbucket_reso_steps = 16\n"
                                               "min_bucket_reso = 32\n[[datasets.subsets]]\nimage_dir = \"x\"\n"));
      }),
      "d.toml: datasets[0]: bucket_reso_steps = 16: sdxl needs bucket sides that are multiples of 32");
  has(error_of([&] {
        check_training_datasets(main, specs_of("[[datasets]]\n[[datasets.subsets]]\nimage_dir = \"x\"\n"
                                               "random_crop = true\n"));
      }),
      "d.toml: datasets[0].subsets[0]: random_crop: model.architecture = \"sdxl\" encodes each image to latents once");
  has(error_of([&] {
        check_training_datasets(main, specs_of("[general]\nshuffle_caption = true\n[[datasets]]\n"
                                               "[[datasets.subsets]]\nimage_dir = \"x\"\n"));
      }),
      "shuffle_caption");
  // The emoji example stays square: kohya datasets are refused with a reason.
  has(error_of([] { check_training_config(parse_config("enable_bucket = true\n", "e.toml")); }),
      "enable_bucket: the emoji example's tiny-unet trains square images from train_data_dir only");
}

TEST(DatasetConfig, TinySdxlTrainsOnTwoBucketsFromADatasetToml) {
  const std::string out = shoestring::testing::fresh_temp_dir("test_dataset_config", "two_buckets");
  const fs::path data = fs::path(out + "_data");
  fs::remove_all(data);
  fs::create_directories(data / "wide");
  fs::create_directories(data / "square");
  // resolution 64, steps 32: buckets 32x96 .. 128x32; 96x32 images train at
  // 96x32 (a predefined bucket), 64x64 ones at 64x64.
  for (int i = 0; i < 3; ++i) {
    write_image(data / "square" / fmt::format("s{}.png", i), 64, 64, i);
    write_text(data / "square" / fmt::format("s{}.caption", i), fmt::format("square picture {}\n", i));
  }
  for (int i = 0; i < 2; ++i) write_image(data / "wide" / fmt::format("w{}.png", i), 96, 32, i);
  write_text(data / "wide" / "meta.json", R"({"w0": {"caption": "wide picture", "tags": "banner"},
                                                "w1": {"tags": "panorama"}})");
  write_text(data / "datasets.toml", fmt::format(R"(
[general]
enable_bucket = true
resolution = 64
min_bucket_reso = 32
max_bucket_reso = 128
bucket_reso_steps = 32
batch_size = 2

[[datasets]]
  [[datasets.subsets]]
  image_dir = "{0}/square"
  caption_extension = ".caption"
  flip_aug = true

[[datasets]]
  [[datasets.subsets]]
  image_dir = "{0}/wide"
  metadata_file = "{0}/wide/meta.json"
  num_repeats = 2
)",
                                                 data.string()));
  TrainConfig c = parse_config(fmt::format("dataset_config = \"{}/datasets.toml\"\n"
                                           "resolution = 64\n"
                                           "max_train_steps = 5\n"
                                           "learning_rate = 2e-3\n"
                                           "caption_dropout_rate = 0.0\n"
                                           "seed = 5\n"
                                           "num_threads = 1\n"
                                           "sample_prompts = [\"wide picture\"]\n"
                                           "sample_seeds = 1\n"
                                           "sample_steps = 2\n"
                                           "output_dir = \"{}\"\n"
                                           "[model]\narchitecture = \"sdxl\"\ntiny = true\n",
                                           data.string(), out),
                               "two_buckets.toml");
  const auto summary = train(c, shoestring::testing::quiet());
  const auto losses = shoestring::testing::losses_of(summary.run_dir + "/metrics.jsonl");
  ASSERT_EQ(losses.size(), 5u);
  for (double l : losses) EXPECT_TRUE(std::isfinite(l));
  // The sample grid is one image at the dataset's resolution (64 x 64 + padding).
  EXPECT_TRUE(fs::exists(summary.last_sample));
  fs::remove_all(data);
}
