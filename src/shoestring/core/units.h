// Human-readable units for logs and reports.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <c10/util/ArrayRef.h>

namespace shoestring {

/// Formats a byte count with binary (IEC) units and three significant digits:
/// 512 -> "512 B", 1536 -> "1.50 KiB", 12582912 -> "12.0 MiB",
/// 1610612736 -> "1.50 GiB", 1 << 40 -> "1.00 TiB". Units go up to EiB.
/// Negative counts (deltas) keep their sign: -1536 -> "-1.50 KiB".
/// Values that would print as "1024" after rounding move to the next unit.
std::string format_bytes(int64_t bytes);

/// Formats a tensor shape for messages: {2, 3, 64} -> "[2, 3, 64]", {} -> "[]".
std::string format_shape(c10::IntArrayRef shape);

}  // namespace shoestring
