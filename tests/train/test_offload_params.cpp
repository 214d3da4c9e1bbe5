// offload_params (train/block_streaming.h, HostBlockStreaming): the weights
// of checkpointed blocks live in host memory and are copied to the device
// for each use; their gradients go to host memory after each block's
// backward and the optimizer updates the host copies. Against the same run
// without offloading: the same losses and final weights, bit for bit (every
// copy is exact), with gradient accumulation and bf16 weights with
// stochastic rounding too; the device's weights and gradients (the ledger's
// peaks) shrink by the streamed part while host_offload holds it; a
// checkpoint of an offloaded run resumes bit-exact; what it cannot do is
// refused naming the key.
#include <gtest/gtest.h>

#include <filesystem>

#include <nlohmann/json.hpp>

#include "shoestring/core/error.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/train/config.h"
#include "shoestring/train/trainer.h"
#include "train_testing.h"

using namespace shoestring;
using shoestring::testing::last_step_record;
using shoestring::testing::losses_of;
using shoestring::testing::quiet;
using shoestring::testing::tiny_emoji_config;

namespace {

/// Every tensor of two safetensors files bit-equal.
void expect_same_tensors(const std::string& a_path, const std::string& b_path) {
  const SafetensorsFile a = SafetensorsFile::open(a_path), b = SafetensorsFile::open(b_path);
  ASSERT_EQ(a.tensors().size(), b.tensors().size());
  for (const auto& info : a.tensors()) {
    const TensorInfo* other = b.find(info.name);
    ASSERT_NE(other, nullptr) << info.name;
    EXPECT_EQ(a.bytes(info), b.bytes(*other)) << info.name;
  }
}

/// Trains `extra` with and without offload_params (gradient checkpointing
/// on, both) and compares them; returns the offloaded run's last step record.
nlohmann::json expect_offload_changes_no_bit(const std::string& name, const std::string& extra) {
  const std::string root = shoestring::testing::fresh_temp_dir("offload", name);
  const std::string common = "gradient_checkpointing = true\nsave_every_n_steps = 3\n" + extra;
  const TrainSummary plain = train(tiny_emoji_config(root + "/plain", common), quiet());
  const TrainSummary offloaded =
      train(tiny_emoji_config(root + "/offload", common + "offload_params = true\n"), quiet());
  EXPECT_EQ(losses_of(plain.run_dir + "/metrics.jsonl").size(), 6u);
  EXPECT_EQ(losses_of(offloaded.run_dir + "/metrics.jsonl"), losses_of(plain.run_dir + "/metrics.jsonl")) << name;
  expect_same_tensors(offloaded.run_dir + "/model.safetensors", plain.run_dir + "/model.safetensors");
  expect_same_tensors(offloaded.run_dir + "/checkpoints/step-000003/model.safetensors",
                      plain.run_dir + "/checkpoints/step-000003/model.safetensors");
  // Memory: the streamed weights, their gradients and optimizer state leave the device for host memory.
  const nlohmann::json p = last_step_record(plain.run_dir), o = last_step_record(offloaded.run_dir);
  const double weights = p["peak_weights_bytes"].get<double>(), host = o["peak_host_offload_bytes"].get<double>();
  std::cout << name << ": device weights " << weights << " -> " << o["peak_weights_bytes"].get<double>()
            << ", gradients " << p["peak_gradients_bytes"].get<double>() << " -> "
            << o["peak_gradients_bytes"].get<double>() << ", optimizer state "
            << p["peak_optimizer_state_bytes"].get<double>() << " -> " << o["peak_optimizer_state_bytes"].get<double>()
            << ", host_offload 0 -> " << host << "\n";
  EXPECT_EQ(p["peak_host_offload_bytes"].get<double>(), 0.0);
  EXPECT_LT(o["peak_weights_bytes"].get<double>(), 0.5 * weights) << name;
  EXPECT_LT(o["peak_gradients_bytes"].get<double>(), 0.5 * p["peak_gradients_bytes"].get<double>()) << name;
  EXPECT_LT(o["peak_optimizer_state_bytes"].get<double>(), 0.5 * p["peak_optimizer_state_bytes"].get<double>()) << name;
  EXPECT_GT(host, 0.5 * weights) << name << ": the streamed weights (and more) in host memory";
  return o;
}

}  // namespace

TEST(OffloadParams, TrainsAsWithoutOffloadingBitForBit) { expect_offload_changes_no_bit("fp32", ""); }

TEST(OffloadParams, WithGradientAccumulationAndBf16StochasticRounding) {
  expect_offload_changes_no_bit("accumulation", "gradient_accumulation_steps = 2\n");
  expect_offload_changes_no_bit("bf16_sr",
                                "full_bf16 = true\nmixed_precision = \"bf16\"\noptimizer_type = \"Adafactor\"\n");
}

// EMA: the streamed weights' shadows move to host memory beside them (the
// device's optimizer_state shrinks by them too); the final file, written
// from the shadows, is the same bit for bit.
TEST(OffloadParams, WithEmaItsShadowsLiveInHostMemory) {
  const nlohmann::json without = expect_offload_changes_no_bit("no_ema", "");
  const nlohmann::json with = expect_offload_changes_no_bit("ema", "ema_decay = 0.9\n");
  // fp32 weights, all trained: the streamed shadows are as large as the
  // streamed weights (the device's weights peak keeps one block of them).
  const double streamed =
      with["peak_host_offload_bytes"].get<double>() - without["peak_host_offload_bytes"].get<double>();
  const double device_ema =
      with["peak_optimizer_state_bytes"].get<double>() - without["peak_optimizer_state_bytes"].get<double>();
  std::cout << "EMA shadows: " << streamed << " bytes in host memory, " << device_ema << " on the device\n";
  EXPECT_GT(streamed, 4.0 * device_ema) << "most shadows belong to streamed weights, in host memory";
  EXPECT_GT(device_ema, 0.0) << "the resident weights' shadows stay on the device";
}

// A checkpoint written by an offloaded run (its weights gathered from host
// memory) resumes, offloaded or not, to the run that did not stop.
TEST(OffloadParams, ItsCheckpointResumesBitExact) {
  const std::string root = shoestring::testing::fresh_temp_dir("offload", "resume");
  const std::string common = "gradient_checkpointing = true\nsave_every_n_steps = 3\noffload_params = true\n";
  const TrainSummary full = train(tiny_emoji_config(root + "/full", common), quiet());
  TrainConfig stopped = tiny_emoji_config(root + "/stopped", common);
  stopped.max_train_steps = 3;
  train(stopped, quiet());
  TrainConfig resumed = tiny_emoji_config(root + "/stopped", common);
  TrainRunOptions o = quiet();
  o.resume_dir = root + "/stopped";
  const TrainSummary r = train(resumed, o);
  EXPECT_EQ(losses_of(r.run_dir + "/metrics.jsonl"), losses_of(full.run_dir + "/metrics.jsonl"));
  expect_same_tensors(r.run_dir + "/model.safetensors", full.run_dir + "/model.safetensors");
}

TEST(OffloadParams, WhatItCannotDoIsRefusedNamingTheKey) {
  const std::string root = shoestring::testing::fresh_temp_dir("offload", "refused");
  auto error_of = [](const TrainConfig& c) {
    try {
      train(c, quiet());
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string none = error_of(tiny_emoji_config(root + "/none", "offload_params = true\n"));
  EXPECT_NE(none.find("gradient_checkpointing = true"), std::string::npos) << none;
  const std::string fused =
      error_of(tiny_emoji_config(root + "/fused",
                                 "offload_params = true\ngradient_checkpointing = true\nfused_backward_pass = true\n"
                                 "optimizer_type = \"Adafactor\"\n"));
  EXPECT_NE(fused.find("fused_backward_pass"), std::string::npos) << fused;
  EXPECT_NE(fused.find("offload_params"), std::string::npos) << fused;
}
