// Atomic file writes: every file shoestring writes (checkpoints, configs,
// images, metrics rewrites) goes to a temporary beside the target, is
// fsync'd, then renamed over the target, so a crash never leaves a partial
// file under the final name.
#pragma once
#include <functional>
#include <string>
#include <string_view>

namespace shoestring {

/// Writes a file atomically: `writer` fills a temporary file
/// `<path>.tmp.<pid>.<n>` in the same directory; on success the temporary is
/// fsync'd and renamed to `path`, and the directory is fsync'd.
/// If `writer` throws, the temporary is removed and the exception propagates;
/// `path` is left as it was.
/// Throws shoestring::Error naming the path when the file cannot be
/// created, written, synced or renamed (e.g. directory missing or read-only).
void write_file_atomic(const std::string& path, const std::function<void(std::FILE*)>& writer);

/// Convenience: atomically writes `bytes` to `path` (see write_file_atomic).
void write_bytes_atomic(const std::string& path, std::string_view bytes);

/// Creates `dir` (and parents) if missing and checks that a file can be
/// created in it. Throws shoestring::Error naming the directory otherwise.
/// Used before any work starts so that an unwritable output folder fails fast.
void ensure_writable_dir(const std::string& dir);

/// Reads a whole file. Throws shoestring::Error naming the path on failure.
std::string read_file(const std::string& path);

}  // namespace shoestring
