// The device setting in a run: a CUDA request this machine cannot meet fails
// before the run folder exists (naming the key and why); "cpu" and "auto"
// (the CPU here) train the same bits; the fp16-for-old-GPUs rule rewrites
// only the bf16 shorthands.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "../error_testing.h"
#include "shoestring/core/device.h"
#include "shoestring/train/device_precision.h"
#include "train_testing.h"

namespace fs = std::filesystem;
using namespace shoestring;
using shoestring::testing::error_of;
using shoestring::testing::losses_of;
using shoestring::testing::quiet;

TEST(DeviceTraining, UnavailableCudaFailsBeforeTheRunFolderExists) {
  if (cuda_availability().device_count > 0) GTEST_SKIP() << "this machine has a CUDA device";
  const std::string out = shoestring::testing::fresh_temp_dir("device", "nocuda");
  TrainConfig c = shoestring::testing::tiny_emoji_config(out);
  c.device = "cuda";
  const std::string e = error_of([&] { train(c, quiet()); });
  EXPECT_NE(e.find("device = \"cuda\""), std::string::npos) << e;
  EXPECT_TRUE(e.find("built without CUDA") != std::string::npos || e.find("no CUDA device") != std::string::npos) << e;
  EXPECT_FALSE(fs::exists(out));
}

TEST(DeviceTraining, CpuAndAutoTrainTheSameLosses) {
  if (cuda_availability().device_count > 0) GTEST_SKIP() << "auto is a GPU here";
  TrainConfig a = shoestring::testing::tiny_emoji_config(shoestring::testing::fresh_temp_dir("device", "auto"));
  a.max_train_steps = 3;
  TrainConfig b = a;
  b.output_dir = shoestring::testing::fresh_temp_dir("device", "cpu");
  b.device = "cpu";
  const auto ra = train(a, quiet());
  const auto rb = train(b, quiet());
  EXPECT_EQ(losses_of(ra.run_dir + "/metrics.jsonl"), losses_of(rb.run_dir + "/metrics.jsonl"));
  fs::remove_all(ra.run_dir);
  fs::remove_all(rb.run_dir);
}

TEST(DevicePrecision, OldGpusComputeInFp16WhereTheConfigDoesNotInsist) {
  TrainConfig mixed;
  mixed.mixed_precision = "bf16";
  std::string note = adapt_precision_for_bf16_support(mixed, /*device_has_bf16=*/false, "cuda:0");
  EXPECT_EQ(mixed.mixed_precision, "fp16");
  EXPECT_TRUE(mixed.auto_upcast);
  EXPECT_NE(note.find("cuda:0 has no native bf16"), std::string::npos) << note;
  EXPECT_NE(note.find("loss scaling"), std::string::npos) << note;

  TrainConfig full;
  full.full_bf16 = true;
  full.mixed_precision = "bf16";
  adapt_precision_for_bf16_support(full, false, "cuda:0");
  EXPECT_FALSE(full.full_bf16);
  EXPECT_TRUE(full.full_fp16);
  EXPECT_EQ(full.mixed_precision, "fp16");

  // Nothing to change: fp32 configs, devices with bf16.
  TrainConfig fp32;
  EXPECT_EQ(adapt_precision_for_bf16_support(fp32, false, "cuda:0"), "");
  EXPECT_EQ(fp32.mixed_precision, "no");
  TrainConfig ampere;
  ampere.full_bf16 = true;
  EXPECT_EQ(adapt_precision_for_bf16_support(ampere, true, "cuda:0"), "");
  EXPECT_TRUE(ampere.full_bf16);

  // fused_backward_pass cannot use loss scaling: bf16 stays, and the note says why.
  TrainConfig fused;
  fused.full_bf16 = true;
  fused.fused_backward_pass = true;
  note = adapt_precision_for_bf16_support(fused, false, "cuda:1");
  EXPECT_TRUE(fused.full_bf16);
  EXPECT_NE(note.find("fused_backward_pass"), std::string::npos) << note;

  // The CPU is never rewritten here (CPU capabilities are chosen elsewhere).
  TrainConfig cpu;
  cpu.full_bf16 = true;
  EXPECT_EQ(adapt_precision_to_device(cpu, c10::Device(c10::kCPU)), "");
  EXPECT_TRUE(cpu.full_bf16);
}
