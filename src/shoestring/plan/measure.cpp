#include "shoestring/plan/measure.h"

#include <unistd.h>

#include <atomic>
#include <filesystem>

#include "shoestring/core/memory_ledger.h"
#include "shoestring/train/trainer.h"

namespace shoestring::plan {
namespace fs = std::filesystem;

Measurement measure_training(TrainConfig config, int64_t steps) {
  static std::atomic<int> counter{0};
  const fs::path dir = fs::temp_directory_path() /
                       fmt::format("shoestring_plan_measure_{}_{}", ::getpid(), counter.fetch_add(1));
  fs::remove_all(dir);
  config.output_dir = dir.string();
  config.max_train_steps = steps;
  config.save_every_n_steps = 0;
  config.sample_every_n_steps = 0;
  config.sample_steps = 1;
  config.sample_seeds = 1;
  config.sample_prompts = {"x"};
  Measurement m;
  TrainRunOptions options;
  options.quiet = true;
  options.predict_memory = [&m](const TrainConfig& c, int64_t vocab) {
    m.vocab_size = vocab;
    m.plan = plan_memory(c, vocab);
    return m.plan.to_json();
  };
  options.on_step = [&m](const nlohmann::json&) {
    MemoryLedger& ledger = MemoryLedger::global();
    MeasuredStep s;
    const auto breakdown = ledger.peak_breakdown();
    const int other = static_cast<int>(MemoryCategory::other);
    s.peak_bytes = ledger.device_peak_total() - ledger.current_bytes(MemoryCategory::other);
    for (int c = 0; c < kNumMemoryCategories; ++c) {
      s.at_peak[c] = breakdown[c];
      s.peak_per_category[c] = ledger.peak_bytes(static_cast<MemoryCategory>(c));
    }
    s.at_peak[other] -= ledger.current_bytes(MemoryCategory::other);
    m.steps.push_back(s);
  };
  try {
    train(config, options);
  } catch (...) {
    fs::remove_all(dir);
    throw;
  }
  fs::remove_all(dir);
  return m;
}

}  // namespace shoestring::plan
