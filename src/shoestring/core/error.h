// Errors: every failure the user can cause is a shoestring::Error whose
// message names the file, key or tensor involved and what was expected.
// Library code never calls exit(); the CLI catches Error and prints it.
#pragma once
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

}  // namespace shoestring
