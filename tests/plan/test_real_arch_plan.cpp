// The memory planner on the registered real architectures (denoiser only):
// parameter counts against the released models' published counts, and the
// predicted peak of one training step against the memory ledger's
// measurement of the same step (plan::measure_model_step, as
// bench/model_step runs it) on the tiny-width variants at a small
// resolution, within 15% of the measured total.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "shoestring/core/error.h"
#include "shoestring/core/units.h"
#include "shoestring/models/architecture.h"
#include "shoestring/plan/measure.h"
#include "shoestring/plan/memory_plan.h"
#include "shoestring/train/config.h"

using namespace shoestring;

namespace {

struct StepCase {
  const char* optimizer;
  bool fused, checkpointing;
};

// Measures one step per case and compares the prediction's total (and
// reports each category) with the ledger's.
void expect_within(const std::string& arch, int64_t resolution, const std::vector<StepCase>& cases,
                   double tolerance = 0.15) {
  for (const StepCase& k : cases) {
    plan::ModelStepOptions o;
    o.architecture = arch;
    o.tiny = true;
    o.resolution = resolution;
    o.steps = 2;
    o.optimizer = k.optimizer;
    o.fused = k.fused;
    o.checkpointing = k.checkpointing;
    const plan::MemoryPlan p = plan::plan_memory(plan::model_step_config(o), plan::kDefaultVocabSize);
    const plan::ModelStepResult r = plan::measure_model_step(o);
    EXPECT_EQ(p.parameters, r.parameters) << arch;
    const double err = static_cast<double>(p.predicted_peak_bytes) / static_cast<double>(r.step.peak_bytes) - 1;
    std::string detail;
    for (int c = 0; c <= static_cast<int>(MemoryCategory::temporaries); ++c) {
      detail += fmt::format(" {} {}/{}", to_string(static_cast<MemoryCategory>(c)), format_bytes(p.at_peak[c]),
                            format_bytes(r.step.at_peak[c]));
    }
    const std::string label = fmt::format("{} tiny {}px {}{}{}", arch, resolution, k.optimizer, k.fused ? " fused" : "",
                                          k.checkpointing ? " ckpt" : "");
    std::printf("[plan] %s: predicted %s measured %s (%+.1f%%) predicted/measured:%s\n", label.c_str(),
                format_bytes(p.predicted_peak_bytes).c_str(), format_bytes(r.step.peak_bytes).c_str(), 100 * err,
                detail.c_str());
    EXPECT_LE(std::abs(err), tolerance) << label << ":" << detail;
  }
}

const std::vector<StepCase> kCases = {
    {"Adafactor", true, true},
    {"Adafactor", true, false},
    {"AdamW", false, false},
};

}  // namespace

TEST(RealArchitecturePlan, ParameterCountsMatchTheReleases) {
  // lvalue names: see test_registry.cpp on -Wdangling-reference (gcc 14)
  for (const std::string name : {"sd15", "sdxl", "ssd1b", "sd35m", "cascade-c", "cascade-c-lite"}) {
    const models::Architecture& a = models::find_architecture(name);
    TrainConfig c = plan::model_step_config({});
    c.architecture = name;
    c.resolution = 1024;
    const plan::MemoryPlan p = plan::plan_memory(c, plan::kDefaultVocabSize);
    if (a.parameters > 0) {
      EXPECT_EQ(p.parameters, a.parameters) << name << " (" << a.parameters_source << ")";
    }
    // bf16 weights: two bytes per parameter and per buffer element (MMDiT's
    // pos_embed), counted from the registry's tensor list.
    int64_t params = 0, buffers = 0;
    for (const auto& t : models::architecture_tensors(name)) {
      int64_t n = 1;
      for (int64_t s : t.shape) n *= s;
      (t.parameter ? params : buffers) += n;
    }
    EXPECT_EQ(p.parameters, params) << name;
    EXPECT_EQ(p.weights_bytes, 2 * (params + buffers)) << name;
  }
}

TEST(RealArchitecturePlan, CheckpointingLowersActivationsAndResolutionRaisesThem) {
  for (const char* name : {"sd15", "sdxl", "sd35m", "cascade-c-lite"}) {
    TrainConfig c = plan::model_step_config({});
    c.architecture = name;
    c.resolution = 1024;
    c.gradient_checkpointing = false;
    const plan::MemoryPlan plain = plan::plan_memory(c, plan::kDefaultVocabSize);
    c.gradient_checkpointing = true;
    const plan::MemoryPlan ckpt = plan::plan_memory(c, plan::kDefaultVocabSize);
    EXPECT_LT(ckpt.activation_bytes, plain.activation_bytes / 4) << name;
    EXPECT_EQ(ckpt.activation_bytes + ckpt.checkpointing_saving_bytes, plain.activation_bytes) << name;
    c.resolution = 512;
    EXPECT_LT(plan::plan_memory(c, plan::kDefaultVocabSize).activation_bytes, ckpt.activation_bytes) << name;
  }
}

// LoRA with offload_params: `train` streams the blocks' frozen base weights
// (the adapters stay on the device); the plan moves them to host memory.
TEST(RealArchitecturePlan, OffloadedLoraStreamsTheFrozenBaseWeights) {
  TrainConfig c = plan::model_step_config({});
  c.architecture = "sdxl";
  c.resolution = 1024;
  c.gradient_checkpointing = true;
  c.fused_backward_pass = false;
  c.network_module = "networks.lora";
  const plan::MemoryPlan resident = plan::plan_memory(c, plan::kDefaultVocabSize);
  c.offload_params = true;
  const plan::MemoryPlan offloaded = plan::plan_memory(c, plan::kDefaultVocabSize);
  EXPECT_EQ(offloaded.parameters, resident.parameters);  // the adapters
  EXPECT_LT(offloaded.weights_bytes, resident.weights_bytes / 10) << "SDXL's blocks hold most of its weights";
  EXPECT_GE(offloaded.host_bytes, resident.weights_bytes - offloaded.weights_bytes);
  EXPECT_LT(offloaded.predicted_peak_bytes, resident.predicted_peak_bytes - offloaded.host_bytes / 2);
  // A rule making base weights trainable (with fp32 masters) changes nothing:
  // `train` freezes the base of a LoRA run whatever the rules say.
  precision::RuleSpec rule;
  rule.match = "*";
  rule.trainable = true;
  rule.master = "fp32";
  c.precision_rules.push_back(rule);
  c.ema_decay = 0.999;
  const plan::MemoryPlan ruled = plan::plan_memory(c, plan::kDefaultVocabSize);
  EXPECT_EQ(ruled.parameters, offloaded.parameters);
  EXPECT_EQ(ruled.ema_bytes, 4 * ruled.parameters);  // the adapters' shadows, on the device
  for (const std::string& note : ruled.notes) EXPECT_EQ(note.find("refuses"), std::string::npos) << note;
}

TEST(RealArchitecturePlan, RefusesWhatItDoesNotModel) {
  TrainConfig c = plan::model_step_config({});
  TrainConfig emoji_lora;  // tiny-unet: LoRA is planned on the released architectures only
  emoji_lora.network_module = "networks.lora";
  EXPECT_THROW(plan::plan_memory(emoji_lora, plan::kDefaultVocabSize), Error);
  c.architecture = "vae";
  EXPECT_THROW(plan::plan_memory(c, plan::kDefaultVocabSize), Error);
  c.architecture = "sd15";
  c.resolution = 520;  // latents 65: not divisible by 8
  EXPECT_THROW(plan::plan_memory(c, plan::kDefaultVocabSize), Error);
}

TEST(RealArchitecturePlan, TinySd15StepWithin15Percent) { expect_within("sd15", 128, kCases); }
TEST(RealArchitecturePlan, TinySdxlStepWithin15Percent) { expect_within("sdxl", 128, kCases); }
TEST(RealArchitecturePlan, TinySsd1bStepWithin15Percent) { expect_within("ssd1b", 128, kCases); }
TEST(RealArchitecturePlan, TinySd35mStepWithin15Percent) { expect_within("sd35m", 128, kCases); }
// 768 px: stage C's 24 x 24 latents (the EfficientNet's factor 32).
TEST(RealArchitecturePlan, TinyCascadeCLiteStepWithin15Percent) { expect_within("cascade-c-lite", 768, kCases); }

// The whole trainer (model.architecture = sd15 / sdxl, tiny, cached latents
// and text embeddings), full fine-tune and LoRA, step 2 measured by the ledger
// against the plan the trainer itself asked for (plan::measure_training).
// LoRA plans count frozen layers' inputs as saved (see the plan's note), so
// they may err high, never low by more than the tolerance.
TEST(RealArchitecturePlan, TrainerRunsFullAndLoraWithinTolerance) {
  struct Case {
    const char* arch;
    std::vector<std::string> sets;
    double low, high;  // allowed relative error, predicted vs measured
  };
  const std::vector<Case> cases = {
      {"sd15",
       {"optimizer_type=\"Adafactor\"", "fused_backward_pass=true", "gradient_checkpointing=true"},
       -0.15,
       0.15},
      {"sd15",
       {"network_module=\"networks.lora\"", "network_dim=8", "optimizer_type=\"AdamW8bit\"",
        "gradient_checkpointing=true"},
       -0.15,
       0.20},
      {"sdxl", {"network_module=\"networks.lora\"", "network_dim=8", "optimizer_type=\"AdamW\""}, -0.15, 0.20},
  };
  for (const Case& k : cases) {
    std::string toml = fmt::format(
        "train_data_dir = \"{}/twemoji\"\nresolution = 128\ntrain_batch_size = 2\nfull_bf16 = true\n"
        "num_threads = 1\nsample_prompts = [\"x\"]\n[model]\narchitecture = \"{}\"\ntiny = true\n",
        SHOESTRING_TEST_DATA, k.arch);
    TrainConfig c = parse_config(toml, "lora_plan.toml", k.sets);
    plan::Measurement m = plan::measure_training(c, 2);
    ASSERT_EQ(m.steps.size(), 2u);
    const double measured = static_cast<double>(m.steps[1].peak_bytes);
    const double e = static_cast<double>(m.plan.predicted_peak_bytes) / measured - 1;
    std::printf("[plan] trainer %s tiny %s: predicted %s measured %s (%+.1f%%)\n", k.arch,
                fmt::format("{}", fmt::join(k.sets, " ")).c_str(), format_bytes(m.plan.predicted_peak_bytes).c_str(),
                format_bytes(m.steps[1].peak_bytes).c_str(), 100 * e);
    EXPECT_GE(e, k.low) << k.arch;
    EXPECT_LE(e, k.high) << k.arch;
  }
}
