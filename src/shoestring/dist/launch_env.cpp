#include "shoestring/dist/launch_env.h"

#include <cerrno>
#include <cstdlib>
#include <limits>

#include <fmt/format.h>

#include "shoestring/core/error.h"

namespace shoestring::dist {

namespace {

/// The whole-number value of variable `name` in [lo, hi], or `fallback` when
/// unset. `expected` says what the value must be, for the error.
std::optional<int> read_int(const EnvironmentLookup& lookup, const std::string& name, int lo, int hi,
                            const char* expected) {
  const std::optional<std::string> text = lookup(name);
  if (!text) return std::nullopt;
  const char* begin = text->c_str();
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(begin, &end, 10);
  const bool whole = !text->empty() && end && *end == '\0' && errno == 0 && (*begin != ' ') && (*begin != '+');
  if (!whole || v < lo || v > hi) {
    fail("environment variable {} = '{}': expected {} (set by torchrun, `shoestring launch` or your job script)", name,
         *text, expected);
  }
  return static_cast<int>(v);
}

}  // namespace

LaunchEnvironment parse_launch_environment(const EnvironmentLookup& lookup) {
  constexpr int kMax = std::numeric_limits<int>::max();
  LaunchEnvironment env;
  const std::optional<int> rank = read_int(lookup, "RANK", 0, kMax, "a whole number >= 0");
  const std::optional<int> world = read_int(lookup, "WORLD_SIZE", 1, kMax, "a whole number >= 1");
  if (!rank && !world) return env;  // a single process
  if (!world) fail("environment variable RANK = {} is set but WORLD_SIZE is not: set both (or neither)", *rank);
  if (!rank) fail("environment variable WORLD_SIZE = {} is set but RANK is not: set both (or neither)", *world);
  if (*rank >= *world) {
    fail("environment variable RANK = {}: expected a rank below WORLD_SIZE = {} (ranks are 0 .. {})", *rank, *world,
         *world - 1);
  }
  env.rank = *rank;
  env.world_size = *world;
  env.local_world_size = read_int(lookup, "LOCAL_WORLD_SIZE", 1, env.world_size,
                                  fmt::format("a whole number in 1 .. WORLD_SIZE = {}", env.world_size).c_str())
                             .value_or(env.world_size);
  env.local_rank = read_int(lookup, "LOCAL_RANK", 0, env.local_world_size - 1,
                            fmt::format("a whole number below LOCAL_WORLD_SIZE = {}", env.local_world_size).c_str())
                       .value_or(env.world_size == env.local_world_size ? env.rank : 0);
  if (!lookup("LOCAL_RANK") && env.world_size != env.local_world_size) {
    fail("environment variable LOCAL_RANK is not set but LOCAL_WORLD_SIZE = {} < WORLD_SIZE = {}: set LOCAL_RANK",
         env.local_world_size, env.world_size);
  }
  env.restart_count = read_int(lookup, "TORCHELASTIC_RESTART_COUNT", 0, kMax, "a whole number >= 0").value_or(0);
  if (const std::optional<std::string> agent = lookup("TORCHELASTIC_USE_AGENT_STORE")) {
    if (*agent == "True" || *agent == "true" || *agent == "1") {
      env.use_agent_store = true;
    } else if (*agent == "False" || *agent == "false" || *agent == "0" || agent->empty()) {
      env.use_agent_store = false;
    } else {
      fail("environment variable TORCHELASTIC_USE_AGENT_STORE = '{}': expected True or False (as torchrun sets it)",
           *agent);
    }
  }
  if (!env.distributed()) return env;
  const std::optional<std::string> addr = lookup("MASTER_ADDR");
  if (!addr || addr->empty()) {
    fail(
        "environment variable MASTER_ADDR is {} but WORLD_SIZE = {}: expected the host name or address of "
        "rank 0's machine (torchrun and `shoestring launch` set it)",
        addr ? "set but empty" : "not set", env.world_size);
  }
  env.master_addr = *addr;
  const std::optional<int> port = read_int(lookup, "MASTER_PORT", 1, 65535, "a TCP port in 1 .. 65535");
  if (!port) {
    fail("environment variable MASTER_PORT is not set but WORLD_SIZE = {}: expected a free TCP port on {}",
         env.world_size, env.master_addr);
  }
  env.master_port = *port;
  return env;
}

LaunchEnvironment launch_environment() {
  return parse_launch_environment([](const std::string& name) -> std::optional<std::string> {
    const char* v = std::getenv(name.c_str());
    if (!v) return std::nullopt;
    return std::string(v);
  });
}

c10::Device rank_device(const LaunchEnvironment& env, const c10::Device& resolved, bool index_given,
                        int visible_cuda_devices) {
  if (!env.distributed() || !resolved.is_cuda()) return resolved;
  if (visible_cuda_devices == 1) {
    if (index_given && resolved.index() != 0) {
      fail("device = \"{}\" with WORLD_SIZE = {}: this process sees one CUDA device, cuda:0", resolved.str(),
           env.world_size);
    }
    return c10::Device(c10::kCUDA, 0);
  }
  if (env.local_world_size > visible_cuda_devices) {
    fail(
        "LOCAL_WORLD_SIZE = {}: {} processes on this machine but {} CUDA devices visible; each rank needs a GPU "
        "of its own: start at most {} processes per machine (--nproc {}), or train on the CPU (device = \"cpu\")",
        env.local_world_size, env.local_world_size, visible_cuda_devices, visible_cuda_devices, visible_cuda_devices);
  }
  const c10::Device mine(c10::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank));
  if (index_given && resolved != mine) {
    fail(
        "device = \"{}\" with WORLD_SIZE = {}: each rank takes the GPU of its LOCAL_RANK (this one: {}); set "
        "device = \"cuda\" (or \"auto\"), or choose the GPUs with CUDA_VISIBLE_DEVICES",
        resolved.str(), env.world_size, mine.str());
  }
  return mine;
}

std::string describe(const LaunchEnvironment& env) {
  if (!env.distributed()) return "single process";
  return fmt::format("rank {} of {} (local {} of {}), store {}:{} hosted by {}{}", env.rank, env.world_size,
                     env.local_rank, env.local_world_size, env.master_addr, env.master_port,
                     env.use_agent_store ? "the torchrun agent" : "rank 0",
                     env.restart_count > 0 ? fmt::format(", restart {}", env.restart_count) : std::string());
}

}  // namespace shoestring::dist
