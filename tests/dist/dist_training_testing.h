// Helpers of the multi-process training tests (test_data_parallel_training,
// test_zero_training): the tiny emoji run, what a run leaves for the
// comparison (losses, final weights, ledger peaks), its file round trip
// between worker and test processes, and the formula-based comparison
// against one process.
#pragma once
#include <unistd.h>

#include <torch/serialize.h>

#include <cmath>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "../train/train_testing.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/train/config.h"
#include "shoestring/train/trainer.h"

namespace shoestring::testing {

inline constexpr int64_t kDistSteps = 4;

/// The tiny emoji run with `batch` images per rank, kDistSteps steps, a
/// checkpoint every 2 steps.
inline TrainConfig ddp_config(const std::string& out, int64_t batch, const std::string& extra = "") {
  TrainConfig c = tiny_emoji_config(out, extra);
  c.train_batch_size = batch;
  c.max_train_steps = kDistSteps;
  c.save_every_n_steps = 2;
  c.ddp_timeout = 1;  // minute
  return c;
}

/// What a run leaves for the comparison: losses per step, final trainable weights.
struct Trajectory {
  std::vector<double> losses;
  std::vector<double> grad_norms;  ///< per step, before clipping
  std::vector<at::Tensor> weights;
  double activation_peak = 0;       ///< the first step's peak activation bytes (proportional to the rows trained)
  double optimizer_state_peak = 0;  ///< the last step's peak optimizer_state bytes (the ledger's)
  double weights_peak = 0;          ///< the last step's peak weights bytes (the ledger's)
  double gradients_peak = 0;        ///< the last step's peak gradients bytes (the ledger's)
  /// The ledger's peak weights bytes of the last step with what follows it
  /// (its checkpoint, samples and final files).
  double last_step_with_saves_weights_peak = 0;
  double summary_images_per_step = 0;  ///< the run summary's images/s x s/step (the "done:" log line)
};

/// Trains `c` and records its trajectory; `die_at_step` > 0 exits the
/// process (status 3) after that step; `resume_dir` resumes that run. With
/// zero_stage = 3 a rank holds only its share of the weights after a step:
/// the final weights are then read back from the run's final model file.
inline Trajectory train_and_record(const TrainConfig& c, int64_t die_at_step = 0,
                                   const std::optional<std::string>& resume_dir = std::nullopt) {
  Trajectory t;
  torch::nn::Module* model = nullptr;
  std::vector<std::string> names;
  TrainRunOptions o = quiet();
  o.resume_dir = resume_dir;
  o.on_model_ready = [&](torch::nn::Module& m) {
    model = &m;
    for (const auto& item : m.named_parameters()) names.push_back(item.key());
  };
  o.on_step = [&](const nlohmann::json& rec) {
    t.losses.push_back(rec["loss"].get<double>());
    t.grad_norms.push_back(rec["grad_norm"].get<double>());
    const int64_t step = rec["step"].get<int64_t>();
    if (t.losses.size() == 1) t.activation_peak = rec["peak_activations_bytes"].get<double>();
    t.optimizer_state_peak = rec["peak_optimizer_state_bytes"].get<double>();
    t.weights_peak = rec["peak_weights_bytes"].get<double>();
    t.gradients_peak = rec["peak_gradients_bytes"].get<double>();
    if (step == die_at_step) ::_exit(3);
    if (step == c.max_train_steps) {
      for (const auto& p : model->parameters()) t.weights.push_back(p.detach().clone());
    }
  };
  const TrainSummary summary = train(c, o);
  t.last_step_with_saves_weights_peak = static_cast<double>(MemoryLedger::global().peak_bytes(MemoryCategory::weights));
  t.summary_images_per_step = summary.images_per_second * summary.seconds_per_step;
  bool sharded = false;
  for (const at::Tensor& w : t.weights) sharded = sharded || w.numel() == 0;
  if (sharded) {
    const SafetensorsFile file = SafetensorsFile::open(summary.run_dir + "/model.safetensors");
    for (size_t i = 0; i < names.size() && i < t.weights.size(); ++i)
      t.weights[i] = file.get(names[i]).to(t.weights[i].scalar_type()).clone();
  }
  return t;
}

/// The largest |a - b| over two runs' weights.
inline double max_weight_diff(const Trajectory& a, const Trajectory& b) {
  double m = 0;
  for (size_t i = 0; i < a.weights.size() && i < b.weights.size(); ++i)
    m = std::max(m, (a.weights[i].to(at::kDouble) - b.weights[i].to(at::kDouble)).abs().max().item<double>());
  return m;
}

/// A rank's trajectory against one process's (or another reference run's):
/// every weight within allclose(rtol 1e-4, `atol`) (fp32 summation order
/// differs), every loss within a relative 1e-5.
inline void expect_matches_one_process(const Trajectory& rank, const Trajectory& one, double atol) {
  ASSERT_EQ(rank.weights.size(), one.weights.size());
  for (size_t i = 0; i < rank.weights.size(); ++i) {
    EXPECT_TRUE(rank.weights[i].allclose(one.weights[i], 1e-4, atol))
        << "parameter " << i << ": max |diff| "
        << (rank.weights[i].to(at::kDouble) - one.weights[i].to(at::kDouble)).abs().max().item<double>();
  }
  ASSERT_EQ(rank.losses.size(), one.losses.size());
  for (size_t s = 0; s < one.losses.size(); ++s) {
    EXPECT_NEAR(rank.losses[s], one.losses[s], 1e-5 * std::abs(one.losses[s])) << "step " << s + 1;
  }
}

/// Every weight of two ranks bit-equal (every rank applies the same update).
inline void expect_same_weights(const Trajectory& a, const Trajectory& b, const std::string& what) {
  ASSERT_EQ(a.weights.size(), b.weights.size());
  for (size_t i = 0; i < a.weights.size(); ++i) {
    EXPECT_TRUE(a.weights[i].equal(b.weights[i])) << "parameter " << i << " differs: " << what;
  }
}

inline void save_trajectory(const Trajectory& t, const std::string& path) {
  std::vector<at::Tensor> all = t.weights;
  all.push_back(at::tensor(t.grad_norms, at::TensorOptions().dtype(at::kDouble)));
  all.push_back(at::tensor(t.losses, at::TensorOptions().dtype(at::kDouble)));
  all.push_back(at::tensor({t.activation_peak, t.optimizer_state_peak, t.summary_images_per_step, t.weights_peak,
                            t.last_step_with_saves_weights_peak, t.gradients_peak},
                           at::TensorOptions().dtype(at::kDouble)));
  torch::save(all, path);
}

inline Trajectory load_trajectory(const std::string& path) {
  std::vector<at::Tensor> all;
  torch::load(all, path);
  Trajectory t;
  t.activation_peak = all.back()[0].item<double>();
  t.optimizer_state_peak = all.back()[1].item<double>();
  t.summary_images_per_step = all.back()[2].item<double>();
  t.weights_peak = all.back()[3].item<double>();
  t.last_step_with_saves_weights_peak = all.back()[4].item<double>();
  t.gradients_peak = all.back()[5].item<double>();
  all.pop_back();
  at::Tensor losses = all.back();
  all.pop_back();
  at::Tensor norms = all.back();
  all.pop_back();
  t.weights = all;
  for (int64_t i = 0; i < losses.numel(); ++i) t.losses.push_back(losses[i].item<double>());
  for (int64_t i = 0; i < norms.numel(); ++i) t.grad_norms.push_back(norms[i].item<double>());
  return t;
}

/// The launch variables of rank `rank` of `world` on loopback port `port`,
/// plus the scenario's batch and the step after which rank 1 dies (0: never).
inline std::map<std::string, std::string> rank_env(int rank, int world, int port, int64_t batch, int64_t die_at = 0) {
  return {{"RANK", std::to_string(rank)},
          {"WORLD_SIZE", std::to_string(world)},
          {"MASTER_ADDR", "127.0.0.1"},
          {"MASTER_PORT", std::to_string(port)},
          {"SHOESTRING_TEST_BATCH", std::to_string(batch)},
          {"SHOESTRING_TEST_DIE_AT", die_at ? std::to_string(die_at) : ""}};
}

}  // namespace shoestring::testing
