// UTF-8 validation for text read from user files (captions, names shown
// by core/text.h).
#pragma once
#include <cstddef>
#include <string_view>

namespace shoestring {

/// Byte offset of the first ill-formed sequence in `text` (the offset of its
/// first byte), or std::string_view::npos when all of `text` is valid UTF-8. Follows RFC 3629 section 4
/// (the UTF8-octets grammar): a sequence is 1 to 4 bytes; rejected are stray
/// continuation bytes (0x80..0xBF as a lead byte), the lead bytes C0, C1 and
/// F5..FF, overlong forms (E0 80..9F, F0 80..8F), UTF-16 surrogates
/// U+D800..U+DFFF (ED A0..BF) and code points above U+10FFFF (F4 90..BF), and
/// sequences cut short by the end of the text or by a byte that is not
/// 0x80..0xBF. U+0000 and
/// noncharacters such as U+FFFE are valid, as in RFC 3629.
size_t utf8_error_offset(std::string_view text);

/// Length of the well-formed UTF-8 sequence that starts at text[i] (i <
/// text.size()): 1 for ASCII, 2 to 4 for a multi-byte sequence, or 0 when the
/// bytes there are ill-formed by the rules of utf8_error_offset().
size_t utf8_sequence_length(std::string_view text, size_t i);

/// The code point of the well-formed sequence of `len` bytes at text[i] (as
/// returned by utf8_sequence_length).
char32_t utf8_code_point(std::string_view text, size_t i, size_t len);

}  // namespace shoestring
