// Helpers shared by the trainer tests (tests/train/*): per-test temp run
// folders, quiet run options and the loss column of metrics.jsonl.
#pragma once
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <fmt/format.h>

#include "../error_testing.h"
#include "shoestring/data/image.h"
#include "shoestring/train/config.h"
#include "shoestring/train/trainer.h"

namespace shoestring::testing {

/// The pixels of a PNG (a sample grid), uint8 [3, H, W].
inline at::Tensor read_png(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream bytes;
  bytes << in.rdbuf();
  const auto [w, h] = image_file_size(path);
  return decode_image_fitted(bytes.str(), path, w, h, 0, 0, w, h);
}

/// "<tmp>/shoestring_<tag>_<name>_<pid>", removed if it exists (not created:
/// the trainer creates its output_dir). `tag` keeps test files apart.
inline std::string fresh_temp_dir(const std::string& tag, const std::string& name) {
  namespace fs = std::filesystem;
  fs::path p = fs::temp_directory_path() / ("shoestring_" + tag + "_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p.string();
}

/// Run options without the progress line.
inline TrainRunOptions quiet() {
  TrainRunOptions o;
  o.quiet = true;
  return o;
}

/// The "loss" of every line of a metrics.jsonl file, in order.
inline std::vector<double> losses_of(const std::string& metrics_path) {
  std::vector<double> out;
  std::ifstream in(metrics_path);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) out.push_back(nlohmann::json::parse(line)["loss"].get<double>());
  }
  return out;
}

/// The losses of a run folder's metrics.jsonl.
inline std::vector<double> run_losses(const std::string& run_dir) { return losses_of(run_dir + "/metrics.jsonl"); }

/// The last step's record of a run's metrics.jsonl.
inline nlohmann::json last_step_record(const std::string& run_dir) {
  std::ifstream in(run_dir + "/metrics.jsonl");
  std::string line, last;
  while (std::getline(in, line)) {
    if (!line.empty()) last = line;
  }
  return nlohmann::json::parse(last);
}

/// The message of the shoestring::Error training `config` throws ("" when it trains).
inline std::string train_error(const TrainConfig& config) {
  return error_of([&] { train(config, quiet()); });
}

/// The emoji example's model at a size that trains a few steps in a second
/// or two on the committed Twemoji fixtures (16 px, batch 4, 6 steps, one
/// sample per prompt), writing to `out`; `extra` is TOML added before the
/// [model] table.
inline TrainConfig tiny_emoji_config(const std::string& out, const std::string& extra = "") {
  std::string text = fmt::format(
      "train_data_dir = \"{}/twemoji\"\n"
      "resolution = 16\n"
      "train_batch_size = 4\n"
      "max_train_steps = 6\n"
      "learning_rate = 1e-3\n"
      "seed = 3\n"
      "num_threads = 1\n"
      "sample_prompts = [\"red heart\"]\n"
      "sample_seeds = 1\n"
      "sample_steps = 2\n"
      "output_dir = \"{}\"\n"
      "{}\n"
      "[model]\n"
      "base_channels = 16\nchannel_mult = [1, 2]\nnum_res_blocks = 1\nattention_levels = [1]\n"
      "num_heads = 2\nnorm_groups = 8\ntext_dim = 32\ntext_layers = 1\n",
      SHOESTRING_TEST_DATA, out, extra);
  return parse_config(text, "tiny.toml");
}

/// A tiny `arch` (sd15, sdxl, ssd1b) run of 8 steps on the Twemoji fixture,
/// with `extra` TOML lines before [model].
inline TrainConfig tiny_ldm_config(const std::string& arch, const std::string& out, const std::string& extra = "") {
  // sd15 has three UNet downsamplings (x8 VAE): 64 px -> 8x8 latents;
  // sdxl/ssd1b have two: 32 px -> 4x4 latents.
  const int resolution = arch == "sd15" ? 64 : 32;
  std::string text = fmt::format(
      "train_data_dir = \"{}/twemoji\"\n"
      "resolution = {}\n"
      "train_batch_size = 4\n"
      "max_train_steps = 8\n"
      "learning_rate = 2e-3\n"
      "caption_dropout_rate = 0.0\n"
      "seed = 5\n"
      "num_threads = 1\n"
      "sample_prompts = [\"red heart\"]\n"
      "sample_seeds = 1\n"
      "sample_steps = 2\n"
      "output_dir = \"{}\"\n"
      "{}"
      "[model]\n"
      "architecture = \"{}\"\n"
      "tiny = true\n",
      SHOESTRING_TEST_DATA, resolution, out, extra, arch);
  return parse_config(text, arch + ".toml");
}

}  // namespace shoestring::testing
