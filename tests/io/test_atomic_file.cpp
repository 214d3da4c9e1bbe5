#include "shoestring/io/atomic_file.h"

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

}  // namespace
}  // namespace shoestring
