// The machine line every benchmark prints before its numbers: the CPU model
// and the instruction-set features its kernels rely on (core/cpu_features.h),
// so that numbers from different machines are never compared blindly.
#pragma once
#include <cstdio>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "shoestring/core/cpu_features.h"
#include "shoestring/core/threads.h"

namespace shoestring::bench {

/// The CPU runtime `shoestring` itself runs with (core/threads.h): passive
/// OpenMP wait unless OMP_WAIT_POLICY is set, OpenBLAS kernels for the CPU
/// where OpenBLAS did not know it (both re-execute the bench once) and the
/// allocator settings. First thing in every bench's main().
inline void prepare_process(char** argv) {
  set_cpu_runtime_environment(argv);
  configure_allocator();
}

/// Prints "CPU: <model> | features: ... | bf16 units: yes|no | OpenMP wait
/// <policy> | BLAS <kernels>" on stdout, or with `json` one JSON object
/// {"cpu", "cpu_features", "bf16_units", "omp_wait_policy", "blas"} as the
/// first line of the JSON-lines output.
inline void print_machine(bool json = false) {
  const CpuFeatures& cpu = cpu_features();
  if (json) {
    fmt::print("{}\n", nlohmann::json{{"cpu", cpu.model},
                                      {"cpu_features", cpu.feature_list()},
                                      {"bf16_units", cpu.fast_bf16()},
                                      {"omp_wait_policy", omp_wait_policy()},
                                      {"blas", blas_kernels()}}
                           .dump());
  } else {
    fmt::print("{} | OpenMP wait {} | BLAS {}\n", describe(cpu), omp_wait_policy(), blas_kernels());
  }
  std::fflush(stdout);
}

}  // namespace shoestring::bench
