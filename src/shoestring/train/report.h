// What a run tells its user while and after it trains: one metrics.jsonl
// record per optimizer step (with the memory ledger's peaks by category; the
// same scalars as TensorBoard events with log_with = "tensorboard"), the
// progress line (it/s, ETA, smoothed loss, peak memory; redrawn in place on a
// TTY, every log_every_n_steps lines otherwise), the first step's measured
// peak next to the planner's prediction, and the summary of train().
#pragma once
#include <array>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "shoestring/core/memory_ledger.h"
#include "shoestring/train/trainer.h"

namespace shoestring {

struct Run;
class EventFileWriter;

/// One optimizer step as reported.
struct StepRecord {
  int64_t step = 0;
  double loss = 0;  ///< mean micro-batch loss (fp32 mse), NaN/inf when non-finite
  double lr = 0;
  double grad_norm = 0;  ///< global gradient norm before clipping
  double seconds = 0;    ///< wall time of the step (forward, backward, update)
  int64_t images = 0;    ///< images the step trained on (batch x accumulation)
  bool skipped = false;  ///< non-finite: the update was not applied
};

/// Writes metrics.jsonl (and, with log_with = "tensorboard", the same
/// values as TensorBoard scalars into RUN_DIR/logs/, io/tensorboard_events.h)
/// and the progress line of one run invocation and gathers its summary.
/// Throws shoestring::Error when metrics.jsonl or the event file cannot be
/// opened for appending.
class RunReport {
 public:
  RunReport(const Run& run, const TrainRunOptions& options);
  ~RunReport();
  RunReport(const RunReport&) = delete;
  RunReport& operator=(const RunReport&) = delete;

  /// Reports step `r` (call after the step, before its checkpoint and
  /// samples): one metrics.jsonl line (flushed), TrainRunOptions::on_step,
  /// the first step's memory lines, the progress line.
  void step(const StepRecord& r);
  /// Ends the progress line on a TTY (before other output such as sampling).
  void end_progress_line();
  /// Notes the sample grid written at `step`.
  void sample_grid(int64_t step, const std::string& path);
  /// The summary after the last step (also logged unless quiet).
  TrainSummary finish(int64_t last_step);

 private:
  const Run& run_;
  const TrainRunOptions& options_;
  const bool tty_;
  const int64_t start_step_;  ///< the step the run resumed at (0: fresh)
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> metrics_;
  std::unique_ptr<EventFileWriter> events_;  ///< log_with = "tensorboard" (rank 0)
  std::array<int64_t, kNumMemoryCategories> run_peaks_{};
  int64_t run_peak_total_ = 0;
  std::vector<double> losses_;
  double first_loss_ = 0;
  double smoothed_;
  std::string last_sample_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace shoestring
