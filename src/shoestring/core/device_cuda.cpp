// CUDA build only (see core/cuda_host.h).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAFunctions.h>

#include "shoestring/core/cuda_host.h"

namespace shoestring::cuda_host {

DeviceProperties device_properties(int index) {
  const cudaDeviceProp* p = at::cuda::getDeviceProperties(index);
  DeviceProperties d;
  d.name = p->name;
  d.major = p->major;
  d.minor = p->minor;
  d.total_bytes = static_cast<int64_t>(p->totalGlobalMem);
  return d;
}

void set_device(int index) { c10::cuda::set_device(static_cast<c10::DeviceIndex>(index)); }

}  // namespace shoestring::cuda_host
