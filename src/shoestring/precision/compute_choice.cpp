#include "shoestring/precision/compute_choice.h"

#include <fmt/format.h>

#include "shoestring/core/error.h"

namespace shoestring::precision {

Bf16Compute parse_bf16_compute(const std::string& value) {
  if (value == "auto") return Bf16Compute::automatic;
  if (value == "bf16") return Bf16Compute::bf16;
  if (value == "fp32") return Bf16Compute::fp32;
  fail("precision.bf16_compute: expected \"auto\", \"bf16\" or \"fp32\", got \"{}\"", value);
}

ComputeHardware cpu_hardware(const CpuFeatures& cpu) {
  ComputeHardware hw;
  hw.name = "CPU " + cpu.model;
  hw.bf16_units = cpu.fast_bf16();
  if (cpu.amx_bf16) {
    hw.units = "AMX BF16";
  } else if (cpu.avx512_bf16) {
    hw.units = "AVX-512 BF16";
  } else {
    hw.units = "no AVX-512 BF16 / AMX BF16";
  }
  return hw;
}

std::optional<ComputeSubstitution> choose_bf16_compute(Bf16Compute mode, const ComputeHardware& hw) {
  ComputeSubstitution s;
  s.from = Dtype::bf16;
  s.to = Dtype::fp32;
  switch (mode) {
    case Bf16Compute::bf16: return std::nullopt;
    case Bf16Compute::fp32: s.reason = "precision.bf16_compute = \"fp32\""; return s;
    case Bf16Compute::automatic:
      if (hw.bf16_units) return std::nullopt;
      s.reason = fmt::format(
          "{} has {}: bf16 math would be slower than fp32 there; precision.bf16_compute = \"auto\", set \"bf16\" "
          "to insist",
          hw.name, hw.units);
      return s;
  }
  return std::nullopt;
}

std::string bf16_compute_warning(Bf16Compute mode, const ComputeHardware& hw, double slowdown) {
  if (mode != Bf16Compute::bf16 || hw.bf16_units) return "";
  return fmt::format(
      "precision.bf16_compute = \"bf16\" on {} ({}): bf16 matmul measured {:.1f}x slower than fp32 here, expect "
      "steps up to that much slower (\"auto\" computes in fp32 and keeps bf16 weights)",
      hw.name, hw.units, slowdown);
}

}  // namespace shoestring::precision
