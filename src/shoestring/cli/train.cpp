// `shoestring train CONFIG [--set key=value]... [--max-steps N] [--output-dir DIR] [--resume RUN_DIR]
// [--device auto|cpu|cuda|cuda:N]`
#include <filesystem>

#include <CLI/CLI.hpp>

#include "shoestring/cli/commands.h"
#include "shoestring/core/device.h"
#include "shoestring/core/error.h"
#include "shoestring/dist/launch_env.h"
#include "shoestring/plan/memory_plan.h"
#include "shoestring/train/config.h"
#include "shoestring/train/trainer.h"

namespace shoestring::cli {
namespace fs = std::filesystem;

void register_train(CLI::App& app) {
  struct Args {
    std::string config;
    std::vector<std::string> sets;
    int64_t max_steps = 0;
    std::string output_dir;
    std::string resume;
    std::string device;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("train", "train a model (or resume a run)");
  cmd->add_option("config", args->config, "run config (TOML); optional with --resume, which reads RUN_DIR/config.toml");
  cmd->add_option("--set", args->sets, "override a config key: --set learning_rate=2e-4 (repeatable)")
      ->allow_extra_args(false);
  cmd->add_option("--max-steps", args->max_steps,
                  "override max_train_steps (cumulative across resumes; clears max_train_epochs, which would set it)")
      ->check(CLI::Range(int64_t{1}, int64_t{1000000000000}));
  cmd->add_option("--output-dir", args->output_dir, "override output_dir (the run folder)");
  cmd->add_option("--resume", args->resume, "continue the run in RUN_DIR from its latest checkpoint");
  CLI::Option* device_flag =
      cmd->add_option("--device", args->device,
                      "where to train: auto (first CUDA device if any, else cpu), cpu, cuda, cuda:N (overrides the "
                      "config's device; a resumed run may move)");
  cmd->callback([args, device_flag] {
    // Checked first, naming the flag: a device the machine lacks fails before any work.
    if (device_flag->count() > 0) resolve_device(args->device, "--device");  // "" too: an error
    std::vector<std::string> sets = args->sets;
    if (args->max_steps > 0) {
      // The command line wins over max_train_epochs too (which would size max_train_steps again).
      sets.push_back(fmt::format("max_train_steps={}", args->max_steps));
      sets.push_back("max_train_epochs=0");
    }
    TrainRunOptions options;
    std::string config_path = args->config;
    if (!args->resume.empty()) {
      if (!fs::is_directory(args->resume)) fail("--resume '{}': not a run folder", args->resume);
      if (config_path.empty()) config_path = (fs::path(args->resume) / "config.toml").string();
      options.resume_dir = args->resume;
      if (!args->output_dir.empty())
        fail("--output-dir cannot be combined with --resume (the run continues in RUN_DIR)");
    } else if (config_path.empty()) {
      fail("train: a CONFIG file is required (or --resume RUN_DIR)");
    }
    if (!fs::exists(config_path)) {
      if (!args->resume.empty()) {
        fail(
            "--resume '{}': not a run folder (it has no config.toml; a run killed before writing it has nothing "
            "to resume: start it again with its original command)",
            args->resume);
      }
      fail("config file '{}' does not exist", config_path);
    }
    if (fs::is_directory(config_path)) fail("config '{}' is a directory, expected a TOML file", config_path);
    TrainConfig config = load_config(config_path, sets);
    if (!args->output_dir.empty()) config.output_dir = args->output_dir;  // a path, used as given
    if (device_flag->count() > 0) config.device = args->device;
    options.predict_memory = [](const TrainConfig& c, int64_t vocab_size) {
      try {
        // One rank of the launcher's WORLD_SIZE (1 without one).
        return plan::plan_memory(c, vocab_size, dist::launch_environment().world_size).to_json();
      } catch (const Error&) {
        return nlohmann::json();  // a config the planner does not model: no prediction printed
      }
    };
    train(config, options);
  });
}

}  // namespace shoestring::cli
