// Fused AdamW and Lion steps (optim/fused_kernels.h): one pass over the
// parameter, its gradient and its state per element range.
#include "shoestring/optim/fused_kernel_support.h"

namespace shoestring {
namespace {

// Everything a range kernel needs; constants already rounded to fp32.
struct AdamWArgs : AdamConstants {
  void* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  uint64_t param_key, exp_avg_key, exp_avg_sq_key;  // counter_rng_key(...) of each tensor
};

template <typename P, typename G, typename S, Rounding kParamRounding>
SHOESTRING_ALWAYS_INLINE void adamw_range(const AdamWArgs& a, int64_t begin, int64_t end) {
  P* __restrict p_ptr = static_cast<P*>(a.param);
  const G* __restrict g_ptr = static_cast<const G*>(a.grad);
  S* __restrict m_ptr = static_cast<S*>(a.exp_avg);
  S* __restrict v_ptr = static_cast<S*>(a.exp_avg_sq);
  StoreWords<P, kParamRounding> p_words;
  StoreWords<S, Rounding::stochastic> m_words, v_words;
  for (int64_t b = begin; b < end; b += kRandom16BlockSize) {
    const int64_t len = std::min(kRandom16BlockSize, end - b);
    p_words.fill(a.param_key, b, len);
    m_words.fill(a.exp_avg_key, b, len);
    v_words.fill(a.exp_avg_sq_key, b, len);
    SHOESTRING_LOOP_NO_ALIAS
    for (int64_t k = 0; k < len; ++k) {
      const int64_t i = b + k;
      const float g = load(g_ptr, i) * a.grad_scale;
      float p = load(p_ptr, i) * a.decay;
      const float m = fma_f32(g, a.one_minus_beta1, load(m_ptr, i) * a.beta1);
      const float v = fma_f32(a.one_minus_beta2 * g, g, load(v_ptr, i) * a.beta2);
      const float denom = sqrt_f32(v) / a.bias_correction2_sqrt + a.eps;
      p = p + (a.neg_step_size * m) / denom;
      store(m_ptr, i, m, m_words[k], Rounding::stochastic);
      store(v_ptr, i, v, v_words[k], Rounding::stochastic);
      store(p_ptr, i, p, p_words[k], kParamRounding);
    }
  }
}

struct LionArgs {
  void* param;
  const void* grad;
  void* exp_avg;
  float grad_scale, decay, neg_lr, beta1, one_minus_beta1, beta2, one_minus_beta2;
  uint64_t param_key, exp_avg_key;
};

template <typename P, typename G, typename S, Rounding kParamRounding>
SHOESTRING_ALWAYS_INLINE void lion_range(const LionArgs& a, int64_t begin, int64_t end) {
  P* __restrict p_ptr = static_cast<P*>(a.param);
  const G* __restrict g_ptr = static_cast<const G*>(a.grad);
  S* __restrict m_ptr = static_cast<S*>(a.exp_avg);
  StoreWords<P, kParamRounding> p_words;
  StoreWords<S, Rounding::stochastic> m_words;
  for (int64_t b = begin; b < end; b += kRandom16BlockSize) {
    const int64_t len = std::min(kRandom16BlockSize, end - b);
    p_words.fill(a.param_key, b, len);
    m_words.fill(a.exp_avg_key, b, len);
    SHOESTRING_LOOP_NO_ALIAS
    for (int64_t k = 0; k < len; ++k) {
      const int64_t i = b + k;
      const float g = load(g_ptr, i) * a.grad_scale;
      const float m_old = load(m_ptr, i);
      float p = load(p_ptr, i) * a.decay;
      const float c = fma_f32(g, a.one_minus_beta1, m_old * a.beta1);
      // torch.sign: (0 < c) - (c < 0), so NaN -> 0. lr * sign is exact.
      const float sign = static_cast<float>(c > 0.0f) - static_cast<float>(c < 0.0f);
      p = p + a.neg_lr * sign;
      const float m = fma_f32(g, a.one_minus_beta2, m_old * a.beta2);
      store(m_ptr, i, m, m_words[k], Rounding::stochastic);
      store(p_ptr, i, p, p_words[k], kParamRounding);
    }
  }
}

// One non-template entry point per dtype combination and instruction set
// (SHOESTRING_TARGET_V4 / V3 and the baseline; IsaKernels picks one per call).
using AdamWRangeFn = void (*)(const AdamWArgs&, int64_t, int64_t);
using LionRangeFn = void (*)(const LionArgs&, int64_t, int64_t);

#define SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, NAME, P, G, S, R)                                                   \
  SHOESTRING_TARGET_V4 void NAME##_v4(const ARGS& a, int64_t b, int64_t e) { KERNEL<P, G, S, R>(a, b, e); }        \
  SHOESTRING_TARGET_V3 void NAME##_v3(const ARGS& a, int64_t b, int64_t e) { KERNEL<P, G, S, R>(a, b, e); }        \
  void NAME##_base(const ARGS& a, int64_t b, int64_t e) { KERNEL<P, G, S, R>(a, b, e); }

#define SHOESTRING_FUSED_VARIANTS(KERNEL, ARGS, PREFIX)                                                              \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_f32_f32_f32, float, float, float, Rounding::nearest)               \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_f32_f32_b16, float, float, bf16_bits, Rounding::nearest)           \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_f32_b16_f32, float, bf16_bits, float, Rounding::nearest)           \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_f32_b16_b16, float, bf16_bits, bf16_bits, Rounding::nearest)       \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_sr_f32_f32, bf16_bits, float, float, Rounding::stochastic)         \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_sr_f32_b16, bf16_bits, float, bf16_bits, Rounding::stochastic)     \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_sr_b16_f32, bf16_bits, bf16_bits, float, Rounding::stochastic)     \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_sr_b16_b16, bf16_bits, bf16_bits, bf16_bits, Rounding::stochastic) \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_rn_f32_f32, bf16_bits, float, float, Rounding::nearest)            \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_rn_f32_b16, bf16_bits, float, bf16_bits, Rounding::nearest)        \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_rn_b16_f32, bf16_bits, bf16_bits, float, Rounding::nearest)        \
  SHOESTRING_FUSED_VARIANT(KERNEL, ARGS, PREFIX##_rn_b16_b16, bf16_bits, bf16_bits, bf16_bits, Rounding::nearest)

SHOESTRING_FUSED_VARIANTS(adamw_range, AdamWArgs, adamw)
SHOESTRING_FUSED_VARIANTS(lion_range, LionArgs, lion)
#undef SHOESTRING_FUSED_VARIANTS
#undef SHOESTRING_FUSED_VARIANT

#define SHOESTRING_ISA(NAME) \
  { NAME##_v4, NAME##_v3, NAME##_base }
// Table index: param kind (0 fp32, 1 bf16 SR, 2 bf16 nearest) * 4 + grad bf16 * 2 + state bf16.
constexpr IsaKernels<AdamWRangeFn> kAdamW[12] = {
    SHOESTRING_ISA(adamw_f32_f32_f32), SHOESTRING_ISA(adamw_f32_f32_b16), SHOESTRING_ISA(adamw_f32_b16_f32),
    SHOESTRING_ISA(adamw_f32_b16_b16), SHOESTRING_ISA(adamw_sr_f32_f32),  SHOESTRING_ISA(adamw_sr_f32_b16),
    SHOESTRING_ISA(adamw_sr_b16_f32),  SHOESTRING_ISA(adamw_sr_b16_b16),  SHOESTRING_ISA(adamw_rn_f32_f32),
    SHOESTRING_ISA(adamw_rn_f32_b16),  SHOESTRING_ISA(adamw_rn_b16_f32),  SHOESTRING_ISA(adamw_rn_b16_b16)};
constexpr IsaKernels<LionRangeFn> kLion[12] = {
    SHOESTRING_ISA(lion_f32_f32_f32), SHOESTRING_ISA(lion_f32_f32_b16), SHOESTRING_ISA(lion_f32_b16_f32),
    SHOESTRING_ISA(lion_f32_b16_b16), SHOESTRING_ISA(lion_sr_f32_f32),  SHOESTRING_ISA(lion_sr_f32_b16),
    SHOESTRING_ISA(lion_sr_b16_f32),  SHOESTRING_ISA(lion_sr_b16_b16),  SHOESTRING_ISA(lion_rn_f32_f32),
    SHOESTRING_ISA(lion_rn_f32_b16),  SHOESTRING_ISA(lion_rn_b16_f32),  SHOESTRING_ISA(lion_rn_b16_b16)};
#undef SHOESTRING_ISA

std::atomic<FusedKernelIsa> g_isa_limit{FusedKernelIsa::avx512};

FusedKernelIsa cpu_isa() {
#ifdef SHOESTRING_FUSED_AVX512
  static const FusedKernelIsa isa = __builtin_cpu_supports("x86-64-v4")   ? FusedKernelIsa::avx512
                                    : __builtin_cpu_supports("x86-64-v3") ? FusedKernelIsa::avx2
                                                                          : FusedKernelIsa::portable;
  return isa;
#else
  return FusedKernelIsa::portable;
#endif
}

// Runs `run(task, begin, end)` over every element of every task (tensor) of
// `elements(task)` elements: chunks of kGrainSize elements in one region.
template <typename Elements, typename Run>
void run_elementwise(int64_t tasks, const Elements& elements, const Run& run) {
  const ChunkPlan plan = plan_chunks(tasks, kGrainSize, elements);
  int64_t total = 0;
  for (int64_t t = 0; t < tasks; ++t) total += elements(t);
  run_chunks(plan.chunks(), total, [&](ChunkQueue& queue) {
    for (int64_t c; (c = queue.take()) >= 0;) {
      for (int64_t k = plan.chunk_begin[c]; k < plan.chunk_begin[c + 1]; ++k) {
        const Segment& s = plan.segments[static_cast<size_t>(k)];
        run(s.task, s.begin, s.end);
      }
    }
  });
}

}  // namespace

FusedKernelIsa fused_kernels_isa() {
  const FusedKernelIsa limit = g_isa_limit.load(std::memory_order_relaxed);
  const FusedKernelIsa cpu = cpu_isa();
  return limit < cpu ? limit : cpu;
}

void fused_kernels_limit_isa(FusedKernelIsa isa) { g_isa_limit.store(isa, std::memory_order_relaxed); }

const char* fused_kernel_isa_name(FusedKernelIsa isa) {
  switch (isa) {
    case FusedKernelIsa::avx512: return "avx512";
    case FusedKernelIsa::avx2: return "avx2";
    default: return "portable";
  }
}

bool fused_adamw_supported(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                           const at::Tensor& exp_avg_sq) {
  return first_reason({{&param, "param"}, {&grad, "grad"}, {&exp_avg, "exp_avg"}, {&exp_avg_sq, "exp_avg_sq"}})
             .empty() &&
         exp_avg.scalar_type() == exp_avg_sq.scalar_type();
}

namespace {

// The checks of fused_adamw_step; `what` names the function (and entry).
void check_adamw(const FusedAdamWTensor& t, const std::string& what) {
  const std::string why = first_reason(
      {{&t.param, "param"}, {&t.grad, "grad"}, {&t.exp_avg, "exp_avg"}, {&t.exp_avg_sq, "exp_avg_sq"}});
  if (!why.empty()) fail("{}: {}", what, why);
  if (t.exp_avg.scalar_type() != t.exp_avg_sq.scalar_type()) {
    fail("{}: exp_avg is {} but exp_avg_sq is {}; both must have one dtype", what,
         c10::toString(t.exp_avg.scalar_type()), c10::toString(t.exp_avg_sq.scalar_type()));
  }
  if (t.scalars.step < 1) fail("{}: step must be >= 1 (1-based), got {}", what, t.scalars.step);
}

void check_lion(const FusedLionTensor& t, const std::string& what) {
  const std::string why = first_reason({{&t.param, "param"}, {&t.grad, "grad"}, {&t.exp_avg, "exp_avg"}});
  if (!why.empty()) fail("{}: {}", what, why);
}

std::string entry_name(const char* function, size_t index, size_t count) {
  return count == 1 ? std::string(function) : fmt::format("{} (tensor {} of {})", function, index, count);
}

}  // namespace

void fused_adamw_step_many(const std::vector<FusedAdamWTensor>& tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) check_adamw(tensors[i], entry_name("fused_adamw_step", i, tensors.size()));
  struct Task {
    AdamWArgs args;
    AdamWRangeFn fn;
  };
  std::vector<Task> tasks(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const FusedAdamWTensor& t = tensors[i];
    AdamWArgs& a = tasks[i].args;
    static_cast<AdamConstants&>(a) = adam_constants(t.scalars);
    a.param = t.param.data_ptr();
    a.grad = t.grad.data_ptr();
    a.exp_avg = t.exp_avg.data_ptr();
    a.exp_avg_sq = t.exp_avg_sq.data_ptr();
    a.param_key = stream_key(t.keys.param);
    a.exp_avg_key = stream_key(t.keys.state1);
    a.exp_avg_sq_key = stream_key(t.keys.state2);
    tasks[i].fn = kAdamW[variant_index(t.param, t.grad, t.exp_avg, t.keys.stochastic_rounding)].get();
  }
  run_elementwise(
      static_cast<int64_t>(tensors.size()), [&](int64_t t) { return tensors[static_cast<size_t>(t)].param.numel(); },
      [&](int64_t t, int64_t b, int64_t e) {
        const Task& task = tasks[static_cast<size_t>(t)];
        task.fn(task.args, b, e);
      });
  for (const FusedAdamWTensor& t : tensors) {
    if (t.param.numel() == 0) continue;
    bump_version(t.param);
    bump_version(t.exp_avg);
    bump_version(t.exp_avg_sq);
  }
}

void fused_adamw_step(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg, at::Tensor& exp_avg_sq,
                      const FusedAdamWScalars& s, const FusedRoundingKeys& keys) {
  fused_adamw_step_many({FusedAdamWTensor{param, grad, exp_avg, exp_avg_sq, s, keys}});
}

bool fused_lion_supported(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg) {
  return first_reason({{&param, "param"}, {&grad, "grad"}, {&exp_avg, "exp_avg"}}).empty();
}

void fused_lion_step_many(const std::vector<FusedLionTensor>& tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) check_lion(tensors[i], entry_name("fused_lion_step", i, tensors.size()));
  struct Task {
    LionArgs args;
    LionRangeFn fn;
  };
  std::vector<Task> tasks(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const FusedLionTensor& t = tensors[i];
    const FusedLionScalars& s = t.scalars;
    LionArgs& a = tasks[i].args;
    a.param = t.param.data_ptr();
    a.grad = t.grad.data_ptr();
    a.exp_avg = t.exp_avg.data_ptr();
    a.grad_scale = static_cast<float>(s.grad_scale);
    a.decay = static_cast<float>(1.0 - s.lr * s.weight_decay);
    a.neg_lr = static_cast<float>(-s.lr);
    a.beta1 = static_cast<float>(s.beta1);
    a.one_minus_beta1 = static_cast<float>(1.0 - s.beta1);
    a.beta2 = static_cast<float>(s.beta2);
    a.one_minus_beta2 = static_cast<float>(1.0 - s.beta2);
    a.param_key = stream_key(t.keys.param);
    a.exp_avg_key = stream_key(t.keys.state1);
    tasks[i].fn = kLion[variant_index(t.param, t.grad, t.exp_avg, t.keys.stochastic_rounding)].get();
  }
  run_elementwise(
      static_cast<int64_t>(tensors.size()), [&](int64_t t) { return tensors[static_cast<size_t>(t)].param.numel(); },
      [&](int64_t t, int64_t b, int64_t e) {
        const Task& task = tasks[static_cast<size_t>(t)];
        task.fn(task.args, b, e);
      });
  for (const FusedLionTensor& t : tensors) {
    if (t.param.numel() == 0) continue;
    bump_version(t.param);
    bump_version(t.exp_avg);
  }
}

void fused_lion_step(at::Tensor& param, const at::Tensor& grad, at::Tensor& exp_avg, const FusedLionScalars& s,
                     const FusedRoundingKeys& keys) {
  fused_lion_step_many({FusedLionTensor{param, grad, exp_avg, s, keys}});
}

}  // namespace shoestring
