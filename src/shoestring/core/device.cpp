#include "shoestring/core/device.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/cuda.h>

#include "shoestring/core/error.h"

#if defined(SHOESTRING_WITH_CUDA)
#include "shoestring/core/cuda_host.h"
#endif

namespace shoestring {

DeviceSetting parse_device(const std::string& text, const std::string& source) {
  DeviceSetting s;
  if (text == "auto") return s;
  if (text == "cpu") {
    s.kind = DeviceSetting::Kind::cpu;
    return s;
  }
  if (text == "cuda") {
    s.kind = DeviceSetting::Kind::cuda;
    return s;
  }
  const std::string prefix = "cuda:";
  if (text.size() > prefix.size() && text.compare(0, prefix.size(), prefix) == 0) {
    const std::string digits = text.substr(prefix.size());
    const bool all_digits = digits.size() <= 4 && digits.find_first_not_of("0123456789") == std::string::npos;
    if (all_digits) {
      s.kind = DeviceSetting::Kind::cuda;
      s.index = std::stoi(digits);
      return s;
    }
  }
  fail("{} = \"{}\": expected \"auto\", \"cpu\", \"cuda\" or \"cuda:N\" (N a device index, e.g. \"cuda:1\")", source,
       text);
}

CudaAvailability cuda_availability() {
  CudaAvailability a;
  // libtorch_cuda registers CUDA's device guard when it is loaded; a CPU-only
  // libtorch has none.
  a.built_with_cuda = c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA);
  a.device_count = a.built_with_cuda ? static_cast<int>(torch::cuda::device_count()) : 0;
  return a;
}

c10::Device resolve_device(const DeviceSetting& setting, const CudaAvailability& cuda, const std::string& text,
                           const std::string& source) {
  switch (setting.kind) {
    case DeviceSetting::Kind::cpu: return c10::Device(c10::kCPU);
    case DeviceSetting::Kind::automatic:
      if (cuda.built_with_cuda && cuda.device_count > 0) return c10::Device(c10::kCUDA, 0);
      return c10::Device(c10::kCPU);
    case DeviceSetting::Kind::cuda: break;
  }
  if (!cuda.built_with_cuda) {
    fail(
        "{} = \"{}\": this libtorch was built without CUDA (a CPU-only build); use {} = \"cpu\" (or \"auto\"), or "
        "build shoestring against a libtorch with CUDA",
        source, text, source);
  }
  if (cuda.device_count == 0) {
    fail(
        "{} = \"{}\": no CUDA device is visible (libtorch has CUDA, but the driver reports none; check nvidia-smi "
        "and CUDA_VISIBLE_DEVICES); use {} = \"cpu\" (or \"auto\")",
        source, text, source);
  }
  if (setting.index >= cuda.device_count) {
    fail("{} = \"{}\": asks for cuda:{} but only {} CUDA device(s) are visible (cuda:0{})", source, text, setting.index,
         cuda.device_count, cuda.device_count > 1 ? fmt::format(" .. cuda:{}", cuda.device_count - 1) : std::string());
  }
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(setting.index));
}

c10::Device resolve_device(const std::string& text, const std::string& source) {
  return resolve_device(parse_device(text, source), cuda_availability(), text, source);
}

bool cuda_capability_has_bf16(int major, int minor) { return major >= 8; }

std::optional<std::pair<int, int>> cuda_compute_capability(const c10::Device& device) {
#if defined(SHOESTRING_WITH_CUDA)
  if (device.is_cuda()) {
    const cuda_host::DeviceProperties p = cuda_host::device_properties(device.has_index() ? device.index() : 0);
    return std::make_pair(p.major, p.minor);
  }
#endif
  return std::nullopt;
}

std::string describe_device(const c10::Device& device) {
#if defined(SHOESTRING_WITH_CUDA)
  if (device.is_cuda()) {
    const cuda_host::DeviceProperties p = cuda_host::device_properties(device.has_index() ? device.index() : 0);
    return fmt::format("{} ({}, compute {}.{}, {:.1f} GiB)", device.str(), p.name, p.major, p.minor,
                       static_cast<double>(p.total_bytes) / (1024.0 * 1024.0 * 1024.0));
  }
#endif
  return device.str();
}

}  // namespace shoestring
