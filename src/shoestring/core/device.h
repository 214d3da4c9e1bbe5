// Where a run computes: the `device` config key / `--device` flag, parsed and
// resolved in one place.
//
// Values: "auto" (the first CUDA device when libtorch has CUDA and one is
// present, else the CPU), "cpu", "cuda" (= "cuda:0"), "cuda:N". Resolution
// checks what is there before any work, and says why a CUDA request cannot
// be met: libtorch built without CUDA, no CUDA device visible, or an index
// beyond the devices present.
//
// Also here: whether a CUDA device computes bf16 natively (compute capability
// >= 8.0, Ampere and later), which decides the fp16 fallback of
// precision_for_device (train/), and the one-line description of a device the
// run log prints. The capability query needs CUDA headers; it is compiled
// only when SHOESTRING_WITH_CUDA is defined (a libtorch with CUDA), and
// returns nothing otherwise.
#pragma once
#include <optional>
#include <string>

#include <c10/core/Device.h>

namespace shoestring {

/// A parsed device setting (not yet checked against the machine).
struct DeviceSetting {
  enum class Kind { automatic, cpu, cuda };
  Kind kind = Kind::automatic;
  int index = 0;  ///< CUDA device index (Kind::cuda only; "cuda" is 0)
};

/// What this process can use: whether libtorch was built with CUDA and how
/// many CUDA devices it sees.
struct CudaAvailability {
  bool built_with_cuda = false;
  int device_count = 0;
};

/// Parses `text` ("auto", "cpu", "cuda", "cuda:N" with N a decimal index).
/// `source` names where it came from in errors (e.g. "device" for the
/// config key, "--device" for the flag). Throws shoestring::Error naming
/// `source`, the value and the accepted forms.
DeviceSetting parse_device(const std::string& text, const std::string& source);

/// The CUDA availability of this process (libtorch's CUDA backend registered;
/// torch::cuda::device_count()).
CudaAvailability cuda_availability();

/// The device `setting` means on a machine with `cuda`: automatic gives
/// cuda:0 when cuda.built_with_cuda and cuda.device_count > 0, else the CPU.
/// Throws shoestring::Error for a CUDA request that cannot be met, naming
/// `source`, `text` (the value as given) and the reason: "libtorch was built
/// without CUDA", "no CUDA device is visible", or "cuda:N but only K
/// device(s)".
c10::Device resolve_device(const DeviceSetting& setting, const CudaAvailability& cuda, const std::string& text,
                           const std::string& source);

/// parse_device then resolve_device against cuda_availability().
c10::Device resolve_device(const std::string& text, const std::string& source);

/// CUDA compute capability (major, minor) of `device`, or nullopt for a
/// non-CUDA device or a build without SHOESTRING_WITH_CUDA.
std::optional<std::pair<int, int>> cuda_compute_capability(const c10::Device& device);

/// True when a CUDA device of compute capability major.minor has native bf16
/// arithmetic (>= 8.0). Pure; testable without a GPU.
bool cuda_capability_has_bf16(int major, int minor);

/// One line for the run log: "cpu", or "cuda:0 (NVIDIA ..., compute 8.6,
/// 24.0 GiB)" where the properties are known.
std::string describe_device(const c10::Device& device);

}  // namespace shoestring
