// offload_params on CUDA (train/block_streaming.h): the checkpointed blocks'
// weights in pinned host memory, copied to the GPU for each use, their
// gradients back after each block's backward, the optimizer and the EMA
// updating the host copies. Against the same run without offloading on the
// GPU: the same losses and weights up to the order of a few sums (the global
// norm and the optimizer step of the streamed tensors run on the CPU), and
// far less device memory for weights, gradients and optimizer state. Skips
// without a CUDA device.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "../train/train_testing.h"
#include "cuda_testing.h"
#include "shoestring/core/memory_ledger_cuda.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/train/config.h"
#include "shoestring/train/run.h"
#include "shoestring/train/trainer.h"

namespace shoestring {
namespace {

TEST(CudaOffloadParams, TrainsAsWithoutOffloadingWithLessDeviceMemory) {
  SHOESTRING_REQUIRE_CUDA();
  at::globalContext().setAllowTF32CuDNN(false);
  at::globalContext().setDeterministicCuDNN(true);
  const std::string root = testing::fresh_temp_dir("cuda_offload", "plain_vs_offload");
  const std::string common =
      "device = \"cuda\"\ngradient_checkpointing = true\nsave_every_n_steps = 3\nema_decay = 0.9\n"
      "gradient_accumulation_steps = 2\n";
  const TrainSummary plain = train(testing::tiny_emoji_config(root + "/plain", common), testing::quiet());
  const TrainSummary offloaded =
      train(testing::tiny_emoji_config(root + "/offload", common + "offload_params = true\n"), testing::quiet());
  const std::vector<double> a = testing::losses_of(plain.run_dir + "/metrics.jsonl");
  const std::vector<double> b = testing::losses_of(offloaded.run_dir + "/metrics.jsonl");
  ASSERT_EQ(a.size(), 6u);
  ASSERT_EQ(b.size(), a.size());
  for (size_t s = 0; s < a.size(); ++s) EXPECT_NEAR(b[s], a[s], 1e-5 * std::abs(a[s])) << "step " << s + 1;
  // The final files (from the EMA shadows) and the step-3 checkpoints agree.
  for (const std::string file : {"/model.safetensors", "/checkpoints/step-000003/model.safetensors"}) {
    const SafetensorsFile pa = SafetensorsFile::open(plain.run_dir + file);
    const SafetensorsFile pb = SafetensorsFile::open(offloaded.run_dir + file);
    ASSERT_EQ(pa.tensors().size(), pb.tensors().size()) << file;
    for (const auto& info : pa.tensors()) {
      const at::Tensor x = pa.get(info.name).to(at::kFloat), y = pb.get(info.name).to(at::kFloat);
      EXPECT_TRUE(x.allclose(y, 1e-4, 1e-5))
          << file << " " << info.name << ": max |diff| " << (x - y).abs().max().item<double>();
    }
  }
  // The device's weights, gradients and optimizer state (the ledger's CUDA
  // categories) shrink by the streamed part.
  const nlohmann::json p = testing::last_step_record(plain.run_dir), o = testing::last_step_record(offloaded.run_dir);
  for (const char* key : {"peak_weights_bytes", "peak_gradients_bytes", "peak_optimizer_state_bytes"}) {
    std::cout << key << ": " << p[key].get<double>() << " -> " << o[key].get<double>() << "\n";
    EXPECT_LT(o[key].get<double>(), 0.5 * p[key].get<double>()) << key;
  }
}

// The streamed weights never reach the device at the start: the model is
// built in host memory and moved to the GPU without them (train/run.cpp's
// move_model_to_device), so the device's peak while the run is set up is
// the other weights' bytes, not the whole model's.
TEST(CudaOffloadParams, TheStreamedWeightsNeverReachTheDeviceAtTheStart) {
  SHOESTRING_REQUIRE_CUDA();
  CudaMemoryLedger& ledger = CudaMemoryLedger::global();
  ledger.install(0);
  ledger.reset_peaks();
  const int64_t before = ledger.allocator_stats().allocated_current;
  const std::string root = testing::fresh_temp_dir("cuda_offload", "start");
  const std::unique_ptr<shoestring::Run> run = setup_run(
      testing::tiny_emoji_config(root, "device = \"cuda\"\ngradient_checkpointing = true\noffload_params = true\n"),
      testing::quiet());
  ASSERT_NE(run->block_streaming, nullptr);
  const auto& streaming = static_cast<const HostBlockStreaming&>(*run->block_streaming);
  int64_t total = 0, streamed = 0, streamed_tensors = 0;
  for (const at::Tensor& p : run->model->module().parameters(/*recurse=*/true)) {
    if (streaming.streams_parameter(p)) {
      EXPECT_EQ(p.numel(), 0) << "a streamed weight is present between uses";
      EXPECT_TRUE(p.device().is_cuda());
      ++streamed_tensors;
    } else {
      total += p.numel() * p.element_size();
    }
  }
  streamed = streaming.streamed_bytes();
  total += streamed;
  ASSERT_GT(streamed_tensors, 0);
  ASSERT_GT(streamed, total / 4) << "the tiny model streams too little to tell";
  // Each tensor's block is rounded to 512 bytes: half the streamed bytes is
  // far above that slack and far below a moment with the whole model there.
  const int64_t peak = ledger.allocator_stats().allocated_peak - before;
  std::cout << "setup peak on the device " << peak << " bytes; model " << total << " bytes, " << streamed
            << " of them streamed\n";
  EXPECT_LT(peak, total - streamed / 2);
}

}  // namespace
}  // namespace shoestring
