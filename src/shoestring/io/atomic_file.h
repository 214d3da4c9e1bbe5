// Atomic file writes: every file shoestring writes (checkpoints, configs,
// images, metrics rewrites) goes to a temporary beside the target, is
// fsync'd, then renamed over the target, so a crash never leaves a partial
// file under the final name.
//
// A process killed mid-write (kill -9, power loss) leaves its temporary
// behind; remove_stale_temporaries() clears those of dead processes.
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
/// `path` is left as it was.
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

/// What remove_stale_temporaries() removed.
struct StaleTemporaries {
  std::vector<std::string> paths;  ///< removed files, sorted
  uint64_t bytes = 0;              ///< their total size
};

/// Removes, under `dir` (recursively, without following symlinks), the
/// temporaries that interrupted writes left: `<name>.tmp.<pid>.<n>` from
/// write_file_atomic and `.write_probe.<pid>` from ensure_writable_dir, whose
/// process `<pid>` no longer exists (kill(pid, 0) fails with ESRCH).
/// Temporaries of live processes, this one included, are kept: another run
/// may be writing them. A missing `dir` removes nothing. Throws
/// shoestring::Error naming a file that cannot be removed.
StaleTemporaries remove_stale_temporaries(const std::string& dir);

/// Reads a whole file. Throws shoestring::Error naming the path on failure.
std::string read_file(const std::string& path);

}  // namespace shoestring
