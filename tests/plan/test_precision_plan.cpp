// The memory planner on configs with per-module precision rules, planned
// from the resolved precision policy: a frozen half, an fp32-master fp16
// run, checkpointing of the lowest level only, mixed storage dtypes (emoji
// model, a real training step each) and LoRA with an fp8 base rule (tiny
// SD 1.5 through the trainer), each predicted within 10% of the memory
// ledger's measurement of step 2.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "shoestring/core/units.h"
#include "shoestring/models/architecture.h"
#include "shoestring/nn/layers.h"
#include "shoestring/plan/measure.h"
#include "shoestring/plan/memory_plan.h"
#include "shoestring/train/config.h"

using namespace shoestring;

namespace {

TrainConfig emoji_config(const std::vector<std::string>& sets) {
  std::vector<std::string> all = {std::string("train_data_dir=\"") + SHOESTRING_TEST_DATA + "/twemoji\"",
                                  "twemoji_categories=[]",  // all 11 fixture images, not the example's smileys
                                  "model.base_channels=32", "num_threads=1", "train_batch_size=4"};
  all.insert(all.end(), sets.begin(), sets.end());
  return load_config(std::string(SHOESTRING_SOURCE_DIR) + "/examples/emoji.toml", all);
}

precision::RuleSpec rule(const std::string& match) {
  precision::RuleSpec r;
  r.match = match;
  r.origin = "test";
  return r;
}

// Trains two steps, compares step 2 with the plan; returns the relative error.
double measured_error(const std::string& label, const TrainConfig& c) {
  plan::Measurement m = plan::measure_training(c, 2);
  EXPECT_EQ(m.steps.size(), 2u) << label;
  if (m.steps.size() != 2) return 1.0;
  const int64_t measured = m.steps[1].peak_bytes, predicted = m.plan.predicted_peak_bytes;
  const double e = static_cast<double>(predicted) / static_cast<double>(measured) - 1;
  std::string detail;
  for (int k = 0; k <= static_cast<int>(MemoryCategory::temporaries); ++k) {
    detail += fmt::format(" {} {}/{}", to_string(static_cast<MemoryCategory>(k)), format_bytes(m.plan.at_peak[k]),
                          format_bytes(m.steps[1].at_peak[k]));
  }
  std::printf("[plan] %s: predicted %lld measured %lld (%+.1f%%) predicted/measured:%s\n", label.c_str(),
              static_cast<long long>(predicted), static_cast<long long>(measured), 100 * e, detail.c_str());
  return e;
}

}  // namespace

TEST(PrecisionPlan, FrozenHalfWithin10Percent) {
  // The caption encoder and the UNet's down path frozen.
  TrainConfig c = emoji_config({});
  for (const char* m : {"text_encoder.*", "unet.down.*"}) {
    precision::RuleSpec r = rule(m);
    r.trainable = false;
    c.precision_rules.push_back(r);
  }
  EXPECT_LE(std::abs(measured_error("frozen text encoder + down path", c)), 0.10);
}

TEST(PrecisionPlan, Fp32MasterFp16Within10Percent) {
  // fp16 weights and compute (emulated on the CPU), loss scaling, fp32 masters.
  // Velocity prediction: with x0's 1/t scale the first fp16 steps overflow at
  // the initial loss scale and are skipped, so step 2 would hold no state yet.
  TrainConfig c = emoji_config({"full_bf16=false", "full_fp16=true", "model.prediction=\"velocity\""});
  precision::RuleSpec r = rule("*");
  r.master = "fp32";
  c.precision_rules.push_back(r);
  EXPECT_LE(std::abs(measured_error("fp16 + fp32 masters", c)), 0.10);
}

TEST(PrecisionPlan, CheckpointOnlyTheLowestLevelWithin10Percent) {
  // Full-resolution level only (down.0 and up.0), fp32 weights.
  TrainConfig c = emoji_config({"full_bf16=false", "train_batch_size=8"});
  for (const char* m : {"unet.down.0.*", "unet.up.0.*"}) {
    precision::RuleSpec r = rule(m);
    r.checkpoint = true;
    c.precision_rules.push_back(r);
  }
  const double e = measured_error("checkpoint level 0 only", c);
  EXPECT_LE(std::abs(e), 0.10);
  EXPECT_GT(plan::plan_memory(c, plan::kDefaultVocabSize).checkpointing_saving_bytes, 0);
}

TEST(PrecisionPlan, MixedStorageDtypesWithin10Percent) {
  // bf16 weights and compute, the middle block and the caption encoder stored in fp32.
  TrainConfig c = emoji_config({});
  for (const char* m : {"unet.mid.*", "text_encoder.*"}) {
    precision::RuleSpec r = rule(m);
    r.storage = "fp32";
    c.precision_rules.push_back(r);
  }
  EXPECT_LE(std::abs(measured_error("bf16 with fp32 mid block and encoder", c)), 0.10);
}

TEST(PrecisionPlan, Fp8BaseIsPlannedAtOneBytePerLinearAndConvWeight) {
  // Against a count of the model's own layers: every Linear / Conv2d weight
  // element saves exactly one byte against the bf16 base; nothing else changes.
  const std::string toml = fmt::format(
      "train_data_dir = \"{}/twemoji\"\nresolution = 128\nfull_bf16 = true\nnetwork_module = \"networks.lora\"\n"
      "network_dim = 8\noptimizer_type = \"AdamW\"\n[model]\narchitecture = \"sd15\"\ntiny = true\n",
      SHOESTRING_TEST_DATA);
  TrainConfig bf16 = parse_config(toml, "lora_bf16.toml", {});
  TrainConfig fp8 = bf16;
  precision::RuleSpec r = rule("*");
  r.storage = "fp8_e4m3";
  r.trainable = false;
  fp8.precision_rules.push_back(r);
  const int64_t vocab = 49408;
  const plan::MemoryPlan a = plan::plan_memory(bf16, vocab), b = plan::plan_memory(fp8, vocab);
  auto unet = models::build_architecture("sd15", nn::LayerInit{torch::kMeta}, /*tiny=*/true);
  int64_t packed = 0;
  for (const auto& m : unet->modules()) {
    if (auto* l = dynamic_cast<nn::LinearImpl*>(m.get())) packed += l->weight.numel();
    if (auto* c = dynamic_cast<nn::Conv2dImpl*>(m.get())) packed += c->weight.numel();
  }
  ASSERT_GT(packed, 0);
  // (weights_bytes also holds the bf16 LoRA adapters, the same in both plans.)
  EXPECT_GE(a.weights_bytes, 2 * nn::parameter_count(*unet));
  EXPECT_EQ(b.weights_bytes, a.weights_bytes - packed);
  // The ledger's weights category over a real step, for the record (printed, not asserted).
  for (const TrainConfig* cfg : {&bf16, &fp8}) {
    TrainConfig run = *cfg;
    run.train_batch_size = 2;
    run.num_threads = 1;
    run.sample_prompts = {"x"};
    const plan::Measurement m = plan::measure_training(run, 1);
    if (m.steps.empty()) continue;
    std::printf(
        "[plan] sd15 tiny LoRA, %s base: ledger weights %lld bytes (peak of the step %lld) = %.3f bytes/UNet "
        "parameter\n",
        cfg == &fp8 ? "fp8" : "bf16", static_cast<long long>(m.steps[0].at_peak[0]),
        static_cast<long long>(m.steps[0].peak_per_category[0]),
        static_cast<double>(m.steps[0].at_peak[0]) / nn::parameter_count(*unet));
  }
  std::printf("[plan] sd15 tiny UNet: bf16 base %.3f bytes/parameter, fp8 base %.3f\n",
              static_cast<double>(a.weights_bytes) / nn::parameter_count(*unet),
              static_cast<double>(b.weights_bytes) / nn::parameter_count(*unet));
}

TEST(PrecisionPlan, LoraWithFp8BaseWithin10Percent) {
  std::string toml = fmt::format(
      "train_data_dir = \"{}/twemoji\"\nresolution = 128\ntrain_batch_size = 2\nfull_bf16 = true\n"
      "num_threads = 1\nsample_prompts = [\"x\"]\nnetwork_module = \"networks.lora\"\nnetwork_dim = 8\n"
      "optimizer_type = \"AdamW\"\n[model]\narchitecture = \"sd15\"\ntiny = true\n",
      SHOESTRING_TEST_DATA);
  TrainConfig c = parse_config(toml, "lora_fp8.toml", {});
  precision::RuleSpec r = rule("*");
  r.storage = "fp8_e4m3";
  r.trainable = false;
  c.precision_rules.push_back(r);
  // Errs high, within 15 %: the trace counts every frozen Linear as saving
  // its input (its adapter does, nn/memory_trace.h TracePrecision::frozen),
  // while an fp8 Linear without an adapter saves only its bytes. Below the
  // measurement it may not go: a plan that under-predicts lets a run OOM.
  const double error = measured_error("sd15 tiny LoRA, fp8 base", c);
  EXPECT_GE(error, -0.10);
  EXPECT_LE(error, 0.15);
}
