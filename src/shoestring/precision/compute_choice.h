// Which compute dtype runs where the rules ask for bf16: the config key
// `precision.bf16_compute` and what the hardware does fast.
//
// bf16 compute pays only on hardware with bf16 units. On x86 CPUs those are
// AVX-512 BF16 and AMX BF16 (core/cpu_features.h); without them libtorch
// 1.13's bf16 matmul and convolution fall back to scalar loops, about 15x
// slower than fp32 on an AVX2 machine, and less exact. So by default ("auto")
// a run whose rules say bf16 compute (full_bf16, mixed_precision = "bf16", or
// a [[precision.rule]]) computes in fp32 on such a CPU, while bf16 *storage*
// keeps its memory saving and its stochastically rounded updates; the run log
// says which was chosen and why. "bf16" insists (with a one-line warning and
// the slowdown measured on the machine), "fp32" always substitutes.
#pragma once
#include <optional>
#include <string>

#include "shoestring/core/cpu_features.h"
#include "shoestring/precision/policy.h"

namespace shoestring::precision {

/// The values of precision.bf16_compute.
enum class Bf16Compute {
  automatic,  ///< "auto": bf16 where the hardware has bf16 units, fp32 elsewhere
  bf16,       ///< "bf16": as the rules say, even where bf16 is slow
  fp32,       ///< "fp32": fp32 wherever the rules say bf16
};

/// Parses "auto" | "bf16" | "fp32". Throws shoestring::Error naming the key
/// and the accepted values for anything else.
Bf16Compute parse_bf16_compute(const std::string& value);

/// What the compute device can do, as far as the choice of compute dtype goes.
struct ComputeHardware {
  std::string name;         ///< "CPU AMD EPYC 7B13" (for the run log)
  bool bf16_units = false;  ///< bf16 runs on dedicated units (faster than fp32)
  std::string units;        ///< which units, or which are missing: "AVX-512 BF16", "no AVX-512 BF16 / AMX BF16"
};

/// The CPU as compute hardware: bf16 units = AVX-512 BF16 or AMX BF16.
ComputeHardware cpu_hardware(const CpuFeatures& cpu);

/// The substitution the policy should apply, or nullopt to compute bf16 as
/// the rules say: fp32 for `fp32`; fp32 for `automatic` on hardware without
/// bf16 units; nothing otherwise. The reason names the hardware and the key.
std::optional<ComputeSubstitution> choose_bf16_compute(Bf16Compute mode, const ComputeHardware& hw);

/// The one-line warning for insisting on bf16 compute (`mode` == bf16) on
/// hardware without bf16 units, with `slowdown` (bf16 matmul time / fp32
/// time, measured by measure_bf16_matmul_slowdown); empty when no warning is
/// due.
std::string bf16_compute_warning(Bf16Compute mode, const ComputeHardware& hw, double slowdown);

}  // namespace shoestring::precision
