// The one place where differences between libtorch versions are guarded.
// Supported: libtorch >= 1.13 (Debian 12 ships 1.13.1), CPU or CUDA.
#pragma once
#include <c10/core/ScalarType.h>
#include <torch/version.h>

#define SHOESTRING_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) || (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// Native float8 dtypes (at::kFloat8_e4m3fn, at::kFloat8_e5m2) exist from 2.1.
// Before that, F8 tensors are carried as raw bytes (uint8).
#define SHOESTRING_HAS_FLOAT8 SHOESTRING_TORCH_AT_LEAST(2, 1)

namespace shoestring::compat {
/// The one-byte dtype fp8 values of format e4m3fn (`e4m3` true) or e5m2 are
/// held in: at::kFloat8_e4m3fn / at::kFloat8_e5m2 with SHOESTRING_HAS_FLOAT8,
/// else at::kByte carrying the same bit patterns (core/fp8.h).
inline c10::ScalarType fp8_storage_dtype(bool e4m3) {
#if SHOESTRING_HAS_FLOAT8
  return e4m3 ? c10::ScalarType::Float8_e4m3fn : c10::ScalarType::Float8_e5m2;
#else
  (void)e4m3;
  return c10::ScalarType::Byte;
#endif
}
}  // namespace shoestring::compat

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

// c10d's NCCL watchdog ends a rank whose collective outlives the group's
// timeout only when NCCL_ASYNC_ERROR_HANDLING is set in 1.13 (default 0:
// hang); 2.x does by default (TORCH_NCCL_ASYNC_ERROR_HANDLING = 3).
// dist/nccl_collectives_cuda.cpp sets the variable where it must.
#define SHOESTRING_NCCL_WATCHDOG_NEEDS_ENV !SHOESTRING_TORCH_AT_LEAST(2, 0)

#include <utility>

namespace shoestring {

/// Calls torch::autograd::Function<F>::apply(args...): the same arguments,
/// result and errors. Every custom autograd function is applied through here.
///
/// Why: with GCC 14 and libtorch 2.x at -O2/-O3, Function::apply's
/// `is_variable_input_.reserve(n)` (a std::vector<bool>) trips false
/// -Warray-bounds and -Wstringop-overflow reports inside libstdc++'s word-wise
/// copy of the (empty) old bit storage, which -Werror turns into errors. The
/// header is a system header, but GCC's middle end reports inlined code anyway,
/// and a pragma around the include would be lost in the precompiled header
/// (GCC does not keep diagnostic pragmas there). GCC does check pragmas along
/// the inlining stack, so: `flatten` inlines apply (and what it calls,
/// including F::forward) into this function, whose body lies in the region
/// below, which silences those two warnings for that inlined code only; any
/// other code keeps them. libtorch 1.13 with GCC 12 does not warn here.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Warray-bounds"
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#define SHOESTRING_FLATTEN __attribute__((flatten))
#else
#define SHOESTRING_FLATTEN
#endif
template <class F, class... Args>
SHOESTRING_FLATTEN inline auto apply_autograd_function(Args&&... args) {
  return F::apply(std::forward<Args>(args)...);
}
#undef SHOESTRING_FLATTEN
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif

}  // namespace shoestring
