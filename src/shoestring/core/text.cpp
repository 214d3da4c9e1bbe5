#include "shoestring/core/text.h"

#include <fmt/format.h>

namespace shoestring {

namespace {

/// Length of the valid UTF-8 sequence of 2 to 4 bytes at s[i] and its code
/// point, or 0 if the bytes there are not one (overlong forms, surrogates and
/// values above U+10FFFF are not valid).
size_t utf8_sequence(std::string_view s, size_t i, char32_t* cp) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char lead = b(0);
  size_t n = 0;
  char32_t v = 0;
  if (lead >= 0xc2 && lead <= 0xdf) {
    n = 2, v = lead & 0x1f;
  } else if (lead >= 0xe0 && lead <= 0xef) {
    n = 3, v = lead & 0x0f;
  } else if (lead >= 0xf0 && lead <= 0xf4) {
    n = 4, v = lead & 0x07;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((b(k) & 0xc0) != 0x80) return 0;
    v = (v << 6) | (b(k) & 0x3f);
  }
  if ((n == 3 && v < 0x800) || (n == 4 && (v < 0x10000 || v > 0x10ffff)) || (v >= 0xd800 && v <= 0xdfff)) return 0;
  *cp = v;
  return n;
}

bool acts_on_terminal(char32_t cp) {
  return (cp >= 0x80 && cp <= 0x9f) || cp == 0x2028 || cp == 0x2029 || (cp >= 0x202a && cp <= 0x202e) ||
         (cp >= 0x2066 && cp <= 0x2069);
}

}  // namespace

std::string printable(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      out += fmt::format("\\x{:02x}", c);
    } else if (c >= 0x80) {
      char32_t cp = 0;
      const size_t n = utf8_sequence(s, i, &cp);
      if (n == 0) {
        out += fmt::format("\\x{:02x}", c);
      } else if (acts_on_terminal(cp)) {
        out += fmt::format("\\u{:04x}", static_cast<uint32_t>(cp));
        i += n;
        continue;
      } else {
        out.append(s.substr(i, n));
        i += n;
        continue;
      }
    } else {
      out.push_back(static_cast<char>(c));
    }
    ++i;
  }
  return out;
}

}  // namespace shoestring
