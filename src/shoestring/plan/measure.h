// Measures what the memory planner predicts: runs real training steps of a
// config through the trainer (train/trainer.h) and reads the memory ledger
// after each step. Used by tests/plan (accuracy of plan_memory) and
// bench/plan_accuracy.
#pragma once
#include <cstdint>
#include <vector>

#include "shoestring/plan/memory_plan.h"
#include "shoestring/train/config.h"

namespace shoestring::plan {

/// Ledger readings of one training step.
struct MeasuredStep {
  /// Device peak of the step (ledger device_peak_total) minus the bytes of
  /// the "other" category left after the step (the dataset held in memory),
  /// i.e. what MemoryPlan::predicted_peak_bytes predicts.
  int64_t peak_bytes = 0;
  Bytes at_peak{};           ///< per category at the total peak (ledger peak_breakdown)
  Bytes peak_per_category{}; ///< each category's own peak during the step
};

/// Result of measure_training().
struct Measurement {
  int64_t vocab_size = 0;          ///< the tokenizer's, to plan with the same embedding
  std::vector<MeasuredStep> steps; ///< one per step run
  MemoryPlan plan;                 ///< plan_memory(config, vocab_size), computed inside the run
};

/// Trains `steps` optimizer steps of `config` in a temporary run folder
/// (removed afterwards; no checkpoints or samples except the final ones,
/// which happen after the last measurement) and returns the ledger readings
/// per step. Throws whatever train() throws (dataset missing, bad config).
Measurement measure_training(TrainConfig config, int64_t steps);

}  // namespace shoestring::plan
