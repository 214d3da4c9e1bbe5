// Multi-process test support for tests/dist: a test starts `world` copies of
// this test binary (fork + exec of /proc/self/exe), each running the
// DistWorker.Main test with a named scenario, and collects their exit
// codes. Children die with the test process (PR_SET_PDEATHSIG), and any
// still running at the deadline are killed, so no process is left behind.
#pragma once
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace shoestring::testing {

/// What a worker process runs: registered by name with DIST_SCENARIO.
inline std::map<std::string, std::function<void()>>& dist_scenarios() {
  static std::map<std::string, std::function<void()>> m;
  return m;
}

struct DistScenarioRegistrar {
  DistScenarioRegistrar(const std::string& name, std::function<void()> f) { dist_scenarios()[name] = std::move(f); }
};

#define DIST_SCENARIO(name)                                                                                        \
  static void dist_scenario_##name();                                                                              \
  static ::shoestring::testing::DistScenarioRegistrar dist_scenario_registrar_##name(#name, dist_scenario_##name); \
  static void dist_scenario_##name()

/// An environment variable of a worker ("" when unset).
inline std::string worker_env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}
inline int worker_rank() { return std::atoi(worker_env("SHOESTRING_TEST_RANK").c_str()); }
inline int worker_world() { return std::atoi(worker_env("SHOESTRING_TEST_WORLD").c_str()); }
/// The folder the workers of one test share (files, the FileStore).
inline std::string worker_dir() { return worker_env("SHOESTRING_TEST_DIR"); }

/// A fresh folder for one multi-process test.
inline std::string fresh_dist_dir(const std::string& name) {
  namespace fs = std::filesystem;
  fs::path p = fs::temp_directory_path() / ("shoestring_dist_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  fs::create_directories(p);
  return p.string();
}

/// A TCP port that was free a moment ago (bound to port 0 and released).
int free_tcp_port();

/// Runs `scenario` in `world` child processes (ranks 0 .. world-1) with
/// SHOESTRING_TEST_RANK / _WORLD / _DIR set, plus `env(rank)`'s variables;
/// returns each child's exit status (128 + signal when killed). Children
/// still running `deadline` after the start are killed (status 128 + 9).
inline std::vector<int> run_workers(const std::string& scenario, int world, const std::string& dir,
                                    const std::function<std::map<std::string, std::string>(int)>& env = {},
                                    std::chrono::seconds deadline = std::chrono::seconds(90)) {
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world; ++rank) {
    std::map<std::string, std::string> vars = env ? env(rank) : std::map<std::string, std::string>{};
    vars["SHOESTRING_DIST_WORKER"] = scenario;
    vars["SHOESTRING_TEST_RANK"] = std::to_string(rank);
    vars["SHOESTRING_TEST_WORLD"] = std::to_string(world);
    vars["SHOESTRING_TEST_DIR"] = dir;
    // The child's environment is built before fork: between fork and exec a
    // child of a threaded process (Gloo's, CUDA's threads) may only make
    // async-signal-safe calls, which setenv (malloc) is not.
    std::vector<std::string> entries;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string entry = *e;
      const std::string key = entry.substr(0, entry.find('='));
      if (vars.count(key) == 0) entries.push_back(entry);
    }
    for (const auto& [k, v] : vars) entries.push_back(k + "=" + v);
    std::vector<char*> envp;
    for (std::string& entry : entries) envp.push_back(entry.data());
    envp.push_back(nullptr);
    const char* argv[] = {"test_dist", "--gtest_filter=DistWorker.Main", "--gtest_brief=1", nullptr};
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::execve("/proc/self/exe", const_cast<char* const*>(argv), envp.data());
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  std::vector<int> status(world, -1);
  const auto until = std::chrono::steady_clock::now() + deadline;
  int running = world;
  while (running > 0) {
    for (int r = 0; r < world; ++r) {
      if (status[r] != -1) continue;
      int s = 0;
      if (::waitpid(pids[r], &s, WNOHANG) == pids[r]) {
        status[r] = WIFEXITED(s) ? WEXITSTATUS(s) : 128 + WTERMSIG(s);
        --running;
      }
    }
    if (running > 0 && std::chrono::steady_clock::now() > until) {
      for (int r = 0; r < world; ++r) {
        if (status[r] != -1) continue;
        ::kill(pids[r], SIGKILL);
        int s = 0;
        ::waitpid(pids[r], &s, 0);
        status[r] = 128 + SIGKILL;
        --running;
      }
    }
    if (running > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return status;
}

/// The text of a file ("" when missing).
inline std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void write_text(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

}  // namespace shoestring::testing
