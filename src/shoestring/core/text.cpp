#include "shoestring/core/text.h"

#include <fmt/format.h>

#include "shoestring/core/utf8.h"

namespace shoestring {

namespace {

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
      const size_t n = utf8_sequence_length(s, i);
      if (n == 0) {
        out += fmt::format("\\x{:02x}", c);
      } else {
        const char32_t cp = utf8_code_point(s, i, n);
        if (acts_on_terminal(cp)) {
          out += fmt::format("\\u{:04x}", static_cast<uint32_t>(cp));
        } else {
          out.append(s.substr(i, n));
        }
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
