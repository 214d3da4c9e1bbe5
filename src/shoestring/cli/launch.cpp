// `shoestring launch --nproc N [--master-port P] -- COMMAND...`: runs N local
// processes of this executable (`shoestring COMMAND...`, e.g. `train
// run.toml`) as the ranks of one data-parallel run, with the environment
// torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE,
// LOCAL_WORLD_SIZE, MASTER_ADDR = 127.0.0.1, MASTER_PORT = a free port;
// dist/launch_env.h), for users without torchrun. Each rank's output lines
// are forwarded prefixed with "[rank R] "; the CPUs are divided between the
// ranks by the trainer (LOCAL_WORLD_SIZE). When a rank exits non-zero the
// others are stopped (SIGTERM, then SIGKILL after a grace period) and the
// launcher fails naming the rank, with that rank's own last "error:" line
// (which names the peer a collective waited for) and any rank suspended
// (SIGSTOP) at the time; a launcher that is interrupted or killed
// takes its ranks with it (SIGTERM forwarded; PR_SET_PDEATHSIG), so no
// process is left behind.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <netinet/in.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "shoestring/cli/commands.h"
#include "shoestring/core/error.h"

namespace shoestring::cli {

namespace {

using Clock = std::chrono::steady_clock;

volatile std::sig_atomic_t g_interrupted = 0;
void on_signal(int sig) { g_interrupted = sig; }

/// A TCP port on loopback that was free a moment ago.
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) fail("launch: cannot open a socket to find a free port: {}", std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(fd);
  if (!ok) fail("launch: cannot find a free TCP port on 127.0.0.1: {}", std::strerror(errno));
  return ntohs(a.sin_port);
}

/// One rank: its process and the read end of its output pipe.
struct Child {
  int rank = 0;
  pid_t pid = -1;
  int out = -1;          ///< stdout + stderr of the rank (-1 once closed)
  std::string partial;   ///< an output line not yet ended
  int status = -1;       ///< exit status once reaped (128 + signal when killed)
  bool stopped = false;  ///< the launcher stopped it (after another rank failed)
  bool paused = false;   ///< suspended by a signal (SIGSTOP, SIGTSTP): alive, running nothing
  int pause_signal = 0;
  std::string last_error;  ///< the last "error: ..." line it printed (its own account of a failure)
};

/// Starts rank `rank` of `world`: `self COMMAND...` with the launch variables.
Child start_rank(int rank, int world, int port, const std::vector<std::string>& command) {
  int fds[2];
  // Close-on-exec: later ranks must not inherit this rank's pipe.
  if (::pipe2(fds, O_CLOEXEC) != 0) fail("launch: cannot create a pipe for rank {}: {}", rank, std::strerror(errno));
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) fail("launch: cannot start rank {}: {}", rank, std::strerror(errno));
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // the launcher gone: so is its rank
    if (::getppid() != parent) ::_exit(127);
    ::dup2(fds[1], STDOUT_FILENO);
    ::dup2(fds[1], STDERR_FILENO);
    ::close(fds[0]);
    ::close(fds[1]);
    ::setenv("RANK", std::to_string(rank).c_str(), 1);
    ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
    ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
    ::setenv("LOCAL_WORLD_SIZE", std::to_string(world).c_str(), 1);
    ::setenv("MASTER_ADDR", "127.0.0.1", 1);
    ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
    ::setenv("TORCHELASTIC_USE_AGENT_STORE", "False", 1);  // rank 0 hosts the store
    ::unsetenv("TORCHELASTIC_RESTART_COUNT");
    std::vector<char*> argv;
    std::string self = "shoestring";
    argv.push_back(self.data());
    std::vector<std::string> args = command;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv("/proc/self/exe", argv.data());
    std::fprintf(stderr, "launch: cannot run /proc/self/exe: %s\n", std::strerror(errno));
    ::_exit(127);
  }
  ::close(fds[1]);
  ::fcntl(fds[0], F_SETFL, ::fcntl(fds[0], F_GETFL) | O_NONBLOCK);
  Child c;
  c.rank = rank;
  c.pid = pid;
  c.out = fds[0];
  return c;
}

/// Forwards what rank `c` printed, line by line, prefixed; closes the pipe at its end.
void forward_output(Child& c, bool flush_partial) {
  char buf[8192];
  while (c.out >= 0) {
    const ssize_t n = ::read(c.out, buf, sizeof buf);
    if (n > 0) {
      c.partial.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) break;
    ::close(c.out);  // end of output (or an error reading it)
    c.out = -1;
    flush_partial = true;
  }
  size_t start = 0;
  for (size_t nl; (nl = c.partial.find('\n', start)) != std::string::npos; start = nl + 1) {
    std::fprintf(stdout, "[rank %d] %.*s\n", c.rank, static_cast<int>(nl - start), c.partial.data() + start);
    if (c.partial.compare(start, 7, "error: ") == 0) c.last_error = c.partial.substr(start + 7, nl - start - 7);
  }
  c.partial.erase(0, start);
  if (flush_partial && !c.partial.empty()) {
    std::fprintf(stdout, "[rank %d] %s\n", c.rank, c.partial.c_str());
    c.partial.clear();
  }
  std::fflush(stdout);
}

std::string describe_status(int status) {
  return status > 128 ? fmt::format("was killed by signal {} ({})", status - 128, strsignal(status - 128))
                      : fmt::format("exited with status {}", status);
}

/// Runs the ranks to the end; returns "" when all exited 0, else what failed.
std::string supervise(std::vector<Child>& children) {
  // After a rank fails, the others get a moment to fail on their own (on
  // Gloo a dead peer fails their next collective at once, with a message
  // naming it), then SIGTERM, then SIGKILL.
  constexpr auto kReport = std::chrono::seconds(3);
  constexpr auto kGrace = std::chrono::seconds(10);
  Clock::time_point failed_at{};
  std::string failure;
  int failed_rank = -1;
  std::vector<std::string> suspended;
  bool stopping = false;
  Clock::time_point stop_at{};
  auto stop_all = [&](int sig) {
    for (auto& c : children) {
      if (c.status >= 0) continue;
      ::kill(c.pid, sig);
      if (c.paused) ::kill(c.pid, SIGCONT);  // a suspended rank acts on SIGTERM only once it runs
      c.stopped = true;
    }
  };
  for (;;) {
    std::vector<pollfd> fds;
    std::vector<Child*> owners;
    for (auto& c : children) {
      if (c.out >= 0) {
        fds.push_back({c.out, POLLIN, 0});
        owners.push_back(&c);
      }
    }
    if (!fds.empty()) ::poll(fds.data(), fds.size(), 100);
    for (auto* c : owners) forward_output(*c, false);
    if (fds.empty()) ::usleep(20000);
    int running = 0;
    for (auto& c : children) {
      if (c.status >= 0) continue;
      int s = 0;
      if (::waitpid(c.pid, &s, WNOHANG | WUNTRACED | WCONTINUED) != c.pid) {
        ++running;
        continue;
      }
      if (WIFSTOPPED(s) || WIFCONTINUED(s)) {
        c.paused = WIFSTOPPED(s);
        c.pause_signal = c.paused ? WSTOPSIG(s) : 0;
        ++running;
        continue;
      }
      c.status = WIFEXITED(s) ? WEXITSTATUS(s) : 128 + WTERMSIG(s);
      if (c.status != 0 && failure.empty() && !stopping) {
        failure = fmt::format("rank {} of {} {}", c.rank, children.size(), describe_status(c.status));
        failed_at = Clock::now();
        failed_rank = c.rank;
        // Ranks suspended at this moment: the likely cause when the failure is a timeout.
        for (const auto& other : children) {
          if (other.paused && other.status < 0) {
            suspended.push_back(fmt::format("rank {} was suspended by signal {} ({})", other.rank, other.pause_signal,
                                            strsignal(other.pause_signal)));
          }
        }
      }
    }
    if (g_interrupted && failure.empty()) {
      failure = fmt::format("interrupted by signal {}; stopped the ranks", static_cast<int>(g_interrupted));
      failed_at = Clock::now() - kReport;  // at once
    }
    if (!failure.empty() && !stopping && running > 0 && Clock::now() >= failed_at + kReport) {
      stopping = true;
      stop_at = Clock::now() + kGrace;
      stop_all(SIGTERM);
    }
    if (stopping && running > 0 && Clock::now() > stop_at) stop_all(SIGKILL);
    if (running == 0) {
      for (auto& c : children) forward_output(c, true);
      bool open = false;
      for (auto& c : children) open = open || c.out >= 0;
      if (!open) break;
    }
  }
  if (failure.empty() || g_interrupted) return failure;
  // Ranks that failed on their own too (e.g. at their next collective).
  std::vector<std::string> also;
  for (const auto& c : children) {
    if (c.status != 0 && !c.stopped && failure.rfind(fmt::format("rank {} ", c.rank), 0) != 0)
      also.push_back(fmt::format("rank {} {}", c.rank, describe_status(c.status)));
  }
  // The failing rank's own account (e.g. which peer did not answer a collective).
  for (const auto& c : children) {
    if (c.rank == failed_rank && !c.last_error.empty()) {
      constexpr size_t kMost = 400;
      failure += ": " + (c.last_error.size() > kMost ? c.last_error.substr(0, kMost) + "..." : c.last_error);
    }
  }
  if (!suspended.empty()) failure += fmt::format(" ({} at the time)", fmt::join(suspended, ", "));
  if (!also.empty()) failure += fmt::format(" (then {})", fmt::join(also, ", "));
  bool stopped = false;
  for (const auto& c : children) stopped = stopped || c.stopped;
  return failure + (stopped ? "; the other ranks were stopped" : "");
}

}  // namespace

void register_launch(CLI::App& app) {
  struct Args {
    int nproc = 0;
    int port = 0;
    std::vector<std::string> command;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = app.add_subcommand(
      "launch", "run N local processes of a command as the ranks of one data-parallel run (like torchrun)");
  cmd->add_option("--nproc", args->nproc, "number of processes (ranks)")->required()->check(CLI::Range(1, 1024));
  cmd->add_option(
         "--master-port", args->port,
         "TCP port of rank 0's store, reached at 127.0.0.1 (default: a free one; the store listens on every interface)")
      ->check(CLI::Range(1, 65535));
  cmd->add_option("command", args->command,
                  "the shoestring command each rank runs, after --: -- train run.toml (or -- cache run.toml)")
      ->required();
  cmd->callback([args] {
    // Only training and cache have ranks (cache: each encodes a share of the
    // disk caches); any other command would run N times over the same output
    // (sample writing one file from every rank at once).
    if (args->command.front() != "train" && args->command.front() != "cache") {
      fail(
          "launch: the command must be `train` or `cache` (got `{}`): only those run as ranks; run other commands "
          "once",
          args->command.front());
    }
    // Each rank is a whole process with its own copy of the model and its
    // share of the CPUs: far more ranks than CPUs only exhausts the memory.
    const int cpus = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
    const int most = std::max(8, 4 * cpus);
    if (args->nproc > most) {
      fail(
          "launch: --nproc {} is more ranks than this machine runs: each rank is a process holding its own copy of "
          "the model, and they share its {} CPU{}; at most {} here (4 per CPU, at least 8)",
          args->nproc, cpus, cpus == 1 ? "" : "s", most);
    }
    const int port = args->port > 0 ? args->port : free_port();
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
      // An ignored signal stays ignored (`nohup shoestring launch ...`), in
      // the ranks too, which inherit the disposition.
      struct sigaction current {};
      if (::sigaction(sig, nullptr, &current) == 0 && current.sa_handler == SIG_IGN) continue;
      ::sigaction(sig, &sa, nullptr);
    }
    std::vector<Child> children;
    try {
      for (int rank = 0; rank < args->nproc; ++rank) {
        if (g_interrupted)
          fail("launch: interrupted by signal {} while starting rank {} of {}", static_cast<int>(g_interrupted), rank,
               args->nproc);
        children.push_back(start_rank(rank, args->nproc, port, args->command));
      }
    } catch (const Error&) {
      for (auto& c : children) ::kill(c.pid, SIGKILL);
      for (auto& c : children) ::waitpid(c.pid, nullptr, 0);
      throw;
    }
    const std::string failure = supervise(children);
    if (!failure.empty()) fail("launch: {}", failure);
  });
}

}  // namespace shoestring::cli
