// bench/safetensors_open: how long SafetensorsFile::open takes for headers of
// many tensors (the header parse and its checks; no tensor data is read).
// Each file holds N zero-size F32 tensors "t<i>" of shape [0] (a header of
// about 57 bytes per tensor, an empty data buffer), written to a temporary
// folder before the clock starts.
//
//   build/bench/safetensors_open [--counts 10000,40000,100000] [--repeats 3] [--json]
//
// Prints the CPU (model name and vector features, bench/bench_machine.h), then per
// count: header bytes and the fastest of `repeats` opens in milliseconds.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "bench_machine.h"
#include "shoestring/io/safetensors.h"

using namespace shoestring;

namespace {

/// Writes a safetensors file of `n` zero-size tensors to `path`; returns the header length.
uint64_t write_many_tensors(const std::string& path, int64_t n) {
  std::string header = "{";
  for (int64_t i = 0; i < n; ++i) {
    header += fmt::format(R"({}"t{}":{{"dtype":"F32","shape":[0],"data_offsets":[0,0]}})", i ? "," : "", i);
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');
  const uint64_t len = header.size();
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(&len), 8);  // little-endian host (see io/safetensors.cpp)
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  return len;
}

}  // namespace

int main(int argc, char** argv) {
  shoestring::bench::prepare_process(argv);
  CLI::App app{"Time to open safetensors files whose headers list many (zero-size) tensors"};
  std::vector<int64_t> counts = {10000, 40000, 100000};
  int repeats = 3;
  bool json = false;
  app.add_option("--counts", counts, "tensor counts, comma-separated")->delimiter(',');
  app.add_option("--repeats", repeats, "opens per count (the fastest is reported)")->check(CLI::Range(1, 100));
  app.add_flag("--json", json, "one JSON object per count");
  CLI11_PARSE(app, argc, argv);
  shoestring::bench::print_machine(json);

  const auto dir = std::filesystem::temp_directory_path() / fmt::format("shoestring_bench_open_{}", ::getpid());
  std::filesystem::create_directories(dir);
  int rc = 0;
  try {
    for (int64_t n : counts) {
      const std::string path = (dir / fmt::format("t{}.safetensors", n)).string();
      const uint64_t header_bytes = write_many_tensors(path, n);
      double best = 1e300;
      for (int r = 0; r < repeats; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        const SafetensorsFile file = SafetensorsFile::open(path);
        const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
        if (static_cast<int64_t>(file.tensors().size()) != n) {
          fmt::print(stderr, "safetensors_open: {} holds {} tensors, expected {}\n", path, file.tensors().size(), n);
          return 1;
        }
        best = std::min(best, ms);
      }
      std::filesystem::remove(path);
      if (json) {
        fmt::print(
            "{}\n",
            nlohmann::json{{"tensors", n}, {"header_bytes", header_bytes}, {"open_ms", best}, {"repeats", repeats}}
                .dump());
      } else {
        fmt::print("{:>8} tensors, header {:>10} bytes: open {:>10.1f} ms (fastest of {})\n", n, header_bytes, best,
                   repeats);
      }
      std::fflush(stdout);
    }
  } catch (const std::exception& e) {
    fmt::print(stderr, "safetensors_open: {}\n", e.what());
    rc = 1;
  }
  std::filesystem::remove_all(dir);
  return rc;
}
