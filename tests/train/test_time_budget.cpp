// train/time_budget.h: max_train_minutes sizes max_train_steps after the
// timed first steps. steps_within_budget is checked against a step-by-step
// simulation of the run it predicts (time per step, a grid at every
// sample_every_n_steps-th step and at the last one); the trainer test checks
// that a sized run ends where config.toml says and resumes to the same step.
#include <gtest/gtest.h>

#include <filesystem>
#include <random>

#include "../error_testing.h"
#include "shoestring/train/config.h"
#include "shoestring/train/time_budget.h"
#include "shoestring/train/trainer.h"
#include "train_testing.h"

using namespace shoestring;

namespace {

/// Predicted wall seconds of a run that stops at `last`, walked step by step.
double simulated_seconds(const BudgetInputs& in, int64_t last) {
  double t = in.elapsed_seconds;
  for (int64_t s = in.steps_done + 1; s <= last; ++s) {
    t += in.seconds_per_step;
    const bool grid = (in.sample_every_n_steps > 0 && s % in.sample_every_n_steps == 0) || s == last;
    if (grid) t += in.seconds_per_sample;
  }
  return t;
}

/// The largest last step whose simulated time fits, by trying every one.
int64_t brute_force(const BudgetInputs& in) {
  int64_t best = in.steps_done;
  for (int64_t n = in.steps_done + 1; n <= in.max_train_steps; ++n) {
    if (simulated_seconds(in, n) <= (1 - kReserveFraction) * in.budget_seconds) best = n;
  }
  return best;
}

}  // namespace

TEST(TimeBudget, SizedStepsAreTheLargestThatFit) {
  std::mt19937 gen(7);
  std::uniform_real_distribution<double> u(0, 1);
  for (int trial = 0; trial < 400; ++trial) {
    BudgetInputs in;
    in.budget_seconds = 60 + 1200 * u(gen);
    in.seconds_per_step = 0.2 + 8 * u(gen);
    in.steps_done = 6;
    in.elapsed_seconds = 5 + in.seconds_per_step * 6 + 30 * u(gen);
    in.max_train_steps = 6 + static_cast<int64_t>(900 * u(gen));
    in.sample_every_n_steps = trial % 3 == 0 ? 0 : 1 + static_cast<int64_t>(300 * u(gen));
    in.seconds_per_sample = trial % 5 == 0 ? 0 : 100 * u(gen);
    ASSERT_EQ(steps_within_budget(in), brute_force(in))
        << "trial " << trial << ": budget " << in.budget_seconds << " s, " << in.seconds_per_step << " s/step, every "
        << in.sample_every_n_steps << ", grid " << in.seconds_per_sample << " s, max " << in.max_train_steps;
  }
}

TEST(TimeBudget, NeverBelowStepsDoneNorAboveTheCeiling) {
  BudgetInputs in;
  in.budget_seconds = 10;
  in.elapsed_seconds = 50;  // already over budget
  in.seconds_per_step = 1;
  in.steps_done = 6;
  in.max_train_steps = 100;
  EXPECT_EQ(steps_within_budget(in), 6);
  in.budget_seconds = 1e9;
  EXPECT_EQ(steps_within_budget(in), 100);
  in.seconds_per_step = 0;
  EXPECT_NE(shoestring::testing::error_of([&] { steps_within_budget(in); }).find("seconds_per_step"),
            std::string::npos);
}

TEST(TimeBudget, SampleGridCostFollowsItsForwardPasses) {
  TrainConfig c;
  c.sample_prompts = {"a", "b"};
  c.sample_seeds = 3;
  c.sample_steps = 10;
  c.sample_cfg = 3;
  c.train_batch_size = 4;
  c.gradient_accumulation_steps = 1;
  // 2 x 3 images x 10 steps x 2 (CFG) = 120 forwards; a step = 3 x 4 = 12.
  EXPECT_DOUBLE_EQ(estimate_sample_seconds(c, 1.5), 1.5 * 120 / 12);
  c.sample_cfg = 1;
  EXPECT_DOUBLE_EQ(estimate_sample_seconds(c, 1.5), 1.5 * 60 / 12);
  // kohya's per-prompt options count: --s steps, --l guidance, --w x --h pixels.
  c.sample_cfg = 3;
  c.resolution = 64;
  c.sample_prompts = {"a --s 4", "b --l 1 --w 128 --h 64"};
  // a: 3 seeds x 4 steps x 2 (CFG) = 24; b: 3 x 10 x 1 x (128 x 64) / 64^2 = 60.
  EXPECT_DOUBLE_EQ(estimate_sample_seconds(c, 1.5), 1.5 * 84 / 12);
  c.sample_prompts.clear();
  EXPECT_EQ(estimate_sample_seconds(c, 1.5), 0);
}

TEST(TimeBudget, SizesOnceAfterTheTimedStepsAndNotWhenResumed) {
  TrainConfig c;
  c.max_train_minutes = 1;  // 60 s
  c.max_train_steps = 1000;
  c.sample_prompts.clear();
  TimeBudget budget(c, 0, /*started=*/100);
  double now = 110;                                // 10 s of setup
  EXPECT_FALSE(budget.observe(1, 5.0, now += 5));  // the first step is not timed
  std::optional<int64_t> sized;
  for (int64_t step = 2; step <= 1 + kTimedSteps; ++step) {
    ASSERT_FALSE(sized);
    sized = budget.observe(step, 2.0, now += 2);
  }
  ASSERT_TRUE(sized);
  // 25 s spent at step 6; (0.97 x 60 - 25) / 2 = 16.6 more steps.
  EXPECT_EQ(*sized, 6 + 16);
  EXPECT_NE(budget.explanation().find("5 timed steps at 2.00 s/step"), std::string::npos) << budget.explanation();
  EXPECT_FALSE(budget.observe(7, 2.0, now += 2));  // once
  TimeBudget resumed(c, 40, 0);
  for (int64_t step = 41; step < 50; ++step) EXPECT_FALSE(resumed.observe(step, 2.0, step * 2.0));
  c.max_train_minutes = 0;
  TimeBudget off(c, 0, 0);
  for (int64_t step = 1; step < 10; ++step) EXPECT_FALSE(off.observe(step, 2.0, step * 2.0));
}

// A budget too small for more than the timed steps ends the run at the step
// where it is sized, writes its final files, records the step in
// config.toml, and `--resume` finds it complete.
TEST(TimeBudget, SizedRunEndsWhereItsConfigSays) {
  const std::string out = shoestring::testing::fresh_temp_dir("budget", "sized");
  TrainConfig c = shoestring::testing::tiny_emoji_config(out);
  c.max_train_steps = 40;
  c.max_train_minutes = 1e-5;  // 0.6 ms
  const TrainSummary s = train(c, shoestring::testing::quiet());
  EXPECT_EQ(s.last_step, 1 + kTimedSteps);
  EXPECT_TRUE(std::filesystem::exists(out + "/model.safetensors"));
  const TrainConfig recorded = load_config(out + "/config.toml");
  EXPECT_EQ(recorded.max_train_steps, 1 + kTimedSteps);
  EXPECT_EQ(recorded.max_train_minutes, c.max_train_minutes);
  TrainRunOptions o = shoestring::testing::quiet();
  o.resume_dir = out;
  const std::string e = shoestring::testing::error_of([&] { train(recorded, o); });
  EXPECT_NE(e.find("complete"), std::string::npos) << e;
  std::filesystem::remove_all(out);
}
