#include "shoestring/io/atomic_file.h"

#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <stdexcept>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "shoestring/core/error.h"
#include "temp_dir.h"

namespace shoestring {
namespace {

using ::testing::HasSubstr;
using testing::TempDir;
namespace fs = std::filesystem;

TEST(AtomicFile, WriteBytesThenReadBack) {
  TempDir dir;
  std::string path = dir.file("a.bin");
  std::string bytes("x\0y\xff", 4);
  write_bytes_atomic(path, bytes);
  EXPECT_EQ(read_file(path), bytes);
  write_bytes_atomic(path, "second");
  EXPECT_EQ(read_file(path), "second");
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"a.bin"});  // no temporaries left
}

TEST(AtomicFile, WriterThrowingLeavesNoFileAndNoTemp) {
  TempDir dir;
  std::string path = dir.file("out.bin");
  EXPECT_THROW(write_file_atomic(path,
                                 [](std::FILE* f) {
                                   std::fputs("partial", f);
                                   throw std::runtime_error("writer failed");
                                 }),
               std::runtime_error);
  EXPECT_FALSE(fs::exists(path));
  EXPECT_TRUE(dir.entries().empty());
}

TEST(AtomicFile, WriterThrowingKeepsPreviousContent) {
  TempDir dir;
  std::string path = dir.file("out.bin");
  write_bytes_atomic(path, "old");
  EXPECT_THROW(write_file_atomic(path,
                                 [](std::FILE* f) {
                                   std::fputs("new but partial", f);
                                   fail("stop");
                                 }),
               Error);
  EXPECT_EQ(read_file(path), "old");
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"out.bin"});
}

TEST(AtomicFile, MissingDirectoryThrowsNamingPath) {
  TempDir dir;
  std::string path = dir.file("missing/sub/out.bin");
  try {
    write_bytes_atomic(path, "x");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(path));
  }
  EXPECT_FALSE(fs::exists(dir.file("missing")));
}

TEST(AtomicFile, ReadMissingFileThrowsNamingPath) {
  TempDir dir;
  std::string path = dir.file("nope.txt");
  try {
    read_file(path);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(path));
  }
}

TEST(AtomicFile, EnsureWritableDirCreatesParents) {
  TempDir dir;
  std::string sub = dir.file("a/b/c");
  ensure_writable_dir(sub);
  EXPECT_TRUE(fs::is_directory(sub));
  EXPECT_TRUE(fs::is_empty(sub));  // the write probe is removed
  ensure_writable_dir(sub);        // existing directory is fine
}

// We may run as root, for whom permission bits do not stop writes: make the
// directory impossible instead (below a regular file, or inside /proc).
TEST(AtomicFile, EnsureWritableDirBelowRegularFileThrows) {
  TempDir dir;
  std::string file = dir.write("plain.txt", "not a directory");
  std::string sub = file + "/out";
  try {
    ensure_writable_dir(sub);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(sub));
    EXPECT_THAT(e.what(), HasSubstr("cannot be created"));
  }
}

TEST(AtomicFile, EnsureWritableDirOnRegularFileThrows) {
  TempDir dir;
  std::string file = dir.write("plain.txt", "x");
  try {
    ensure_writable_dir(file);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(file));
    EXPECT_THAT(e.what(), ::testing::AnyOf(HasSubstr("not a directory"), HasSubstr("Not a directory")));
  }
}

TEST(AtomicFile, EnsureWritableDirUnwritableProcThrows) {
  if (!fs::is_directory("/proc/self")) GTEST_SKIP() << "/proc is not mounted";
  try {
    ensure_writable_dir("/proc");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("'/proc'"));
    EXPECT_THAT(e.what(), HasSubstr("not writable"));
  }
}

/// The pid of a process that has exited and been reaped: no process has it
/// now (until the kernel reuses it, which takes a full wrap of pid_max).
pid_t dead_pid() {
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  int status = 0;
  ::waitpid(child, &status, 0);
  return child;
}

TEST(AtomicFile, RemovesTemporariesOfDeadProcessesOnly) {
  TempDir dir;
  const pid_t dead = dead_pid();
  fs::create_directories(dir.file("checkpoints/step-000002"));
  const std::string stale1 =
      dir.write(fmt::format("checkpoints/step-000002/model.safetensors.tmp.{}.3", dead), "12345");
  const std::string stale2 = dir.write(fmt::format("config.toml.tmp.{}.0", dead), "abc");
  const std::string probe = dir.write(fmt::format(".write_probe.{}", dead), "");
  const std::string live = dir.write(fmt::format("metrics.jsonl.tmp.{}.7", ::getpid()), "live");  // this process
  const std::string other = dir.write(fmt::format("notes.tmp.{}", dead), "not ours: no counter");
  const std::string kept = dir.write("model.safetensors", "final");

  const StaleTemporaries removed = remove_stale_temporaries(dir.path().string());
  std::vector<std::string> expected{stale1, stale2, probe};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(removed.paths, expected);
  EXPECT_EQ(removed.bytes, 8u);
  for (const auto& p : expected) EXPECT_FALSE(fs::exists(p)) << p;
  for (const auto& p : {live, other, kept}) EXPECT_TRUE(fs::exists(p)) << p;
  EXPECT_TRUE(remove_stale_temporaries(dir.file("missing")).paths.empty());
}

TEST(AtomicFile, TemporaryNamesMatchWhatWriteFileAtomicCreates) {
  // The name remove_stale_temporaries looks for is the one write_file_atomic
  // uses: capture it from inside a writer, then pretend its process died by
  // renaming it to a dead pid.
  TempDir dir;
  std::string temp_name;
  write_file_atomic(dir.file("out.bin"), [&](std::FILE*) {
    for (const auto& e : fs::directory_iterator(dir.path())) temp_name = e.path().filename().string();
  });
  const std::string own = fmt::format(".tmp.{}.", ::getpid());
  ASSERT_NE(temp_name.find("out.bin" + own), std::string::npos) << temp_name;
  const std::string stale =
      dir.write(temp_name.replace(temp_name.find(own), own.size(), fmt::format(".tmp.{}.", dead_pid())), "x");
  EXPECT_EQ(remove_stale_temporaries(dir.path().string()).paths, std::vector<std::string>{stale});
}

}  // namespace
}  // namespace shoestring
