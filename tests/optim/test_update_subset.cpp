// Optimizer::set_update_subset (what ZeRO stages 1 and 2 give each rank):
// the updated parameters get exactly the bits of the full optimizer
// (stochastic rounding keyed by the index in the full list), the others
// keep their values and hold no state, and loading a full state keeps
// only the subset's tensors.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/optim/factory.h"

namespace shoestring {
namespace {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

/// Three bf16 parameters with fixed values and gradients.
NamedTensors make_params() {
  torch::manual_seed(5);
  NamedTensors p;
  p.emplace_back("a.weight", torch::randn({300, 16}).to(torch::kBFloat16));
  p.emplace_back("b.bias", torch::randn({17}).to(torch::kBFloat16));
  p.emplace_back("c.weight", torch::randn({16, 33}).to(torch::kBFloat16));
  for (auto& [n, t] : p) {
    t.set_requires_grad(true);
    t.mutable_grad() = torch::randn(t.sizes()).to(torch::kBFloat16);
  }
  return p;
}

void expect_subset_steps_as_full(const std::string& type) {
  OptimizerOptions options;  // stochastic rounding on
  NamedTensors full_params = make_params();
  NamedTensors part_params = make_params();
  auto full = make_optimizer(type, {}, full_params, options);
  auto part = make_optimizer(type, {}, part_params, options);
  part->set_update_subset({true, false, true});
  const at::Tensor untouched = part_params[1].second.detach().clone();
  for (int step = 0; step < 3; ++step) {
    full->step(1e-2, 0.5);
    part->step(1e-2, 0.5);
  }
  for (size_t i : {size_t{0}, size_t{2}}) {
    EXPECT_TRUE(part_params[i].second.equal(full_params[i].second)) << type << " " << part_params[i].first;
  }
  EXPECT_TRUE(part_params[1].second.equal(untouched)) << type << ": a parameter outside the subset changed";
  // State of the subset only, the same tensors as the full optimizer's.
  std::map<std::string, at::Tensor> full_state;
  for (const auto& [k, t] : full->state_tensors()) full_state[k] = t;
  int64_t expected_bytes = 0;
  for (const auto& [k, t] : part->state_tensors()) {
    EXPECT_EQ(k.rfind("b.bias.", 0), std::string::npos) << k;
    ASSERT_TRUE(full_state.count(k)) << k;
    EXPECT_TRUE(t.equal(full_state[k])) << k;
    expected_bytes += t.numel() * t.element_size();
  }
  EXPECT_GT(expected_bytes, 0);
  EXPECT_EQ(part->state_bytes(), expected_bytes);
  // Loading the full state keeps the subset's tensors only (names still checked).
  NamedTensors fresh = make_params();
  auto loaded = make_optimizer(type, {}, fresh, options);
  loaded->set_update_subset({false, true, false});
  loaded->load_state_tensors(full_state);
  for (const auto& [k, t] : loaded->state_tensors()) EXPECT_EQ(k.rfind("b.bias.", 0), 0u) << k;
  EXPECT_FALSE(loaded->state_tensors().empty());
  std::map<std::string, at::Tensor> wrong = full_state;
  wrong["nope.exp_avg"] = torch::zeros({1});
  EXPECT_THAT([&] { loaded->load_state_tensors(wrong); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("nope.exp_avg")));
}

TEST(UpdateSubset, AdamW) { expect_subset_steps_as_full("AdamW"); }
TEST(UpdateSubset, AdamW8bit) { expect_subset_steps_as_full("AdamW8bit"); }
TEST(UpdateSubset, Adafactor) { expect_subset_steps_as_full("Adafactor"); }

TEST(UpdateSubset, NeedsOneEntryPerParameter) {
  NamedTensors p = make_params();
  auto opt = make_optimizer("AdamW", {}, p, OptimizerOptions{});
  EXPECT_THAT([&] { opt->set_update_subset({true}); },
              ::testing::ThrowsMessage<Error>(::testing::HasSubstr("1 entries for 3 parameters")));
}

}  // namespace
}  // namespace shoestring
