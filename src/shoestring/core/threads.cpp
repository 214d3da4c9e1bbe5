#include "shoestring/core/threads.h"

#include <dlfcn.h>
#include <sched.h>
#include <unistd.h>

#include <cstdlib>
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

void prefer_passive_omp_wait(char** argv) {
  const char* set = std::getenv("OMP_WAIT_POLICY");
  if (set != nullptr && *set != '\0') return;
  if (setenv("OMP_WAIT_POLICY", "PASSIVE", 1) != 0) return;
  setenv("GOMP_SPINCOUNT", kOmpSpinCount, 0);  // a value the user set is kept
  execv("/proc/self/exe", argv);
  // execv returned: it failed. Carry on with libgomp's default; the variable
  // now set only affects children, which is what the user would get anyway.
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
