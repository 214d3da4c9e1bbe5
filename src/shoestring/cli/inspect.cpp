// `shoestring inspect FILE.safetensors [--json]`: validates a safetensors file
// and prints its tensors, totals, bytes per dtype and metadata (the rendering
// lives in io/inspect.h so it can be tested without the CLI), then the
// architectures detected from its tensor names and shapes.
//
// `shoestring inspect --arch NAME [--tiny] [--json]`: builds a registered
// architecture on the meta device (nothing allocated) and prints its
// parameter count and the bytes its weights take in fp32 / bf16 / fp16 / fp8.
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "shoestring/cli/commands.h"
#include "shoestring/core/error.h"
#include "shoestring/core/text.h"
#include "shoestring/core/units.h"
#include "shoestring/io/inspect.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/io/weight_files.h"
#include "shoestring/models/architecture.h"

namespace shoestring::cli {

namespace {

struct InspectOptions {
  std::string file;
  std::string arch;
  bool tiny = false;
  bool json = false;
};

// Elements per byte of each storage dtype a user may pick.
const std::vector<std::pair<const char*, int64_t>> kDtypeBytes = {{"fp32", 4}, {"bf16", 2}, {"fp16", 2}, {"fp8", 1}};

void print_architecture(const InspectOptions& o) {
  const models::Architecture& a = models::find_architecture(o.arch);
  const auto& tensors = models::architecture_tensors(a.name, o.tiny);
  int64_t params = 0;
  for (const auto& t : tensors) {
    if (!t.parameter) continue;  // buffers (e.g. pos_embed) are stored but not parameters
    int64_t n = 1;
    for (int64_t s : t.shape) n *= s;
    params += n;
  }
  if (o.json) {
    nlohmann::json j;
    j["architecture"] = a.name;
    j["tiny"] = o.tiny;
    j["description"] = a.description;
    j["prefix"] = a.prefix;
    j["tensors"] = tensors.size();
    j["parameters"] = params;
    j["expected_parameters"] = a.parameters;
    j["parameters_source"] = a.parameters_source;
    for (const auto& [name, bytes] : kDtypeBytes) j["bytes_per_dtype"][name] = params * bytes;
    std::cout << j.dump(2) << '\n';
    return;
  }
  std::cout << fmt::format("architecture {}{}: {}\n", a.name, o.tiny ? " (tiny width)" : "", a.description);
  std::cout << fmt::format("checkpoint key prefix: {}\n", a.prefix);
  std::cout << fmt::format("tensors: {}\n", tensors.size());
  std::cout << fmt::format("parameters: {}", params);
  if (a.parameters > 0 && !o.tiny) std::cout << fmt::format(" (expected {}: {})", a.parameters, a.parameters_source);
  std::cout << '\n';
  std::cout << "weights:";
  for (const auto& [name, bytes] : kDtypeBytes) std::cout << fmt::format(" {} {}", name, format_bytes(params * bytes));
  std::cout << '\n';
}

nlohmann::json detection_json(const models::Detection& d) {
  return {{"architecture", d.architecture}, {"tiny", d.tiny},       {"prefix", d.prefix},
          {"matched", d.matched},           {"missing", d.missing}, {"unexpected", d.unexpected},
          {"mismatched", d.mismatched},     {"exact", d.exact()}};
}

std::string detection_text(const std::vector<models::Detection>& found) {
  std::ostringstream out;
  if (found.empty()) {
    std::string names;
    for (const auto& a : models::architectures()) names += (names.empty() ? "" : ", ") + a.name;
    out << "architecture: not detected (none of " << names << ")\n";
    return out.str();
  }
  constexpr size_t kShown = 10;
  auto list = [&](const char* what, const std::vector<std::string>& items) {
    if (items.empty()) return;
    out << fmt::format("  {} {}:\n", items.size(), what);
    for (size_t i = 0; i < items.size() && i < kShown; ++i) out << "    " << printable(items[i]) << '\n';
    if (items.size() > kShown) out << fmt::format("    ... and {} more\n", items.size() - kShown);
  };
  for (const auto& d : found) {
    out << fmt::format("architecture: {}{} under '{}' ({} tensors match; {} missing, {} unexpected, {} other shape)\n",
                       d.architecture, d.tiny ? " (tiny width)" : "", printable(d.prefix), d.matched, d.missing.size(),
                       d.unexpected.size(), d.mismatched.size());
    list("missing", d.missing);
    list("unexpected", d.unexpected);
    list("with another shape", d.mismatched);
  }
  return out.str();
}

// A sharded checkpoint (*.safetensors.index.json): every shard is opened and
// validated; prints the shards, tensor count, parameters and the detection.
void inspect_sharded(const InspectOptions& o) {
  const WeightFiles files = WeightFiles::open(o.file);
  std::vector<models::TensorShape> shapes;
  std::map<std::string, int64_t> per_file;
  int64_t params = 0;
  for (const auto& name : files.names()) {
    const TensorInfo* info = files.find(name);
    shapes.push_back({name, info->shape});
    params += info->numel();
    ++per_file[files.file_of(name)];
  }
  const std::vector<models::Detection> found = models::detect_architectures(shapes);
  if (o.json) {
    nlohmann::json j;
    j["path"] = o.file;
    j["sharded"] = true;
    j["shards"] = per_file;
    j["tensors"] = shapes.size();
    j["parameters"] = params;
    j["data_bytes"] = files.data_bytes();
    j["metadata"] = files.metadata();
    j["architectures"] = nlohmann::json::array();
    for (const auto& d : found) j["architectures"].push_back(detection_json(d));
    std::cout << j.dump(2) << '\n';
  } else {
    std::cout << fmt::format("{}: sharded checkpoint, {} shards, {} tensors, {} parameters, {} of data\n",
                             printable(o.file), per_file.size(), shapes.size(), params,
                             format_bytes(static_cast<int64_t>(files.data_bytes())));
    for (const auto& [f, n] : per_file) std::cout << fmt::format("  {}: {} tensors\n", printable(f), n);
    std::cout << detection_text(found);
  }
  std::cout.flush();
}

}  // namespace

void register_inspect(CLI::App& app) {
  auto opts = std::make_shared<InspectOptions>();
  CLI::App* sub = app.add_subcommand(
      "inspect",
      "Validate a .safetensors file and list its tensors, dtypes, shapes, parameter count, bytes per "
      "dtype, metadata and detected architecture; or, with --arch, size a registered architecture");
  sub->add_option("file", opts->file, "path to a .safetensors file or a sharded *.safetensors.index.json");
  sub->add_option("--arch", opts->arch, "a registered architecture (sd15, sdxl, ssd1b, vae, tiny-unet, ...)");
  sub->add_flag("--tiny", opts->tiny, "with --arch: the test-size variant of the architecture");
  sub->add_flag("--json", opts->json, "print one JSON object instead of a table");
  sub->callback([opts]() {
    if (opts->file.empty() == opts->arch.empty()) fail("inspect: give either a .safetensors FILE or --arch NAME");
    if (!opts->arch.empty()) {
      print_architecture(*opts);
      std::cout.flush();
      return;
    }
    if (opts->file.size() > 5 && opts->file.compare(opts->file.size() - 5, 5, ".json") == 0) {
      inspect_sharded(*opts);
      return;
    }
    // Throws shoestring::Error naming the file and the rule broken; main() prints it.
    const SafetensorsFile file = SafetensorsFile::open(opts->file);
    std::vector<models::TensorShape> shapes;
    for (const auto& t : file.tensors()) shapes.push_back({t.name, t.shape});
    const std::vector<models::Detection> found = models::detect_architectures(shapes);
    if (opts->json) {
      nlohmann::json j = inspect_json(file);
      j["architectures"] = nlohmann::json::array();
      for (const auto& d : found) j["architectures"].push_back(detection_json(d));
      std::cout << j.dump(2) << '\n';
    } else {
      std::cout << inspect_text(file) << detection_text(found);
    }
    std::cout.flush();
  });
}

}  // namespace shoestring::cli
