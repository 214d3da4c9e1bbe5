#include "shoestring/core/text.h"

#include <gtest/gtest.h>

namespace shoestring {
namespace {

TEST(Printable, KeepsPrintableAsciiAndUtf8) {
  EXPECT_EQ(printable("unet.down_blocks.0.weight"), "unet.down_blocks.0.weight");
  EXPECT_EQ(printable(R"(C:\runs\a "b")"), R"(C:\runs\a "b")");
  EXPECT_EQ(printable("gr\xc3\xbc\xc3\x9f \xe7\x8c\xab \xf0\x9f\x98\x80"),
            "gr\xc3\xbc\xc3\x9f \xe7\x8c\xab \xf0\x9f\x98\x80");
  EXPECT_EQ(printable(""), "");
}

TEST(Printable, EscapesC0ControlsAndDel) {
  EXPECT_EQ(printable("a\x1b[31mred\x1b[0m"), R"(a\x1b[31mred\x1b[0m)");
  EXPECT_EQ(printable("line\nforged  F32  [1]\r\t"), R"(line\nforged  F32  [1]\r\t)");
  EXPECT_EQ(printable(std::string("\0\x07\x7f", 3)), R"(\x00\x07\x7f)");
}

TEST(Printable, EscapesC1ControlsSeparatorsAndBidiOverrides) {
  EXPECT_EQ(printable("\xc2\x9b"
                      "31m"),
            R"(\u009b31m)");  // U+009B, a one-character CSI
  EXPECT_EQ(printable("\xc2\x85"), R"(\u0085)");
  EXPECT_EQ(printable("a\xe2\x80\xa8"
                      "b"),
            R"(a\u2028b)");
  EXPECT_EQ(printable("\xe2\x80\xae"
                      "cba"),
            R"(\u202ecba)");
  EXPECT_EQ(printable("\xe2\x81\xa6x\xe2\x81\xa9"), R"(\u2066x\u2069)");
  EXPECT_EQ(printable("\xc2\xa0"), "\xc2\xa0");  // U+00A0 is printable
}

TEST(Printable, EscapesBytesThatAreNotUtf8) {
  EXPECT_EQ(printable("\xff"), R"(\xff)");
  EXPECT_EQ(printable("a\xc3"), R"(a\xc3)");                        // truncated sequence
  EXPECT_EQ(printable("\xc0\xaf"), R"(\xc0\xaf)");                  // overlong '/'
  EXPECT_EQ(printable("\xed\xa0\x80"), R"(\xed\xa0\x80)");          // surrogate U+D800
  EXPECT_EQ(printable("\xf4\x90\x80\x80"), R"(\xf4\x90\x80\x80)");  // above U+10FFFF
}

}  // namespace
}  // namespace shoestring
