// The planner for several processes (plan_memory's world_size): ZeRO stages
// 1-2 shard the optimizer state as dist::TensorOwnership assigns the
// tensors, so one rank's state is what its owned tensors need (AdamW's fp32
// m and v: 8 bytes per element, docs/optimizers/), and the per-rank model
// states follow the ZeRO paper's stage-1 formula (Rajbhandari et al.,
// arXiv 1910.02054, with bf16 weights and gradients and K = 8):
// 2 Psi + 2 Psi + 8 Psi / N, plus at most the largest tensor's state.
#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <map>

#include <torch/torch.h>

#include "../error_testing.h"
#include "shoestring/dist/zero.h"
#include "shoestring/models/architecture.h"
#include "shoestring/nn/layers.h"
#include "shoestring/optim/fused_backward.h"
#include "shoestring/plan/memory_plan.h"
#include "shoestring/train/config.h"

using namespace shoestring;

namespace {

TrainConfig zero_config(int64_t stage) {
  return parse_config(fmt::format("resolution = 32\ntrain_batch_size = 1\nfull_bf16 = true\nzero_stage = {}\n"
                                  "[model]\narchitecture = \"sdxl\"\ntiny = true\n",
                                  stage),
                      "zero.toml");
}

}  // namespace

TEST(ZeroPlan, OptimizerStateIsTheLargestRanksOwnedTensors) {
  // The trainable tensors, in the order the trainer hands them to ZeroSharding.
  auto model = models::build_architecture("sdxl", nn::LayerInit{torch::kMeta}, /*tiny=*/true);
  std::vector<int64_t> numels;
  for (const auto& p : model->parameters()) numels.push_back(p.numel());
  int64_t psi = 0, largest = 0;
  for (int64_t n : numels) {
    psi += n;
    largest = std::max(largest, n);
  }
  const plan::MemoryPlan one = plan::plan_memory(zero_config(1), plan::kDefaultVocabSize, 1);
  EXPECT_EQ(one.optimizer_state_bytes, 8 * psi);  // one process: nothing is sharded
  EXPECT_EQ(one.communication_bytes, 0);
  EXPECT_EQ(one.weights_bytes, 2 * psi);
  for (const int world : {2, 4}) {
    for (const int64_t stage : {1, 2}) {
      const plan::MemoryPlan p = plan::plan_memory(zero_config(stage), plan::kDefaultVocabSize, world);
      const dist::TensorOwnership owners(numels, world);
      int64_t most = 0;
      for (int r = 0; r < world; ++r) most = std::max(most, owners.elements_of(r));
      EXPECT_EQ(p.optimizer_state_bytes, 8 * most) << "world " << world << " stage " << stage;
      // The EMA is sharded with its tensors: that rank's fp32 shadows.
      TrainConfig with_ema = zero_config(stage);
      with_ema.ema_decay = 0.99;
      EXPECT_EQ(plan::plan_memory(with_ema, plan::kDefaultVocabSize, world).ema_bytes, 4 * most) << world;
      // The paper's per-rank model states at stage 1: 2 Psi + 2 Psi + K Psi / N.
      const int64_t paper = 2 * psi + 2 * psi + 8 * psi / world;
      const int64_t model_states = p.weights_bytes + 2 * psi + p.optimizer_state_bytes;
      EXPECT_GE(model_states, paper) << world;
      EXPECT_LE(model_states, paper + 8 * largest) << world;
      EXPECT_EQ(p.world_size, world);
      EXPECT_EQ(p.zero_stage, stage);
      // Two fp32 buckets in flight, each at most 25 MiB or one larger tensor;
      // a bucket closes only when the next tensor would overflow it, so a
      // pair holds more than 25 MiB when the gradients do.
      const int64_t cap = int64_t{25} << 20;
      ASSERT_GT(4 * psi, cap);
      EXPECT_GT(p.communication_bytes, cap);
      EXPECT_LE(p.communication_bytes, 2 * std::max(cap, 4 * largest));
      EXPECT_LT(p.predicted_peak_bytes, one.predicted_peak_bytes + p.communication_bytes) << world;
      // Stage 2 reduces into owners: a bucket holds one owner's tensors
      // (dist::ZeroSharding), so its buffers are never larger than stage 1's.
      if (stage == 2) {
        const plan::MemoryPlan s1 = plan::plan_memory(zero_config(1), plan::kDefaultVocabSize, world);
        EXPECT_LE(p.communication_bytes, s1.communication_bytes) << world;
      }
    }
  }
  // zero_stage 0 (plain data parallel) keeps the whole state (and EMA) on every rank.
  EXPECT_EQ(plan::plan_memory(zero_config(0), plan::kDefaultVocabSize, 4).optimizer_state_bytes, 8 * psi);
  // offload_params at several ranks: planned without it, said in a note (train refuses it).
  TrainConfig offloaded = zero_config(2);
  offloaded.offload_params = true;
  bool noted = false;
  for (const std::string& n : plan::plan_memory(offloaded, plan::kDefaultVocabSize, 2).notes)
    noted = noted || n.find("offload_params is for one process") != std::string::npos;
  EXPECT_TRUE(noted);
  TrainConfig ema0 = zero_config(0);
  ema0.ema_decay = 0.99;
  EXPECT_EQ(plan::plan_memory(ema0, plan::kDefaultVocabSize, 4).ema_bytes, 4 * psi);
  EXPECT_NE(shoestring::testing::error_of([] {
              plan::plan_memory(zero_config(1), plan::kDefaultVocabSize, 0);
            }).find("world size"),
            std::string::npos);
}

// The ZeRO paper's own configuration: fp16 weights and gradients with fp32
// master weights and Adam, K = 12 bytes of optimizer state per parameter
// (master, m, v), all three sharded from stage 1 on: the rank that owns the
// most elements keeps 12 bytes for each of them, and the per-rank model
// states are 2 Psi + 2 Psi + 12 Psi / N plus at most the largest tensor's.
TEST(ZeroPlan, Fp16WithFp32MastersShardsTheMastersWithTheState) {
  auto model = models::build_architecture("sdxl", nn::LayerInit{torch::kMeta}, /*tiny=*/true);
  std::vector<int64_t> numels;
  int64_t psi = 0, largest = 0;
  for (const auto& p : model->parameters()) {
    numels.push_back(p.numel());
    psi += p.numel();
    largest = std::max(largest, p.numel());
  }
  auto config = [](int64_t stage) {
    return parse_config(fmt::format("resolution = 32\ntrain_batch_size = 1\nzero_stage = {}\n"
                                    "[[precision.rule]]\nmatch = \"*\"\nstorage = \"fp16\"\ncompute = \"fp16\"\n"
                                    "master = \"fp32\"\n"
                                    "[model]\narchitecture = \"sdxl\"\ntiny = true\n",
                                    stage),
                        "zero_fp16.toml");
  };
  const plan::MemoryPlan one = plan::plan_memory(config(1), plan::kDefaultVocabSize, 1);
  EXPECT_EQ(one.optimizer_state_bytes, 12 * psi);
  EXPECT_EQ(one.weights_bytes, 2 * psi);
  for (const int world : {2, 4}) {
    const dist::TensorOwnership owners(numels, world);
    int64_t most = 0;
    for (int r = 0; r < world; ++r) most = std::max(most, owners.elements_of(r));
    for (const int64_t stage : {1, 2}) {
      const plan::MemoryPlan p = plan::plan_memory(config(stage), plan::kDefaultVocabSize, world);
      EXPECT_EQ(p.optimizer_state_bytes, 12 * most) << "world " << world << " stage " << stage;
      const int64_t paper = 2 * psi + 2 * psi + 12 * psi / world;
      const int64_t model_states = p.weights_bytes + 2 * psi + p.optimizer_state_bytes;
      EXPECT_GE(model_states, paper) << world;
      EXPECT_LE(model_states, paper + 12 * largest) << world;
    }
    // zero_stage 0 keeps every master on every rank.
    EXPECT_EQ(plan::plan_memory(config(0), plan::kDefaultVocabSize, world).optimizer_state_bytes, 12 * psi);
  }
}

// fused_backward_pass on several ranks (optim/fused_backward.h,
// FusedReduction): the step gradients wait in fp32 buckets of a quarter of
// the model's (1 to 25 MiB), in reverse parameter order, closed where the receiving rank changes;
// the bucket being packed, its flat copy and two in flight: 4 buckets, or
// the whole model's fp32 gradients twice when they fill less. One process:
// none.
TEST(ZeroPlan, FusedBackwardOnSeveralRanksHoldsItsGradientBuckets) {
  auto model = models::build_architecture("sdxl", nn::LayerInit{torch::kMeta}, /*tiny=*/true);
  std::vector<int64_t> numels;
  int64_t psi = 0;
  for (const auto& p : model->parameters()) {
    numels.push_back(p.numel());
    psi += p.numel();
  }
  // A quarter of the fp32 gradients with one receiver, a thirty-second with
  // several owners, between 256 KiB and 25 MiB (fused_bucket_bytes).
  const int64_t cap = std::clamp<int64_t>(psi, int64_t{256} << 10, int64_t{25} << 20);
  const int64_t owners_cap = std::clamp<int64_t>(psi / 8, int64_t{256} << 10, int64_t{25} << 20);
  EXPECT_EQ(fused_bucket_bytes(psi), cap);
  EXPECT_EQ(fused_bucket_bytes(psi, 2), owners_cap);
  for (const int64_t stage : {0, 1, 2, 3}) {
    TrainConfig c = zero_config(stage);
    c.fused_backward_pass = true;
    EXPECT_EQ(plan::plan_memory(c, plan::kDefaultVocabSize, 1).communication_bytes, 0);
    // One bucket per owner (stage 0: one for all), filled in reverse order
    // up to cap / owners each: what is held at most is the filling buckets,
    // the packed bucket's flat copy and the two in flight.
    const dist::TensorOwnership owners(numels, 2);
    const int64_t share = stage == 0 ? cap : owners_cap / 2;
    std::map<int, int64_t> filling;
    std::deque<int64_t> in_flight;
    int64_t held = 0, peak = 0;
    auto send = [&](int r) {
      if (filling[r] == 0) return;
      peak = std::max(peak, held + filling[r]);
      in_flight.push_back(filling[r]);
      filling[r] = 0;
      if (in_flight.size() > 2) {
        held -= in_flight.front();
        in_flight.pop_front();
      }
    };
    for (size_t k = numels.size(); k-- > 0;) {
      const int r = stage == 0 ? -1 : owners.owner(k);
      if (filling[r] > 0 && filling[r] + numels[k] * 4 > share) send(r);
      filling[r] += numels[k] * 4;
      held += numels[k] * 4;
      peak = std::max(peak, held);
    }
    for (int r = -1; r < 2; ++r) send(r);
    const plan::MemoryPlan p = plan::plan_memory(c, plan::kDefaultVocabSize, 2);
    EXPECT_EQ(p.communication_bytes, std::min(2 * 4 * psi, peak)) << "stage " << stage;
    EXPECT_TRUE(std::none_of(p.notes.begin(), p.notes.end(),
                             [](const std::string& n) { return n.find("refuses") != std::string::npos; }))
        << "stage " << stage;
    EXPECT_GE(p.predicted_peak_bytes, p.weights_bytes + p.optimizer_state_bytes + p.communication_bytes)
        << "stage " << stage;
  }
  // What `train` refuses with several ranks is planned with a note saying so.
  auto noted = [](const TrainConfig& c, const std::string& what) {
    const plan::MemoryPlan p = plan::plan_memory(c, plan::kDefaultVocabSize, 2);
    return std::any_of(p.notes.begin(), p.notes.end(), [&](const std::string& n) {
      return n.find(what) != std::string::npos && n.find("refuses") != std::string::npos;
    });
  };
  TrainConfig two_pass = zero_config(1);
  two_pass.fused_backward_pass = true;
  two_pass.fused_clip_method = "two_pass";
  EXPECT_FALSE(noted(two_pass, "two_pass")) << "two_pass runs on several ranks";
  TrainConfig offload = zero_config(2);
  offload.offload_params = true;
  EXPECT_TRUE(noted(offload, "offload_params"));
}

// Stage 3 (dist/zero.h) shards the weights of checkpointed blocks: a rank's
// planned weights are its share of them (the ZeRO paper's 2 Psi / N for bf16
// weights) plus what stays whole (the layers outside blocks, the block in
// use), which does not depend on N; without checkpointing nothing streams.
TEST(ZeroPlan, Stage3ShardsTheWeightsOfCheckpointedBlocks) {
  auto model = models::build_architecture("sdxl", nn::LayerInit{torch::kMeta}, /*tiny=*/true);
  int64_t psi = 0, largest = 0;
  for (const auto& p : model->parameters()) {
    psi += p.numel();
    largest = std::max(largest, p.numel());
  }
  TrainConfig c = zero_config(3);
  c.gradient_checkpointing = true;
  const plan::MemoryPlan two = plan::plan_memory(c, plan::kDefaultVocabSize, 2);
  const plan::MemoryPlan four = plan::plan_memory(c, plan::kDefaultVocabSize, 4);
  const plan::MemoryPlan stage2 = plan::plan_memory(zero_config(2), plan::kDefaultVocabSize, 2);
  EXPECT_EQ(stage2.weights_bytes, 2 * psi);
  EXPECT_GE(two.weights_bytes, 2 * psi / 2);
  EXPECT_GE(four.weights_bytes, 2 * psi / 4);
  EXPECT_LT(two.weights_bytes, stage2.weights_bytes);
  EXPECT_LT(four.weights_bytes, two.weights_bytes);
  // What is not sharded is the same at every N, up to the owners' imbalance
  // (at most the largest tensor each).
  const int64_t whole_at_2 = two.weights_bytes - 2 * psi / 2, whole_at_4 = four.weights_bytes - 2 * psi / 4;
  EXPECT_LE(std::abs(whole_at_2 - whole_at_4), 2 * 2 * largest) << whole_at_2 << " vs " << whole_at_4;
  EXPECT_LT(whole_at_2, 2 * psi / 2) << "most of the weights are in checkpointed blocks";
  EXPECT_LE(two.predicted_peak_bytes, stage2.predicted_peak_bytes);
  bool noted = false;
  for (const std::string& n : two.notes) noted = noted || n.find("ZeRO stage 3") != std::string::npos;
  EXPECT_TRUE(noted);
  // Without checkpointed blocks nothing streams: stage 2's weights, and a note saying why.
  const plan::MemoryPlan plain = plan::plan_memory(zero_config(3), plan::kDefaultVocabSize, 2);
  EXPECT_EQ(plain.weights_bytes, 2 * psi);
  bool says = false;
  for (const std::string& n : plain.notes) says = says || n.find("gradient_checkpointing = true") != std::string::npos;
  EXPECT_TRUE(says);
  // full_bf16 with accumulation: at stage 3 a rank's buffers hold its own
  // streamed tensors' sums (and the resident ones'), at stage 2 every one.
  TrainConfig accumulate = c;
  accumulate.gradient_accumulation_steps = 2;
  TrainConfig accumulate2 = accumulate;
  accumulate2.zero_stage = 2;
  const plan::MemoryPlan acc3 = plan::plan_memory(accumulate, plan::kDefaultVocabSize, 2);
  const plan::MemoryPlan acc2 = plan::plan_memory(accumulate2, plan::kDefaultVocabSize, 2);
  const auto G = static_cast<size_t>(MemoryCategory::gradients);
  // Both peak in backward at stage 3, where the rank's buffers (at least
  // half the model's fp32 sums: the rank owning the most) replace its own
  // gradients, beside the resident ones and the block's in use: well under
  // the whole model's buffers (stage 2's).
  EXPECT_GE(acc3.at_peak[G], 4 * psi / 2);
  EXPECT_LT(acc3.at_peak[G], 0.75 * 4 * psi);
  EXPECT_GE(acc2.at_peak[G], 4 * psi);
  EXPECT_LT(acc3.predicted_peak_bytes, acc2.predicted_peak_bytes);
  for (const std::string& n : acc3.notes) EXPECT_EQ(n.find("refuses"), std::string::npos) << n;
  // `plan --budget` plans its proposals for the same world size: the
  // stage-3 plan's own peak fits already (one process would not).
  EXPECT_GT(plan::plan_memory(c, plan::kDefaultVocabSize, 1).predicted_peak_bytes, two.predicted_peak_bytes);
  const plan::Advice advice = plan::advise(c, plan::kDefaultVocabSize, two.predicted_peak_bytes, 2);
  EXPECT_TRUE(advice.fits_already);
  EXPECT_EQ(advice.best.plan.world_size, 2);
  // A LoRA network at stage 3: the run refuses it; the plan says so.
  TrainConfig lora = c;
  lora.network_module = "networks.lora";
  bool refused = false;
  for (const std::string& n : plan::plan_memory(lora, plan::kDefaultVocabSize, 2).notes)
    refused = refused || n.find("the run refuses it") != std::string::npos;
  EXPECT_TRUE(refused);
}
