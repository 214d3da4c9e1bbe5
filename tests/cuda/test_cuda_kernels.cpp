// GPU == CPU, bit for bit: stochastic rounding (the counter-based bits), the
// optimizer steps (AdamW, AdamW8bit, Adafactor, Lion, Compass), gradient
// accumulation with SR, and 8-bit block-wise quantize / dequantize. The CPU
// result of each is the reference; the same inputs moved to cuda:0 must give
// the same bits. Every test skips when no CUDA device is present.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <c10/cuda/CUDAStream.h>

#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "cuda_testing.h"
#include "kernels/cuda/stochastic_rounding_cuda.h"
#include "shoestring/core/stochastic_rounding.h"
#include "shoestring/optim/factory.h"
#include "shoestring/optim/grad_accumulation.h"
#include "shoestring/optim/optimizer.h"
#include "shoestring/optim/quantization.h"

namespace shoestring {
namespace {

using testing::bit_difference;
using testing::on_cuda;

// fp32 values that exercise every rounding rule: normal values of many
// magnitudes, exact bf16/fp16 values, fp16 subnormals and overflow, signed
// zeros, infinities and NaN.
at::Tensor rounding_inputs(int64_t n) {
  at::Tensor x = at::randn({n}, at::TensorOptions().dtype(at::kFloat));
  x.mul_(at::pow(10.0, at::randint(-8, 6, {n}).to(at::kFloat)));
  const float specials[] = {0.0f,
                            -0.0f,
                            1.0f,
                            -1.0f,
                            65504.0f,
                            65520.0f,
                            1e-6f,
                            -3e-8f,
                            6e-8f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::denorm_min()};
  for (size_t i = 0; i < sizeof(specials) / sizeof(specials[0]); ++i) x[static_cast<int64_t>(i)] = specials[i];
  return x;
}

TEST(CudaStochasticRounding, KernelMatchesCpuBitForBit) {
  SHOESTRING_REQUIRE_CUDA();
  at::manual_seed(7);
  const int64_t n = 1 << 20 | 123;  // not a multiple of any block size
  const at::Tensor x = rounding_inputs(n);
  const at::Tensor xc = on_cuda(x);
  const RoundingKey key{11, 5, 42};
  for (const bool bf16 : {true, false}) {
    const at::Tensor cpu = stochastic_round(x, bf16 ? at::kBFloat16 : at::kHalf, key);
    // Rounded in two chunks on the GPU: the element offset keeps the bits.
    at::Tensor gpu = at::empty({n}, xc.options().dtype(bf16 ? at::kBFloat16 : at::kHalf));
    const int64_t half = n / 2 + 17;
    void* stream = c10::cuda::getCurrentCUDAStream().stream();
    auto* dst = reinterpret_cast<uint16_t*>(gpu.data_ptr());
    const float* src = xc.data_ptr<float>();
    auto launch = bf16 ? &cuda::stochastic_round_bf16 : &cuda::stochastic_round_fp16;
    ASSERT_EQ(launch(src, dst, half, key.seed, key.step, key.tensor_id, 0, stream), 0);
    ASSERT_EQ(launch(src + half, dst + half, n - half, key.seed, key.step, key.tensor_id, half, stream), 0);
    const std::string diff = bit_difference(gpu, cpu, bf16 ? "SR to bf16" : "SR to fp16");
    EXPECT_TRUE(diff.empty()) << diff;
  }
}

// The library entry point with a CUDA tensor (the device-generic path).
TEST(CudaStochasticRounding, LibraryEntryPointMatchesCpuBitForBit) {
  SHOESTRING_REQUIRE_CUDA();
  at::manual_seed(8);
  const at::Tensor x = rounding_inputs(70001).reshape({7, 10001});
  const RoundingKey key{3, 9, 17};
  for (const at::ScalarType dtype : {at::kBFloat16, at::kHalf}) {
    const at::Tensor cpu = stochastic_round(x, dtype, key);
    const at::Tensor gpu = stochastic_round(on_cuda(x), dtype, key);
    EXPECT_TRUE(gpu.is_cuda());
    const std::string diff = bit_difference(gpu, cpu, std::string("stochastic_round to ") + c10::toString(dtype));
    EXPECT_TRUE(diff.empty()) << diff;
  }
}

// Parameters of a small model: a bf16 matrix (SR writes), an fp32 matrix and
// an fp32 bias (no decay), on `device`.
std::vector<std::pair<std::string, at::Tensor>> make_params(const at::Device& device) {
  at::manual_seed(21);
  std::vector<std::pair<std::string, at::Tensor>> params = {
      {"layer.weight", at::randn({48, 80}).mul_(0.1).to(at::kBFloat16)},
      {"proj.weight", at::randn({80, 33}).mul_(0.1)},
      {"proj.bias", at::randn({33}).mul_(0.01)},
  };
  for (auto& [name, p] : params) p = p.to(device).set_requires_grad(true);
  return params;
}

// Runs `steps` optimizer steps with the same gradients on `device`; returns
// the parameters and the optimizer state, on the CPU.
std::vector<std::pair<std::string, at::Tensor>> run_optimizer(const std::string& type, at::ScalarType state_dtype,
                                                              const at::Device& device, int steps) {
  auto params = make_params(device);
  OptimizerOptions options;
  options.seed = 99;
  options.state_dtype = state_dtype;
  auto opt = make_optimizer(type, {}, params, options);
  at::manual_seed(33);
  for (int s = 0; s < steps; ++s) {
    for (auto& [name, p] : params) {
      p.mutable_grad() = at::randn(p.sizes()).mul_(0.05).to(p.scalar_type()).to(device);
    }
    opt->step(1e-3);
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (auto& [name, p] : params) out.emplace_back(name, p.detach().cpu());
  for (auto& [name, t] : opt->state_tensors()) out.emplace_back("state " + name, t.cpu());
  return out;
}

class CudaOptimizer : public ::testing::TestWithParam<std::pair<std::string, at::ScalarType>> {};

TEST_P(CudaOptimizer, StepsMatchCpuBitForBit) {
  SHOESTRING_REQUIRE_CUDA();
  const auto& [type, state_dtype] = GetParam();
  const auto cpu = run_optimizer(type, state_dtype, at::Device(at::kCPU), 3);
  const auto gpu = run_optimizer(type, state_dtype, at::Device(at::kCUDA, 0), 3);
  ASSERT_EQ(cpu.size(), gpu.size()) << type << ": the GPU run holds other state tensors";
  for (size_t i = 0; i < cpu.size(); ++i) {
    ASSERT_EQ(cpu[i].first, gpu[i].first);
    const std::string diff = bit_difference(gpu[i].second, cpu[i].second, type + " " + cpu[i].first);
    EXPECT_TRUE(diff.empty()) << diff;
  }
}

INSTANTIATE_TEST_SUITE_P(Optimizers, CudaOptimizer,
                         ::testing::Values(std::make_pair(std::string("AdamW"), at::kFloat),
                                           std::make_pair(std::string("AdamW"), at::kBFloat16),
                                           std::make_pair(std::string("AdamW8bit"), at::kFloat),
                                           std::make_pair(std::string("Adafactor"), at::kFloat),
                                           std::make_pair(std::string("Lion"), at::kFloat),
                                           std::make_pair(std::string("Compass"), at::kFloat)),
                         [](const auto& info) {
                           return info.param.first + (info.param.second == at::kFloat ? "_fp32" : "_bf16");
                         });

TEST(CudaGradAccumulation, StochasticBf16AccumulationMatchesCpuBitForBit) {
  SHOESTRING_REQUIRE_CUDA();
  at::manual_seed(5);
  const at::Tensor param = at::zeros({300, 77}, at::kBFloat16);
  std::vector<at::Tensor> grads;
  for (int i = 0; i < 4; ++i) grads.push_back(at::randn({300, 77}).mul_(std::pow(10.0, -i)));
  auto accumulate = [&](const at::Device& device) {
    GradientAccumulator acc({param.to(device)}, GradAccumulationMode::bf16_sr, 1234);
    for (int i = 0; i < 3; ++i) acc.add(0, grads[i].to(device), /*micro_step=*/10 + i);
    const at::Tensor buffer = acc.get(0).cpu();
    const at::Tensor total = acc.finish(0, grads[3].to(device)).cpu();
    return std::make_pair(buffer, total);
  };
  const auto cpu = accumulate(at::Device(at::kCPU));
  const auto gpu = accumulate(at::Device(at::kCUDA, 0));
  std::string diff = bit_difference(gpu.first, cpu.first, "bf16_sr buffer");
  EXPECT_TRUE(diff.empty()) << diff;
  diff = bit_difference(gpu.second, cpu.second, "bf16_sr finish");
  EXPECT_TRUE(diff.empty()) << diff;
}

TEST(CudaQuantization, BlockwiseQuantizeDequantizeMatchCpuBitForBit) {
  SHOESTRING_REQUIRE_CUDA();
  at::manual_seed(6);
  const at::Tensor x = at::randn({1000, 37}).mul_(at::rand({1000, 1}).mul_(3.0));  // last block short
  for (const QuantizationMap* map : {&signed_dynamic_map(), &unsigned_dynamic_map()}) {
    const at::Tensor in = map == &signed_dynamic_map() ? x : x.abs();
    const BlockwiseQuantized cpu = quantize_blockwise(in, *map);
    const BlockwiseQuantized gpu = quantize_blockwise(on_cuda(in), *map);
    std::string diff = bit_difference(gpu.codes, cpu.codes, "codes");
    EXPECT_TRUE(diff.empty()) << diff;
    diff = bit_difference(gpu.absmax, cpu.absmax, "absmax");
    EXPECT_TRUE(diff.empty()) << diff;
    const at::Tensor back_cpu = dequantize_blockwise(cpu.codes, cpu.absmax, *map);
    const at::Tensor back_gpu = dequantize_blockwise(on_cuda(cpu.codes), on_cuda(cpu.absmax), *map);
    diff = bit_difference(back_gpu, back_cpu, "dequantized");
    EXPECT_TRUE(diff.empty()) << diff;
  }
}

}  // namespace
}  // namespace shoestring
