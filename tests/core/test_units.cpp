#include <gtest/gtest.h>

#include <cstdint>
#include <limits>

#include "shoestring/core/units.h"

namespace shoestring {
namespace {

TEST(FormatBytes, BinaryUnitsThreeSignificantDigits) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1024), "1.00 KiB");
  EXPECT_EQ(format_bytes(1536), "1.50 KiB");
  EXPECT_EQ(format_bytes(12LL << 20), "12.0 MiB");
  EXPECT_EQ(format_bytes(100LL << 20), "100 MiB");
  EXPECT_EQ(format_bytes(3LL << 29), "1.50 GiB");
  EXPECT_EQ(format_bytes(1LL << 40), "1.00 TiB");
  // 10239 B = 9.999 KiB rounds to "10.0", 1048575 B = 1023.999 KiB to 1.00 MiB.
  EXPECT_EQ(format_bytes(10239), "10.0 KiB");
  EXPECT_EQ(format_bytes(1048575), "1.00 MiB");
  EXPECT_EQ(format_bytes(-1536), "-1.50 KiB");
  EXPECT_EQ(format_bytes(std::numeric_limits<int64_t>::max()), "8.00 EiB");
  EXPECT_EQ(format_bytes(std::numeric_limits<int64_t>::min()), "-8.00 EiB");
}

}  // namespace
}  // namespace shoestring
