// The fused SPARKLES step (optim/fused_kernels.h; formulas in optim/sparkles.h).
#include "shoestring/optim/fused_kernel_support.h"

#include <limits>

namespace shoestring {
namespace {

// Independent fp32 accumulators, flushed into double every kFlushTerms terms
// each (as fused_adafactor.cpp): the loop vectorizes without reassociation.
constexpr int kLanes = 16;
constexpr int64_t kFlushTerms = 64;

// Sum of term(i) over [0, n), fp32 lanes flushed into double.
template <typename Term>
SHOESTRING_ALWAYS_INLINE double lane_sum(int64_t n, const Term& term) {
  double total = 0.0;
  int64_t i = 0;
  while (i < n) {
    const int64_t chunk_end = std::min(n, i + kLanes * kFlushTerms);
    float lane[kLanes] = {};
    for (; i + kLanes <= chunk_end; i += kLanes) {
      for (int k = 0; k < kLanes; ++k) lane[k] += term(i + k);
    }
    double part = 0.0;
    for (int k = 0; k < kLanes; ++k) part += lane[k];
    for (; i < chunk_end; ++i) part += term(i);
    total += part;
  }
  return total;
}

SHOESTRING_ALWAYS_INLINE float float_of(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

struct SparklesArgs {
  void* param;
  const void* grad;
  void* m;
  void* v;
  void* prev;
  int64_t rows, k;      // slices and elements per slice
  const float* center;  // [rows]: c mean of the slice (0 without centralization)
  const float* scale;   // [rows]: f of the slice (1 without normalization)
  float grad_scale;     // the gradient is multiplied by this first
  float wd;             // coupled weight decay (0 when decoupled or none)
  uint32_t p_mask;      // ~0 with coupled decay, else 0: the weight's bits enter g only then
  int64_t update_k;     // pass 2's slice length: k, or n when every slice has the same factors
  float beta1, one_minus_beta1, beta2, one_minus_beta2, amp, bias_correction2_sqrt, eps, step_size;
  float decay;  // 1 - s wd with decoupled decay, else 1
  float clip;   // t^0.25 when clipping, else +inf
  bool coupled;
  uint64_t param_key, m_key, v_key, prev_key;
};

// Mean and sum of squared deviations of slices [r0, r1) of the gradient.
template <typename G>
SHOESTRING_ALWAYS_INLINE void slice_moments(const SparklesArgs& a, bool deviations, int64_t r0, int64_t r1,
                                            double* mean, double* m2) {
  const G* __restrict g_ptr = static_cast<const G*>(a.grad);
  const int64_t k = a.k;
  for (int64_t r = r0; r < r1; ++r) {
    const G* __restrict row = g_ptr + r * k;
    const float gs = a.grad_scale;
    const double mu = lane_sum(k, [&](int64_t i) { return load(row, i) * gs; }) / static_cast<double>(k);
    mean[r] = mu;
    if (deviations) {
      const auto muf = static_cast<float>(mu);
      m2[r] = lane_sum(k, [&](int64_t i) {
        const float d = load(row, i) * gs - muf;
        return d * d;
      });
    }
  }
}

// The new first moment m and gh of one element, as pass 2 computes them from
// the gradient g, the weight p (read only for coupled weight decay) and the
// stored first moment m0.
SHOESTRING_ALWAYS_INLINE float amplified(const SparklesArgs& a, float center, float scale, float g0, float p, float m0,
                                         float* m_out) {
  const float g1 = (g0 * a.grad_scale - center) * scale;
  const float g = fma_f32(p, a.wd, g1);  // wd = 0 without coupled decay
  const float m = fma_f32(g, a.one_minus_beta1, m0 * a.beta1);
  *m_out = m;
  return fma_f32(m, a.amp, g);
}

// ||gh - prev_grad||^2 over slices [r0, r1) (the weights are read only with
// coupled weight decay).
template <typename P, typename G, typename S>
SHOESTRING_ALWAYS_INLINE double change_norm2(const SparklesArgs& a, int64_t r0, int64_t r1) {
  const P* __restrict p_ptr = static_cast<const P*>(a.param);
  const G* __restrict g_ptr = static_cast<const G*>(a.grad);
  const S* __restrict m_ptr = static_cast<const S*>(a.m);
  const S* __restrict prev = static_cast<const S*>(a.prev);
  double total = 0.0;
  for (int64_t r = r0; r < r1; ++r) {
    const float center = a.center[r], scale = a.scale[r];
    const int64_t base = r * a.k;
    if (a.coupled) {
      total += lane_sum(a.k, [&](int64_t j) {
        const int64_t i = base + j;
        float m;
        const float d = amplified(a, center, scale, load(g_ptr, i), load(p_ptr, i), load(m_ptr, i), &m) - load(prev, i);
        return d * d;
      });
    } else {
      total += lane_sum(a.k, [&](int64_t j) {
        const int64_t i = base + j;
        float m;
        const float d = amplified(a, center, scale, load(g_ptr, i), 0.0f, load(m_ptr, i), &m) - load(prev, i);
        return d * d;
      });
    }
  }
  return total;
}

// Pass 2 over elements [e0, e1). Straight-line arithmetic without selects
// on the options (GCC 12 unswitched such a loop on them and ran an
// unvectorized copy): without coupled decay wd is 0 and the weight's bits are
// masked to +0 (so an inf weight cannot turn g into NaN), decay is 1 without
// decoupled decay, clip +inf without clipping.
template <typename P, typename G, typename S, Rounding kParamRounding>
SHOESTRING_ALWAYS_INLINE void update_elements(const SparklesArgs& a, int64_t e0, int64_t e1) {
  P* __restrict p_ptr = static_cast<P*>(a.param);
  const G* __restrict g_ptr = static_cast<const G*>(a.grad);
  S* __restrict m_ptr = static_cast<S*>(a.m);
  S* __restrict v_ptr = static_cast<S*>(a.v);
  S* __restrict prev_ptr = static_cast<S*>(a.prev);
  const float wd = a.wd, beta1 = a.beta1, one_minus_beta1 = a.one_minus_beta1, beta2 = a.beta2;
  const float one_minus_beta2 = a.one_minus_beta2, amp = a.amp, bc2 = a.bias_correction2_sqrt, eps = a.eps;
  const float step_size = a.step_size, decay = a.decay, clip = a.clip, grad_scale = a.grad_scale;
  const uint32_t p_mask = a.p_mask;
  const int64_t k = a.update_k;
  StoreWords<P, kParamRounding> p_words;
  StoreWords<S, Rounding::stochastic> m_words, v_words, prev_words;
  for (int64_t e = e0; e < e1;) {
    const int64_t r = e / k;
    const int64_t end = std::min(e1, (r + 1) * k);
    const float center = a.center[r], scale = a.scale[r];
    for (int64_t b = e; b < end; b += kRandom16BlockSize) {
      const int64_t len = std::min(kRandom16BlockSize, end - b);
      p_words.fill(a.param_key, b, len);
      m_words.fill(a.m_key, b, len);
      v_words.fill(a.v_key, b, len);
      prev_words.fill(a.prev_key, b, len);
      SHOESTRING_LOOP_NO_ALIAS
      for (int64_t q = 0; q < len; ++q) {
        const int64_t i = b + q;
        const float p0 = load(p_ptr, i);
        const float g1 = (load(g_ptr, i) * grad_scale - center) * scale;
        const float g = fma_f32(float_of(bits_of(p0) & p_mask), wd, g1);
        const float m = fma_f32(g, one_minus_beta1, load(m_ptr, i) * beta1);
        const float gh = fma_f32(m, amp, g);
        const float v = fma_f32(one_minus_beta2 * gh, gh, load(v_ptr, i) * beta2);
        const float denom = sqrt_f32(v) / bc2 + eps;
        const float p = p0 * decay;
        const float u0 = (gh / denom) * step_size;
        const float lo = u0 < -clip ? -clip : u0;
        const float u = lo > clip ? clip : lo;
        store(p_ptr, i, p - u, p_words[q], kParamRounding);
        store(m_ptr, i, m, m_words[q], Rounding::stochastic);
        store(v_ptr, i, v, v_words[q], Rounding::stochastic);
        store(prev_ptr, i, gh, prev_words[q], Rounding::stochastic);
      }
    }
    e = end;
  }
}

using MomentsFn = void (*)(const SparklesArgs&, bool, int64_t, int64_t, double*, double*);
using NormFn = double (*)(const SparklesArgs&, int64_t, int64_t);
using UpdateFn = void (*)(const SparklesArgs&, int64_t, int64_t);

#define SHOESTRING_SP_MOMENTS(NAME, G)                                                                                 \
  SHOESTRING_TARGET_V4 void NAME##_v4(const SparklesArgs& a, bool d, int64_t r0, int64_t r1, double* mu, double* m2) { \
    slice_moments<G>(a, d, r0, r1, mu, m2);                                                                            \
  }                                                                                                                    \
  SHOESTRING_TARGET_V3 void NAME##_v3(const SparklesArgs& a, bool d, int64_t r0, int64_t r1, double* mu, double* m2) { \
    slice_moments<G>(a, d, r0, r1, mu, m2);                                                                            \
  }                                                                                                                    \
  void NAME##_base(const SparklesArgs& a, bool d, int64_t r0, int64_t r1, double* mu, double* m2) {                    \
    slice_moments<G>(a, d, r0, r1, mu, m2);                                                                            \
  }                                                                                                                    \
  constexpr IsaKernels<MomentsFn> NAME = {NAME##_v4, NAME##_v3, NAME##_base};
SHOESTRING_SP_MOMENTS(sparkles_moments_f32, float)
SHOESTRING_SP_MOMENTS(sparkles_moments_b16, bf16_bits)
#undef SHOESTRING_SP_MOMENTS
constexpr IsaKernels<MomentsFn> kMoments[2] = {sparkles_moments_f32, sparkles_moments_b16};

#define SHOESTRING_SP_NORM(NAME, P, G, S)                                                                        \
  SHOESTRING_TARGET_V4 double NAME##_v4(const SparklesArgs& a, int64_t r0, int64_t r1) {                         \
    return change_norm2<P, G, S>(a, r0, r1);                                                                     \
  }                                                                                                              \
  SHOESTRING_TARGET_V3 double NAME##_v3(const SparklesArgs& a, int64_t r0, int64_t r1) {                         \
    return change_norm2<P, G, S>(a, r0, r1);                                                                     \
  }                                                                                                              \
  double NAME##_base(const SparklesArgs& a, int64_t r0, int64_t r1) { return change_norm2<P, G, S>(a, r0, r1); } \
  constexpr IsaKernels<NormFn> NAME = {NAME##_v4, NAME##_v3, NAME##_base};
SHOESTRING_SP_NORM(sparkles_norm_fff, float, float, float)
SHOESTRING_SP_NORM(sparkles_norm_ffb, float, float, bf16_bits)
SHOESTRING_SP_NORM(sparkles_norm_fbf, float, bf16_bits, float)
SHOESTRING_SP_NORM(sparkles_norm_fbb, float, bf16_bits, bf16_bits)
SHOESTRING_SP_NORM(sparkles_norm_bff, bf16_bits, float, float)
SHOESTRING_SP_NORM(sparkles_norm_bfb, bf16_bits, float, bf16_bits)
SHOESTRING_SP_NORM(sparkles_norm_bbf, bf16_bits, bf16_bits, float)
SHOESTRING_SP_NORM(sparkles_norm_bbb, bf16_bits, bf16_bits, bf16_bits)
#undef SHOESTRING_SP_NORM
// [param bf16][grad bf16][state bf16]
constexpr IsaKernels<NormFn> kNorm[8] = {sparkles_norm_fff, sparkles_norm_ffb, sparkles_norm_fbf, sparkles_norm_fbb,
                                         sparkles_norm_bff, sparkles_norm_bfb, sparkles_norm_bbf, sparkles_norm_bbb};

#define SHOESTRING_SP_UPDATE(NAME, P, G, S, R)                                                                \
  SHOESTRING_TARGET_V4 void NAME##_v4(const SparklesArgs& a, int64_t e0, int64_t e1) {                        \
    update_elements<P, G, S, R>(a, e0, e1);                                                                   \
  }                                                                                                           \
  SHOESTRING_TARGET_V3 void NAME##_v3(const SparklesArgs& a, int64_t e0, int64_t e1) {                        \
    update_elements<P, G, S, R>(a, e0, e1);                                                                   \
  }                                                                                                           \
  void NAME##_base(const SparklesArgs& a, int64_t e0, int64_t e1) { update_elements<P, G, S, R>(a, e0, e1); } \
  constexpr IsaKernels<UpdateFn> NAME = {NAME##_v4, NAME##_v3, NAME##_base};
#define SHOESTRING_SP_UPDATES(NAME, P, R)                 \
  SHOESTRING_SP_UPDATE(NAME##_ff, P, float, float, R)     \
  SHOESTRING_SP_UPDATE(NAME##_fb, P, float, bf16_bits, R) \
  SHOESTRING_SP_UPDATE(NAME##_bf, P, bf16_bits, float, R) \
  SHOESTRING_SP_UPDATE(NAME##_bb, P, bf16_bits, bf16_bits, R)
SHOESTRING_SP_UPDATES(sparkles_update_f32, float, Rounding::nearest)
SHOESTRING_SP_UPDATES(sparkles_update_sr, bf16_bits, Rounding::stochastic)
SHOESTRING_SP_UPDATES(sparkles_update_rn, bf16_bits, Rounding::nearest)
#undef SHOESTRING_SP_UPDATES
#undef SHOESTRING_SP_UPDATE
// [param kind: fp32, bf16 SR, bf16 RN][grad bf16][state bf16]
constexpr IsaKernels<UpdateFn> kUpdate[12] = {sparkles_update_f32_ff, sparkles_update_f32_fb, sparkles_update_f32_bf,
                                              sparkles_update_f32_bb, sparkles_update_sr_ff,  sparkles_update_sr_fb,
                                              sparkles_update_sr_bf,  sparkles_update_sr_bb,  sparkles_update_rn_ff,
                                              sparkles_update_rn_fb,  sparkles_update_rn_bf,  sparkles_update_rn_bb};

std::string sparkles_reason(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& ema,
                            const at::Tensor& ema_squared, const at::Tensor& prev_grad) {
  std::string why = first_reason(
      {{&param, "param"}, {&grad, "grad"}, {&ema, "ema"}, {&ema_squared, "ema_squared"}, {&prev_grad, "prev_grad"}});
  if (!why.empty()) return why;
  if (ema_squared.scalar_type() != ema.scalar_type() || prev_grad.scalar_type() != ema.scalar_type()) {
    return fmt::format("the states are {}, {} and {}, expected one dtype", c10::toString(ema.scalar_type()),
                       c10::toString(ema_squared.scalar_type()), c10::toString(prev_grad.scalar_type()));
  }
  return {};
}

// One tensor's step: its kernels, arguments, per-slice factors and the
// chunks of both passes (fixed by the shape, so nothing depends on the
// thread count).
struct SparklesPlan {
  enum class Norm { none, per_slice, whole };
  SparklesArgs a{};
  Norm norm = Norm::none;
  bool center_on = false, check_change = false, change_in_pass1 = false;
  float c = 0;
  double alpha = 0, threshold = 0;
  int64_t n = 0, slice_rows = 1, slice_chunks = 0, element_chunks = 0;
  std::vector<float> center, scale;
  std::vector<double> mean, m2, chunk_norm2;
  MomentsFn moments = nullptr;
  NormFn change = nullptr;
  UpdateFn update = nullptr;
  bool permute = false;

  bool pass1_needed() const { return center_on || norm != Norm::none || change_in_pass1; }

  float scale_of(double sum_sq, int64_t count) const {
    const auto sd = static_cast<float>(std::sqrt(sum_sq / static_cast<double>(count - 1))) + 1e-8f;
    return static_cast<float>((1.0 - alpha) + alpha / static_cast<double>(sd));
  }

  // Pass 1, slice chunk q: moments; per-slice factors; the chunk's change norm.
  void pass1(int64_t q) {
    const int64_t r0 = q * slice_rows, r1 = std::min(a.rows, r0 + slice_rows);
    if (center_on || norm != Norm::none) moments(a, norm != Norm::none, r0, r1, mean.data(), m2.data());
    if (norm == Norm::whole) return;
    for (int64_t r = r0; r < r1; ++r) {
      const auto i = static_cast<size_t>(r);
      if (center_on) center[i] = static_cast<float>(mean[i]) * c;
      if (norm == Norm::per_slice) scale[i] = scale_of(m2[i], a.k);
    }
    if (change_in_pass1) chunk_norm2[static_cast<size_t>(q)] = change(a, r0, r1);
  }

  // The change norm of a whole-tensor normalization needs the whole
  // tensor's factor first: a pass of its own between pass 1 and the decision.
  bool needs_change_pass() const { return norm == Norm::whole && check_change; }

  // Between the passes (one thread): the factors of a whole-tensor
  // normalization from the slices' moments (Chan, Golub & LeVeque's pairwise
  // combination, in slice order).
  void finish_factors() {
    if (norm == Norm::whole) {
      double total_mean = 0.0;
      for (int64_t r = 0; r < a.rows; ++r) {
        const auto i = static_cast<size_t>(r);
        if (center_on) center[i] = static_cast<float>(mean[i]) * c;
        total_mean += mean[i] - static_cast<double>(center[i]);
      }
      total_mean /= static_cast<double>(a.rows);
      double total_m2 = 0.0;
      for (int64_t r = 0; r < a.rows; ++r) {
        const auto i = static_cast<size_t>(r);
        const double d = mean[i] - static_cast<double>(center[i]) - total_mean;
        total_m2 += m2[i] + static_cast<double>(a.k) * d * d;
      }
      std::fill(scale.begin(), scale.end(), scale_of(total_m2, n));
    }
  }

  // The change-norm pass of needs_change_pass(), slice chunk q.
  void change_pass(int64_t q) {
    chunk_norm2[static_cast<size_t>(q)] = change(a, q * slice_rows, std::min(a.rows, (q + 1) * slice_rows));
  }

  // The permutation decision from the chunks' change norms (in chunk order).
  void decide() {
    if (check_change) {
      double norm2 = 0.0;
      for (double x : chunk_norm2) norm2 += x;
      permute = std::sqrt(norm2) < threshold;
    }
  }

  void pass2(int64_t q) {
    if (!permute) update(a, q * kGrainSize, std::min(n, (q + 1) * kGrainSize));
  }
};

SparklesPlan make_plan(const FusedSparklesTensor& t) {
  const FusedSparklesScalars& s = t.scalars;
  SparklesPlan plan;
  SparklesArgs& a = plan.a;
  const int64_t n = t.param.numel();
  const bool matrix = t.param.dim() >= 2;
  plan.n = n;
  a.rows = matrix ? t.param.size(0) : 1;
  a.k = n / a.rows;
  plan.center_on = s.centralization != 0 && matrix;
  if (s.normalization != 0) {
    if (s.normalize_channels && matrix && a.k >= 2) {
      plan.norm = SparklesPlan::Norm::per_slice;
    } else if (n > 2) {  // one slice: its moments are the tensor's
      plan.norm = a.rows == 1 ? SparklesPlan::Norm::per_slice : SparklesPlan::Norm::whole;
    }
  }
  plan.check_change = s.step > 1 && s.stochastic_threshold > 0;
  plan.change_in_pass1 = plan.check_change && plan.norm != SparklesPlan::Norm::whole;
  plan.c = static_cast<float>(s.centralization);
  plan.alpha = s.normalization;
  plan.threshold = s.stochastic_threshold;
  plan.center.assign(static_cast<size_t>(a.rows), 0.0f);
  plan.scale.assign(static_cast<size_t>(a.rows), 1.0f);
  if (plan.center_on || plan.norm != SparklesPlan::Norm::none) {
    plan.mean.assign(static_cast<size_t>(a.rows), 0.0);
    plan.m2.assign(static_cast<size_t>(a.rows), 0.0);
  }
  plan.slice_rows = std::max<int64_t>(1, kGrainSize / std::max<int64_t>(a.k, 1));
  plan.slice_chunks = plan.pass1_needed() ? (a.rows + plan.slice_rows - 1) / plan.slice_rows : 0;
  plan.chunk_norm2.assign(static_cast<size_t>(plan.slice_chunks), 0.0);
  plan.element_chunks = (n + kGrainSize - 1) / kGrainSize;

  const bool g16 = t.grad.scalar_type() == at::kBFloat16;
  const bool s16 = t.ema.scalar_type() == at::kBFloat16;
  const bool p16 = t.param.scalar_type() == at::kBFloat16;
  plan.moments = kMoments[g16 ? 1 : 0].get();
  plan.change = kNorm[(p16 ? 4 : 0) + (g16 ? 2 : 0) + (s16 ? 1 : 0)].get();
  const int kind = p16 ? (t.keys.stochastic_rounding ? 1 : 2) : 0;
  plan.update = kUpdate[kind * 4 + (g16 ? 2 : 0) + (s16 ? 1 : 0)].get();

  const double bias_correction1 = 1.0 - std::pow(s.beta1, static_cast<double>(s.step));
  const double bias_correction2 = 1.0 - std::pow(s.beta2, static_cast<double>(s.step));
  const double step_size = s.lr / bias_correction1;
  a.grad_scale = static_cast<float>(s.grad_scale);
  a.param = t.param.data_ptr();
  a.grad = t.grad.data_ptr();
  a.m = t.ema.data_ptr();
  a.v = t.ema_squared.data_ptr();
  a.prev = t.prev_grad.data_ptr();
  a.center = plan.center.data();
  a.scale = plan.scale.data();
  const bool coupled = s.weight_decay != 0 && !s.decouple_weight_decay;
  a.wd = coupled ? static_cast<float>(s.weight_decay) : 0.0f;
  a.coupled = coupled;
  a.p_mask = coupled ? ~0u : 0u;
  a.update_k = plan.center_on || plan.norm == SparklesPlan::Norm::per_slice ? a.k : n;
  a.beta1 = static_cast<float>(s.beta1);
  a.one_minus_beta1 = static_cast<float>(1.0 - s.beta1);
  a.beta2 = static_cast<float>(s.beta2);
  a.one_minus_beta2 = static_cast<float>(1.0 - s.beta2);
  a.amp = static_cast<float>(s.amp_fac);
  a.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  a.eps = static_cast<float>(s.eps);
  a.step_size = static_cast<float>(step_size);
  a.decay =
      s.weight_decay != 0 && s.decouple_weight_decay ? static_cast<float>(1.0 - step_size * s.weight_decay) : 1.0f;
  a.clip = s.clip_gradients ? static_cast<float>(std::pow(static_cast<double>(s.step), 0.25))
                            : std::numeric_limits<float>::infinity();
  a.param_key = stream_key(t.keys.param);
  a.m_key = stream_key(t.keys.ema);
  a.v_key = stream_key(t.keys.ema_squared);
  a.prev_key = stream_key(t.keys.prev_grad);
  return plan;
}

struct ChunkRef {
  int64_t plan, chunk;
};

}  // namespace

bool fused_sparkles_supported(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& ema,
                              const at::Tensor& ema_squared, const at::Tensor& prev_grad) {
  return sparkles_reason(param, grad, ema, ema_squared, prev_grad).empty();
}

std::vector<bool> fused_sparkles_step_many(const std::vector<FusedSparklesTensor>& tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const FusedSparklesTensor& t = tensors[i];
    const std::string why = sparkles_reason(t.param, t.grad, t.ema, t.ema_squared, t.prev_grad);
    if (!why.empty()) fail("fused_sparkles_step_many: tensor {}: {}", i, why);
  }
  std::vector<SparklesPlan> plans;
  plans.reserve(tensors.size());
  std::vector<ChunkRef> first, second;
  int64_t work = 0;
  for (const FusedSparklesTensor& t : tensors) {
    const auto p = static_cast<int64_t>(plans.size());
    plans.push_back(t.param.numel() > 0 ? make_plan(t) : SparklesPlan{});
    const SparklesPlan& plan = plans.back();
    for (int64_t q = 0; q < plan.slice_chunks; ++q) first.push_back({p, q});
    for (int64_t q = 0; q < plan.element_chunks; ++q) second.push_back({p, q});
    work += plan.n * (plan.change_in_pass1 ? 4 : 3);
  }
  // Both passes in one parallel region (PhasedChunks); the thread that
  // finishes the last pass-1 chunk computes every tensor's factors and
  // decision (no allocation there: it must not throw while the others wait).
  // A tensor normalized as a whole and checked for the permutation needs a
  // pass in between: then three regions.
  const auto n1 = static_cast<int64_t>(first.size()), n2 = static_cast<int64_t>(second.size());
  auto run_pass = [&](const std::vector<ChunkRef>& chunks, auto&& body) {
    run_chunks(static_cast<int64_t>(chunks.size()), work, [&](ChunkQueue& queue) {
      for (int64_t c; (c = queue.take()) >= 0;) {
        const ChunkRef& ref = chunks[static_cast<size_t>(c)];
        body(plans[static_cast<size_t>(ref.plan)], ref.chunk);
      }
    });
  };
  bool change_pass = false;
  for (const SparklesPlan& plan : plans) change_pass = change_pass || (plan.n > 0 && plan.needs_change_pass());
  if (change_pass) {
    run_pass(first, [](SparklesPlan& plan, int64_t q) { plan.pass1(q); });
    std::vector<ChunkRef> middle;
    for (size_t p = 0; p < plans.size(); ++p) {
      if (plans[p].n == 0) continue;
      plans[p].finish_factors();
      if (!plans[p].needs_change_pass()) continue;
      for (int64_t q = 0; q < plans[p].slice_chunks; ++q) middle.push_back({static_cast<int64_t>(p), q});
    }
    run_pass(middle, [](SparklesPlan& plan, int64_t q) { plan.change_pass(q); });
    for (SparklesPlan& plan : plans) {
      if (plan.n > 0) plan.decide();
    }
    run_pass(second, [](SparklesPlan& plan, int64_t q) { plan.pass2(q); });
  } else {
    PhasedChunks phases(n1, n2);
    auto between = [&] {
      for (SparklesPlan& plan : plans) {
        if (plan.n == 0) continue;
        plan.finish_factors();
        plan.decide();
      }
      phases.open_second();
    };
    if (n1 == 0) between();
    run_chunks(n1 + n2, work, [&](ChunkQueue&) {
      for (int64_t c; (c = phases.take_first()) >= 0;) {
        plans[static_cast<size_t>(first[static_cast<size_t>(c)].plan)].pass1(first[static_cast<size_t>(c)].chunk);
        if (phases.finish_first()) between();
      }
      for (int64_t c; (c = phases.take_second()) >= 0;) {
        plans[static_cast<size_t>(second[static_cast<size_t>(c)].plan)].pass2(second[static_cast<size_t>(c)].chunk);
      }
    });
  }
  std::vector<bool> done(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    done[i] = !plans[i].permute;
    if (!done[i]) continue;
    for (const at::Tensor* t : {&tensors[i].param, &tensors[i].ema, &tensors[i].ema_squared, &tensors[i].prev_grad}) {
      bump_version(*t);
    }
  }
  return done;
}

}  // namespace shoestring
