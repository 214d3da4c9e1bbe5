// Intra-op thread count for libtorch.
//
// libtorch 1.13 defaults to the number of *physical* cores that cpuinfo
// reports, which on small virtual machines whose vCPUs are presented as SMT
// siblings is 1 even when 2 CPUs are usable; bf16 kernels there run ~2x
// faster on both. shoestring defaults to every CPU the process may use.
#pragma once
#include <cstdint>

namespace shoestring {

/// Sets libtorch's intra-op threads: `requested` if > 0, else the number of
/// CPUs in this process's affinity mask. Returns the count set.
int configure_threads(int64_t requested);

}  // namespace shoestring
