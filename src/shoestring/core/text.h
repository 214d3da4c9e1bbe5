// Text from files (tensor names, metadata, shard names) made safe to print on
// a terminal: control characters cannot move the cursor, colour the screen or
// start a new (forged) line of a table.
#pragma once
#include <string>
#include <string_view>

namespace shoestring {

/// `s` with every character a terminal would act on written as an escape:
/// "\n", "\r", "\t"; other C0 controls, DEL and bytes that are not valid
/// UTF-8 as "\xHH" (two lowercase hex digits); the C1 controls U+0080..U+009F,
/// the line / paragraph separators U+2028, U+2029 and the bidirectional
/// overrides and isolates U+202A..U+202E, U+2066..U+2069 as "\uHHHH".
/// Everything else, printable ASCII and other UTF-8 included, is kept as it
/// is (a backslash too: the result is for reading, not for parsing back).
/// Example: the C++ literal "a\x1b[31m\nb" (7 bytes) becomes the 13
/// characters a\x1b[31m\nb, each backslash a literal one.
std::string printable(std::string_view s);

/// Whether `s` begins with `prefix` (key prefixes of weight files).
inline bool has_prefix(std::string_view s, std::string_view prefix) { return s.substr(0, prefix.size()) == prefix; }
/// Whether `s` ends with `suffix`.
inline bool has_suffix(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

}  // namespace shoestring
