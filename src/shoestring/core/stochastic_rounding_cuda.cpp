// CUDA build only (see core/cuda_host.h).
#include <c10/cuda/CUDAStream.h>

#include "kernels/cuda/stochastic_rounding_cuda.h"
#include "shoestring/core/cuda_host.h"
#include "shoestring/core/error.h"

namespace shoestring::cuda_host {

void stochastic_round_into(const at::Tensor& src, at::Tensor& dst, RoundingKey key, int64_t element_offset) {
  void* stream = c10::cuda::getCurrentCUDAStream(src.device().index()).stream();
  const auto* in = static_cast<const float*>(src.data_ptr());
  auto* out = static_cast<uint16_t*>(dst.data_ptr());
  const int err =
      dst.scalar_type() == at::kBFloat16
          ? cuda::stochastic_round_bf16(in, out, src.numel(), key.seed, key.step, key.tensor_id, element_offset, stream)
          : cuda::stochastic_round_fp16(in, out, src.numel(), key.seed, key.step, key.tensor_id, element_offset,
                                        stream);
  if (err != 0) fail("stochastic_round_into: CUDA kernel launch failed (cudaError {})", err);
}

}  // namespace shoestring::cuda_host
