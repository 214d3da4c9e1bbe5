// UTF-8 validation against RFC 3629, checked by a reference that decodes the
// bits first and judges the code point after (the validator judges bytes).
#include <gtest/gtest.h>

#include <string>

#include "shoestring/core/utf8.h"

namespace shoestring {
namespace {

constexpr size_t kValid = std::string_view::npos;

std::string bytes(std::initializer_list<int> b) {
  std::string s;
  for (int c : b) s += static_cast<char>(c);
  return s;
}

/// Reference for one sequence that fills `s` exactly: valid iff the lead
/// byte announces s.size() bytes, the rest are 10xxxxxx, and the decoded code
/// point is not overlong, not a surrogate and <= U+10FFFF.
bool reference_valid(const std::string& s) {
  const auto u = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  size_t len;
  char32_t cp;
  if (u(0) < 0x80) {
    len = 1, cp = u(0);
  } else if ((u(0) & 0xE0) == 0xC0) {
    len = 2, cp = u(0) & 0x1F;
  } else if ((u(0) & 0xF0) == 0xE0) {
    len = 3, cp = u(0) & 0x0F;
  } else if ((u(0) & 0xF8) == 0xF0) {
    len = 4, cp = u(0) & 0x07;
  } else {
    return false;
  }
  if (len != s.size()) return false;
  for (size_t k = 1; k < len; ++k) {
    if ((u(k) & 0xC0) != 0x80) return false;
    cp = (cp << 6) | (u(k) & 0x3F);
  }
  const char32_t min_cp[] = {0, 0, 0x80, 0x800, 0x10000};
  return cp >= min_cp[len] && !(cp >= 0xD800 && cp <= 0xDFFF) && cp <= 0x10FFFF;
}

TEST(Utf8, KnownValidAndInvalidText) {
  EXPECT_EQ(utf8_error_offset(""), kValid);
  EXPECT_EQ(utf8_error_offset("plain ascii, with a\ttab"), kValid);
  EXPECT_EQ(utf8_error_offset("caf\xC3\xA9 \xE2\x9D\xA4 \xF0\x9F\x98\x80"), kValid);  // é ❤ 😀
  EXPECT_EQ(utf8_error_offset(bytes({0xF4, 0x8F, 0xBF, 0xBF})), kValid);              // U+10FFFF
  EXPECT_EQ(utf8_error_offset(bytes({0xEF, 0xBF, 0xBE})), kValid);                    // U+FFFE (noncharacter)
  EXPECT_EQ(utf8_error_offset(std::string("a\0b", 3)), kValid);                       // U+0000

  EXPECT_EQ(utf8_error_offset("caf\xE9!"), 3u);                       // Latin-1 é
  EXPECT_EQ(utf8_error_offset(bytes({'a', 'b', 0xC0, 0xAF})), 2u);    // overlong '/'
  EXPECT_EQ(utf8_error_offset(bytes({0xE0, 0x80, 0xAF})), 0u);        // overlong '/', 3 bytes
  EXPECT_EQ(utf8_error_offset(bytes({0xF0, 0x8F, 0xBF, 0xBF})), 0u);  // overlong U+FFFF
  EXPECT_EQ(utf8_error_offset(bytes({'x', 0xED, 0xA0, 0x80})), 1u);   // surrogate U+D800
  EXPECT_EQ(utf8_error_offset(bytes({0xED, 0xBF, 0xBF})), 0u);        // surrogate U+DFFF
  EXPECT_EQ(utf8_error_offset(bytes({0xF4, 0x90, 0x80, 0x80})), 0u);  // U+110000
  EXPECT_EQ(utf8_error_offset(bytes({0xF5, 0x80, 0x80, 0x80})), 0u);  // lead F5
  EXPECT_EQ(utf8_error_offset(bytes({0xFF})), 0u);
  EXPECT_EQ(utf8_error_offset(bytes({'o', 'k', 0x80})), 2u);                // stray continuation
  EXPECT_EQ(utf8_error_offset(bytes({0xE2, 0x9D})), 0u);                    // cut short by the end
  EXPECT_EQ(utf8_error_offset(bytes({0xE2, 0x9D, 'A'})), 0u);               // cut short by ASCII
  EXPECT_EQ(utf8_error_offset(bytes({0xC3, 0xA9, 0xF0, 0x9F, 0x98})), 2u);  // after a valid é
}

// Every sequence of one to three bytes, and every four-byte one whose last
// byte is one of a few representatives, against the reference.
TEST(Utf8, SequenceLengthAndCodePoint) {
  // (UTF-8 bytes, code point) from the Unicode code charts.
  const std::pair<std::string, char32_t> known[] = {
      {"A", U'A'},
      {"\xc3\xa9", U'\u00e9'},
      {"\xc2\x9b", U'\u009b'},
      {"\xe2\x82\xac", U'\u20ac'},
      {"\xe2\x80\xae", U'\u202e'},
      {"\xf0\x9f\x98\x80", U'\U0001f600'},
      {"\xf4\x8f\xbf\xbf", U'\U0010ffff'},
  };
  for (const auto& [text, cp] : known) {
    const std::string in = "x" + text + "y";
    ASSERT_EQ(utf8_sequence_length(in, 1), text.size()) << text;
    EXPECT_EQ(utf8_code_point(in, 1, text.size()), cp) << text;
  }
  for (const std::string bad : {"\x80", "\xc0\xaf", "\xe0\x80\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80", "\xe2\x82"}) {
    EXPECT_EQ(utf8_sequence_length(bad, 0), 0u) << bad;
  }
}

TEST(Utf8, AgreesWithDecodingReferenceOnAllShortSequences) {
  std::string s;
  for (int a = 0; a < 256; ++a) {
    s = bytes({a});
    ASSERT_EQ(utf8_error_offset(s) == kValid, reference_valid(s)) << a;
    for (int b = 0; b < 256; ++b) {
      s = bytes({a, b});
      const bool ref2 = reference_valid(s) || (reference_valid(bytes({a})) && reference_valid(bytes({b})));
      ASSERT_EQ(utf8_error_offset(s) == kValid, ref2) << a << " " << b;
      if (a < 0xE0 || a > 0xF7) continue;  // only 3- and 4-byte leads from here
      for (int c = 0; c < 256; ++c) {
        s = bytes({a, b, c});
        if (a < 0xF0) {
          ASSERT_EQ(utf8_error_offset(s) == kValid, reference_valid(s)) << a << " " << b << " " << c;
          continue;
        }
        for (int d : {0x00, 0x7F, 0x80, 0xA5, 0xBF, 0xC0, 0xFF}) {
          s = bytes({a, b, c, d});
          ASSERT_EQ(utf8_error_offset(s) == kValid, reference_valid(s)) << a << " " << b << " " << c << " " << d;
        }
      }
    }
  }
}

}  // namespace
}  // namespace shoestring
