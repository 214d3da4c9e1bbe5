// The CUDA fixed costs of a plan (plan/device_costs.h): the allocator's
// 512-byte rounding per resident tensor and the cuBLAS workspaces, added to
// the peaks and the temporaries only when asked for (device = cuda).
#include <gtest/gtest.h>

#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/plan/device_costs.h"
#include "shoestring/plan/memory_plan.h"
#include "shoestring/train/config.h"
#include "shoestring/train/tiny_unet_model.h"

using namespace shoestring;

namespace {

TEST(CudaFixedCosts, RoundingPerTensorAndTheBlasWorkspace) {
  // libtorch 2.x's default cuBLAS workspace (4096 KiB x 2 + 16 KiB x 8) and
  // cuBLASLt's 1 MiB.
  EXPECT_EQ(plan::kCudaBlasWorkspaceBytes, 8519680 + 1048576);
  const plan::CudaFixedCosts none = plan::cuda_fixed_costs(0);
  EXPECT_EQ(none.rounding_bytes, 0);
  EXPECT_EQ(none.total(), plan::kCudaBlasWorkspaceBytes);
  const plan::CudaFixedCosts some = plan::cuda_fixed_costs(1000);
  EXPECT_EQ(some.rounding_bytes, 1000 * 256);  // half a 512-byte block each
  EXPECT_EQ(some.total(), 1000 * 256 + plan::kCudaBlasWorkspaceBytes);
  EXPECT_THROW(plan::cuda_fixed_costs(-1), Error);
}

TEST(CudaFixedCosts, AddedToTheEmojiPlanOnlyWhenAsked) {
  const TrainConfig c =
      load_config(std::string(SHOESTRING_SOURCE_DIR) + "/examples/emoji.toml",
                  {std::string("train_data_dir=\"") + SHOESTRING_TEST_DATA + "/twemoji\"", "twemoji_categories=[]"});
  const plan::MemoryPlan cpu = plan::plan_memory(c, 300);
  EXPECT_EQ(cpu.device_fixed_bytes, 0);
  // Every parameter tensor trains: the weight, its gradient and up to two
  // state tensors.
  TinyUNetModel model(TinyUNetModelOptions::from_config(c, 300));
  EXPECT_EQ(cpu.resident_tensors, 4 * static_cast<int64_t>(model->parameters().size()));

  plan::MemoryPlan cuda = cpu;
  plan::add_cuda_fixed_costs(cuda);
  const int64_t fixed = plan::cuda_fixed_costs(cpu.resident_tensors).total();
  EXPECT_EQ(cuda.device_fixed_bytes, fixed);
  EXPECT_EQ(cuda.predicted_peak_bytes, cpu.predicted_peak_bytes + fixed);
  EXPECT_EQ(cuda.first_step_peak_bytes, cpu.first_step_peak_bytes + fixed);
  const int t = static_cast<int>(MemoryCategory::temporaries);
  EXPECT_EQ(cuda.at_peak[t], cpu.at_peak[t] + fixed);
  ASSERT_EQ(cuda.notes.size(), cpu.notes.size() + 1);
  EXPECT_NE(cuda.notes.back().find("excludes the CUDA context"), std::string::npos) << cuda.notes.back();
  EXPECT_EQ(cuda.to_json().at("device_fixed_bytes").get<int64_t>(), fixed);
}

}  // namespace
