// `shoestring report RUN_DIR [--max-points N] [--max-grids N]`
//
// Rewrites RUN_DIR/report.html (train/run_report_html.h) from the run
// folder's metrics.jsonl, sample grids and config.toml: what train() writes
// at each checkpoint, redrawn at any time (after a crash, or with other
// bounds). The machine line names the machine running this command.
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include "shoestring/cli/commands.h"
#include "shoestring/core/cpu_features.h"
#include "shoestring/core/units.h"
#include "shoestring/train/run_report_html.h"

namespace shoestring::cli {

namespace {

struct ReportArgs {
  std::string run_dir;
  RunReportOptions options;
};

void run_report(const ReportArgs& a) {
  const std::string machine = describe(cpu_features()) + " | redrawn by `shoestring report`";
  const std::string path = write_run_report(a.run_dir, machine, a.options);
  std::cout << fmt::format("wrote {} ({})\n", path,
                           format_bytes(static_cast<int64_t>(std::filesystem::file_size(path))));
}

}  // namespace

void register_report(CLI::App& app) {
  auto a = std::make_shared<ReportArgs>();
  CLI::App* cmd = app.add_subcommand(
      "report", "Rewrite RUN_DIR/report.html: plots of metrics.jsonl, the sample grids, the config, the machine");
  cmd->add_option("RUN_DIR", a->run_dir, "a run folder (holds metrics.jsonl)")->required();
  cmd->add_option("--max-points", a->options.max_points, "points per plotted series (default 2000)")
      ->check(CLI::Range(size_t{4}, size_t{1} << 24));
  cmd->add_option("--max-grids", a->options.max_grids, "sample grids inlined per prompt set (default 12)")
      ->check(CLI::Range(size_t{1}, size_t{1} << 20));
  cmd->callback([a] { run_report(*a); });
}

}  // namespace shoestring::cli
