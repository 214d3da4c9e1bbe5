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
  const float* r_factor;  // pass 2 only
  const float* c_factor;
};

// Rows [r0, r1): pass 1 (kSecond = false: g^2 + eps1, row sums and column
// partials) or pass 2 (true: ((r c) g)^2, total only).
template <typename G, bool kSecond>
SHOESTRING_ALWAYS_INLINE double adafactor_rows(const AdafactorSumArgs& a, int64_t r0, int64_t r1,
                                               double* __restrict row_sum, double* __restrict col_sum,
                                               float* __restrict col_part) {
  const G* __restrict g_ptr = static_cast<const G*>(a.grad);
  const float* __restrict c_factor = a.c_factor;
  const int64_t m = a.m;
  double total = 0.0;
  int64_t rows_in_part = 0;
  if (!kSecond) {
    for (int64_t j = 0; j < m; ++j) col_part[j] = 0.0f;
  }
  for (int64_t i = r0; i < r1; ++i) {
    const G* __restrict row = g_ptr + i * m;
    const float r = kSecond ? a.r_factor[i] : 0.0f;
    double row_total = 0.0;
    int64_t j = 0;
    while (j < m) {
      const int64_t chunk_end = std::min(m, j + kLanes * kFlushTerms);
      float lane[kLanes] = {};
      for (; j + kLanes <= chunk_end; j += kLanes) {
        for (int k = 0; k < kLanes; ++k) {
          const float g = load(row, j + k);
          float x;
          if (kSecond) {
            const float u = (r * c_factor[j + k]) * g;
            x = u * u;
          } else {
            x = g * g + a.eps1;
            col_part[j + k] += x;
          }
          lane[k] += x;
        }
      }
      double part = 0.0;
      for (int k = 0; k < kLanes; ++k) part += lane[k];
      for (; j < chunk_end; ++j) {  // last < kLanes elements of the row
        const float g = load(row, j);
        float x;
        if (kSecond) {
          const float u = (r * c_factor[j]) * g;
          x = u * u;
        } else {
          x = g * g + a.eps1;
          col_part[j] += x;
        }
        part += x;
      }
      row_total += part;
    }
    if (!kSecond) {
      row_sum[i] = row_total;
      if (++rows_in_part == kFlushTerms || i + 1 == r1) {
        for (int64_t c = 0; c < m; ++c) {
          col_sum[c] += col_part[c];
          col_part[c] = 0.0f;
        }
        rows_in_part = 0;
      }
    }
    total += row_total;
  }
  return total;
}

using AdafactorRowsFn = double (*)(const AdafactorSumArgs&, int64_t, int64_t, double*, double*, float*);
SHOESTRING_FUSED_TARGET_CLONES double adafactor_sums_f32(const AdafactorSumArgs& a, int64_t r0, int64_t r1, double* rs,
                                                         double* cs, float* cp) {
  return adafactor_rows<float, false>(a, r0, r1, rs, cs, cp);
}
SHOESTRING_FUSED_TARGET_CLONES double adafactor_sums_b16(const AdafactorSumArgs& a, int64_t r0, int64_t r1, double* rs,
                                                         double* cs, float* cp) {
  return adafactor_rows<bf16_bits, false>(a, r0, r1, rs, cs, cp);
}
SHOESTRING_FUSED_TARGET_CLONES double adafactor_sq_f32(const AdafactorSumArgs& a, int64_t r0, int64_t r1, double* rs,
                                                       double* cs, float* cp) {
  return adafactor_rows<float, true>(a, r0, r1, rs, cs, cp);
}
SHOESTRING_FUSED_TARGET_CLONES double adafactor_sq_b16(const AdafactorSumArgs& a, int64_t r0, int64_t r1, double* rs,
                                                       double* cs, float* cp) {
  return adafactor_rows<bf16_bits, true>(a, r0, r1, rs, cs, cp);
}

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
#define SHOESTRING_AF_VARIANT(NAME, P, G, R)                                                      \
  SHOESTRING_FUSED_TARGET_CLONES void NAME(const AdafactorApplyArgs& a, int64_t r0, int64_t r1) { \
    adafactor_apply_rows<P, G, R>(a, r0, r1);                                                     \
  }
SHOESTRING_AF_VARIANT(adafactor_apply_f32_f32, float, float, Rounding::nearest)
SHOESTRING_AF_VARIANT(adafactor_apply_f32_b16, float, bf16_bits, Rounding::nearest)
SHOESTRING_AF_VARIANT(adafactor_apply_sr_f32, bf16_bits, float, Rounding::stochastic)
SHOESTRING_AF_VARIANT(adafactor_apply_sr_b16, bf16_bits, bf16_bits, Rounding::stochastic)
SHOESTRING_AF_VARIANT(adafactor_apply_rn_f32, bf16_bits, float, Rounding::nearest)
SHOESTRING_AF_VARIANT(adafactor_apply_rn_b16, bf16_bits, bf16_bits, Rounding::nearest)
#undef SHOESTRING_AF_VARIANT
constexpr AdafactorApplyFn kAdafactorApply[6] = {adafactor_apply_f32_f32, adafactor_apply_f32_b16,
                                                 adafactor_apply_sr_f32,  adafactor_apply_sr_b16,
                                                 adafactor_apply_rn_f32,  adafactor_apply_rn_b16};

// Rows per parallel task: about kGrainSize elements.
int64_t row_grain(int64_t m) { return std::max<int64_t>(1, kGrainSize / std::max<int64_t>(m, 1)); }

}  // namespace

namespace {
// Splits rows [0, n) into tasks whose boundaries do not depend on the thread
// count (fixed chunks of row_grain(m) rows), so sums are reproducible.
template <typename F>
void for_fixed_row_chunks(int64_t n, int64_t m, const F& f) {
  const int64_t rows = row_grain(m);
  const int64_t chunks = (n + rows - 1) / rows;
  if (chunks == 1) {
    f(0, 0, n);
    return;
  }
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) f(c, c * rows, std::min(n, (c + 1) * rows));
  });
}
}  // namespace

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
  const int64_t rows = row_grain(m);
  const int64_t chunks = (n + rows - 1) / rows;

  // Pass 1: row sums and per-chunk column sums (added in chunk order).
  std::vector<double> row_sum(static_cast<size_t>(n));
  std::vector<double> col_chunks(static_cast<size_t>(chunks * m), 0.0);
  AdafactorSumArgs sa{grad.data_ptr(), n, m, static_cast<float>(s.eps1), nullptr, nullptr};
  const AdafactorRowsFn sums = g_bf16 ? adafactor_sums_b16 : adafactor_sums_f32;
  for_fixed_row_chunks(n, m, [&](int64_t c, int64_t r0, int64_t r1) {
    std::vector<float> part(static_cast<size_t>(m));
    sums(sa, r0, r1, row_sum.data(), col_chunks.data() + c * m, part.data());
  });

  // Second-moment factors (n + m numbers).
  const auto beta2t = static_cast<float>(s.beta2t);
  const auto one_minus_beta2t = static_cast<float>(1.0 - s.beta2t);
  float* row = exp_avg_sq_row.data_ptr<float>();
  float* col = exp_avg_sq_col.data_ptr<float>();
  double row_total = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const auto mean = static_cast<float>(row_sum[static_cast<size_t>(i)] / static_cast<double>(m));
    row[i] = fma_f32(mean, one_minus_beta2t, row[i] * beta2t);
    row_total += row[i];
  }
  for (int64_t j = 0; j < m; ++j) {
    double sum = 0.0;
    for (int64_t c = 0; c < chunks; ++c) sum += col_chunks[static_cast<size_t>(c * m + j)];
    const auto mean = static_cast<float>(sum / static_cast<double>(n));
    col[j] = fma_f32(mean, one_minus_beta2t, col[j] * beta2t);
  }
  const auto row_mean = static_cast<float>(row_total / static_cast<double>(n));
  std::vector<float> r_factor(static_cast<size_t>(n)), c_factor(static_cast<size_t>(m));
  for (int64_t i = 0; i < n; ++i) r_factor[static_cast<size_t>(i)] = 1.0f / sqrt_f32(row[i] / row_mean);
  for (int64_t j = 0; j < m; ++j) c_factor[static_cast<size_t>(j)] = 1.0f / sqrt_f32(col[j]);

  // Pass 2: sum of squares of the unclipped update.
  sa.r_factor = r_factor.data();
  sa.c_factor = c_factor.data();
  const AdafactorRowsFn squares = g_bf16 ? adafactor_sq_b16 : adafactor_sq_f32;
  std::vector<double> chunk_sums(static_cast<size_t>(chunks), 0.0);
  for_fixed_row_chunks(n, m, [&](int64_t c, int64_t r0, int64_t r1) {
    chunk_sums[static_cast<size_t>(c)] = squares(sa, r0, r1, nullptr, nullptr, nullptr);
  });
  double sum_sq = 0.0;
  for (double x : chunk_sums) sum_sq += x;
  const double rms_u = std::sqrt(sum_sq / static_cast<double>(n * m));
  const double clip = std::max(1.0, rms_u / s.clip_threshold);

  // Pass 3: the weights.
  AdafactorApplyArgs a;
  a.param = param.data_ptr();
  a.grad = grad.data_ptr();
  a.m = m;
  a.r_factor = r_factor.data();
  a.c_factor = c_factor.data();
  a.clip = static_cast<float>(clip);
  a.step_size = static_cast<float>(s.step_size);
  a.decay_alpha = static_cast<float>(-s.weight_decay * s.step_size);
  a.decay = s.weight_decay != 0.0;
  a.param_key = stream_key(keys.param);
  const int kind = param.scalar_type() == at::kFloat ? 0 : (keys.stochastic_rounding ? 1 : 2);
  const AdafactorApplyFn apply = kAdafactorApply[kind * 2 + (g_bf16 ? 1 : 0)];
  for_fixed_row_chunks(n, m, [&](int64_t, int64_t r0, int64_t r1) { apply(a, r0, r1); });
  bump_version(param);
  bump_version(exp_avg_sq_row);
  bump_version(exp_avg_sq_col);
}

}  // namespace shoestring
