// `shoestring inspect FILE.safetensors [--json]`: validates a safetensors file
// and prints its tensors, totals, bytes per dtype and metadata (the rendering
// lives in io/inspect.h so it can be tested without the CLI).
#include <iostream>
#include <memory>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "shoestring/cli/commands.h"
#include "shoestring/io/inspect.h"
#include "shoestring/io/safetensors.h"

namespace shoestring::cli {

namespace {
struct InspectOptions {
  std::string file;
  bool json = false;
};
}  // namespace

void register_inspect(CLI::App& app) {
  auto opts = std::make_shared<InspectOptions>();
  CLI::App* sub = app.add_subcommand(
      "inspect", "Validate a .safetensors file and list its tensors, dtypes, shapes, parameter "
                 "count, bytes per dtype and metadata");
  sub->add_option("file", opts->file, "path to a .safetensors file")->required();
  sub->add_flag("--json", opts->json, "print one JSON object instead of a table");
  sub->callback([opts]() {
    // Throws shoestring::Error naming the file and the rule broken; main() prints it.
    const SafetensorsFile file = SafetensorsFile::open(opts->file);
    if (opts->json) {
      std::cout << inspect_json(file).dump(2) << '\n';
    } else {
      std::cout << inspect_text(file);
    }
    std::cout.flush();
  });
}

}  // namespace shoestring::cli
