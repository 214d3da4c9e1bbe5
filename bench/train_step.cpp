// bench/train_step: speed and measured memory of training steps for a config
// (default: the emoji example), as users see them in `shoestring train`.
//
//   build/bench/train_step [--config examples/emoji.toml] [--steps 30] [--set k=v]... [--json]
//
// Prints seconds per optimizer step and images per second (excluding the first
// step, which includes one-time allocation), the loss at the first and last
// step, and the run's peak bytes per memory-ledger category.
#include <filesystem>
#include <iostream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench_machine.h"
#include "shoestring/core/error.h"
#include "shoestring/core/units.h"
#include "shoestring/train/config.h"
#include "shoestring/train/trainer.h"

namespace fs = std::filesystem;

int main(int argc, char** argv) {
  shoestring::bench::prepare_process(argv);
  CLI::App app{"training-step benchmark"};
  std::string config = std::string(SHOESTRING_BENCH_SOURCE_DIR) + "/examples/emoji.toml";
  int64_t steps = 30;
  std::vector<std::string> sets;
  bool json = false;
  app.add_option("--config", config, "run config");
  app.add_option("--steps", steps, "optimizer steps to time")->check(CLI::Range(2, 100000));
  app.add_option("--set", sets, "config override key=value");
  app.add_flag("--json", json, "JSON lines on stdout: the machine, then the result");
  CLI11_PARSE(app, argc, argv);
  shoestring::bench::print_machine(json);
  try {
    std::string out = (fs::temp_directory_path() / ("shoestring_bench_" + std::to_string(::getpid()))).string();
    sets.push_back("max_train_steps=" + std::to_string(steps));
    sets.push_back("save_every_n_steps=0");
    sets.push_back("sample_every_n_steps=0");
    sets.push_back("output_dir=\"" + out + "\"");
    auto cfg = shoestring::load_config(config, sets);
    std::vector<double> seconds, losses;
    shoestring::TrainRunOptions opts;
    opts.quiet = true;
    opts.on_step = [&](const nlohmann::json& rec) {
      seconds.push_back(rec["seconds"].get<double>());
      losses.push_back(rec["loss"].get<double>());
    };
    auto summary = shoestring::train(cfg, opts);
    fs::remove_all(out);
    double total = 0;
    for (size_t i = 1; i < seconds.size(); ++i) total += seconds[i];
    double s_per_step = total / static_cast<double>(seconds.size() - 1);
    int64_t images = cfg.train_batch_size * cfg.gradient_accumulation_steps;
    nlohmann::json r = {{"config", config},
                        {"steps", steps},
                        {"batch", images},
                        {"resolution", cfg.resolution},
                        {"full_bf16", cfg.full_bf16},
                        {"gradient_checkpointing", cfg.gradient_checkpointing},
                        {"seconds_per_step", s_per_step},
                        {"images_per_second", images / s_per_step},
                        {"first_loss", losses.front()},
                        {"last_loss", losses.back()},
                        {"peak_bytes", summary.peak_memory}};
    if (json) {
      std::cout << r.dump() << "\n";
    } else {
      std::cout << fmt::format("{}: {} steps of {} images at {} px\n", config, steps, images, cfg.resolution)
                << fmt::format("  {:.3f} s/step, {:.1f} images/s (steps 2..{})\n", s_per_step, images / s_per_step,
                               steps)
                << fmt::format("  loss {:.4f} (step 1) -> {:.4f} (step {})\n", losses.front(), losses.back(), steps)
                << "  peak memory by category:\n";
      for (auto& [k, v] : summary.peak_memory.items()) {
        std::cout << fmt::format("    {:<16} {}\n", k, shoestring::format_bytes(v.get<int64_t>()));
      }
    }
  } catch (const shoestring::Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
