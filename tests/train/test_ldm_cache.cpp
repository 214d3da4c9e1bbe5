// The LDM families' disk caches (train/ldm_cache.h, io/tensor_cache.h) on a
// folder of the committed Twemoji images with caption files, tiny SDXL at
// 32 px: entries keyed (an unchanged dataset encodes nothing, a changed
// caption or image exactly its entry), a killed run's leftovers (temporaries,
// a shard its manifest does not list) resumed, corrupt and truncated shards
// reported by name and encoded again, bad manifests named, and a fine-tune
// from the disk cache whose losses equal the in-memory run's.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "shoestring/core/error.h"
#include "shoestring/io/atomic_file.h"
#include "shoestring/train/config.h"
#include "shoestring/train/ldm_cache.h"
#include "shoestring/train/trainer.h"
#include "train_testing.h"

namespace fs = std::filesystem;
using namespace shoestring;
using shoestring::testing::losses_of;
using shoestring::testing::quiet;

namespace {

const std::vector<std::string> kWords = {"red",   "blue",  "green", "yellow", "happy", "sad",
                                         "round", "small", "large", "bright", "dark"};

/// A temp folder with `data/` (the 11 Twemoji fixture images, each with a
/// caption file of distinct words) and room for `cache/` and runs.
struct CacheFixture {
  std::string root;
  explicit CacheFixture(const std::string& name) {
    root = shoestring::testing::fresh_temp_dir("test_ldm_cache", name);
    fs::create_directories(root + "/data");
    std::vector<fs::path> images;
    for (const auto& e : fs::directory_iterator(std::string(SHOESTRING_TEST_DATA) + "/twemoji/img/twitter/64"))
      images.push_back(e.path());
    std::sort(images.begin(), images.end());
    for (size_t i = 0; i < images.size(); ++i) {
      fs::copy_file(images[i], image(i));
      std::ofstream(caption(i)) << kWords[i % kWords.size()] << " emoji face number";
    }
  }
  ~CacheFixture() {
    std::error_code ec;
    fs::remove_all(root, ec);
  }
  std::string image(size_t i) const { return fmt::format("{}/data/img{:02d}.png", root, i); }
  std::string caption(size_t i) const { return fmt::format("{}/data/img{:02d}.txt", root, i); }
  std::string cache() const { return root + "/cache"; }
  TrainConfig config(const std::string& out = "", const std::string& extra = "") const {
    return parse_config(fmt::format("train_data_dir = \"{}/data\"\n"
                                    "resolution = 32\n"
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
                                    "architecture = \"sdxl\"\n"
                                    "tiny = true\n",
                                    root, cache(), out.empty() ? root + "/run" : out, extra),
                        "cache.toml");
  }
  /// The shard files of one cache ("latents" / "text"), sorted.
  std::vector<std::string> shards(const std::string& kind) const {
    std::vector<std::string> out;
    for (const auto& e : fs::directory_iterator(cache() + "/" + kind)) {
      if (e.path().extension() == ".safetensors") out.push_back(e.path().string());
    }
    std::sort(out.begin(), out.end());
    return out;
  }
};

constexpr int64_t kImages = 11;
// 11 distinct captions, "" (caption dropout), one sample prompt.
constexpr int64_t kTexts = 13;

}  // namespace

TEST(LdmDiskCache, SecondRunEncodesNothing) {
  CacheFixture f("keyed");
  LdmCacheStats first = build_ldm_caches(f.config(), true);
  EXPECT_EQ(first.dir, f.cache());
  EXPECT_EQ(first.latent_entries, kImages);
  EXPECT_EQ(first.latents_encoded, kImages);
  EXPECT_EQ(first.text_entries, kTexts);
  EXPECT_EQ(first.text_encoded, kTexts);
  EXPECT_TRUE(first.problems.empty());
  LdmCacheStats second = build_ldm_caches(f.config(), true);
  EXPECT_EQ(second.latent_entries, kImages);
  EXPECT_EQ(second.latents_encoded, 0);
  EXPECT_EQ(second.text_encoded, 0);
  // Whatever the key depends on changes it: another dtype encodes everything again.
  LdmCacheStats bf16 = build_ldm_caches(f.config("", "full_bf16 = true\n"), true);
  EXPECT_EQ(bf16.latents_encoded, kImages);
  EXPECT_EQ(bf16.text_encoded, kTexts);
}

TEST(LdmDiskCache, AChangedCaptionOrImageEncodesExactlyItsEntry) {
  CacheFixture f("changed");
  build_ldm_caches(f.config(), true);
  // The same words in another order: the word tokenizer's vocabulary is the
  // same, only this caption's token ids differ.
  std::ofstream(f.caption(3)) << "emoji " << kWords[3] << " face number";
  LdmCacheStats s = build_ldm_caches(f.config(), true);
  EXPECT_EQ(s.text_encoded, 1);
  EXPECT_EQ(s.latents_encoded, 0);
  // Another image's bytes under an image's name: its latents only.
  fs::copy_file(f.image(0), f.image(5), fs::copy_options::overwrite_existing);
  s = build_ldm_caches(f.config(), true);
  EXPECT_EQ(s.latents_encoded, 0) << "img05 now holds img00's bytes: img00's entry serves it";
  EXPECT_EQ(s.latent_entries, kImages - 1);
  std::ofstream(f.image(5), std::ios::app) << "trailing bytes";  // decodes the same, hashes differently
  s = build_ldm_caches(f.config(), true);
  EXPECT_EQ(s.latents_encoded, 1);
  EXPECT_EQ(s.text_encoded, 0);
}

TEST(LdmDiskCache, AKilledRunsLeftoversAreResumed) {
  CacheFixture f("resume");
  build_ldm_caches(f.config(), true);
  const std::string latents = f.cache() + "/latents";
  // A write killed mid-way leaves a temporary: removed, never read.
  const std::string tmp = latents + "/r0-000002.safetensors.tmp.12345.0";
  std::ofstream(tmp) << "half a shard";
  // A run killed between its shard and its manifest: the manifest does not list it.
  const std::string manifest = latents + "/manifest-r0.json";
  nlohmann::json m = nlohmann::json::parse(read_file(manifest));
  ASSERT_EQ(m["shards"].size(), 1u);
  m["shards"] = nlohmann::json::array();
  write_bytes_atomic(manifest, m.dump());
  fs::remove(f.cache() + "/text/manifest-r0.json");  // or before its first manifest
  LdmCacheStats s = build_ldm_caches(f.config(), true);
  EXPECT_FALSE(fs::exists(tmp));
  EXPECT_EQ(s.latents_encoded, 0) << "the complete shard is adopted from its own metadata";
  EXPECT_EQ(s.text_encoded, 0);
  EXPECT_EQ(nlohmann::json::parse(read_file(manifest))["shards"].size(), 1u);
  EXPECT_TRUE(fs::exists(f.cache() + "/text/manifest-r0.json"));
}

TEST(LdmDiskCache, CorruptAndTruncatedShardsAreNamedAndEncodedAgain) {
  CacheFixture f("corrupt");
  build_ldm_caches(f.config(), true);
  const std::string latent_shard = f.shards("latents").at(0);
  {
    // One flipped byte near the end of the data buffer (inside a latent).
    std::fstream io(latent_shard, std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(-5, std::ios::end);
    char c = 0;
    io.read(&c, 1);
    io.seekp(-5, std::ios::end);
    c = static_cast<char>(c ^ 0x10);
    io.write(&c, 1);
  }
  const std::string text_shard = f.shards("text").at(0);
  fs::resize_file(text_shard, fs::file_size(text_shard) - 100);
  LdmCacheStats s = build_ldm_caches(f.config(), true);
  ASSERT_EQ(s.problems.size(), 2u);
  EXPECT_NE(s.problems[0].find(text_shard), std::string::npos) << s.problems[0];
  EXPECT_NE(s.problems[1].find(latent_shard), std::string::npos) << s.problems[1];
  EXPECT_NE(s.problems[1].find("checksum"), std::string::npos) << s.problems[1];
  EXPECT_EQ(s.latents_encoded, kImages);
  EXPECT_EQ(s.text_encoded, kTexts);
  EXPECT_FALSE(fs::exists(latent_shard)) << "the damaged shard is deleted";
  LdmCacheStats again = build_ldm_caches(f.config(), true);
  EXPECT_TRUE(again.problems.empty());
  EXPECT_EQ(again.latents_encoded, 0);
  EXPECT_EQ(again.text_encoded, 0);
}

TEST(LdmDiskCache, ABadManifestIsNamed) {
  CacheFixture f("bad_manifest");
  build_ldm_caches(f.config(), true);
  const std::string manifest = f.cache() + "/latents/manifest-r0.json";
  nlohmann::json m = nlohmann::json::parse(read_file(manifest));
  m["kind"] = "text";
  write_bytes_atomic(manifest, m.dump());
  try {
    build_ldm_caches(f.config(), true);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(manifest), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("\"kind\""), std::string::npos) << e.what();
  }
  write_bytes_atomic(manifest, "{ not json");
  EXPECT_THROW(build_ldm_caches(f.config(), true), Error);
}

TEST(LdmDiskCache, TrainingFromTheDiskCacheGivesTheInMemoryLosses) {
  CacheFixture f("losses");
  const std::string disk = "cache_latents_to_disk = true\ncache_text_encoder_outputs_to_disk = true\n";
  const auto memory_run = train(f.config(f.root + "/memory"), quiet());
  const auto first = train(f.config(f.root + "/disk1", disk), quiet());  // encodes the cache
  // Reading a complete cache takes no lock: runs share it, and one may be
  // writing it meanwhile (here: this process holds both writers' locks).
  const auto second = [&] {
    FolderLock latents_lock(f.cache() + "/latents", ".lock-r0"), text_lock(f.cache() + "/text", ".lock-r0");
    return train(f.config(f.root + "/disk2", disk), quiet());  // reads it back
  }();
  const std::vector<double> expected = losses_of(memory_run.run_dir + "/metrics.jsonl");
  ASSERT_EQ(expected.size(), 4u);
  EXPECT_EQ(losses_of(first.run_dir + "/metrics.jsonl"), expected);
  EXPECT_EQ(losses_of(second.run_dir + "/metrics.jsonl"), expected);
  EXPECT_EQ(build_ldm_caches(f.config(), true).latents_encoded, 0);
}

// With the disk cache an image is decoded only when its latents are encoded
// (its header alone is read at load): undecodable images are named all at
// once, after the others' latents are written, so fixing them encodes only them.
TEST(LdmDiskCache, UndecodableImagesAreNamedTogetherAndTheRestIsKept) {
  CacheFixture f("undecodable");
  for (const size_t i : {3u, 7u}) {
    const std::string whole = read_file(f.image(i));
    write_bytes_atomic(f.image(i), whole.substr(0, whole.size() / 2));
  }
  try {
    build_ldm_caches(f.config(), true);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("2 images cannot be decoded"), std::string::npos) << what;
    EXPECT_NE(what.find(f.image(3)), std::string::npos) << what;
    EXPECT_NE(what.find(f.image(7)), std::string::npos) << what;
  }
  CacheFixture clean("undecodable_clean");
  for (const size_t i : {3u, 7u}) write_bytes_atomic(f.image(i), read_file(clean.image(i)));
  const LdmCacheStats s = build_ldm_caches(f.config(), true);
  EXPECT_EQ(s.latents_encoded, 2);
  EXPECT_EQ(s.latent_entries, kImages);
}
