// io/tensor_cache.h at the level of its files: entries read back as
// written; a shard cut short while mapped is refused by name (the mapping
// would fault with SIGBUS where its pages are gone); a cache opened to read
// takes no lock. (The LDM caches built on it: tests/train/test_ldm_cache.cpp.)
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/io/atomic_file.h"
#include "shoestring/io/tensor_cache.h"
#include "temp_dir.h"

namespace fs = std::filesystem;
using namespace shoestring;

namespace {

std::string key_of(int i) { return fmt::format("{:032x}", i + 1); }

/// `count` entries of one [4, 8] float tensor each, as shards of `per_shard`.
void write_entries(TensorCache& cache, int count, int per_shard) {
  std::vector<CacheEntry> shard;
  for (int i = 0; i < count; ++i) {
    shard.push_back({key_of(i), {{"value", torch::full({4, 8}, static_cast<float>(i))}}});
    if (static_cast<int>(shard.size()) == per_shard || i + 1 == count) {
      cache.write_shard(shard);
      shard.clear();
    }
  }
}

}  // namespace

TEST(TensorCache, AShardCutShortWhileMappedIsNamedNotAFault) {
  shoestring::testing::TempDir t;
  const std::string dir = t.file("cache");
  {
    TensorCache writer = TensorCache::open(dir, "latents");
    write_entries(writer, 4, 4);
  }
  TensorCache reader = TensorCache::open(dir, "latents", "");
  ASSERT_EQ(reader.size(), 4);
  EXPECT_TRUE(reader.read(key_of(0)).at(0).equal(torch::full({4, 8}, 0.0f)));  // maps the shard
  const std::string shard = reader.shard_of(key_of(3));
  fs::resize_file(shard, fs::file_size(shard) / 2);
  try {
    (void)reader.read(key_of(3));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(shard), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("the shard is now"), std::string::npos) << e.what();
  }
}

TEST(TensorCache, ReadingTakesNoLockAndSeesEveryWritersShards) {
  shoestring::testing::TempDir t;
  const std::string dir = t.file("cache");
  TensorCache r0 = TensorCache::open(dir, "text");
  write_entries(r0, 3, 2);
  TensorCache r1 = TensorCache::open(dir, "text", "r1");  // another rank's writer
  std::vector<CacheEntry> more = {{key_of(10), {{"value", torch::ones({2})}}}};
  r1.write_shard(more);
  // Both writers hold their locks; a reader opens anyway and sees the union.
  TensorCache reader = TensorCache::open(dir, "text", "");
  EXPECT_EQ(reader.size(), 4);
  EXPECT_TRUE(reader.read(key_of(2)).at(0).equal(torch::full({4, 8}, 2.0f)));
  EXPECT_TRUE(reader.read(key_of(10)).at(0).equal(torch::ones({2})));
  // A second writer of the same name is refused, naming the folder.
  try {
    (void)TensorCache::open(dir, "text", "r1");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(dir), std::string::npos) << e.what();
  }
}

// A damaged shard holding newer copies of entries another shard also holds:
// the entries fall back to the older, intact copies (checked in turn), so
// nothing is encoded again; the damaged shard is reported and deleted.
TEST(TensorCache, ADamagedShardsEntriesFallBackToIntactCopies) {
  shoestring::testing::TempDir t;
  const std::string dir = t.file("cache");
  TensorCache cache = TensorCache::open(dir, "latents");
  write_entries(cache, 3, 3);
  const std::string intact = cache.shard_of(key_of(0));
  std::vector<CacheEntry> copies;
  for (int i = 0; i < 3; ++i) copies.push_back({key_of(i), {{"value", torch::full({4, 8}, 100.0f + i)}}});
  cache.write_shard(copies);  // newer copies: they win
  const std::string newer = cache.shard_of(key_of(0));
  ASSERT_NE(newer, intact);
  {
    // One flipped byte near the end (inside the last entry's values).
    std::fstream io(newer, std::ios::in | std::ios::out | std::ios::binary);
    io.seekg(-3, std::ios::end);
    char c = 0;
    io.read(&c, 1);
    io.seekp(-3, std::ios::end);
    c = static_cast<char>(c ^ 0x40);
    io.write(&c, 1);
  }
  const CacheVerifyReport report = cache.verify({key_of(0), key_of(1), key_of(2)});
  ASSERT_EQ(report.problems.size(), 1u);
  EXPECT_NE(report.problems[0].find(newer), std::string::npos) << report.problems[0];
  EXPECT_FALSE(fs::exists(newer));
  EXPECT_EQ(report.shards_checked, 2);
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(cache.contains(key_of(i))) << i;
    EXPECT_EQ(cache.shard_of(key_of(i)), intact);
    EXPECT_TRUE(cache.read(key_of(i)).at(0).equal(torch::full({4, 8}, static_cast<float>(i))));
  }
}
