// Golden optimizer trajectories from PyTorch (scripts/gen_optim_reference.py,
// scripts/gen_sparkles_reference.py): the JSON layout those scripts write
// ({"shapes", "weight_decay", <run>: {"initial", "lr", "steps": [{"grads",
// "params"?}]}}) and the replay every optimizer test shares.
#pragma once
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "shoestring/optim/optimizer.h"

namespace shoestring::testing {

/// A float32 tensor of `shape` from a flat JSON list.
inline at::Tensor golden_tensor(const nlohmann::json& values, const nlohmann::json& shape) {
  return torch::tensor(values.get<std::vector<float>>()).view(shape.get<std::vector<int64_t>>());
}

/// tests/data/optim/`file`, parsed.
inline nlohmann::json load_golden(const std::string& file) {
  std::ifstream in(std::string(SHOESTRING_TEST_DATA) + "/optim/" + file);
  EXPECT_TRUE(in.good()) << file;
  return nlohmann::json::parse(in);
}

/// max |got - expected| / max(|expected|, 1e-3).
inline double max_rel(const at::Tensor& got, const at::Tensor& expected) {
  return ((got - expected).abs() / expected.abs().clamp_min(1e-3)).max().item<double>();
}

/// The run's initial parameters ("p0", "p1", ... with the file's weight decay).
struct GoldenParams {
  std::vector<at::Tensor> params;
  std::vector<OptimParam> optim_params;
};

inline GoldenParams golden_params(const nlohmann::json& ref, const nlohmann::json& run) {
  GoldenParams g;
  for (size_t i = 0; i < ref["shapes"].size(); ++i) {
    g.params.push_back(golden_tensor(run["initial"][i], ref["shapes"][i]).requires_grad_(true));
    g.optim_params.push_back({"p" + std::to_string(i), g.params.back(), ref["weight_decay"][i].get<double>()});
  }
  return g;
}

/// Steps `opt` through the run's gradients at its lr; after each step the
/// gradients must be unchanged and, where the file has a snapshot, every
/// parameter within `tolerance` (max_rel) of it. Returns the snapshots compared.
inline int replay_golden_steps(Optimizer& opt, std::vector<at::Tensor>& params, const nlohmann::json& ref,
                               const nlohmann::json& run, const std::string& key, double tolerance = 1e-6) {
  const double lr = run["lr"];
  int checked = 0;
  for (size_t s = 0; s < run["steps"].size(); ++s) {
    const auto& rec = run["steps"][s];
    std::vector<at::Tensor> grads;
    for (size_t i = 0; i < params.size(); ++i) {
      grads.push_back(golden_tensor(rec["grads"][i], ref["shapes"][i]));
      params[i].mutable_grad() = grads.back().clone();
    }
    opt.step(lr);
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(torch::equal(params[i].grad(), grads[i])) << key << ": the gradient must not be modified";
    }
    if (!rec.contains("params")) continue;
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_LT(max_rel(params[i].detach(), golden_tensor(rec["params"][i], ref["shapes"][i])), tolerance)
          << key << " step " << s + 1 << " param " << i;
      ++checked;
    }
  }
  return checked;
}

}  // namespace shoestring::testing
