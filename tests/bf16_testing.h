// bf16 error bounds for tests that must hold on every x86-64 CPU.
//
// libtorch 1.13 computes a bf16 matrix product (torch::mm, bmm, convolution)
// in one of two ways, chosen by the CPU it runs on:
// - oneDNN, on CPUs with AVX-512 (BW/VL/DQ): the products of bf16 inputs are
//   exact in fp32 and summed in fp32; the sum is rounded to bf16 once;
// - libtorch's own gemm elsewhere (AVX2-only CPUs): the running sum is kept
//   in the bf16 output, so each of the K additions rounds to bf16 at the
//   magnitude of the partial sum (a linear layer's transposed-weight product
//   still sums in fp32 there).
// The first is within one bf16 rounding of the exact result; the second can
// be off by many roundings. bf16_mm_accumulates_in_fp32() tells which one
// this CPU uses, bf16_mm_error_bound() gives a per-element bound for either.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>

#include <torch/torch.h>

namespace shoestring::testing {

/// Unit roundoff of bf16 (8 significant bits, round to nearest even): a
/// rounded value is within a relative 2^-8 of the exact one.
inline constexpr double kBf16UnitRoundoff = 1.0 / 256;
/// Unit roundoff of fp32 (24 significant bits).
inline constexpr double kFp32UnitRoundoff = 1.0 / 16777216;

/// True when torch::mm of bf16 matrices sums its products in fp32 on this
/// CPU, false when it rounds the running sum to bf16 after each addition.
/// Probe: a [16, 512] x [512, 16] product of ones (large enough for oneDNN
/// where the CPU has it): each entry is 512 when summed in fp32; in bf16 the
/// sum stops at 256, where 256 + 1 lies halfway between the neighbours 256
/// and 258 and rounds to even. Computed once per process.
inline bool bf16_mm_accumulates_in_fp32() {
  static const bool fp32 = [] {
    torch::NoGradGuard no_grad;
    const torch::Tensor a = torch::ones({16, 512}, torch::kBFloat16);
    const torch::Tensor b = torch::ones({512, 16}, torch::kBFloat16);
    return torch::mm(a, b).to(torch::kFloat32).min().item<float>() == 512.0f;
  }();
  return fp32;
}

/// Per-element bound on |torch::mm(a, b) - exact| for bf16 a [M, K] and
/// b [K, N], as an fp32 [M, N] tensor, for the way this CPU sums
/// (bf16_mm_accumulates_in_fp32()). With s_l the exact partial sums
/// sum_{i<=l} a_i b_i (s_K the exact result) and u = 2^-8:
/// - fp32 sums: one rounding of the fp32 sum to bf16, u |s_K|, plus the fp32
///   summation's worst case, K 2^-24 sum_l |a_l b_l| (recursive summation,
///   Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., 4.2),
///   doubled to cover the fp32 reference's own error: a guarantee.
/// - bf16 sums: addition l rounds s_l with an error of at most half a bf16
///   spacing, <= u |s_l|, of either sign. Treated as independent and uniform
///   (standard deviation <= u |s_l| / sqrt(3)), the total error has standard
///   deviation sigma <= u sqrt(sum_l s_l^2 / 3) (the probabilistic model of
///   Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019); the bound is 6 sigma
///   plus the final rounding u |s_K|. Not a worst case (that is K u sum |a_l b_l|, as
///   large as the result itself), but exceeded with probability ~2e-9 per
///   element; on random N(0, 1) inputs the largest error seen is ~3.7 sigma
///   over 65536 entries with K from 64 to 1024.
/// Summing in a different order (blocks, pairs) gives smaller partial sums,
/// so the bound still holds. a and b are read in fp32; errors thrown: as torch::mm.
inline torch::Tensor bf16_mm_error_bound(const torch::Tensor& a, const torch::Tensor& b) {
  torch::NoGradGuard no_grad;
  const torch::Tensor a32 = a.to(torch::kFloat32), b32 = b.to(torch::kFloat32);
  const int64_t k = a32.size(1);
  const torch::Tensor exact = torch::mm(a32, b32);
  const torch::Tensor rounding = kBf16UnitRoundoff * exact.abs();
  if (bf16_mm_accumulates_in_fp32()) {
    return rounding + 2.0 * static_cast<double>(k) * kFp32UnitRoundoff * torch::mm(a32.abs(), b32.abs());
  }
  torch::Tensor partial = torch::zeros_like(exact), squares = torch::zeros_like(exact);
  for (int64_t l = 0; l < k; ++l) {
    partial += a32.narrow(1, l, 1) * b32.narrow(0, l, 1);  // [M, 1] x [1, N] -> [M, N]
    squares += partial * partial;
  }
  return rounding + 6.0 * kBf16UnitRoundoff * (squares / 3.0).sqrt();
}

/// Relative standard deviation of the error of one bf16 dot product of
/// length k with independent zero-mean terms, as this CPU sums it: one final
/// rounding, u / sqrt(3), when it sums in fp32; otherwise the k roundings of
/// the running sum (bf16_mm_error_bound): sigma / |s_k| = u sqrt(sum_l E s_l^2
/// / 3) / sqrt(E s_k^2) = u sqrt((k + 1) / 6), since E s_l^2 grows like l.
/// k >= 1.
inline double bf16_dot_relative_error(int64_t k) {
  if (bf16_mm_accumulates_in_fp32()) return kBf16UnitRoundoff / std::sqrt(3.0);
  return kBf16UnitRoundoff * std::sqrt(static_cast<double>(k + 1) / 6.0);
}

/// Longest reduction of `module`'s weights: the largest fan-in (numel / out
/// features: in_channels * kh * kw for a convolution, in_features for a
/// linear layer) over its parameters of two or more dimensions; 1 if none.
inline int64_t longest_weight_reduction(const torch::nn::Module& module) {
  int64_t k = 1;
  for (const auto& p : module.parameters()) {
    if (p.dim() >= 2 && p.size(0) > 0) k = std::max<int64_t>(k, p.numel() / p.size(0));
  }
  return k;
}

}  // namespace shoestring::testing
