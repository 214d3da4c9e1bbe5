// The `shoestring` command line: train, cache, sample, inspect, plan, convert, launch, consolidate,
// report.
#include <algorithm>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include "shoestring/cli/commands.h"
#include "shoestring/core/error.h"
#include "shoestring/core/text.h"
#include "shoestring/core/threads.h"

int main(int argc, char** argv) {
  // CPU runtime first: libgomp and OpenBLAS read their settings when loaded (re-exec).
  shoestring::set_cpu_runtime_environment(argv);
  shoestring::configure_allocator();
  CLI::App app{"shoestring: train diffusion image models on small-memory hardware"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "shoestring 0.1.0");
  shoestring::cli::register_train(app);
  shoestring::cli::register_cache(app);
  shoestring::cli::register_sample(app);
  shoestring::cli::register_inspect(app);
  shoestring::cli::register_plan(app);
  shoestring::cli::register_convert(app);
  shoestring::cli::register_launch(app);
  shoestring::cli::register_consolidate(app);
  shoestring::cli::register_report(app);
  spdlog::set_pattern("[%H:%M:%S] %^%l%$ %v");
  // A first word that is no command: CLI11 would only say "A subcommand is required".
  std::vector<std::string> names;
  for (const CLI::App* sub : app.get_subcommands({})) names.push_back(sub->get_name());
  if (argc > 1 && argv[1][0] != '-' && std::find(names.begin(), names.end(), argv[1]) == names.end()) {
    fmt::print(stderr, "error: unknown command '{}'; the commands are {} (shoestring --help)\n",
               shoestring::printable(argv[1]), fmt::join(names, ", "));
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const shoestring::Error& e) {
    // Messages quote names from files (tensors, shards, keys): escaped, so a
    // name cannot colour the terminal or forge a line.
    fmt::print(stderr, "error: {}\n", shoestring::printable(e.what()));
    return 1;
  } catch (const c10::Error& e) {
    fmt::print(stderr, "error (libtorch): {}\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    fmt::print(stderr, "error: {}\n", shoestring::printable(e.what()));
    return 1;
  }
  return 0;
}
