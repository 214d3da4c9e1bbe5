#include "shoestring/train/device_precision.h"

#include <fmt/format.h>

#include "shoestring/core/device.h"

namespace shoestring {

std::string adapt_precision_for_bf16_support(TrainConfig& c, bool device_has_bf16, const std::string& device_name) {
  if (device_has_bf16) return "";
  const bool bf16_compute = c.mixed_precision == "bf16" || c.full_bf16;
  if (!bf16_compute) return "";
  if (c.fused_backward_pass) {
    return fmt::format(
        "{} has no native bf16 (compute capability < 8.0); bf16 kept because fused_backward_pass cannot use fp16 "
        "loss scaling (expect slow emulated bf16; fused_backward_pass = false would compute in fp16)",
        device_name);
  }
  std::string changed;
  if (c.full_bf16) {
    c.full_bf16 = false;
    c.full_fp16 = true;
    changed = "full_bf16 -> full_fp16";
  }
  if (c.mixed_precision == "bf16") {
    c.mixed_precision = "fp16";
    changed += changed.empty() ? "mixed_precision bf16 -> fp16" : ", mixed_precision bf16 -> fp16";
  }
  c.auto_upcast = true;
  return fmt::format(
      "precision: {} has no native bf16 (compute capability < 8.0): {}, with dynamic loss scaling and automatic "
      "upcast of overflowing blocks (precision rules naming bf16 are kept as written)",
      device_name, changed);
}

std::string adapt_precision_to_device(TrainConfig& config, const c10::Device& device) {
  const auto capability = cuda_compute_capability(device);
  if (!capability) return "";
  return adapt_precision_for_bf16_support(config, cuda_capability_has_bf16(capability->first, capability->second),
                                          device.str());
}

}  // namespace shoestring
