// parse_launch_environment against the variables torchrun sets
// (/work/shared/research/zero.md section 3) and the errors for bad ones.
#include <map>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "shoestring/core/error.h"
#include "shoestring/dist/launch_env.h"

namespace shoestring::dist {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

LaunchEnvironment parse(const std::map<std::string, std::string>& vars) {
  return parse_launch_environment([&](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

std::string error_of(const std::map<std::string, std::string>& vars) {
  try {
    parse(vars);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(LaunchEnvironment, NoVariablesIsOneProcess) {
  const LaunchEnvironment env = parse({});
  EXPECT_EQ(env.rank, 0);
  EXPECT_EQ(env.world_size, 1);
  EXPECT_FALSE(env.distributed());
  EXPECT_EQ(describe(env), "single process");
}

TEST(LaunchEnvironment, ReadsTorchrunStaticLaunch) {
  // What Debian torchrun 1.13 gives worker 1 of `--nproc_per_node 2` (probed).
  const LaunchEnvironment env = parse({{"RANK", "1"},
                                       {"LOCAL_RANK", "1"},
                                       {"WORLD_SIZE", "2"},
                                       {"LOCAL_WORLD_SIZE", "2"},
                                       {"MASTER_ADDR", "127.0.0.1"},
                                       {"MASTER_PORT", "29500"},
                                       {"TORCHELASTIC_USE_AGENT_STORE", "True"},
                                       {"TORCHELASTIC_RESTART_COUNT", "1"},
                                       {"GROUP_RANK", "0"}});
  EXPECT_EQ(env.rank, 1);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.world_size, 2);
  EXPECT_EQ(env.local_world_size, 2);
  EXPECT_EQ(env.master_addr, "127.0.0.1");
  EXPECT_EQ(env.master_port, 29500);
  EXPECT_TRUE(env.use_agent_store);
  EXPECT_EQ(env.restart_count, 1);
  EXPECT_TRUE(env.distributed());
  EXPECT_EQ(describe(env), "rank 1 of 2 (local 1 of 2), store 127.0.0.1:29500 hosted by the torchrun agent, restart 1");
}

TEST(LaunchEnvironment, StandaloneLaunchHostsTheStoreOnRankZero) {
  const LaunchEnvironment env = parse({{"RANK", "0"},
                                       {"WORLD_SIZE", "3"},
                                       {"MASTER_ADDR", "localhost"},
                                       {"MASTER_PORT", "41234"},
                                       {"TORCHELASTIC_USE_AGENT_STORE", "False"}});
  EXPECT_FALSE(env.use_agent_store);
  EXPECT_EQ(env.local_rank, 0);  // defaults: one machine
  EXPECT_EQ(env.local_world_size, 3);
  EXPECT_EQ(env.restart_count, 0);
}

TEST(LaunchEnvironment, MultiNodeSlurmStyle) {
  // srun with RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID ...: rank 5 of 8, 4 per node.
  const LaunchEnvironment env = parse({{"RANK", "5"},
                                       {"LOCAL_RANK", "1"},
                                       {"WORLD_SIZE", "8"},
                                       {"LOCAL_WORLD_SIZE", "4"},
                                       {"MASTER_ADDR", "node01"},
                                       {"MASTER_PORT", "29500"}});
  EXPECT_EQ(env.rank, 5);
  EXPECT_EQ(env.local_rank, 1);
  EXPECT_EQ(env.local_world_size, 4);
}

TEST(LaunchEnvironment, WorldSizeOneNeedsNoStore) {
  const LaunchEnvironment env = parse({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
  EXPECT_FALSE(env.distributed());
}

TEST(LaunchEnvironment, ErrorsNameTheVariableAndTheExpectation) {
  const std::map<std::string, std::string> ok = {
      {"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500"}};
  auto with = [&](const std::string& k, const std::string& v) {
    auto m = ok;
    m[k] = v;
    return m;
  };
  auto without = [&](const std::string& k) {
    auto m = ok;
    m.erase(k);
    return m;
  };
  EXPECT_THAT(error_of(with("RANK", "2")),
              AllOf(HasSubstr("RANK = 2"), HasSubstr("below WORLD_SIZE = 2"), HasSubstr("0 .. 1")));
  EXPECT_THAT(error_of(with("RANK", "one")), AllOf(HasSubstr("RANK = 'one'"), HasSubstr("whole number >= 0")));
  EXPECT_THAT(error_of(with("RANK", "-1")), HasSubstr("RANK = '-1'"));
  EXPECT_THAT(error_of(with("RANK", "1x")), HasSubstr("RANK = '1x'"));
  EXPECT_THAT(error_of(with("RANK", "")), HasSubstr("RANK = ''"));
  EXPECT_THAT(error_of(with("RANK", "99999999999")), HasSubstr("RANK = '99999999999'"));
  EXPECT_THAT(error_of(with("WORLD_SIZE", "0")), AllOf(HasSubstr("WORLD_SIZE = '0'"), HasSubstr(">= 1")));
  EXPECT_THAT(error_of(without("WORLD_SIZE")), AllOf(HasSubstr("RANK = 0 is set but WORLD_SIZE is not")));
  EXPECT_THAT(error_of(without("RANK")), AllOf(HasSubstr("WORLD_SIZE = 2 is set but RANK is not")));
  EXPECT_THAT(error_of(without("MASTER_ADDR")),
              AllOf(HasSubstr("MASTER_ADDR is not set but WORLD_SIZE = 2"), HasSubstr("rank 0's machine")));
  EXPECT_THAT(error_of(with("MASTER_ADDR", "")), HasSubstr("MASTER_ADDR is set but empty but WORLD_SIZE = 2"));
  EXPECT_THAT(error_of(without("MASTER_PORT")), HasSubstr("MASTER_PORT is not set but WORLD_SIZE = 2"));
  EXPECT_THAT(error_of(with("MASTER_PORT", "70000")),
              AllOf(HasSubstr("MASTER_PORT = '70000'"), HasSubstr("1 .. 65535")));
  EXPECT_THAT(error_of(with("MASTER_PORT", "0")), HasSubstr("MASTER_PORT = '0'"));
  EXPECT_THAT(error_of(with("LOCAL_WORLD_SIZE", "3")),
              AllOf(HasSubstr("LOCAL_WORLD_SIZE = '3'"), HasSubstr("1 .. WORLD_SIZE = 2")));
  auto local = with("LOCAL_WORLD_SIZE", "1");
  local["LOCAL_RANK"] = "1";
  EXPECT_THAT(error_of(local), AllOf(HasSubstr("LOCAL_RANK = '1'"), HasSubstr("below LOCAL_WORLD_SIZE = 1")));
  EXPECT_THAT(error_of(with("LOCAL_WORLD_SIZE", "1")), HasSubstr("LOCAL_RANK is not set"));
  EXPECT_THAT(error_of(with("TORCHELASTIC_USE_AGENT_STORE", "yes")),
              AllOf(HasSubstr("TORCHELASTIC_USE_AGENT_STORE = 'yes'"), HasSubstr("True or False")));
  EXPECT_THAT(error_of(with("TORCHELASTIC_RESTART_COUNT", "a")), HasSubstr("TORCHELASTIC_RESTART_COUNT = 'a'"));
  // A single process does not need the store variables.
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "1"}}), "(no error)");
}

/// Rank `rank` of `world`, `local` processes on its machine.
LaunchEnvironment ranks(int rank, int world, int local_rank, int local_world) {
  LaunchEnvironment env;
  env.rank = rank;
  env.world_size = world;
  env.local_rank = local_rank;
  env.local_world_size = local_world;
  return env;
}

std::string rank_device_error(const LaunchEnvironment& env, const c10::Device& resolved, bool index_given,
                              int visible) {
  try {
    rank_device(env, resolved, index_given, visible);
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(RankDevice, EachRankTakesTheGpuOfItsLocalRank) {
  const c10::Device cpu(c10::kCPU), cuda0(c10::kCUDA, 0);
  // One process, or the CPU: the device as resolved.
  EXPECT_EQ(rank_device(ranks(0, 1, 0, 1), c10::Device(c10::kCUDA, 3), true, 4), c10::Device(c10::kCUDA, 3));
  EXPECT_EQ(rank_device(ranks(5, 8, 1, 4), cpu, false, 4), cpu);
  // torchrun on a machine with 4 GPUs, the second machine of two: cuda:LOCAL_RANK.
  for (int local = 0; local < 4; ++local)
    EXPECT_EQ(rank_device(ranks(4 + local, 8, local, 4), cuda0, false, 4), c10::Device(c10::kCUDA, local));
  // Fewer processes than GPUs is fine; "cuda:N" naming this rank's GPU too.
  EXPECT_EQ(rank_device(ranks(1, 2, 1, 2), cuda0, false, 8), c10::Device(c10::kCUDA, 1));
  EXPECT_EQ(rank_device(ranks(1, 2, 1, 2), c10::Device(c10::kCUDA, 1), true, 2), c10::Device(c10::kCUDA, 1));
  // Each process sees one GPU (CUDA_VISIBLE_DEVICES per task, as SLURM sets it): cuda:0.
  EXPECT_EQ(rank_device(ranks(3, 4, 3, 4), cuda0, false, 1), cuda0);
  EXPECT_EQ(rank_device(ranks(3, 4, 3, 4), cuda0, true, 1), cuda0);
}

TEST(RankDevice, RefusesMoreProcessesThanGpusAndAnotherRanksGpu) {
  const c10::Device cuda0(c10::kCUDA, 0);
  EXPECT_THAT(rank_device_error(ranks(0, 4, 0, 4), cuda0, false, 2),
              AllOf(HasSubstr("LOCAL_WORLD_SIZE = 4"), HasSubstr("2 CUDA devices visible"), HasSubstr("--nproc 2")));
  EXPECT_THAT(
      rank_device_error(ranks(1, 2, 1, 2), cuda0, true, 2),
      AllOf(HasSubstr("device = \"cuda:0\""), HasSubstr("this one: cuda:1"), HasSubstr("CUDA_VISIBLE_DEVICES")));
  EXPECT_THAT(rank_device_error(ranks(1, 2, 1, 2), c10::Device(c10::kCUDA, 1), true, 1),
              AllOf(HasSubstr("device = \"cuda:1\""), HasSubstr("sees one CUDA device")));
}

}  // namespace
}  // namespace shoestring::dist
