// Shared GoogleTest entry point: fixes libtorch's thread count so tests are
// repeatable and do not oversubscribe the 2-core CI machine, and removes the
// temporary folders this process made when every test passed.
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <system_error>

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

/// Removes "<tmp>/shoestring_*" entries whose name carries this process's id
/// as a whole "_<pid>" field (the naming of fresh_temp_dir and the tests'
/// other temp helpers). Training tests leave run folders of up to 500 MB
/// there; a full suite left 2.3 GB a run before this. A failed test keeps
/// them for inspection, as does SHOESTRING_KEEP_TEST_DIRS=1.
void remove_own_temp_dirs() {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path tmp = fs::temp_directory_path(ec);
  if (ec) return;
  const std::string pid = "_" + std::to_string(::getpid());
  for (fs::directory_iterator it(tmp, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind("shoestring_", 0) != 0) continue;
    const size_t at = name.find(pid);
    if (at == std::string::npos) continue;
    const size_t after = at + pid.size();
    if (after != name.size() && name[after] != '_' && name[after] != '.') continue;
    std::error_code rm;
    fs::remove_all(it->path(), rm);
  }
}

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  // ctest runs a suite per process (--gtest_filter=Suite.*, cmake/gtest_suites.cmake);
  // SHOESTRING_TEST_EXCLUDE (gtest patterns joined by ':') leaves tests of it out,
  // e.g. the slow ones under a sanitizer (scripts/test_sanitize.sh).
  if (const char* exclude = std::getenv("SHOESTRING_TEST_EXCLUDE"); exclude && *exclude) {
    std::string filter = ::testing::GTEST_FLAG(filter);
    filter += (filter.find('-') == std::string::npos ? "-" : ":") + std::string(exclude);
    ::testing::GTEST_FLAG(filter) = filter;
  }
  // One intra-op thread per test process: ctest runs two processes at once
  // on the 2-core CI machine, and OpenMP barriers degrade badly when
  // oversubscribed. Tests that need more threads set them themselves.
  torch::set_num_threads(1);
  const int result = RUN_ALL_TESTS();
  const char* keep = std::getenv("SHOESTRING_KEEP_TEST_DIRS");
  if (result == 0 && (keep == nullptr || std::string(keep) != "1")) remove_own_temp_dirs();
  return result;
}
