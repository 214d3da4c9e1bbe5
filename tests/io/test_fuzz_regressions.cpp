// Replays the reader fuzz target's seed corpus and every input that once
// crashed it (tests/fuzz/corpus/, tests/fuzz/regressions/) through the same
// code (tests/fuzz/fuzz_input.h) in the ordinary build: each must be read or
// refused with shoestring::Error, never crash or throw anything else.
#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "../fuzz/fuzz_input.h"
#include "shoestring/core/error.h"
#include "shoestring/io/atomic_file.h"
#include "temp_dir.h"

namespace shoestring {
namespace {

namespace fs = std::filesystem;

std::vector<fs::path> inputs_in(const std::string& folder) {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(fs::path(SHOESTRING_SOURCE_DIR) / "tests" / "fuzz" / folder)) {
    if (e.is_regular_file() && e.path().extension() != ".md") out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

/// "read" or "refused" for one input; fails the test for anything else.
std::string outcome(const fs::path& input) {
  testing::TempDir dir;
  const std::string bytes = read_file(input.string());
  try {
    fuzz::read_fuzz_input(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), dir.path());
    return "read";
  } catch (const Error&) {
    return "refused";
  } catch (const std::exception& e) {
    ADD_FAILURE() << input << ": threw a non-shoestring exception: " << e.what();
    return "other";
  }
}

TEST(FuzzRegressions, EveryCommittedInputIsReadOrRefused) {
  const auto regressions = inputs_in("regressions");
  for (const auto& p : regressions) outcome(p);
}

TEST(FuzzRegressions, SeedCorpusOutcomesMatchTheirNames) {
  // Seeds are named st_valid_* / ix_valid_* (accepted) or *_bad_* (refused):
  // checks the harness reaches the readers rather than stopping early.
  const auto seeds = inputs_in("corpus");
  ASSERT_GE(seeds.size(), 10u);
  for (const auto& p : seeds) {
    const std::string name = p.filename().string();
    EXPECT_EQ(outcome(p), name.find("_valid") != std::string::npos ? "read" : "refused") << name;
  }
}

}  // namespace
}  // namespace shoestring
