// The one place where differences between libtorch versions are guarded.
// Supported: libtorch >= 1.13 (Debian 12 ships 1.13.1), CPU or CUDA.
#pragma once
#include <torch/version.h>

#define SHOESTRING_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// Native float8 dtypes (at::kFloat8_e4m3fn, at::kFloat8_e5m2) exist from 2.1.
// Before that, F8 tensors are carried as raw bytes (uint8).
#define SHOESTRING_HAS_FLOAT8 SHOESTRING_TORCH_AT_LEAST(2, 1)

// c10::Allocator: from 2.3, allocate() is non-const and copy_data() is a pure
// virtual that every allocator must implement (1.13: allocate() const, no
// copy_data).
#define SHOESTRING_ALLOCATOR_API_2_3 SHOESTRING_TORCH_AT_LEAST(2, 3)

// Fused scaled-dot-product attention (at::scaled_dot_product_attention): from
// 2.0, with the `scale` argument (our 1/sqrt(d) is folded into the query
// projection, so we pass scale = 1) from 2.1. Before: nn/chunked_attention.h's paths.
#define SHOESTRING_HAS_SDPA SHOESTRING_TORCH_AT_LEAST(2, 1)

// CUDA caching allocator: attachAllocatorTraceTracker (a callback on every
// allocation and free) exists from 2.1 (core/memory_ledger_cuda.cpp).
#define SHOESTRING_HAS_CUDA_TRACE_TRACKER SHOESTRING_TORCH_AT_LEAST(2, 1)
