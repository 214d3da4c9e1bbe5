// Stochastic rounding (SR) of fp32 tensors to bf16 / fp16, with randomness
// that is a pure function of (seed, step, tensor_id, element index).
//
// Why: a bf16 weight updated by round-to-nearest loses every update smaller
// than half its spacing (1.0 + 1e-4 stays 1.0 forever); SR keeps the
// expectation exact, so low-precision master weights / gradient accumulators
// still train (torchastic, kohya-ss, OneTrainer; llm.c for bf16 on GPU).
//
// Why counter-based: the random bits of an element depend only on the key and
// its global element index, never on thread count, chunking or call history,
// so a run resumed from a checkpoint (which stores the seed and step) rounds
// bit-identically to the uninterrupted run — llm.c's per-tensor-seed idea.
// The generator is counter_rng.h (SplitMix64 by index, one 64-bit output
// giving the 16 random bits of four consecutive elements: counter_random16);
// the bit rules are in stochastic_rounding_bits.h.
#pragma once
#include <cstdint>

#include <ATen/core/Tensor.h>

namespace shoestring {

/// Identifies one rounding event: the run's seed, the optimizer step, and a
/// stable id of the tensor (e.g. its index in the parameter list). Changing any
/// component gives an independent stream of random bits.
struct RoundingKey {
  uint64_t seed = 0;
  uint64_t step = 0;
  uint64_t tensor_id = 0;
};

/// dst <- SR(src). src: contiguous float32 tensor; dst: contiguous
/// bfloat16 or float16 tensor on the same device with the same numel (shape may differ, e.g.
/// flat chunks), not overlapping src. Element i of src uses random bits number
/// (element_offset + i) of the key's stream, where element_offset (>= 0) is the
/// global row-major index of src[0] within the logical tensor, so rounding a
/// tensor in chunks gives the same bits as rounding it at once. Runs in
/// at::parallel_for with a grain of 32768 elements; the result does not depend
/// on the number of threads. (With libtorch's OpenMP backend, parallel_for is
/// inline and only goes parallel if this file is compiled with -fopenmp.)
/// Rules: see sr_bf16_from_fp32_bits and sr_fp16_from_fp32_bits. CPU
/// tensors take that loop.
/// Tensors on another device (CUDA) take the CUDA kernel of kernels/cuda/
/// where the build links it (SHOESTRING_WITH_CUDA_KERNELS), else
/// stochastic_round_into_generic: the same bits either way.
/// Throws shoestring::Error on mismatched devices, wrong dtype, layout,
/// numel, overlap or a negative element_offset.
void stochastic_round_into(const at::Tensor& src, at::Tensor& dst, RoundingKey key, int64_t element_offset = 0);

/// stochastic_round_into built from ATen integer ops only (int64 tensors:
/// bitwise and/or/xor, shifts, multiplication and addition wrapping modulo
/// 2^64), so it runs on any device libtorch supports and gives the same bits
/// as the CPU loop, element for element. src and dst on one device, with the
/// requirements of stochastic_round_into. Works through the tensor in chunks
/// of 2^20 elements (temporaries: about 10 int64 words per chunk element).
/// Used for non-CPU tensors without a custom kernel; tests call it on CPU
/// tensors to compare with the fast loop. Throws as stochastic_round_into.
void stochastic_round_into_generic(const at::Tensor& src, at::Tensor& dst, RoundingKey key, int64_t element_offset = 0);

/// The counter-based random words of elements [first_index, first_index + n)
/// of `key`'s stream (stochastic_rounding_random_bits), computed with ATen ops
/// on `device`: int64 tensor [n] with values in [0, 2^16). first_index >= 0
/// and first_index + n must fit in int64.
at::Tensor stochastic_rounding_random_bits_tensor(RoundingKey key, int64_t first_index, int64_t n,
                                                  const c10::Device& device);

/// Returns SR(src) as a new tensor of dtype `dtype` (at::kBFloat16 or at::kHalf)
/// with src's shape, on src's device. src: float32 tensor of any layout (element indices
/// are row-major logical indices). Throws shoestring::Error as
/// stochastic_round_into, and for any other target dtype.
at::Tensor stochastic_round(const at::Tensor& src, at::ScalarType dtype, RoundingKey key);

/// Scalar SR of x to bf16 bits; `random16` is uniform in [0, 65536) (only its
/// low 16 bits are read). |x| rounds up with probability
/// (bits(x) & 0xFFFF) / 65536. For tests and reference.
uint16_t stochastic_round_bf16_bits(float x, uint32_t random16);

/// Scalar SR of x to IEEE fp16 bits; `random_bits` is uniform in [0, 65536)
/// (normal results read bits 0..12, subnormal results bits 0..15; higher bits
/// are ignored). For tests and reference.
uint16_t stochastic_round_fp16_bits(float x, uint32_t random_bits);

/// The random 16-bit word (in [0, 2^16)) that element `index` of `key` uses:
/// counter_random16 of the key's stream (four elements per SplitMix64
/// output), the exact word the tensor functions feed to the bit rules.
uint32_t stochastic_rounding_random_bits(RoundingKey key, uint64_t index);

}  // namespace shoestring
