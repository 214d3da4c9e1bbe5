// Shared helpers of the CUDA tests (tests/cuda, built only in the CUDA build
// and compile-checked elsewhere): skipping without a device, moving tensors,
// comparing bit patterns.
#pragma once
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <string>

namespace shoestring::testing {

/// GTEST_SKIP()s the calling test when libtorch sees no CUDA device.
#define SHOESTRING_REQUIRE_CUDA()                                               \
  do {                                                                          \
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device present"; \
  } while (0)

/// The same tensor on cuda:0 (a copy).
inline at::Tensor on_cuda(const at::Tensor& t) { return t.to(at::Device(at::kCUDA, 0)); }

/// t's elements as integers of the same width (bit patterns), on the CPU.
inline at::Tensor bits_of(const at::Tensor& t) {
  const at::Tensor c = t.to(at::kCPU).contiguous();
  switch (c.element_size()) {
    case 1: return c.view(at::kByte);
    case 2: return c.view(at::kShort);
    case 4: return c.view(at::kInt);
    default: return c.view(at::kLong);
  }
}

/// Empty when a (on any device) and b hold the same bit patterns, dtype and
/// shape; otherwise a message naming `what`, the mismatch count and the first
/// mismatching index.
inline std::string bit_difference(const at::Tensor& a, const at::Tensor& b, const std::string& what) {
  if (a.scalar_type() != b.scalar_type()) return what + ": dtypes differ";
  if (a.sizes() != b.sizes()) return what + ": shapes differ";
  const at::Tensor ne = bits_of(a).reshape({-1}).ne(bits_of(b).reshape({-1}));
  const int64_t count = ne.sum().item<int64_t>();
  if (count == 0) return "";
  const int64_t first = ne.nonzero()[0][0].item<int64_t>();
  return what + ": " + std::to_string(count) + " of " + std::to_string(a.numel()) +
         " elements differ in their bits, first at flat index " + std::to_string(first);
}

}  // namespace shoestring::testing
