// Data parallel training (zero_stage = 0): 2 processes with batch b train
// the emoji example's tiny UNet to the same losses and weights as one
// process with batch 2b; rank 0 alone writes the run folder; a rank that
// dies mid-run stops the other with an error naming the collective.
#include <chrono>
#include <map>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "../train/train_testing.h"
#include "dist_testing.h"
#include "dist_training_testing.h"
#include "shoestring/core/error.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/train/config.h"
#include "shoestring/train/trainer.h"

namespace shoestring {
namespace {

using shoestring::testing::fresh_dist_dir;
using shoestring::testing::read_text;
using shoestring::testing::run_workers;
using shoestring::testing::worker_dir;
using shoestring::testing::worker_env;
using shoestring::testing::worker_rank;
using shoestring::testing::write_text;
using ::testing::AllOf;
using ::testing::HasSubstr;

using shoestring::testing::ddp_config;
using shoestring::testing::expect_matches_one_process;
using shoestring::testing::load_trajectory;
using shoestring::testing::rank_env;
using shoestring::testing::save_trajectory;
using shoestring::testing::train_and_record;
using shoestring::testing::Trajectory;
constexpr int64_t kSteps = shoestring::testing::kDistSteps;

DIST_SCENARIO(ddp_train) {
  TrainConfig c = ddp_config(worker_dir() + "/run", std::stoll(worker_env("SHOESTRING_TEST_BATCH")));
  c.fused_backward_pass = worker_env("SHOESTRING_TEST_FUSED") == "1";
  c.offload_params = worker_env("SHOESTRING_TEST_OFFLOAD") == "1";
  if (!worker_env("SHOESTRING_TEST_MINUTES").empty()) {
    c.max_train_minutes = std::stod(worker_env("SHOESTRING_TEST_MINUTES"));
    c.max_train_steps = 100000;  // the budget is the limit
    c.save_every_n_steps = 0;    // the last step only
  }
  if (!worker_env("SHOESTRING_TEST_START_LATE").empty() && worker_rank() == 1) {
    // rank 0 waits for this rank to join: its clock runs longer before the first step
    std::this_thread::sleep_for(std::chrono::duration<double>(std::stod(worker_env("SHOESTRING_TEST_START_LATE"))));
  }
  if (!worker_env("SHOESTRING_TEST_ACCUM").empty())
    c.gradient_accumulation_steps = std::stoll(worker_env("SHOESTRING_TEST_ACCUM"));
  const std::string die_at = worker_env("SHOESTRING_TEST_DIE_AT");  // rank 1 exits after this step
  const int64_t die = die_at.empty() ? 0 : std::stoll(die_at);
  try {
    const Trajectory t = train_and_record(c, worker_rank() == 1 ? die : 0);
    save_trajectory(t, worker_dir() + "/rank" + std::to_string(worker_rank()) + ".pt");
  } catch (const Error& e) {
    write_text(worker_dir() + "/error" + std::to_string(worker_rank()) + ".txt", e.what());
    ::_exit(4);
  }
}

/// Runs ddp_train on 2 ranks x batch 2 in `dir` with the scenario's
/// variables `extra` (rank 1 dies after step `die_at` when > 0); returns the
/// exit statuses.
std::vector<int> two_ranks(const std::string& dir, const std::map<std::string, std::string>& extra,
                           int64_t die_at = 0) {
  const int port = shoestring::testing::free_tcp_port();
  return run_workers("ddp_train", 2, dir, [&](int r) {
    auto env = rank_env(r, 2, port, 2, die_at);
    for (const auto& [key, value] : extra) env[key] = value;
    return env;
  });
}

TEST(DataParallelTraining, TwoRanksMatchOneProcessWithDoubleBatch) {
  const std::string dir = fresh_dist_dir("ddp2");
  ASSERT_EQ(two_ranks(dir, {}), (std::vector<int>{0, 0}));
  const Trajectory r0 = load_trajectory(dir + "/rank0.pt");
  const Trajectory r1 = load_trajectory(dir + "/rank1.pt");

  // The reference: one process, batch 2 x 2 (this test process has no launch variables).
  const Trajectory one = train_and_record(ddp_config(dir + "/single", 4));
  ASSERT_EQ(r0.losses.size(), static_cast<size_t>(kSteps));
  ASSERT_EQ(r0.weights.size(), one.weights.size());
  for (size_t i = 0; i < r0.weights.size(); ++i) {
    // Every rank applies the same update to the same weights: bit-equal.
    EXPECT_TRUE(r0.weights[i].equal(r1.weights[i])) << "parameter " << i << " differs between ranks";
  }
  // One process sums the batch in one reduction, two ranks in two halves
  // then one all-reduce: equal up to fp32 summation order.
  expect_matches_one_process(r0, one, 1e-5);
  double max_weight_diff = 0, max_loss_diff = 0;
  for (size_t i = 0; i < r0.weights.size(); ++i)
    max_weight_diff = std::max(max_weight_diff, (r0.weights[i] - one.weights[i]).abs().max().item<double>());
  for (int64_t s = 0; s < kSteps; ++s) max_loss_diff = std::max(max_loss_diff, std::abs(r0.losses[s] - one.losses[s]));
  std::cout << "2 ranks x batch 2 vs 1 process x batch 4: max |weight diff| " << max_weight_diff << ", max |loss diff| "
            << max_loss_diff << "\n";
  for (int64_t s = 0; s < kSteps; ++s) {
    EXPECT_EQ(r0.losses[s], r1.losses[s]) << "step " << s + 1 << ": ranks report the global batch's loss";
  }
  // Each rank ran forward and backward on its own half of the batch.
  EXPECT_GT(r0.activation_peak, 0);
  EXPECT_LT(r0.activation_peak, 0.75 * one.activation_peak);
  EXPECT_LT(r1.activation_peak, 0.75 * one.activation_peak);
  // Rank 0 alone wrote the run folder: one metrics line per step, its checkpoints, final files.
  EXPECT_EQ(shoestring::testing::losses_of(dir + "/run/metrics.jsonl"), r0.losses);
  EXPECT_TRUE(std::filesystem::exists(dir + "/run/checkpoints/step-000002/model.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/run/checkpoints/latest.json"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/run/model.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/run/samples/step-000004.png"));
  // The images per step are the global batch's.
  std::ifstream metrics(dir + "/run/metrics.jsonl");
  std::string line;
  std::getline(metrics, line);
  const auto rec = nlohmann::json::parse(line);
  EXPECT_NEAR(rec["images_per_second"].get<double>() * rec["seconds"].get<double>(), 4.0, 1e-9);
  EXPECT_NEAR(r0.summary_images_per_step, 4.0, 1e-6);  // the "done:" line counts both ranks' rows too
}

TEST(DataParallelTraining, ThreeRanksMatchOneProcessWithTripleBatch) {
  const std::string dir = fresh_dist_dir("ddp3");
  const int port = shoestring::testing::free_tcp_port();
  ASSERT_EQ(run_workers("ddp_train", 3, dir, [&](int r) { return rank_env(r, 3, port, 1); }),
            (std::vector<int>{0, 0, 0}));
  const Trajectory r0 = load_trajectory(dir + "/rank0.pt");
  const Trajectory r2 = load_trajectory(dir + "/rank2.pt");
  const Trajectory one = train_and_record(ddp_config(dir + "/single", 3));
  ASSERT_EQ(r0.weights.size(), r2.weights.size());
  for (size_t i = 0; i < r0.weights.size(); ++i) {
    EXPECT_TRUE(r0.weights[i].equal(r2.weights[i])) << "parameter " << i << " differs between ranks";
  }
  // 3 ranks sum in another order than one batch of 3; AdamW's normalised
  // update turns last-bit differences of near-zero gradients into weight
  // differences up to ~2e-5 after 4 steps (x0 prediction's 1/t scale).
  expect_matches_one_process(r0, one, 5e-5);
}

TEST(DataParallelTraining, GradientAccumulationMatchesOneProcess) {
  // 2 ranks x batch 2 x 2 micro-batches (one all-reduce per step, after the
  // last micro-batch) against one process with batch 4 x 2 micro-batches.
  const std::string dir = fresh_dist_dir("ddpaccum");
  ASSERT_EQ(two_ranks(dir, {{"SHOESTRING_TEST_ACCUM", "2"}}), (std::vector<int>{0, 0}));
  const Trajectory r0 = load_trajectory(dir + "/rank0.pt");
  TrainConfig single = ddp_config(dir + "/single", 4);
  single.gradient_accumulation_steps = 2;
  const Trajectory one = train_and_record(single);
  expect_matches_one_process(r0, one, 1e-5);
}

TEST(DataParallelTraining, UnsupportedSettingIsRefusedOnEveryRank) {
  // offload_params streams one process's weights from host memory.
  const std::string dir = fresh_dist_dir("ddpoffload");
  EXPECT_EQ(two_ranks(dir, {{"SHOESTRING_TEST_OFFLOAD", "1"}}), (std::vector<int>{4, 4}));
  for (int r : {0, 1}) {
    EXPECT_THAT(read_text(dir + "/error" + std::to_string(r) + ".txt"),
                AllOf(HasSubstr("WORLD_SIZE = 2"), HasSubstr("offload_params is for one process")));
  }
}

// max_train_minutes: each rank times the same steps, but their clocks start
// apart (rank 1 joins 3 s late, so rank 0 has spent 3 s more of the budget
// when it sizes the run: about 60 steps of this model fewer); rank 0's
// sizing holds for both, so both stop at the same step, the one rank 0
// records in the run's config.toml.
TEST(DataParallelTraining, MaxTrainMinutesSizesEveryRankAlike) {
  const std::string dir = fresh_dist_dir("ddpminutes");
  ASSERT_EQ(two_ranks(dir, {{"SHOESTRING_TEST_MINUTES", "0.2"}, {"SHOESTRING_TEST_START_LATE", "3"}}),
            (std::vector<int>{0, 0}));
  const Trajectory r0 = load_trajectory(dir + "/rank0.pt");
  const Trajectory r1 = load_trajectory(dir + "/rank1.pt");
  EXPECT_EQ(r0.losses.size(), r1.losses.size());
  EXPECT_LT(r0.losses.size(), 100000u);
  const TrainConfig recorded = load_config(dir + "/run/config.toml");
  EXPECT_EQ(recorded.max_train_steps, static_cast<int64_t>(r0.losses.size()));
  std::cout << "max_train_minutes = 0.2 at 2 ranks: " << r0.losses.size() << " steps\n";
}

TEST(DataParallelTraining, ADeadRankStopsTheOtherNamingTheCollective) {
  const std::string dir = fresh_dist_dir("ddpdead");
  EXPECT_EQ(two_ranks(dir, {}, /*die_at=*/1), (std::vector<int>{4, 3}));
  EXPECT_THAT(read_text(dir + "/error0.txt"),
              AllOf(HasSubstr("on rank 0 of 2 failed"), HasSubstr("another rank exited")));
}

// fused_backward_pass: the survivor fails inside backward, waiting for a
// gradient bucket, and still exits with the error (helper-24 saw it die of
// SIGSEGV: the buckets' collectives outlived the process group).
TEST(DataParallelTraining, ADeadRankStopsTheOtherInsideAFusedBackward) {
  const std::string dir = fresh_dist_dir("ddpdeadfused");
  EXPECT_EQ(two_ranks(dir, {{"SHOESTRING_TEST_FUSED", "1"}}, /*die_at=*/1), (std::vector<int>{4, 3}));
  EXPECT_THAT(read_text(dir + "/error0.txt"),
              AllOf(HasSubstr("on rank 0 of 2 failed"), HasSubstr("another rank exited")));
}

}  // namespace
}  // namespace shoestring
