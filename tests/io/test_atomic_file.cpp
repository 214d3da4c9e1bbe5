#include "shoestring/io/atomic_file.h"

#include <poll.h>
#include <signal.h>
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

TEST(AtomicFile, TerminatedMidWriteLeavesNoTemporary) {
  // A child process stopped by SIGTERM (a launcher stopping its ranks, `kill`)
  // in the middle of a write: its temporary was on disk, and is gone after,
  // and the child still ends by the signal.
  for (int sig : {SIGTERM, SIGINT}) {
    TempDir dir;
    const std::string path = dir.file("out.bin");
    int ready[2];
    ASSERT_EQ(::pipe(ready), 0);
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      ::close(ready[0]);
      try {
        write_file_atomic(path, [&](std::FILE* f) {
          std::fputs("partial", f);
          std::fflush(f);
          const char byte = 1;
          if (::write(ready[1], &byte, 1) != 1) ::_exit(2);
          for (;;) ::pause();  // until the signal
        });
      } catch (...) {
      }
      ::_exit(3);
    }
    ::close(ready[1]);
    pollfd wait_ready{ready[0], POLLIN, 0};
    ASSERT_EQ(::poll(&wait_ready, 1, 20000), 1) << "the child did not start writing";
    const std::vector<std::string> during = dir.entries();
    ASSERT_EQ(during.size(), 1u);
    EXPECT_THAT(during[0], HasSubstr("out.bin.tmp." + std::to_string(child) + "."));
    ASSERT_EQ(::kill(child, sig), 0);
    int status = 0;
    ASSERT_EQ(::waitpid(child, &status, 0), child);
    ::close(ready[0]);
    EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == sig) << "status " << status << ", signal " << sig;
    EXPECT_TRUE(dir.entries().empty()) << "signal " << sig;
  }
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

// Only the temporaries of the names the caller owns go, whatever their pid
// (a container's restarted process often has the dead one's pid, e.g. 1),
// and only in the folder given, not below it.
TEST(AtomicFile, RemovesOwnedTemporariesOnly) {
  TempDir dir;
  fs::create_directories(dir.file("projects/deep"));
  const std::string stale1 = dir.write("model.safetensors.tmp.1.3", "12345");
  const std::string stale2 = dir.write(fmt::format("config.toml.tmp.{}.0", ::getpid()), "abc");
  const std::string probe = dir.write(".write_probe.77", "");
  const std::string foreign = dir.write("thesis.docx.tmp.99999.3", "a user's file");
  const std::string below = dir.write("projects/deep/model.safetensors.tmp.5.1", "not in this folder");
  const std::string no_counter = dir.write("model.safetensors.tmp.5", "not a temporary name");
  const std::string kept = dir.write("model.safetensors", "final");

  const StaleTemporaries removed = remove_temporaries(dir.path().string(), [](const std::string& name) {
    return name == "model.safetensors" || name == "config.toml" || name == ".write_probe";
  });
  std::vector<std::string> expected{stale1, stale2, probe};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(removed.paths, expected);
  EXPECT_EQ(removed.bytes, 8u);
  for (const auto& p : expected) EXPECT_FALSE(fs::exists(p)) << p;
  for (const auto& p : {foreign, below, no_counter, kept}) EXPECT_TRUE(fs::exists(p)) << p;
  EXPECT_TRUE(remove_temporaries(dir.file("missing"), [](const std::string&) { return true; }).paths.empty());
}

TEST(AtomicFile, TemporaryNamesMatchWhatWriteFileAtomicCreates) {
  // The name remove_temporaries looks for is the one write_file_atomic uses:
  // capture it from inside a writer, then leave a copy behind.
  TempDir dir;
  std::string temp_name;
  write_file_atomic(dir.file("out.bin"), [&](std::FILE*) {
    for (const auto& e : fs::directory_iterator(dir.path())) temp_name = e.path().filename().string();
  });
  ASSERT_EQ(temp_name.rfind(fmt::format("out.bin.tmp.{}.", ::getpid()), 0), 0u) << temp_name;
  const std::string stale = dir.write(temp_name, "x");
  EXPECT_EQ(remove_temporaries(dir.path().string(), [](const std::string& n) { return n == "out.bin"; }).paths,
            std::vector<std::string>{stale});
}

// flock locks belong to an open file description: a second lock on the same
// file is refused even in the same process, and released with the first.
TEST(AtomicFile, FolderLockIsExclusiveUntilReleased) {
  TempDir dir;
  {
    FolderLock first(dir.path().string(), ".lock");
    try {
      FolderLock second(dir.path().string(), ".lock");
      FAIL() << "no error";
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr("in use by another shoestring process"));
      EXPECT_THAT(e.what(), HasSubstr(dir.path().string()));
    }
  }
  FolderLock again(dir.path().string(), ".lock");  // released: free again
  EXPECT_TRUE(fs::exists(again.path()));
}

}  // namespace
}  // namespace shoestring
