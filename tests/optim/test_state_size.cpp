// Each optimizer's state_size() (through optimizer_state_size, what the
// memory planner and `plan --explain` use) against the bytes of the state
// tensors the real optimizer holds after one step: every optimizer type,
// fp32 and bf16 state, fp32 and bf16 weights, 1-D and 2-D / 4-D shapes
// (factored for Adafactor) and sizes around AdamW8bit's 8-bit threshold and
// block boundaries.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/units.h"
#include "shoestring/optim/factory.h"

using namespace shoestring;

namespace {

// Sum of element bytes over the state tensors of one parameter named `name`.
int64_t held_bytes(const Optimizer& opt, const std::string& name) {
  int64_t bytes = 0;
  for (const auto& [key, t] : opt.state_tensors()) {
    if (key.compare(0, name.size() + 1, name + ".") == 0) bytes += t.numel() * t.element_size();
  }
  return bytes;
}

struct ArgsCase {
  const char* type;
  std::vector<std::string> args;
};

}  // namespace

TEST(OptimizerStateSize, MatchesTheStateTensorsAfterOneStep) {
  const std::vector<ArgsCase> optimizers = {
      {"AdamW", {}},
      {"AdamW8bit", {}},
      {"AdamW8bit", {"min_8bit_size=100", "block_size=64"}},
      {"Adafactor", {"scale_parameter=False", "relative_step=False", "warmup_init=False"}},
      {"Adafactor", {}},
      {"Adafactor", {"beta1=0.9", "relative_step=False"}},
      {"Lion", {}},
      {"Compass", {}},
      {"SPARKLES", {}},
  };
  // 1-D, odd sizes around the 8-bit threshold (4096) and the 64 / 256 blocks,
  // 2-D and 4-D (Adafactor factors them), an empty tensor.
  const std::vector<std::vector<int64_t>> shapes = {{7},    {99},     {100},  {257},         {4095},   {4096},
                                                    {4097}, {64, 80}, {3, 5}, {12, 4, 3, 3}, {1, 300}, {0}};
  int checked = 0;
  for (const ArgsCase& k : optimizers) {
    for (at::ScalarType state_dtype : {at::kFloat, at::kBFloat16}) {
      for (at::ScalarType weight_dtype : {at::kFloat, at::kBFloat16}) {
        torch::manual_seed(3);
        std::vector<std::pair<std::string, at::Tensor>> params;
        for (size_t i = 0; i < shapes.size(); ++i) {
          params.emplace_back(fmt::format("p{}", i), (torch::randn(shapes[i]) * 0.1).to(weight_dtype));
        }
        OptimizerOptions options;
        options.state_dtype = state_dtype;
        options.stochastic_rounding = weight_dtype != at::kFloat;
        auto opt = make_optimizer(k.type, k.args, params, options);
        for (auto& [name, p] : params) p.mutable_grad() = torch::randn(p.sizes()).to(weight_dtype);
        opt->step(1e-3);
        const std::string label = fmt::format("{} [{}] state {} weights {}", k.type, fmt::join(k.args, " "),
                                              c10::toString(state_dtype), c10::toString(weight_dtype));
        for (size_t i = 0; i < shapes.size(); ++i) {
          const OptimizerStateSize s = optimizer_state_size(k.type, k.args, shapes[i], weight_dtype, options);
          EXPECT_EQ(s.state, held_bytes(*opt, params[i].first)) << label << " shape " << format_shape(shapes[i]);
          EXPECT_GE(s.scratch, 0);
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 9 * 2 * 2 * 12);
}

TEST(OptimizerStateSize, UnknownOptimizerThrows) {
  EXPECT_THROW(optimizer_state_size("SGD", {}, {4}, at::kFloat, {}), Error);
}
