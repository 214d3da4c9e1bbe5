#include "shoestring/train/report.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>

#include <spdlog/spdlog.h>

#include "shoestring/core/error.h"
#include "shoestring/core/units.h"
#include "shoestring/io/tensorboard_events.h"
#include "shoestring/train/run.h"

namespace shoestring {
namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "--:--";
  auto s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}:{:02d}:{:02d}", s / 3600, (s / 60) % 60, s % 60);
  return fmt::format("{:02d}:{:02d}", s / 60, s % 60);
}

/// "weights 1.2 MiB, gradients ..." for per-category byte counts.
std::string by_category(const std::array<int64_t, kNumMemoryCategories>& bytes) {
  std::vector<std::string> parts;
  for (int cat = 0; cat < kNumMemoryCategories; ++cat) {
    parts.push_back(fmt::format("{} {}", to_string(static_cast<MemoryCategory>(cat)), format_bytes(bytes[cat])));
  }
  return fmt::format("{}", fmt::join(parts, ", "));
}

std::unique_ptr<std::FILE, int (*)(std::FILE*)> open_metrics(const std::string& run_dir) {
  const std::string path = (fs::path(run_dir) / "metrics.jsonl").string();
  std::FILE* f = std::fopen(path.c_str(), "ab");
  if (!f) fail("cannot open '{}' for appending", path);
  return {f, &std::fclose};
}

}  // namespace

RunReport::RunReport(const Run& run, const TrainRunOptions& options)
    : run_(run),
      options_(options),
      tty_(!options.quiet && ::isatty(::fileno(stderr))),
      start_step_(run.counters.step),
      metrics_(run.writes_files() ? open_metrics(run.run_dir)
                                  : std::unique_ptr<std::FILE, int (*)(std::FILE*)>(nullptr, &std::fclose)),
      smoothed_(std::nan("")),
      start_(Clock::now()) {
  if (run.writes_files() && run.config.log_with == "tensorboard") {
    events_ = std::make_unique<EventFileWriter>((fs::path(run.run_dir) / "logs").string());
    // A resume redoes the steps after its checkpoint: TensorBoard drops the
    // earlier files' events from here on.
    if (start_step_ > 0) events_->write(event_session_start(wall_time_now(), start_step_ + 1));
    if (!options.quiet) spdlog::info("TensorBoard events: {}", events_->path());
  }
}

RunReport::~RunReport() = default;

void RunReport::step(const StepRecord& r) {
  const MemoryLedger& ledger = MemoryLedger::global();
  const TrainConfig& c = run_.config;
  const bool first = r.step == start_step_ + 1;
  const auto peaks = ledger.peak_breakdown();
  nlohmann::json rec = {{"step", r.step},
                        {"loss", r.loss},
                        {"lr", r.lr},
                        {"grad_norm", r.grad_norm},
                        {"seconds", r.seconds},
                        {"images_per_second", r.images / r.seconds},
                        {"peak_bytes", ledger.peak_total()},
                        {"peak_device_bytes", ledger.device_peak_total()},
                        {"skipped", r.skipped}};
  for (int cat = 0; cat < kNumMemoryCategories; ++cat) {
    const int64_t peak = ledger.peak_bytes(static_cast<MemoryCategory>(cat));
    rec[fmt::format("peak_{}_bytes", to_string(static_cast<MemoryCategory>(cat)))] = peak;
    run_peaks_[cat] = std::max(run_peaks_[cat], peak);
  }
  run_peak_total_ = std::max(run_peak_total_, ledger.peak_total());
  const std::string line = rec.dump() + "\n";
  if (metrics_) {  // rank 0 of a data-parallel run, or the single process
    std::fwrite(line.data(), 1, line.size(), metrics_.get());
    std::fflush(metrics_.get());
  }
  if (events_) {  // the record's values as scalars; bytes as MiB
    std::vector<std::pair<std::string, float>> values = {
        {"train/loss", static_cast<float>(r.loss)},
        {"train/lr", static_cast<float>(r.lr)},
        {"train/grad_norm", static_cast<float>(r.grad_norm)},
        {"train/images_per_second", static_cast<float>(r.images / r.seconds)},
        {"train/seconds_per_step", static_cast<float>(r.seconds)},
        {"memory/peak_MiB", static_cast<float>(static_cast<double>(ledger.peak_total()) / (1 << 20))}};
    for (int cat = 0; cat < kNumMemoryCategories; ++cat) {
      const auto category = static_cast<MemoryCategory>(cat);
      values.emplace_back(fmt::format("memory/peak_{}_MiB", to_string(category)),
                          static_cast<float>(static_cast<double>(ledger.peak_bytes(category)) / (1 << 20)));
    }
    events_->write(event_scalars(wall_time_now(), r.step, values));
  }
  if (options_.on_step) options_.on_step(rec);

  if (first) first_loss_ = r.loss;
  losses_.push_back(r.loss);
  if (std::isfinite(r.loss)) smoothed_ = std::isnan(smoothed_) ? r.loss : 0.95 * smoothed_ + 0.05 * r.loss;

  if (first && !run_.predicted_memory.is_null() && !options_.quiet) {
    // The plan excludes the dataset held in memory (ledger "other"). A
    // resumed run's first step already holds its optimizer state: the
    // steady-state prediction.
    const int64_t predicted =
        run_.predicted_memory.value(r.step == 1 ? "first_step_peak_bytes" : "predicted_peak_bytes", int64_t{0});
    const int64_t measured = ledger.device_peak_total() - peaks[static_cast<int>(MemoryCategory::other)];
    spdlog::info(
        "step {} memory: predicted {} (shoestring plan), measured {} ({:+.1f}%)", r.step, format_bytes(predicted),
        format_bytes(measured),
        100.0 * static_cast<double>(measured - predicted) / static_cast<double>(std::max<int64_t>(1, predicted)));
  }
  if (first && run_.network && !run_.network->never_called().empty()) {
    spdlog::warn(
        "LoRA: {} adapters were never used by the forward pass (their layers' forward() is "
        "bypassed, so they do not train): {}",
        run_.network->never_called().size(), fmt::join(run_.network->never_called(), ", "));
  }
  if (options_.quiet) return;
  if (first) {
    spdlog::info("step {} measured peak {} = {}", r.step, format_bytes(ledger.peak_total()), by_category(peaks));
  }
  const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
  const double its = static_cast<double>(r.step - start_step_) / elapsed;
  const double eta = static_cast<double>(c.max_train_steps - r.step) / its;
  const std::string progress =
      fmt::format("step {}/{} | {:.2f} it/s | ETA {} | loss {:.4f} | peak {}", r.step, c.max_train_steps, its,
                  format_duration(eta), smoothed_, format_bytes(run_peak_total_));
  if (tty_) {
    fmt::print(stderr, "\r{}\033[K", progress);
    if (r.step == c.max_train_steps) fmt::print(stderr, "\n");
  } else if (r.step % c.log_every_n_steps == 0 || r.step == c.max_train_steps || first) {
    fmt::print(stderr, "{}\n", progress);
  }
}

void RunReport::end_progress_line() {
  if (tty_) fmt::print(stderr, "\n");
}

void RunReport::sample_grid(int64_t step, const std::string& path) {
  last_sample_ = path;
  if (!options_.quiet) spdlog::info("step {}: sample grid {}", step, path);
}

TrainSummary RunReport::finish(int64_t last_step) {
  const TrainConfig& c = run_.config;
  TrainSummary summary;
  summary.run_dir = run_.run_dir;
  summary.first_step = start_step_ + 1;
  summary.last_step = last_step;
  summary.first_loss = first_loss_;
  const double total = std::chrono::duration<double>(Clock::now() - start_).count();
  const int64_t steps_run = last_step - start_step_;
  summary.seconds_per_step = total / static_cast<double>(std::max<int64_t>(1, steps_run));
  // Every rank's rows, as metrics.jsonl counts them (StepRecord::images).
  summary.images_per_second =
      static_cast<double>(steps_run * c.train_batch_size * c.gradient_accumulation_steps * run_.world_size()) / total;
  // Mean over the last 10% of this invocation's steps.
  const size_t tail = std::max<size_t>(1, losses_.size() / 10);
  double s = 0;
  for (size_t i = losses_.size() - tail; i < losses_.size(); ++i) s += losses_[i];
  summary.final_loss = s / static_cast<double>(tail);
  summary.skipped_steps = run_.counters.skipped_steps;
  summary.skipped_images = static_cast<int64_t>(run_.dataset.skipped().size());
  summary.last_sample = last_sample_;
  summary.peak_memory = nlohmann::json::object();
  for (int cat = 0; cat < kNumMemoryCategories; ++cat) {
    summary.peak_memory[to_string(static_cast<MemoryCategory>(cat))] = run_peaks_[cat];
  }
  summary.peak_memory["total"] = run_peak_total_;
  if (options_.quiet) return summary;
  spdlog::info("done: steps {}..{}, {:.3f} s/step, {:.1f} images/s, loss {:.4f} -> {:.4f}", summary.first_step,
               summary.last_step, summary.seconds_per_step, summary.images_per_second, summary.first_loss,
               summary.final_loss);
  spdlog::info("peak memory {} (per category peaks: {})", format_bytes(run_peak_total_), by_category(run_peaks_));
  if (summary.skipped_images > 0) {
    spdlog::warn("{} image{} skipped:", summary.skipped_images, summary.skipped_images == 1 ? " was" : "s were");
    for (const auto& sk : run_.dataset.skipped()) {
      // most reasons already start with the file's path
      if (sk.reason.rfind(sk.path, 0) == 0) {
        spdlog::warn("  {}", sk.reason);
      } else {
        spdlog::warn("  {}: {}", sk.path, sk.reason);
      }
    }
  }
  spdlog::info("final weights {}/{}; samples {}; report {}/report.html", run_.run_dir,
               run_.lora_only() ? "lora.safetensors" : "model.safetensors", summary.last_sample, run_.run_dir);
  return summary;
}

}  // namespace shoestring
