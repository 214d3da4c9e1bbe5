// The message of the shoestring::Error a piece of test code throws, for tests
// that check what an error names.
#pragma once
#include <functional>
#include <string>

#include "shoestring/core/error.h"

namespace shoestring::testing {

/// e.what() of the shoestring::Error `fn` throws; "" when it throws none
/// (other exceptions propagate and fail the test).
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace shoestring::testing
