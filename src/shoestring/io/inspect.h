// Summaries of a safetensors file for `shoestring inspect`: per-tensor
// dtype/shape/size, totals, bytes per dtype and metadata, as JSON or text.
#pragma once
#include <string>

#include <nlohmann/json_fwd.hpp>

namespace shoestring {

class SafetensorsFile;

/// Machine-readable summary of `file`:
/// {"file": path,
///  "tensors": [{"name", "dtype", "shape": [..], "parameters": numel, "bytes"}...]
///             (data-buffer order),
///  "parameters": total numel, "bytes": total tensor bytes,
///  "bytes_per_dtype": {"F32": bytes, ...}, "metadata": {key: value}}.
/// Counts are exact integers; bytes are bytes.
nlohmann::json inspect_json(const SafetensorsFile& file);

/// Human-readable summary of `file`: one line per tensor (name, dtype, shape,
/// number of elements), then total parameters, total bytes (and MiB), bytes
/// per dtype, and the metadata. Ends with a newline. Names, metadata and the
/// path are shown through printable() (core/text.h): control characters in
/// them are escaped, never sent to the terminal.
std::string inspect_text(const SafetensorsFile& file);

}  // namespace shoestring
