#include "shoestring/core/threads.h"

#include <sched.h>

#include <thread>

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
  return n;
}

}  // namespace shoestring
