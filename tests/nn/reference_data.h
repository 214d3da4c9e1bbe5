// Loader for reference vectors written by scripts/gen_nn_reference.py:
// <case>.json lists tensors {name, shape, offset (float32 elements)} stored
// back to back as little-endian float32 in <case>.bin.
#pragma once
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

namespace shoestring::testing {

inline std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open " + path);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

/// Loads tests/data/<folder>/<name>.{json,bin} (scripts/reference_data.py's
/// format) into a name -> float32 tensor map.
inline std::map<std::string, torch::Tensor> load_reference(const std::string& name, const std::string& folder = "nn") {
  const std::string base = std::string(SHOESTRING_TEST_DATA) + "/" + folder + "/" + name;
  const auto index = nlohmann::json::parse(slurp(base + ".json"));
  const std::string bin = slurp(base + ".bin");
  std::map<std::string, torch::Tensor> out;
  for (const auto& e : index.at("tensors")) {
    std::vector<int64_t> shape = e.at("shape").get<std::vector<int64_t>>();
    const int64_t offset = e.at("offset").get<int64_t>();
    torch::Tensor t = torch::empty(shape, torch::kFloat32);
    const size_t bytes = static_cast<size_t>(t.numel()) * 4;
    if (static_cast<size_t>(offset) * 4 + bytes > bin.size()) throw std::runtime_error("truncated " + base + ".bin");
    std::memcpy(t.data_ptr<float>(), bin.data() + offset * 4, bytes);  // host is little-endian
    out[e.at("name").get<std::string>()] = t;
  }
  return out;
}

/// Copies every "param.<path>" tensor into the module's parameter <path>
/// (and buffer <path> when with_buffers: BatchNorm statistics); fails the
/// test if the sets of names differ.
inline void load_params(torch::nn::Module& m, const std::map<std::string, torch::Tensor>& ref,
                        bool with_buffers = false) {
  torch::NoGradGuard no_grad;
  size_t used = 0;
  auto targets = m.named_parameters();
  if (with_buffers) {
    for (auto& kv : m.named_buffers()) targets.insert(kv.key(), kv.value());
  }
  for (auto& kv : targets) {
    auto it = ref.find("param." + kv.key());
    ASSERT_NE(it, ref.end()) << "reference lacks parameter " << kv.key();
    ASSERT_EQ(it->second.sizes(), kv.value().sizes()) << kv.key();
    kv.value().copy_(it->second);
    ++used;
  }
  size_t in_ref = 0;
  for (const auto& kv : ref) in_ref += kv.first.rfind("param.", 0) == 0;
  EXPECT_EQ(used, in_ref) << "reference has parameters the module lacks";
}

}  // namespace shoestring::testing
