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

#include "ldm_cache_fixture.h"
#include "shoestring/core/content_hash.h"
#include "shoestring/core/error.h"
#include "shoestring/io/atomic_file.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/models/t5_encoder.h"
#include "shoestring/train/config.h"
#include "shoestring/train/ldm_cache.h"
#include "shoestring/train/trainer.h"
#include "train_testing.h"

namespace fs = std::filesystem;
using namespace shoestring;
using shoestring::testing::CacheFixture;
using shoestring::testing::kImages;
using shoestring::testing::kTexts;
using shoestring::testing::kWords;
using shoestring::testing::losses_of;
using shoestring::testing::quiet;

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

  // The latents made another writer's (rank 1 of a 2-rank `launch -- cache`:
  // r1's shard and manifest), then that shard's header damaged: this run
  // (writer r0) may not delete it, so it encodes its entries again into a
  // shard of its own and must read those, not the damaged shard its
  // manifest still lists, later in the index.
  const std::string latents = f.cache() + "/latents";
  ASSERT_EQ(f.shards("latents").size(), 1u);
  const std::string r1_shard = latents + "/r1-000001.safetensors";
  fs::rename(f.shards("latents").at(0), r1_shard);
  std::string manifest = read_file(latents + "/manifest-r0.json");
  for (size_t at; (at = manifest.find("\"r0")) != std::string::npos;) manifest.replace(at, 3, "\"r1");
  write_bytes_atomic(latents + "/manifest-r1.json", manifest);
  fs::remove(latents + "/manifest-r0.json");
  {
    std::fstream io(r1_shard, std::ios::in | std::ios::out | std::ios::binary);
    io.write("\xff\xff\xff\xff\xff\xff\xff\x7f", 8);  // a header length past the end of the file
  }
  const auto third = train(f.config(f.root + "/disk3", disk), quiet());
  EXPECT_EQ(losses_of(third.run_dir + "/metrics.jsonl"), expected);
  EXPECT_TRUE(fs::exists(r1_shard)) << "another writer's shard is left to it";
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

// Ranks sharing a cache (CacheShare) split the missing entries by key: the
// last 8 hex digits mod the world size, so they agree without talking.
TEST(LdmDiskCache, CacheKeyOwnerIsTheKeysLastEightHexDigitsModWorldSize) {
  std::vector<int64_t> share(3, 0);
  for (int i = 0; i < 3000; ++i) {
    const std::string key = content_key128("entry " + std::to_string(i));
    const uint64_t tail = std::stoull(key.substr(key.size() - 8), nullptr, 16);
    for (int world : {1, 2, 3, 7}) EXPECT_EQ(cache_key_owner(key, world), static_cast<int>(tail % world)) << key;
    ++share[static_cast<size_t>(cache_key_owner(key, 3))];
  }
  for (int64_t n : share) EXPECT_NEAR(static_cast<double>(n), 1000.0, 100.0);  // 3.2 sigma of a binomial
  EXPECT_EQ(cache_key_owner("00000000000000000000000000000011", 4), 17 % 4);
  EXPECT_THROW(cache_key_owner("not-hex-at-all!", 2), Error);
  EXPECT_THROW(cache_key_owner("0a", 0), Error);
}

// Rank 0 of 2 encodes its share, then waits for rank 1's; when none appears
// within the patience it stops naming rank 1 and how many entries are
// missing. What it wrote stays: one process then encodes only the rest.
TEST(LdmDiskCache, ARankWaitingForAShareThatNeverComesNamesTheRank) {
  CacheFixture f("missing_rank");
  CacheShare share;
  share.rank = 0;
  share.world_size = 2;
  share.patience = std::chrono::seconds(2);
  try {
    build_ldm_caches(f.config(), true, share);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rank 0 waited"), std::string::npos) << what;
    EXPECT_NE(what.find("rank 1: "), std::string::npos) << what;
    EXPECT_EQ(what.find("rank 0: "), std::string::npos) << what;
    EXPECT_NE(what.find(f.cache()), std::string::npos) << what;
  }
  // Rank 0 stopped in the text cache (encoded first): its text share is there, no latents yet.
  const LdmCacheStats rest = build_ldm_caches(f.config(), true);
  EXPECT_GT(rest.text_encoded, 0);
  EXPECT_LT(rest.text_encoded, kTexts);
  EXPECT_EQ(rest.latents_encoded, kImages);
}

// SD3.5 Medium and Stable Cascade stage C cache to disk through the same
// shards and keys (their own encoders' identities): `shoestring cache` fills
// both caches, a second pass encodes nothing, a changed caption exactly its
// entry, and training from the caches (sample grid included) gives the
// in-memory run's losses step for step.
class LatentFamilyDiskCache : public ::testing::TestWithParam<std::string> {};

TEST_P(LatentFamilyDiskCache, TrainingFromTheDiskCacheGivesTheInMemoryLosses) {
  const std::string arch = GetParam();
  CacheFixture f("family_" + arch);
  LdmCacheStats first = build_ldm_caches(f.config("", "", arch), true);
  EXPECT_EQ(first.latent_entries, kImages);
  EXPECT_EQ(first.latents_encoded, kImages);
  EXPECT_EQ(first.text_entries, kTexts);
  EXPECT_EQ(first.text_encoded, kTexts);
  EXPECT_EQ(f.shards("latents").size(), 1u);
  LdmCacheStats second = build_ldm_caches(f.config("", "", arch), true);
  EXPECT_EQ(second.latents_encoded, 0);
  EXPECT_EQ(second.text_encoded, 0);

  const std::string disk = "cache_latents_to_disk = true\ncache_text_encoder_outputs_to_disk = true\n";
  const auto memory_run = train(f.config(f.root + "/memory", "", arch), quiet());
  const auto disk_run = train(f.config(f.root + "/disk", disk, arch), quiet());
  const std::vector<double> expected = losses_of(memory_run.run_dir + "/metrics.jsonl");
  ASSERT_EQ(expected.size(), 4u);
  EXPECT_EQ(losses_of(disk_run.run_dir + "/metrics.jsonl"), expected);
  // The sample prompt's conditioning came from the cache: the same grid, up
  // to rounding (the negative prompt "" is the caption-dropout row, encoded
  // in another batch than in memory: a level in a few pixels at most).
  const at::Tensor a = shoestring::testing::read_png(disk_run.last_sample).to(torch::kInt32);
  const at::Tensor b = shoestring::testing::read_png(memory_run.last_sample).to(torch::kInt32);
  ASSERT_EQ(a.sizes(), b.sizes());
  EXPECT_LE((a - b).abs().max().item<int>(), 2);
  EXPECT_LT((a - b).abs().to(torch::kFloat64).mean().item<double>(), 0.05);

  std::ofstream(f.caption(3)) << "emoji " << kWords[3] << " face number";
  LdmCacheStats changed = build_ldm_caches(f.config("", "", arch), true);
  EXPECT_EQ(changed.text_encoded, 1);
  EXPECT_EQ(changed.latents_encoded, 0);
  // Another dtype is another key: everything again.
  LdmCacheStats bf16 = build_ldm_caches(f.config("", "full_bf16 = true\n", arch), true);
  EXPECT_EQ(bf16.latents_encoded, kImages);
  EXPECT_EQ(bf16.text_encoded, kTexts);
}

INSTANTIATE_TEST_SUITE_P(Architectures, LatentFamilyDiskCache, ::testing::Values("sd35m", "cascade-c"));

// SD3's T5 states are cached beside the CLIP ones, keyed by T5's file and
// token length: another length encodes every text again, and training from
// the cache gives the in-memory losses with T5.
TEST(Sd3DiskCache, T5StatesAreCachedAndKeyedByTheirLength) {
  CacheFixture f("sd3_t5");
  const std::string tok = f.root + "/tok";
  fs::create_directories(tok);
  for (const char* name : {"vocab.json", "merges.txt"})
    fs::copy_file(std::string(SHOESTRING_TEST_DATA) + "/clip_tokenizer/" + name, tok + "/" + name);
  fs::copy_file(std::string(SHOESTRING_TEST_DATA) + "/text/t5_micro_spiece.model", tok + "/spiece.model");
  {
    torch::manual_seed(1);
    models::T5Encoder t5(models::T5EncoderOptions::tiny().vocab_size(200));
    std::vector<NamedTensor> tensors;
    for (const auto& p : t5->named_parameters()) tensors.push_back({p.key(), p.value().detach(), std::nullopt});
    save_safetensors(f.root + "/t5.safetensors", tensors);
  }
  const std::string t5 = "tokenizer_dir = \"" + tok + "\"\nt5xxl = \"" + f.root + "/t5.safetensors\"\n";
  EXPECT_EQ(build_ldm_caches(f.config("", t5, "sd35m"), true).text_encoded, kTexts);
  EXPECT_EQ(build_ldm_caches(f.config("", t5, "sd35m"), true).text_encoded, 0);
  EXPECT_EQ(build_ldm_caches(f.config("", t5 + "t5xxl_max_token_length = 32\n", "sd35m"), true).text_encoded, kTexts);
  const std::string disk = "cache_text_encoder_outputs_to_disk = true\n";
  const auto memory_run = train(f.config(f.root + "/memory", t5, "sd35m"), quiet());
  const auto disk_run = train(f.config(f.root + "/disk", t5 + disk, "sd35m"), quiet());
  EXPECT_EQ(losses_of(disk_run.run_dir + "/metrics.jsonl"), losses_of(memory_run.run_dir + "/metrics.jsonl"));
}
