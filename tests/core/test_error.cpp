#include <gtest/gtest.h>

#include "shoestring/core/error.h"

TEST(Error, FailFormatsMessage) {
  try {
    shoestring::fail("key '{}' expected {}", "seed", "an integer");
    FAIL() << "fail() returned";
  } catch (const shoestring::Error& e) {
    EXPECT_STREQ(e.what(), "key 'seed' expected an integer");
  }
}

// Levenshtein's textbook examples: kitten -> sitting needs 3 edits
// (2 substitutions, 1 insertion); flaw -> lawn 2; identical strings 0.
TEST(Error, EditDistanceMatchesTheTextbookExamples) {
  EXPECT_EQ(shoestring::edit_distance("kitten", "sitting"), 3u);
  EXPECT_EQ(shoestring::edit_distance("flaw", "lawn"), 2u);
  EXPECT_EQ(shoestring::edit_distance("", "abc"), 3u);
  EXPECT_EQ(shoestring::edit_distance("seed", "seed"), 0u);
}
