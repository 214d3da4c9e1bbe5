// ZeRO stages 1 and 2 in training (dist/zero.h): the emoji example's tiny
// UNet on 2 and 3 processes trains to the weights and losses of
// zero_stage = 0 / one process with AdamW, AdamW8bit, Adafactor and bf16
// weights with stochastic rounding; each rank holds about 1/W of the
// optimizer state (the ledger's optimizer_state category); a stage-1
// checkpoint is the single-process one and resumes at another world size
// and stage; configs it cannot run are refused naming the key.
#include <filesystem>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "../train/train_testing.h"
#include "dist_testing.h"
#include "dist_training_testing.h"
#include "shoestring/core/error.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/train/checkpoint_io.h"
#include "shoestring/train/config.h"
#include "shoestring/train/run.h"
#include "shoestring/train/trainer.h"

namespace shoestring {
namespace {

namespace fs = std::filesystem;
using shoestring::testing::ddp_config;
using shoestring::testing::expect_matches_one_process;
using shoestring::testing::expect_same_weights;
using shoestring::testing::fresh_dist_dir;
using shoestring::testing::load_trajectory;
using shoestring::testing::max_weight_diff;
using shoestring::testing::rank_env;
using shoestring::testing::read_text;
using shoestring::testing::run_workers;
using shoestring::testing::save_trajectory;
using shoestring::testing::train_and_record;
using shoestring::testing::Trajectory;
using shoestring::testing::worker_dir;
using shoestring::testing::worker_env;
using shoestring::testing::worker_rank;
using shoestring::testing::write_text;
using ::testing::AllOf;
using ::testing::HasSubstr;

/// A worker: trains ddp_config(SHOESTRING_TEST_RUN, batch) with the TOML of
/// SHOESTRING_TEST_EXTRA at zero_stage SHOESTRING_TEST_STAGE (resuming the
/// run when SHOESTRING_TEST_RESUME = 1) and saves its trajectory as
/// <run>.rankR.pt, or its error as <run>.errorR.txt (exit 4).
DIST_SCENARIO(zero_train) {
  const std::string run = worker_dir() + "/" + worker_env("SHOESTRING_TEST_RUN");
  TrainConfig c = ddp_config(run, std::stoll(worker_env("SHOESTRING_TEST_BATCH")), worker_env("SHOESTRING_TEST_EXTRA"));
  c.zero_stage = std::stoll(worker_env("SHOESTRING_TEST_STAGE"));
  const bool resume = worker_env("SHOESTRING_TEST_RESUME") == "1";
  try {
    const Trajectory t = train_and_record(c, 0, resume ? std::optional<std::string>(run) : std::nullopt);
    save_trajectory(t, run + ".rank" + std::to_string(worker_rank()) + ".pt");
  } catch (const Error& e) {
    write_text(run + ".error" + std::to_string(worker_rank()) + ".txt", e.what());
    ::_exit(4);
  }
}

struct RankRun {
  std::string name;  ///< the run folder under the test's folder
  int world = 2;
  int64_t batch = 2;  ///< per rank
  int stage = 1;
  std::string extra;  ///< TOML lines
  bool resume = false;
};

/// Runs `r` on r.world processes; returns the exit statuses.
std::vector<int> launch(const std::string& dir, const RankRun& r) {
  const int port = shoestring::testing::free_tcp_port();
  return run_workers(
      "zero_train", r.world, dir,
      [&](int rank) {
        auto env = rank_env(rank, r.world, port, r.batch);
        env["SHOESTRING_TEST_RUN"] = r.name;
        env["SHOESTRING_TEST_STAGE"] = std::to_string(r.stage);
        env["SHOESTRING_TEST_EXTRA"] = r.extra;
        env["SHOESTRING_TEST_RESUME"] = r.resume ? "1" : "0";
        return env;
      },
      std::chrono::seconds(150));
}

/// Runs `r` and returns every rank's trajectory, after checking that every
/// rank finished and holds the same weights (every rank applies the same
/// update, bit for bit).
std::vector<Trajectory> train_ranks(const std::string& dir, const RankRun& r) {
  const std::vector<int> status = launch(dir, r);
  std::vector<Trajectory> out;
  EXPECT_EQ(status, std::vector<int>(static_cast<size_t>(r.world), 0))
      << r.name << ": " << read_text(dir + "/" + r.name + ".error0.txt");
  if (status != std::vector<int>(static_cast<size_t>(r.world), 0)) return out;
  for (int rank = 0; rank < r.world; ++rank)
    out.push_back(load_trajectory(dir + "/" + r.name + ".rank" + std::to_string(rank) + ".pt"));
  for (int rank = 1; rank < r.world; ++rank)
    expect_same_weights(out[0], out[static_cast<size_t>(rank)], r.name + ": rank 0 vs rank " + std::to_string(rank));
  return out;
}

/// Each rank's optimizer state (the ledger's optimizer_state peak of the
/// last step) is about 1/W of one process's `total`: together exactly
/// `total` (whole tensors, each on one rank), each at most total / W plus a
/// share of the largest tensors (< 1.5 x total / W on this model).
void expect_sharded_state(const std::vector<Trajectory>& ranks, double total, const std::string& what) {
  ASSERT_GT(total, 0);
  const double world = static_cast<double>(ranks.size());
  double sum = 0;
  std::string per_rank;
  for (size_t r = 0; r < ranks.size(); ++r) {
    sum += ranks[r].optimizer_state_peak;
    per_rank += fmt::format(" {:.0f}", ranks[r].optimizer_state_peak);
    EXPECT_LT(ranks[r].optimizer_state_peak, 1.5 * total / world) << what << ": rank " << r;
    EXPECT_GT(ranks[r].optimizer_state_peak, 0.5 * total / world) << what << ": rank " << r;
  }
  EXPECT_EQ(sum, total) << what;
  std::cout << what << ": optimizer state bytes per rank" << per_rank << " of " << total << " in one process\n";
}

/// 2 ranks x batch 2 at zero_stage 0, 1 and 2 with the optimizer settings
/// `extra` (TOML): stages 1 and 2 train as stage 0.
void expect_stages_train_as_stage_0(const std::string& name, const std::string& extra) {
  const std::string dir = fresh_dist_dir("zero_" + name);
  // 2 ranks x batch 2 at zero_stage 0, 1 and 2 (clipping on: max_grad_norm 1 by default).
  const std::vector<Trajectory> s0 = train_ranks(dir, {"s0", 2, 2, 0, extra});
  const std::vector<Trajectory> s1 = train_ranks(dir, {"s1", 2, 2, 1, extra});
  const std::vector<Trajectory> s2 = train_ranks(dir, {"s2", 2, 2, 2, extra});
  ASSERT_EQ(s0.size(), 2u);
  ASSERT_EQ(s1.size(), 2u);
  ASSERT_EQ(s2.size(), 2u);
  // Stage 1 reduces as stage 0 and clips with the same local norm; each
  // tensor's owner applies the very update stage 0 applies everywhere.
  expect_matches_one_process(s1[0], s0[0], 1e-5);
  expect_same_weights(s1[0], s0[0], "zero_stage 1 vs 0");
  // Stage 2: the same sums (a + b for two ranks), the norm summed in
  // another order: equal up to the last bits of the clipping factor.
  expect_matches_one_process(s2[0], s0[0], 1e-5);
  // The global norm (reported, and the clipping factor) sums both ranks'
  // parts: the norm of stage 0's whole gradient up to double summation order.
  ASSERT_EQ(s2[1].grad_norms.size(), s0[0].grad_norms.size());
  for (size_t s = 0; s < s0[0].grad_norms.size(); ++s) {
    EXPECT_NEAR(s2[0].grad_norms[s], s0[0].grad_norms[s], 1e-9 * s0[0].grad_norms[s]) << "step " << s + 1;
    EXPECT_NEAR(s2[1].grad_norms[s], s0[0].grad_norms[s], 1e-9 * s0[0].grad_norms[s]) << "step " << s + 1;
  }
  std::cout << name << ": max |weight diff| stage 1 vs 0 " << max_weight_diff(s1[0], s0[0]) << ", stage 2 vs 0 "
            << max_weight_diff(s2[0], s0[0]) << "\n";
  // zero_stage 0 keeps the whole state on every rank; stages 1 and 2 about half each.
  EXPECT_EQ(s0[0].optimizer_state_peak, s0[1].optimizer_state_peak);
  expect_sharded_state(s1, s0[0].optimizer_state_peak, name + " stage 1");
  expect_sharded_state(s2, s0[0].optimizer_state_peak, name + " stage 2");
}

TEST(ZeroTwoRanks, AdamW) { expect_stages_train_as_stage_0("AdamW", "optimizer_type = \"AdamW\""); }
TEST(ZeroTwoRanks, AdamW8bit) { expect_stages_train_as_stage_0("AdamW8bit", "optimizer_type = \"AdamW8bit\""); }
TEST(ZeroTwoRanks, Adafactor) { expect_stages_train_as_stage_0("Adafactor", "optimizer_type = \"Adafactor\""); }
// bf16 weights, updated through stochastic rounding keyed by the parameter's index.
TEST(ZeroTwoRanks, Bf16StochasticRounding) {
  expect_stages_train_as_stage_0("bf16_sr", "full_bf16 = true\nmixed_precision = \"bf16\"");
}

TEST(ZeroTraining, ThreeRanksMatchOneProcessWithTripleBatch) {
  const std::string dir = fresh_dist_dir("zero3");
  const std::vector<Trajectory> s1 = train_ranks(dir, {"s1", 3, 1, 1, ""});
  const std::vector<Trajectory> s2 = train_ranks(dir, {"s2", 3, 1, 2, ""});
  ASSERT_EQ(s1.size(), 3u);
  ASSERT_EQ(s2.size(), 3u);
  const Trajectory one = train_and_record(ddp_config(dir + "/single", 3));
  // The tolerance of DataParallelTraining.ThreeRanksMatchOneProcessWithTripleBatch.
  expect_matches_one_process(s1[0], one, 5e-5);
  expect_matches_one_process(s2[0], one, 5e-5);
  expect_sharded_state(s1, one.optimizer_state_peak, "3 ranks stage 1");
  expect_sharded_state(s2, one.optimizer_state_peak, "3 ranks stage 2");
}

/// The tensors of a training-state file by name.
std::map<std::string, at::Tensor> state_tensors_of(const std::string& checkpoint) {
  auto file = SafetensorsFile::open(checkpoint + "/state.safetensors");
  std::map<std::string, at::Tensor> out;
  for (const auto& info : file.tensors()) out[info.name] = file.get(info.name);
  return out;
}

/// A copy of run folder `from` at `to` whose latest checkpoint is step 2 (as a run stopped there).
void copy_stopped_at_step_2(const std::string& from, const std::string& to) {
  fs::copy(from, to, fs::copy_options::recursive);
  fs::remove(fs::path(to) / kRunLockFile);
  set_latest_checkpoint(to, to + "/checkpoints/step-000002", 2);
}

TEST(ZeroTraining, Stage1CheckpointIsOneProcessesAndResumesAtAnotherWorldSize) {
  const std::string dir = fresh_dist_dir("zeroresume");
  // Uninterrupted: 2 ranks x batch 2, 4 steps, checkpoints at steps 2 and 4, at zero_stage 1 and 0.
  const std::vector<Trajectory> s1 = train_ranks(dir, {"s1", 2, 2, 1, ""});
  const std::vector<Trajectory> s0 = train_ranks(dir, {"s0", 2, 2, 0, ""});
  ASSERT_EQ(s1.size(), 2u);
  ASSERT_EQ(s0.size(), 2u);

  // The stage-1 checkpoint holds every rank's optimizer state: the very
  // tensors of the stage-0 checkpoint (rank 0's whole state), bit for bit.
  const auto sharded = state_tensors_of(dir + "/s1/checkpoints/step-000002");
  const auto whole = state_tensors_of(dir + "/s0/checkpoints/step-000002");
  ASSERT_EQ(sharded.size(), whole.size());
  size_t optimizer_tensors = 0;
  for (const auto& [name, t] : whole) {
    auto it = sharded.find(name);
    ASSERT_NE(it, sharded.end()) << name << " missing from the stage-1 checkpoint";
    EXPECT_TRUE(it->second.equal(t)) << name;
    if (name.rfind("optimizer.", 0) == 0) ++optimizer_tensors;
  }
  EXPECT_GT(optimizer_tensors, 10u);

  // Resumed at 2 ranks and zero_stage 1 from step 2 (each rank keeps its
  // own tensors' state): the weights of the run that did not stop.
  copy_stopped_at_step_2(dir + "/s1", dir + "/r2");
  const std::vector<Trajectory> r2 = train_ranks(dir, {"r2", 2, 2, 1, "", /*resume=*/true});
  ASSERT_EQ(r2.size(), 2u);
  expect_same_weights(r2[0], s1[0], "resumed at step 2 vs uninterrupted");
  expect_sharded_state(r2, s0[0].optimizer_state_peak, "resumed at stage 1");

  // Resumed in one process (train_batch_size is a resume key, so the global
  // batch is then 2): the same weights as the stage-0 checkpoint resumed so.
  copy_stopped_at_step_2(dir + "/s1", dir + "/r1");
  copy_stopped_at_step_2(dir + "/s0", dir + "/r0");
  const Trajectory r1 = train_and_record(ddp_config(dir + "/r1", 2), 0, dir + "/r1");
  const Trajectory r0 = train_and_record(ddp_config(dir + "/r0", 2), 0, dir + "/r0");
  ASSERT_EQ(r1.losses.size(), 2u);
  expect_same_weights(r1, r0, "stage-1 checkpoint vs stage-0 checkpoint, resumed in one process");
  EXPECT_EQ(r1.optimizer_state_peak, s0[0].optimizer_state_peak) << "one process holds the whole state again";
}

TEST(ZeroTraining, ConfigsItCannotRunAreRefusedNamingTheKey) {
  EXPECT_THAT([] { parse_config("zero_stage = 3\n", "run.toml"); },
              ::testing::ThrowsMessage<Error>(
                  AllOf(HasSubstr("run.toml"), HasSubstr("zero_stage = 3 is not implemented yet"))));
  EXPECT_THAT([] { parse_config("zero_stage = 4\n", "run.toml"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("zero_stage")));
  EXPECT_EQ(parse_config("zero_stage = 2\n", "run.toml").zero_stage, 2);
  EXPECT_EQ(parse_config("zero_stage = 1\n", "run.toml").zero_stage, 1);
  EXPECT_EQ(parse_config("ddp_timeout = 30\n", "run.toml").zero_stage, 0);
  EXPECT_EQ(parse_config("ddp_timeout = 30\n", "run.toml").ddp_timeout, 30);
  EXPECT_THAT([] { parse_config("ddp_timeout = 0\n", "run.toml"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("ddp_timeout")));

  // Several ranks at zero_stage 1 with a gradient path it does not shard yet: refused on every rank.
  const std::string dir = fresh_dist_dir("zerofused");
  EXPECT_EQ(launch(dir, {"fused", 2, 2, 1, "fused_backward_pass = true"}), (std::vector<int>{4, 4}));
  for (int r : {0, 1}) {
    EXPECT_THAT(read_text(dir + "/fused.error" + std::to_string(r) + ".txt"),
                AllOf(HasSubstr("WORLD_SIZE = 2, zero_stage = 1"), HasSubstr("fused_backward_pass"),
                      HasSubstr("not support yet")));
  }
}

}  // namespace
}  // namespace shoestring
