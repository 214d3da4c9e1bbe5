#include "shoestring/core/cpu_features.h"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <set>
#include <sstream>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "shoestring/core/error.h"

namespace shoestring {

namespace {

/// The value after "key<tabs/spaces>: " on a line that starts with `key`, or
/// nothing when the line is another key.
bool value_of(const std::string& line, const std::string& key, std::string& value) {
  if (line.rfind(key, 0) != 0) return false;
  const auto colon = line.find(':', key.size());
  if (colon == std::string::npos) return false;
  for (size_t i = key.size(); i < colon; ++i) {
    if (line[i] != ' ' && line[i] != '\t') return false;  // "flagsfoo:" is another key
  }
  value = line.substr(std::min(line.size(), colon + 1));
  const auto first = value.find_first_not_of(" \t");
  value = first == std::string::npos ? "" : value.substr(first);
  while (!value.empty() && (value.back() == ' ' || value.back() == '\r')) value.pop_back();
  return true;
}

}  // namespace

std::string CpuFeatures::feature_list() const {
  const std::pair<const char*, bool> all[] = {{"avx2", avx2},
                                              {"fma", fma},
                                              {"f16c", f16c},
                                              {"avx512f", avx512f},
                                              {"avx512bw", avx512bw},
                                              {"avx512vl", avx512vl},
                                              {"avx512dq", avx512dq},
                                              {"avx512_bf16", avx512_bf16},
                                              {"avx512_fp16", avx512_fp16},
                                              {"amx_bf16", amx_bf16}};
  std::string out;
  for (const auto& [name, present] : all) {
    if (present) out += (out.empty() ? "" : " ") + std::string(name);
  }
  return out.empty() ? "none" : out;
}

CpuFeatures parse_cpuinfo(const std::string& text) {
  CpuFeatures cpu;
  std::istringstream in(text);
  bool have_model = false, have_flags = false;
  for (std::string line; std::getline(in, line) && !(have_model && have_flags);) {
    std::string value;
    if (!have_model && value_of(line, "model name", value)) {
      if (!value.empty()) cpu.model = value;
      have_model = true;
    } else if (!have_flags && value_of(line, "flags", value)) {
      std::set<std::string> flags;
      std::istringstream words(value);
      for (std::string w; words >> w;) flags.insert(w);
      const auto has = [&](const char* f) { return flags.count(f) > 0; };
      cpu.avx2 = has("avx2");
      cpu.fma = has("fma");
      cpu.f16c = has("f16c");
      cpu.avx512f = has("avx512f");
      cpu.avx512bw = has("avx512bw");
      cpu.avx512vl = has("avx512vl");
      cpu.avx512dq = has("avx512dq");
      cpu.avx512_bf16 = has("avx512_bf16");
      cpu.avx512_fp16 = has("avx512_fp16");
      cpu.amx_bf16 = has("amx_bf16");
      have_flags = true;
    }
  }
  return cpu;
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures cpu = [] {
    std::ifstream f("/proc/cpuinfo");
    std::stringstream text;
    text << f.rdbuf();
    return parse_cpuinfo(text.str());
  }();
  return cpu;
}

std::string describe(const CpuFeatures& cpu) {
  return fmt::format("CPU: {} | features: {} | bf16 units: {}", cpu.model, cpu.feature_list(),
                     cpu.fast_bf16() ? "yes" : "no");
}

double measure_bf16_matmul_slowdown(int n, int repeats) {
  if (n < 16) fail("measure_bf16_matmul_slowdown: n = {} is too small (expected >= 16)", n);
  if (repeats < 1) fail("measure_bf16_matmul_slowdown: repeats = {} (expected >= 1)", repeats);
  const at::Tensor a = at::rand({n, n});
  const at::Tensor b = at::rand({n, n});
  const auto best_seconds = [&](const at::Tensor& x, const at::Tensor& y) {
    at::mm(x, y);  // warm-up: first-call dispatch and buffer setup
    double best = 1e30;
    for (int i = 0; i < repeats; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      at::Tensor c = at::mm(x, y);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    return std::max(best, 1e-9);
  };
  const double fp32 = best_seconds(a, b);
  const double bf16 = best_seconds(a.to(at::kBFloat16), b.to(at::kBFloat16));
  return bf16 / fp32;
}

}  // namespace shoestring
