// Reading the JSON reference files that scripts/gen_*_reference.py write
// into tests/data/train/ (float64 values compared against the C++ side).
#pragma once
#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

namespace shoestring::testing {

/// tests/data/train/<name>, parsed (a missing file fails the test).
inline nlohmann::json train_reference(const std::string& name) {
  std::ifstream in(std::string(SHOESTRING_TEST_DATA) + "/train/" + name);
  EXPECT_TRUE(in.good()) << name;
  return nlohmann::json::parse(in);
}

/// A JSON array of numbers as a float64 tensor.
inline at::Tensor doubles(const nlohmann::json& j) {
  return torch::tensor(j.get<std::vector<double>>(), torch::kDouble);
}

/// max |a - b|, computed in float64.
inline double max_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
}

}  // namespace shoestring::testing
