// What this CPU can do fast: its model name and the instruction-set features
// that decide which kernels libtorch (and ours) run, read once from the
// kernel's /proc/cpuinfo (so a feature the OS has not enabled, such as
// AVX-512 state under some hypervisors, does not count).
//
// Why it matters here: libtorch's bf16 matmul and convolution run on oneDNN's
// bf16 kernels only where the CPU has bf16 dot-product instructions
// (AVX-512 BF16, `avx512_bf16`, or AMX BF16, `amx_bf16`); elsewhere they fall
// back to scalar loops about an order of magnitude slower than fp32 (measured
// by bench/train_step on AVX2-only machines; `measure_bf16_matmul_slowdown`
// measures it on the machine at hand). Every benchmark prints
// `describe(cpu_features())` so numbers from different machines are never
// compared blindly.
#pragma once
#include <string>
#include <vector>

namespace shoestring {

/// The CPU as /proc/cpuinfo describes its first processor.
struct CpuFeatures {
  std::string model = "unknown";  ///< "model name" ("AMD EPYC 7B13", ...), "unknown" if absent
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512_bf16 = false;  ///< AVX-512 BF16 (vdpbf16ps): bf16 dot products
  bool avx512_fp16 = false;  ///< AVX-512 FP16 (Sapphire Rapids and later)
  bool amx_bf16 = false;     ///< AMX tiles with bf16 (Sapphire Rapids and later)

  /// True where bf16 matmul runs on bf16 dot-product units (AVX-512 BF16 or
  /// AMX BF16), i.e. where bf16 compute is faster than fp32 rather than slower.
  bool fast_bf16() const { return avx512_bf16 || amx_bf16; }
  /// The vector features above that are present, in a fixed order
  /// ("avx2 fma f16c avx512f ... amx_bf16"), "none" if none.
  std::string feature_list() const;
};

/// Parses the text of /proc/cpuinfo (the first processor's "model name" and
/// "flags" lines; later processors are ignored). Text without them gives the
/// defaults (model "unknown", no features). Never throws.
CpuFeatures parse_cpuinfo(const std::string& text);

/// This machine's features: parse_cpuinfo of /proc/cpuinfo, read once and
/// cached (thread-safe). An unreadable /proc/cpuinfo gives the defaults.
const CpuFeatures& cpu_features();

/// "CPU: AMD EPYC 7B13 | features: avx2 fma f16c | bf16 units: no", the line
/// every benchmark prints before its numbers.
std::string describe(const CpuFeatures& cpu);

/// Times a square fp32 and bf16 matmul (n x n, libtorch's CPU kernels, the
/// current intra-op threads, best of `repeats`) and returns bf16 time / fp32
/// time: > 1 means bf16 is slower. About 10-200 ms on a 2-core machine for
/// n = 256. Throws shoestring::Error for n < 16 or repeats < 1.
double measure_bf16_matmul_slowdown(int n = 256, int repeats = 3);

}  // namespace shoestring
