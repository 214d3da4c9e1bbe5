#include "shoestring/io/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "shoestring/core/error.h"

namespace shoestring {
namespace fs = std::filesystem;

namespace {
std::atomic<uint64_t> g_counter{0};

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
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (!f) {
    fail("cannot create '{}' (writing '{}'): {}", tmp, path, std::strerror(errno));
  }
  try {
    writer(f);
    if (std::fflush(f) != 0 || std::ferror(f)) {
      fail("cannot write '{}': {}", path, std::strerror(errno));
    }
    if (::fsync(::fileno(f)) != 0) {
      fail("cannot fsync '{}': {}", path, std::strerror(errno));
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
