// `shoestring launch`: N local ranks of a training run, output prefixed by
// rank, and a failing or killed rank makes the launcher stop the others
// and fail naming the rank, leaving no process behind.
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <thread>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "../train/ldm_cache_fixture.h"
#include "../train/train_testing.h"
#include "dist_testing.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/io/tensor_cache.h"
#include "shoestring/train/config.h"
#include "shoestring/train/ldm_cache.h"

extern char** environ;

namespace shoestring {
namespace {

using namespace std::chrono_literals;
using shoestring::testing::fresh_dist_dir;
using shoestring::testing::read_text;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;

/// The launcher, started with its output in a file.
struct Launcher {
  pid_t pid = -1;
  std::string output_path;

  Launcher(const std::vector<std::string>& args, const std::string& output)
      : Launcher(SHOESTRING_BINARY, args, output) {}

  /// Another program (torchrun) with `args`.
  Launcher(const std::string& program, const std::vector<std::string>& args, const std::string& output)
      : output_path(output) {
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, STDOUT_FILENO, output.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, STDOUT_FILENO, STDERR_FILENO);
    std::vector<std::string> all = {program};
    all.insert(all.end(), args.begin(), args.end());
    std::vector<char*> argv;
    for (auto& a : all) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn(&pid, program.c_str(), &fa, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&fa);
  }

  /// Its exit status (128 + signal), killing it after `deadline`.
  int wait(std::chrono::seconds deadline = 120s) {
    const auto until = std::chrono::steady_clock::now() + deadline;
    int s = 0;
    while (::waitpid(pid, &s, WNOHANG) != pid) {
      if (std::chrono::steady_clock::now() > until) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &s, 0);
        break;
      }
      std::this_thread::sleep_for(20ms);
    }
    return WIFEXITED(s) ? WEXITSTATUS(s) : 128 + WTERMSIG(s);
  }

  /// The ranks: the launcher's child processes, in start order.
  std::vector<pid_t> children() const {
    std::ifstream in(fmt::format("/proc/{}/task/{}/children", pid, pid));
    std::vector<pid_t> out;
    pid_t p;
    while (in >> p) out.push_back(p);
    return out;
  }

  std::string output() const { return read_text(output_path); }
};

std::string write_config(const std::string& dir, int64_t steps, int64_t batch, double ddp_timeout_minutes = 2) {
  TrainConfig c = shoestring::testing::tiny_emoji_config(dir + "/run");
  c.max_train_steps = steps;
  c.train_batch_size = batch;
  c.num_threads = 0;  // divided between the ranks
  c.ddp_timeout = ddp_timeout_minutes;
  const std::string path = dir + "/run.toml";
  std::ofstream(path) << to_toml(c);
  return path;
}

bool gone(pid_t p) { return ::kill(p, 0) != 0 && errno == ESRCH; }

/// The rank processes of `l` once its first step is done (rank 0 writes
/// dir/run/metrics.jsonl), waiting at most 90 s.
std::vector<pid_t> ranks_after_the_first_step(Launcher& l, const std::string& dir) {
  const auto until = std::chrono::steady_clock::now() + 90s;
  while (read_text(dir + "/run/metrics.jsonl").empty() && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(20ms);
  return l.children();
}

TEST(Launch, TwoRanksTrainOneRun) {
  const std::string dir = fresh_dist_dir("launch2");
  const std::string config = write_config(dir, 3, 2);
  Launcher l({"launch", "--nproc", "2", "--", "train", config}, dir + "/out.txt");
  EXPECT_EQ(l.wait(), 0) << l.output();
  const std::string out = l.output();
  EXPECT_THAT(out, AllOf(HasSubstr("[rank 0] "), HasSubstr("data parallel (zero_stage = 0): 2 processes"),
                         HasSubstr("1 threads")));  // 2 CPUs shared by 2 ranks (ctest machine: 2 cores)
  EXPECT_EQ(shoestring::testing::losses_of(dir + "/run/metrics.jsonl").size(), 3u);
  EXPECT_TRUE(std::filesystem::exists(dir + "/run/model.safetensors"));
}

// torchrun --max_restarts 1 (Debian's python3-torch): rank 1 of the first
// attempt dies while writing its step-4 optimizer shard (the atomic-write
// crash hook, set for that rank and attempt only by a wrapper script);
// torchrun starts the group again, which resumes from the step-2 checkpoint
// in the same run folder (TORCHELASTIC_RESTART_COUNT = 1) and finishes with
// the final weights of a run that never stopped, bit for bit.
TEST(Torchrun, ARestartedGroupResumesFromItsLastCheckpoint) {
  const char* torchrun = "/usr/bin/torchrun";
  if (!std::filesystem::exists(torchrun)) GTEST_SKIP() << "no " << torchrun << " (Debian's python3-torch)";
  const std::string dir = fresh_dist_dir("torchrun_restart");
  auto config_for = [&](const std::string& name) {
    TrainConfig c = shoestring::testing::tiny_emoji_config(dir + "/" + name);
    c.max_train_steps = 4;
    c.save_every_n_steps = 2;
    c.train_batch_size = 2;
    c.zero_stage = 1;
    c.num_threads = 1;
    c.ddp_timeout = 1;
    const std::string path = dir + "/" + name + ".toml";
    std::ofstream(path) << to_toml(c);
    return path;
  };
  Launcher whole({"launch", "--nproc", "2", "--", "train", config_for("whole")}, dir + "/whole.txt");
  ASSERT_EQ(whole.wait(), 0) << whole.output();

  const std::string wrapper = dir + "/rank.sh";
  std::ofstream(wrapper) << "#!/bin/sh\n"
                         << "if [ \"$RANK\" = 1 ] && [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then\n"
                         << "  export SHOESTRING_TEST_CRASH_AT_WRITE=2\n"
                         << "fi\n"
                         << "exec " << SHOESTRING_BINARY << " \"$@\"\n";
  std::filesystem::permissions(wrapper, std::filesystem::perms::owner_all);
  const int port = shoestring::testing::free_tcp_port();
  Launcher l(torchrun,
             {"--nproc_per_node", "2", "--max_restarts", "1", "--master_addr", "127.0.0.1", "--master_port",
              std::to_string(port), "-r", "1", "-t", "1", "--no_python", wrapper, "train", config_for("restarted")},
             dir + "/restarted.txt");
  ASSERT_EQ(l.wait(std::chrono::seconds(170)), 0) << l.output();
  EXPECT_THAT(l.output(), AllOf(HasSubstr("restart 1 of an elastic launch"), HasSubstr("resumed from"))) << l.output();
  const SafetensorsFile a = SafetensorsFile::open(dir + "/whole/model.safetensors");
  const SafetensorsFile b = SafetensorsFile::open(dir + "/restarted/model.safetensors");
  ASSERT_EQ(a.tensors().size(), b.tensors().size());
  for (const auto& info : a.tensors()) {
    const TensorInfo* other = b.find(info.name);
    ASSERT_NE(other, nullptr) << info.name;
    EXPECT_EQ(a.bytes(info), b.bytes(*other)) << info.name;
  }
  EXPECT_EQ(shoestring::testing::losses_of(dir + "/restarted/metrics.jsonl"),
            shoestring::testing::losses_of(dir + "/whole/metrics.jsonl"));
}

TEST(Launch, AFailingRankFailsTheLaunchNamingIt) {
  const std::string dir = fresh_dist_dir("launchfail");
  Launcher l({"launch", "--nproc", "2", "--", "train", dir + "/missing.toml"}, dir + "/out.txt");
  EXPECT_EQ(l.wait(), 1);
  EXPECT_THAT(l.output(), AllOf(HasSubstr("[rank 1] error: config file"), HasSubstr("error: launch: rank"),
                                HasSubstr("of 2 exited with status 1")));
}

// Only `train` runs as ranks: `sample` under launch would write one file from
// every rank at once.
TEST(Launch, RefusesCommandsOtherThanTrainAndCache) {
  const std::string dir = fresh_dist_dir("launchsample");
  Launcher l({"launch", "--nproc", "2", "--", "sample", dir + "/model.safetensors", "--prompt", "x", "--out",
              dir + "/grid.png"},
             dir + "/out.txt");
  EXPECT_EQ(l.wait(), 1);
  EXPECT_THAT(l.output(),
              AllOf(HasSubstr("must be `train` or `cache`"), HasSubstr("`sample`"), Not(HasSubstr("[rank"))));
  // Far more ranks than CPUs (each a process with its own model copy): refused before any starts.
  const int too_many = 4 * std::max(2, static_cast<int>(std::thread::hardware_concurrency())) + 1;
  Launcher many({"launch", "--nproc", std::to_string(std::max(9, too_many)), "--", "train", dir + "/run.toml"},
                dir + "/many.txt");
  EXPECT_EQ(many.wait(), 1);
  EXPECT_THAT(many.output(), AllOf(HasSubstr("--nproc"), HasSubstr("CPU"), Not(HasSubstr("[rank"))));
}

TEST(Launch, AKilledRankStopsTheRunAndLeavesNoProcess) {
  const std::string dir = fresh_dist_dir("launchkill");
  const std::string config = write_config(dir, 100000, 2);  // far more steps than the test waits for
  Launcher l({"launch", "--nproc", "2", "--", "train", config}, dir + "/out.txt");
  const std::vector<pid_t> ranks = ranks_after_the_first_step(l, dir);
  ASSERT_EQ(ranks.size(), 2u) << l.output();
  ::kill(ranks[1], SIGKILL);
  EXPECT_EQ(l.wait(), 1);
  // (Rank 0 usually fails its next collective first, naming it; if it is
  // slower than the launcher's grace period it is stopped instead.)
  EXPECT_THAT(l.output(), HasSubstr("error: launch: rank 1 of 2 was killed by signal 9")) << l.output();
  for (pid_t p : ranks) EXPECT_TRUE(gone(p)) << "rank process " << p << " is still there";
}

// `nohup shoestring launch ...`: a SIGHUP ignored when the launcher starts
// stays ignored, in the launcher and in its ranks (which inherit it); the
// run goes on until stopped otherwise.
TEST(Launch, AnIgnoredHangupStaysIgnored) {
  const std::string dir = fresh_dist_dir("launchhup");
  const std::string config = write_config(dir, 100000, 2);
  struct sigaction ignore {}, previous {};
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(::sigaction(SIGHUP, &ignore, &previous), 0);
  Launcher l({"launch", "--nproc", "2", "--", "train", config}, dir + "/out.txt");
  ::sigaction(SIGHUP, &previous, nullptr);
  const std::vector<pid_t> ranks = ranks_after_the_first_step(l, dir);
  ASSERT_EQ(ranks.size(), 2u) << l.output();
  ::kill(l.pid, SIGHUP);
  for (pid_t p : ranks) ::kill(p, SIGHUP);
  std::this_thread::sleep_for(1500ms);
  int status = 0;
  if (::waitpid(l.pid, &status, WNOHANG) == l.pid) {  // reaped: l.wait() has nothing left to wait for
    ADD_FAILURE() << "the launcher ended on SIGHUP: " << l.output();
    for (pid_t p : ranks) ::kill(p, SIGKILL);
    return;
  }
  for (pid_t p : ranks) EXPECT_FALSE(gone(p)) << "rank process " << p << " ended on SIGHUP";
  ::kill(l.pid, SIGTERM);  // stops the ranks
  EXPECT_EQ(l.wait(), 1);
  EXPECT_THAT(l.output(), HasSubstr("interrupted by signal 15")) << l.output();
  for (pid_t p : ranks) EXPECT_TRUE(gone(p)) << "rank process " << p << " is still there";
}

// A rank suspended by SIGSTOP (a hung peer): the other's next collective
// times out (ddp_timeout 0.1 min), and the launcher's summary names the
// suspended rank and carries rank 0's own account; no process is left.
TEST(Launch, ASuspendedRankIsNamedInTheSummary) {
  const std::string dir = fresh_dist_dir("launchstop");
  const std::string config = write_config(dir, 100000, 2, /*ddp_timeout_minutes=*/0.1);
  Launcher l({"launch", "--nproc", "2", "--", "train", config}, dir + "/out.txt");
  const std::vector<pid_t> ranks = ranks_after_the_first_step(l, dir);
  ASSERT_EQ(ranks.size(), 2u) << l.output();
  ::kill(ranks[1], SIGSTOP);
  EXPECT_EQ(l.wait(std::chrono::seconds(60)), 1);
  EXPECT_THAT(l.output(), AllOf(HasSubstr("error: launch: rank 0 of 2 exited with status 1: "),
                                HasSubstr("rank 1 was suspended by signal 19")))
      << l.output();
  for (pid_t p : ranks) EXPECT_TRUE(gone(p)) << "rank process " << p << " is still there";
}

}  // namespace
}  // namespace shoestring

namespace shoestring {
namespace {

/// What one rank's `shoestring cache` printed: latents encoded, by the
/// other ranks, reused (in the cache when this rank looked), then the same
/// for text (-1s when absent).
std::vector<int64_t> encoded_by(const std::string& output, int rank) {
  const std::regex line(fmt::format(R"(\[rank {}\] cache .* \(rank {} of 2\): latents (\d+) encoded, (\d+) by the )"
                                    R"(other ranks, (\d+) reused; text (\d+) encoded, (\d+) by the other ranks, (\d+) )"
                                    R"(reused)",
                                    rank, rank));
  std::smatch m;
  if (!std::regex_search(output, m, line)) return {-1, -1, -1, -1, -1, -1};
  std::vector<int64_t> out;
  for (size_t i = 1; i <= 6; ++i) out.push_back(std::stoll(m[i]));
  return out;
}

}  // namespace

// `shoestring launch --nproc 2 -- cache`: each rank encodes a disjoint share
// of the missing entries (cache_key_owner) into its own shards, then waits
// for the other's; together they fill the cache once, with the entries one
// process would have written.
TEST(Launch, TwoRanksEncodeDisjointSharesOfTheDiskCache) {
  shoestring::testing::CacheFixture f("launch_share");
  const std::string config = f.root + "/cache.toml";
  std::ofstream(config) << to_toml(f.config());
  Launcher l({"launch", "--nproc", "2", "--", "cache", config}, f.root + "/out.txt");
  ASSERT_EQ(l.wait(), 0) << l.output();
  const std::string out = l.output();
  const std::vector<int64_t> r0 = encoded_by(out, 0), r1 = encoded_by(out, 1);
  ASSERT_GE(r0[0], 0) << out;
  ASSERT_GE(r1[0], 0) << out;
  using shoestring::testing::kImages;
  using shoestring::testing::kTexts;
  EXPECT_EQ(r0[0] + r1[0], kImages) << out;
  EXPECT_EQ(r0[3] + r1[3], kTexts) << out;
  // Each rank accounts for every entry: encoded, by the other rank, or
  // already there when it looked (the other rank may have been quicker).
  for (const auto& r : {r0, r1}) {
    EXPECT_EQ(r[0] + r[1] + r[2], kImages) << out;
    EXPECT_EQ(r[3] + r[4] + r[5], kTexts) << out;
  }
  EXPECT_GT(r0[0], 0);
  EXPECT_GT(r1[0], 0);
  for (const char* kind : {"latents", "text"}) {
    for (const char* rank : {"r0", "r1"})
      EXPECT_TRUE(std::filesystem::exists(fmt::format("{}/{}/manifest-{}.json", f.cache(), kind, rank)))
          << kind << " " << rank;
  }
  // Complete: one process encodes nothing more.
  const LdmCacheStats again = build_ldm_caches(f.config(), true);
  EXPECT_EQ(again.latents_encoded, 0);
  EXPECT_EQ(again.text_encoded, 0);
  // The same entries one process writes (batches of other images: fp32 rounding apart).
  shoestring::testing::CacheFixture one("launch_share_one");
  build_ldm_caches(one.config(), true);
  for (const char* kind : {"latents", "text"}) {
    const TensorCache shared = TensorCache::open(f.cache() + "/" + kind, kind, "");
    const TensorCache single = TensorCache::open(one.cache() + "/" + kind, kind, "");
    ASSERT_EQ(shared.keys(), single.keys()) << kind;
    for (const std::string& key : single.keys()) {
      const auto a = shared.read(key), b = single.read(key);
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(a[i].allclose(b[i], 1e-5, 1e-6)) << kind << " " << key;
    }
  }
}

}  // namespace shoestring
