// bench/ldm_disk_cache: host memory and time of the LDM disk caches
// (train/ldm_cache.h) over the dataset's size. For each size N it writes N
// distinct 64 x 64 PNG images with distinct captions, then runs the CLI as a
// user does, each command in its own process, and reports its wall time and
// peak resident memory (ru_maxrss from wait4):
//
//   1. `shoestring cache CONFIG`           first: encodes every latent and caption
//   2. `shoestring cache CONFIG`           again, on the unchanged dataset: encodes nothing
//   3. `shoestring train CONFIG`           trains tiny SD 1.5 from the disk caches
//   4. `shoestring train CONFIG --set cache_latents_to_disk=false --set
//      cache_text_encoder_outputs_to_disk=false`   the same run with the caches in memory
//
// The claim measured (issue 14): the peak RSS of a run trained from the disk
// cache grows by a small constant from N = 100 to N = 10,000 (an index of a
// few hundred bytes per entry), while the in-memory run grows with N.
//
//   build/bench/ldm_disk_cache [--sizes 100,10000] [--steps 20] [--work DIR] [--shoestring PATH] [--keep]
//
// Prints the CPU (bench/bench_machine.h), one row per size, and the growth
// from the smallest to the largest size of each run's peak RSS.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include "bench_machine.h"
#include "shoestring/data/image.h"

namespace fs = std::filesystem;
using namespace shoestring;

namespace {

struct ChildResult {
  int status = 0;
  double seconds = 0;
  double peak_rss_mib = 0;
  std::string log;  // stdout + stderr
};

/// Runs `body` in a forked child whose stdout and stderr go to `log_path`;
/// waits for it and returns its exit status, wall time and peak RSS.
ChildResult run_child(const std::string& log_path, const std::function<void()>& body) {
  std::fflush(stdout);
  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    std::FILE* f = std::freopen(log_path.c_str(), "w", stdout);
    if (f == nullptr || ::dup2(::fileno(stdout), 2) < 0) ::_exit(126);
    try {
      body();
    } catch (const std::exception& e) {
      std::fprintf(stdout, "bench child: %s\n", e.what());
      std::fflush(stdout);
      ::_exit(125);
    }
    std::fflush(stdout);
    ::_exit(0);
  }
  ChildResult r;
  struct rusage usage {};
  if (::wait4(pid, &r.status, 0, &usage) != pid) throw std::runtime_error("wait4 failed");
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  r.peak_rss_mib = static_cast<double>(usage.ru_maxrss) / 1024.0;  // kB
  std::ifstream in(log_path);
  std::stringstream ss;
  ss << in.rdbuf();
  r.log = ss.str();
  return r;
}

/// Runs the CLI with `args` (stdout + stderr to `log_path`); fails loudly
/// with the log's tail when it exits non-zero.
ChildResult run_cli(const std::string& cli, const std::vector<std::string>& args, const std::string& log_path) {
  ChildResult r = run_child(log_path, [&] {
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(cli.c_str()));
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::setenv("OMP_WAIT_POLICY", "PASSIVE", 0);  // shoestring's default, without its re-exec
    ::execv(cli.c_str(), argv.data());
    throw std::runtime_error(fmt::format("cannot run {}", cli));
  });
  if (!WIFEXITED(r.status) || WEXITSTATUS(r.status) != 0) {
    const std::string tail = r.log.size() > 3000 ? r.log.substr(r.log.size() - 3000) : r.log;
    throw std::runtime_error(fmt::format("{} {} failed (status {}):\n{}", cli, fmt::join(args, " "), r.status, tail));
  }
  return r;
}

/// N images of 64 x 64 (distinct pixels: a seeded pattern per image) with
/// distinct captions (5 words from 5 lists of 10) in `dir`.
void write_dataset(const std::string& dir, int64_t n) {
  const std::vector<std::vector<std::string>> words = {
      {"red", "blue", "green", "yellow", "purple", "orange", "pink", "brown", "black", "white"},
      {"round", "square", "tall", "flat", "spiky", "soft", "shiny", "dull", "striped", "dotted"},
      {"cat", "dog", "house", "tree", "car", "boat", "bird", "fish", "cup", "lamp"},
      {"at", "near", "under", "over", "beside", "behind", "inside", "around", "past", "along"},
      {"noon", "night", "dawn", "dusk", "sea", "hill", "town", "field", "lake", "road"}};
  fs::create_directories(dir);
  std::vector<uint8_t> pixels(64 * 64 * 3);
  for (int64_t i = 0; i < n; ++i) {
    uint64_t s = 0x9E3779B97F4A7C15ULL * static_cast<uint64_t>(i + 1);
    for (size_t p = 0; p < pixels.size(); ++p) {
      // Smooth colour ramps (VAE-friendly) plus a few bits of per-image noise.
      s = s * 6364136223846793005ULL + 1442695040888963407ULL;
      const size_t y = p / (64 * 3), x = (p / 3) % 64, c = p % 3;
      pixels[p] = static_cast<uint8_t>((x * (c + 1) * 3 + y * 2 + static_cast<size_t>(i) * 7 + (s >> 60)) & 0xFF);
    }
    const at::Tensor img = torch::from_blob(pixels.data(), {64, 64, 3}, torch::kUInt8);
    const std::string stem = fmt::format("{}/img{:06d}", dir, i);
    save_png(stem + ".png", img);
    std::string caption;
    int64_t k = i;
    for (const auto& list : words) {
      caption += (caption.empty() ? "" : " ") + list[static_cast<size_t>(k % 10)];
      k /= 10;
    }
    std::ofstream(stem + ".txt") << caption << "\n";
  }
}

/// The "cache DIR: latents X encoded, Y reused; text A encoded, B reused" line's numbers.
std::string cache_summary(const std::string& log) {
  std::smatch m;
  static const std::regex re(R"(latents (\d+) encoded, (\d+) reused; text (\d+) encoded, (\d+) reused)");
  if (!std::regex_search(log, m, re)) return "?";
  return fmt::format("{}+{}", m[1].str(), m[3].str());
}

}  // namespace

int main(int argc, char** argv) {
  bench::prepare_process(argv);
  CLI::App app{"host memory and time of the LDM disk caches over the dataset's size"};
  std::vector<int64_t> sizes = {100, 10000};
  int64_t steps = 20;
  std::string work = (fs::temp_directory_path() / fmt::format("shoestring_bench_ldm_cache_{}", ::getpid())).string();
  std::string cli = (fs::canonical("/proc/self/exe").parent_path().parent_path() / "shoestring").string();
  bool keep = false;
  app.add_option("--sizes", sizes, "dataset sizes (images)")->delimiter(',');
  app.add_option("--steps", steps, "training steps of each run (batch 4)");
  app.add_option("--work", work, "scratch folder (removed after unless --keep)");
  app.add_option("--shoestring", cli, "the CLI to run (default: build/shoestring beside build/bench)");
  app.add_flag("--keep", keep, "keep the scratch folder");
  CLI11_PARSE(app, argc, argv);
  bench::print_machine();
  if (!fs::exists(cli)) {
    std::fprintf(stderr, "ldm_disk_cache: %s does not exist (build it, or pass --shoestring)\n", cli.c_str());
    return 2;
  }
  fmt::print("tiny SD 1.5, 64 x 64 images, batch 4, {} steps; each command in its own process (peak RSS: ru_maxrss)\n",
             steps);
  fmt::print("{:>7} {:>10} {:>10} {:>9} | {:>12} {:>12} | {:>14} {:>12}\n", "images", "cache 1 s", "cache 2 s",
             "encoded 2", "disk train s", "disk RSS MiB", "memory train s", "memory MiB");
  struct Row {
    int64_t n;
    double disk_rss, memory_rss;
  };
  std::vector<Row> rows;
  try {
    for (const int64_t n : sizes) {
      const std::string root = fmt::format("{}/n{}", work, n);
      fs::remove_all(root);
      fs::create_directories(root);
      const ChildResult data = run_child(root + "/data.log", [&] { write_dataset(root + "/data", n); });
      if (!WIFEXITED(data.status) || WEXITSTATUS(data.status) != 0) {
        throw std::runtime_error("writing the dataset failed: " + data.log);
      }
      const std::string config = root + "/config.toml";
      std::ofstream(config) << fmt::format(
          "train_data_dir = \"{0}/data\"\n"
          "resolution = 64\n"
          "train_batch_size = 4\n"
          "max_train_steps = {1}\n"
          "learning_rate = 1e-4\n"
          "seed = 1\n"
          "cache_dir = \"{0}/cache\"\n"
          "cache_latents_to_disk = true\n"
          "cache_text_encoder_outputs_to_disk = true\n"
          "output_dir = \"{0}/run\"\n"
          "[model]\n"
          "architecture = \"sd15\"\n"
          "tiny = true\n",
          root, steps);
      const ChildResult first = run_cli(cli, {"cache", config}, root + "/cache1.log");
      const ChildResult second = run_cli(cli, {"cache", config}, root + "/cache2.log");
      const ChildResult disk = run_cli(cli, {"train", config}, root + "/train_disk.log");
      const ChildResult memory =
          run_cli(cli,
                  {"train", config, "--output-dir", root + "/run_memory", "--set", "cache_latents_to_disk=false",
                   "--set", "cache_text_encoder_outputs_to_disk=false"},
                  root + "/train_memory.log");
      fmt::print("{:>7} {:>10.2f} {:>10.2f} {:>9} | {:>12.2f} {:>12.1f} | {:>14.2f} {:>12.1f}\n", n, first.seconds,
                 second.seconds, cache_summary(second.log), disk.seconds, disk.peak_rss_mib, memory.seconds,
                 memory.peak_rss_mib);
      std::fflush(stdout);
      rows.push_back({n, disk.peak_rss_mib, memory.peak_rss_mib});
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ldm_disk_cache: %s\n", e.what());
    if (!keep) fs::remove_all(work);
    return 1;
  }
  if (rows.size() >= 2) {
    const Row& a = rows.front();
    const Row& b = rows.back();
    fmt::print("peak RSS growth from {} to {} images: disk cache {:+.1f} MiB, in memory {:+.1f} MiB\n", a.n, b.n,
               b.disk_rss - a.disk_rss, b.memory_rss - a.memory_rss);
  }
  fmt::print("(\"encoded 2\": latents + text entries the second `shoestring cache` encoded; 0+0 = all reused)\n");
  if (keep) {
    fmt::print("scratch kept: {}\n", work);
  } else {
    fs::remove_all(work);
  }
  return 0;
}
