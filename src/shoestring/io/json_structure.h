// Structure checks of untrusted JSON text (safetensors headers, sharded
// checkpoint indexes), run before nlohmann::json builds the text in memory:
// nlohmann keeps the last of duplicate keys silently and builds any nesting
// depth, so a malformed file could mean something other than it says, or
// cost gigabytes of memory before it is refused.
#pragma once
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

namespace shoestring {

/// What scan_json_structure() found; all empty / false: nothing.
struct JsonStructureIssues {
  std::optional<size_t> too_deep_at;             ///< byte offset of the first '{' / '[' nested beyond max_depth
  std::optional<std::string> duplicate_top_key;  ///< a key of the top-level object given twice
  /// (top-level key, a key given twice inside its value)
  std::optional<std::pair<std::string, std::string>> duplicate_nested_key;
  std::optional<std::string> syntax_error;  ///< the JSON parser's message
  bool long_array = false;                  ///< an array holds more than max_array_length values
};

/// Scans JSON `text` in linear time and stops at the first issue: a pass
/// over the brackets outside strings for nesting beyond `max_depth`
/// (the text is then not parsed), then a SAX pass with one hash set of keys
/// per open object for duplicate keys, arrays longer than
/// `max_array_length` and syntax errors. Throws nothing.
JsonStructureIssues scan_json_structure(std::string_view text, int max_depth, size_t max_array_length);

}  // namespace shoestring
