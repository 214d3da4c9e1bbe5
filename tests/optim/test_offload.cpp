// Optimizer-state offload: the same updates bit for bit as without it, state
// charged to the ledger's host_offload category, at most one parameter's
// state on the device during a step, and checkpoints that round-trip.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shoestring/core/memory_ledger.h"
#include "shoestring/optim/factory.h"
#include "shoestring/optim/fused_backward.h"

using namespace shoestring;

namespace {

std::vector<std::pair<std::string, at::Tensor>> make_params(at::ScalarType dtype) {
  torch::manual_seed(7);
  std::vector<std::pair<std::string, at::Tensor>> p;
  p.emplace_back("a.weight", torch::randn({64, 96}).to(dtype).requires_grad_(true));
  p.emplace_back("a.bias", torch::randn({64}).to(dtype).requires_grad_(true));
  p.emplace_back("conv.weight", torch::randn({32, 16, 3, 3}).to(dtype).requires_grad_(true));
  return p;
}

// Runs `steps` steps with deterministic gradients; returns the final
// parameters and state.
std::pair<std::vector<at::Tensor>, std::vector<std::pair<std::string, at::Tensor>>> run(const std::string& type,
                                                                                        at::ScalarType dtype,
                                                                                        bool offload, bool fused,
                                                                                        int steps) {
  auto params = make_params(dtype);
  OptimizerOptions o;
  o.seed = 3;
  o.offload_state = offload;
  std::vector<std::string> args =
      type == "AdamW8bit" ? std::vector<std::string>{"min_8bit_size=100"} : std::vector<std::string>{};
  auto opt = make_optimizer(type, args, params, o);
  std::unique_ptr<FusedBackward> fb;
  if (fused) fb = std::make_unique<FusedBackward>(*opt, FusedBackwardOptions{});
  for (int s = 1; s <= steps; ++s) {
    torch::manual_seed(100 + s);
    at::Tensor loss = torch::zeros({}, torch::kFloat32);
    for (auto& [n, p] : params) loss = loss + (p.to(torch::kFloat32) * torch::randn(p.sizes())).sum();
    if (fb) {
      fb->begin_step(1e-2);
      fb->begin_micro_batch(0);
      loss.backward();
      fb->end_step();
    } else {
      loss.backward();
      opt->step(1e-2);
      for (auto& [n, p] : params) p.mutable_grad().reset();
    }
  }
  std::vector<at::Tensor> out;
  for (auto& [n, p] : params) out.push_back(p.detach().clone());
  return {out, opt->state_tensors()};
}

}  // namespace

TEST(OptimizerOffload, SameUpdatesAsOnDevice) {
  MemoryLedger::global().install();
  for (const char* type : {"AdamW", "AdamW8bit", "Adafactor", "Lion"}) {
    for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
      for (bool fused : {false, true}) {
        SCOPED_TRACE(std::string(type) + (dtype == torch::kFloat32 ? " fp32" : " bf16") + (fused ? " fused" : ""));
        auto ref = run(type, dtype, false, fused, 3);
        auto off = run(type, dtype, true, fused, 3);
        ASSERT_EQ(ref.first.size(), off.first.size());
        for (size_t i = 0; i < ref.first.size(); ++i) EXPECT_TRUE(torch::equal(ref.first[i], off.first[i])) << i;
        ASSERT_EQ(ref.second.size(), off.second.size());
        for (size_t i = 0; i < ref.second.size(); ++i) {
          EXPECT_EQ(ref.second[i].first, off.second[i].first);
          EXPECT_TRUE(torch::equal(ref.second[i].second, off.second[i].second)) << ref.second[i].first;
          EXPECT_EQ(MemoryLedger::global().charged_category(off.second[i].second),
                    static_cast<int>(MemoryCategory::host_offload))
              << off.second[i].first;
          EXPECT_EQ(MemoryLedger::global().charged_category(ref.second[i].second),
                    static_cast<int>(MemoryCategory::optimizer_state))
              << ref.second[i].first;
        }
      }
    }
  }
}

TEST(OptimizerOffload, DeviceHoldsOneParameterStateAtATime) {
  auto& ledger = MemoryLedger::global();
  ledger.install();
  auto params = make_params(torch::kFloat32);
  OptimizerOptions o;
  o.offload_state = true;
  auto opt = make_optimizer("AdamW", {}, params, o);
  for (auto& [n, p] : params) p.mutable_grad() = torch::ones_like(p);
  opt->step(1e-3);  // creates the state, ends on the host
  const int64_t host_before = ledger.current_bytes(MemoryCategory::host_offload);
  const int64_t dev_before = ledger.current_bytes(MemoryCategory::optimizer_state);
  ledger.reset_peaks();
  opt->step(1e-3);
  // AdamW: 8 bytes per element; the largest parameter has 64*96 elements.
  const int64_t largest_state = 64 * 96 * 8;
  EXPECT_EQ(ledger.current_bytes(MemoryCategory::host_offload), host_before);
  EXPECT_EQ(ledger.current_bytes(MemoryCategory::optimizer_state), dev_before);
  EXPECT_LE(ledger.peak_bytes(MemoryCategory::optimizer_state) - dev_before, largest_state);
  EXPECT_GE(ledger.peak_bytes(MemoryCategory::optimizer_state) - dev_before, largest_state);
  EXPECT_GE(host_before, opt->state_bytes());
  // The device total leaves the host bytes out.
  EXPECT_EQ(ledger.current_total() - ledger.device_current_total(), host_before);
  // Restored state goes to the host too.
  auto saved = opt->state_tensors();
  std::map<std::string, at::Tensor> m;
  for (auto& [k, t] : saved) m[k] = t;
  opt->load_state_tensors(m);
  for (auto& [k, t] : opt->state_tensors()) {
    EXPECT_EQ(ledger.charged_category(t), static_cast<int>(MemoryCategory::host_offload)) << k;
  }
}
