// bench/precision_convergence: how far low-precision training falls behind
// fp32 on the same diffusion problem, same data, same seed.
//
//   build/bench/precision_convergence [--steps 300] [--set k=v]... [--only NAME]... [--json]
//
// Trains a small text-conditioned UNet (the emoji example shrunk to 16 px so
// six runs fit in minutes on 2 cores) under: fp32 AdamW; bf16 weights with
// round-to-nearest AdamW; bf16 with stochastic rounding (SR) AdamW, AdamW8bit,
// Adafactor, Compass and SPARKLES (the bf16 LoRA guide's arguments). Prints
// each configuration's final loss (mean of the last 10% of steps) and its
// ratio to fp32's (when "fp32 AdamW" runs too: `--only "fp32 AdamW" --only
// "bf16-sr SPARKLES"`). Uses the Twemoji set when it has
// been fetched (scripts/fetch_twemoji.sh), else the test fixtures.
#include <algorithm>
#include <filesystem>
#include <iostream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "bench_machine.h"
#include "shoestring/core/error.h"
#include "shoestring/train/config.h"
#include "shoestring/train/trainer.h"

namespace fs = std::filesystem;

namespace {
struct Setup {
  const char* name;
  std::vector<std::string> sets;
};
}  // namespace

int main(int argc, char** argv) {
  shoestring::bench::prepare_process(argv);
  CLI::App app{"precision convergence benchmark"};
  int64_t steps = 300;
  std::vector<std::string> extra;
  std::vector<std::string> only;
  bool json = false;
  app.add_option("--steps", steps, "optimizer steps per configuration")->check(CLI::Range(10, 1000000));
  app.add_option("--set", extra, "extra config override for every configuration");
  app.add_option("--only", only, "run only the configurations with these names (repeatable)");
  app.add_flag("--json", json, "one JSON object per configuration");
  CLI11_PARSE(app, argc, argv);
  shoestring::bench::print_machine(json);

  std::string source = SHOESTRING_BENCH_SOURCE_DIR;
  std::string data = shoestring::expand_path("${SHOESTRING_CACHE}/emoji-datasource-twitter-16.0.0");
  if (!fs::exists(data + "/emoji.json")) data = source + "/tests/data/twemoji";
  const std::vector<std::string> adafactor_args = {
      "optimizer_args=[\"scale_parameter=False\", \"relative_step=False\", \"warmup_init=False\"]"};
  std::vector<Setup> setups = {
      {"fp32 AdamW", {"full_bf16=false"}},
      {"bf16-rtn AdamW", {"full_bf16=true", "stochastic_rounding=false"}},
      {"bf16-sr AdamW", {"full_bf16=true"}},
      {"bf16-sr AdamW8bit", {"full_bf16=true", "optimizer_type=\"AdamW8bit\""}},
      {"bf16-sr Adafactor", {"full_bf16=true", "optimizer_type=\"Adafactor\"", adafactor_args[0]}},
      {"bf16-sr Compass", {"full_bf16=true", "optimizer_type=\"Compass\""}},
      {"bf16-sr SPARKLES",
       {"full_bf16=true", "optimizer_type=\"SPARKLES\"",
        "optimizer_args=[\"centralization=0.5\", \"normalization=0.5\", \"amp_fac=2\", "
        "\"stochastic_threshold=1e-6\"]"}},
  };
  try {
    double fp32_loss = std::nan("");
    if (!json) {
      std::cout << fmt::format("{} steps each, data {}\n{:<22} {:>12} {:>10} {:>10}\n", steps, data, "config",
                               "final loss", "vs fp32", "s/step");
    }
    for (const auto& s : setups) {
      if (!only.empty() && std::find(only.begin(), only.end(), s.name) == only.end()) continue;
      std::string out = (fs::temp_directory_path() / ("shoestring_conv_" + std::to_string(::getpid()))).string();
      fs::remove_all(out);
      std::vector<std::string> sets = {"train_data_dir=\"" + data + "\"",
                                       "resolution=16",
                                       "train_batch_size=16",
                                       "max_train_steps=" + std::to_string(steps),
                                       "learning_rate=2e-4",
                                       "lr_scheduler=\"constant_with_warmup\"",
                                       "lr_warmup_steps=10",
                                       "ema_decay=0",
                                       "save_every_n_steps=0",
                                       "sample_every_n_steps=0",
                                       "sample_seeds=1",
                                       "sample_steps=2",
                                       "sample_prompts=[\"x\"]",
                                       "seed=7",
                                       "output_dir=\"" + out + "\"",
                                       "model.base_channels=32",
                                       "model.channel_mult=[1,2]",
                                       "model.num_res_blocks=1",
                                       "model.attention_levels=[1]",
                                       "model.text_dim=128",
                                       "model.text_layers=1"};
      sets.insert(sets.end(), s.sets.begin(), s.sets.end());
      sets.insert(sets.end(), extra.begin(), extra.end());
      auto cfg = shoestring::load_config(source + "/examples/emoji.toml", sets);
      shoestring::TrainRunOptions opts;
      opts.quiet = true;
      auto summary = shoestring::train(cfg, opts);
      fs::remove_all(out);
      if (std::string(s.name) == "fp32 AdamW") fp32_loss = summary.final_loss;
      double ratio = summary.final_loss / fp32_loss;
      if (json) {
        std::cout << nlohmann::json{{"config", s.name},
                                    {"steps", steps},
                                    {"final_loss", summary.final_loss},
                                    {"first_loss", summary.first_loss},
                                    {"ratio_to_fp32", std::isfinite(ratio) ? nlohmann::json(ratio) : nlohmann::json()},
                                    {"seconds_per_step", summary.seconds_per_step}}
                         .dump()
                  << std::endl;
      } else {
        std::cout << fmt::format("{:<22} {:>12.5f} {:>10} {:>10.3f}\n", s.name, summary.final_loss,
                                 std::isfinite(ratio) ? fmt::format("{:+.2f}%", 100 * (ratio - 1)) : "-",
                                 summary.seconds_per_step)
                  << std::flush;
      }
    }
  } catch (const shoestring::Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
