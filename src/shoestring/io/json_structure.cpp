#include "shoestring/io/json_structure.h"

#include <unordered_set>
#include <vector>

#include <nlohmann/json.hpp>

namespace shoestring {

namespace {

/// One linear pass over `text` that tracks bracket depth outside strings;
/// returns the offset of the first '{' or '[' that opens level max_depth + 1,
/// or nullopt. Exact for well-formed JSON; for malformed text the parser that
/// runs next reports the syntax error.
std::optional<size_t> find_too_deep(std::string_view text, int max_depth) {
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // the escaped character cannot end the string
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > max_depth) return i;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return std::nullopt;
}

/// SAX pass: records the first duplicate top-level key, the first duplicate
/// key inside a top-level entry, the first over-long array and the first
/// syntax error, and stops there. Linear in the text size: one hash set of
/// keys per open object.
class KeyCheck : public nlohmann::json_sax<nlohmann::json> {
 public:
  explicit KeyCheck(size_t max_array_length) : max_array_length_(max_array_length) {}
  std::optional<std::string> dup_name;                         // duplicate top-level key
  std::optional<std::pair<std::string, std::string>> dup_key;  // (top-level key, duplicate key)
  std::optional<std::string> syntax_error;                     // the JSON parser's message
  bool long_array = false;

  bool null() override { return value(); }
  bool boolean(bool) override { return value(); }
  bool number_integer(number_integer_t) override { return value(); }
  bool number_unsigned(number_unsigned_t) override { return value(); }
  bool number_float(number_float_t, const string_t&) override { return value(); }
  bool string(string_t&) override { return value(); }
  bool binary(binary_t&) override { return value(); }
  bool start_object(std::size_t) override {
    if (!value()) return false;
    open_.push_back({true, 0});
    keys_.emplace_back();
    return true;
  }
  bool end_object() override {
    open_.pop_back();
    keys_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override {
    if (!value()) return false;
    open_.push_back({false, 0});
    return true;
  }
  bool end_array() override {
    open_.pop_back();
    return true;
  }
  bool key(string_t& k) override {
    const bool fresh = keys_.back().insert(k).second;
    if (open_.size() == 1) {
      top_key_ = k;
      if (!fresh) dup_name = k;
    } else if (!fresh) {
      dup_key = std::make_pair(top_key_, k);
    }
    return fresh;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    syntax_error = e.what();
    return false;
  }

 private:
  struct Open {
    bool object;
    size_t elements;  // of an array
  };
  std::vector<Open> open_;                             // open objects and arrays, outermost first
  std::vector<std::unordered_set<std::string>> keys_;  // the keys of each open object, outermost first
  std::string top_key_;                                // the top-level key being read
  size_t max_array_length_;

  // Counts an array element; false (stop) when an array grows too long.
  bool value() {
    if (!open_.empty() && !open_.back().object && ++open_.back().elements > max_array_length_) {
      long_array = true;
      return false;
    }
    return true;
  }
};

}  // namespace

JsonStructureIssues scan_json_structure(std::string_view text, int max_depth, size_t max_array_length) {
  JsonStructureIssues issues;
  issues.too_deep_at = find_too_deep(text, max_depth);
  if (issues.too_deep_at) return issues;  // never handed to the parser
  KeyCheck check(max_array_length);
  nlohmann::json::sax_parse(text.begin(), text.end(), &check);
  issues.duplicate_top_key = check.dup_name;
  issues.duplicate_nested_key = check.dup_key;
  issues.syntax_error = check.syntax_error;
  issues.long_array = check.long_array;
  return issues;
}

}  // namespace shoestring
