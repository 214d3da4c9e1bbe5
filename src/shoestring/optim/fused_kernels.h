// Fused, single-pass CPU optimizer steps.
//
// The op-chain form of one AdamW step (mul_, add_, addcmul_, sqrt, div, add_,
// addcdiv_, dtype conversions, stochastic rounding of three tensors) walks the
// parameter's memory about ten times. These kernels read param, grad and
// state once and write param and state once per element, so a step runs close
// to memory bandwidth (bench/optimizer_memory measures the ratio to memcpy).
//
// Numerics: every element is computed in fp32 with the operation order and
// the fp32 constants of the op chain, and with the fused multiply-adds that
// libtorch's x86-64 CPU kernels execute: add_(x, alpha) is
// vec::fmadd(x, alpha, self), and addcmul_'s self + (value * t1) * t2 is
// contracted into fma(value * t1, t2, self) by GCC (libtorch is built in GNU
// mode, where -ffp-contract=fast also fuses the SIMD intrinsics' * and +);
// addcdiv_ has no multiply-add to fuse. Measured against Debian's libtorch
// 1.13 (AVX-512 kernels): bit-identical fp32 results (tests/optim/
// test_fused_kernels.cpp), so bf16 outputs are the same stochastic rounding,
// with the same random bits (core/counter_rng.h, keyed by RoundingKey and the
// element's index in the tensor), as stochastic_round_into of the op chain's
// fp32 value. A libtorch without FMA kernels (or built without contraction)
// differs from these kernels by rounding in the last fp32 bit of some
// elements. Results do not depend on the thread count.
//
// Layout: the inner loops are branch-free loops over contiguous arrays,
// compiled at -O3 with fp contraction off, and on GCC/x86-64 also for
// x86-64-v3 (AVX2 + FMA) and x86-64-v4 (AVX-512), picked at run time by
// fused_kernels_isa() (the CPU's best, lowered by fused_kernels_limit_isa).
// The AdamW8bit kernel, whose table look-ups GCC does not vectorize, has
// AVX-512 and AVX2 variants written with intrinsics (permutes and gathers);
// every variant gives the same bits.
//
// Threads: a step's elements are cut into chunks of at most 16384 elements
// that the intra-op threads take one at a time inside one parallel region
// (at::parallel_for); the *_many functions put many tensors' chunks into one
// region (a multi-tensor apply, as PyTorch's foreach / fused optimizers), so
// a model of a thousand small tensors does not pay a thousand region starts.
// Results never depend on the thread count or on which thread ran a chunk.
#pragma once
#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "shoestring/core/stochastic_rounding.h"

namespace shoestring {

/// Scalars of one AdamW step (torch.optim.AdamW semantics, amsgrad off).
struct FusedAdamWScalars {
  double lr = 1e-3;           ///< learning rate of this step
  double beta1 = 0.9;         ///< first-moment decay
  double beta2 = 0.999;       ///< second-moment decay
  double eps = 1e-8;          ///< added to sqrt(v_hat) (outside the square root)
  double weight_decay = 0.0;  ///< decoupled: p <- p (1 - lr wd) before the Adam update
  int64_t step = 1;           ///< 1-based step number t (bias corrections 1 - beta^t)
  double grad_scale = 1.0;    ///< the gradient is multiplied by this first (1 = none)
};

/// How a fused kernel stores low-precision (bf16) tensors.
/// Parameter: stochastic rounding with key `param` when `stochastic_rounding`,
/// else round-to-nearest-even (as Tensor::copy_). State tensors are always
/// stochastically rounded, with `state1` (exp_avg) and `state2` (exp_avg_sq).
/// Optimizer uses tensor ids index*16 (param) and index*16 + slot (state).
struct FusedRoundingKeys {
  bool stochastic_rounding = true;
  RoundingKey param;
  RoundingKey state1;
  RoundingKey state2;
};

/// True when fused_adamw_step can run on these tensors: all defined, on the
/// CPU, strided and contiguous, with the same numel; param, exp_avg and
/// exp_avg_sq float32 or bfloat16; grad float32 or bfloat16. (Anything else,
/// e.g. fp16 or a non-contiguous view, takes the op-chain path.)
bool fused_adamw_supported(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                           const at::Tensor& exp_avg_sq);

/// One AdamW step in one pass over memory, in place on param, exp_avg and
/// exp_avg_sq (all of numel n; shapes are not compared). Per element, in fp32:
///   g  = grad * grad_scale
///   p  = p * (1 - lr wd)
///   m  = fma(g, 1 - b1, m * b1)
///   v  = fma((1 - b2) g, g, v * b2)
///   p  = p + (-lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps)
/// with every constant rounded to fp32 once, as libtorch does for a Scalar
/// argument; then p, m, v are stored (fp32, or bf16 rounded as `keys` says).
/// The tensors must not overlap. Bumps the autograd version counter of every
/// tensor written, like an in-place op. Runs in chunks of 16384 elements
/// taken by the intra-op threads in one parallel region (on the calling
/// thread below 262144 elements); results are identical for any thread count.
/// Throws shoestring::Error when !fused_adamw_supported(...), naming what is
/// wrong.
void fused_adamw_step(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                      const FusedAdamWScalars& scalars, const FusedRoundingKeys& keys);

/// One tensor of fused_adamw_step_many: the arguments of fused_adamw_step
/// (tensor handles; the data they share is updated).
struct FusedAdamWTensor {
  at::Tensor param, grad, exp_avg, exp_avg_sq;
  FusedAdamWScalars scalars;
  FusedRoundingKeys keys;
};

/// fused_adamw_step on every entry of `tensors` (each with its own scalars and
/// keys) in one parallel region: the same bits as calling fused_adamw_step on
/// each, in any order. Every entry is checked first: throws shoestring::Error
/// naming the first unsupported one (its position and what is wrong) before
/// any tensor is written. No two entries may share memory.
void fused_adamw_step_many(const std::vector<FusedAdamWTensor>& tensors);

/// Scalars of one Lion step (Chen et al. 2023, arXiv 2302.06675).
struct FusedLionScalars {
  double lr = 1e-4;           ///< learning rate of this step
  double beta1 = 0.9;         ///< interpolation for the update direction
  double beta2 = 0.99;        ///< momentum decay
  double weight_decay = 0.0;  ///< decoupled
  double grad_scale = 1.0;    ///< the gradient is multiplied by this first (1 = none)
};

/// True when fused_lion_step can run: param, grad, exp_avg defined, CPU,
/// contiguous, same numel, each float32 or bfloat16.
bool fused_lion_supported(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg);

/// One Lion step in one pass, in place on param and exp_avg. Per element, in
/// fp32 (the op order of optim/lion.cpp's op chain and of lion-pytorch):
///   g = grad * grad_scale
///   p = p * (1 - lr wd)
///   c = fma(g, 1 - b1, m * b1);  p = p - lr * sign(c)   (sign(0) = sign(NaN) = 0, as torch.sign)
///   m = fma(g, 1 - b2, m * b2)
/// then stores p (keys.param / stochastic_rounding as for AdamW) and m
/// (bf16: SR with keys.state1). keys.state2 is unused. Same threading,
/// version-counter and error behaviour as fused_adamw_step.
void fused_lion_step(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg, const FusedLionScalars& scalars,
                     const FusedRoundingKeys& keys);

/// One tensor of fused_lion_step_many: the arguments of fused_lion_step.
struct FusedLionTensor {
  at::Tensor param, grad, exp_avg;
  FusedLionScalars scalars;
  FusedRoundingKeys keys;
};

/// fused_lion_step on every entry of `tensors` in one parallel region, with
/// the checks, errors and results of fused_adamw_step_many.
void fused_lion_step_many(const std::vector<FusedLionTensor>& tensors);

/// True when fused_adamw8bit_step can run: param and grad defined, CPU,
/// contiguous, same numel, each float32 or bfloat16; exp_avg_q and
/// exp_avg_sq_q contiguous CPU uint8 of that numel; the absmax tensors
/// contiguous CPU float32 of ceil(numel / block_size) elements; block_size
/// >= 1. (fp16 parameters or gradients take AdamW8bit's generic path.)
bool fused_adamw8bit_supported(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg_q,
                               const at::Tensor& exp_avg_absmax, const at::Tensor& exp_avg_sq_q,
                               const at::Tensor& exp_avg_sq_absmax, int64_t block_size);

/// One 8-bit AdamW step (optim/adamw8bit.h: Dettmers et al. 2021, arXiv
/// 2110.02861, bitsandbytes' block-wise AdamW8bit) in one pass over memory,
/// in place on param and the four state tensors. The moments are stored as
/// codes of the signed (exp_avg) and unsigned (exp_avg_sq) dynamic maps of
/// optim/quantization.h times a per-block absmax (blocks of block_size
/// elements over the flattened tensor, the last one possibly short). Per
/// block: decode m and v (map value * absmax), then per element in fp32
///   g  = grad * grad_scale
///   p1 = p * (1 - lr wd)
///   m1 = fma(g, 1 - b1, m * b1)
///   v1 = v * b2 + ((1 - b2) g) g            (two roundings, no fma)
///   p2 = p1 + ((-lr / (1 - b1^t)) m1) / (sqrt(v1) / sqrt(1 - b2^t) + eps)
/// (constants rounded to fp32 once); when g, m1, v1 or p2 is not finite the
/// element keeps its parameter bits and its decoded m and v. p2 is stored as
/// fused_adamw_step stores a parameter (keys.param, keys.stochastic_rounding;
/// keys.state1/state2 are unused: codes are not randomly rounded). Then each
/// block's new absmax is max |m| (resp. |v|) and every code is the map value
/// nearest to m / absmax (m * (1 / absmax), as quantize_block). The result is
/// the same, bit for bit, as AdamW8bit's generic per-element path. Blocks run
/// in chunks of whole blocks (about 16384 elements) in one parallel region;
/// results do not depend on the thread count. On CPUs
/// with AVX-512 (F, BW, DQ, VL) 16 elements are processed at a time (register
/// permutes to decode, a gather from QuantizationMap::fast_table() to encode).
/// Throws shoestring::Error when !fused_adamw8bit_supported(...) or step < 1.
void fused_adamw8bit_step(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg_q, at::Tensor& exp_avg_absmax,
                          at::Tensor& exp_avg_sq_q, at::Tensor& exp_avg_sq_absmax, int64_t block_size,
                          const FusedAdamWScalars& scalars, const FusedRoundingKeys& keys);

/// One tensor of fused_adamw8bit_step_many: the arguments of
/// fused_adamw8bit_step.
struct FusedAdamW8bitTensor {
  at::Tensor param, grad, exp_avg_q, exp_avg_absmax, exp_avg_sq_q, exp_avg_sq_absmax;
  int64_t block_size = 256;
  FusedAdamWScalars scalars;
  FusedRoundingKeys keys;
};

/// fused_adamw8bit_step on every entry of `tensors` in one parallel region
/// (chunks of whole quantization blocks), with the checks, errors and results
/// of fused_adamw_step_many.
void fused_adamw8bit_step_many(const std::vector<FusedAdamW8bitTensor>& tensors);

/// Scalars of one factored Adafactor step (optim/adafactor.h).
struct FusedAdafactorScalars {
  double beta2t = 0.0;          ///< second-moment decay of this step, 1 - t^decay_rate
  double eps1 = 1e-30;          ///< added to g^2
  double clip_threshold = 1.0;  ///< d: U <- U / max(1, RMS(U) / d)
  double step_size = 1e-3;      ///< a_t
  double weight_decay = 0.0;    ///< decoupled: p <- p - wd a_t p
};

/// One Adafactor step (Shazeer & Stern 2018, arXiv 1804.04235; semantics of
/// optim/adafactor.h, i.e. transformers' Adafactor) for a factored tensor
/// without first moment, with the gradient viewed as the row-major matrix
/// g [n, m], in two passes over g (the second together with the weights),
/// with no full-size temporary and no per-tensor libtorch op:
///  1. per row i: row_sum_i = sum_j (g_ij^2 + eps1), each term rounded to
///     fp32 as grad.square().add_(eps1), summed in fp32 lanes of at most 64
///     terms flushed into double; R_i <- fma(row_sum_i / m, 1 - beta2t,
///     R_i beta2t) (fp32, the fused multiply-add of libtorch's add_(x,
///     alpha)); then col_sum[j] += g_ij^2 + eps1 and W_j += g_ij^2 / R_i.
///     After all rows: C_j likewise from col_sum; r_i = 1 / sqrt(R_i /
///     mean(R)), c_j = 1 / sqrt(C_j) (fp32; mean in double); the sum of
///     squares of the unclipped update is S = sum_ij (r_i c_j g_ij)^2 =
///     mean(R) sum_j W_j / C_j (exact algebra; W_j summed in fp32 partials
///     of 64 rows flushed into double), clip = max(1, sqrt(S / nm) / d);
///  2. u = (((r_i c_j) g_ij) / clip) a_t; p <- (wd ? fma(p, -wd a_t, p) : p) - u,
///     stored fp32, or bf16 by stochastic rounding with keys.param (round to
///     nearest when !keys.stochastic_rounding).
/// The sums are more accurate than libtorch's fp32 means, so results match
/// the op chain to rounding, not bit for bit. param, grad: float32 or
/// bfloat16, contiguous CPU, n m elements; exp_avg_sq_row: float32 [n],
/// exp_avg_sq_col: float32 [m], contiguous CPU (updated in place). Both
/// passes run in one parallel region (the thread that finishes the last
/// pass-1 chunk computes the factors, then pass 2 starts; on the calling
/// thread below 262144 elements), over row chunks fixed by the shape (pass 1:
/// at least 64 rows and 16384 elements, at most 64 chunks): results do not
/// depend on the thread count. Throws shoestring::Error naming the tensor
/// that is not as described.
void fused_adafactor_factored_step(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg_sq_row,
                                   at::Tensor& exp_avg_sq_col, int64_t n, int64_t m,
                                   const FusedAdafactorScalars& scalars, const FusedRoundingKeys& keys);

/// True when fused_adafactor_unfactored_step can run: param, grad and
/// exp_avg_sq defined, CPU, contiguous, of one numel, each float32 or bfloat16.
bool fused_adafactor_unfactored_supported(const at::Tensor& param, const at::Tensor& grad,
                                          const at::Tensor& exp_avg_sq);

/// One Adafactor step (optim/adafactor.h; Shazeer & Stern 2018, arXiv
/// 1804.04235, as transformers' Adafactor) for an unfactored tensor (a
/// vector) without first moment, the same bits as Adafactor's op chain: per
/// element in fp32,
///   v = fma(g g + eps1, 1 - beta2t, v beta2t);  u = (1 / sqrt(v)) g
/// (v stored: fp32, or bf16 by stochastic rounding with keys.state1), then
/// RMS(u) = ||u||_2 / sqrt(n) taken by at::norm on the fp32 update (the op
/// chain's reduction), clip = max(1, RMS / d), and
///   p <- (wd ? fma(p, -wd a_t, p) : p) - (u / clip) a_t
/// stored as fused_adamw_step stores a parameter (keys.param). One fp32
/// buffer of n elements; runs on the calling thread (vectors are small).
/// Throws shoestring::Error when !fused_adafactor_unfactored_supported(...).
void fused_adafactor_unfactored_step(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg_sq,
                                     const FusedAdafactorScalars& scalars, const FusedRoundingKeys& keys);

/// Scalars of one SPARKLES step (optim/sparkles.h has the formulas and the
/// meaning of each; rakki194/SPARKLES sparkles.py with the fixes of
/// docs/optimizers/sparkles.md).
struct FusedSparklesScalars {
  double lr = 1e-3;                    ///< learning rate of this step
  int64_t step = 1;                    ///< 1-based step t (bias corrections; permutation only for t > 1)
  double beta1 = 0.9, beta2 = 0.999;   ///< moment decays
  double eps = 1e-8;                   ///< added to the bias-corrected sqrt(v)
  double weight_decay = 0.0;           ///< coupled (g + wd p) unless decouple_weight_decay
  bool decouple_weight_decay = false;  ///< p (1 - s wd) instead
  double centralization = 0.5;         ///< c: g - c mean(g over dims >= 1), tensors of >= 2 dims
  double normalization = 0.5;          ///< a: interpolation towards g / (std(g) + 1e-8)
  bool normalize_channels = true;      ///< std per slice of dim 0 (else of the whole tensor)
  double amp_fac = 2.0;                ///< amplification of the first moment
  bool clip_gradients = false;         ///< clamp the update to +-t^0.25
  double stochastic_threshold = 1e-6;  ///< permute when ||gh - prev_grad||_2 < this (0 = never)
  double grad_scale = 1.0;             ///< the gradient is multiplied by this first (1 = none)
};

/// Rounding keys of a SPARKLES step: the parameter as FusedRoundingKeys
/// says; the three states (bf16: always stochastic rounding) with their own.
struct FusedSparklesKeys {
  bool stochastic_rounding = true;
  RoundingKey param, ema, ema_squared, prev_grad;
};

/// True when fused_sparkles_step_many can take these tensors: param, grad,
/// ema, ema_squared, prev_grad defined, CPU, strided and contiguous, of one
/// numel; param and grad float32 or bfloat16; the three states float32, or
/// all three bfloat16.
bool fused_sparkles_supported(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& ema,
                              const at::Tensor& ema_squared, const at::Tensor& prev_grad);

/// One tensor of fused_sparkles_step_many.
struct FusedSparklesTensor {
  at::Tensor param, grad, ema, ema_squared, prev_grad;
  FusedSparklesScalars scalars;
  FusedSparklesKeys keys;
};

/// One SPARKLES step (optim/sparkles.h) of each entry's `param` in two passes
/// over memory instead of the op chain's ~20, with no full-size temporary.
/// Slices are those of dim 0 for tensors of >= 2 dims (the whole tensor is one
/// slice for vectors and scalars); grad is read in param's shape.
///  Pass 1, per slice (in cache): mean and unbiased variance of the gradient
///  (fp32 partials added into double), hence the centralization c mean_r and
///  the normalization factor f = (1 - a) + a / (std + 1e-8) (per slice, or
///  of the whole tensor from the slices' moments, Chan et al. 1979); when
///  t > 1 and the threshold is > 0, also ||gh - prev_grad||^2 with gh as
///  pass 2 will compute it (a pass of its own, after the whole tensor's
///  factor, when the normalization is global over several slices:
///  normalize_channels off, or slices of one element such as [N, 1]).
///  Pass 2, per element in fp32: g = ((g grad_scale - c mean) f) [+ wd p coupled];
///  m = fma(g, 1 - b1, m b1); gh = fma(m, amp, g);
///  v = fma((1 - b2) gh, gh, v b2); u = gh / (sqrt(v) / sqrt(1 - b2^t) + eps)
///  * lr / (1 - b1^t) [clamped]; p = p [(1 - s wd)] - u; prev_grad = gh;
///  stored as fused_adamw_step stores (keys: param, ema, ema_squared, prev_grad).
/// Differences from the op chain (Sparkles::update's generic path): the
/// interpolation is g f rather than at::lerp(g, g / s, a), and the sums are
/// more accurate than libtorch's fp32 reductions: results match it to fp32
/// rounding, not bit for bit (tests/optim/test_device_generic.cpp). Without
/// coupled weight decay the weight does not enter g (its bits are masked), so
/// an inf weight stays out of the state as on the op chain.
/// Entry i of the result is false, that entry left unwritten, when its
/// permutation criterion holds (||gh - prev_grad|| < threshold at t > 1): the
/// caller then runs the op chain, which permutes.
/// Every entry's passes share one parallel region (multi-tensor apply; three
/// regions when an entry needs the change-norm pass of its own; on the calling
/// thread below 262144 elements' worth of work). Chunks are fixed by the
/// shapes, so results do not depend on the thread count or the instruction
/// set. Every entry is checked first: throws shoestring::Error naming the
/// first unsupported one (!fused_sparkles_supported) before any tensor is
/// written. No two entries may share memory.
std::vector<bool> fused_sparkles_step_many(const std::vector<FusedSparklesTensor>& tensors);

/// The instruction sets every fused kernel is built for, in order: portable
/// (baseline x86-64 or any other target), avx2 (x86-64-v3: AVX2 + FMA) and
/// avx512 (x86-64-v4); AdamW8bit's avx2 and avx512 kernels are written with
/// intrinsics, the others compiled from the same loops.
enum class FusedKernelIsa { portable, avx2, avx512 };

/// For tests and benchmarks: the kernels use at most `isa` (and never more
/// than the CPU has); every variant gives the same bits. Default avx512, i.e.
/// the best the CPU supports. Process-wide.
void fused_kernels_limit_isa(FusedKernelIsa isa);

/// The instruction set the fused kernels use now: avx512 on a CPU with
/// x86-64-v4 (AVX-512 F, BW, CD, DQ, VL), avx2 with x86-64-v3 (AVX2, FMA,
/// BMI1/2, F16C, ...), else portable (always portable where the kernels are
/// not built for several: compilers other than GCC, other architectures),
/// at most the fused_kernels_limit_isa limit.
FusedKernelIsa fused_kernels_isa();

/// "avx512", "avx2" or "portable".
const char* fused_kernel_isa_name(FusedKernelIsa isa);

}  // namespace shoestring
