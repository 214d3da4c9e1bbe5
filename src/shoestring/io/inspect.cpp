#include "shoestring/io/inspect.h"

#include <algorithm>
#include <map>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "shoestring/core/text.h"
#include "shoestring/io/safetensors.h"

namespace shoestring {

namespace {

/// 1234567 -> "1,234,567".
std::string grouped(uint64_t v) {
  std::string digits = std::to_string(v);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(digits[i]);
  }
  return out;
}

std::string mib(uint64_t bytes) { return fmt::format("{:.2f} MiB", static_cast<double>(bytes) / (1024.0 * 1024.0)); }

/// Metadata values can be long (embedded configs, thumbnails): keep the text
/// summary on one line per key (control characters escaped, core/text.h) and
/// cut values beyond `limit` characters.
std::string one_line(const std::string& s, size_t limit = 200) {
  std::string out = printable(s);
  if (out.size() > limit) {
    out = fmt::format("{}... ({} characters in all)", out.substr(0, limit), s.size());
  }
  return out;
}

std::string shape_text(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

}  // namespace

nlohmann::json inspect_json(const SafetensorsFile& file) {
  nlohmann::json out = nlohmann::json::object();
  out["file"] = file.path();
  nlohmann::json tensors = nlohmann::json::array();
  uint64_t parameters = 0;
  uint64_t bytes = 0;
  std::map<std::string, uint64_t> per_dtype;
  for (const auto& t : file.tensors()) {
    tensors.push_back({{"name", t.name},
                       {"dtype", to_string(t.dtype)},
                       {"shape", t.shape},
                       {"parameters", static_cast<uint64_t>(t.numel())},
                       {"bytes", t.nbytes()}});
    parameters += static_cast<uint64_t>(t.numel());
    bytes += t.nbytes();
    per_dtype[to_string(t.dtype)] += t.nbytes();
  }
  out["tensors"] = std::move(tensors);
  out["parameters"] = parameters;
  out["bytes"] = bytes;
  out["bytes_per_dtype"] = per_dtype;
  out["metadata"] = file.metadata();
  return out;
}

std::string inspect_text(const SafetensorsFile& file) {
  const auto& tensors = file.tensors();
  size_t name_w = 4, dtype_w = 5, shape_w = 5;
  std::vector<std::string> shapes, names;  // names with control characters escaped
  shapes.reserve(tensors.size());
  names.reserve(tensors.size());
  uint64_t parameters = 0;
  uint64_t bytes = 0;
  std::map<std::string, uint64_t> per_dtype;
  for (const auto& t : tensors) {
    shapes.push_back(shape_text(t.shape));
    names.push_back(printable(t.name));
    name_w = std::max(name_w, names.back().size());
    dtype_w = std::max(dtype_w, std::string(to_string(t.dtype)).size());
    shape_w = std::max(shape_w, shapes.back().size());
    parameters += static_cast<uint64_t>(t.numel());
    bytes += t.nbytes();
    per_dtype[to_string(t.dtype)] += t.nbytes();
  }

  std::string out = fmt::format("{}: {} tensors\n", printable(file.path()), tensors.size());
  if (!tensors.empty()) {
    out += fmt::format("  {:<{}}  {:<{}}  {:<{}}  {:>14}\n", "name", name_w, "dtype", dtype_w, "shape", shape_w,
                       "parameters");
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    out += fmt::format("  {:<{}}  {:<{}}  {:<{}}  {:>14}\n", names[i], name_w, to_string(t.dtype), dtype_w, shapes[i],
                       shape_w, grouped(static_cast<uint64_t>(t.numel())));
  }
  out += fmt::format("total: {} parameters, {} bytes ({})\n", grouped(parameters), grouped(bytes), mib(bytes));
  if (!per_dtype.empty()) {
    out += "bytes per dtype:\n";
    size_t bytes_w = 0;
    for (const auto& [dtype, b] : per_dtype) bytes_w = std::max(bytes_w, grouped(b).size());
    for (const auto& [dtype, b] : per_dtype) {
      out += fmt::format("  {:<8} {:>{}} bytes ({})\n", dtype, grouped(b), bytes_w, mib(b));
    }
  }
  if (file.metadata().empty()) {
    out += "metadata: none\n";
  } else {
    out += "metadata:\n";
    for (const auto& [k, v] : file.metadata()) {
      out += fmt::format("  {} = {}\n", one_line(k), one_line(v));
    }
  }
  return out;
}

}  // namespace shoestring
