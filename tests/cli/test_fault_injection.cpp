// Fault injection: a training run killed at every write point of its
// checkpoints, sample grid and final files (io/atomic_file.h's
// SHOESTRING_TEST_CRASH_AT_WRITE hook ends the process after a temporary is
// written and before its rename, as a kill there would) is finished by what
// a user would type next, and ends with the same bytes as the uninterrupted
// run, with no temporary file left behind.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "run_cli.h"
#include "shoestring/io/atomic_file.h"
#include "shoestring/io/safetensors.h"

namespace fs = std::filesystem;

namespace {

using shoestring::testing::run_cli;

std::string bytes_of(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

/// A training state file as text: its metadata without the wall-clock
/// elapsed_seconds and the run's random run_id (a run killed before its
/// first checkpoint starts over as a new run), and each tensor's name,
/// dtype, shape and bytes.
std::string state_of(const fs::path& path) {
  static const std::regex varying(R"re("(elapsed_seconds|run_id)":("[0-9a-f]*"|[0-9.eE+-]+))re");
  const auto file = shoestring::SafetensorsFile::open(path.string());
  std::string out;
  for (const auto& [key, value] : file.metadata()) out += key + "=" + std::regex_replace(value, varying, "") + "\n";
  for (const auto& info : file.tensors()) {
    const at::Tensor t = file.get(info.name).contiguous();
    out += info.name + " " + shoestring::to_string(info.dtype) + " " + std::to_string(t.numel()) + "\n";
    out.append(static_cast<const char*>(t.data_ptr()), t.numel() * t.element_size());
  }
  return out;
}

/// Every regular file under `dir`, relative path -> contents, except
/// metrics.jsonl (its lines carry wall-clock times; compared by loss below)
/// and report.html (drawn from them; its presence is kept); training states
/// as state_of().
std::map<std::string, std::string> files_of(const fs::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    const std::string rel = fs::relative(e.path(), dir).string();
    if (rel == "metrics.jsonl") continue;
    if (rel == "report.html") {
      out[rel] = "(drawn)";
      continue;
    }
    out[rel] = e.path().filename() == "state.safetensors" ? state_of(e.path()) : bytes_of(e.path());
  }
  return out;
}

/// The "loss" values of metrics.jsonl, as printed (exact text, in order).
std::vector<std::string> losses_of(const fs::path& metrics) {
  std::vector<std::string> out;
  std::ifstream in(metrics);
  std::string line;
  while (std::getline(in, line)) {
    const size_t at = line.find("\"loss\":");
    if (at != std::string::npos) out.push_back(line.substr(at, line.find(',', at) - at));
  }
  return out;
}

/// Names of the files that differ between two files_of() maps ("" if none).
std::string differences(const std::map<std::string, std::string>& got, const std::map<std::string, std::string>& want) {
  std::string out;
  for (const auto& [name, bytes] : want) {
    auto it = got.find(name);
    if (it == got.end()) out += " missing:" + name;
    else if (it->second != bytes) out += " differs:" + name;
  }
  for (const auto& [name, bytes] : got) {
    if (!want.count(name)) out += " extra:" + name;
  }
  return out;
}

// EMA (the final file holds the EMA weights) and LoRA on a random base
// (checkpoints and final files hold both the model and the adapters).
TEST(FaultInjection, RunKilledAtEveryWritePointFinishesWithTheSameBytes) {
  const fs::path work = fs::temp_directory_path() / ("shoestring_fault_" + std::to_string(::getpid()));
  fs::remove_all(work);
  fs::create_directories(work);
  const fs::path config = work / "run.toml";
  std::ofstream(config) << "train_data_dir = \"" << SHOESTRING_TEST_DATA << "/twemoji\"\n"
                        << "resolution = 16\ntrain_batch_size = 2\nmax_train_steps = 4\nsave_every_n_steps = 2\n"
                        << "sample_every_n_steps = 2\nnum_threads = 1\nseed = 7\n"
                        << "sample_prompts = [\"red heart\"]\nsample_seeds = 1\nsample_steps = 2\n"
                        << "ema_decay = 0.9\nnetwork_module = \"networks.lora\"\n"
                        << "[model]\nbase_channels = 16\nchannel_mult = [1, 2]\nnum_res_blocks = 1\n"
                        << "attention_levels = [1]\nnum_heads = 2\nnorm_groups = 8\ntext_dim = 32\n"
                        << "text_layers = 1\n";
  // Every run uses the same folder (its path is in config.toml and the
  // config hash of the saved files); the reference is moved aside.
  const fs::path run_dir = work / "run";
  const std::string train = "train " + config.string() + " --output-dir " + run_dir.string();
  const auto reference_run = run_cli(train);
  ASSERT_EQ(reference_run.code, 0) << reference_run.output;
  fs::rename(run_dir, work / "reference");
  const auto reference = files_of(work / "reference");
  const auto reference_losses = losses_of(work / "reference" / "metrics.jsonl");
  ASSERT_EQ(reference_losses.size(), 4u);
  ASSERT_TRUE(reference.count("model.safetensors"));
  ASSERT_TRUE(reference.count("lora.safetensors"));
  ASSERT_TRUE(reference.count("checkpoints/latest.json"));

  int write_points = 0;
  // The second checkpoint repeats the first's writes (and samples/report
  // theirs): after the first crash in a file of one kind (its path with the
  // step digits removed), a crash in another of that kind is counted but not
  // resumed again (the resume from the checkpoint before it is the same
  // code path). Saves a third of the test's time on 2 cores.
  std::set<std::string> resumed_kinds;
  for (int n = 1; n <= 60; ++n) {
    SCOPED_TRACE("killed at atomic write " + std::to_string(n));
    const auto crashed = run_cli(train, "SHOESTRING_TEST_CRASH_AT_WRITE=" + std::to_string(n));
    if (crashed.code == 0) break;  // the run has fewer writes than n
    ASSERT_EQ(crashed.code, shoestring::kCrashExitCode) << crashed.output;
    ++write_points;
    const size_t to = crashed.output.rfind("' to '");
    std::string kind = to == std::string::npos ? std::to_string(n) : crashed.output.substr(to + 6);
    kind.erase(std::remove_if(kind.begin(), kind.end(), [](char ch) { return ch >= '0' && ch <= '9'; }), kind.end());
    if (!resumed_kinds.insert(kind).second) {
      fs::remove_all(run_dir);
      continue;
    }
    // What a user does next: resume the run, or, when the folder holds no
    // config yet, run the same command again.
    const bool resumable = fs::exists(run_dir / "config.toml");
    const auto finished = run_cli(resumable ? "train --resume " + run_dir.string() : train);
    ASSERT_EQ(finished.code, 0) << (resumable ? "--resume: " : "rerun: ") << finished.output << "\n" << crashed.output;
    EXPECT_EQ(differences(files_of(run_dir), reference), "") << crashed.output;  // no temporary left, same bytes
    EXPECT_EQ(losses_of(run_dir / "metrics.jsonl"), reference_losses) << crashed.output;
    fs::remove_all(run_dir);
  }
  // config.toml, metrics.jsonl, two checkpoints (model, adapters, state,
  // latest.json), two sample grids with their prompt files, the final model
  // and adapters, report.html at both checkpoints: 18.
  EXPECT_EQ(write_points, 18);
  EXPECT_GE(resumed_kinds.size(), 9u);  // every kind of write was resumed from at least once
  fs::remove_all(work);
}

}  // namespace
