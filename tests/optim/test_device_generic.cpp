// The device-generic optimizer paths (ATen ops only: what tensors on a GPU
// take), forced on CPU tensors with force_device_generic_optimizers and
// compared with the fused CPU kernels: the same bits for AdamW, Lion and
// AdamW8bit (parameters, state, 8-bit codes and absmax), in fp32 and in
// bf16 with stochastic rounding, over several steps; Adafactor's generic
// and SPARKLES' generic paths are their op chains, which the fused kernels
// match to rounding (their sums are more accurate), checked to a tolerance. Block-wise quantize /
// dequantize: the generic functions give the CPU functions' bits.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>
#include <vector>

#include "shoestring/optim/factory.h"
#include "shoestring/optim/optimizer.h"
#include "shoestring/optim/quantization.h"

namespace shoestring {
namespace {

/// Restores the default dispatch when a test ends (also on failure).
struct GenericForced {
  explicit GenericForced(bool on) { force_device_generic_optimizers(on); }
  ~GenericForced() { force_device_generic_optimizers(false); }
};

struct Trajectory {
  std::vector<at::Tensor> params;
  std::vector<std::pair<std::string, at::Tensor>> state;
};

/// Runs `steps` steps of optimizer `type` from the same start (a weight
/// matrix large enough for 8-bit state and several fused grains, a bias), on
/// the fused path or the forced generic one.
Trajectory run(const std::string& type, const std::vector<std::string>& args, at::ScalarType dtype, bool generic,
               bool nan_element = true, int steps = 3, at::ScalarType state_dtype = at::kFloat,
               bool stochastic_rounding = true) {
  GenericForced forced(generic);
  torch::manual_seed(11);
  std::vector<std::pair<std::string, at::Tensor>> params = {
      {"w", (torch::randn({257, 129}) * 0.1).to(dtype)},  // 33153 elements: 8-bit state, uneven blocks
      {"b", (torch::randn({129}) * 0.1).to(dtype)},       // small: fp32 state in AdamW8bit
  };
  OptimizerOptions o;
  o.seed = 5;
  o.stochastic_rounding = stochastic_rounding;
  o.state_dtype = state_dtype;
  auto opt = make_optimizer(type, args, params, o);
  for (int s = 0; s < steps; ++s) {
    for (auto& [n, p] : params) {
      auto g = (torch::randn(p.sizes()) * (s + 1) * 0.01).to(dtype);
      // A non-finite element (AdamW8bit skips it; the others carry NaN alike on both paths).
      if (nan_element && s == 1 && n == "w") g.view({-1})[17] = std::numeric_limits<float>::quiet_NaN();
      p.mutable_grad() = g;
    }
    opt->step(1e-3 * (s + 1));
  }
  Trajectory t;
  for (auto& [n, p] : params) t.params.push_back(p.detach().clone());
  t.state = opt->state_tensors();
  return t;
}

void expect_same_bits(const at::Tensor& a, const at::Tensor& b, const std::string& what) {
  ASSERT_EQ(a.scalar_type(), b.scalar_type()) << what;
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const at::Tensor ab = a.contiguous().view({-1});
  const at::Tensor bb = b.contiguous().view({-1});
  at::Tensor ai, bi;
  switch (a.element_size()) {
    case 1:
      ai = ab.view(torch::kByte).to(torch::kInt);
      bi = bb.view(torch::kByte).to(torch::kInt);
      break;
    case 2:
      ai = ab.view(torch::kShort);
      bi = bb.view(torch::kShort);
      break;
    default:
      ai = ab.view(torch::kInt);
      bi = bb.view(torch::kInt);
      break;
  }
  const int64_t differ = ai.ne(bi).sum().item<int64_t>();
  EXPECT_EQ(differ, 0) << what << ": " << differ << " of " << a.numel() << " elements differ";
}

void expect_identical(const std::string& type, const std::vector<std::string>& args, at::ScalarType dtype) {
  const Trajectory fused = run(type, args, dtype, false);
  const Trajectory generic = run(type, args, dtype, true);
  const std::string what = type + " " + c10::toString(dtype);
  for (size_t i = 0; i < fused.params.size(); ++i)
    expect_same_bits(fused.params[i], generic.params[i], what + " param");
  ASSERT_EQ(fused.state.size(), generic.state.size()) << what;
  for (size_t i = 0; i < fused.state.size(); ++i) {
    EXPECT_EQ(fused.state[i].first, generic.state[i].first);
    expect_same_bits(fused.state[i].second, generic.state[i].second, what + " " + fused.state[i].first);
  }
}

TEST(DeviceGeneric, AdamWSameBitsAsFusedKernel) {
  expect_identical("AdamW", {"weight_decay=0.1"}, torch::kFloat);
  expect_identical("AdamW", {"weight_decay=0.1"}, torch::kBFloat16);
}

TEST(DeviceGeneric, LionSameBitsAsFusedKernel) {
  expect_identical("Lion", {"weight_decay=0.1"}, torch::kFloat);
  expect_identical("Lion", {"weight_decay=0.1"}, torch::kBFloat16);
}

TEST(DeviceGeneric, AdamW8bitSameBitsAsFusedKernel) {
  expect_identical("AdamW8bit", {"weight_decay=0.1"}, torch::kFloat);
  expect_identical("AdamW8bit", {"weight_decay=0.1"}, torch::kBFloat16);
  // fp16 parameters: the CPU per-element loop against the generic path.
  expect_identical("AdamW8bit", {"weight_decay=0.1"}, torch::kHalf);
}

TEST(DeviceGeneric, CompassIsOneOpChainOnEveryPath) { expect_identical("Compass", {}, torch::kBFloat16); }

/// Largest |a - b| / (max |b| over the tensor) over every parameter and state
/// tensor of SPARKLES' fused and generic paths (NaN where one path has NaN
/// must be NaN on the other; finite elements are compared).
double sparkles_paths_apart(const std::vector<std::string>& args, at::ScalarType dtype, int steps,
                            at::ScalarType state_dtype = at::kFloat, bool nan_element = false) {
  const Trajectory fused = run("SPARKLES", args, dtype, false, nan_element, steps, state_dtype);
  const Trajectory generic = run("SPARKLES", args, dtype, true, nan_element, steps, state_dtype);
  std::vector<std::pair<at::Tensor, at::Tensor>> pairs;
  for (size_t i = 0; i < fused.params.size(); ++i) pairs.emplace_back(fused.params[i], generic.params[i]);
  EXPECT_EQ(fused.state.size(), generic.state.size());
  for (size_t i = 0; i < std::min(fused.state.size(), generic.state.size()); ++i) {
    EXPECT_EQ(fused.state[i].first, generic.state[i].first);
    pairs.emplace_back(fused.state[i].second, generic.state[i].second);
  }
  double worst = 0;
  for (const auto& [a, b] : pairs) {
    const at::Tensor a32 = a.to(torch::kFloat), b32 = b.to(torch::kFloat);
    EXPECT_TRUE(torch::equal(a32.isnan(), b32.isnan())) << "NaN in different elements";
    const at::Tensor a0 = a32.nan_to_num(0), b0 = b32.nan_to_num(0);
    worst = std::max(worst, ((a0 - b0).abs().max() / b0.abs().max()).item<double>());
  }
  return worst;
}

TEST(DeviceGeneric, SparklesFusedKernelMatchesOpChainToRounding) {
  // fp32: the kernel's sums and its g f in place of lerp differ from the op
  // chain by fp32 rounding, amplified a little by the division by sqrt(v).
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"weight_decay=0.1"},  // guide defaults, coupled decay
           {"normalize_channels=False", "decouple_weight_decay=True", "weight_decay=0.1", "clip_gradients=True"}}) {
    EXPECT_LT(sparkles_paths_apart(args, torch::kFloat, 4), 1e-5) << args[0];
  }
  // Without the two reductions the element formulas are the op chain's, fused
  // multiply-adds included (as fused_adamw_step's): the same bits.
  EXPECT_EQ(sparkles_paths_apart({"centralization=0", "normalization=0", "amp_fac=0.5", "weight_decay=0.1"},
                                 torch::kFloat, 4),
            0.0);
  // The same there in bf16: the same fp32 values meet the same random words
  // (keys: weight slot 0, ema 1, ema_squared 2, prev_grad 3), for
  // stochastically rounded and round-to-nearest weights and bf16 states.
  const std::vector<std::string> plain = {"centralization=0", "normalization=0", "amp_fac=0.5", "weight_decay=0.1"};
  for (bool sr : {true, false}) {
    const Trajectory f = run("SPARKLES", plain, torch::kBFloat16, false, false, 3, torch::kBFloat16, sr);
    const Trajectory g = run("SPARKLES", plain, torch::kBFloat16, true, false, 3, torch::kBFloat16, sr);
    for (size_t i = 0; i < f.params.size(); ++i) expect_same_bits(f.params[i], g.params[i], "SPARKLES bf16 param");
    ASSERT_EQ(f.state.size(), g.state.size());
    for (size_t i = 0; i < f.state.size(); ++i)
      expect_same_bits(f.state[i].second, g.state[i].second, f.state[i].first);
  }
  // bf16 weights and states with the reductions: a difference in the last fp32
  // bits flips an occasional stochastic rounding, one bf16 step (up to 2^-7
  // relative to the element, less relative to the tensor's largest) at most.
  EXPECT_LT(sparkles_paths_apart({"weight_decay=0.1"}, torch::kBFloat16, 3), 1.0 / 128);
  EXPECT_LT(sparkles_paths_apart({"weight_decay=0.1"}, torch::kBFloat16, 3, torch::kBFloat16), 1.0 / 128);
  EXPECT_LT(sparkles_paths_apart({}, torch::kFloat, 3, torch::kBFloat16), 1.0 / 128);
  // Permutation on every step after the first: those steps run the op chain on both paths.
  EXPECT_LT(sparkles_paths_apart({"stochastic_threshold=1e9"}, torch::kFloat, 3), 1e-5);
  EXPECT_LT(sparkles_paths_apart({"stochastic_threshold=1e9", "weight_decay=0.1"}, torch::kBFloat16, 3), 1.0 / 128);
  // A NaN gradient element (step 2): NaN spreads over the same elements on both
  // paths (its slice's mean and std), the rest agrees.
  EXPECT_LT(sparkles_paths_apart({"weight_decay=0.1"}, torch::kFloat, 3, torch::kFloat, /*nan_element=*/true), 1e-5);
  EXPECT_LT(sparkles_paths_apart({"normalize_channels=False"}, torch::kFloat, 3, torch::kFloat, true), 1e-5);
}

TEST(DeviceGeneric, AdafactorOpChainMatchesFusedKernelToRounding) {
  // (A NaN gradient element would poison a whole factored row and column: none here.)
  const Trajectory fused = run("Adafactor", {}, torch::kFloat, false, /*nan_element=*/false);
  const Trajectory generic = run("Adafactor", {}, torch::kFloat, true, /*nan_element=*/false);
  for (size_t i = 0; i < fused.params.size(); ++i) {
    const double diff = (fused.params[i] - generic.params[i]).abs().max().item<double>();
    EXPECT_LT(diff, 1e-6) << i;  // updates are ~1e-3 (relative step): agreement to ~1e-3 of an update
  }
}

TEST(DeviceGeneric, BlockwiseQuantizationSameBits) {
  torch::manual_seed(2);
  auto x = torch::randn({1000, 7}) * torch::logspace(-8, 2, 7);  // every decade of the map
  x.slice(0, 0, 1).zero_();                                      // an all-zero block start
  x.view({-1}).slice(0, 256, 512).zero_();                       // an all-zero block
  for (const QuantizationMap* map : {&signed_dynamic_map(), &unsigned_dynamic_map()}) {
    const at::Tensor input = map == &unsigned_dynamic_map() ? x.abs() : x;
    for (int64_t bs : {int64_t{256}, int64_t{64}, int64_t{7000}}) {
      const BlockwiseQuantized cpu = quantize_blockwise(input, *map, bs);
      const BlockwiseQuantized gen = quantize_blockwise_generic(input, *map, bs);
      expect_same_bits(cpu.codes, gen.codes, "codes");
      expect_same_bits(cpu.absmax, gen.absmax, "absmax");
      expect_same_bits(dequantize_blockwise(cpu.codes, cpu.absmax, *map, bs),
                       dequantize_blockwise_generic(cpu.codes, cpu.absmax, *map, bs), "dequantized");
    }
  }
  // Values exactly halfway between two map values go to the lower code.
  const auto& v = signed_dynamic_map().values();
  std::vector<float> mids;
  for (size_t i = 100; i < 110; ++i) mids.push_back(static_cast<float>((static_cast<double>(v[i]) + v[i + 1]) / 2));
  mids.push_back(1.0f);  // absmax 1: the values are the scaled ones
  const at::Tensor m = torch::tensor(mids);
  expect_same_bits(quantize_blockwise(m, signed_dynamic_map()).codes,
                   quantize_blockwise_generic(m, signed_dynamic_map(), 256).codes, "midpoints");
}

}  // namespace
}  // namespace shoestring
