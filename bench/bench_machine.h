// The machine line every benchmark prints before its numbers: the CPU model
// and the instruction-set features its kernels rely on (core/cpu_features.h),
// so that numbers from different machines are never compared blindly.
#pragma once
#include <cstdio>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "shoestring/core/cpu_features.h"

namespace shoestring::bench {

/// Prints "CPU: <model> | features: ... | bf16 units: yes|no" on stdout, or
/// with `json` one JSON object {"cpu", "cpu_features", "bf16_units"} as the
/// first line of the JSON-lines output.
inline void print_machine(bool json = false) {
  const CpuFeatures& cpu = cpu_features();
  if (json) {
    fmt::print("{}\n",
               nlohmann::json{{"cpu", cpu.model}, {"cpu_features", cpu.feature_list()}, {"bf16_units", cpu.fast_bf16()}}
                   .dump());
  } else {
    fmt::print("{}\n", describe(cpu));
  }
  std::fflush(stdout);
}

}  // namespace shoestring::bench
