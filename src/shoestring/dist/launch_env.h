// The launch environment of one process of a data-parallel run: the
// variables torchrun (torch.distributed.elastic's local agent), `shoestring
// launch` or a SLURM job script set for each worker, parsed and checked.
// A process started without them is a single-process run (world size 1).
//
// Source: torch 1.13 torch/distributed/elastic/agent/server/local_elastic_agent.py
// (the variables) and torch/distributed/rendezvous.py `_create_c10d_store`
// (TORCHELASTIC_USE_AGENT_STORE, the per-attempt store prefix);
// research notes /work/shared/research/zero.md section 3.
#pragma once
#include <functional>
#include <optional>
#include <string>

#include <c10/core/Device.h>

namespace shoestring::dist {

/// Where this process sits in a run. Ranks are 0-based; rank 0 writes the
/// run folder.
struct LaunchEnvironment {
  int rank = 0;              ///< RANK: global rank, 0 <= rank < world_size
  int local_rank = 0;        ///< LOCAL_RANK: rank on this machine (default: RANK)
  int world_size = 1;        ///< WORLD_SIZE: number of processes in the run
  int local_world_size = 1;  ///< LOCAL_WORLD_SIZE: processes on this machine (default: WORLD_SIZE)
  std::string master_addr;   ///< MASTER_ADDR: host of the rendezvous store (needed when world_size > 1)
  int master_port = 0;       ///< MASTER_PORT: its TCP port, 1..65535 (needed when world_size > 1)
  /// TORCHELASTIC_USE_AGENT_STORE = "True": torchrun's agent already hosts
  /// the store on MASTER_PORT, so every rank connects as a client (under the
  /// prefix "/worker/attempt_<restart_count>"); else rank 0 hosts it.
  bool use_agent_store = false;
  int restart_count = 0;  ///< TORCHELASTIC_RESTART_COUNT: elastic restarts so far (0 on the first attempt)

  /// More than one process.
  bool distributed() const { return world_size > 1; }
};

/// Reads one environment variable: its value, or nullopt when unset.
using EnvironmentLookup = std::function<std::optional<std::string>(const std::string& name)>;

/// Parses the launch variables through `lookup` (see LaunchEnvironment for
/// each). Neither RANK nor WORLD_SIZE set: a single process. Throws
/// shoestring::Error naming the variable and what was expected for: a value
/// that is not a whole number (or out of range), RANK without WORLD_SIZE or
/// the reverse, WORLD_SIZE < 1, RANK >= WORLD_SIZE, LOCAL_RANK >=
/// LOCAL_WORLD_SIZE, LOCAL_WORLD_SIZE > WORLD_SIZE, MASTER_ADDR or
/// MASTER_PORT missing when WORLD_SIZE > 1, a MASTER_PORT outside 1..65535,
/// TORCHELASTIC_USE_AGENT_STORE other than True / False (1 / 0).
LaunchEnvironment parse_launch_environment(const EnvironmentLookup& lookup);

/// parse_launch_environment over this process's environment (getenv).
LaunchEnvironment launch_environment();

/// The device this process computes on. `resolved` is what the run's device
/// setting resolved to (core/device.h); `index_given` whether the setting
/// named an index ("cuda:N"); `visible_cuda_devices` how many this process
/// sees. One process or the CPU: `resolved`. Several processes on CUDA, one
/// GPU each, as torchrun's users expect: cuda:LOCAL_RANK; cuda:0 when the
/// process sees a single device (a launcher that hands each process its own
/// GPU through CUDA_VISIBLE_DEVICES, as SLURM does). Throws
/// shoestring::Error naming the variables when this machine's processes
/// outnumber its visible devices, and when the setting names an index that
/// is not this rank's.
c10::Device rank_device(const LaunchEnvironment& env, const c10::Device& resolved, bool index_given,
                        int visible_cuda_devices);

/// "rank 1 of 2 (local 1 of 2), store 127.0.0.1:29500 hosted by rank 0" for
/// logs and errors; "single process" when world_size == 1.
std::string describe(const LaunchEnvironment& env);

}  // namespace shoestring::dist
