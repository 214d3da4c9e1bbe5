// CUDA kernels for stochastic rounding; see stochastic_rounding_cuda.h.
// One thread per element in a grid-stride loop; the random bits depend only on
// the element's global index (counter_random16: four neighbours share one
// hash, recomputed per thread), so the launch configuration does not matter.
#include "kernels/cuda/stochastic_rounding_cuda.h"

#include <cuda_runtime.h>

#include "shoestring/core/counter_rng.h"
#include "shoestring/core/stochastic_rounding_bits.h"

namespace shoestring {
namespace cuda {
namespace {

constexpr int kThreadsPerBlock = 256;
constexpr int64_t kMaxBlocks = 65535;

template <bool kToBf16>
__global__ void stochastic_round_kernel(const uint32_t* __restrict__ src, uint16_t* __restrict__ dst, int64_t n,
                                        uint64_t key, uint64_t first_index) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint32_t r = counter_random16(key, first_index + static_cast<uint64_t>(i));
    dst[i] = kToBf16 ? sr_bf16_from_fp32_bits(src[i], r) : sr_fp16_from_fp32_bits(src[i], r);
  }
}

template <bool kToBf16>
int launch(const float* src, uint16_t* dst, int64_t n, uint64_t seed, uint64_t step, uint64_t tensor_id,
           int64_t element_offset, void* stream) {
  if (n <= 0) return 0;
  const int64_t wanted = (n + kThreadsPerBlock - 1) / kThreadsPerBlock;
  const int blocks = static_cast<int>(wanted < kMaxBlocks ? wanted : kMaxBlocks);
  const uint64_t key = counter_rng_key(seed, step, tensor_id);
  stochastic_round_kernel<kToBf16><<<blocks, kThreadsPerBlock, 0, static_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const uint32_t*>(src), dst, n, key, static_cast<uint64_t>(element_offset));
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int stochastic_round_bf16(const float* src, uint16_t* dst, int64_t n, uint64_t seed, uint64_t step, uint64_t tensor_id,
                          int64_t element_offset, void* stream) {
  return launch<true>(src, dst, n, seed, step, tensor_id, element_offset, stream);
}

int stochastic_round_fp16(const float* src, uint16_t* dst, int64_t n, uint64_t seed, uint64_t step, uint64_t tensor_id,
                          int64_t element_offset, void* stream) {
  return launch<false>(src, dst, n, seed, step, tensor_id, element_offset, stream);
}

}  // namespace cuda
}  // namespace shoestring
