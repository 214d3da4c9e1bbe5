// UTF-8 validation (RFC 3629). See utf8.h.
#include "shoestring/core/utf8.h"

namespace shoestring {

size_t utf8_error_offset(std::string_view text) {
  const auto byte = [&](size_t i) { return static_cast<unsigned char>(text[i]); };
  const size_t n = text.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char lead = byte(i);
    if (lead < 0x80) {
      ++i;
      continue;
    }
    // Length and the allowed range of the second byte (RFC 3629 section 4).
    size_t len = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (lead >= 0xC2 && lead <= 0xDF) {
      len = 2;
    } else if (lead == 0xE0) {
      len = 3, lo = 0xA0;  // no overlong 3-byte forms (< U+0800)
    } else if ((lead >= 0xE1 && lead <= 0xEC) || lead == 0xEE || lead == 0xEF) {
      len = 3;
    } else if (lead == 0xED) {
      len = 3, hi = 0x9F;  // no surrogates U+D800..U+DFFF
    } else if (lead == 0xF0) {
      len = 4, lo = 0x90;  // no overlong 4-byte forms (< U+10000)
    } else if (lead >= 0xF1 && lead <= 0xF3) {
      len = 4;
    } else if (lead == 0xF4) {
      len = 4, hi = 0x8F;  // nothing above U+10FFFF
    } else {
      return i;  // 0x80..0xC1 (continuation byte or overlong 2-byte lead), 0xF5..0xFF
    }
    if (i + len > n) return i;
    if (byte(i + 1) < lo || byte(i + 1) > hi) return i;
    for (size_t k = 2; k < len; ++k) {
      if ((byte(i + k) & 0xC0) != 0x80) return i;
    }
    i += len;
  }
  return std::string_view::npos;
}

}  // namespace shoestring
