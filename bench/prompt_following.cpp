// bench/prompt_following: does a trained emoji model draw what its prompt names?
//
//   build/bench/prompt_following RUN_DIR [--prompts 24] [--seeds 2] [--steps 25] [--cfg 3] [--seed 1] [--json]
//
// --json prints JSON lines: the machine (bench_machine.h), then the result.
//
// Reads RUN_DIR/config.toml (the dataset the run trained on) and
// RUN_DIR/model.safetensors. Picks --prompts dataset entries (a seeded choice
// without repeats; all with --prompts 0), prompts each with its name (the
// caption's first field, "grinning face" of "grinning face, grinning, smileys &
// emotion"), samples --seeds images, and finds each sample's nearest training
// image by mean squared pixel difference at the model's resolution.
// Prints, with the CPU line:
//   top-1: the share of samples whose nearest training image is the prompted
//          entry (chance: 1 / dataset size); top-5 likewise among the 5 nearest;
//   mse_prompted / mse_nearest_other: mean squared difference (pixels scaled to
//          [0, 1]) to the prompted entry's image and to the nearest other one.
// A nearest-neighbour score, not a perceptual one: it rewards drawing the
// training image itself, which is what a model memorising 169 emoji should do.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <numeric>
#include <random>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "bench_machine.h"
#include "shoestring/core/error.h"
#include "shoestring/core/threads.h"
#include "shoestring/data/dataset.h"
#include "shoestring/train/config.h"
#include "shoestring/train/sampling.h"
#include "shoestring/train/tiny_unet_model.h"

namespace fs = std::filesystem;

namespace {
/// The caption's first comma-separated field: the emoji's name.
std::string name_of(const std::string& caption) { return caption.substr(0, caption.find(',')); }
}  // namespace

int main(int argc, char** argv) {
  shoestring::bench::prepare_process(argv);
  CLI::App app{"prompt-following benchmark for the emoji example"};
  std::string run_dir;
  int64_t prompts = 24, seeds = 2, steps = 25, seed = 1;
  double cfg = 3.0;
  bool json = false;
  app.add_option("run_dir", run_dir, "run folder of `shoestring train` (config.toml, model.safetensors)")->required();
  app.add_option("--prompts", prompts, "dataset entries to prompt (0 = all)")->check(CLI::Range(0, 100000));
  app.add_option("--seeds", seeds, "samples per prompt")->check(CLI::Range(1, 64));
  app.add_option("--steps", steps, "sampler steps")->check(CLI::Range(1, 1000));
  app.add_option("--cfg", cfg, "classifier-free guidance scale")->check(CLI::Range(0.0, 100.0));
  app.add_option("--seed", seed, "seed of the entry choice and first sample seed")->check(CLI::Range(0, 1 << 30));
  app.add_flag("--json", json, "JSON lines on stdout: the machine, then the result");
  CLI11_PARSE(app, argc, argv);
  if (!std::isfinite(cfg)) {  // NaN passes CLI::Range
    std::cerr << "error: --cfg must be a finite number\n";
    return 1;
  }
  shoestring::bench::print_machine(json);
  try {
    shoestring::configure_threads(0);
    const auto config = shoestring::load_config((fs::path(run_dir) / "config.toml").string());
    auto data = shoestring::ImageCaptionDataset::load(shoestring::expand_path(config.train_data_dir),
                                                      static_cast<int>(config.resolution), config.twemoji_categories);
    auto loaded =
        shoestring::load_tiny_unet_checkpoint((fs::path(run_dir) / "model.safetensors").string(), at::Device("cpu"));
    const int64_t n = data.size();
    std::vector<int64_t> chosen(static_cast<size_t>(n));
    std::iota(chosen.begin(), chosen.end(), 0);
    std::mt19937_64 rng(static_cast<uint64_t>(seed));
    std::shuffle(chosen.begin(), chosen.end(), rng);
    if (prompts > 0 && prompts < n) chosen.resize(static_cast<size_t>(prompts));

    shoestring::SampleRequest req;
    for (int64_t i : chosen) req.prompts.push_back(name_of(data.captions()[static_cast<size_t>(i)]));
    for (int64_t s = 0; s < seeds; ++s) req.seeds.push_back(static_cast<uint64_t>(seed + s));
    req.steps = steps;
    req.cfg = cfg;
    const at::Tensor samples = shoestring::generate_images(loaded.model, loaded.tokenizer, req);

    // [M, D] samples and [N, D] training images, pixels in [0, 1].
    const at::Tensor x = samples.to(torch::kFloat64).flatten(1) / 255.0;
    const at::Tensor y = data.images().to(torch::kFloat64).flatten(1) / 255.0;
    const double d = static_cast<double>(x.size(1));
    // Squared distances / D: |x|^2 + |y|^2 - 2 x.y, [M, N].
    const at::Tensor mse = (x.pow(2).sum(1, true) + y.pow(2).sum(1).unsqueeze(0) - 2 * x.matmul(y.t())) / d;
    int64_t top1 = 0, top5 = 0;
    double mse_prompted = 0, mse_other = 0;
    const int64_t m = x.size(0);
    for (int64_t r = 0; r < m; ++r) {
      const int64_t want = chosen[static_cast<size_t>(r / seeds)];
      const at::Tensor row = mse[r];
      const at::Tensor order = row.argsort();
      const auto* o = order.data_ptr<int64_t>();
      // Entries with the same name (skin-tone variants share it) count as the prompted one.
      const std::string want_name = name_of(data.captions()[static_cast<size_t>(want)]);
      auto same = [&](int64_t j) { return name_of(data.captions()[static_cast<size_t>(j)]) == want_name; };
      if (same(o[0])) ++top1;
      for (int64_t k = 0; k < std::min<int64_t>(5, n); ++k) {
        if (same(o[k])) {
          ++top5;
          break;
        }
      }
      mse_prompted += row[want].item<double>();
      for (int64_t k = 0; k < n; ++k) {
        if (!same(o[k])) {
          mse_other += row[o[k]].item<double>();
          break;
        }
      }
    }
    nlohmann::json r = {{"run_dir", run_dir},
                        {"dataset_size", n},
                        {"prompts", static_cast<int64_t>(chosen.size())},
                        {"samples", m},
                        {"steps", steps},
                        {"cfg", cfg},
                        {"top1", static_cast<double>(top1) / static_cast<double>(m)},
                        {"top5", static_cast<double>(top5) / static_cast<double>(m)},
                        {"chance_top1", 1.0 / static_cast<double>(n)},
                        {"mse_prompted", mse_prompted / static_cast<double>(m)},
                        {"mse_nearest_other", mse_other / static_cast<double>(m)}};
    if (json) {
      std::cout << r.dump() << "\n";
    } else {
      fmt::print(
          "{}: {} prompts x {} seeds from {} images, {} steps, cfg {}\n"
          "top-1 {:.3f}  top-5 {:.3f}  (chance {:.4f})  mse to prompted {:.4f}, to nearest other {:.4f}\n",
          run_dir, chosen.size(), seeds, n, steps, cfg, r["top1"].get<double>(), r["top5"].get<double>(),
          r["chance_top1"].get<double>(), r["mse_prompted"].get<double>(), r["mse_nearest_other"].get<double>());
    }
  } catch (const shoestring::Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
