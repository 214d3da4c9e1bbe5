// kohya datasets in aspect-ratio buckets (ImageCaptionDataset::load_buckets)
// and the bucketed batch order (BatchSampler over SamplerBuckets): images of
// several aspect ratios land in the buckets the Python reference
// (scripts/gen_bucket_reference.py) gives, are cropped as kohya crops them,
// captions come from caption files, class_tokens or kohya's metadata JSON,
// repeats count as kohya counts them, and a batch never mixes buckets.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include <unistd.h>

#include <nlohmann/json.hpp>
#include <spdlog/sinks/ringbuffer_sink.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "../error_testing.h"
#include "shoestring/core/error.h"
#include "shoestring/data/dataset.h"
#include "shoestring/data/image.h"

namespace fs = std::filesystem;
using namespace shoestring;
using shoestring::testing::error_of;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    static int counter = 0;
    path = fs::temp_directory_path() /
           ("shoestring_test_buckets_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

void write_text(const fs::path& p, const std::string& text) { std::ofstream(p) << text; }

/// A w x h RGB image: the left `band` columns red, the right `band` blue, the rest green.
void write_banded(const fs::path& p, int w, int h, int band) {
  auto img = torch::zeros({h, w, 3}, torch::kUInt8);
  img.index_put_({torch::indexing::Slice(), torch::indexing::Slice(), 1}, 255);
  img.index_put_({torch::indexing::Slice(), torch::indexing::Slice(0, band)},
                 torch::tensor({255, 0, 0}, torch::kUInt8));
  img.index_put_({torch::indexing::Slice(), torch::indexing::Slice(w - band, w)},
                 torch::tensor({0, 0, 255}, torch::kUInt8));
  save_png(p.string(), img);
}

/// The bucket the Python reference gives an image of `size` in case `name`.
BucketReso reference_bucket(const std::string& name, BucketReso size) {
  std::ifstream in(std::string(SHOESTRING_TEST_DATA) + "/buckets/reference.json");
  const nlohmann::json ref = nlohmann::json::parse(in);
  for (const auto& c : ref["cases"]) {
    if (c["name"] != name) continue;
    for (const auto& im : c["images"]) {
      if (im["size"][0] == size.width && im["size"][1] == size.height) {
        return {im["bucket"][0].get<int64_t>(), im["bucket"][1].get<int64_t>()};
      }
    }
  }
  ADD_FAILURE() << "no reference for " << name << " " << to_string(size);
  return {};
}

DatasetSpec tiny_spec(const std::string& dir, int64_t steps) {
  DatasetSpec d;
  d.buckets.resolution = {32, 32};
  d.buckets.enable_bucket = true;
  d.buckets.min_bucket_reso = 16;
  d.buckets.max_bucket_reso = steps == 16 ? 64 : 48;
  d.buckets.bucket_reso_steps = steps;
  d.batch_size = 2;
  DatasetSubset s;
  s.image_dir = dir;
  s.where = "test subset";
  d.subsets.push_back(s);
  d.where = "test dataset";
  return d;
}

}  // namespace

TEST(DatasetBuckets, ImagesLandInTheReferenceBucketsAndAreCentreCropped) {
  TempDir t;
  // Sizes of the reference's image list, for its tiny_32_steps16 / steps8 cases.
  const std::vector<BucketReso> sizes = {{48, 32}, {32, 48}, {64, 64}, {100, 60}, {60, 100}, {40, 24}};
  for (size_t i = 0; i < sizes.size(); ++i) {
    write_banded(t.path / fmt::format("img{}.png", i), static_cast<int>(sizes[i].width),
                 static_cast<int>(sizes[i].height), 8);
    if (i != 1) write_text(t.path / fmt::format("img{}.txt", i), fmt::format("caption {}\n", i));
  }
  write_text(t.path / "notes.md", "not an image");
  for (const int64_t steps : {16, 8}) {
    const std::string ref_case = steps == 16 ? "tiny_32_steps16" : "tiny_32_steps8";
    DatasetSpec spec = tiny_spec(t.path.string(), steps);
    spec.subsets[0].class_tokens = "sks photo";
    const ImageCaptionDataset ds = ImageCaptionDataset::load_buckets({spec}, 1);
    ASSERT_TRUE(ds.bucketed());
    ASSERT_EQ(ds.size(), 6);
    EXPECT_EQ(ds.resolution(), 0);
    std::set<BucketReso> seen;
    for (int64_t i = 0; i < ds.size(); ++i) {
      const BucketReso want = reference_bucket(ref_case, sizes[static_cast<size_t>(i)]);
      const DatasetBucket& b = ds.buckets()[static_cast<size_t>(ds.bucket_of(i))];
      EXPECT_EQ(b.reso, want) << ref_case << " image " << i << ": " << to_string(b.reso);
      EXPECT_EQ(ds.geometry(i).original, sizes[static_cast<size_t>(i)]);
      seen.insert(b.reso);
      const at::Tensor img = ds.bucket_images(ds.bucket_of(i));
      EXPECT_EQ(img.size(2), want.height);
      EXPECT_EQ(img.size(3), want.width);
    }
    // Buckets sorted by size, one per size in use, each image once.
    ASSERT_EQ(ds.buckets().size(), seen.size());
    for (size_t b = 1; b < ds.buckets().size(); ++b) EXPECT_LT(ds.buckets()[b - 1].reso, ds.buckets()[b].reso);
    EXPECT_EQ(ds.captions()[0], "caption 0");
    EXPECT_EQ(ds.captions()[1], "sks photo");  // no caption file: class_tokens, as kohya
    EXPECT_EQ(ds.caption_stats().missing, 0);  // class_tokens captioned it
    EXPECT_EQ(ds.caption_stats().class_tokens, 1);
    spec.subsets[0].class_tokens.clear();
    const ImageCaptionDataset uncaptioned = ImageCaptionDataset::load_buckets({spec}, 1);
    EXPECT_EQ(uncaptioned.captions()[1], "");
    EXPECT_EQ(uncaptioned.caption_stats().missing, 1);
    EXPECT_EQ(uncaptioned.caption_stats().class_tokens, 0);
  }
  // steps 16: 48x32 trains at 32x32, not resized (scale 32 / 32), cropped 8 px
  // each side (kohya's (48 - 32) // 2): the red and blue bands are cut off.
  const ImageCaptionDataset ds = ImageCaptionDataset::load_buckets({tiny_spec(t.path.string(), 16)}, 1);
  EXPECT_EQ(ds.geometry(0).resized, (BucketReso{48, 32}));
  EXPECT_EQ(ds.geometry(0).crop.x, 8);
  EXPECT_EQ(ds.geometry(0).crop.y, 0);
  const at::Tensor x = ds.batch_images({0});
  ASSERT_EQ(x.sizes(), (std::vector<int64_t>{1, 3, 32, 32}));
  EXPECT_TRUE(x[0][0].eq(-1).all().item<bool>());  // no red
  EXPECT_TRUE(x[0][1].eq(1).all().item<bool>());   // all green
  EXPECT_TRUE(x[0][2].eq(-1).all().item<bool>());  // no blue
  // A batch of two buckets is refused.
  int64_t other = -1;
  for (int64_t i = 1; i < ds.size(); ++i) {
    if (ds.bucket_of(i) != ds.bucket_of(0)) other = i;
  }
  ASSERT_GE(other, 0);
  EXPECT_NE(error_of([&] { ds.batch_images({0, other}); }).find("different buckets"), std::string::npos);
}

TEST(DatasetBuckets, MetadataJsonGivesCaptionsAndTagsAsKohyaJoinsThem) {
  TempDir t;
  write_banded(t.path / "a.png", 64, 32, 4);
  write_banded(t.path / "b.png", 32, 32, 4);
  write_banded(t.path / "c.png", 32, 64, 4);
  write_text(t.path / "meta.json", R"({
    "a": {"caption": "a red thing", "tags": "red, wide"},
    "b.png": {"tags": "square"},
    "c": {"caption": "tall", "train_resolution": [32, 64]}
  })");
  DatasetSpec spec = tiny_spec(t.path.string(), 16);
  spec.subsets[0].metadata_file = (t.path / "meta.json").string();
  spec.subsets[0].num_repeats = 3;
  const ImageCaptionDataset ds = ImageCaptionDataset::load_buckets({spec}, 1);
  ASSERT_EQ(ds.size(), 3);
  EXPECT_EQ(ds.captions()[0], "a red thing,red, wide");  // caption + "," + tags (kohya's caption_separator)
  EXPECT_EQ(ds.captions()[1], "square");
  EXPECT_EQ(ds.captions()[2], "tall");
  EXPECT_EQ(ds.paths()[0], (t.path / "a.png").string());  // key without extension: the image file found
  // Repeats: each image is num_repeats entries of its bucket (kohya's count).
  int64_t entries = 0;
  for (const auto& b : ds.buckets()) entries += b.entries;
  EXPECT_EQ(entries, 9);
  const std::vector<SamplerBucket> sb = sampler_buckets(ds);
  for (size_t b = 0; b < sb.size(); ++b) {
    EXPECT_EQ(static_cast<int64_t>(sb[b].samples.size()), ds.buckets()[b].entries);
    EXPECT_EQ(sb[b].batch_size, 2);
  }
  // JSON Lines, and the errors naming the file and key.
  write_text(t.path / "meta.jsonl", "{\"image_path\": \"a.png\", \"caption\": \"x\"}\n\n{\"image_path\": \"b\"}\n");
  spec.subsets[0].metadata_file = (t.path / "meta.jsonl").string();
  const ImageCaptionDataset lines = ImageCaptionDataset::load_buckets({spec}, 1);
  ASSERT_EQ(lines.size(), 2);
  EXPECT_EQ(lines.captions()[0], "x");
  write_text(t.path / "bad.json", R"({"a": {"caption": "x", "colour": "red"}})");
  spec.subsets[0].metadata_file = (t.path / "bad.json").string();
  const std::string m = error_of([&] { ImageCaptionDataset::load_buckets({spec}, 1); });
  EXPECT_NE(m.find("bad.json: entry \"a\": unknown key 'colour'"), std::string::npos) << m;
  write_text(t.path / "missing.json", R"({"nothere": {"caption": "x"}})");
  spec.subsets[0].metadata_file = (t.path / "missing.json").string();
  EXPECT_NE(error_of([&] { ImageCaptionDataset::load_buckets({spec}, 1); }).find("does not exist"), std::string::npos);
  // num_repeats < 1: the subset is left out (kohya), here leaving no image.
  spec.subsets[0].metadata_file.clear();
  spec.subsets[0].num_repeats = 0;
  EXPECT_NE(error_of([&] { ImageCaptionDataset::load_buckets({spec}, 1); }).find("no image"), std::string::npos);
}

TEST(BucketedSampler, BatchesNeverMixBucketsAndEveryEntryIsUsedOnce) {
  // Three buckets of 5, 2 and 7 entries (one image repeated), batch sizes 2, 2, 3.
  std::vector<SamplerBucket> buckets = {{{0, 1, 2, 3, 4}, 2}, {{5, 6}, 2}, {{7, 7, 8, 8, 9, 9, 10}, 3}};
  std::map<int64_t, size_t> bucket_of;
  for (size_t b = 0; b < buckets.size(); ++b) {
    for (int64_t s : buckets[b].samples) bucket_of[s] = b;
  }
  BatchSampler partial(buckets, 11, /*partial_batches=*/true);
  EXPECT_EQ(partial.batches_per_epoch(), 3 + 1 + 3);  // ceil(5/2) + ceil(2/2) + ceil(7/3), as kohya
  EXPECT_EQ(partial.dataset_size(), 14);
  BatchSampler drop(buckets, 11, /*partial_batches=*/false);
  EXPECT_EQ(drop.batches_per_epoch(), 2 + 1 + 2);
  bool orders_differ = false;
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    std::map<int64_t, int> count;
    std::vector<size_t> bucket_order;
    for (int64_t k = 0; k < partial.batches_per_epoch(); ++k) {
      const auto batch = partial.next();
      ASSERT_FALSE(batch.empty());
      const size_t b = bucket_of.at(batch.front());
      for (int64_t s : batch) EXPECT_EQ(bucket_of.at(s), b) << "a batch mixes buckets";
      EXPECT_LE(static_cast<int64_t>(batch.size()), buckets[b].batch_size);
      for (int64_t s : batch) ++count[s];
      bucket_order.push_back(b);
    }
    // Every entry once per epoch (an image as often as it is repeated).
    for (const auto& b : buckets) {
      for (int64_t s : b.samples) {
        EXPECT_EQ(count[s], std::count(b.samples.begin(), b.samples.end(), s)) << "epoch " << epoch << " image " << s;
      }
    }
    // The batch list is shuffled across buckets (not bucket after bucket).
    orders_differ |= !std::is_sorted(bucket_order.begin(), bucket_order.end());
  }
  EXPECT_TRUE(orders_differ);
  // Without partial batches, every batch is full.
  for (int64_t k = 0; k < 2 * drop.batches_per_epoch(); ++k) {
    const auto batch = drop.next();
    EXPECT_EQ(static_cast<int64_t>(batch.size()), buckets[bucket_of.at(batch.front())].batch_size);
  }
  // One bucket of [0, N) without partial batches is the unbucketed order.
  std::vector<int64_t> all;
  for (int64_t i = 0; i < 23; ++i) all.push_back(i);
  BatchSampler plain(23, 4, 9), one({{all, 4}}, 9, false);
  for (int k = 0; k < 20; ++k) ASSERT_EQ(plain.next(), one.next()) << k;
  // Resume: a new sampler set to a saved position continues exactly.
  BatchSampler a(buckets, 5, true), b(buckets, 5, true);
  for (int k = 0; k < 9; ++k) a.next();
  b.set_position(a.position());
  for (int k = 0; k < 10; ++k) ASSERT_EQ(a.next(), b.next());
  EXPECT_THROW(BatchSampler({{{0}, 2}}, 1, false), Error);  // no full batch
  EXPECT_NO_THROW(BatchSampler({{{0}, 2}}, 1, true));       // kohya: a batch of one
}

// DatasetSelection::decode_on_demand (the latent disk cache's loading): the
// same images as decoding at load, for buckets (random crops included) and
// the square layout, with only the headers read at load, so a file whose
// pixels are damaged is not skipped but named when a batch decodes it.
TEST(DatasetOnDemand, DecodesWhatLoadingDecodesAndNamesADamagedFile) {
  TempDir t;
  const std::vector<BucketReso> sizes = {{48, 32}, {32, 32}, {32, 48}, {40, 24}, {24, 40}, {64, 16}};
  for (size_t i = 0; i < sizes.size(); ++i) {
    write_banded(t.path / fmt::format("img{}.png", i), static_cast<int>(sizes[i].width),
                 static_cast<int>(sizes[i].height), 8);
    write_text(t.path / fmt::format("img{}.txt", i), fmt::format("caption {}\n", i));
  }
  DatasetSpec spec = tiny_spec(t.path.string(), 8);
  spec.subsets[0].random_crop = true;
  DatasetSelection on_demand;
  on_demand.decode_on_demand = true;
  const ImageCaptionDataset eager = ImageCaptionDataset::load_buckets({spec}, 3);
  const ImageCaptionDataset lazy = ImageCaptionDataset::load_buckets({spec}, 3, on_demand);
  EXPECT_FALSE(eager.decodes_on_demand());
  ASSERT_TRUE(lazy.decodes_on_demand());
  ASSERT_EQ(lazy.size(), eager.size());
  ASSERT_EQ(lazy.buckets().size(), eager.buckets().size());
  for (const DatasetBucket& b : eager.buckets()) {
    EXPECT_TRUE(lazy.batch_images(b.images).equal(eager.batch_images(b.images))) << to_string(b.reso);
  }
  EXPECT_NE(error_of([&] { (void)lazy.bucket_images(0); }).find("decoded on demand"), std::string::npos);
  const ImageCaptionDataset square = ImageCaptionDataset::load_folder(t.path.string(), 24);
  const ImageCaptionDataset square_lazy = ImageCaptionDataset::load_folder(t.path.string(), 24, on_demand);
  EXPECT_FALSE(square_lazy.images().defined());
  EXPECT_TRUE(square_lazy.batch_images({5, 0, 2}).equal(square.batch_images({5, 0, 2})));

  // A PNG cut after its header: skipped when decoding at load, named on demand.
  {
    const std::string whole = [&] {
      std::ifstream in(t.path / "img1.png", std::ios::binary);
      return std::string(std::istreambuf_iterator<char>(in), {});
    }();
    std::ofstream(t.path / "img1.png", std::ios::binary | std::ios::trunc) << whole.substr(0, whole.size() / 2);
  }
  EXPECT_EQ(ImageCaptionDataset::load_folder(t.path.string(), 24).skipped().size(), 1u);
  const ImageCaptionDataset damaged = ImageCaptionDataset::load_folder(t.path.string(), 24, on_demand);
  EXPECT_TRUE(damaged.skipped().empty());
  ASSERT_EQ(damaged.size(), 6);
  EXPECT_TRUE(damaged.batch_images({0}).equal(square.batch_images({0})));
  EXPECT_NE(error_of([&] { (void)damaged.batch_images({0, 1}); }).find("img1.png"), std::string::npos);
}

// A DreamBooth subset folder without images (empty, or a typo'd extension)
// is warned about, naming it, as kohya warns; the other subsets load.
TEST(DatasetBuckets, ASubsetFolderWithoutImagesIsWarnedAbout) {
  TempDir t;
  fs::create_directories(t.path / "full");
  fs::create_directories(t.path / "empty");
  write_banded(t.path / "full" / "a.png", 32, 32, 8);
  write_text(t.path / "empty" / "a.txt", "a caption without its image");
  DatasetSpec spec = tiny_spec((t.path / "full").string(), 8);
  DatasetSubset empty = spec.subsets[0];
  empty.image_dir = (t.path / "empty").string();
  empty.where = "subset 2";
  spec.subsets.push_back(empty);
  auto sink = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(16);
  const auto saved = spdlog::default_logger();
  spdlog::set_default_logger(std::make_shared<spdlog::logger>("capture", sink));
  const ImageCaptionDataset ds = ImageCaptionDataset::load_buckets({spec}, 1);
  spdlog::set_default_logger(saved);
  EXPECT_EQ(ds.size(), 1);
  std::string warnings;
  for (const std::string& line : sink->last_formatted()) warnings += line;
  EXPECT_NE(warnings.find("subset 2: image_dir " + empty.image_dir + " holds no images"), std::string::npos)
      << warnings;
  EXPECT_EQ(warnings.find("test subset"), std::string::npos) << warnings;  // the full one is not named
}
