// The disk caches' test fixture (test_ldm_cache, and test_dist's ranks that
// fill one cache together): a temp folder with the committed Twemoji images,
// a caption file each, and a tiny SDXL config at 32 px that caches into it.
#pragma once
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "shoestring/train/config.h"
#include "train_testing.h"

namespace shoestring::testing {

inline const std::vector<std::string> kWords = {"red",   "blue",  "green", "yellow", "happy", "sad",
                                         "round", "small", "large", "bright", "dark"};

/// A temp folder with `data/` (the 11 Twemoji fixture images, each with a
/// caption file of distinct words) and room for `cache/` and runs.
struct CacheFixture {
  std::string root;
  bool owner = true;  ///< removes the folder when destroyed
  /// The fixture of another process (a test_dist worker), in `root`; not removed.
  static CacheFixture attach(const std::string& root) { return CacheFixture(root, false); }
  explicit CacheFixture(const std::string& name) {
    root = shoestring::testing::fresh_temp_dir("test_ldm_cache", name);
    std::filesystem::create_directories(root + "/data");
    std::vector<std::filesystem::path> images;
    for (const auto& e : std::filesystem::directory_iterator(std::string(SHOESTRING_TEST_DATA) + "/twemoji/img/twitter/64"))
      images.push_back(e.path());
    std::sort(images.begin(), images.end());
    for (size_t i = 0; i < images.size(); ++i) {
      std::filesystem::copy_file(images[i], image(i));
      std::ofstream(caption(i)) << kWords[i % kWords.size()] << " emoji face number";
    }
  }
  CacheFixture(CacheFixture&& o) noexcept : root(std::move(o.root)), owner(o.owner) { o.owner = false; }
  ~CacheFixture() {
    if (!owner) return;
    std::error_code ec;
    std::filesystem::remove_all(root, ec);
  }
  std::string image(size_t i) const { return fmt::format("{}/data/img{:02d}.png", root, i); }
  std::string caption(size_t i) const { return fmt::format("{}/data/img{:02d}.txt", root, i); }
  std::string cache() const { return root + "/cache"; }
  /// A tiny `arch` run caching into cache(): sdxl at 32 px, sd35m and cascade-c at 64 px.
  TrainConfig config(const std::string& out = "", const std::string& extra = "",
                     const std::string& arch = "sdxl") const {
    return parse_config(fmt::format("train_data_dir = \"{}/data\"\n"
                                    "resolution = {}\n"
                                    "train_batch_size = 4\n"
                                    "max_train_steps = 4\n"
                                    "learning_rate = 2e-3\n"
                                    "seed = 5\n"
                                    "num_threads = 1\n"
                                    "sample_prompts = [\"red emoji\"]\n"
                                    "sample_seeds = 1\n"
                                    "sample_steps = 1\n"
                                    "cache_dir = \"{}\"\n"
                                    "output_dir = \"{}\"\n"
                                    "{}"
                                    "[model]\n"
                                    "architecture = \"{}\"\n"
                                    "tiny = true\n",
                                    root, arch == "sdxl" ? 32 : 64, cache(), out.empty() ? root + "/run" : out, extra,
                                    arch),
                        "cache.toml");
  }
  CacheFixture(std::string r, bool own) : root(std::move(r)), owner(own) {}
  /// The shard files of one cache ("latents" / "text"), sorted.
  std::vector<std::string> shards(const std::string& kind) const {
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(cache() + "/" + kind)) {
      if (e.path().extension() == ".safetensors") out.push_back(e.path().string());
    }
    std::sort(out.begin(), out.end());
    return out;
  }
};

inline constexpr int64_t kImages = 11;
// 11 distinct captions, "" (caption dropout), one sample prompt.
inline constexpr int64_t kTexts = 13;

}  // namespace shoestring::testing
