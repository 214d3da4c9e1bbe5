#include "shoestring/core/threads.h"

#include <dlfcn.h>
#include <sched.h>
#include <unistd.h>

#include <cctype>
#include <cstdlib>
#include <cstring>
#include <thread>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <ATen/Parallel.h>

namespace shoestring {

int configure_threads(int64_t requested) {
  int n = static_cast<int>(requested);
  if (n <= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) n = CPU_COUNT(&set);
    if (n <= 0) n = static_cast<int>(std::thread::hardware_concurrency());
    if (n <= 0) n = 1;
  }
  at::set_num_threads(n);
  // OpenBLAS (Debian's libopenblas0-pthread, under libtorch's matrix
  // products) keeps a pool of its own, sized at load from
  // OPENBLAS_NUM_THREADS / OMP_NUM_THREADS, else every core; at::set_num_threads
  // does not reach it. Unless the user sized it, it follows the count set here.
  const char* blas = std::getenv("OPENBLAS_NUM_THREADS");
  if (blas == nullptr || *blas == '\0') {
    using SetThreads = void (*)(int);
    if (auto* set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) set(n);
  }
  return n;
}

namespace {

bool unset(const char* name) {
  const char* v = std::getenv(name);
  return v == nullptr || *v == '\0';
}

/// OpenBLAS's name for the kernel set it runs, "" without OpenBLAS.
std::string openblas_corename() {
  using CoreName = char* (*)();
  auto* get = reinterpret_cast<CoreName>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  const char* name = get != nullptr ? get() : nullptr;
  return name != nullptr ? name : "";
}

/// True when this process runs under the dynamic loader invoked as a
/// program (`ld-linux-x86-64.so.2 shoestring ...`): /proc/self/exe is the
/// loader then, and re-executing it would treat argv[1] as the program.
bool run_by_the_loader() {
  char path[4096];
  const ssize_t n = ::readlink("/proc/self/exe", path, sizeof(path) - 1);
  if (n <= 0) return false;
  path[n] = '\0';
  const char* slash = std::strrchr(path, '/');
  const char* name = slash != nullptr ? slash + 1 : path;
  return std::strncmp(name, "ld-", 3) == 0 || std::strncmp(name, "ld.so", 5) == 0;
}

}  // namespace

std::string openblas_core_override(const std::string& chosen, const CpuFeatures& cpu) {
  if (chosen.empty()) return "";
  std::string lower = chosen;
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  for (const char* modern : {"haswell", "zen", "skylakex", "cooperlake", "sapphirerapids", "excavator"}) {
    if (lower == modern) return "";
  }
  if (cpu.avx512f && cpu.avx512bw && cpu.avx512vl && cpu.avx512dq) return "SkylakeX";
  if (cpu.avx2 && cpu.fma) return "Haswell";
  return "";
}

std::string blas_kernels() {
  const std::string core = openblas_corename();
  if (core.empty()) return "unknown";
  // Set at all, even empty, the variable chose: OpenBLAS 0.3.21 then skips
  // its CPU-model table (an empty value gave Cooperlake where unset gave
  // Prescott on a family 6 model 207 Xeon).
  return "OpenBLAS " + core + (std::getenv("OPENBLAS_CORETYPE") == nullptr ? "" : " (OPENBLAS_CORETYPE)");
}

// OPENBLAS_THREAD_TIMEOUT (how long OpenBLAS's idle threads spin, calling
// sched_yield, before they sleep; default 2^28 cycles) is left to OpenBLAS:
// measured on the 2-core Xeon (family 6 model 207, emoji model, fp32,
// unfused AdamW, 30 steps, 5 alternations), 2^18 or 2^22 cycles were 8 %
// faster and used 14-17 % less CPU on a quiet machine, but 45-50 % slower
// with one busy process on the other core (a sleeping thread then waits
// for the scheduler at every matrix product); 2^4 was like 2^18.
void set_cpu_runtime_environment(char** argv) {
  bool changed = false;
  if (unset("OMP_WAIT_POLICY")) {
    changed = setenv("OMP_WAIT_POLICY", "PASSIVE", 1) == 0;
    if (changed) setenv("GOMP_SPINCOUNT", kOmpSpinCount, 0);  // a value the user set is kept
  }
  if (std::getenv("OPENBLAS_CORETYPE") == nullptr) {  // an empty value is the user's too (blas_kernels)
    const std::string core = openblas_core_override(openblas_corename(), cpu_features());
    if (!core.empty() && setenv("OPENBLAS_CORETYPE", core.c_str(), 1) == 0) changed = true;
  }
  if (!changed || run_by_the_loader()) return;
  execv("/proc/self/exe", argv);
  // execv returned: it failed. Carry on with what the libraries chose; the
  // variables now set only affect children, which is what the user would get
  // anyway.
}

std::string omp_wait_policy() {
  const char* v = std::getenv("OMP_WAIT_POLICY");
  std::string policy = v != nullptr && *v != '\0' ? v : "default (spinning)";
  const char* spin = std::getenv("GOMP_SPINCOUNT");
  if (spin != nullptr && *spin != '\0') policy += std::string(", GOMP_SPINCOUNT ") + spin;
  return policy;
}

void configure_allocator() {
#if defined(__GLIBC__)
  constexpr int kMiB = 1 << 20;
  mallopt(M_MMAP_THRESHOLD, 32 * kMiB);
  mallopt(M_TRIM_THRESHOLD, 1024 * kMiB);
  mallopt(M_TOP_PAD, 64 * kMiB);
#endif
}

}  // namespace shoestring
