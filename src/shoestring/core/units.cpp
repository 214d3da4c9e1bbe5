#include "shoestring/core/units.h"

#include <cmath>

#include <fmt/format.h>

namespace shoestring {

std::string format_bytes(int64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  const char* sign = bytes < 0 ? "-" : "";
  // Magnitude as unsigned so INT64_MIN is representable.
  const uint64_t magnitude = bytes < 0 ? uint64_t{0} - static_cast<uint64_t>(bytes) : static_cast<uint64_t>(bytes);
  if (magnitude < 1024) return fmt::format("{}{} B", sign, magnitude);
  double value = static_cast<double>(magnitude);
  int unit = 0;
  while (value >= 1024.0 && unit < 6) {
    value /= 1024.0;
    ++unit;
  }
  // Three significant digits; a value that rounds up to 1024 moves one unit up.
  int decimals = value < 9.995 ? 2 : (value < 99.95 ? 1 : 0);
  if (decimals == 0 && std::round(value) >= 1024.0 && unit < 6) {
    value /= 1024.0;
    ++unit;
    decimals = 2;
  }
  return fmt::format("{}{:.{}f} {}", sign, value, decimals, kUnits[unit]);
}

std::string format_shape(c10::IntArrayRef shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace shoestring
