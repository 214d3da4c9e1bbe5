// Helpers shared by the architecture tests: reference tensors and key lists
// written by scripts/gen_dit_reference.py, a module's key set, resident memory.
#pragma once
#include <unistd.h>

#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <torch/torch.h>

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

}  // namespace shoestring::testing
