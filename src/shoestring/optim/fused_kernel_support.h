// Internal to optim/: what the fused CPU kernels (fused_kernels.cpp: AdamW
// and Lion; fused_adamw8bit.cpp; fused_adafactor.cpp; fused_sparkles.cpp) share: the compile
// options their loops need, bf16 bit handling, rounding on store, the AdamW
// constants and the checks of the public entry points (optim/fused_kernels.h).
// Include it first in a kernel file, and compile that file as CMakeLists.txt
// compiles fused_kernels.cpp (-fno-math-errno, no shared PCH).
#pragma once
#include "shoestring/optim/fused_kernels.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <ATen/Functions.h>
#include <ATen/Parallel.h>

#include "shoestring/core/error.h"
#include "shoestring/optim/quantization.h"

// The loops below must vectorize and must evaluate exactly the written fp32
// operations: -O3 (also in -O2 builds), and no implicit fp contraction (GNU
// mode contracts a*b + c into an fma on FMA targets; the fmas that libtorch's
// own GCC-compiled kernels end up with are written out instead, see the
// header). sqrt must not set errno, which
// only a command-line flag achieves: CMakeLists.txt compiles this file with
// -fno-math-errno. The pragma applies to the functions defined (and the
// inline helpers included) from here on.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("O3", "fp-contract=off")
#endif

#include "shoestring/core/counter_rng.h"
#include "shoestring/core/stochastic_rounding_bits.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define SHOESTRING_FUSED_AVX512 1
// GCC 12's AVX-512 intrinsics initialize their "undefined" operands from
// themselves, which -Wmaybe-uninitialized reports at the header's lines
// (GCC bug 105593); silenced for the header only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

namespace shoestring {
namespace {

// Elements per parallel task: 16384 elements move 224-448 KiB (AdamW), big
// enough to amortize a task, small enough to split mid-size tensors.
constexpr int64_t kGrainSize = 16384;

// Each kernel is compiled three times: for x86-64-v4 (AVX-512 F/BW/CD/DQ/VL),
// x86-64-v3 (AVX2 + FMA) and the baseline, and picked per call by
// fused_kernels_isa() (IsaKernels::get), so fused_kernels_limit_isa reaches
// every kernel (tests and bench/optimizer_memory --isa run the AVX2 code on an
// AVX-512 machine). Only GCC on x86-64 Linux; elsewhere the three are the same.
#ifdef SHOESTRING_FUSED_AVX512
#define SHOESTRING_TARGET_V4 __attribute__((target("arch=x86-64-v4")))
#define SHOESTRING_TARGET_V3 __attribute__((target("arch=x86-64-v3")))
#else
#define SHOESTRING_TARGET_V4
#define SHOESTRING_TARGET_V3
#endif

#if defined(__GNUC__)
#define SHOESTRING_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define SHOESTRING_ALWAYS_INLINE inline
#endif

// The three compilations of one kernel (see SHOESTRING_TARGET_V4).
template <typename Fn>
struct IsaKernels {
  Fn avx512, avx2, portable;
  Fn get() const {
    switch (fused_kernels_isa()) {
      case FusedKernelIsa::avx512: return avx512;
      case FusedKernelIsa::avx2: return avx2;
      default: return portable;
    }
  }
};

// Work split into chunks that the intra-op threads take one at a time (an
// atomic counter: dynamic scheduling) inside one parallel region: a thread
// that starts late (a worker woken from sleep, a core shared with another
// process) takes fewer chunks instead of holding up the others, and many
// tensors' steps share one region (multi-tensor apply). Which thread runs a
// chunk never changes its result.
class ChunkQueue {
 public:
  explicit ChunkQueue(int64_t chunks) : chunks_(chunks) {}
  // The next chunk's index, or -1 when none is left.
  int64_t take() {
    const int64_t c = next_.fetch_add(1, std::memory_order_relaxed);
    return c < chunks_ ? c : -1;
  }

 private:
  std::atomic<int64_t> next_{0};
  int64_t chunks_;
};

// Below this much work (in elements of a plain step such as AdamW's or
// Lion's) a step runs on the calling thread. A parallel region ends only
// when every worker has joined it; on the 2-core VM the benches run on, an
// empty at::parallel_for region took 65-170 us (another process's compile
// running, workers asleep or not), the time AdamW needs for 200-500K
// elements on one thread. Stepped one tensor at a time (fused backward,
// bench/optimizer_memory's fused rows), the SDXL-shaped list's mid-size
// tensors were slower in two threads than in one.
constexpr int64_t kMinParallelWork = 16 * kGrainSize;

// Calls worker(queue) once on each of up to min(chunks, intra-op threads)
// threads; the workers take the chunks from `queue`. Inline (one call) when
// one thread would do, inside a parallel region, or when `work` (elements
// times the kernel's cost per element relative to AdamW's) is under
// kMinParallelWork. A worker keeps its per-thread scratch across the chunks
// it takes.
template <typename Worker>
void run_chunks(int64_t chunks, int64_t work, const Worker& worker) {
  if (chunks <= 0) return;
  ChunkQueue queue(chunks);
  const int64_t threads = std::min<int64_t>(chunks, at::get_num_threads());
  if (threads <= 1 || work < kMinParallelWork || at::in_parallel_region()) {
    worker(queue);
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) worker(queue);
  });
}

// Two phases of chunks in one region, the second opened by whoever finishes
// the first phase's last chunk (after its serial step between the phases):
// take_first() until it returns -1, calling finish_first() after each chunk
// (true for the one thread that finished the last: it runs the serial step,
// then open_second()); then take_second(), which waits for open_second().
// A thread only waits once every first-phase chunk has been taken by a
// running thread, so one thread alone, or any number, always finishes.
class PhasedChunks {
 public:
  PhasedChunks(int64_t first, int64_t second) : first_(first), second_(second) {}
  int64_t take_first() {
    const int64_t c = next_first_.fetch_add(1, std::memory_order_relaxed);
    return c < first_ ? c : -1;
  }
  bool finish_first() { return done_first_.fetch_add(1, std::memory_order_acq_rel) + 1 == first_; }
  void open_second() { open_.store(true, std::memory_order_release); }
  int64_t take_second() {
    for (int spins = 0; !open_.load(std::memory_order_acquire); ++spins) {
      if (spins % 64 == 63) {
        std::this_thread::yield();
      } else {
        cpu_relax();
      }
    }
    const int64_t c = next_second_.fetch_add(1, std::memory_order_relaxed);
    return c < second_ ? c : -1;
  }

 private:
  static void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  int64_t first_, second_;
  std::atomic<int64_t> next_first_{0}, done_first_{0}, next_second_{0};
  std::atomic<bool> open_{false};
};

// A range [begin, end) of units (elements or quantization blocks) of task
// `task` (one tensor of a multi-tensor step).
struct Segment {
  int64_t task, begin, end;
};

// The segments of `tasks` tasks of units(t) units each, grouped into chunks
// of at most `grain` units: a task of at least `grain` units is cut at
// multiples of `grain` (one segment per chunk, the last one shorter); smaller
// tasks are packed, whole, into shared chunks after those (a bias and a norm
// weight do not get a chunk each, and the short chunks come last, where they
// even out the threads' finishing times). Chunk c is
// segments[chunk_begin[c], chunk_begin[c + 1]).
struct ChunkPlan {
  std::vector<Segment> segments;
  std::vector<int64_t> chunk_begin{0};
  int64_t chunks() const { return static_cast<int64_t>(chunk_begin.size()) - 1; }
  void close_chunk() { chunk_begin.push_back(static_cast<int64_t>(segments.size())); }
};

template <typename Units>
ChunkPlan plan_chunks(int64_t tasks, int64_t grain, const Units& units) {
  ChunkPlan plan;
  std::vector<Segment> small;
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t n = units(t);
    if (n <= 0) continue;
    if (n < grain) {
      small.push_back({t, 0, n});
      continue;
    }
    for (int64_t b = 0; b < n; b += grain) {
      plan.segments.push_back({t, b, std::min(n, b + grain)});
      plan.close_chunk();
    }
  }
  int64_t packed = 0;  // units in the open chunk of small tasks
  for (const Segment& s : small) {
    if (packed > 0 && packed + s.end > grain) {
      plan.close_chunk();
      packed = 0;
    }
    plan.segments.push_back(s);
    packed += s.end;
  }
  if (packed > 0) plan.close_chunk();
  return plan;
}

// bf16 is handled as its raw bits (uint16_t); fp32 as float.
using bf16_bits = uint16_t;

// Builtins rather than std::sqrt / std::fma: the <cmath> wrappers were
// compiled without the options above, and GCC will not inline a function with
// different optimization options, which would leave a call in the loop.
#if defined(__GNUC__)
SHOESTRING_ALWAYS_INLINE float sqrt_f32(float x) { return __builtin_sqrtf(x); }
SHOESTRING_ALWAYS_INLINE float fma_f32(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
#else
SHOESTRING_ALWAYS_INLINE float sqrt_f32(float x) { return std::sqrt(x); }
SHOESTRING_ALWAYS_INLINE float fma_f32(float a, float b, float c) { return std::fma(a, b, c); }
#endif

SHOESTRING_ALWAYS_INLINE float load(const float* p, int64_t i) { return p[i]; }
SHOESTRING_ALWAYS_INLINE float load(const bf16_bits* p, int64_t i) {
  const uint32_t u = static_cast<uint32_t>(p[i]) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

SHOESTRING_ALWAYS_INLINE uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

// How a value is stored: fp32 as is; bf16 by stochastic rounding (with the
// element's random word, counter_random16) or by round-to-nearest-even
// (c10::BFloat16's rule, NaN -> 0x7FC0).
enum class Rounding { stochastic, nearest };

SHOESTRING_ALWAYS_INLINE void store(float* p, int64_t i, float x, uint32_t, Rounding) { p[i] = x; }
SHOESTRING_ALWAYS_INLINE void store(bf16_bits* p, int64_t i, float x, uint32_t random16, Rounding rounding) {
  const uint32_t b = bits_of(x);
  if (rounding == Rounding::stochastic) {
    p[i] = sr_bf16_from_fp32_bits(b, random16);
  } else {
    const uint32_t rne = (b + (((b >> 16) & 1u) + 0x7FFFu)) >> 16;
    const bool is_nan = (b & 0x7FFFFFFFu) > 0x7F800000u;
    p[i] = static_cast<bf16_bits>(is_nan ? 0x7FC0u : rne);
  }
}

// The random words of a block of stores into a T tensor with rounding R:
// computed (Random16Block, one hash per four elements) only when the stores
// round stochastically into bf16, else every word reads 0 and nothing is
// hashed. Kernels fill it per block of at most kRandom16BlockSize elements,
// then index it by the element's position in the block. The element loop that
// reads the words needs SHOESTRING_LOOP_NO_ALIAS: GCC cannot prove that the words
// (uint16) do not alias the bf16 tensors it writes, and gives up on the loop
// (seen with GCC 12 for the AVX2 clones) instead of checking at run time.
template <typename T, Rounding R>
struct StoreWords {
  static constexpr bool kNeeded = std::is_same_v<T, bf16_bits> && R == Rounding::stochastic;
  Random16Block block;
  const uint16_t* words = nullptr;
  SHOESTRING_ALWAYS_INLINE void fill(uint64_t key, int64_t first_index, int64_t n) {
    if constexpr (kNeeded) words = block.fill(key, static_cast<uint64_t>(first_index), n);
  }
  SHOESTRING_ALWAYS_INLINE uint32_t operator[](int64_t k) const {
    if constexpr (kNeeded) {
      return words[k];
    } else {
      return 0;
    }
  }
};

// The scalars of one AdamW step as the op chain passes them to libtorch:
// computed in double, then rounded to fp32 once (shared by the fp32/bf16 and
// the 8-bit kernels).
struct AdamConstants {
  float grad_scale, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size;
};

inline AdamConstants adam_constants(const FusedAdamWScalars& s) {
  const double bias_correction1 = 1.0 - std::pow(s.beta1, static_cast<double>(s.step));
  const double bias_correction2 = 1.0 - std::pow(s.beta2, static_cast<double>(s.step));
  AdamConstants c;
  c.grad_scale = static_cast<float>(s.grad_scale);
  c.decay = static_cast<float>(1.0 - s.lr * s.weight_decay);
  c.beta1 = static_cast<float>(s.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - s.beta1);
  c.beta2 = static_cast<float>(s.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - s.beta2);
  c.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  c.eps = static_cast<float>(s.eps);
  c.neg_step_size = static_cast<float>(-(s.lr / bias_correction1));  // = -float(lr / bc1): rounding is symmetric
  return c;
}

inline int variant_index(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& state, bool sr) {
  const int p = param.scalar_type() == at::kFloat ? 0 : (sr ? 1 : 2);
  return p * 4 + (grad.scalar_type() == at::kBFloat16 ? 2 : 0) + (state.scalar_type() == at::kBFloat16 ? 1 : 0);
}

// Why `t` cannot take the fused path, or "" when it can.
inline std::string unsupported_reason(const at::Tensor& t, const char* name, int64_t numel) {
  if (!t.defined()) return fmt::format("{} is undefined", name);
  if (!t.device().is_cpu()) return fmt::format("{} is on {}, expected the CPU", name, t.device().str());
  if (t.layout() != at::kStrided) return fmt::format("{} is not a strided (dense) tensor", name);
  if (t.scalar_type() != at::kFloat && t.scalar_type() != at::kBFloat16) {
    return fmt::format("{} is {}, expected float32 or bfloat16", name, c10::toString(t.scalar_type()));
  }
  if (!t.is_contiguous()) return fmt::format("{} is not contiguous", name);
  if (numel >= 0 && t.numel() != numel) return fmt::format("{} has {} elements, expected {}", name, t.numel(), numel);
  return {};
}

inline std::string first_reason(std::initializer_list<std::pair<const at::Tensor*, const char*>> tensors) {
  int64_t numel = -1;
  for (const auto& [t, name] : tensors) {
    std::string why = unsupported_reason(*t, name, numel);
    if (!why.empty()) return why;
    numel = t->numel();
  }
  return {};
}

inline uint64_t stream_key(const RoundingKey& k) { return counter_rng_key(k.seed, k.step, k.tensor_id); }

inline void bump_version(const at::Tensor& t) { t.unsafeGetTensorImpl()->bump_version(); }

}  // namespace
}  // namespace shoestring
