// CUDA stochastic rounding fp32 -> bf16 / fp16 on raw device pointers: the
// same bit rules (src/shoestring/core/stochastic_rounding_bits.h) and the same
// counter-based random bits (src/shoestring/core/counter_rng.h) as the CPU
// path, so a tensor rounded on the GPU is bit-identical to the CPU result for
// the same (seed, step, tensor_id, element_offset). Built into the static
// library shoestring_cuda_kernels when CMake finds nvcc; this header has no
// CUDA or libtorch dependency so host code can include it anywhere.
#pragma once
#include <cstdint>

namespace shoestring {
namespace cuda {

/// dst[i] <- SR_bf16(src[i]) for i in [0, n), using random bits number
/// (element_offset + i) of the stream of (seed, step, tensor_id).
/// src: n float32 values in device memory; dst: n bfloat16 bit patterns
/// (uint16) in device memory, not overlapping src. `stream` is a cudaStream_t
/// (nullptr = default stream); the launch is asynchronous.
/// Returns the cudaError_t of the launch as an int (0 = cudaSuccess); n <= 0
/// launches nothing and returns 0.
int stochastic_round_bf16(const float* src, uint16_t* dst, int64_t n, uint64_t seed, uint64_t step, uint64_t tensor_id,
                          int64_t element_offset, void* stream);

/// As stochastic_round_bf16, to IEEE fp16 bit patterns (uint16).
int stochastic_round_fp16(const float* src, uint16_t* dst, int64_t n, uint64_t seed, uint64_t step, uint64_t tensor_id,
                          int64_t element_offset, void* stream);

}  // namespace cuda
}  // namespace shoestring
