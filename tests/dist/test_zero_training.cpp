// ZeRO stages 1 and 2 in training (dist/zero.h): the emoji example's tiny
// UNet on 2 and 3 processes trains to the weights and losses of
// zero_stage = 0 / one process with AdamW, AdamW8bit, Adafactor and bf16
// weights with stochastic rounding; each rank holds about 1/W of the
// optimizer state (the ledger's optimizer_state category); a sharded
// checkpoint (each rank's optimizer shard, indexed by rank 0) resumes at
// 1, 2 and 3 ranks and another stage, a one-process checkpoint at 2 ranks,
// survives a rank killed while writing it, and consolidates into the final
// model file; configs it cannot run are refused naming the key.
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "../cli/run_cli.h"
#include "../train/train_testing.h"
#include "dist_testing.h"
#include "dist_training_testing.h"
#include "shoestring/core/error.h"
#include "shoestring/io/atomic_file.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/io/weight_files.h"
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
using shoestring::testing::read_png;
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
  if (!worker_env("SHOESTRING_TEST_SEED").empty()) c.seed = std::stoll(worker_env("SHOESTRING_TEST_SEED"));
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
  int crash_at = 0;   ///< > 0: rank 1 dies at its crash_at-th atomic write (io/atomic_file.h's hook)
  int64_t seed = -1;  ///< >= 0: the config's seed instead of the fixture's
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
        if (r.seed >= 0) env["SHOESTRING_TEST_SEED"] = std::to_string(r.seed);
        if (rank == 1 && r.crash_at > 0) env["SHOESTRING_TEST_CRASH_AT_WRITE"] = std::to_string(r.crash_at);
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
  std::string errors;
  for (int rank = 0; rank < r.world; ++rank) {
    const std::string path = dir + "/" + r.name + ".error" + std::to_string(rank) + ".txt";
    if (fs::exists(path)) errors += fmt::format("\nrank {}: {}", rank, read_text(path));
  }
  EXPECT_EQ(status, std::vector<int>(static_cast<size_t>(r.world), 0)) << r.name << ":" << errors;
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

/// 2 ranks x batch 2 at zero_stage 0 and 2 (and 1 when `stage_1`) with the
/// optimizer settings `extra` (TOML): stages 1 and 2 train as stage 0. (Stage
/// 1 shards only the optimizer state, which stage 2 shards the same way: it
/// runs for one optimizer, to keep the suite's time.)
void expect_stages_train_as_stage_0(const std::string& name, const std::string& extra, bool stage_1 = false) {
  const std::string dir = fresh_dist_dir("zero_" + name);
  // 2 ranks x batch 2 at zero_stage 0, 1 and 2 (clipping on: max_grad_norm 1 by default).
  const std::vector<Trajectory> s0 = train_ranks(dir, {"s0", 2, 2, 0, extra});
  const std::vector<Trajectory> s2 = train_ranks(dir, {"s2", 2, 2, 2, extra});
  ASSERT_EQ(s0.size(), 2u);
  ASSERT_EQ(s2.size(), 2u);
  if (stage_1) {
    const std::vector<Trajectory> s1 = train_ranks(dir, {"s1", 2, 2, 1, extra});
    ASSERT_EQ(s1.size(), 2u);
    // Stage 1 reduces as stage 0 and clips with the same local norm; each
    // tensor's owner applies the very update stage 0 applies everywhere.
    expect_matches_one_process(s1[0], s0[0], 1e-5);
    expect_same_weights(s1[0], s0[0], "zero_stage 1 vs 0");
    std::cout << name << ": max |weight diff| stage 1 vs 0 " << max_weight_diff(s1[0], s0[0]) << "\n";
    expect_sharded_state(s1, s0[0].optimizer_state_peak, name + " stage 1");
  }
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
  std::cout << name << ": max |weight diff| stage 2 vs 0 " << max_weight_diff(s2[0], s0[0]) << "\n";
  // zero_stage 0 keeps the whole state on every rank; stages 1 and 2 about half each.
  EXPECT_EQ(s0[0].optimizer_state_peak, s0[1].optimizer_state_peak);
  expect_sharded_state(s2, s0[0].optimizer_state_peak, name + " stage 2");
}

TEST(ZeroTwoRanks, AdamW) { expect_stages_train_as_stage_0("AdamW", "optimizer_type = \"AdamW\"", /*stage_1=*/true); }
TEST(ZeroTwoRanks, AdamW8bit) { expect_stages_train_as_stage_0("AdamW8bit", "optimizer_type = \"AdamW8bit\""); }
TEST(ZeroTwoRanks, Adafactor) { expect_stages_train_as_stage_0("Adafactor", "optimizer_type = \"Adafactor\""); }
// bf16 weights, updated through stochastic rounding keyed by the parameter's index.
TEST(ZeroTwoRanks, Bf16StochasticRounding) {
  expect_stages_train_as_stage_0("bf16_sr", "full_bf16 = true\nmixed_precision = \"bf16\"");
}

// full_bf16 with gradient accumulation (the accumulator path) on 2 ranks:
// each rank sums its micro-batches in its own buffers (fp32, or bf16 with
// stochastic rounding), adds them to the last micro-batch's gradient in
// fp32, and the ranks average that sum (no communication before the last
// micro-batch). Stages 1 and 2 train as stage 0; stage 0 trains as one
// process with the same global batch, up to bf16's rounding of the
// per-rank gradients. (Stage 3: ZeroStage3.Bf16WithGradientAccumulation.)
TEST(ZeroTwoRanks, Bf16WithGradientAccumulation) {
  for (const std::string mode : {"fp32", "bf16_sr"}) {
    const std::string extra =
        "full_bf16 = true\nmixed_precision = \"bf16\"\ngradient_accumulation_steps = 2\n"
        "gradient_accumulation_dtype = \"" +
        mode + "\"\n";
    expect_stages_train_as_stage_0("bf16_accumulation_" + mode, extra, /*stage_1=*/mode == "fp32");
    const std::string dir = fresh_dist_dir("zero_bf16_accumulation_one_" + mode);
    const std::vector<Trajectory> s0 = train_ranks(dir, {"s0", 2, 2, 0, extra});
    ASSERT_EQ(s0.size(), 2u);
    const Trajectory one = train_and_record(ddp_config(dir + "/one", 4, extra));
    ASSERT_EQ(s0[0].losses.size(), one.losses.size());
    for (size_t s = 0; s < one.losses.size(); ++s) {
      EXPECT_NEAR(s0[0].losses[s], one.losses[s], 2e-3 * std::abs(one.losses[s])) << mode << ", step " << s + 1;
    }
    double diff = 0;
    for (size_t i = 0; i < one.weights.size(); ++i) {
      ASSERT_EQ(s0[0].weights[i].scalar_type(), at::kBFloat16);
      const at::Tensor a = s0[0].weights[i].to(at::kFloat), b = one.weights[i].to(at::kFloat);
      // A few of bf16's steps (2^-8 relative) where the rounding went the other way.
      EXPECT_TRUE(a.allclose(b, 2e-2, 2e-3)) << mode << ", parameter " << i;
      diff = std::max(diff, (a - b).abs().max().item<double>());
    }
    std::cout << "bf16 accumulation (" << mode << "): 2 ranks vs one process, max |weight diff| " << diff << "\n";
  }
}

// fused_backward_pass (each parameter stepped inside backward as its
// gradient is ready) on 2 ranks: the hook averages that parameter's step
// gradient first, all-reduced at stage 0, reduced to its owner at stages 1
// and 2, which alone steps it; the norm for the next step's clipping sums
// the owners' parts. With and without gradient accumulation, stages 1 and 2
// train as stage 0, and stage 0 as one process with the same global batch.
// (Stage 3: ZeroStage3.FusedBackward; two_pass clipping:
// ZeroTwoRanks.FusedTwoPassClipsAsTheUnfusedPath.)
TEST(ZeroTwoRanks, FusedBackward) {
  for (const std::string accumulation : {"1", "2"}) {
    const std::string extra = "fused_backward_pass = true\ngradient_accumulation_steps = " + accumulation + "\n";
    expect_stages_train_as_stage_0("fused_accumulation_" + accumulation, extra, /*stage_1=*/true);
    const std::string dir = fresh_dist_dir("zero_fused_one_" + accumulation);
    const std::vector<Trajectory> s0 = train_ranks(dir, {"s0", 2, 2, 0, extra});
    ASSERT_EQ(s0.size(), 2u);
    const Trajectory one = train_and_record(ddp_config(dir + "/one", 4, extra));
    expect_matches_one_process(s0[0], one, 5e-5);
    std::cout << "fused backward, accumulation " << accumulation << ": 2 ranks vs one process, max |weight diff| "
              << max_weight_diff(s0[0], one) << "\n";
  }
}

// fused_clip_method = "two_pass" on several ranks: the measuring pass sums
// each step gradient over the ranks (to its owner from stage 1 on) and
// measures it where it arrives, the owners' parts summed into one global
// norm; the second pass applies with that exact clip scale. So it clips as
// the unfused path does after its reduction: at stages 0, 2 and 3, with and
// without accumulation, the same norms, losses and weights up to fp32
// summation order, with clipping active at every step.
TEST(ZeroTwoRanks, FusedTwoPassClipsAsTheUnfusedPath) {
  const std::string dir = fresh_dist_dir("zero_fused_two_pass");
  double worst_weight = 0, worst_norm = 0;
  for (const std::string accumulation : {"1", "2"}) {
    for (const int stage : {0, 2, 3}) {
      const std::string name = "stage" + std::to_string(stage) + "_accumulation" + accumulation;
      SCOPED_TRACE(name);
      const std::string extra =
          "max_grad_norm = 0.05\ngradient_checkpointing = true\ngradient_accumulation_steps = " + accumulation + "\n";
      const std::vector<Trajectory> unfused = train_ranks(dir, {"u_" + name, 2, 2, stage, extra});
      const std::vector<Trajectory> fused = train_ranks(
          dir, {"f_" + name, 2, 2, stage, extra + "fused_backward_pass = true\nfused_clip_method = \"two_pass\"\n"});
      ASSERT_EQ(unfused.size(), 2u);
      ASSERT_EQ(fused.size(), 2u);
      expect_matches_one_process(fused[0], unfused[0], 5e-5);
      ASSERT_EQ(fused[0].grad_norms.size(), unfused[0].grad_norms.size());
      for (size_t k = 0; k < unfused[0].grad_norms.size(); ++k) {
        EXPECT_GT(unfused[0].grad_norms[k], 0.05) << "step " << k + 1 << " is clipped";
        EXPECT_NEAR(fused[0].grad_norms[k], unfused[0].grad_norms[k], 1e-5 * unfused[0].grad_norms[k])
            << "step " << k + 1;
        EXPECT_EQ(fused[0].grad_norms[k], fused[1].grad_norms[k]) << "every rank the same norm, step " << k + 1;
        worst_norm = std::max(worst_norm, std::abs(fused[0].grad_norms[k] / unfused[0].grad_norms[k] - 1));
      }
      worst_weight = std::max(worst_weight, max_weight_diff(fused[0], unfused[0]));
    }
  }
  std::cout << "fused two_pass vs unfused, stages 0 / 2 / 3, accumulation 1 / 2: max |weight diff| " << worst_weight
            << ", max relative norm diff " << worst_norm << "\n";
}

/// zero_stage = 3 on `world` ranks x batch 2 with gradient checkpointing
/// (the streamed blocks' weights gathered for each use) trains as stage 0
/// does: each block's gradients are reduced to their owner as soon as its
/// backward has run (summed in another order than stage 0's all-reduce) and
/// the final model is written from the other ranks' model shards that rank
/// 0 maps. Each
/// rank's weights (the ledger's peak, a streamed block gathered included)
/// are well under one process's; together they hold the model once plus
/// the resident layers and the blocks in use. Returns the test's folder.
std::string expect_stage3_trains_as_stage_0(const std::string& name, int world, const std::string& extra) {
  const std::string dir = fresh_dist_dir("zero_stage3_" + name);
  const std::string checkpointed = "gradient_checkpointing = true\n" + extra;
  const std::vector<Trajectory> s0 = train_ranks(dir, {"s0", world, 2, 0, checkpointed});
  const std::vector<Trajectory> s3 = train_ranks(dir, {"s3", world, 2, 3, checkpointed});
  EXPECT_EQ(s0.size(), static_cast<size_t>(world));
  EXPECT_EQ(s3.size(), static_cast<size_t>(world));
  if (s0.size() != static_cast<size_t>(world) || s3.size() != static_cast<size_t>(world)) return dir;
  expect_matches_one_process(s3[0], s0[0], 1e-5);
  for (size_t s = 0; s < s0[0].grad_norms.size() && s < s3[0].grad_norms.size(); ++s)
    EXPECT_NEAR(s3[0].grad_norms[s], s0[0].grad_norms[s], 1e-6 * s0[0].grad_norms[s]) << "step " << s + 1;
  std::cout << name << ": max |weight diff| stage 3 vs 0 " << max_weight_diff(s3[0], s0[0]) << "; weights bytes "
            << "per rank stage 0 " << s0[0].weights_peak << ", stage 3";
  double sum = 0;
  for (const Trajectory& t : s3) {
    std::cout << " " << t.weights_peak;
    sum += t.weights_peak;
    EXPECT_LT(t.weights_peak, 0.8 * s0[0].weights_peak) << name;
  }
  // The last step's checkpoint, samples and final file neither: rank 0
  // maps the other ranks' model shards instead of gathering the model.
  std::cout << "; with the last step's saves";
  for (size_t r = 0; r < s3.size(); ++r) {
    std::cout << " " << s3[r].last_step_with_saves_weights_peak;
    EXPECT_LT(s3[r].last_step_with_saves_weights_peak, 0.8 * s0[0].weights_peak) << name << ": rank " << r;
  }
  std::cout << "\n";
  EXPECT_GE(sum, s0[0].weights_peak) << name << ": the model is held once over the ranks";
  expect_sharded_state(s3, s0[0].optimizer_state_peak, name + " stage 3");
  return dir;
}

// (AdamW at 2 ranks: ZeroEma, whose stage-3 final file equals stage 0's bit for bit.)
TEST(ZeroStage3, TwoRanksAdafactorBf16StochasticRounding) {
  expect_stage3_trains_as_stage_0("Adafactor_bf16", 2,
                                  "optimizer_type = \"Adafactor\"\nfull_bf16 = true\nmixed_precision = \"bf16\"");
}
// A sample grid at every step: at the steps without a checkpoint (1, 3)
// every rank writes its streamed weights into RUN_DIR/.streamed-weights/
// for rank 0, removed after; the grids are stage 0's.
TEST(ZeroStage3, ThreeRanksWithGradientAccumulation) {
  const std::string dir =
      expect_stage3_trains_as_stage_0("accumulation", 3, "gradient_accumulation_steps = 2\nsample_every_n_steps = 1");
  EXPECT_FALSE(fs::exists(dir + "/s3/.streamed-weights"));
  for (const char* step : {"step-000001.png", "step-000003.png"}) {
    const at::Tensor s0 = read_png(dir + "/s0/samples/" + step), s3 = read_png(dir + "/s3/samples/" + step);
    ASSERT_EQ(s0.sizes(), s3.sizes()) << step;
    // Weights equal up to fp32 summation order: pixels within 1 of 255.
    EXPECT_LE((s0.to(at::kInt) - s3.to(at::kInt)).abs().max().item<int>(), 1) << step;
  }
}

// fused_backward_pass at stage 3: the hooks reduce every parameter's step
// gradient to its owner in buckets, the streamed blocks' too (whose release
// then reduces nothing), and the owner steps it as the sum arrives, while
// the other ranks' copies of the block are freed. With accumulation every
// micro-batch's gradients are summed over the ranks and only the owner
// buffers the sum (at stages 0-2 every rank buffers every gradient until
// the last micro-batch): each rank's gradient bytes under stage 0's. On
// this tiny model the fused buckets (one per owner, a quarter of the fp32
// gradients in all: fused_bucket_bytes) are as large as a rank's buffers,
// so the margin is that of the buffers: a rank buffering every tensor
// would hold about 1.15 of stage 0's bytes, its own about 0.8.
// With and without accumulation it trains as stage 0 (the same sums, in
// another order with accumulation).
TEST(ZeroStage3, FusedBackward) {
  for (const std::string accumulation : {"1", "2"}) {
    const std::string dir = expect_stage3_trains_as_stage_0(
        "fused_accumulation_" + accumulation, 2,
        "fused_backward_pass = true\ngradient_accumulation_steps = " + accumulation + "\n");
    if (accumulation == "1") continue;
    const Trajectory s0 = load_trajectory(dir + "/s0.rank0.pt");
    std::cout << "fused, accumulation 2: gradients bytes per rank stage 0 " << s0.gradients_peak << ", stage 3";
    for (const int rank : {0, 1}) {
      const Trajectory s3 = load_trajectory(dir + "/s3.rank" + std::to_string(rank) + ".pt");
      std::cout << " " << s3.gradients_peak;
      EXPECT_LT(s3.gradients_peak, 0.9 * s0.gradients_peak) << "rank " << rank;
    }
    std::cout << "\n";
  }
}

// full_bf16 with gradient accumulation at stage 3: each streamed block's
// gradient is summed over the ranks after every backward, in fp32, and its
// owner adds that sum to its buffer (fp32, or bf16 with stochastic
// rounding): never a bf16 sum rounded to nearest, and a rank's buffers hold
// its own tensors' sums only. Stage 0 sums each rank's micro-batches first,
// then over the ranks: with fp32 buffers the same sums up to fp32's order,
// so the bf16 weights (rounded with the same random bits) differ only where
// that order flips a rounding; with bf16 buffers within a few bf16 steps.
TEST(ZeroStage3, Bf16WithGradientAccumulation) {
  for (const std::string mode : {"fp32", "bf16_sr"}) {
    const std::string dir = fresh_dist_dir("zero_stage3_bf16_accumulation_" + mode);
    const std::string extra =
        "gradient_checkpointing = true\nfull_bf16 = true\nmixed_precision = \"bf16\"\n"
        "gradient_accumulation_steps = 2\ngradient_accumulation_dtype = \"" +
        mode + "\"\n";
    const std::vector<Trajectory> s0 = train_ranks(dir, {"s0", 2, 2, 0, extra});
    const std::vector<Trajectory> s3 = train_ranks(dir, {"s3", 2, 2, 3, extra});
    ASSERT_EQ(s0.size(), 2u);
    ASSERT_EQ(s3.size(), 2u);
    ASSERT_EQ(s3[0].losses.size(), s0[0].losses.size());
    for (size_t s = 0; s < s0[0].losses.size(); ++s) {
      EXPECT_NEAR(s3[0].losses[s], s0[0].losses[s], 2e-3 * std::abs(s0[0].losses[s])) << mode << ", step " << s + 1;
    }
    int64_t differ = 0, total = 0;
    for (size_t i = 0; i < s0[0].weights.size(); ++i) {
      ASSERT_EQ(s3[0].weights[i].scalar_type(), at::kBFloat16);
      const at::Tensor a = s3[0].weights[i].to(at::kFloat), b = s0[0].weights[i].to(at::kFloat);
      EXPECT_TRUE(a.allclose(b, 2e-2, 2e-3)) << mode << ", parameter " << i;
      differ += a.ne(b).sum().item<int64_t>();
      total += a.numel();
    }
    const double fraction = static_cast<double>(differ) / static_cast<double>(total);
    std::cout << "bf16 accumulation (" << mode << ") stage 3 vs 0: " << differ << " of " << total
              << " weights differ; gradients bytes per rank stage 0 " << s0[0].gradients_peak << ", stage 3 "
              << s3[0].gradients_peak << " " << s3[1].gradients_peak << "\n";
    if (mode == "fp32") {
      EXPECT_LT(fraction, 1e-3) << "fp32 sums in another order flip few roundings (bf16 sums: 11 %)";
    }
    for (const Trajectory& t : s3) EXPECT_LT(t.gradients_peak, 0.8 * s0[0].gradients_peak) << mode;
    expect_sharded_state(s3, s0[0].optimizer_state_peak, "bf16 accumulation (" + mode + ") stage 3");
  }
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

/// A copy of run folder `from` at `to` whose latest checkpoint is step 2 (as a run stopped there).
void copy_stopped_at_step_2(const std::string& from, const std::string& to) {
  fs::copy(from, to, fs::copy_options::recursive);
  fs::remove(fs::path(to) / kRunLockFile);
  set_latest_checkpoint(to, to + "/checkpoints/step-000002", 2);
}

/// Bytes of the tensors of a safetensors file whose names start with `prefix`.
int64_t tensor_bytes(const std::string& path, const std::string& prefix = "") {
  const auto file = SafetensorsFile::open(path);
  int64_t n = 0;
  for (const auto& info : file.tensors()) {
    if (info.name.rfind(prefix, 0) == 0) n += static_cast<int64_t>(info.nbytes());
  }
  return n;
}

/// A run resumed at step 2 against the run that did not stop: every final
/// weight within allclose(rtol 1e-4, `atol`) (0: bit for bit), the losses
/// of steps 3 and 4 within a relative 1e-5 (0: equal). Returns the largest
/// weight difference.
double expect_resumed_matches(const Trajectory& resumed, const Trajectory& full, double atol, const std::string& what) {
  EXPECT_EQ(resumed.losses.size(), 2u) << what;
  if (resumed.losses.size() != 2u || full.losses.size() != 4u) return -1;
  if (atol == 0) {
    expect_same_weights(resumed, full, what);
  } else {
    expect_matches_one_process(resumed, Trajectory{{full.losses[2], full.losses[3]}, {}, full.weights}, atol);
  }
  for (size_t s = 0; s < 2; ++s) {
    if (atol == 0) {
      EXPECT_EQ(resumed.losses[s], full.losses[s + 2]) << what << ": step " << s + 3;
    }
  }
  const double diff = max_weight_diff(resumed, full);
  std::cout << what << ": max |weight diff| " << diff << "\n";
  return diff;
}

/// The optimizer shards of a checkpoint hold the whole state of one process
/// (`total` bytes) once, about 1/W each; the rest of the folder once (one
/// model file, a training state without optimizer tensors); the index names
/// every tensor's file.
void expect_shards(const std::string& checkpoint, int world, int64_t total, const std::string& what) {
  int64_t sum = 0;
  std::string per_rank;
  for (int r = 0; r < world; ++r) {
    const std::string shard = checkpoint + "/" + optimizer_shard_name(r, world);
    ASSERT_TRUE(fs::exists(shard)) << shard;
    const int64_t bytes = tensor_bytes(shard);
    EXPECT_EQ(bytes, tensor_bytes(shard, "optimizer.")) << shard << " holds optimizer state only";
    EXPECT_LT(bytes, 1.5 * static_cast<double>(total) / world) << what << ": rank " << r;
    EXPECT_GT(bytes, 0.5 * static_cast<double>(total) / world) << what << ": rank " << r;
    sum += bytes;
    per_rank += fmt::format(" {} (file {})", bytes, fs::file_size(shard));
  }
  EXPECT_EQ(sum, total) << what << ": the shards hold the state once";
  EXPECT_EQ(tensor_bytes(checkpoint + "/state.safetensors", "optimizer."), 0) << what;
  size_t shards = 0;
  for (const auto& e : fs::directory_iterator(checkpoint)) shards += is_optimizer_shard_name(e.path().filename());
  EXPECT_EQ(shards, static_cast<size_t>(world)) << what;
  const std::optional<CheckpointIndex> index = read_checkpoint_index(checkpoint);
  ASSERT_TRUE(index) << checkpoint;
  EXPECT_EQ(index->world_size, world);
  for (const auto& e : fs::directory_iterator(checkpoint)) {
    const std::string name = e.path().filename();
    if (name == kCheckpointIndexFile) continue;
    const SafetensorsFile file = SafetensorsFile::open(e.path().string());
    for (const auto& info : file.tensors()) {
      auto it = index->weight_map.find(info.name);
      ASSERT_NE(it, index->weight_map.end()) << info.name << " of " << name << " not in the index";
      EXPECT_EQ(it->second, name) << info.name;
    }
  }
  std::cout << what << ": optimizer shard bytes per rank" << per_rank << " of " << total << " in one process\n";
}

/// Every tensor of two safetensors files equal, bytes and dtype (`atol` > 0:
/// values within allclose(rtol 1e-4, atol) instead); returns the largest
/// difference.
double compare_files(const std::string& a, const std::string& b, double atol = 0) {
  const auto fa = SafetensorsFile::open(a);
  const auto fb = SafetensorsFile::open(b);
  EXPECT_EQ(fa.tensors().size(), fb.tensors().size()) << a << " vs " << b;
  double diff = 0;
  for (const auto& info : fa.tensors()) {
    const TensorInfo* other = fb.find(info.name);
    EXPECT_NE(other, nullptr) << info.name << " missing from " << b;
    if (!other) continue;
    EXPECT_EQ(info.dtype, other->dtype) << info.name;
    EXPECT_EQ(info.shape, other->shape) << info.name;
    if (atol == 0) {
      EXPECT_EQ(fa.bytes(info), fb.bytes(*other)) << info.name << ": " << a << " vs " << b;
    }
    const at::Tensor x = fa.get(info).to(at::kDouble), y = fb.get(*other).to(at::kDouble);
    if (atol > 0) {
      EXPECT_TRUE(x.allclose(y, 1e-4, atol)) << info.name;
    }
    if (x.numel() > 0) diff = std::max(diff, (x - y).abs().max().item<double>());
  }
  return diff;
}

TEST(ZeroCheckpoint, ShardedResumesAtOneTwoAndThreeRanksAndConsolidates) {
  const std::string dir = fresh_dist_dir("zeroshards");
  // Uninterrupted: 2 ranks x batch 3 at zero_stage 2 (checkpoints at steps 2
  // and 4), and one process with the same global batch of 6.
  const std::vector<Trajectory> s2 = train_ranks(dir, {"s2", 2, 3, 2, ""});
  ASSERT_EQ(s2.size(), 2u);
  const Trajectory one = train_and_record(ddp_config(dir + "/one", 6));
  expect_matches_one_process(s2[0], one, 5e-5);

  // Each rank's shard: its own tensors' state, about half of one process's.
  const int64_t total = tensor_bytes(dir + "/one/checkpoints/step-000002/state.safetensors", "optimizer.");
  ASSERT_GT(total, 0);
  expect_shards(dir + "/s2/checkpoints/step-000002", 2, total, "2 ranks, zero_stage 2");
  EXPECT_EQ(tensor_bytes(dir + "/s2/checkpoints/step-000002/state.safetensors"),
            tensor_bytes(dir + "/one/checkpoints/step-000002/state.safetensors") - total)
      << "the rest of the training state once";

  // Resumed from step 2 at 2 ranks: the run that did not stop, bit for bit.
  copy_stopped_at_step_2(dir + "/s2", dir + "/r2");
  const std::vector<Trajectory> r2 = train_ranks(dir, {"r2", 2, 3, 2, "", /*resume=*/true});
  ASSERT_EQ(r2.size(), 2u);
  expect_resumed_matches(r2[0], s2[0], 0, "sharded, resumed at 2 ranks");

  // At 3 ranks x batch 2 and zero_stage 1 (the same global batch; each rank
  // reads the state of the tensors it owns now), within the 3-rank tolerance.
  copy_stopped_at_step_2(dir + "/s2", dir + "/r3");
  const std::vector<Trajectory> r3 = train_ranks(dir, {"r3", 3, 2, 1, "", /*resume=*/true});
  ASSERT_EQ(r3.size(), 3u);
  expect_resumed_matches(r3[0], s2[0], 5e-5, "sharded, resumed at 3 ranks, zero_stage 1");
  expect_shards(dir + "/r3/checkpoints/step-000004", 3, total, "3 ranks, zero_stage 1");

  // In one process with batch 6: the whole state from both shards.
  copy_stopped_at_step_2(dir + "/s2", dir + "/r1");
  const Trajectory r1 = train_and_record(ddp_config(dir + "/r1", 6), 0, dir + "/r1");
  expect_resumed_matches(r1, s2[0], 5e-5, "sharded, resumed in one process");
  EXPECT_EQ(r1.optimizer_state_peak, one.optimizer_state_peak) << "one process holds the whole state again";
  EXPECT_EQ(tensor_bytes(dir + "/r1/checkpoints/step-000004/state.safetensors", "optimizer."), total);
  EXPECT_FALSE(read_checkpoint_index(dir + "/r1/checkpoints/step-000004"))
      << "the copied 2-rank step-4 folder was rewritten as one process's";

  // A one-process checkpoint resumed at 2 ranks x batch 3, zero_stage 2.
  copy_stopped_at_step_2(dir + "/one", dir + "/o2");
  const std::vector<Trajectory> o2 = train_ranks(dir, {"o2", 2, 3, 2, "", /*resume=*/true});
  ASSERT_EQ(o2.size(), 2u);
  expect_resumed_matches(o2[0], one, 5e-5, "one-process checkpoint, resumed at 2 ranks");
  expect_sharded_state(o2, one.optimizer_state_peak, "one-process checkpoint resumed at 2 ranks");

  // Resumed in one process with the run's own train_batch_size 3: the
  // global batch halves, said in a warning naming both.
  copy_stopped_at_step_2(dir + "/s2", dir + "/w1");
  const auto warned = shoestring::testing::run_cli("train --resume " + dir + "/w1");
  EXPECT_EQ(warned.code, 0) << warned.output;
  EXPECT_THAT(warned.output, AllOf(HasSubstr("resumed at 1 rank(s) from a checkpoint of 2"),
                                   HasSubstr("the global batch is now 3 images per step"), HasSubstr("it was 6"),
                                   HasSubstr("train_batch_size x gradient_accumulation_steps = 6 per rank")))
      << warned.output;

  // consolidate: the sharded checkpoint of the last step is the run's final
  // model file, tensor for tensor (and one process's within the tolerance);
  // --dtype bf16 is libtorch's rounding of it.
  const std::string cli = std::string(SHOESTRING_BINARY) + " consolidate ";
  ASSERT_EQ(std::system((cli + dir + "/s2/checkpoints/step-000004 " + dir + "/s2.safetensors > " + dir +
                         "/consolidate.txt 2>&1")
                            .c_str()),
            0)
      << read_text(dir + "/consolidate.txt");
  EXPECT_THAT(read_text(dir + "/consolidate.txt"), HasSubstr("sharded checkpoint"));
  compare_files(dir + "/s2.safetensors", dir + "/s2/model.safetensors");
  std::cout << "consolidated 2-rank checkpoint vs one process's final file: max |diff| "
            << compare_files(dir + "/s2.safetensors", dir + "/one/model.safetensors", 5e-5) << "\n";
  ASSERT_EQ(std::system((cli + dir + "/one/checkpoints/step-000004 " + dir + "/one.safetensors > /dev/null").c_str()),
            0);
  compare_files(dir + "/one.safetensors", dir + "/one/model.safetensors");
  ASSERT_EQ(std::system((cli + dir + "/s2/checkpoints/step-000002 " + dir + "/s2_bf16.safetensors --dtype bf16 > " +
                         dir + "/consolidate.txt 2>&1")
                            .c_str()),
            0)
      << read_text(dir + "/consolidate.txt");
  const auto bf16 = SafetensorsFile::open(dir + "/s2_bf16.safetensors");
  const auto fp32 = SafetensorsFile::open(dir + "/s2/checkpoints/step-000002/model.safetensors");
  ASSERT_EQ(bf16.tensors().size(), fp32.tensors().size());
  for (const auto& info : fp32.tensors()) {
    const at::Tensor want = fp32.get(info);
    const at::Tensor got = bf16.get(info.name);
    if (want.is_floating_point()) {
      EXPECT_TRUE(got.equal(want.to(at::kBFloat16))) << info.name;
    }
  }
  EXPECT_EQ(bf16.metadata().at("dtype"), "bf16");
}

// A stage-3 checkpoint (each rank's model shard with the streamed weights
// it owns, rank 0's model.safetensors with the others, each rank's
// optimizer shard) resumes at 2 ranks, stage 3 (bit for bit: the same
// reductions in the same order) and in one process; consolidate writes the
// run's final model.
TEST(ZeroCheckpoint, Stage3ResumesAtTwoRanksAndOneProcess) {
  const std::string dir = fresh_dist_dir("zero3shards");
  const std::string checkpointed = "gradient_checkpointing = true\n";
  const std::vector<Trajectory> s3 = train_ranks(dir, {"s3", 2, 3, 3, checkpointed});
  ASSERT_EQ(s3.size(), 2u);
  {
    // The model once: every final tensor in exactly one of the model files,
    // each rank's shard holding some (the blocks it owns).
    const std::string step4 = dir + "/s3/checkpoints/step-000004/";
    std::map<std::string, int> copies;
    for (const std::string& file : {std::string("model.safetensors"), model_shard_name(0, 2), model_shard_name(1, 2)}) {
      ASSERT_TRUE(fs::exists(step4 + file)) << file;
      const auto f = SafetensorsFile::open(step4 + file);
      if (file != "model.safetensors") {
        EXPECT_GT(f.tensors().size(), 0u) << file;
      }
      for (const auto& info : f.tensors()) ++copies[info.name];
    }
    const auto final_file = SafetensorsFile::open(dir + "/s3/model.safetensors");
    EXPECT_EQ(copies.size(), final_file.tensors().size());
    for (const auto& [name, n] : copies) {
      EXPECT_EQ(n, 1) << name;
      EXPECT_NE(final_file.find(name), nullptr) << name;
    }
    EXPECT_FALSE(fs::exists(dir + "/s3/.streamed-weights"));
  }
  copy_stopped_at_step_2(dir + "/s3", dir + "/r2");
  const std::vector<Trajectory> r2 = train_ranks(dir, {"r2", 2, 3, 3, checkpointed, /*resume=*/true});
  ASSERT_EQ(r2.size(), 2u);
  expect_resumed_matches(r2[0], s3[0], 0, "stage 3, resumed at 2 ranks");
  copy_stopped_at_step_2(dir + "/s3", dir + "/r1");
  const Trajectory r1 = train_and_record(ddp_config(dir + "/r1", 6, checkpointed), 0, dir + "/r1");
  expect_resumed_matches(r1, s3[0], 5e-5, "stage 3, resumed in one process");
  const std::string cli = std::string(SHOESTRING_BINARY) + " consolidate ";
  ASSERT_EQ(std::system((cli + dir + "/s3/checkpoints/step-000004 " + dir + "/s3.safetensors > " + dir +
                         "/consolidate.txt 2>&1")
                            .c_str()),
            0)
      << read_text(dir + "/consolidate.txt");
  compare_files(dir + "/s3.safetensors", dir + "/s3/model.safetensors");
  // --ema on a run without EMA: refused, nothing written.
  EXPECT_NE(std::system((cli + "--ema " + dir + "/s3/checkpoints/step-000004 " + dir + "/no_ema.safetensors > " + dir +
                         "/consolidate.txt 2>&1")
                            .c_str()),
            0);
  EXPECT_THAT(read_text(dir + "/consolidate.txt"), HasSubstr("holds no EMA weights"));
  EXPECT_FALSE(fs::exists(dir + "/no_ema.safetensors"));
  // The model alone is read: a checkpoint that lost an optimizer shard still
  // gives its weights. Given the model file instead of its folder: named.
  const std::string lost = dir + "/lost_shard";
  fs::copy(dir + "/s3/checkpoints/step-000004", lost, fs::copy_options::recursive);
  fs::remove(lost + "/" + optimizer_shard_name(1, 2));
  ASSERT_EQ(std::system((cli + lost + " " + dir + "/lost.safetensors > " + dir + "/consolidate.txt 2>&1").c_str()), 0)
      << read_text(dir + "/consolidate.txt");
  compare_files(dir + "/lost.safetensors", dir + "/s3/model.safetensors");
  EXPECT_NE(
      std::system(
          (cli + lost + "/model.safetensors " + dir + "/file.safetensors > " + dir + "/consolidate.txt 2>&1").c_str()),
      0);
  EXPECT_THAT(read_text(dir + "/consolidate.txt"), HasSubstr("is a file; give the checkpoint folder"));
  // A damaged model part: refused naming it, nothing written.
  auto refused = [&](const std::string& what, const std::function<void(const std::string&)>& damage,
                     const std::string& named) {
    const std::string copy = dir + "/damaged_" + what;
    fs::copy(dir + "/s3/checkpoints/step-000004", copy, fs::copy_options::recursive);
    damage(copy);
    const std::string out = dir + "/damaged_" + what + ".safetensors";
    EXPECT_NE(std::system((cli + copy + " " + out + " > " + dir + "/consolidate.txt 2>&1").c_str()), 0) << what;
    EXPECT_THAT(read_text(dir + "/consolidate.txt"), HasSubstr(named)) << what;
    EXPECT_FALSE(fs::exists(out)) << what;
  };
  refused(
      "optimizer_as_model",
      [](const std::string& c) {
        fs::copy_file(c + "/" + optimizer_shard_name(1, 2), c + "/" + model_shard_name(1, 2),
                      fs::copy_options::overwrite_existing);
      },
      model_shard_name(1, 2));
  refused(
      "no_index", [](const std::string& c) { fs::remove(c + "/" + std::string(kCheckpointIndexFile)); },
      "no " + std::string(kCheckpointIndexFile));
  refused(
      "index_without_shards",
      [](const std::string& c) {
        const std::string path = c + "/" + std::string(kCheckpointIndexFile);
        nlohmann::json index = nlohmann::json::parse(read_text(path));
        nlohmann::json kept = nlohmann::json::object();
        for (const auto& [name, file] : index["weight_map"].items()) {
          if (!is_model_shard_name(file.get<std::string>())) kept[name] = file;
        }
        index["weight_map"] = kept;
        write_text(path, index.dump());
      },
      model_shard_name(0, 2));
  // A shard of another run (same config, step and world size): refused.
  const std::vector<Trajectory> other = train_ranks(dir, {"other", 2, 3, 3, checkpointed});
  ASSERT_EQ(other.size(), 2u);
  refused(
      "other_run",
      [&](const std::string& c) {
        fs::copy_file(dir + "/other/checkpoints/step-000004/" + model_shard_name(1, 2),
                      c + "/" + model_shard_name(1, 2), fs::copy_options::overwrite_existing);
      },
      "written by another run");
  // The step's model.safetensors alone is part of the model: `sample`
  // says so and takes the index instead.
  const std::string step4 = dir + "/s3/checkpoints/step-000004/";
  const std::string sample = std::string(SHOESTRING_BINARY) + " sample --prompt 'red heart' --steps 2 --out ";
  EXPECT_NE(
      std::system((sample + dir + "/part.png " + step4 + "model.safetensors > " + dir + "/sample.txt 2>&1").c_str()),
      0);
  EXPECT_THAT(read_text(dir + "/sample.txt"),
              AllOf(HasSubstr("one part of a ZeRO stage-3 checkpoint"), HasSubstr("consolidate")));
  EXPECT_EQ(
      std::system(
          (sample + dir + "/index.png " + step4 + kCheckpointIndexFile + " > " + dir + "/sample.txt 2>&1").c_str()),
      0)
      << read_text(dir + "/sample.txt");
  EXPECT_TRUE(fs::exists(dir + "/index.png"));
}

// EMA with ZeRO on 2 ranks (stages 2 and 3): each rank keeps the EMA of the
// tensors it owns and writes it into its checkpoint shard (none in
// state.safetensors); the final model file, written from the EMA weights
// every rank swapped in (stage 3: and wrote to a scratch folder that rank 0
// maps, removed after), is stage 0's (whose every rank
// keeps the whole EMA) within stage 3's summation-order tolerance; a
// stage-3 checkpoint's EMA shards resume at 2 ranks bit for bit and in one
// process.
TEST(ZeroEma, ShardedWithItsTensorsSavedInTheShardsAndSwappedInForTheFinalFile) {
  const std::string dir = fresh_dist_dir("zero_ema");
  const std::string extra = "gradient_checkpointing = true\nema_decay = 0.9\n";
  const std::vector<Trajectory> s0 = train_ranks(dir, {"s0", 2, 2, 0, extra});
  const std::vector<Trajectory> s2 = train_ranks(dir, {"s2", 2, 2, 2, extra});
  const std::vector<Trajectory> s3 = train_ranks(dir, {"s3", 2, 2, 3, extra});
  ASSERT_EQ(s0.size(), 2u);
  ASSERT_EQ(s2.size(), 2u);
  ASSERT_EQ(s3.size(), 2u);
  // The final file holds the EMA, not the step-4 checkpoint's trained weights.
  EXPECT_GT(compare_files(dir + "/s0/model.safetensors", dir + "/s0/checkpoints/step-000004/model.safetensors", 1.0),
            0.0);
  std::cout << "final EMA file vs stage 0's: stage 2 max |diff| "
            << compare_files(dir + "/s2/model.safetensors", dir + "/s0/model.safetensors", 1e-5) << ", stage 3 "
            << compare_files(dir + "/s3/model.safetensors", dir + "/s0/model.safetensors", 1e-5) << "\n";
  // Optimizer state and EMA (both the ledger's optimizer_state): about half on each rank, the whole once.
  expect_sharded_state(s2, s0[0].optimizer_state_peak, "EMA, stage 2");
  expect_sharded_state(s3, s0[0].optimizer_state_peak, "EMA, stage 3");
  EXPECT_FALSE(fs::exists(dir + "/s3/.streamed-weights")) << "the scratch folder of the EMA weights";
  const std::string step4 = dir + "/s3/checkpoints/step-000004/";
  EXPECT_EQ(tensor_bytes(step4 + "state.safetensors", "ema."), 0);
  const int64_t ema0 = tensor_bytes(step4 + optimizer_shard_name(0, 2), "ema.");
  const int64_t ema1 = tensor_bytes(step4 + optimizer_shard_name(1, 2), "ema.");
  EXPECT_GT(ema0, 0);
  EXPECT_GT(ema1, 0);
  EXPECT_EQ(ema0 + ema1, tensor_bytes(dir + "/s0/checkpoints/step-000004/state.safetensors", "ema."));
  // Resumed from step 2: the same EMA, so the same final file.
  copy_stopped_at_step_2(dir + "/s3", dir + "/r2");
  ASSERT_EQ(train_ranks(dir, {"r2", 2, 2, 3, extra, /*resume=*/true}).size(), 2u);
  compare_files(dir + "/r2/model.safetensors", dir + "/s3/model.safetensors");
  copy_stopped_at_step_2(dir + "/s3", dir + "/r1");
  train_and_record(ddp_config(dir + "/r1", 4, extra), 0, dir + "/r1");
  compare_files(dir + "/r1/model.safetensors", dir + "/s3/model.safetensors", 5e-5);
  // consolidate --ema: the last step's checkpoint gives the final (EMA) file
  // bit for bit, from the shards (stage 3) and from state.safetensors (stage 0).
  const std::string cli = std::string(SHOESTRING_BINARY) + " consolidate ";
  const std::string log = dir + "/consolidate.txt";
  for (const std::string run : {"s3", "s0"}) {
    const std::string out = dir + "/" + run + "_ema.safetensors";
    ASSERT_EQ(
        std::system(
            (cli + "--ema " + dir + "/" + run + "/checkpoints/step-000004 " + out + " > " + log + " 2>&1").c_str()),
        0)
        << read_text(log);
    EXPECT_THAT(read_text(log), HasSubstr(" from their EMA)"));
    EXPECT_EQ(compare_files(out, dir + "/" + run + "/model.safetensors"), 0.0) << run;
  }
  // In fp32: the shadows themselves, which round to the final file's bf16 values.
  ASSERT_EQ(std::system(
                (cli + "--ema --dtype fp32 " + step4 + " " + dir + "/s3_ema32.safetensors > " + log + " 2>&1").c_str()),
            0)
      << read_text(log);
  {
    const auto fp32 = SafetensorsFile::open(dir + "/s3_ema32.safetensors");
    const auto final_file = SafetensorsFile::open(dir + "/s3/model.safetensors");
    ASSERT_EQ(fp32.tensors().size(), final_file.tensors().size());
    for (const auto& info : final_file.tensors()) {
      const at::Tensor kept = final_file.get(info);
      const at::Tensor shadow = fp32.get(*fp32.find(info.name));
      if (kept.is_floating_point()) {
        EXPECT_EQ(shadow.scalar_type(), at::kFloat) << info.name;
      }
      EXPECT_TRUE(torch::equal(shadow.to(kept.scalar_type()), kept)) << info.name;
    }
  }
  // A lost shard, or a run without EMA: refused by name, nothing written.
  const std::string lost = dir + "/lost_ema_shard";
  fs::copy(dir + "/s3/checkpoints/step-000004", lost, fs::copy_options::recursive);
  fs::remove(lost + "/" + optimizer_shard_name(1, 2));
  EXPECT_NE(std::system((cli + "--ema " + lost + " " + dir + "/lost.safetensors > " + log + " 2>&1").c_str()), 0);
  EXPECT_THAT(read_text(log), HasSubstr(optimizer_shard_name(1, 2)));
  EXPECT_FALSE(fs::exists(dir + "/lost.safetensors"));
}

// consolidate --ema of a bf16 run (fp32 shadows, bf16 weights): the shadows
// rounded to nearest into bf16, the run's final file bit for bit.
TEST(ZeroEma, ConsolidateEmaOfABf16RunIsItsFinalFile) {
  const std::string dir = fresh_dist_dir("ema_bf16");
  train_and_record(ddp_config(dir + "/run", 4, "full_bf16 = true\nema_decay = 0.9\n"));
  const std::string log = dir + "/consolidate.txt", out = dir + "/ema.safetensors";
  ASSERT_EQ(std::system((std::string(SHOESTRING_BINARY) + " consolidate --ema " + dir +
                         "/run/checkpoints/step-000004 " + out + " > " + log + " 2>&1")
                            .c_str()),
            0)
      << read_text(log);
  EXPECT_THAT(read_text(log), HasSubstr("single-file checkpoint"));
  EXPECT_EQ(SafetensorsFile::open(out).find("unet.conv_in.weight")->dtype, StDtype::BF16);
  EXPECT_EQ(compare_files(out, dir + "/run/model.safetensors"), 0.0);
  EXPECT_GT(compare_files(out, dir + "/run/checkpoints/step-000004/model.safetensors", 1.0), 0.0);
  // Damaged shadows are refused by name, nothing written: one beyond bf16's
  // range (the guard), one of another dtype, one missing beside its optimizer state.
  const std::string step4 = dir + "/run/checkpoints/step-000004";
  const SafetensorsFile state = SafetensorsFile::open(step4 + "/state.safetensors");
  const std::string victim = "ema.unet.conv_in.weight";
  auto tampered = [&](const std::string& name, const std::function<std::optional<at::Tensor>(const at::Tensor&)>& f) {
    const std::string copy = dir + "/" + name;
    fs::create_directories(copy);
    fs::copy_file(step4 + "/model.safetensors", copy + "/model.safetensors");
    std::vector<NamedTensor> tensors;
    for (const auto& info : state.tensors()) {
      const at::Tensor t = state.get(info);
      if (info.name != victim) {
        tensors.push_back({info.name, t, std::nullopt});
      } else if (const std::optional<at::Tensor> changed = f(t)) {
        tensors.push_back({info.name, *changed, std::nullopt});
      }
    }
    save_safetensors(copy + "/state.safetensors", tensors, state.metadata());
    return copy;
  };
  const std::string cli = std::string(SHOESTRING_BINARY) + " consolidate --ema ";
  for (const auto& [copy, expected] : std::vector<std::pair<std::string, std::string>>{
           {tampered("huge", [](const at::Tensor& t) { return t.clone().fill_(3.4e38); }),
            "would damage 1 tensor(s) (overflow, or more than 1% of nonzero values flushed to zero):"},
           {tampered("int", [](const at::Tensor& t) { return t.to(at::kInt); }), "expected an fp32 shadow"},
           {tampered("nan", [](const at::Tensor& t) { return t.clone().fill_(NAN); }), "holds inf or NaN"},
           {tampered("gone", [](const at::Tensor&) { return std::nullopt; }), "but no EMA shadow"}}) {
    EXPECT_NE(std::system((cli + copy + " " + copy + ".safetensors > " + log + " 2>&1").c_str()), 0) << copy;
    EXPECT_THAT(read_text(log), AllOf(HasSubstr(expected), HasSubstr("unet.conv_in.weight"))) << read_text(log);
    EXPECT_FALSE(fs::exists(copy + ".safetensors"));
    // The way out is named in consolidate's own flags.
    if (copy.find("huge") != std::string::npos) {
      EXPECT_THAT(read_text(log), HasSubstr("or pass --force"));
    }
  }
  // An output anywhere under the checkpoint folder is refused.
  fs::create_directories(step4 + "/sub");
  EXPECT_NE(std::system((cli + step4 + " " + step4 + "/sub/x.safetensors > " + log + " 2>&1").c_str()), 0);
  EXPECT_THAT(read_text(log), HasSubstr("inside the checkpoint folder"));
}

// save_precision = "fp32" with weights stored narrower and their fp32
// sources sharded over the owners: rank 0 writes the final file from the
// owners' masters (stage 1) and EMA shadows (stage 3, the streamed blocks'
// weights included), mapped from the last checkpoint's optimizer shards, bit
// for bit as those shards keep them; without that it wrote the stored
// weights upcast.
TEST(ZeroFinalFile, Fp32FromTheOwnersMastersAndEmaShadows) {
  struct Case {
    std::string name;
    int stage;
    std::string extra, prefix;
  };
  const std::vector<Case> cases = {
      {"masters", 1,
       "save_precision = \"fp32\"\nfull_fp16 = true\n[[precision.rule]]\nmatch = \"unet.*\"\nmaster = \"fp32\"\n",
       "master."},
      {"ema", 3,
       "save_precision = \"fp32\"\nfull_bf16 = true\nmixed_precision = \"bf16\"\nema_decay = 0.9\n"
       "gradient_checkpointing = true\n",
       "ema."}};
  const std::string dir = fresh_dist_dir("zero_final_fp32");
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name);
    const std::vector<Trajectory> ranks = train_ranks(dir, {k.name, 2, 2, k.stage, k.extra});
    ASSERT_EQ(ranks.size(), 2u);
    const std::string step = dir + "/" + k.name + "/checkpoints/step-000004";
    // The checkpoint's index maps the stored weights and the owners' optimizer shards alike.
    const WeightFiles checkpoint = WeightFiles::open(step + "/checkpoint.index.json");
    const SafetensorsFile model = SafetensorsFile::open(dir + "/" + k.name + "/model.safetensors");
    int64_t compared = 0, narrower = 0;
    for (const auto& info : model.tensors()) {
      const at::Tensor t = model.get(info);
      ASSERT_EQ(t.scalar_type(), at::kFloat) << info.name;
      if (!checkpoint.find(k.prefix + info.name)) continue;
      ++compared;
      EXPECT_TRUE(torch::equal(t, checkpoint.get(k.prefix + info.name))) << info.name << " is not its fp32 source";
      if (!torch::equal(t, checkpoint.get(info.name).to(at::kFloat))) ++narrower;
    }
    EXPECT_GT(compared, 10);
    EXPECT_GT(narrower, 10) << "the sources are not finer than the stored weights";
    std::cout << k.name << " (stage " << k.stage << ", 2 ranks): " << compared
              << " tensors written from their owners' fp32 sources, " << narrower
              << " of them finer than the stored weight\n";
  }
}

TEST(ZeroCheckpoint, ARankKilledWhileWritingItsShardLeavesAResumableRun) {
  const std::string dir = fresh_dist_dir("zerokill");
  const std::vector<Trajectory> full = train_ranks(dir, {"full", 2, 2, 2, ""});
  ASSERT_EQ(full.size(), 2u);
  // Rank 1 writes its shards only: its 2nd atomic write is the step-4 shard.
  // Killed there (after the temporary, before the rename), the other rank
  // stops too, and latest.json still names step 2.
  const std::vector<int> status = launch(dir, {"killed", 2, 2, 2, "", false, /*crash_at=*/2});
  EXPECT_EQ(status[1], kCrashExitCode);
  EXPECT_NE(status[0], 0);
  EXPECT_EQ(latest_checkpoint_dir(dir + "/killed"), dir + "/killed/checkpoints/step-000002");
  // Resumed: the uninterrupted run's weights, bit for bit, no temporary left.
  const std::vector<Trajectory> resumed = train_ranks(dir, {"killed", 2, 2, 2, "", /*resume=*/true});
  ASSERT_EQ(resumed.size(), 2u);
  expect_resumed_matches(resumed[0], full[0], 0, "killed at rank 1's step-4 shard, resumed");
  for (const auto& e : fs::recursive_directory_iterator(dir + "/killed"))
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
  compare_files(dir + "/killed/checkpoints/step-000004/" + optimizer_shard_name(1, 2),
                dir + "/full/checkpoints/step-000004/" + optimizer_shard_name(1, 2));
}

/// Steps skipped as non-finite (fp16 overflow at the loss scale), 1-based.
std::vector<size_t> skipped_steps(const Trajectory& t) {
  std::vector<size_t> out;
  for (size_t s = 0; s < t.grad_norms.size(); ++s) {
    if (!std::isfinite(t.grad_norms[s])) out.push_back(s + 1);
  }
  return out;
}

/// Largest |difference| of two trajectories' final weights.
double max_weight_diff_of(const Trajectory& a, const Trajectory& b) {
  double d = 0;
  for (size_t i = 0; i < a.weights.size() && i < b.weights.size(); ++i) {
    d = std::max(d, (a.weights[i].to(at::kDouble) - b.weights[i].to(at::kDouble)).abs().max().item<double>());
  }
  return d;
}

// fp16 weights with fp32 master weights (a precision rule with master =
// "fp32") and dynamic loss scaling, on 2 ranks at zero_stage 0 to 3. The
// loss scale starts high and grows after every clean step, so that steps
// overflow and are skipped: every stage skips the steps one process with
// the same global batch skips (the skip follows the global gradient norm,
// which all ranks agree on), and trains to its weights within fp16's
// rounding. From stage 1 on each rank keeps the masters of the tensors it
// owns only (with their optimizer state: about 1/2 each) and writes them
// into its checkpoint shard as "master.<param>"; a run resumed from that
// checkpoint at 2 ranks goes on bit for bit, and in one process reads every
// rank's masters.
TEST(ZeroMixedPrecision, Fp16LossScalingAndFp32MastersAtEveryStage) {
  const std::string dir = fresh_dist_dir("zero_fp16");
  const std::string extra =
      "gradient_checkpointing = true\n"
      "precision.loss_scale_init = 32768.0\n"
      "precision.loss_scale_growth_interval = 1\n"
      "[[precision.rule]]\nmatch = \"*\"\nstorage = \"fp16\"\ncompute = \"fp16\"\nmaster = \"fp32\"\n";
  const Trajectory one = train_and_record(ddp_config(dir + "/one", 4, extra));
  const std::vector<size_t> skipped = skipped_steps(one);
  ASSERT_FALSE(skipped.empty()) << "the loss scale overflows at least once";
  ASSERT_LT(skipped.size(), one.grad_norms.size()) << "and some steps apply";
  for (const auto& w : one.weights) EXPECT_EQ(w.scalar_type(), at::kHalf);
  // The model file says what its tensors are (it said fp32 for fp16 rules).
  EXPECT_EQ(SafetensorsFile::open(dir + "/one/model.safetensors").metadata().at("dtype"), "fp16");

  std::vector<std::vector<Trajectory>> stages;
  for (int stage = 0; stage <= 3; ++stage) {
    stages.push_back(train_ranks(dir, {"s" + std::to_string(stage), 2, 2, stage, extra}));
    ASSERT_EQ(stages.back().size(), 2u) << "zero_stage " << stage;
  }
  const Trajectory& s0 = stages[0][0];
  for (int stage = 0; stage <= 3; ++stage) {
    const Trajectory& t = stages[static_cast<size_t>(stage)][0];
    const std::string what = fmt::format("zero_stage {}", stage);
    EXPECT_EQ(skipped_steps(t), skipped) << what << ": the steps one process skips";
    EXPECT_EQ(skipped_steps(stages[static_cast<size_t>(stage)][1]), skipped) << what << ", rank 1";
    ASSERT_EQ(t.losses.size(), one.losses.size());
    for (size_t s = 0; s < one.losses.size(); ++s) {
      EXPECT_NEAR(t.losses[s], one.losses[s], 2e-3 * std::abs(one.losses[s])) << what << ", step " << s + 1;
    }
    // fp16 weights: within a few of fp16's steps near the largest weights
    // (2^-10 relative), the 2 ranks' fp32 sums being another order than
    // one process's.
    for (size_t i = 0; i < one.weights.size(); ++i) {
      EXPECT_TRUE(t.weights[i].to(at::kFloat).allclose(one.weights[i].to(at::kFloat), 4e-3, 2e-3))
          << what << ", parameter " << i;
    }
    std::cout << what << ": skipped steps " << fmt::format("{}", fmt::join(skipped_steps(t), " "))
              << ", max |weight diff| vs one process " << max_weight_diff_of(t, one) << ", vs stage 0 "
              << max_weight_diff_of(t, s0) << "\n";
  }
  // Stage 0 keeps every master and all optimizer state on every rank (one
  // process's bytes); stage 1 on the owners only.
  EXPECT_EQ(s0.optimizer_state_peak, one.optimizer_state_peak);
  expect_sharded_state(stages[1], one.optimizer_state_peak, "fp16 with fp32 masters, stage 1");

  // The checkpoint: the masters once, in the owners' shards.
  const std::string step2 = dir + "/s2/checkpoints/step-000002/";
  const int64_t masters = tensor_bytes(dir + "/one/checkpoints/step-000002/state.safetensors", "master.");
  ASSERT_GT(masters, 0);
  EXPECT_EQ(tensor_bytes(step2 + "state.safetensors", "master."), 0);
  const int64_t m0 = tensor_bytes(step2 + optimizer_shard_name(0, 2), "master.");
  const int64_t m1 = tensor_bytes(step2 + optimizer_shard_name(1, 2), "master.");
  EXPECT_GT(m0, 0);
  EXPECT_GT(m1, 0);
  EXPECT_EQ(m0 + m1, masters);

  // Resumed at step 2: at 2 ranks, the run that did not stop bit for bit;
  // in one process (batch 4), every rank's masters, within fp16's rounding.
  copy_stopped_at_step_2(dir + "/s2", dir + "/r2");
  const std::vector<Trajectory> r2 = train_ranks(dir, {"r2", 2, 2, 2, extra, /*resume=*/true});
  ASSERT_EQ(r2.size(), 2u);
  expect_resumed_matches(r2[0], stages[2][0], 0, "fp16 with masters, resumed at 2 ranks");
  copy_stopped_at_step_2(dir + "/s2", dir + "/r1");
  const Trajectory r1 = train_and_record(ddp_config(dir + "/r1", 4, extra), 0, dir + "/r1");
  std::vector<size_t> skipped_after_2;  // the resumed trajectory's steps count from step 3
  for (size_t step : skipped) {
    if (step > 2) skipped_after_2.push_back(step - 2);
  }
  EXPECT_EQ(skipped_steps(r1), skipped_after_2);
  EXPECT_EQ(r1.optimizer_state_peak, one.optimizer_state_peak) << "one process holds every master again";
  for (size_t i = 0; i < one.weights.size(); ++i) {
    EXPECT_TRUE(r1.weights[i].to(at::kFloat).allclose(stages[2][0].weights[i].to(at::kFloat), 4e-3, 2e-3))
        << "resumed in one process, parameter " << i;
  }

  // A master in rank 1's shard that no longer rounds to the model file's
  // weight (edited by hand): the owner's master is the weight on every rank
  // (train_ranks checks the ranks' weights bit for bit); one that is not
  // finite, or not fp32, is refused naming the shard (helper-23).
  const std::string shard1 = "/checkpoints/step-000002/" + optimizer_shard_name(1, 2);
  std::string master_name;
  {
    const SafetensorsFile shard = SafetensorsFile::open(dir + "/s2" + shard1);
    for (const auto& info : shard.tensors()) {
      if (info.name.rfind("master.", 0) == 0 && master_name.empty()) master_name = info.name;
    }
  }
  ASSERT_FALSE(master_name.empty());
  auto edit_master = [&](const std::string& run, const std::function<at::Tensor(const at::Tensor&)>& edit) {
    copy_stopped_at_step_2(dir + "/s2", dir + "/" + run);
    const std::string path = dir + "/" + run + shard1;
    std::vector<NamedTensor> tensors;
    std::map<std::string, std::string> metadata;
    {
      const SafetensorsFile file = SafetensorsFile::open(path);
      metadata = file.metadata();
      for (const auto& info : file.tensors()) {
        const at::Tensor t = file.get(info).clone();
        tensors.push_back({info.name, info.name == master_name ? edit(t) : t, std::nullopt});
      }
    }
    save_safetensors(path, tensors, metadata);
    // The index's record of the shard's size, as one who edits by hand would fix it.
    const std::string index_path = dir + "/" + run + "/checkpoints/step-000002/" + kCheckpointIndexFile;
    nlohmann::json index = nlohmann::json::parse(read_text(index_path));
    index["files"][optimizer_shard_name(1, 2)]["bytes"] = fs::file_size(path);
    write_text(index_path, index.dump());
  };
  // Resumed at stage 2 (rank 1 owns the edited master) and at stage 0
  // (every rank keeps every master): the same losses and weights, which
  // they were not while rank 0 took that weight from the model file.
  edit_master("scaled", [](const at::Tensor& t) { return t * 1.5; });
  edit_master("scaled0", [](const at::Tensor& t) { return t * 1.5; });
  const std::vector<Trajectory> scaled = train_ranks(dir, {"scaled", 2, 2, 2, extra, /*resume=*/true});
  const std::vector<Trajectory> scaled0 = train_ranks(dir, {"scaled0", 2, 2, 0, extra, /*resume=*/true});
  ASSERT_EQ(scaled.size(), 2u);
  ASSERT_EQ(scaled0.size(), 2u);
  expect_same_weights(scaled[0], scaled0[0], "an edited master, resumed at stage 2 and at stage 0");
  EXPECT_EQ(scaled[0].losses, scaled0[0].losses) << "an edited master, resumed at stage 2 and at stage 0";
  edit_master("nan", [](const at::Tensor& t) { return t.index_fill(0, at::zeros({1}, at::kLong), NAN); });
  EXPECT_EQ(launch(dir, {"nan", 2, 2, 2, extra, /*resume=*/true}), (std::vector<int>{4, 4}));
  EXPECT_THAT(read_text(dir + "/nan.error0.txt"),
              AllOf(HasSubstr(optimizer_shard_name(1, 2)), HasSubstr(master_name), HasSubstr("inf or NaN")));
  edit_master("half", [](const at::Tensor& t) { return t.to(at::kHalf).to(at::kFloat).to(at::kHalf); });
  EXPECT_EQ(launch(dir, {"half", 2, 2, 2, extra, /*resume=*/true}), (std::vector<int>{4, 4}));
  EXPECT_THAT(read_text(dir + "/half.error0.txt"),
              AllOf(HasSubstr(optimizer_shard_name(1, 2)), HasSubstr(master_name), HasSubstr("expected float32")));

  // Another seed at 2 ranks, and 3 ranks: still one process's skips. Each
  // rank backpropagates its share of the global batch's mean loss (its rows'
  // mean / W), so every activation gradient is as large as one process's
  // and overflows at the same loss scale; with each rank's own rows' mean
  // (W times larger per row), these skipped other steps (helper-23,
  // 2026-12-06: seed 1 at 2 ranks, 3 ranks at seed 3).
  for (const auto& [world, seed] : {std::pair<int, int64_t>{2, 1}, std::pair<int, int64_t>{3, 3}}) {
    const std::string what = fmt::format("{} ranks, seed {}", world, seed);
    TrainConfig single = ddp_config(fmt::format("{}/one_w{}_s{}", dir, world, seed), 2 * world, extra);
    single.seed = seed;
    const Trajectory reference = train_and_record(single);
    const std::vector<Trajectory> ranks =
        train_ranks(dir, {fmt::format("w{}_s{}", world, seed), world, 2, 2, extra, false, 0, seed});
    ASSERT_EQ(ranks.size(), static_cast<size_t>(world)) << what;
    EXPECT_FALSE(skipped_steps(reference).empty()) << what << ": overflows at least once";
    EXPECT_EQ(skipped_steps(ranks[0]), skipped_steps(reference)) << what;
    std::cout << what << ": skipped steps " << fmt::format("{}", fmt::join(skipped_steps(ranks[0]), " "))
              << ", max |weight diff| vs one process " << max_weight_diff_of(ranks[0], reference) << "\n";
  }
}

TEST(ZeroTraining, ConfigsItCannotRunAreRefusedNamingTheKey) {
  EXPECT_EQ(parse_config("zero_stage = 3\n", "run.toml").zero_stage, 3);
  EXPECT_THAT([] { parse_config("zero_stage = 4\n", "run.toml"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("zero_stage")));
  EXPECT_EQ(parse_config("zero_stage = 2\n", "run.toml").zero_stage, 2);
  EXPECT_EQ(parse_config("zero_stage = 1\n", "run.toml").zero_stage, 1);
  EXPECT_EQ(parse_config("ddp_timeout = 30\n", "run.toml").zero_stage, 0);
  EXPECT_EQ(parse_config("ddp_timeout = 30\n", "run.toml").ddp_timeout, 30);
  EXPECT_THAT([] { parse_config("ddp_timeout = 0\n", "run.toml"); },
              ::testing::ThrowsMessage<Error>(HasSubstr("ddp_timeout")));

  // Stage 3 without a checkpointed block: refused on every rank, naming the key.
  {
    const std::string dir3 = fresh_dist_dir("zero3refused");
    EXPECT_EQ(launch(dir3, {"plain", 2, 2, 3, ""}), (std::vector<int>{4, 4}));
    for (int r : {0, 1}) {
      EXPECT_THAT(read_text(dir3 + "/plain.error" + std::to_string(r) + ".txt"),
                  AllOf(HasSubstr("zero_stage = 3"), HasSubstr("gradient_checkpointing = true")));
    }
  }

  {
    // A LoRA network at stage 3: its adapters are outside the checkpointed blocks; stage 2 named instead.
    const std::string dir3 = fresh_dist_dir("zero3lora");
    EXPECT_EQ(launch(dir3, {"lora", 2, 2, 3, "gradient_checkpointing = true\nnetwork_module = \"networks.lora\""}),
              (std::vector<int>{4, 4}));
    for (int r : {0, 1}) {
      EXPECT_THAT(read_text(dir3 + "/lora.error" + std::to_string(r) + ".txt"),
                  AllOf(HasSubstr("LoRA network's adapters"), HasSubstr("zero_stage = 2")));
    }
  }
}

}  // namespace
}  // namespace shoestring
