// Helpers shared by the architecture tests: reference tensors and key lists
// written by scripts/gen_dit_reference.py, a module's key set, resident memory.
#pragma once
#include <unistd.h>

#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shoestring/models/denoiser.h"
#include "shoestring/models/tiny_unet.h"
#include "shoestring/precision/policy.h"

#include "../nn/reference_data.h"

namespace shoestring::testing {

/// tests/data/models/<name>.{json,bin} -> name -> float32 tensor.
inline std::map<std::string, torch::Tensor> load_case(const std::string& name) {
  return load_reference(name, "models");
}

/// tests/data/models/<name>.keys.txt ("name d0,d1,..." per line) -> tensor name -> shape.
inline std::map<std::string, std::vector<int64_t>> load_keys(const std::string& name) {
  std::istringstream in(slurp(std::string(SHOESTRING_TEST_DATA) + "/models/" + name + ".keys.txt"));
  std::map<std::string, std::vector<int64_t>> keys;
  for (std::string line; std::getline(in, line);) {
    if (line.empty() || line[0] == '#') continue;
    const size_t space = line.find(' ');
    std::vector<int64_t> shape;
    std::istringstream dims(line.substr(space + 1));
    for (std::string d; std::getline(dims, d, ',');) shape.push_back(std::stoll(d));
    keys[line.substr(0, space)] = shape;
  }
  return keys;
}

/// Every parameter and buffer of `m` -> its shape.
inline std::map<std::string, std::vector<int64_t>> module_keys(const torch::nn::Module& m) {
  std::map<std::string, std::vector<int64_t>> keys;
  for (const auto& p : m.named_parameters()) keys[p.key()] = p.value().sizes().vec();
  for (const auto& b : m.named_buffers()) keys[b.key()] = b.value().sizes().vec();
  return keys;
}

/// Resident set size of this process in bytes (/proc/self/statm).
inline int64_t resident_bytes() {
  std::ifstream f("/proc/self/statm");
  int64_t size = 0, resident = 0;
  f >> size >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

/// Asserts that `keys` holds `name` with `shape`.
inline void expect_shape(const std::map<std::string, std::vector<int64_t>>& keys, const std::string& name,
                         std::vector<int64_t> shape) {
  auto it = keys.find(name);
  ASSERT_NE(it, keys.end()) << name;
  EXPECT_EQ(it->second, shape) << name;
}

/// A TinyUNet small enough for unit tests: 16 base channels, levels [1, 2],
/// one ResBlock per level, attention at level 1, 2 heads, context 12, 8 groups.
inline models::TinyUNetOptions small_tiny_unet_options() {
  return models::TinyUNetOptions()
      .base_channels(16)
      .channel_mult({1, 2})
      .num_res_blocks(1)
      .attention_levels({1})
      .num_heads(2)
      .context_dim(12)
      .groups(8);
}

/// Gradient checkpointing as a training run switches it on: the config's
/// `gradient_checkpointing` shorthand rule ({match "*", checkpoint true}; off:
/// no rule) resolved against `model` and set on every declared block of the
/// denoiser block tables in it (precision::block_precision, as
/// precision::apply does), leaving the parameters (dtype, requires_grad) as
/// they are. Blocks compute in the dtype of the model's parameters (as
/// unconfigured; a CPU-only helper).
inline void checkpoint_by_rule(torch::nn::Module& model, bool on) {
  const std::vector<nn::BlockTable*> tables = models::denoiser_block_tables(model);
  const auto policy = precision::Policy::from_specs(precision::shorthand_rules("no", false, false, on));
  const precision::Resolution res = precision::resolve(model, policy, {tables.begin(), tables.end()});
  const at::ScalarType dtype = model.parameters().at(0).scalar_type();
  std::map<std::string, const precision::ModuleRow*> row_of;
  for (const auto& m : res.modules) row_of[m.path] = &m;
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    for (nn::BlockTable* t : tables) {
      if (!t->is_block(item.value().get())) continue;
      nn::BlockPrecision p = precision::block_precision(row_of.at(item.key())->settings, torch::kCPU);
      p.compute = dtype;
      t->set(item.value().get(), p);
    }
  }
}

}  // namespace shoestring::testing
