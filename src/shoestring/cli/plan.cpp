// `shoestring plan CONFIG [--set key=value]... [--budget 8GiB] [--vocab-size N] [--json] [--explain]`
#include <filesystem>
#include <iostream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "shoestring/cli/commands.h"
#include "shoestring/core/error.h"
#include "shoestring/core/units.h"
#include "shoestring/dist/launch_env.h"
#include "shoestring/models/architecture.h"
#include "shoestring/plan/explain.h"
#include "shoestring/plan/memory_plan.h"
#include "shoestring/train/config.h"
#include "shoestring/train/training_model.h"

namespace shoestring::cli {
namespace fs = std::filesystem;

namespace {

constexpr MemoryCategory kShown[] = {MemoryCategory::weights, MemoryCategory::gradients,
                                     MemoryCategory::optimizer_state, MemoryCategory::activations,
                                     MemoryCategory::temporaries};

void print_plan(const TrainConfig& c, const plan::MemoryPlan& p) {
  fmt::print("model: {}{}, {:.2f}M parameters, weights {}, optimizer {}{}{}\n", c.architecture,
             models::find_architecture(c.architecture).family != models::Family::tiny_unet
                 ? (c.tiny ? " (tiny) denoiser" : " denoiser")
                 : "",
             p.parameters / 1e6, c.full_bf16 ? "bf16" : (c.mixed_precision == "bf16" ? "fp32 (bf16 autocast)" : "fp32"),
             c.optimizer_type, c.optimizer_state_dtype == "bf16" ? " (bf16 state)" : "",
             c.fused_backward_pass ? ", fused backward" : "");
  fmt::print("batch {} x {} accumulation at {} px{}{}\n", c.train_batch_size, c.gradient_accumulation_steps,
             c.resolution, c.gradient_checkpointing ? ", gradient checkpointing" : "",
             c.offload_optimizer_state ? ", optimizer state offloaded to host" : "");
  if (p.world_size > 1)
    fmt::print("one rank of {} processes (zero_stage = {}); gradient reduction buffers {}\n", p.world_size,
               p.zero_stage, format_bytes(p.communication_bytes));
  fmt::print("predicted peak {} per training step (at: {})\n", format_bytes(p.predicted_peak_bytes), p.peak_phase);
  for (MemoryCategory cat : kShown) {
    fmt::print("  {:<16} {:>12}\n", to_string(cat), format_bytes(p.at_peak[static_cast<int>(cat)]));
  }
  if (p.host_bytes > 0)
    fmt::print("  host memory (offloaded optimizer state{}) {}\n", c.offload_params ? ", weights and gradients" : "",
               format_bytes(p.host_bytes));
  if (p.ema_bytes > 0) fmt::print("  (optimizer_state includes the EMA copy: {})\n", format_bytes(p.ema_bytes));
  fmt::print("first step peak {} (its optimizer state is created during the update)\n",
             format_bytes(p.first_step_peak_bytes));
  for (const auto& n : p.notes) fmt::print("note: {}\n", n);
  if (p.checkpointing_saving_bytes > 0) {
    fmt::print("gradient checkpointing saves {} of activations\n", format_bytes(p.checkpointing_saving_bytes));
  }
}

}  // namespace

void register_plan(CLI::App& app) {
  struct Args {
    std::string config;
    std::vector<std::string> sets;
    std::string budget;
    int64_t vocab_size = plan::kDefaultVocabSize;
    bool json = false;
    bool explain = false;
    int world_size = 0;  ///< 0: the launcher's WORLD_SIZE, else 1
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand("plan", "predict the peak memory of a training config (no model is built)");
  cmd->add_option("config", args->config, "run config (TOML)")->required();
  cmd->add_option("--set", args->sets, "override a config key: --set train_batch_size=8 (repeatable)")
      ->allow_extra_args(false);
  CLI::Option* budget_option =
      cmd->add_option("--budget", args->budget, "memory budget (e.g. 8GiB): propose the cheapest switches that fit");
  cmd->add_option("--vocab-size", args->vocab_size,
                  "caption vocabulary size (sets the token embedding; the trainer builds it from the dataset)")
      ->check(CLI::Range(int64_t{1}, int64_t{100000000}));
  cmd->add_option("--world-size", args->world_size,
                  "plan one rank of a run of this many processes (zero_stage from the config shards the optimizer "
                  "state); default: WORLD_SIZE when set by a launcher, else 1")
      ->check(CLI::Range(1, 65536));
  cmd->add_flag("--json", args->json, "one JSON object on stdout");
  cmd->add_flag("--explain", args->explain, "list every module with its precision rule (precision/policy.h)");
  cmd->callback([args, budget_option] {
    if (!fs::exists(args->config)) fail("config file '{}' does not exist", args->config);
    if (fs::is_directory(args->config)) fail("config '{}' is a directory, expected a TOML file", args->config);
    TrainConfig config = load_config(args->config, args->sets);
    check_training_config(config);  // what train would refuse, refused here too
    const int world = args->world_size > 0 ? args->world_size : dist::launch_environment().world_size;
    plan::MemoryPlan p = plan::plan_memory(config, args->vocab_size, world);
    nlohmann::json out = p.to_json();
    std::optional<plan::Advice> advice;
    if (budget_option->count() > 0 && args->budget.empty())
      fail("--budget: expected a memory size such as 8GiB, got ''");
    if (!args->budget.empty()) {
      const int64_t budget = plan::parse_byte_size(args->budget);
      advice = plan::advise(config, args->vocab_size, budget, world);
      nlohmann::json a = {{"budget_bytes", budget}, {"fits", advice->fits_already}, {"found", advice->found}};
      a["config_lines"] = advice->best.config_lines;
      a["cost"] = advice->best.cost;
      a["expected_slowdown"] = advice->best.slowdown;
      a["predicted_peak_bytes"] = advice->best.plan.predicted_peak_bytes;
      if (!advice->found) a["floor_reason"] = advice->floor_reason;
      out["advice"] = a;
    }
    // Resolve the precision rules (on the meta device: nothing is allocated),
    // so plan refuses what train would refuse and prints the same warnings;
    // the table is shown only with --explain.
    const std::string explanation = plan::explain_precision(config, args->vocab_size);
    if (args->json) {
      if (args->explain) out["explain"] = explanation;
      std::cout << out.dump(2) << "\n";
      return;
    }
    print_plan(config, p);
    if (advice) {
      const int64_t budget = advice->best.plan.predicted_peak_bytes;
      if (advice->fits_already) {
        fmt::print("\nfits the budget of {} as it is\n", args->budget);
      } else if (advice->found) {
        fmt::print("\nto fit {} (predicted {}; expected cost: {}), set:\n", args->budget, format_bytes(budget),
                   advice->best.cost);
        for (const auto& line : advice->best.config_lines) fmt::print("{}\n", line);
      } else {
        fmt::print("\nnothing fits {}: {}\n", args->budget, advice->floor_reason);
        fmt::print("smallest found ({}):\n", format_bytes(budget));
        for (const auto& line : advice->best.config_lines) fmt::print("{}\n", line);
      }
    }
    if (args->explain) fmt::print("\n{}", explanation);
  });
}

}  // namespace shoestring::cli
