// Helpers shared by the trainer tests (tests/train/*): per-test temp run
// folders, quiet run options and the loss column of metrics.jsonl.
#pragma once
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "shoestring/train/trainer.h"

namespace shoestring::testing {

/// "<tmp>/shoestring_<tag>_<name>_<pid>", removed if it exists (not created:
/// the trainer creates its output_dir). `tag` keeps test files apart.
inline std::string fresh_temp_dir(const std::string& tag, const std::string& name) {
  namespace fs = std::filesystem;
  fs::path p = fs::temp_directory_path() / ("shoestring_" + tag + "_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p.string();
}

/// Run options without the progress line.
inline TrainRunOptions quiet() {
  TrainRunOptions o;
  o.quiet = true;
  return o;
}

/// The "loss" of every line of a metrics.jsonl file, in order.
inline std::vector<double> losses_of(const std::string& metrics_path) {
  std::vector<double> out;
  std::ifstream in(metrics_path);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) out.push_back(nlohmann::json::parse(line)["loss"].get<double>());
  }
  return out;
}

}  // namespace shoestring::testing
