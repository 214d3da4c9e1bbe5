// Several processes on CUDA: ProcessGroup's collectives on device tensors
// (NCCL), and data-parallel / ZeRO training on two GPUs against one GPU
// with the double batch. One rank on cuda:0 runs on any GPU machine (NCCL
// with a group of one: the routing, the dtype handling and the store
// prefix); the two-rank tests skip unless two CUDA devices are visible (NCCL
// refuses two ranks on one GPU). Each check is a formula over the per-rank
// inputs, as tests/dist/test_collectives.cpp's on the CPU.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <c10/cuda/CUDAFunctions.h>

#include "../dist/dist_testing.h"
#include "../dist/dist_training_testing.h"
#include "../dist/test_worker.cpp"  // the workers' entry point (DistWorker.Main) in this binary too
#include "cuda_testing.h"
#include "shoestring/core/error.h"
#include "shoestring/dist/data_parallel.h"
#include "shoestring/dist/process_group.h"

namespace shoestring::dist {
namespace {

using namespace std::chrono_literals;
using shoestring::testing::fresh_dist_dir;
using shoestring::testing::read_text;
using shoestring::testing::run_workers;
using shoestring::testing::worker_dir;
using shoestring::testing::worker_env;
using shoestring::testing::worker_rank;
using shoestring::testing::worker_world;
using shoestring::testing::write_text;
using ::testing::HasSubstr;

int cuda_devices() { return static_cast<int>(torch::cuda::device_count()); }

bool same_bits16(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.cpu().view(at::kShort).equal(b.cpu().view(at::kShort));
}

/// The collectives on tensors of `device` (this rank's GPU) against formulas;
/// every rank runs every check.
void check_device_collectives(ProcessGroup& g, const c10::Device& device) {
  const int r = g.rank();
  const int w = g.size();
  const double ranks_sum = w * (w - 1) / 2.0;
  const double ones_sum = w * (w + 1) / 2.0;  // 1 + .. + w
  auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  EXPECT_THAT(g.backends(), HasSubstr("NCCL on " + device.str()));

  // fp32 all-reduce in place, contiguous and not.
  at::Tensor x = at::arange(12, f32).reshape({3, 4});
  at::Tensor t = x * (r + 1) + r;
  g.all_reduce_sum(t);
  EXPECT_EQ(t.device(), device);
  EXPECT_TRUE(t.equal(x * ones_sum + ranks_sum)) << t;
  at::Tensor nc = (x * (r + 1)).t();
  g.all_reduce_sum(nc);
  EXPECT_TRUE(nc.equal(x.t() * ones_sum));

  // bf16: the fp32 sum of every rank's values, rounded once (as on the CPU).
  auto bf16_of = [&](int k) { return (at::arange(1, 9, f32) * 0.1f * (k + 1)).to(at::kBFloat16); };
  at::Tensor b = bf16_of(r);
  at::Tensor expected = at::zeros({8}, f32);
  for (int k = 0; k < w; ++k) expected += bf16_of(k).to(at::kFloat);
  g.all_reduce_sum(b);
  EXPECT_EQ(b.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(same_bits16(b, expected.to(at::kBFloat16))) << b << expected;

  // fp16 sums in fp32.
  at::Tensor h = at::full({5}, 1.0 / 3.0, f32).to(at::kHalf);
  const at::Tensor h_expected = (h.to(at::kFloat) * w).to(at::kHalf);
  g.all_reduce_sum(h);
  EXPECT_TRUE(h.equal(h_expected));

  // Reduce to the last rank, in flight.
  at::Tensor red = at::full({7}, static_cast<float>(r + 1), f32);
  g.reduce_sum_async(red, w - 1).wait();
  if (r == w - 1) {
    EXPECT_TRUE(red.equal(at::full({7}, ones_sum, f32))) << red;
  }

  // Broadcast of every bf16 bit pattern from the last rank, of bool from rank 0.
  at::Tensor patterns =
      at::arange(-32768, 32768, at::TensorOptions().dtype(at::kInt)).to(at::kShort).view(at::kBFloat16).to(device);
  at::Tensor mine = r == w - 1 ? patterns.clone() : at::zeros_like(patterns);
  g.broadcast(mine, w - 1);
  EXPECT_TRUE(same_bits16(mine, patterns));
  at::Tensor flags = at::arange(6, f32).remainder(2).eq(r == 0 ? 0 : 1);
  g.broadcast(flags, 0);
  EXPECT_TRUE(flags.equal(at::arange(6, f32).remainder(2).eq(0)));

  // Reduce-scatter and all-gather (built from rooted collectives).
  at::Tensor rs_in = at::arange(w * 5, f32) + 100.0f * r;
  at::Tensor chunk = g.reduce_scatter_sum(rs_in);
  EXPECT_TRUE(chunk.equal(at::arange(5 * r, 5 * r + 5, f32) * w + 100.0f * ranks_sum)) << chunk;
  at::Tensor gathered = g.all_gather(at::arange(4, f32) + 10.0f * r);
  std::vector<at::Tensor> parts;
  for (int k = 0; k < w; ++k) parts.push_back(at::arange(4, f32) + 10.0f * k);
  EXPECT_TRUE(gathered.equal(at::cat(parts))) << gathered;

  // Host tensors of the same group go through Gloo.
  at::Tensor host = at::full({3}, static_cast<float>(r + 1));
  g.all_reduce_sum(host);
  EXPECT_TRUE(host.is_cpu());
  EXPECT_TRUE(host.equal(at::full({3}, static_cast<float>(ones_sum))));
  EXPECT_EQ(g.all_reduce_sum(static_cast<double>(r)), ranks_sum);

  // GradientReducer over device parameters (one bucket each, then one in all).
  at::Tensor p1 = at::zeros({3, 2}, f32).requires_grad_();
  at::Tensor p2 = at::zeros({5}, f32).to(at::kBFloat16).requires_grad_();
  p1.mutable_grad() = at::arange(6, f32).reshape({3, 2}) * (r + 1);
  p2.mutable_grad() = (at::arange(5, f32) * (r + 1)).to(at::kBFloat16);
  GradientReducer reducer(g, {p1, p2}, 4);
  reducer.all_reduce_gradients();
  EXPECT_TRUE(p1.grad().allclose(at::arange(6, f32).reshape({3, 2}) * ones_sum, 0, 1e-6)) << p1.grad();
  EXPECT_TRUE(
      same_bits16(p2.grad(), (at::arange(5, f32).to(at::kBFloat16).to(at::kFloat) * ones_sum).to(at::kBFloat16)));

  // A tensor on another GPU than the group's is refused, naming both.
  if (cuda_devices() > 1) {
    const c10::Device other(c10::kCUDA, static_cast<c10::DeviceIndex>(device.index() == 0 ? 1 : 0));
    at::Tensor elsewhere = at::zeros({2}, f32.device(other));
    EXPECT_THAT([&] { g.all_reduce_sum(elsewhere); }, ::testing::ThrowsMessage<Error>(HasSubstr(other.str())));
  }
}

TEST(CudaCollectives, OneRankOnTheDevice) {
  SHOESTRING_REQUIRE_CUDA();
  const std::string dir = fresh_dist_dir("cuda_one_rank");
  const c10::Device device(c10::kCUDA, 0);
  auto g = ProcessGroup::connect_file(dir + "/store", 0, 1, 60s, device);
  check_device_collectives(*g, device);
}

DIST_SCENARIO(cuda_collectives) {
  const c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(worker_rank()));
  c10::cuda::set_device(device.index());
  auto g = ProcessGroup::connect_file(worker_dir() + "/store", worker_rank(), worker_world(), 60s, device);
  check_device_collectives(*g, device);
}

TEST(CudaCollectives, TwoRanksOnTwoGpus) {
  SHOESTRING_REQUIRE_CUDA();
  if (cuda_devices() < 2) GTEST_SKIP() << "needs two CUDA devices (NCCL runs one rank per GPU)";
  const std::string dir = fresh_dist_dir("cuda_two_ranks");
  EXPECT_EQ(run_workers("cuda_collectives", 2, dir), (std::vector<int>{0, 0}));
}

/// fp32 convolutions in fp32 (cuDNN's default TF32 rounds their inputs to
/// 10 mantissa bits, in a way that depends on the batch's algorithm), and
/// cuDNN's deterministic algorithms: the runs compared then differ by
/// summation order only.
void exact_fp32_convolutions() {
  at::globalContext().setAllowTF32CuDNN(false);
  at::globalContext().setAllowTF32CuBLAS(false);
  at::globalContext().setDeterministicCuDNN(true);
}

/// A worker: the tiny emoji run on its GPU (device = "cuda": cuda:RANK),
/// batch SHOESTRING_TEST_BATCH per rank, zero_stage SHOESTRING_TEST_STAGE,
/// fused_backward_pass when SHOESTRING_TEST_FUSED = 1;
/// its trajectory to <run>.rankR.pt, or its error to <run>.errorR.txt.
DIST_SCENARIO(cuda_train) {
  const std::string run = worker_dir() + "/" + worker_env("SHOESTRING_TEST_RUN");
  TrainConfig c = shoestring::testing::ddp_config(run, std::stoll(worker_env("SHOESTRING_TEST_BATCH")),
                                                  "gradient_checkpointing = true\n");
  c.device = "cuda";
  c.zero_stage = std::stoll(worker_env("SHOESTRING_TEST_STAGE"));
  c.fused_backward_pass = worker_env("SHOESTRING_TEST_FUSED") == "1";
  exact_fp32_convolutions();
  try {
    const auto t = shoestring::testing::train_and_record(c);
    shoestring::testing::save_trajectory(t, run + ".rank" + std::to_string(worker_rank()) + ".pt");
  } catch (const Error& e) {
    write_text(run + ".error" + std::to_string(worker_rank()) + ".txt", e.what());
    ::_exit(4);
  }
}

/// On the CPU, for comparisons across devices and sources.
shoestring::testing::Trajectory on_cpu(shoestring::testing::Trajectory t) {
  for (at::Tensor& w : t.weights) w = w.cpu();
  return t;
}

TEST(CudaDataParallel, TwoGpusMatchOneGpuWithDoubleBatch) {
  SHOESTRING_REQUIRE_CUDA();
  if (cuda_devices() < 2) GTEST_SKIP() << "needs two CUDA devices (NCCL runs one rank per GPU)";
  const std::string dir = fresh_dist_dir("cuda_ddp");
  TrainConfig one_config = shoestring::testing::ddp_config(dir + "/one", 4, "gradient_checkpointing = true\n");
  one_config.device = "cuda";
  exact_fp32_convolutions();
  const auto one = on_cpu(shoestring::testing::train_and_record(one_config));
  // Stage 2 with the fused backward: reductions issued inside autograd's
  // hooks, on its CUDA device thread.
  for (const auto& [stage, fused] : {std::pair{0, false}, std::pair{2, true}, std::pair{3, false}}) {
    const std::string name = "stage" + std::to_string(stage) + (fused ? "_fused" : "");
    const int port = shoestring::testing::free_tcp_port();
    const auto status = run_workers(
        "cuda_train", 2, dir,
        [&](int r) {
          auto env = shoestring::testing::rank_env(r, 2, port, 2);
          env["SHOESTRING_TEST_RUN"] = name;
          env["SHOESTRING_TEST_STAGE"] = std::to_string(stage);
          env["SHOESTRING_TEST_FUSED"] = fused ? "1" : "0";
          return env;
        },
        std::chrono::seconds(240));
    ASSERT_EQ(status, (std::vector<int>{0, 0}))
        << name << ": " << read_text(dir + "/" + name + ".error0.txt") << read_text(dir + "/" + name + ".error1.txt");
    const auto r0 = on_cpu(shoestring::testing::load_trajectory(dir + "/" + name + ".rank0.pt"));
    const auto r1 = on_cpu(shoestring::testing::load_trajectory(dir + "/" + name + ".rank1.pt"));
    SCOPED_TRACE(name);
    // cuBLAS / cuDNN sum a batch of 2 and one of 4 in their own orders:
    // within fp32 rounding of one GPU's run (atol 1e-4: the CPU test's 1e-5
    // with room for the GPU's algorithms).
    shoestring::testing::expect_matches_one_process(r0, one, 1e-4);
    for (size_t s = 0; s < one.losses.size(); ++s) EXPECT_EQ(r0.losses[s], r1.losses[s]) << "step " << s + 1;
  }
}

}  // namespace
}  // namespace shoestring::dist
