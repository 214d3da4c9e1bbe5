#include "shoestring/io/atomic_file.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

#include "shoestring/core/error.h"

namespace shoestring {
namespace fs = std::filesystem;

namespace {
std::atomic<uint64_t> g_counter{0};  // names temporaries
std::atomic<uint64_t> g_writes{0};   // counts writes for the crash hook

/// The SHOESTRING_TEST_CRASH_AT_WRITE hook: the 1-based index of the write
/// that ends the process (0: never).
uint64_t crash_at_write() {
  static const uint64_t n = [] {
    const char* v = std::getenv("SHOESTRING_TEST_CRASH_AT_WRITE");
    return v ? std::strtoull(v, nullptr, 10) : 0;
  }();
  return n;
}

bool all_digits(const std::string& s) {
  return !s.empty() && s.size() <= 18 && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

/// The target name of a temporary: "<name>" for "<name>.tmp.<pid>.<n>"
/// (write_file_atomic), ".write_probe" for ".write_probe.<pid>"
/// (ensure_writable_dir); "" for any other name.
std::string temporary_target(const std::string& name) {
  const std::string probe = ".write_probe.";
  if (name.rfind(probe, 0) == 0) return all_digits(name.substr(probe.size())) ? ".write_probe" : "";
  const size_t last_dot = name.rfind('.');
  if (last_dot == std::string::npos || last_dot == 0 || !all_digits(name.substr(last_dot + 1))) return "";
  const size_t pid_dot = name.rfind('.', last_dot - 1);
  if (pid_dot == std::string::npos || !all_digits(name.substr(pid_dot + 1, last_dot - pid_dot - 1))) return "";
  if (pid_dot < 5 || name.compare(pid_dot - 4, 4, ".tmp") != 0) return "";
  return name.substr(0, pid_dot - 4);
}

/// Temporaries being written now, for the signal handler below: fixed slots
/// (no allocation, lock-free atomics), so the handler only reads them and
/// calls unlink, both async-signal-safe. 0 free, 1 being filled, 2 ready.
struct TemporarySlot {
  std::atomic<int> state{0};
  char path[4096];
};
TemporarySlot g_temporaries[32];

/// SIGINT, SIGTERM or SIGHUP (Ctrl-C, a launcher stopping its ranks, a
/// closed terminal): removes the temporaries being written, then ends the
/// process by the same signal with its default action, as it would have
/// ended without this handler.
void remove_temporaries_and_reraise(int sig) {
  for (TemporarySlot& slot : g_temporaries) {
    if (slot.state.load() == 2) ::unlink(slot.path);
  }
  ::signal(sig, SIG_DFL);
  ::raise(sig);  // delivered when this handler returns
}

/// Installs the handler once per process, for each of the three signals whose
/// disposition is still the default (a handler of the program's own, e.g. the
/// launcher's, is kept; so is an ignored signal).
void install_temporary_cleanup() {
  static std::once_flag once;
  std::call_once(once, [] {
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
      struct sigaction current {};
      if (::sigaction(sig, nullptr, &current) != 0 || (current.sa_flags & SA_SIGINFO) != 0 ||
          current.sa_handler != SIG_DFL) {
        continue;
      }
      struct sigaction action {};
      action.sa_handler = remove_temporaries_and_reraise;
      sigemptyset(&action.sa_mask);
      ::sigaction(sig, &action, nullptr);
    }
  });
}

/// A temporary the signal handler removes while registered (RAII). A path
/// too long for a slot, or more than 32 writes at once, is not registered:
/// remove_temporaries still finds it later.
class RegisteredTemporary {
 public:
  explicit RegisteredTemporary(const std::string& path) {
    install_temporary_cleanup();
    if (path.size() >= sizeof(TemporarySlot::path)) return;
    for (TemporarySlot& slot : g_temporaries) {
      int expected = 0;
      if (!slot.state.compare_exchange_strong(expected, 1)) continue;
      std::memcpy(slot.path, path.c_str(), path.size() + 1);
      slot.state.store(2);
      slot_ = &slot;
      return;
    }
  }
  ~RegisteredTemporary() {
    if (slot_) slot_->state.store(0);
  }
  RegisteredTemporary(const RegisteredTemporary&) = delete;
  RegisteredTemporary& operator=(const RegisteredTemporary&) = delete;

 private:
  TemporarySlot* slot_ = nullptr;
};

void fsync_dir(const fs::path& dir) {
  int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}
}  // namespace

void write_file_atomic(const std::string& path, const std::function<void(std::FILE*)>& writer) {
  fs::path target(path);
  std::string tmp = fmt::format("{}.tmp.{}.{}", path, ::getpid(), g_counter++);
  const RegisteredTemporary registered(tmp);  // a SIGINT / SIGTERM / SIGHUP meanwhile removes it
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) {
    fail("cannot create '{}' (writing '{}'): {}", tmp, path, std::strerror(errno));
  }
  const uint64_t index = ++g_writes;
  try {
    writer(f);
    if (std::fflush(f) != 0 || std::ferror(f)) {
      fail("cannot write '{}': {}", path, std::strerror(errno));
    }
    if (::fsync(::fileno(f)) != 0) {
      fail("cannot fsync '{}': {}", path, std::strerror(errno));
    }
    if (index == crash_at_write()) {
      std::fprintf(stderr, "SHOESTRING_TEST_CRASH_AT_WRITE=%llu: exiting before renaming '%s' to '%s'\n",
                   static_cast<unsigned long long>(index), tmp.c_str(), path.c_str());
      ::_exit(kCrashExitCode);  // as a kill would: no cleanup, the temporary stays
    }
  } catch (...) {
    std::fclose(f);
    std::remove(tmp.c_str());
    throw;
  }
  if (std::fclose(f) != 0) {
    std::remove(tmp.c_str());
    fail("cannot close '{}': {}", path, std::strerror(errno));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    std::remove(tmp.c_str());
    fail("cannot rename '{}' to '{}': {}", tmp, path, std::strerror(err));
  }
  fsync_dir(target.parent_path());
}

void write_bytes_atomic(const std::string& path, std::string_view bytes) {
  write_file_atomic(path, [&](std::FILE* f) {
    if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) {
      fail("cannot write {} bytes to '{}': {}", bytes.size(), path, std::strerror(errno));
    }
  });
}

void ensure_writable_dir(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail("output directory '{}' cannot be created: {}", dir, ec.message());
  if (!fs::is_directory(dir)) fail("output path '{}' exists and is not a directory", dir);
  std::string probe = (fs::path(dir) / fmt::format(".write_probe.{}", ::getpid())).string();
  std::FILE* f = std::fopen(probe.c_str(), "wb");
  if (!f) fail("output directory '{}' is not writable: {}", dir, std::strerror(errno));
  std::fclose(f);
  std::remove(probe.c_str());
}

StaleTemporaries remove_temporaries(const std::string& dir, const std::function<bool(const std::string&)>& owned) {
  StaleTemporaries removed;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return removed;
  for (auto it = fs::directory_iterator(dir, ec); !ec && it != fs::directory_iterator(); it.increment(ec)) {
    if (it->is_symlink(ec) || !it->is_regular_file(ec)) continue;
    const std::string target = temporary_target(it->path().filename().string());
    if (target.empty() || !owned(target)) continue;
    const uint64_t size = it->file_size(ec);
    if (!fs::remove(it->path(), ec) || ec) {
      fail("cannot remove the stale temporary file '{}': {}", it->path().string(),
           ec ? ec.message() : std::string("it vanished"));
    }
    removed.paths.push_back(it->path().string());
    removed.bytes += size;
  }
  if (ec) fail("cannot list '{}' for stale temporary files: {}", dir, ec.message());
  std::sort(removed.paths.begin(), removed.paths.end());
  return removed;
}

FolderLock::FolderLock(const std::string& dir, const std::string& name) : path_((fs::path(dir) / name).string()) {
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("cannot create the lock file '{}': {}", path_, std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd_);
    fd_ = -1;
    if (err == EWOULDBLOCK) {
      fail("'{}' is in use by another shoestring process (it holds {}); wait for it to end or stop it", dir, path_);
    }
    fail("cannot lock '{}': {}", path_, std::strerror(err));
  }
}

FolderLock::~FolderLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

std::string read_file(const std::string& path) {
  if (fs::is_directory(path)) fail("'{}' is a directory, expected a file", path);
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open '{}': {}", path, std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) fail("cannot read '{}'", path);
  return ss.str();
}

}  // namespace shoestring
