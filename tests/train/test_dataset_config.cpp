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

// Stable Cascade with flip_aug: the mirror images' EfficientNet latents are
// encoded beside the originals and drawn half the time, as the LDM families do.
TEST(DatasetConfig, TinyCascadeTrainsWithFlipAug) {
  const std::string out = shoestring::testing::fresh_temp_dir("test_dataset_config", "cascade_flip");
  const fs::path data = fs::path(out + "_data");
  fs::remove_all(data);
  fs::create_directories(data / "square");
  for (int i = 0; i < 4; ++i) {
    write_image(data / "square" / fmt::format("s{}.png", i), 64, 64, i);
    write_text(data / "square" / fmt::format("s{}.caption", i), fmt::format("square picture {}\n", i));
  }
  auto run = [&](bool flip) {
    write_text(data / "datasets.toml",
               fmt::format("[general]\nenable_bucket = true\nresolution = 64\nmin_bucket_reso = 32\nmax_bucket_reso = "
                           "128\nbucket_reso_steps = 32\n"
                           "batch_size = 2\n[[datasets]]\n  [[datasets.subsets]]\n  image_dir = \"{}/square\"\n"
                           "  caption_extension = \".caption\"\n  flip_aug = {}\n",
                           data.string(), flip ? "true" : "false"));
    TrainConfig c =
        parse_config(fmt::format("dataset_config = \"{}/datasets.toml\"\nresolution = 64\nmax_train_steps = 4\n"
                                 "learning_rate = 2e-3\nseed = 5\nnum_threads = 1\noutput_dir = \"{}\"\n[model]\n"
                                 "architecture = \"cascade-c\"\ntiny = true\n",
                                 data.string(), out + (flip ? "_flip" : "_plain")),
                     "cascade_flip.toml");
    return shoestring::testing::losses_of(train(c, shoestring::testing::quiet()).run_dir + "/metrics.jsonl");
  };
  const auto flipped = run(true), plain = run(false);
  ASSERT_EQ(flipped.size(), 4u);
  for (double l : flipped) EXPECT_TRUE(std::isfinite(l));
  EXPECT_NE(flipped, plain);
  fs::remove_all(data);
  fs::remove_all(out + "_flip");
  fs::remove_all(out + "_plain");
}

// kohya's folder names (config_util.py, extract_dreambooth_params): the name
// split at '_', the first part the repeats, the rest joined by '_' the class
// tokens; anything else is no repeats folder.
TEST(DatasetConfig, ParsesKohyasRepeatsFolderNames) {
  struct Good {
    const char* name;
    int64_t repeats;
    const char* tokens;
  };
  for (const Good& g :
       {Good{"10_sks dog", 10, "sks dog"}, Good{"10_sks_dog", 10, "sks_dog"}, Good{"3", 3, ""}, Good{"0_x", 0, "x"},
        Good{"007_a b", 7, "a b"}, Good{"10_", 10, ""}, Good{"1_ünïcode", 1, "ünïcode"}}) {
    const std::optional<RepeatsFolderName> p = parse_repeats_folder_name(g.name);
    ASSERT_TRUE(p) << g.name;
    EXPECT_EQ(p->num_repeats, g.repeats) << g.name;
    EXPECT_EQ(p->class_tokens, g.tokens) << g.name;
  }
  for (const char* bad : {"sks dog", "_10", "10sks", "x_10", "-1_a", "+1_a", " 10_a", ""}) {
    EXPECT_FALSE(parse_repeats_folder_name(bad)) << bad;
  }
  const std::string big = error_of([] { parse_repeats_folder_name("99999999_x"); });
  EXPECT_NE(big.find("99999999_x"), std::string::npos) << big;
}

TEST(DatasetConfig, RepeatsFoldersBecomeOneSubsetEach) {
  const fs::path dir = shoestring::testing::fresh_temp_dir("test_dataset_config", "repeats");
  fs::create_directories(dir / "10_sks dog");
  fs::create_directories(dir / "2_cat" / "nested");  // not listed: kohya's glob is not recursive
  fs::create_directories(dir / ".hidden");
  write_image(dir / "10_sks dog" / "a.png", 40, 32, 1);
  write_image(dir / "10_sks dog" / "b.png", 32, 40, 2);
  write_text(dir / "10_sks dog" / "b.txt", "a photo of sks dog");
  write_image(dir / "2_cat" / "c.png", 32, 32, 3);
  write_image(dir / "2_cat" / "nested" / "d.png", 32, 32, 4);
  const TrainConfig c = sdxl_main(fmt::format("train_data_dir = \"{}\"\n", dir.string()));
  EXPECT_TRUE(has_repeats_folders(dir.string()));
  EXPECT_TRUE(uses_kohya_datasets(c));
  const std::vector<DatasetSpec> specs = dataset_specs(c);
  ASSERT_EQ(specs.size(), 1u);
  ASSERT_EQ(specs[0].subsets.size(), 2u);  // in name order
  EXPECT_EQ(specs[0].subsets[0].image_dir, (dir / "10_sks dog").string());
  EXPECT_EQ(specs[0].subsets[0].num_repeats, 10);
  EXPECT_EQ(specs[0].subsets[0].class_tokens, "sks dog");
  EXPECT_FALSE(specs[0].subsets[0].recursive);
  EXPECT_EQ(specs[0].subsets[1].num_repeats, 2);
  EXPECT_EQ(specs[0].subsets[1].class_tokens, "cat");

  // Loaded: class tokens caption the image without a caption file, and each
  // image is num_repeats entries of an epoch.
  const ImageCaptionDataset ds = ImageCaptionDataset::load_buckets(specs, 1);
  ASSERT_EQ(ds.size(), 3);
  int64_t want_entries = 0;
  for (int64_t i = 0; i < ds.size(); ++i) {
    const bool dog = ds.paths()[static_cast<size_t>(i)].find("10_sks dog") != std::string::npos;
    EXPECT_EQ(ds.num_repeats(i), dog ? 10 : 2);
    want_entries += ds.num_repeats(i);
  }
  int64_t entries = 0;
  for (const SamplerBucket& b : sampler_buckets(ds)) entries += static_cast<int64_t>(b.samples.size());
  EXPECT_EQ(entries, 10 * 2 + 2 * 1);
  EXPECT_EQ(entries, want_entries);
  const auto& caps = ds.captions();
  EXPECT_NE(std::find(caps.begin(), caps.end(), "sks dog"), caps.end());             // a.png: no caption file
  EXPECT_NE(std::find(caps.begin(), caps.end(), "a photo of sks dog"), caps.end());  // b.txt
  EXPECT_NE(std::find(caps.begin(), caps.end(), "cat"), caps.end());

  // A folder of another name is an error naming it and the expected form.
  fs::create_directories(dir / "dogs");
  const std::string bad = error_of([&] { dataset_specs(c); });
  EXPECT_NE(bad.find((dir / "dogs").string()), std::string::npos) << bad;
  EXPECT_NE(bad.find("<repeats>_<class tokens>"), std::string::npos) << bad;
  fs::remove_all(dir / "dogs");
  // So is an image in no subfolder, and dataset_repeats, which the names contradict.
  write_image(dir / "loose.png", 32, 32, 5);
  const std::string loose = error_of([&] { dataset_specs(c); });
  EXPECT_NE(loose.find((dir / "loose.png").string()), std::string::npos) << loose;
  fs::remove(dir / "loose.png");
  const std::string repeats = error_of(
      [&] { dataset_specs(sdxl_main(fmt::format("train_data_dir = \"{}\"\ndataset_repeats = 3\n", dir.string()))); });
  EXPECT_NE(repeats.find("dataset_repeats"), std::string::npos) << repeats;
  // The emoji model refuses the layout, naming it.
  const std::string tiny = error_of(
      [&] { check_training_config(parse_config(fmt::format("train_data_dir = \"{}\"\n", dir.string()), "t.toml")); });
  EXPECT_NE(tiny.find("<repeats>_<class tokens>"), std::string::npos) << tiny;
  fs::remove_all(dir);
}

TEST(DatasetConfig, AFolderWithoutRepeatsFoldersLoadsAsBefore) {
  const std::string folder = std::string(SHOESTRING_TEST_DATA) + "/folder";  // has nested/, no <n>_ folder
  EXPECT_FALSE(has_repeats_folders(folder));
  const TrainConfig c = sdxl_main(fmt::format("train_data_dir = \"{}\"\n", folder));
  EXPECT_FALSE(uses_kohya_datasets(c));
  const TrainConfig b = sdxl_main(fmt::format("train_data_dir = \"{}\"\nenable_bucket = true\n", folder));
  const std::vector<DatasetSpec> specs = dataset_specs(b);
  ASSERT_EQ(specs[0].subsets.size(), 1u);
  EXPECT_TRUE(specs[0].subsets[0].recursive);
  EXPECT_FALSE(has_repeats_folders("/nonexistent/shoestring"));
}

// An epoch counts repeats, as kohya's: a tiny SDXL run over repeats folders
// trains max_train_epochs x ceil(batches / accumulation) steps, where a
// bucket of n entries (images x repeats) makes ceil(n / batch_size) batches
// (kohya's BucketManager, one process).
TEST(DatasetConfig, TinySdxlTrainsEpochsOfRepeatsFolders) {
  const std::string out = shoestring::testing::fresh_temp_dir("test_dataset_config", "repeat_epochs");
  const fs::path data = fs::path(out + "_data");
  fs::remove_all(data);
  fs::create_directories(data / "3_sks dog");
  fs::create_directories(data / "1_dog");
  for (int i = 0; i < 2; ++i) write_image(data / "3_sks dog" / fmt::format("d{}.png", i), 64, 64, i);
  write_image(data / "1_dog" / "c.png", 64, 64, 3);
  TrainConfig c = parse_config(fmt::format("train_data_dir = \"{}\"\n"
                                           "resolution = 64\n"
                                           "train_batch_size = 2\n"
                                           "max_train_epochs = 2\n"
                                           "learning_rate = 2e-3\n"
                                           "seed = 5\n"
                                           "num_threads = 1\n"
                                           "sample_prompts = [\"sks dog\"]\n"
                                           "sample_seeds = 1\n"
                                           "sample_steps = 2\n"
                                           "output_dir = \"{}\"\n"
                                           "[model]\narchitecture = \"sdxl\"\ntiny = true\n",
                                           data.string(), out),
                               "repeat_epochs.toml");
  const int64_t entries = 2 * 3 + 1 * 1;  // one bucket (no enable_bucket): every image at 64 x 64
  const int64_t batches = (entries + c.train_batch_size - 1) / c.train_batch_size;
  const int64_t steps =
      c.max_train_epochs * ((batches + c.gradient_accumulation_steps - 1) / c.gradient_accumulation_steps);
  const auto summary = train(c, shoestring::testing::quiet());
  EXPECT_EQ(summary.last_step, steps);
  EXPECT_EQ(shoestring::testing::losses_of(summary.run_dir + "/metrics.jsonl").size(), static_cast<size_t>(steps));
  fs::remove_all(data);
  fs::remove_all(out);
}
