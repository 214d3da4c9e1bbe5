// max_train_minutes: a wall-time budget for a whole `train` invocation that
// sizes the schedule after timing its first steps, so that a slow machine
// finishes on time and a fast one learns more.
//
// A run with max_train_minutes > 0 times steps 2..kTimedSteps+1 (step 1 pays
// one-off allocation and kernel selection), then sets max_train_steps to the
// largest step count whose predicted wall time fits the budget (never more
// than the configured max_train_steps, never fewer than the steps already
// done), and records it in the run's config.toml so that `--resume` goes on
// to the same last step with the same learning-rate schedule. The steps timed
// before the sizing follow the schedule of the configured max_train_steps;
// with lr_warmup_steps > kTimedSteps + 1 (the emoji example) the warmup does
// not depend on max_train_steps, so they are the same steps as those of a run
// given the sized count from the start. A resumed invocation does not size
// again.
//
// The prediction: the time already spent (setup included) + the remaining
// steps at the timed mean + each sample grid still due (its cost estimated
// from the timed step: a grid runs count x steps x (2 with CFG) single-image
// forward passes, one training step about 3 forward passes of a batch, as
// forward + backward is about 3x forward) + kReserveFraction of the budget
// for checkpoints and the final files.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "shoestring/train/config.h"

namespace shoestring {

/// What the budget needs to know to size a run (all times in seconds).
struct BudgetInputs {
  double budget_seconds = 0;         ///< max_train_minutes x 60
  double elapsed_seconds = 0;        ///< wall time of this invocation so far (setup, timed steps)
  double seconds_per_step = 0;       ///< mean of the timed steps (> 0)
  int64_t steps_done = 0;            ///< optimizer steps done so far (the last timed step)
  int64_t max_train_steps = 0;       ///< the configured ceiling
  int64_t sample_every_n_steps = 0;  ///< 0: only the last step samples
  double seconds_per_sample = 0;     ///< one sample grid (estimate_sample_seconds)
};

/// The largest N in [steps_done, max_train_steps] with
///   elapsed + (N - steps_done) x seconds_per_step + grids(N) x seconds_per_sample
///     <= (1 - kReserveFraction) x budget,
/// where grids(N) counts the sample grids of steps steps_done+1..N (every
/// sample_every_n_steps-th step and step N). steps_done when even one more
/// step does not fit. Throws shoestring::Error for seconds_per_step <= 0 or
/// steps_done > max_train_steps.
int64_t steps_within_budget(const BudgetInputs& in);

/// The estimated seconds of one sample grid of `config`, from the seconds of
/// one training step (3 forward passes of train_batch_size x
/// gradient_accumulation_steps images at `resolution`): per prompt, seeds
/// images of its denoiser passes (kohya's --s, else sample_steps), two per
/// pass with guidance (--l, else sample_cfg, above 1), each pass costing its
/// pixels (--w x --h, else resolution^2) over resolution^2 of a training
/// image's. 0 when the config draws no samples. Throws shoestring::Error for
/// a sample prompt parse_sample_prompt refuses.
double estimate_sample_seconds(const TrainConfig& config, double seconds_per_step);

/// Steps timed before the sizing (after the untimed first step).
inline constexpr int64_t kTimedSteps = 5;
/// Share of the budget kept for checkpoints, final files and variation.
inline constexpr double kReserveFraction = 0.03;

/// Watches one invocation's steps and, once, sizes the run (see the file comment).
class TimeBudget {
 public:
  /// `start_step`: the step this invocation starts after (0 for a fresh run;
  /// > 0 when resumed: no sizing). `started`: when the invocation began
  /// (seconds on a steady clock).
  TimeBudget(const TrainConfig& config, int64_t start_step, double started);

  /// Called after each step with its number and wall seconds, and the
  /// clock's `now` (seconds, same clock as `started`). Returns the sized
  /// max_train_steps at the step where the run is sized, nullopt otherwise
  /// (and always when max_train_minutes is 0 or the run was resumed).
  std::optional<int64_t> observe(int64_t step, double step_seconds, double now);

  /// The log line of the sizing ("max_train_minutes = 15: 5 timed steps at
  /// 4.81 s/step ..."); empty before it.
  const std::string& explanation() const { return explanation_; }

 private:
  const TrainConfig& config_;
  bool active_ = false;
  double started_ = 0;
  double timed_seconds_ = 0;
  int64_t timed_ = 0;
  std::string explanation_;
};

}  // namespace shoestring
