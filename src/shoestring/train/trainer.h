// The training loop: dataset -> caption dropout -> the family's objective ->
// forward (per-block compute dtypes from the precision policy) -> backward
// (per-block gradient checkpointing, micro-batch accumulation) -> the
// gradient path (global-norm clipping, the optimizer, stochastic rounding
// into low-precision weights; optim/gradient_path.h) -> EMA -> metrics,
// sample grids, atomic checkpoints. A run resumed from a checkpoint produces
// the same losses, step for step, as the uninterrupted run. Setup and
// checkpoints are in train/run.h, the step in trainer.cpp, reporting in
// train/report.h.
#pragma once
#include <functional>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>
#include <torch/nn/module.h>

#include "shoestring/train/config.h"

namespace shoestring {

/// Per-run options that are not part of the config.
struct TrainRunOptions {
  std::optional<std::string> resume_dir;  ///< continue the run in this folder from its latest checkpoint
  bool quiet = false;                     ///< no progress line (tests)
  /// Called after every optimizer step with that step's metrics record.
  std::function<void(const nlohmann::json&)> on_step;
  /// Optional memory prediction (the planner, plan/memory_plan.h, which sits
  /// above train/): called once the caption vocabulary is known with the
  /// config and the vocabulary size; returns MemoryPlan::to_json(). The
  /// trainer prints its first-step prediction next to the measured peak at the
  /// first step.
  std::function<nlohmann::json(const TrainConfig&, int64_t vocab_size)> predict_memory;
  /// Called once with the model after the precision policy was applied and
  /// before the optimizer is built (tests use it to plant weights).
  std::function<void(torch::nn::Module&)> on_model_ready;
};

/// What a finished run reports.
struct TrainSummary {
  std::string run_dir;
  int64_t first_step = 0;        ///< first step this invocation ran (1 unless resumed)
  int64_t last_step = 0;         ///< cumulative optimizer steps after the run
  double first_loss = 0;         ///< loss of first_step
  double final_loss = 0;         ///< mean loss over the last 10% of this invocation's steps
  double seconds_per_step = 0;   ///< wall seconds per optimizer step (this invocation)
  double images_per_second = 0;  ///< images of the global batch (every rank's rows) per wall second
  int64_t skipped_steps = 0;     ///< non-finite steps skipped (cumulative)
  int64_t skipped_images = 0;    ///< unreadable dataset images
  std::string last_sample;       ///< path of the last sample grid
  nlohmann::json peak_memory;    ///< run-wide peak bytes per ledger category
};

/// Runs (or resumes) training as configured. Checks that output_dir is
/// writable before any work. Throws shoestring::Error on bad input (dataset,
/// checkpoint, config) and when max_nonfinite_steps consecutive steps are
/// non-finite.
TrainSummary train(const TrainConfig& config, const TrainRunOptions& options = {});

}  // namespace shoestring
