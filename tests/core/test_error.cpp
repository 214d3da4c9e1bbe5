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
