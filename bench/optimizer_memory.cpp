// bench/optimizer_memory: persistent memory per parameter and optimizer-step
// throughput, per optimizer configuration, on a ~100M-parameter set of
// tensors shaped like the SDXL UNet's.
//
//   build/bench/optimizer_memory [--params 100e6] [--steps 3] [--threads 0] [--only TEXT] [--json] [--flat]
//                                [--isa avx512|avx2|portable] [--generic]
//
// --generic: every optimizer takes its device-generic path (ATen op chains,
// what GPU tensors take; force_device_generic_optimizers), to measure the
// fused CPU kernels against the op chains side by side.
//
// --isa: the most the fused kernels may use (fused_kernels_limit_isa), to
// measure the AVX2 (x86-64-v3) or portable code on an AVX-512 machine; the
// header line says what they use.
//
// --flat: one [params / 1024, 1024] matrix instead of the list below, so no
// per-tensor costs (calls, parallel_for wake-ups, short tails) enter the
// time: what the kernels themselves reach. A kernel far below memcpy there
// while fp32 AdamW (the fewest operations per byte) is near it is limited by
// its arithmetic, not by memory.
//
// Parameter set: the SDXL base UNet's parameter list (model_channels 320,
// channel_mult [1, 2, 4], transformer depth [0, 2, 10] per level plus 10 in
// the middle block, 2 ResBlocks per level down / 3 up, context_dim 2048,
// adm_in_channels 2816, linear proj_in/proj_out, GEGLU feed-forward; as in
// Stability AI's generative-models sgm/modules/diffusionmodules/openaimodel.py
// and sgm/modules/attention.py), with every channel-like width (model
// channels, time-embedding width, context and adm widths) scaled by
// c0 / 320, c0 chosen so the total is closest to --params. c0 = 320 gives
// the real SDXL UNet (2,567,463,684 parameters).
//
// bytes_per_param: the memory ledger (core/memory_ledger.h) is installed;
// weights are allocated under `weights`, gradients under `gradients`, and the
// optimizer allocates its state under `optimizer_state`. After one warm-up
// step (which creates the state), the ledger's peaks are reset and one more
// step runs; bytes_per_param = (peak weights + peak gradients + peak
// optimizer_state) / parameters. Weights and state do not change size during
// a step, so this sum is the peak of the three together. Fused-backward
// configurations simulate the fused pattern: each parameter's gradient is
// created, the parameter is updated, the gradient is freed, then the next
// one, so at most one gradient is alive (its values come from a preallocated
// random source tensor charged to `other`, not counted).
//
// step_gbps: bytes the step must read and write (counted per configuration
// and tensor: parameter read + write, gradient read, each state tensor read +
// write, at their storage dtypes) / the median time of --steps timed steps
// (after the warm-up). For fused configurations only the optimizer update
// calls are timed, not the gradient creation. memcpy_gbps: the same number of
// bytes moved by std::memcpy of B/2 bytes from one buffer into another
// (read B/2 + write B/2 = B), one contiguous slice per at::parallel_for
// thread (same thread count); median of 3 after a warm-up copy.
// memcpy_ratio = step_gbps / memcpy_gbps (same process, same run).
//
// Optimizers written by other modules are compiled in when their headers
// exist (AdamW8bit: optim/adamw8bit.h, Adafactor: optim/adafactor.h, Lion:
// optim/lion.h, SPARKLES: optim/sparkles.h); a missing one is reported as
// skipped.
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/core/threads.h"
#include "shoestring/core/units.h"
#include "shoestring/optim/fused_kernels.h"
#include "shoestring/optim/optimizer.h"
#if __has_include("shoestring/optim/adamw8bit.h")
#include "shoestring/optim/adamw8bit.h"
#define SHOESTRING_BENCH_HAS_ADAMW8BIT 1
#endif
#if __has_include("shoestring/optim/adafactor.h")
#include "shoestring/optim/adafactor.h"
#define SHOESTRING_BENCH_HAS_ADAFACTOR 1
#endif
#include "bench_machine.h"
#if __has_include("shoestring/optim/lion.h")
#include "shoestring/optim/lion.h"
#define SHOESTRING_BENCH_HAS_LION 1
#endif
#if __has_include("shoestring/optim/sparkles.h")
#include "shoestring/optim/sparkles.h"
#define SHOESTRING_BENCH_HAS_SPARKLES 1
#endif

using namespace shoestring;

namespace {

// ---- SDXL-UNet-shaped parameter list -----------------------------------------

enum class Kind { conv, linear, norm, bias };

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  Kind kind;
};

class UNetShapes {
 public:
  explicit UNetShapes(int64_t c0) : c0_(c0) {}

  std::vector<ParamSpec> build() {
    const int64_t ch0 = c0_;
    const int64_t time_dim = 4 * c0_;
    const int64_t context = scale(2048);
    const int64_t adm = scale(2816);
    linear("time_embed.0", ch0, time_dim);
    linear("time_embed.2", time_dim, time_dim);
    linear("label_emb.0.0", adm, time_dim);
    linear("label_emb.0.2", time_dim, time_dim);
    conv("input_blocks.0.0", 4, ch0, 3);
    const int64_t mult[3] = {1, 2, 4};
    const int64_t depth[3] = {0, 2, 10};
    std::vector<int64_t> skips = {ch0};
    int64_t ch = ch0;
    int block = 1;
    for (int level = 0; level < 3; ++level) {
      for (int r = 0; r < 2; ++r, ++block) {
        const std::string prefix = "input_blocks." + std::to_string(block);
        resblock(prefix + ".0", ch, ch0 * mult[level], time_dim);
        ch = ch0 * mult[level];
        if (depth[level] > 0) transformer(prefix + ".1", ch, depth[level], context);
        skips.push_back(ch);
      }
      if (level < 2) {
        conv("input_blocks." + std::to_string(block) + ".0.op", ch, ch, 3);  // downsample
        skips.push_back(ch);
        ++block;
      }
    }
    resblock("middle_block.0", ch, ch, time_dim);
    transformer("middle_block.1", ch, 10, context);
    resblock("middle_block.2", ch, ch, time_dim);
    block = 0;
    for (int level = 2; level >= 0; --level) {
      for (int r = 0; r < 3; ++r, ++block) {
        const std::string prefix = "output_blocks." + std::to_string(block);
        const int64_t skip = skips.back();
        skips.pop_back();
        resblock(prefix + ".0", ch + skip, ch0 * mult[level], time_dim);
        ch = ch0 * mult[level];
        int sub = 1;
        if (depth[level] > 0) transformer(prefix + "." + std::to_string(sub++), ch, depth[level], context);
        if (level > 0 && r == 2) conv(prefix + "." + std::to_string(sub) + ".conv", ch, ch, 3);  // upsample
      }
    }
    norm("out.0", ch);
    conv("out.2", ch, 4, 3);
    return std::move(specs_);
  }

 private:
  int64_t scale(int64_t width) const { return std::max<int64_t>(1, (width * c0_ + 160) / 320); }
  void add(const std::string& name, std::vector<int64_t> shape, Kind kind) {
    specs_.push_back({name, std::move(shape), kind});
  }
  void linear(const std::string& n, int64_t in, int64_t out, bool bias = true) {
    add(n + ".weight", {out, in}, Kind::linear);
    if (bias) add(n + ".bias", {out}, Kind::bias);
  }
  void conv(const std::string& n, int64_t in, int64_t out, int64_t k) {
    add(n + ".weight", {out, in, k, k}, Kind::conv);
    add(n + ".bias", {out}, Kind::bias);
  }
  void norm(const std::string& n, int64_t c) {
    add(n + ".weight", {c}, Kind::norm);
    add(n + ".bias", {c}, Kind::bias);
  }
  void resblock(const std::string& n, int64_t in, int64_t out, int64_t emb) {
    norm(n + ".in_layers.0", in);
    conv(n + ".in_layers.2", in, out, 3);
    linear(n + ".emb_layers.1", emb, out);
    norm(n + ".out_layers.0", out);
    conv(n + ".out_layers.3", out, out, 3);
    if (in != out) conv(n + ".skip_connection", in, out, 1);
  }
  void transformer(const std::string& n, int64_t c, int depth, int64_t context) {
    norm(n + ".norm", c);
    linear(n + ".proj_in", c, c);
    for (int d = 0; d < depth; ++d) {
      const std::string b = n + ".transformer_blocks." + std::to_string(d);
      for (const char* attn : {".attn1", ".attn2"}) {
        const int64_t kv_in = std::string(attn) == ".attn1" ? c : context;
        linear(b + attn + ".to_q", c, c, false);
        linear(b + attn + ".to_k", kv_in, c, false);
        linear(b + attn + ".to_v", kv_in, c, false);
        linear(b + attn + ".to_out.0", c, c);
      }
      linear(b + ".ff.net.0.proj", c, 8 * c);  // GEGLU: inner 4c, value and gate
      linear(b + ".ff.net.2", 4 * c, c);
      norm(b + ".norm1", c);
      norm(b + ".norm2", c);
      norm(b + ".norm3", c);
    }
    linear(n + ".proj_out", c, c);
  }

  int64_t c0_;
  std::vector<ParamSpec> specs_;
};

int64_t numel_of(const ParamSpec& s) {
  int64_t n = 1;
  for (int64_t d : s.shape) n *= d;
  return n;
}

int64_t total_params(const std::vector<ParamSpec>& specs) {
  int64_t n = 0;
  for (const auto& s : specs) n += numel_of(s);
  return n;
}

// Base channel count whose parameter total is closest to `target`.
int64_t choose_base_channels(int64_t target) {
  int64_t best = 1;
  int64_t best_err = -1;
  for (int64_t c0 = 1; c0 <= 640; ++c0) {
    const int64_t err = std::llabs(total_params(UNetShapes(c0).build()) - target);
    if (best_err < 0 || err < best_err) best = c0, best_err = err;
  }
  return best;
}

// ---- configurations --------------------------------------------------------

enum class Algo { adamw, adamw8bit, adafactor, lion, lion_kernel, sparkles };

// Lion stepped by optim/fused_kernels.h's fused_lion_step (the kernel the
// Lion class can call): the kernel's throughput, independent of the class.
class LionKernelProbe : public Optimizer {
 public:
  LionKernelProbe(std::vector<OptimParam> params, OptimizerOptions o) : Optimizer(std::move(params), o) {}
  void update(size_t index, const at::Tensor& grad, double lr, int64_t step) override {
    at::Tensor& p = params_[index].param;
    if (!has_state(index, "exp_avg")) {
      ScopedMemoryCategory cat(MemoryCategory::optimizer_state);
      state(index, "exp_avg") = torch::zeros(p.sizes(), p.options().dtype(options_.state_dtype).requires_grad(false));
    }
    FusedLionScalars s;
    s.lr = lr;
    s.weight_decay = params_[index].weight_decay;
    FusedRoundingKeys k;
    k.stochastic_rounding = options_.stochastic_rounding;
    const uint64_t id = static_cast<uint64_t>(index) * 16;
    k.param = {options_.seed, static_cast<uint64_t>(step), id};
    k.state1 = {options_.seed, static_cast<uint64_t>(step), id + 1};
    fused_lion_step(p, grad, state(index, "exp_avg"), s, k);
  }
};

struct Config {
  std::string name;
  Algo algo;
  at::ScalarType weight_dtype;  // also the gradient dtype
  at::ScalarType state_dtype;   // full-size state (AdamW, Lion, Adafactor's unfactored)
  bool fused;
};

bool available(Algo a) {
  switch (a) {
    case Algo::adamw:
    case Algo::lion_kernel: return true;
    case Algo::adamw8bit:
#ifdef SHOESTRING_BENCH_HAS_ADAMW8BIT
      return true;
#else
      return false;
#endif
    case Algo::adafactor:
#ifdef SHOESTRING_BENCH_HAS_ADAFACTOR
      return true;
#else
      return false;
#endif
    case Algo::lion:
#ifdef SHOESTRING_BENCH_HAS_LION
      return true;
#else
      return false;
#endif
    case Algo::sparkles:
#ifdef SHOESTRING_BENCH_HAS_SPARKLES
      return true;
#else
      return false;
#endif
  }
  return false;
}

std::unique_ptr<Optimizer> make_optimizer(const Config& c, std::vector<OptimParam> params) {
  OptimizerOptions o;
  o.stochastic_rounding = true;
  o.seed = 1234;
  o.state_dtype = c.state_dtype;
  switch (c.algo) {
    case Algo::adamw: return std::make_unique<AdamW>(std::move(params), AdamWOptions{}, o);
    case Algo::adamw8bit:
#ifdef SHOESTRING_BENCH_HAS_ADAMW8BIT
      return std::make_unique<AdamW8bit>(std::move(params), AdamW8bitOptions{}, o);
#else
      break;
#endif
    case Algo::adafactor: {
#ifdef SHOESTRING_BENCH_HAS_ADAFACTOR
      AdafactorOptions a;  // kohya's usual SDXL settings: fixed lr, no parameter scaling
      a.relative_step = false;
      a.scale_parameter = false;
      a.warmup_init = false;
      return std::make_unique<Adafactor>(std::move(params), a, o);
#else
      break;
#endif
    }
    case Algo::lion:
#ifdef SHOESTRING_BENCH_HAS_LION
      return std::make_unique<Lion>(std::move(params), LionOptions{}, o);
#else
      break;
#endif
    case Algo::lion_kernel: return std::make_unique<LionKernelProbe>(std::move(params), o);
    case Algo::sparkles:
#ifdef SHOESTRING_BENCH_HAS_SPARKLES
      return std::make_unique<Sparkles>(std::move(params), SparklesOptions{}, o);  // sparkles.py's defaults
#else
      break;
#endif
  }
  fail("optimizer_memory: optimizer for '{}' is not built", c.name);
}

// Bytes one step must read and write for parameter `i`: parameter read and
// written, gradient read, and every state tensor read and written, at the
// dtypes actually stored (state as the optimizer holds it after a step).
int64_t step_bytes(const Optimizer& opt, const std::vector<std::pair<std::string, at::Tensor>>& state,
                   at::ScalarType grad_dtype) {
  int64_t bytes = 0;
  for (const auto& p : opt.params()) {
    const int64_t n = p.param.numel();
    bytes += 2 * n * p.param.element_size() + n * static_cast<int64_t>(c10::elementSize(grad_dtype));
  }
  for (const auto& [name, t] : state) bytes += 2 * t.numel() * t.element_size();
  return bytes;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// GB/s of std::memcpy moving `bytes` (read + write): a buffer of bytes/2 is
// copied into another, each of the at::parallel_for threads copying one
// contiguous slice with one std::memcpy call (glibc then uses non-temporal
// stores for large slices; on the 2-core dev machine this beat 1 MiB chunks,
// 51 vs 42 GB/s, so it is the stricter baseline). Median of 3 timed copies
// after one warm-up copy.
double memcpy_gbps(int64_t bytes) {
  const int64_t half = std::max<int64_t>(bytes / 2, 1 << 20);
  std::unique_ptr<char[]> src(new char[static_cast<size_t>(half)]);
  std::unique_ptr<char[]> dst(new char[static_cast<size_t>(half)]);
  std::memset(src.get(), 1, static_cast<size_t>(half));
  std::memset(dst.get(), 0, static_cast<size_t>(half));
  const int64_t threads = std::max(1, at::get_num_threads());
  const int64_t slice = (half + threads - 1) / threads;
  auto copy = [&] {
    at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) {
        const int64_t off = t * slice;
        if (off < half) {
          std::memcpy(dst.get() + off, src.get() + off, static_cast<size_t>(std::min(slice, half - off)));
        }
      }
    });
  };
  copy();
  std::vector<double> t;
  for (int r = 0; r < 3; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    copy();
    t.push_back(seconds_since(t0));
  }
  return 2.0 * static_cast<double>(half) / median(t) / 1e9;
}

double load_average() {
  std::ifstream in("/proc/loadavg");
  double l = -1;
  in >> l;
  return l;
}

nlohmann::json run_config(const Config& c, const std::vector<ParamSpec>& specs, int steps) {
  auto& ledger = MemoryLedger::global();
  const double lr = 1e-4;
  int64_t n_params = 0, max_numel = 0;
  for (const auto& s : specs) {
    n_params += numel_of(s);
    max_numel = std::max(max_numel, numel_of(s));
  }
  torch::NoGradGuard no_grad;
  // Gradient values: one random source, sliced per parameter (not counted).
  at::Tensor source;
  {
    ScopedMemoryCategory cat(MemoryCategory::other);
    source = (torch::randn({max_numel}) * 1e-3).to(c.weight_dtype);
  }
  std::vector<OptimParam> params;
  {
    ScopedMemoryCategory cat(MemoryCategory::weights);
    for (const auto& s : specs) {
      at::Tensor w = torch::empty(s.shape, torch::TensorOptions(c.weight_dtype));
      w.normal_(0.0, 0.02);
      w.requires_grad_(true);
      params.push_back({s.name, w, s.shape.size() >= 2 ? 0.01 : 0.0});
    }
  }
  auto make_grad = [&](const at::Tensor& p) {
    ScopedMemoryCategory cat(MemoryCategory::gradients);
    at::Tensor g = torch::empty(p.sizes(), p.options().requires_grad(false));
    g.view({-1}).copy_(source.narrow(0, 0, p.numel()));
    return g;
  };
  if (!c.fused) {
    for (auto& p : params) p.param.mutable_grad() = make_grad(p.param);
  }
  std::unique_ptr<Optimizer> opt = make_optimizer(c, params);

  // One step; returns the seconds spent in the optimizer.
  auto step = [&]() -> double {
    ScopedMemoryCategory cat(MemoryCategory::temporaries);
    if (!c.fused) {
      auto t0 = std::chrono::steady_clock::now();
      opt->step(lr);
      return seconds_since(t0);
    }
    const int64_t s = opt->step_count() + 1;
    double t = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      at::Tensor g = make_grad(params[i].param);
      auto t0 = std::chrono::steady_clock::now();
      opt->update(i, g, lr, s);
      t += seconds_since(t0);
    }  // each gradient is freed here, before the next one exists
    opt->set_step_count(s);
    return t;
  };

  step();  // warm-up: creates the optimizer state
  ledger.reset_peaks();
  std::vector<double> times;
  for (int s = 0; s < steps; ++s) times.push_back(step());
  const int64_t weights = ledger.peak_bytes(MemoryCategory::weights);
  const int64_t grads = ledger.peak_bytes(MemoryCategory::gradients);
  const int64_t state = ledger.peak_bytes(MemoryCategory::optimizer_state);
  const int64_t temporaries = ledger.peak_bytes(MemoryCategory::temporaries);
  const auto state_tensors = opt->state_tensors();
  const int64_t moved = step_bytes(*opt, state_tensors, c.weight_dtype);
  const double t = median(times);
  const double gbps = static_cast<double>(moved) / t / 1e9;

  // Free everything before the memcpy baseline.
  opt.reset();
  params.clear();
  source = at::Tensor();
  const double copy_gbps = memcpy_gbps(moved);

  const double np = static_cast<double>(n_params);
  nlohmann::json r = {{"config", c.name},
                      {"params", n_params},
                      {"bytes_per_param", static_cast<double>(weights + grads + state) / np},
                      {"weights_bytes_per_param", static_cast<double>(weights) / np},
                      {"gradients_bytes_per_param", static_cast<double>(grads) / np},
                      {"optimizer_state_bytes_per_param", static_cast<double>(state) / np},
                      {"peak_temporaries_bytes", temporaries},
                      {"step_seconds", t},
                      {"step_bytes", moved},
                      {"step_bytes_per_param", static_cast<double>(moved) / np},
                      {"step_gbps", gbps},
                      {"memcpy_gbps", copy_gbps},
                      {"memcpy_ratio", gbps / copy_gbps},
                      {"memcpy_method", "std::memcpy, one slice per thread, at::parallel_for"},
                      {"threads", at::get_num_threads()},
                      {"fused_kernels_isa", fused_kernel_isa_name(fused_kernels_isa())},
                      {"timed_steps", steps}};
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  shoestring::bench::prepare_process(argv);
  CLI::App app{"optimizer memory and step-throughput benchmark"};
  double target = 100e6;
  int steps = 3;
  int64_t threads = 0;
  std::string only;
  bool json = false;
  bool flat = false;
  std::string isa = "avx512";
  bool generic = false;
  app.add_option("--params", target, "approximate number of parameters (default 100e6)")->check(CLI::Range(1e4, 3e9));
  app.add_option("--steps", steps, "timed optimizer steps per configuration (median)")->check(CLI::Range(1, 1000));
  app.add_option("--threads", threads, "intra-op threads (0 = every allowed CPU)")->check(CLI::NonNegativeNumber);
  app.add_option("--only", only, "run only configurations whose name contains this text");
  app.add_flag("--json", json, "one JSON object per configuration, one per line");
  app.add_flag("--flat", flat,
               "one [--params / 1024, 1024] matrix instead of the SDXL-shaped list (no per-tensor costs)");
  app.add_option("--isa", isa, "the most the fused kernels may use (fused_kernels_limit_isa)")
      ->check(CLI::IsMember({"avx512", "avx2", "portable"}));
  app.add_flag("--generic", generic, "the device-generic optimizer paths (ATen op chains), not the fused CPU kernels");
  CLI11_PARSE(app, argc, argv);
  if (generic && app.count("--isa") > 0) {
    std::cerr << "optimizer_memory: --isa limits the fused kernels, which --generic does not run\n";
    return 2;
  }
  force_device_generic_optimizers(generic);
  fused_kernels_limit_isa(isa == "avx512" ? FusedKernelIsa::avx512
                          : isa == "avx2" ? FusedKernelIsa::avx2
                                          : FusedKernelIsa::portable);
  shoestring::bench::print_machine(json);
  try {
    MemoryLedger::global().install();
    configure_threads(threads);
    const int64_t c0 = flat ? 0 : choose_base_channels(static_cast<int64_t>(target));
    const std::vector<ParamSpec> specs =
        flat ? std::vector<ParamSpec>{{"flat.weight",
                                       {std::max<int64_t>(1, static_cast<int64_t>(target) / 1024), 1024},
                                       Kind::linear}}
             : UNetShapes(c0).build();
    int64_t by_kind[4] = {0, 0, 0, 0};
    for (const auto& s : specs) by_kind[static_cast<int>(s.kind)] += numel_of(s);
    const int64_t total = total_params(specs);
    const double load_before = load_average();
    const std::string paths = generic ? std::string("op chains (--generic)")
                                      : fmt::format("fused kernels {}", fused_kernel_isa_name(fused_kernels_isa()));
    if (!json && flat) {
      std::cout << fmt::format("one [{}, 1024] matrix, {} parameters\n  threads {}, {}, load average {:.2f} at start\n",
                               specs[0].shape[0], total, at::get_num_threads(), paths, load_before);
    } else if (!json) {
      std::cout << fmt::format(
          "SDXL-UNet-shaped parameter set: model_channels {} (SDXL: 320), {} tensors, {} parameters\n"
          "  conv {:.1f}%, linear {:.1f}%, norm {:.2f}%, bias {:.2f}%\n"
          "  threads {}, {}, load average {:.2f} at start\n",
          c0, specs.size(), total, 100.0 * by_kind[0] / total, 100.0 * by_kind[1] / total, 100.0 * by_kind[2] / total,
          100.0 * by_kind[3] / total, at::get_num_threads(), paths, load_before);
    }
    const std::vector<Config> configs = {
        {"fp32 AdamW", Algo::adamw, at::kFloat, at::kFloat, false},
        {"bf16-sr AdamW", Algo::adamw, at::kBFloat16, at::kBFloat16, false},
        {"bf16-sr AdamW8bit", Algo::adamw8bit, at::kBFloat16, at::kBFloat16, false},
        {"bf16-sr AdamW8bit fused", Algo::adamw8bit, at::kBFloat16, at::kBFloat16, true},
        {"bf16-sr Adafactor fused", Algo::adafactor, at::kBFloat16, at::kBFloat16, true},
        {"bf16-sr Lion", Algo::lion, at::kBFloat16, at::kBFloat16, false},
        // Not one of the goal's six: the same Lion step through fused_lion_step.
        {"bf16-sr Lion (fused_lion_step)", Algo::lion_kernel, at::kBFloat16, at::kBFloat16, false},
        {"bf16-sr SPARKLES", Algo::sparkles, at::kBFloat16, at::kBFloat16, false},
    };
    if (!only.empty() && std::none_of(configs.begin(), configs.end(),
                                      [&](const Config& c) { return c.name.find(only) != std::string::npos; })) {
      std::string names;
      for (const auto& c : configs) names += (names.empty() ? "" : ", ") + c.name;
      fail("--only '{}' matches no configuration (configurations: {})", only, names);
    }
    std::vector<nlohmann::json> rows;
    for (const auto& c : configs) {
      if (!only.empty() && c.name.find(only) == std::string::npos) continue;
      if (!available(c.algo)) {
        nlohmann::json r = {{"config", c.name}, {"skipped", "optimizer not built"}};
        if (json) std::cout << r.dump() << std::endl;
        rows.push_back(r);
        continue;
      }
      nlohmann::json r = run_config(c, specs, steps);
      r["model_channels"] = c0;
      r["load_average_start"] = load_before;
      if (json) std::cout << r.dump() << std::endl;
      rows.push_back(r);
    }
    if (!json) {
      std::cout << fmt::format("\n{:<31} {:>9} {:>7} {:>7} {:>7} {:>9} {:>8} {:>8} {:>7}\n", "config", "B/param",
                               "weights", "grads", "state", "step ms", "GB/s", "memcpy", "ratio");
      for (const auto& r : rows) {
        if (r.contains("skipped")) {
          std::cout << fmt::format("{:<31} skipped: {}\n", r["config"].get<std::string>(),
                                   r["skipped"].get<std::string>());
          continue;
        }
        std::cout << fmt::format(
            "{:<31} {:>9.3f} {:>7.3f} {:>7.3f} {:>7.3f} {:>9.1f} {:>8.2f} {:>8.2f} {:>7.2f}\n",
            r["config"].get<std::string>(), r["bytes_per_param"].get<double>(),
            r["weights_bytes_per_param"].get<double>(), r["gradients_bytes_per_param"].get<double>(),
            r["optimizer_state_bytes_per_param"].get<double>(), 1e3 * r["step_seconds"].get<double>(),
            r["step_gbps"].get<double>(), r["memcpy_gbps"].get<double>(), r["memcpy_ratio"].get<double>());
      }
      std::cout << fmt::format(
          "\nB/param: ledger peak of weights + gradients + optimizer state during a step, per parameter.\n"
          "GB/s: bytes the step must read + write / median step time; memcpy: std::memcpy of the same bytes\n"
          "(one slice per thread, same threads); ratio = GB/s / memcpy. Load average at end: {:.2f}\n",
          load_average());
    }
  } catch (const shoestring::Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
