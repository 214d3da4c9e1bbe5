#include "shoestring/train/time_budget.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "shoestring/core/error.h"
#include "shoestring/train/sampling.h"

namespace shoestring {

namespace {

/// Sample grids drawn at steps first+1..last: every `every`-th step, and `last`.
int64_t grids_between(int64_t first, int64_t last, int64_t every) {
  if (last <= first) return 0;
  int64_t n = every > 0 ? last / every - first / every : 0;
  if (every <= 0 || last % every != 0) ++n;
  return n;
}

}  // namespace

int64_t steps_within_budget(const BudgetInputs& in) {
  if (!(in.seconds_per_step > 0))
    fail("steps_within_budget: seconds_per_step = {} (expected > 0)", in.seconds_per_step);
  if (in.steps_done > in.max_train_steps) {
    fail("steps_within_budget: {} steps done, beyond max_train_steps {}", in.steps_done, in.max_train_steps);
  }
  const double usable = (1 - kReserveFraction) * in.budget_seconds;
  const auto fits = [&](int64_t n) {
    const double predicted =
        in.elapsed_seconds + static_cast<double>(n - in.steps_done) * in.seconds_per_step +
        static_cast<double>(grids_between(in.steps_done, n, in.sample_every_n_steps)) * in.seconds_per_sample;
    return predicted <= usable;
  };
  // Without grids the answer is the floor below; grids only lower it, so
  // walk down from there (by at most the steps the grids cost).
  const double spare = std::max(0.0, usable - in.elapsed_seconds);
  const double upper = static_cast<double>(in.steps_done) + std::floor(spare / in.seconds_per_step);
  int64_t n = upper >= static_cast<double>(in.max_train_steps) ? in.max_train_steps : static_cast<int64_t>(upper);
  while (n > in.steps_done && !fits(n)) --n;
  return n;
}

double estimate_sample_seconds(const TrainConfig& c, double seconds_per_step) {
  if (c.sample_prompts.empty() || c.sample_seeds <= 0) return 0;
  double forwards = 0;  // in training images' pixels
  const auto area = static_cast<double>(c.resolution) * static_cast<double>(c.resolution);
  for (size_t i = 0; i < c.sample_prompts.size(); ++i) {
    const SamplePrompt p = parse_sample_prompt(c.sample_prompts[i], fmt::format("sample_prompts[{}]", i));
    const double steps = static_cast<double>(p.steps > 0 ? p.steps : c.sample_steps);
    const double guided = p.cfg.value_or(c.sample_cfg) > 1 ? 2.0 : 1.0;
    const double pixels = p.width > 0 && p.height > 0 && area > 0
                              ? static_cast<double>(p.width) * static_cast<double>(p.height) / area
                              : 1.0;
    forwards += static_cast<double>(c.sample_seeds) * steps * guided * pixels;
  }
  const double step_forwards = 3.0 * static_cast<double>(c.train_batch_size * c.gradient_accumulation_steps);
  return seconds_per_step * forwards / step_forwards;
}

TimeBudget::TimeBudget(const TrainConfig& config, int64_t start_step, double started)
    : config_(config), active_(config.max_train_minutes > 0 && start_step == 0), started_(started) {}

std::optional<int64_t> TimeBudget::observe(int64_t step, double step_seconds, double now) {
  if (!active_) return std::nullopt;
  if (step == 1) return std::nullopt;  // one-off allocation and kernel selection
  timed_seconds_ += step_seconds;
  ++timed_;
  if (timed_ < kTimedSteps && step < config_.max_train_steps) return std::nullopt;
  active_ = false;
  BudgetInputs in;
  in.budget_seconds = config_.max_train_minutes * 60;
  in.elapsed_seconds = now - started_;
  in.seconds_per_step = timed_seconds_ / static_cast<double>(timed_);
  in.steps_done = step;
  in.max_train_steps = config_.max_train_steps;
  in.sample_every_n_steps = config_.sample_every_n_steps;
  in.seconds_per_sample = estimate_sample_seconds(config_, in.seconds_per_step);
  const int64_t sized = steps_within_budget(in);
  explanation_ = fmt::format(
      "max_train_minutes = {:g}: {} timed steps at {:.2f} s/step, {:.0f} s spent so far{}; training {} steps{}",
      config_.max_train_minutes, timed_, in.seconds_per_step, in.elapsed_seconds,
      in.seconds_per_sample > 0 ? fmt::format(", about {:.0f} s per sample grid", in.seconds_per_sample) : "", sized,
      sized == config_.max_train_steps ? fmt::format(" (max_train_steps {}: the budget is not the limit)", sized)
                                       : fmt::format(" of max_train_steps {}", config_.max_train_steps));
  return sized;
}

}  // namespace shoestring
