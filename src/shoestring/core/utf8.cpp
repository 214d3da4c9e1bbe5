// UTF-8 validation (RFC 3629). See utf8.h.
#include "shoestring/core/utf8.h"

namespace shoestring {

size_t utf8_sequence_length(std::string_view text, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char lead = byte(i);
  if (lead < 0x80) return 1;
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
    return 0;  // 0x80..0xC1 (continuation byte or overlong 2-byte lead), 0xF5..0xFF
  }
  if (i + len > text.size()) return 0;
  if (byte(i + 1) < lo || byte(i + 1) > hi) return 0;
  for (size_t k = 2; k < len; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
  }
  return len;
}

char32_t utf8_code_point(std::string_view text, size_t i, size_t len) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[i + k]); };
  if (len == 1) return byte(0);
  char32_t cp = byte(0) & (0x7F >> len);  // the lead byte's payload bits
  for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (byte(k) & 0x3F);
  return cp;
}

size_t utf8_error_offset(std::string_view text) {
  for (size_t i = 0; i < text.size();) {
    const size_t len = utf8_sequence_length(text, i);
    if (len == 0) return i;
    i += len;
  }
  return std::string_view::npos;
}

}  // namespace shoestring
