// The memory planner against the memory ledger: predicted peaks of the emoji
// model within 10% of one real training step, over a grid of batch sizes,
// resolutions, checkpointing, fused backward and three optimizers; parameter
// counts against the built model; budget advice; size parsing.
#include <gtest/gtest.h>

#include <cmath>

#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/plan/measure.h"
#include "shoestring/plan/memory_plan.h"
#include "shoestring/train/config.h"
#include "shoestring/train/tiny_unet_model.h"

using namespace shoestring;

namespace {

TrainConfig emoji_config(const std::vector<std::string>& sets = {}) {
  std::vector<std::string> all = {std::string("train_data_dir=\"") + SHOESTRING_TEST_DATA + "/twemoji\"",
                                  "twemoji_categories=[]"};  // all 11 fixture images, not the example's smileys
  all.insert(all.end(), sets.begin(), sets.end());
  return load_config(std::string(SHOESTRING_SOURCE_DIR) + "/examples/emoji.toml", all);
}

double rel_error(int64_t predicted, int64_t measured) {
  return (static_cast<double>(predicted) - static_cast<double>(measured)) / static_cast<double>(measured);
}

}  // namespace

TEST(MemoryPlan, ParameterCountMatchesTheBuiltModel) {
  for (const char* base : {"model.base_channels=32", "model.base_channels=64"}) {
    for (const char* ss : {"model.scale_shift_norm=false", "model.scale_shift_norm=true"}) {
      TrainConfig c = emoji_config({base, ss});
      TinyUNetModel model(TinyUNetModelOptions::from_config(c, 300));
      int64_t n = 0;
      for (const auto& p : model->parameters()) n += p.numel();
      EXPECT_EQ(plan::plan_memory(c, 300).parameters, n) << base << " " << ss;
    }
  }
}

TEST(MemoryPlan, StateBytesFollowTheOptimizer) {
  TrainConfig c = emoji_config({"ema_decay=0"});
  const auto adamw = plan::plan_memory(c, 300);
  EXPECT_EQ(adamw.optimizer_state_bytes, adamw.parameters * 8);
  c.optimizer_state_dtype = "bf16";
  EXPECT_EQ(plan::plan_memory(c, 300).optimizer_state_bytes, adamw.parameters * 4);
  c.optimizer_type = "AdamW8bit";
  const auto a8 = plan::plan_memory(c, 300);
  EXPECT_LT(a8.optimizer_state_bytes, adamw.parameters * 23 / 10);  // ~2.03 bytes/param + small fp32 tensors
  EXPECT_GT(a8.optimizer_state_bytes, adamw.parameters * 2);
  c.offload_optimizer_state = true;
  const auto off = plan::plan_memory(c, 300);
  EXPECT_EQ(off.optimizer_state_bytes, 0);
  EXPECT_EQ(off.host_bytes, a8.optimizer_state_bytes);
  EXPECT_LT(off.predicted_peak_bytes, a8.predicted_peak_bytes);
}

// offload_params with EMA: the streamed weights' fp32 shadows are planned in
// host memory (EMA::move_shadows_to_host), the others' on the device; 4
// bytes per trained parameter in all.
TEST(MemoryPlan, OffloadedWeightsKeepTheirEmaInHostMemory) {
  TrainConfig c = emoji_config({"gradient_checkpointing=true", "offload_params=true", "ema_decay=0"});
  const auto without = plan::plan_memory(c, 300);
  c.ema_decay = 0.9;
  const auto with = plan::plan_memory(c, 300);
  const int64_t host_shadows = with.host_bytes - without.host_bytes;
  EXPECT_EQ(host_shadows + with.ema_bytes, 4 * with.parameters);
  EXPECT_GT(host_shadows, 4 * with.ema_bytes) << "most trained weights stream";
  EXPECT_GT(with.ema_bytes, 0) << "the resident weights' shadows stay on the device";
  c.offload_params = false;
  EXPECT_EQ(plan::plan_memory(c, 300).ema_bytes, 4 * with.parameters);
}

// Runs `train` refuses with offload_params (gradient paths that keep the
// gradients elsewhere than .grad) are planned as offloaded, with a note.
TEST(MemoryPlan, OffloadWithARefusedGradientPathIsNoted) {
  const auto noted = [](const plan::MemoryPlan& p, const std::string& what) {
    for (const std::string& n : p.notes) {
      if (n.find("offload_params with") != std::string::npos && n.find(what) != std::string::npos) return true;
    }
    return false;
  };
  const std::vector<std::string> offload = {"gradient_checkpointing=true", "offload_params=true"};
  EXPECT_FALSE(noted(plan::plan_memory(emoji_config(offload), 300), "refuses"));
  std::vector<std::string> sets = offload;
  sets.push_back("gradient_accumulation_steps=2");
  EXPECT_TRUE(noted(plan::plan_memory(emoji_config(sets), 300), "full_bf16 and gradient_accumulation_steps"));
  sets = offload;
  sets.insert(sets.end(), {"full_bf16=false", "mixed_precision=\"fp16\""});
  EXPECT_TRUE(noted(plan::plan_memory(emoji_config(sets), 300), "fp16 loss scaling"));
}

// bf16 weights computing in bf16 keep 2-byte activations, computing in fp32
// 4-byte ones; the planner's resolution cache must not serve one for the other.
TEST(MemoryPlan, Bf16ComputeChoiceChangesActivationsThroughTheCache) {
  TrainConfig c = emoji_config({"train_batch_size=4", "full_bf16=true"});
  c.bf16_compute = "bf16";
  const int64_t bf16 = plan::plan_memory(c, 300).activation_bytes;
  c.bf16_compute = "fp32";
  const int64_t fp32 = plan::plan_memory(c, 300).activation_bytes;
  EXPECT_GT(fp32, bf16 * 3 / 2) << "bf16 " << bf16 << " fp32 " << fp32;
  c.bf16_compute = "bf16";
  EXPECT_EQ(plan::plan_memory(c, 300).activation_bytes, bf16);
}

TEST(MemoryPlan, CheckpointingAndChunkingLowerActivations) {
  TrainConfig c = emoji_config({"train_batch_size=8"});
  const auto plain = plan::plan_memory(c, 300);
  c.gradient_checkpointing = true;
  const auto ckpt = plan::plan_memory(c, 300);
  EXPECT_GT(ckpt.checkpointing_saving_bytes, plain.activation_bytes / 2);
  EXPECT_EQ(ckpt.activation_bytes, plain.activation_bytes - ckpt.checkpointing_saving_bytes);
  c.gradient_checkpointing = false;
  c.attention_chunk_mib = 1;
  c.resolution = 64;
  const auto chunk = plan::plan_memory(c, 300);
  c.attention_chunk_mib = 0;
  EXPECT_LT(chunk.activation_bytes, plan::plan_memory(c, 300).activation_bytes);
}

// One real training step per configuration, measured by the ledger: the
// steady-state peak (step 2) and the first step's peak within 10%.
TEST(MemoryPlan, PredictsMeasuredPeakWithin10Percent) {
  struct Case {
    const char* opt;
    int64_t batch, res;
    bool ckpt, fused;
    std::vector<std::string> sets;
  };
  std::vector<Case> grid;
  for (const char* opt : {"AdamW", "AdamW8bit", "Adafactor"}) {
    grid.push_back({opt, 4, 32, false, false, {}});
    grid.push_back({opt, 4, 32, true, false, {}});
    grid.push_back({opt, 8, 16, false, true, {}});
    grid.push_back({opt, 2, 32, true, true, {}});
  }
  // Beyond the emoji defaults: fp32 weights, offloaded state, chunked attention, additive time embedding,
  // offloaded weights.
  grid.push_back({"AdamW", 4, 32, false, false, {"full_bf16=false"}});
  grid.push_back({"AdamW", 2, 32, true, true, {"full_bf16=false"}});
  grid.push_back({"AdamW", 4, 32, false, false, {"offload_optimizer_state=true"}});
  grid.push_back({"AdamW8bit", 4, 32, false, false, {"attention_chunk_mib=1"}});
  grid.push_back({"AdamW", 4, 32, false, false, {"model.scale_shift_norm=false"}});
  // Streamed blocks: each block's gradients leave the device after its backward.
  grid.push_back({"AdamW", 4, 32, true, false, {"offload_params=true"}});
  grid.push_back({"AdamW", 2, 32, true, false, {"offload_params=true"}});
  for (const Case& k : grid) {
    std::vector<std::string> sets = {"model.base_channels=32", "num_threads=1"};
    sets.insert(sets.end(), k.sets.begin(), k.sets.end());
    TrainConfig c = emoji_config(sets);
    c.optimizer_type = k.opt;
    if (std::string(k.opt) == "Adafactor") c.optimizer_args.clear();
    c.train_batch_size = k.batch;
    c.resolution = k.res;
    c.gradient_checkpointing = k.ckpt;
    c.fused_backward_pass = k.fused;
    std::string label =
        fmt::format("{} batch {} {}px{}{}", k.opt, k.batch, k.res, k.ckpt ? " ckpt" : "", k.fused ? " fused" : "");
    for (const auto& s : k.sets) label += " " + s;
    plan::Measurement m = plan::measure_training(c, 2);
    ASSERT_EQ(m.steps.size(), 2u);
    const double e2 = rel_error(m.plan.predicted_peak_bytes, m.steps[1].peak_bytes);
    const double e1 = rel_error(m.plan.first_step_peak_bytes, m.steps[0].peak_bytes);
    EXPECT_LE(std::abs(e2), 0.10) << label << ": predicted " << m.plan.predicted_peak_bytes << " measured "
                                  << m.steps[1].peak_bytes;
    EXPECT_LE(std::abs(e1), 0.10) << label << " (step 1): predicted " << m.plan.first_step_peak_bytes << " measured "
                                  << m.steps[0].peak_bytes;
    if (c.offload_optimizer_state) {
      // The state lives on the host: the ledger charges it there, the plan reports it there.
      EXPECT_GT(m.plan.host_bytes, 0);
      EXPECT_NEAR(static_cast<double>(m.steps[1].at_peak[static_cast<int>(MemoryCategory::host_offload)]),
                  static_cast<double>(m.plan.host_bytes), 0.02 * static_cast<double>(m.plan.host_bytes));
    }
  }
}

TEST(MemoryPlan, AdviceFitsTheBudgetOrNamesTheFloor) {
  TrainConfig c = emoji_config({"train_batch_size=32", "full_bf16=false"});
  const auto base = plan::plan_memory(c, 300);
  const int64_t budget = base.predicted_peak_bytes * 6 / 10;
  plan::Advice a = plan::advise(c, 300, budget);
  ASSERT_TRUE(a.found) << a.floor_reason;
  EXPECT_FALSE(a.fits_already);
  EXPECT_LE(a.best.plan.predicted_peak_bytes, budget);
  EXPECT_FALSE(a.best.config_lines.empty());
  // The proposed lines, pasted as overrides, give a config that fits.
  std::vector<std::string> sets = {"train_batch_size=32", "full_bf16=false"};
  for (const auto& line : a.best.config_lines) {
    std::string kv = line;
    kv.erase(std::remove(kv.begin(), kv.end(), ' '), kv.end());
    sets.push_back(kv);
  }
  EXPECT_LE(plan::plan_memory(emoji_config(sets), 300).predicted_peak_bytes, budget);
  // The cheapest switch first: with a budget that only needs fused backward, nothing slower is proposed.
  TrainConfig fused = c;
  fused.fused_backward_pass = true;
  const int64_t fused_peak = plan::plan_memory(fused, 300).predicted_peak_bytes;
  if (fused_peak < base.predicted_peak_bytes) {
    plan::Advice f = plan::advise(c, 300, fused_peak);
    ASSERT_TRUE(f.found);
    EXPECT_DOUBLE_EQ(f.best.slowdown, 1.0);
  }
  plan::Advice none = plan::advise(c, 300, 1 << 20);
  EXPECT_FALSE(none.found);
  EXPECT_NE(none.floor_reason.find("weights"), std::string::npos);
  EXPECT_TRUE(plan::advise(c, 300, base.predicted_peak_bytes).fits_already);
}

TEST(MemoryPlan, ParsesByteSizes) {
  EXPECT_EQ(plan::parse_byte_size("8GiB"), int64_t{8} << 30);
  EXPECT_EQ(plan::parse_byte_size("512 MiB"), int64_t{512} << 20);
  EXPECT_EQ(plan::parse_byte_size("1.5G"), int64_t{3} << 29);
  EXPECT_EQ(plan::parse_byte_size("2e9"), int64_t{2000000000});
  EXPECT_THROW(plan::parse_byte_size("eight gigs"), Error);
  EXPECT_THROW(plan::parse_byte_size("8XB"), Error);
  EXPECT_THROW(plan::parse_byte_size("-1G"), Error);
}

TEST(MemoryPlan, JsonHasStableFieldNames) {
  auto j = plan::plan_memory(emoji_config(), 300).to_json();
  for (const char* k : {"predicted_peak_bytes", "weights_bytes", "gradients_bytes", "optimizer_state_bytes",
                        "activations_bytes", "temporaries_bytes"}) {
    ASSERT_TRUE(j.contains(k)) << k;
    EXPECT_GE(j[k].get<int64_t>(), 0) << k;
  }
  int64_t sum = 0;
  for (const char* k :
       {"weights_bytes", "gradients_bytes", "optimizer_state_bytes", "activations_bytes", "temporaries_bytes"}) {
    sum += j[k].get<int64_t>();
  }
  EXPECT_EQ(sum, j["predicted_peak_bytes"].get<int64_t>());
}
