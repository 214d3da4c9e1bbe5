// Atomic file writes: every file shoestring writes (checkpoints, configs,
// images, metrics rewrites) goes to a temporary beside the target, is
// fsync'd, then renamed over the target, so a crash never leaves a partial
// file under the final name.
//
// A process stopped mid-write by SIGINT, SIGTERM or SIGHUP removes its
// temporaries before it ends (a handler installed at the first write, where
// the program has none of its own). One killed otherwise (kill -9, power
// loss) leaves its temporary behind; remove_temporaries() clears them in a
// folder the caller owns (FolderLock).
// SHOESTRING_TEST_CRASH_AT_WRITE=N (a test hook) makes the N-th atomic write
// of the process end it with _exit(kCrashExitCode) after the temporary is
// written and before the rename, as a kill at that point would: the
// fault-injection test (tests/cli) resumes a run from every such point.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace shoestring {

/// Writes a file atomically: `writer` fills a temporary file
/// `<path>.tmp.<pid>.<n>` in the same directory; on success the temporary is
/// fsync'd and renamed to `path`, and the directory is fsync'd.
/// If `writer` throws, the temporary is removed and the exception propagates;
/// `path` is left as it was. SIGINT, SIGTERM or SIGHUP during the write
/// removes the temporary and ends the process by that signal (the handler is
/// installed at the first call, for those of the three signals whose
/// disposition is still the default).
/// Throws shoestring::Error naming the path when the file cannot be
/// created, written, synced or renamed (e.g. directory missing or read-only).
void write_file_atomic(const std::string& path, const std::function<void(std::FILE*)>& writer);

/// Exit status of a process ended by the SHOESTRING_TEST_CRASH_AT_WRITE hook.
inline constexpr int kCrashExitCode = 86;

/// Convenience: atomically writes `bytes` to `path` (see write_file_atomic).
void write_bytes_atomic(const std::string& path, std::string_view bytes);

/// Creates `dir` (and parents) if missing and checks that a file can be
/// created in it. Throws shoestring::Error naming the directory otherwise.
/// Used before any work starts so that an unwritable output folder fails fast.
void ensure_writable_dir(const std::string& dir);

/// What remove_temporaries() removed.
struct StaleTemporaries {
  std::vector<std::string> paths;  ///< removed files, sorted
  uint64_t bytes = 0;              ///< their total size
};

/// Removes, in folder `dir` (not below it, symlinks not followed), the
/// temporaries that interrupted writes left: `<name>.tmp.<pid>.<n>` of
/// write_file_atomic and `.write_probe.<pid>` of ensure_writable_dir (whose
/// `<name>` is ".write_probe"), for the names `owned(name)` accepts, whatever
/// their pid (in a container a restarted process often has the dead one's
/// pid). Only for folders no other process writes in: hold a FolderLock.
/// A missing `dir` removes nothing. Throws shoestring::Error naming a file
/// that cannot be removed.
StaleTemporaries remove_temporaries(const std::string& dir, const std::function<bool(const std::string&)>& owned);

/// An exclusive advisory lock (flock) on `<dir>/<name>`, held from
/// construction until destruction or process exit (a kill releases it too).
/// The lock file is left in place, empty. Throws shoestring::Error naming
/// the folder when another process holds the lock, or the file cannot be
/// created.
class FolderLock {
 public:
  FolderLock(const std::string& dir, const std::string& name);
  ~FolderLock();
  FolderLock(const FolderLock&) = delete;
  FolderLock& operator=(const FolderLock&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

/// Reads a whole file. Throws shoestring::Error naming the path on failure.
std::string read_file(const std::string& path);

}  // namespace shoestring
