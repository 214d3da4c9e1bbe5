// The seeded subset of a dataset (max_train_images, DatasetSelection):
// seeded_subset's size, order, determinism, nesting and uniform inclusion
// (probability count / n), and the loaders keeping exactly the subset of
// their listing that seeded_subset names.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <set>

#include "shoestring/core/error.h"
#include "shoestring/data/dataset.h"

using namespace shoestring;

namespace {

const std::string kData = SHOESTRING_TEST_DATA;

}  // namespace

TEST(SeededSubset, SizeOrderAndDeterminism) {
  for (int64_t n : {0, 1, 7, 100}) {
    for (int64_t count : {0, 1, 5, 100, 250}) {
      const std::vector<int64_t> a = seeded_subset(n, count, 11);
      ASSERT_EQ(static_cast<int64_t>(a.size()), std::min(n, count)) << n << " " << count;
      EXPECT_TRUE(std::is_sorted(a.begin(), a.end()));
      EXPECT_EQ(std::set<int64_t>(a.begin(), a.end()).size(), a.size());  // distinct
      for (const int64_t i : a) EXPECT_TRUE(i >= 0 && i < n);
      EXPECT_EQ(seeded_subset(n, count, 11), a);  // the same seed picks the same images
    }
  }
  EXPECT_NE(seeded_subset(1000, 10, 1), seeded_subset(1000, 10, 2));
  EXPECT_THROW(seeded_subset(-1, 1, 0), Error);
  EXPECT_THROW(seeded_subset(3, -1, 0), Error);
}

TEST(SeededSubset, ALargerCountKeepsTheSmallersImages) {
  for (uint64_t seed : {0u, 5u, 99u}) {
    std::vector<int64_t> previous;
    for (int64_t count = 1; count <= 40; ++count) {
      const std::vector<int64_t> now = seeded_subset(40, count, seed);
      EXPECT_TRUE(std::includes(now.begin(), now.end(), previous.begin(), previous.end())) << count;
      previous = now;
    }
  }
}

TEST(SeededSubset, EveryIndexIsChosenWithProbabilityCountOverN) {
  constexpr int64_t n = 20, count = 5, seeds = 4000;
  std::vector<int64_t> hits(n, 0);
  for (int64_t s = 0; s < seeds; ++s) {
    for (const int64_t i : seeded_subset(n, count, static_cast<uint64_t>(s))) ++hits[static_cast<size_t>(i)];
  }
  const double p = static_cast<double>(count) / n;
  const double mean = seeds * p, sd = std::sqrt(seeds * p * (1 - p));  // binomial
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_LT(std::abs(static_cast<double>(hits[static_cast<size_t>(i)]) - mean), 5 * sd) << "index " << i;
  }
}

TEST(SeededSubset, FolderKeepsTheSeededPickOfItsListing) {
  const std::string dir = kData + "/folder";
  const ImageCaptionDataset all = ImageCaptionDataset::load_folder(dir, 16);
  // The listing: every image found, loaded or skipped, sorted by path (load_folder's order).
  std::vector<std::string> listing = all.paths();
  for (const SkippedImage& s : all.skipped()) listing.push_back(s.path);
  auto by_path = [](const std::string& a, const std::string& b) {
    return std::filesystem::path(a) < std::filesystem::path(b);
  };
  std::sort(listing.begin(), listing.end(), by_path);
  ASSERT_EQ(all.listed_images(), static_cast<int64_t>(listing.size()));
  for (uint64_t seed = 0; seed < 6; ++seed) {
    const ImageCaptionDataset some = ImageCaptionDataset::load_folder(dir, 16, {2, seed});
    EXPECT_EQ(some.listed_images(), static_cast<int64_t>(listing.size()));
    std::vector<std::string> chosen;
    for (const int64_t i : seeded_subset(static_cast<int64_t>(listing.size()), 2, seed)) {
      chosen.push_back(listing[static_cast<size_t>(i)]);
    }
    std::vector<std::string> got = some.paths();
    for (const SkippedImage& s : some.skipped()) got.push_back(s.path);
    std::sort(got.begin(), got.end(), by_path);
    EXPECT_EQ(got, chosen) << "seed " << seed;
    for (size_t k = 0; k < some.paths().size(); ++k) {  // each keeps its own caption
      const auto at = std::find(all.paths().begin(), all.paths().end(), some.paths()[k]) - all.paths().begin();
      EXPECT_EQ(some.captions()[k], all.captions()[static_cast<size_t>(at)]);
    }
  }
}

TEST(SeededSubset, TwemojiAndBucketedLoadersKeepTheSubset) {
  const std::string twemoji = kData + "/twemoji";
  const ImageCaptionDataset all = ImageCaptionDataset::load(twemoji, 16);
  const ImageCaptionDataset a = ImageCaptionDataset::load(twemoji, 16, {}, {3, 7});
  const ImageCaptionDataset b = ImageCaptionDataset::load(twemoji, 16, {}, {3, 7});
  EXPECT_LE(a.size(), 3);
  EXPECT_EQ(a.paths(), b.paths());
  EXPECT_EQ(a.listed_images(), all.listed_images());
  for (const std::string& p : a.paths()) {
    EXPECT_NE(std::find(all.paths().begin(), all.paths().end(), p), all.paths().end()) << p;
  }

  DatasetSpec spec;
  spec.buckets.resolution = {32, 32};
  spec.batch_size = 1;
  DatasetSubset sub;
  sub.image_dir = kData + "/folder";  // its own files: 4 images, one of them corrupt
  sub.num_repeats = 3;
  sub.where = "test subset";
  spec.subsets.push_back(sub);
  spec.where = "test dataset";
  const ImageCaptionDataset whole = ImageCaptionDataset::load_buckets({spec}, 1);
  for (uint64_t seed = 0; seed < 4; ++seed) {
    const ImageCaptionDataset some = ImageCaptionDataset::load_buckets({spec}, 1, {2, seed});
    EXPECT_EQ(some.listed_images(), whole.listed_images());
    EXPECT_EQ(some.size() + static_cast<int64_t>(some.skipped().size()), 2);
    for (int64_t i = 0; i < some.size(); ++i) EXPECT_EQ(some.num_repeats(i), 3);
  }
}
