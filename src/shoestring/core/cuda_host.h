// Host entry points that need CUDA headers (c10/cuda, ATen/cuda), declared
// without them. They are defined in core/*_cuda.cpp, which the build compiles
// only where libtorch has CUDA (SHOESTRING_WITH_CUDA; cmake/cuda.cmake) and
// which CI compiles, without linking, wherever nvcc and the c10/cuda headers
// are present (shoestring_cuda_compile_check), so a GPU build cannot rot
// unseen. Callers guard their calls with SHOESTRING_WITH_CUDA /
// SHOESTRING_WITH_CUDA_KERNELS.
#pragma once
#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

#include "shoestring/core/stochastic_rounding.h"

namespace shoestring::cuda_host {

/// What the run log and the precision choice need of a CUDA device.
struct DeviceProperties {
  std::string name;          ///< "NVIDIA H200"
  int major = 0, minor = 0;  ///< compute capability
  int64_t total_bytes = 0;   ///< device memory
};

/// at::cuda::getDeviceProperties(index) (core/device_cuda.cpp).
DeviceProperties device_properties(int index);

/// Makes CUDA device `index` this thread's current device
/// (c10::cuda::set_device; core/device_cuda.cpp): kernels and streams that
/// take the current device then use the rank's own GPU.
void set_device(int index);

/// Stochastic rounding of the fp32 CUDA tensor `src` into the bf16 / fp16
/// CUDA tensor `dst` (both contiguous, same numel) by kernels/cuda on the
/// current stream, with the bits of the CPU path (core/stochastic_rounding_bits.h).
/// Throws shoestring::Error when the kernel launch fails
/// (core/stochastic_rounding_cuda.cpp).
void stochastic_round_into(const at::Tensor& src, at::Tensor& dst, RoundingKey key, int64_t element_offset);

}  // namespace shoestring::cuda_host
