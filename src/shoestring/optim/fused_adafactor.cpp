// The fused Adafactor step for factored (2-D) parameters (optim/fused_kernels.h).
#include "shoestring/optim/fused_kernel_support.h"

namespace shoestring {
namespace {

// ---- Adafactor (factored) ----------------------------------------------------

// Lanes of the fp32 partial sums: independent accumulators, so the compiler
// may keep them in one vector register without reassociating anything.
constexpr int kLanes = 16;
// Terms per lane before a flush into double.
constexpr int64_t kFlushTerms = 64;

struct AdafactorSumArgs {
  const void* grad;
  int64_t n, m;
  float eps1;
  float beta2t, one_minus_beta2t;
  float* row_state;  // exp_avg_sq_row, [n]: updated in place, row by row
};

// Rows [r0, r1) in one pass over the gradient: each row's mean of g^2 + eps1
// updates its exp_avg_sq_row entry R_i at once; the column sums of g^2 + eps1
// go to col_sum, and the column sums of g^2 / R_i to wcol_sum (both [m],
// double, added into per 64 rows from fp32 partials).
//
// The second sum is what makes a separate pass for the update's RMS
// unnecessary: with U_ij = g_ij / sqrt(R_i C_j / mean(R)) (the factored
// update before clipping, Shazeer & Stern 2018, Algorithm 4),
//   sum_ij U_ij^2 = mean(R) * sum_j (sum_i g_ij^2 / R_i) / C_j,
// and R_i is final as soon as row i has been read, while C_j only scales the
// finished column sums. The row's squares are kept in an m-float buffer (in
// cache) between the row sum and the weighted column sum.
template <typename G>
SHOESTRING_ALWAYS_INLINE void adafactor_rows(const AdafactorSumArgs& a, int64_t r0, int64_t r1,
                                             double* __restrict col_sum, double* __restrict wcol_sum,
                                             float* __restrict col_part, float* __restrict wcol_part,
                                             float* __restrict sq) {
  const G* __restrict g_ptr = static_cast<const G*>(a.grad);
  const int64_t m = a.m;
  const float eps1 = a.eps1;
  int64_t rows_in_part = 0;
  bool first_flush = true;  // col_sum / wcol_sum are written, not added to, at the first flush
  for (int64_t j = 0; j < m; ++j) {
    col_part[j] = 0.0f;
    wcol_part[j] = 0.0f;
  }
  for (int64_t i = r0; i < r1; ++i) {
    const G* __restrict row = g_ptr + i * m;
    double row_total = 0.0;
    int64_t j = 0;
    while (j < m) {
      const int64_t chunk_end = std::min(m, j + kLanes * kFlushTerms);
      float lane[kLanes] = {};
      for (; j + kLanes <= chunk_end; j += kLanes) {
        for (int k = 0; k < kLanes; ++k) {
          const float g = load(row, j + k);
          const float g2 = g * g;
          const float x = g2 + eps1;
          sq[j + k] = g2;
          col_part[j + k] += x;
          lane[k] += x;
        }
      }
      double part = 0.0;
      for (int k = 0; k < kLanes; ++k) part += lane[k];
      for (; j < chunk_end; ++j) {  // last < kLanes elements of the row
        const float g = load(row, j);
        const float g2 = g * g;
        const float x = g2 + eps1;
        sq[j] = g2;
        col_part[j] += x;
        part += x;
      }
      row_total += part;
    }
    const auto mean = static_cast<float>(row_total / static_cast<double>(m));
    const float r_new = fma_f32(mean, a.one_minus_beta2t, a.row_state[i] * a.beta2t);
    a.row_state[i] = r_new;
    const float w = 1.0f / r_new;
    for (int64_t c = 0; c < m; ++c) wcol_part[c] += w * sq[c];
    if (++rows_in_part == kFlushTerms || i + 1 == r1) {
      if (first_flush) {
        for (int64_t c = 0; c < m; ++c) {
          col_sum[c] = col_part[c];
          wcol_sum[c] = wcol_part[c];
          col_part[c] = 0.0f;
          wcol_part[c] = 0.0f;
        }
      } else {
        for (int64_t c = 0; c < m; ++c) {
          col_sum[c] += col_part[c];
          wcol_sum[c] += wcol_part[c];
          col_part[c] = 0.0f;
          wcol_part[c] = 0.0f;
        }
      }
      first_flush = false;
      rows_in_part = 0;
    }
  }
}

using AdafactorRowsFn = void (*)(const AdafactorSumArgs&, int64_t, int64_t, double*, double*, float*, float*, float*);
#define SHOESTRING_AF_SUMS(NAME, TARGET, G)                                                                    \
  TARGET void NAME(const AdafactorSumArgs& a, int64_t r0, int64_t r1, double* cs, double* ws, float* cp, float* wp, \
                   float* sq) {                                                                                \
    adafactor_rows<G>(a, r0, r1, cs, ws, cp, wp, sq);                                                          \
  }
SHOESTRING_AF_SUMS(adafactor_sums_f32_v4, SHOESTRING_TARGET_V4, float)
SHOESTRING_AF_SUMS(adafactor_sums_f32_v3, SHOESTRING_TARGET_V3, float)
SHOESTRING_AF_SUMS(adafactor_sums_f32_base, , float)
SHOESTRING_AF_SUMS(adafactor_sums_b16_v4, SHOESTRING_TARGET_V4, bf16_bits)
SHOESTRING_AF_SUMS(adafactor_sums_b16_v3, SHOESTRING_TARGET_V3, bf16_bits)
SHOESTRING_AF_SUMS(adafactor_sums_b16_base, , bf16_bits)
#undef SHOESTRING_AF_SUMS
constexpr IsaKernels<AdafactorRowsFn> kAdafactorSums[2] = {
    {adafactor_sums_f32_v4, adafactor_sums_f32_v3, adafactor_sums_f32_base},
    {adafactor_sums_b16_v4, adafactor_sums_b16_v3, adafactor_sums_b16_base}};

struct AdafactorApplyArgs {
  void* param;
  const void* grad;
  int64_t m;
  const float* r_factor;
  const float* c_factor;
  float clip, step_size, decay_alpha;
  bool decay;
  uint64_t param_key;
};

template <typename P, typename G, Rounding kParamRounding>
SHOESTRING_ALWAYS_INLINE void adafactor_apply_rows(const AdafactorApplyArgs& a, int64_t r0, int64_t r1) {
  P* __restrict p_ptr = static_cast<P*>(a.param);
  const G* __restrict g_ptr = static_cast<const G*>(a.grad);
  const int64_t m = a.m;
  StoreWords<P, kParamRounding> p_words;
  for (int64_t i = r0; i < r1; ++i) {
    const float r = a.r_factor[i];
    const int64_t base = i * m;
    for (int64_t j0 = 0; j0 < m; j0 += kRandom16BlockSize) {
      const int64_t len = std::min(kRandom16BlockSize, m - j0);
      p_words.fill(a.param_key, base + j0, len);
      SHOESTRING_LOOP_NO_ALIAS
      for (int64_t k = 0; k < len; ++k) {
        const int64_t j = j0 + k;
        const int64_t e = base + j;
        const float u = (((r * a.c_factor[j]) * load(g_ptr, e)) / a.clip) * a.step_size;
        float p = load(p_ptr, e);
        const float p1 = fma_f32(p, a.decay_alpha, p);
        p = a.decay ? p1 : p;
        store(p_ptr, e, p - u, p_words[k], kParamRounding);
      }
    }
  }
}

using AdafactorApplyFn = void (*)(const AdafactorApplyArgs&, int64_t, int64_t);
#define SHOESTRING_AF_VARIANT(NAME, P, G, R)                                                                         \
  SHOESTRING_TARGET_V4 void NAME##_v4(const AdafactorApplyArgs& a, int64_t r0, int64_t r1) {                         \
    adafactor_apply_rows<P, G, R>(a, r0, r1);                                                                        \
  }                                                                                                                  \
  SHOESTRING_TARGET_V3 void NAME##_v3(const AdafactorApplyArgs& a, int64_t r0, int64_t r1) {                         \
    adafactor_apply_rows<P, G, R>(a, r0, r1);                                                                        \
  }                                                                                                                  \
  void NAME##_base(const AdafactorApplyArgs& a, int64_t r0, int64_t r1) { adafactor_apply_rows<P, G, R>(a, r0, r1); } \
  constexpr IsaKernels<AdafactorApplyFn> NAME = {NAME##_v4, NAME##_v3, NAME##_base};
SHOESTRING_AF_VARIANT(adafactor_apply_f32_f32, float, float, Rounding::nearest)
SHOESTRING_AF_VARIANT(adafactor_apply_f32_b16, float, bf16_bits, Rounding::nearest)
SHOESTRING_AF_VARIANT(adafactor_apply_sr_f32, bf16_bits, float, Rounding::stochastic)
SHOESTRING_AF_VARIANT(adafactor_apply_sr_b16, bf16_bits, bf16_bits, Rounding::stochastic)
SHOESTRING_AF_VARIANT(adafactor_apply_rn_f32, bf16_bits, float, Rounding::nearest)
SHOESTRING_AF_VARIANT(adafactor_apply_rn_b16, bf16_bits, bf16_bits, Rounding::nearest)
#undef SHOESTRING_AF_VARIANT
constexpr IsaKernels<AdafactorApplyFn> kAdafactorApply[6] = {adafactor_apply_f32_f32, adafactor_apply_f32_b16,
                                                             adafactor_apply_sr_f32,  adafactor_apply_sr_b16,
                                                             adafactor_apply_rn_f32,  adafactor_apply_rn_b16};

// Rows per parallel task: about kGrainSize elements.
int64_t row_grain(int64_t m) { return std::max<int64_t>(1, kGrainSize / std::max<int64_t>(m, 1)); }

// The sums pass cuts the rows into chunks of at least kMinSumRows rows (and
// kGrainSize elements), at most kMaxSumChunks of them. Each chunk writes 2 m
// doubles of column partials, added in chunk order afterwards; with 64 rows
// or more these cost at most 1/8 of the chunk's gradient bytes (bf16), and
// their number bounds the serial work of adding them up. (Chunks of a few
// rows made the partials outweigh the gradient of SDXL's narrow tensors.)
constexpr int64_t kMaxSumChunks = 64;
constexpr int64_t kMinSumRows = 64;

// Rows per chunk of the sums pass: a function of the shape only, so the
// sums do not depend on the thread count.
int64_t sum_chunk_rows(int64_t n, int64_t m) {
  return std::max({row_grain(m), kMinSumRows, (n + kMaxSumChunks - 1) / kMaxSumChunks});
}

// ---- Adafactor (unfactored) --------------------------------------------------

struct UnfactoredArgs {
  void* param;
  const void* grad;
  void* v;   // exp_avg_sq
  float* u;  // the update before clipping, [n]
  int64_t n;
  float eps1, beta2t, one_minus_beta2t;
  float clip, step_size, decay_alpha;
  bool decay;
  uint64_t param_key, v_key;
};

// Pass 1 over [0, n): v and the unclipped update u, in the op chain's order
// (grad.square().add_(eps1); v.mul_(beta2t).add_(g2, 1 - beta2t), libtorch's
// fused multiply-add; v.rsqrt().mul_(grad)); v is stored (bf16: SR).
template <typename G, typename S>
void unfactored_moments(const UnfactoredArgs& a) {
  const G* __restrict g_ptr = static_cast<const G*>(a.grad);
  S* __restrict v_ptr = static_cast<S*>(a.v);
  float* __restrict u_ptr = a.u;
  StoreWords<S, Rounding::stochastic> v_words;
  for (int64_t b = 0; b < a.n; b += kRandom16BlockSize) {
    const int64_t len = std::min(kRandom16BlockSize, a.n - b);
    v_words.fill(a.v_key, b, len);
    SHOESTRING_LOOP_NO_ALIAS
    for (int64_t k = 0; k < len; ++k) {
      const int64_t i = b + k;
      const float g = load(g_ptr, i);
      const float g2 = g * g + a.eps1;
      const float v = fma_f32(g2, a.one_minus_beta2t, load(v_ptr, i) * a.beta2t);
      u_ptr[i] = (1.0f / sqrt_f32(v)) * g;
      store(v_ptr, i, v, v_words[k], Rounding::stochastic);
    }
  }
}

// Pass 2: u.div_(clip).mul_(a_t); p.add_(p, -wd a_t) when wd; p.sub_(u).
template <typename P, Rounding kParamRounding>
void unfactored_apply(const UnfactoredArgs& a) {
  P* __restrict p_ptr = static_cast<P*>(a.param);
  const float* __restrict u_ptr = a.u;
  StoreWords<P, kParamRounding> p_words;
  for (int64_t b = 0; b < a.n; b += kRandom16BlockSize) {
    const int64_t len = std::min(kRandom16BlockSize, a.n - b);
    p_words.fill(a.param_key, b, len);
    SHOESTRING_LOOP_NO_ALIAS
    for (int64_t k = 0; k < len; ++k) {
      const int64_t i = b + k;
      const float u = (u_ptr[i] / a.clip) * a.step_size;
      float p = load(p_ptr, i);
      const float p1 = fma_f32(p, a.decay_alpha, p);
      p = a.decay ? p1 : p;
      store(p_ptr, i, p - u, p_words[k], kParamRounding);
    }
  }
}

}  // namespace

bool fused_adafactor_unfactored_supported(const at::Tensor& param, const at::Tensor& grad,
                                          const at::Tensor& exp_avg_sq) {
  return first_reason({{&param, "param"}, {&grad, "grad"}, {&exp_avg_sq, "exp_avg_sq"}}).empty();
}

void fused_adafactor_unfactored_step(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg_sq,
                                     const FusedAdafactorScalars& s, const FusedRoundingKeys& keys) {
  const std::string why = first_reason({{&param, "param"}, {&grad, "grad"}, {&exp_avg_sq, "exp_avg_sq"}});
  if (!why.empty()) fail("fused_adafactor_unfactored_step: {}", why);
  const int64_t n = param.numel();
  if (n == 0) return;
  std::vector<float> u(static_cast<size_t>(n));
  UnfactoredArgs a;
  a.param = param.data_ptr();
  a.grad = grad.data_ptr();
  a.v = exp_avg_sq.data_ptr();
  a.u = u.data();
  a.n = n;
  a.eps1 = static_cast<float>(s.eps1);
  a.beta2t = static_cast<float>(s.beta2t);
  a.one_minus_beta2t = static_cast<float>(1.0 - s.beta2t);
  a.step_size = static_cast<float>(s.step_size);
  a.decay_alpha = static_cast<float>(-s.weight_decay * s.step_size);
  a.decay = s.weight_decay != 0.0;
  a.param_key = stream_key(keys.param);
  a.v_key = stream_key(keys.state1);
  const bool g16 = grad.scalar_type() == at::kBFloat16, v16 = exp_avg_sq.scalar_type() == at::kBFloat16;
  if (g16) {
    v16 ? unfactored_moments<bf16_bits, bf16_bits>(a) : unfactored_moments<bf16_bits, float>(a);
  } else {
    v16 ? unfactored_moments<float, bf16_bits>(a) : unfactored_moments<float, float>(a);
  }
  // RMS(U) exactly as the op chain takes it (at::norm of the fp32 update, so
  // the same reduction and the same double), then U / max(1, RMS / d).
  const at::Tensor u_view = at::from_blob(u.data(), {n}, at::TensorOptions().dtype(at::kFloat));
  const double rms = u_view.norm().item<double>() / std::sqrt(static_cast<double>(n));
  a.clip = static_cast<float>(std::max(1.0, rms / s.clip_threshold));
  if (param.scalar_type() == at::kFloat) {
    unfactored_apply<float, Rounding::nearest>(a);
  } else if (keys.stochastic_rounding) {
    unfactored_apply<bf16_bits, Rounding::stochastic>(a);
  } else {
    unfactored_apply<bf16_bits, Rounding::nearest>(a);
  }
  bump_version(param);
  bump_version(exp_avg_sq);
}

void fused_adafactor_factored_step(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg_sq_row,
                                   at::Tensor& exp_avg_sq_col, int64_t n, int64_t m, const FusedAdafactorScalars& s,
                                   const FusedRoundingKeys& keys) {
  const char* what = "fused_adafactor_factored_step";
  if (n < 1 || m < 1) fail("{}: matrix shape [{}, {}] must be positive", what, n, m);
  const std::string why = first_reason({{&param, "param"}, {&grad, "grad"}});
  if (!why.empty()) fail("{}: {}", what, why);
  if (param.numel() != n * m) fail("{}: param has {} elements, expected {} x {}", what, param.numel(), n, m);
  for (const auto& [t, name, len] :
       {std::make_tuple(&exp_avg_sq_row, "exp_avg_sq_row", n), std::make_tuple(&exp_avg_sq_col, "exp_avg_sq_col", m)}) {
    if (!t->defined() || !t->device().is_cpu() || t->layout() != at::kStrided || t->scalar_type() != at::kFloat ||
        !t->is_contiguous() || t->numel() != len) {
      fail("{}: {} must be a contiguous CPU float32 tensor of {} elements", what, name, len);
    }
  }
  const bool g_bf16 = grad.scalar_type() == at::kBFloat16;
  const int64_t rows = sum_chunk_rows(n, m);
  const int64_t chunks = (n + rows - 1) / rows;

  // Pass 1 (the only one before the weights): row state, column sums, and
  // the sums that give the update's RMS; per-chunk column sums are added in
  // chunk order, so the result does not depend on the thread count. Then the
  // factors (n + m numbers, by the thread that finished the last pass-1
  // chunk), then pass 2: the weights. All in one parallel region
  // (PhasedChunks): a region per pass cost the SDXL-shaped list a second
  // wake-up of the workers per tensor.
  const auto beta2t = static_cast<float>(s.beta2t);
  const auto one_minus_beta2t = static_cast<float>(1.0 - s.beta2t);
  float* row = exp_avg_sq_row.data_ptr<float>();
  float* col = exp_avg_sq_col.data_ptr<float>();
  // [chunk][col sum | weighted], every entry written by its chunk.
  std::unique_ptr<double[]> col_chunks(new double[static_cast<size_t>(2 * chunks * m)]);
  std::unique_ptr<float[]> r_factor(new float[static_cast<size_t>(n)]);
  std::unique_ptr<float[]> c_factor(new float[static_cast<size_t>(m)]);
  AdafactorSumArgs sa{grad.data_ptr(), n, m, static_cast<float>(s.eps1), beta2t, one_minus_beta2t, row};
  const AdafactorRowsFn sums = kAdafactorSums[g_bf16 ? 1 : 0].get();

  AdafactorApplyArgs a;
  a.param = param.data_ptr();
  a.grad = grad.data_ptr();
  a.m = m;
  a.r_factor = r_factor.get();
  a.c_factor = c_factor.get();
  a.clip = 1.0f;  // set by factors()
  a.step_size = static_cast<float>(s.step_size);
  a.decay_alpha = static_cast<float>(-s.weight_decay * s.step_size);
  a.decay = s.weight_decay != 0.0;
  a.param_key = stream_key(keys.param);
  const int kind = param.scalar_type() == at::kFloat ? 0 : (keys.stochastic_rounding ? 1 : 2);
  const AdafactorApplyFn apply = kAdafactorApply[kind * 2 + (g_bf16 ? 1 : 0)].get();
  const int64_t apply_rows = row_grain(m);
  const int64_t apply_chunks = (n + apply_rows - 1) / apply_rows;

  // Second-moment factors and the update's RMS (no allocation: it must not
  // throw while other threads wait for it).
  auto factors = [&] {
    double row_total = 0.0;
    for (int64_t i = 0; i < n; ++i) row_total += row[i];
    double weighted = 0.0;  // sum_j (sum_i g_ij^2 / R_i) / C_j
    for (int64_t j = 0; j < m; ++j) {
      double sum = 0.0, wsum = 0.0;
      for (int64_t c = 0; c < chunks; ++c) {
        sum += col_chunks[static_cast<size_t>(2 * c * m + j)];
        wsum += col_chunks[static_cast<size_t>(2 * c * m + m + j)];
      }
      const auto mean = static_cast<float>(sum / static_cast<double>(n));
      col[j] = fma_f32(mean, one_minus_beta2t, col[j] * beta2t);
      weighted += wsum / static_cast<double>(col[j]);
    }
    const auto row_mean = static_cast<float>(row_total / static_cast<double>(n));
    for (int64_t i = 0; i < n; ++i) r_factor[static_cast<size_t>(i)] = 1.0f / sqrt_f32(row[i] / row_mean);
    for (int64_t j = 0; j < m; ++j) c_factor[static_cast<size_t>(j)] = 1.0f / sqrt_f32(col[j]);
    const double sum_sq = static_cast<double>(row_mean) * weighted;
    const double rms_u = std::sqrt(sum_sq / static_cast<double>(n * m));
    a.clip = static_cast<float>(std::max(1.0, rms_u / s.clip_threshold));
  };

  PhasedChunks phases(chunks, apply_chunks);
  run_chunks(chunks + apply_chunks, n * m, [&](ChunkQueue&) {
    std::unique_ptr<float[]> scratch;  // 3 m floats, set before use by sums()
    for (int64_t c; (c = phases.take_first()) >= 0;) {
      if (!scratch) scratch.reset(new float[static_cast<size_t>(3 * m)]);
      double* out = col_chunks.get() + 2 * c * m;
      sums(sa, c * rows, std::min(n, (c + 1) * rows), out, out + m, scratch.get(), scratch.get() + m,
           scratch.get() + 2 * m);
      if (phases.finish_first()) {
        factors();
        phases.open_second();
      }
    }
    for (int64_t c; (c = phases.take_second()) >= 0;) apply(a, c * apply_rows, std::min(n, (c + 1) * apply_rows));
  });
  bump_version(param);
  bump_version(exp_avg_sq_row);
  bump_version(exp_avg_sq_col);
}

}  // namespace shoestring
