// Errors: every failure the user can cause is a shoestring::Error whose
// message names the file, key or tensor involved and what was expected.
// Library code never calls exit(); the CLI catches Error and prints it.
#pragma once
#include <cstddef>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace shoestring {

/// Exception for user-visible failures (bad config, bad file, bad input).
/// The message is complete and printable as is.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Throws shoestring::Error with a fmt-formatted message.
template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

/// Levenshtein distance (insertions, deletions, substitutions, each 1)
/// between two byte strings, for "did you mean" suggestions in error
/// messages (unknown config keys, unknown LoRA module names).
size_t edit_distance(const std::string& a, const std::string& b);

}  // namespace shoestring
