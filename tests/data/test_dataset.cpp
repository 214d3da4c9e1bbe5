// Tests for the in-memory datasets (Twemoji and kohya folder layouts) and the
// deterministic batch sampler.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>

#include <unistd.h>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/data/dataset.h"
#include "shoestring/data/image.h"

namespace fs = std::filesystem;
using shoestring::BatchSampler;
using shoestring::Error;
using shoestring::ImageCaptionDataset;

namespace {

const std::string kData = SHOESTRING_TEST_DATA;
const std::string kTwemoji = kData + "/twemoji";
const std::string kFolder = kData + "/folder";

struct TempDir {
  fs::path path;
  TempDir() {
    static int counter = 0;
    path = fs::temp_directory_path() /
           ("shoestring_test_dataset_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

/// Expected (image file, caption) pairs, derived from the fixture's emoji.json
/// following the caption rule documented in dataset.h.
std::vector<std::pair<std::string, std::string>> expected_twemoji(const std::string& root) {
  std::ifstream in(root + "/emoji.json");
  const nlohmann::json entries = nlohmann::json::parse(in);
  const std::map<std::string, std::string> tone = {{"1F3FB", "light skin tone"},
                                                   {"1F3FC", "medium-light skin tone"},
                                                   {"1F3FD", "medium skin tone"},
                                                   {"1F3FE", "medium-dark skin tone"},
                                                   {"1F3FF", "dark skin tone"}};
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& e : entries) {
    if (!e["has_img_twitter"].get<bool>()) continue;
    auto caption = [&](const std::string& tone_text) {
      std::vector<std::string> parts = {lower(e["name"].get<std::string>())};
      if (!tone_text.empty()) parts.push_back(tone_text);
      for (const auto& s : e["short_names"]) {
        std::string t = s.get<std::string>();
        for (char& c : t) c = c == '_' ? ' ' : c;
        if (std::find(parts.begin(), parts.end(), t) == parts.end()) parts.push_back(t);
      }
      parts.push_back(lower(e["category"].get<std::string>()));
      std::string joined;
      for (const auto& p : parts) joined += (joined.empty() ? "" : ", ") + p;
      return joined;
    };
    out.emplace_back(e["image"].get<std::string>(), caption(""));
    if (!e.contains("skin_variations")) continue;
    for (const auto& [key, v] : e["skin_variations"].items()) {
      std::string t = tone.at(key.substr(0, 5));
      if (key.size() > 5 && key.substr(6) != key.substr(0, 5)) t += ", " + tone.at(key.substr(6));
      out.emplace_back(v["image"].get<std::string>(), caption(t));
    }
  }
  return out;
}

std::string filename(const std::string& path) { return fs::path(path).filename().string(); }

}  // namespace

TEST(TwemojiDataset, LoadsFixtureWithCaptionsFromEmojiJson) {
  const auto ds = ImageCaptionDataset::load_twemoji(kTwemoji, 32);
  const auto expected = expected_twemoji(kTwemoji);
  ASSERT_EQ(expected.size(), 11u);  // 6 entries, one with 5 skin tones
  ASSERT_EQ(ds.size(), static_cast<int64_t>(expected.size()));
  EXPECT_TRUE(ds.skipped().empty());
  EXPECT_EQ(ds.resolution(), 32);
  ASSERT_EQ(ds.images().sizes(), (std::vector<int64_t>{11, 3, 32, 32}));
  EXPECT_EQ(ds.images().scalar_type(), at::kByte);
  for (size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(filename(ds.paths()[i]), expected[i].first);
    EXPECT_EQ(ds.captions()[i], expected[i].second);
  }
  // The examples given in the design brief.
  const auto& caps = ds.captions();
  EXPECT_NE(std::find(caps.begin(), caps.end(), "grinning face, grinning, smileys & emotion"), caps.end());
  EXPECT_NE(std::find(caps.begin(), caps.end(), "waving hand sign, medium skin tone, wave, people & body"), caps.end());
  // Each stored image is what load_image gives for its file.
  for (int64_t i : {0, 5, 10}) {
    EXPECT_TRUE(ds.images()[i].equal(shoestring::load_image(ds.paths()[i], 32))) << i;
  }
}

// twemoji_categories keeps the entries whose emoji.json category is listed
// (case-insensitive), skin-tone variations with their entry; the reference is
// the fixture's emoji.json read by the test itself (expected_twemoji).
TEST(TwemojiDataset, CategoriesKeepOnlyTheirEntries) {
  const auto all = expected_twemoji(kTwemoji);
  const auto ds = ImageCaptionDataset::load_twemoji(kTwemoji, 16, {"smileys & emotion", "People & Body"});
  std::vector<std::string> want;
  for (const auto& [file, caption] : all) {
    if (caption.find(", smileys & emotion") != std::string::npos ||
        caption.find(", people & body") != std::string::npos) {
      want.push_back(file);
    }
  }
  ASSERT_EQ(want.size(), 9u);  // 3 smileys + 1 person with 5 skin tones
  ASSERT_EQ(ds.size(), static_cast<int64_t>(want.size()));
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(filename(ds.paths()[i]), want[i]);
  // A category the file does not have is an error listing the ones it has.
  EXPECT_THAT([] { ImageCaptionDataset::load_twemoji(kTwemoji, 16, {"Smileys"}); },
              ::testing::ThrowsMessage<shoestring::Error>(
                  ::testing::AllOf(::testing::HasSubstr("twemoji_categories"), ::testing::HasSubstr("\"Smileys\""),
                                   ::testing::HasSubstr("Smileys & Emotion"), ::testing::HasSubstr("emoji.json"))));
  // Through load(): the kohya folder layout has no categories.
  EXPECT_THAT([] { ImageCaptionDataset::load(std::string(SHOESTRING_TEST_DATA) + "/folder", 16, {"Flags"}); },
              ::testing::ThrowsMessage<shoestring::Error>(::testing::HasSubstr("Twemoji layout")));
  EXPECT_EQ(ImageCaptionDataset::load(kTwemoji, 16, {"Flags"}).size(), 1);
}

TEST(TwemojiDataset, HonoursHasImgTwitterAndSkipsMissingFiles) {
  TempDir tmp;
  fs::copy(kTwemoji, tmp.path, fs::copy_options::recursive);
  std::ifstream in(tmp.path / "emoji.json");
  nlohmann::json entries = nlohmann::json::parse(in);
  in.close();
  ASSERT_GE(entries.size(), 2u);
  ASSERT_FALSE(entries[0].contains("skin_variations"));
  entries[0]["has_img_twitter"] = false;
  ASSERT_FALSE(entries[1].contains("skin_variations"));
  fs::remove(tmp.path / "img/twitter/64" / entries[1]["image"].get<std::string>());
  std::ofstream(tmp.path / "emoji.json") << entries.dump();

  const auto ds = ImageCaptionDataset::load(tmp.path.string(), 16);
  EXPECT_EQ(ds.size(), 11 - 2);
  ASSERT_EQ(ds.skipped().size(), 1u);
  EXPECT_EQ(filename(ds.skipped()[0].path), entries[1]["image"].get<std::string>());
  for (const auto& p : ds.paths()) EXPECT_NE(filename(p), entries[0]["image"].get<std::string>());

  std::ofstream(tmp.path / "emoji.json") << "[{\"has_img_twitter\": true}]";
  try {
    ImageCaptionDataset::load(tmp.path.string(), 16);
    FAIL() << "no error for an entry without 'image'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("emoji.json"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("'image'"), std::string::npos) << e.what();
  }
}

TEST(FolderDataset, KohyaLayoutWithCorruptAndUncaptionedImages) {
  const auto ds = ImageCaptionDataset::load_folder(kFolder, 24);
  ASSERT_EQ(ds.size(), 4);
  ASSERT_EQ(ds.images().sizes(), (std::vector<int64_t>{4, 3, 24, 24}));
  std::map<std::string, std::string> by_file;
  for (int64_t i = 0; i < ds.size(); ++i) {
    by_file[fs::relative(ds.paths()[i], kFolder).string()] = ds.captions()[i];
  }
  const std::map<std::string, std::string> want = {{"grinning.png", "a grinning face, yellow"},
                                                   {"heart.png", "a red heart"},
                                                   {"nested/wave.png", "a waving hand, medium skin tone"},
                                                   {"no_caption.png", ""}};
  EXPECT_EQ(by_file, want);
  EXPECT_EQ(ds.missing_captions(), 1);
  ASSERT_EQ(ds.skipped().size(), 1u);
  EXPECT_EQ(filename(ds.skipped()[0].path), "corrupt.png");
  EXPECT_NE(ds.skipped()[0].reason.find("corrupt.png"), std::string::npos) << ds.skipped()[0].reason;

  // load() picks the folder layout here.
  EXPECT_EQ(ImageCaptionDataset::load(kFolder, 24).size(), 4);
}

TEST(FolderDataset, WebpSkippedAndNoImagesIsAnError) {
  TempDir tmp;
  std::ofstream(tmp.path / "a.webp") << "RIFF....WEBP";
  fs::copy_file(kFolder + "/corrupt.png", tmp.path / "b.png");
  try {
    ImageCaptionDataset::load_folder(tmp.path.string(), 16);
    FAIL() << "no error for a folder without loadable images";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("no image"), std::string::npos) << msg;
    EXPECT_NE(msg.find("2 skipped"), std::string::npos) << msg;
  }
  fs::copy_file(kFolder + "/heart.png", tmp.path / "c.png");
  const auto ds = ImageCaptionDataset::load_folder(tmp.path.string(), 16);
  EXPECT_EQ(ds.size(), 1);
  ASSERT_EQ(ds.skipped().size(), 2u);
  EXPECT_NE(ds.skipped()[0].reason.find("WebP"), std::string::npos);
}

namespace {
/// Writes `text` (bytes as given) to `path`.
void write_text(const fs::path& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }

/// Paths of `ds` relative to `root`, sorted.
std::vector<std::string> relative_paths(const ImageCaptionDataset& ds, const fs::path& root) {
  std::vector<std::string> out;
  for (const auto& p : ds.paths()) out.push_back(fs::path(p).lexically_relative(root).string());
  std::sort(out.begin(), out.end());
  return out;
}
}  // namespace

// A link to a folder above it used to be followed until the path grew too
// long: 3 images loaded as 123, without a word.
TEST(FolderDataset, SymlinkLoopIsListedOnceAndReported) {
  TempDir tmp;
  fs::create_directories(tmp.path / "sub" / "deeper");
  fs::copy_file(kFolder + "/heart.png", tmp.path / "a.png");
  write_text(tmp.path / "a.txt", "a heart\n");
  fs::copy_file(kFolder + "/grinning.png", tmp.path / "sub" / "b.png");
  fs::copy_file(kFolder + "/heart.png", tmp.path / "sub" / "deeper" / "c.png");
  fs::create_directory_symlink("..", tmp.path / "sub" / "loop");              // -> tmp
  fs::create_directory_symlink("../..", tmp.path / "sub" / "deeper" / "up");  // -> tmp
  fs::create_directory_symlink(".", tmp.path / "self");                       // -> tmp

  const auto ds = ImageCaptionDataset::load_folder(tmp.path.string(), 8);
  EXPECT_EQ(relative_paths(ds, tmp.path), (std::vector<std::string>{"a.png", "sub/b.png", "sub/deeper/c.png"}));
  EXPECT_EQ(ds.images().size(0), 3);
  ASSERT_EQ(ds.warnings().size(), 3u);
  std::set<std::string> links;
  for (const auto& w : ds.warnings()) {
    links.insert(fs::path(w.path).lexically_relative(tmp.path).string());
    EXPECT_NE(w.message.find("symlink loop"), std::string::npos) << w.message;
    EXPECT_NE(w.message.find(w.path), std::string::npos) << w.message;  // names the link
  }
  EXPECT_EQ(links, (std::set<std::string>{"self", "sub/loop", "sub/deeper/up"}));
}

// Decision: a folder reached through two links is listed once (at its first
// path in sorted order); an image and its caption file reached twice load
// once; a symlinked image with a caption file of its own is a sample of its own.
TEST(FolderDataset, ImageReachedTwiceThroughSymlinksLoadsOnce) {
  TempDir tmp;
  const fs::path pics = tmp.path / "pics";
  const fs::path data = tmp.path / "data";
  fs::create_directories(pics);
  fs::create_directories(data);
  fs::copy_file(kFolder + "/heart.png", pics / "x.png");
  write_text(pics / "x.txt", "a heart\n");
  fs::create_directory_symlink(pics, data / "one");
  fs::create_directory_symlink(pics, data / "two");
  fs::create_symlink(pics / "x.png", data / "same.png");  // same image, same caption file
  fs::create_symlink(pics / "x.txt", data / "same.txt");
  fs::create_symlink(pics / "x.png", data / "own.png");  // same image, its own caption
  write_text(data / "own.txt", "another caption\n");

  const auto ds = ImageCaptionDataset::load_folder(data.string(), 8);
  EXPECT_EQ(relative_paths(ds, data), (std::vector<std::string>{"one/x.png", "own.png"}));
  std::map<std::string, std::string> caption;
  for (int64_t i = 0; i < ds.size(); ++i) caption[filename(ds.paths()[i])] = ds.captions()[i];
  EXPECT_EQ(caption["x.png"], "a heart");
  EXPECT_EQ(caption["own.png"], "another caption");
  ASSERT_EQ(ds.warnings().size(), 2u);
  EXPECT_EQ(filename(ds.warnings()[0].path), "two");
  EXPECT_NE(ds.warnings()[0].message.find("already listed"), std::string::npos) << ds.warnings()[0].message;
  EXPECT_EQ(filename(ds.warnings()[1].path), "same.png");
  EXPECT_NE(ds.warnings()[1].message.find("loaded once"), std::string::npos) << ds.warnings()[1].message;
  EXPECT_TRUE(ds.skipped().empty());
}

TEST(FolderDataset, CountsMissingAndEmptyCaptions) {
  TempDir tmp;
  for (const char* name : {"a", "b", "c", "d", "e", "f"}) {
    fs::copy_file(kFolder + "/heart.png", tmp.path / (std::string(name) + ".png"));
  }
  write_text(tmp.path / "a.txt", "a heart\nsecond line ignored\n");
  write_text(tmp.path / "b.txt", "");                // empty file
  write_text(tmp.path / "c.txt", "   \t\nlater\n");  // blank first line
  write_text(tmp.path / "d.txt",
             "\xEF\xBB\xBF"
             "caf\xC3\xA9 heart\r\n");  // BOM, CRLF
  // e.png, f.png: no caption file
  const auto ds = ImageCaptionDataset::load_folder(tmp.path.string(), 8);
  ASSERT_EQ(ds.size(), 6);
  std::map<std::string, std::string> caption;
  for (int64_t i = 0; i < ds.size(); ++i) caption[filename(ds.paths()[i])] = ds.captions()[i];
  EXPECT_EQ(caption, (std::map<std::string, std::string>{{"a.png", "a heart"},
                                                         {"b.png", ""},
                                                         {"c.png", ""},
                                                         {"d.png", "caf\xC3\xA9 heart"},
                                                         {"e.png", ""},
                                                         {"f.png", ""}}));
  EXPECT_EQ(ds.caption_stats().missing, 2);
  EXPECT_EQ(ds.caption_stats().empty, 2);
  EXPECT_EQ(ds.missing_captions(), 2);
  // The Twemoji layout has neither.
  const auto twemoji = ImageCaptionDataset::load_twemoji(kTwemoji, 8);
  EXPECT_EQ(twemoji.caption_stats().missing, 0);
  EXPECT_EQ(twemoji.caption_stats().empty, 0);
}

TEST(FolderDataset, CaptionThatIsNotUtf8IsAnErrorNamingFileAndOffset) {
  TempDir tmp;
  fs::copy_file(kFolder + "/heart.png", tmp.path / "a.png");
  fs::copy_file(kFolder + "/heart.png", tmp.path / "b.png");
  write_text(tmp.path / "a.txt", "fine\n");
  write_text(tmp.path / "b.txt", "line one\ncaf\xE9\n");  // Latin-1 é on line 2, byte 12
  try {
    ImageCaptionDataset::load_folder(tmp.path.string(), 8);
    FAIL() << "no error for a Latin-1 caption";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find((tmp.path / "b.txt").string()), std::string::npos) << msg;
    EXPECT_NE(msg.find("not valid UTF-8"), std::string::npos) << msg;
    EXPECT_NE(msg.find("byte offset 12"), std::string::npos) << msg;
  }
  write_text(tmp.path / "b.txt", "\xED\xA0\x80 surrogate\n");
  EXPECT_THROW(ImageCaptionDataset::load_folder(tmp.path.string(), 8), Error);
}

TEST(Dataset, MissingPathSaysHowToFetch) {
  try {
    ImageCaptionDataset::load(kData + "/no_such_dataset", 32);
    FAIL() << "no error for a missing path";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("no_such_dataset"), std::string::npos) << msg;
    EXPECT_NE(msg.find("scripts/fetch_twemoji.sh"), std::string::npos) << msg;
  }
  // An emoji.json path selects the Twemoji layout.
  EXPECT_EQ(ImageCaptionDataset::load(kTwemoji + "/emoji.json", 8).size(), 11);
}

TEST(Dataset, BatchImagesAreScaledToMinusOneOne) {
  const auto ds = ImageCaptionDataset::load(kTwemoji, 16);
  const std::vector<int64_t> idx = {3, 0, 3};
  const at::Tensor x = ds.batch_images(idx);
  ASSERT_EQ(x.scalar_type(), at::kFloat);
  ASSERT_EQ(x.sizes(), (std::vector<int64_t>{3, 3, 16, 16}));
  EXPECT_GE(x.min().item<float>(), -1.0f);
  EXPECT_LE(x.max().item<float>(), 1.0f);
  EXPECT_FLOAT_EQ(x.max().item<float>(), 1.0f);  // white background
  const at::Tensor want = ds.images()[0].to(at::kFloat) / 127.5 - 1.0;
  EXPECT_TRUE(at::allclose(x[1], want, 0, 1e-6));
  EXPECT_TRUE(x[0].equal(x[2]));
  EXPECT_EQ(ds.batch_captions(idx)[1], ds.captions()[0]);
  EXPECT_THROW(ds.batch_images({11}), Error);
  EXPECT_THROW(ds.batch_images({-1}), Error);
}

TEST(BatchSampler, EachEpochIsAPermutationWithDropLast) {
  BatchSampler sampler(10, 3, 42);
  ASSERT_EQ(sampler.batches_per_epoch(), 3);
  for (int64_t epoch = 0; epoch < 4; ++epoch) {
    const auto perm = sampler.epoch_permutation(epoch);
    std::vector<int64_t> sorted = perm;
    std::sort(sorted.begin(), sorted.end());
    for (int64_t i = 0; i < 10; ++i) ASSERT_EQ(sorted[i], i);
    std::vector<int64_t> seen;
    for (int64_t b = 0; b < 3; ++b) {
      EXPECT_EQ(sampler.position().epoch, epoch);
      EXPECT_EQ(sampler.position().index, b);
      const auto batch = sampler.next();
      ASSERT_EQ(batch.size(), 3u);
      seen.insert(seen.end(), batch.begin(), batch.end());
    }
    // The epoch's batches are the first 9 entries of its permutation.
    EXPECT_EQ(seen, std::vector<int64_t>(perm.begin(), perm.begin() + 9));
  }
  EXPECT_EQ(sampler.position().epoch, 4);
  EXPECT_NE(sampler.epoch_permutation(0), sampler.epoch_permutation(1));
}

TEST(BatchSampler, SameSeedSameOrderAndResumeIsIdentical) {
  BatchSampler a(37, 4, 7), b(37, 4, 7), c(37, 4, 8);
  std::vector<std::vector<int64_t>> run;
  std::vector<BatchSampler::Position> positions;
  bool differs_from_c = false;
  for (int i = 0; i < 40; ++i) {  // 40 batches = 4 epochs and a bit (9 per epoch)
    positions.push_back(a.position());
    run.push_back(a.next());
    EXPECT_EQ(b.next(), run.back());
    differs_from_c |= c.next() != run.back();
  }
  EXPECT_TRUE(differs_from_c);
  // A new sampler set to a saved position continues exactly.
  for (int start : {0, 8, 9, 23}) {
    BatchSampler resumed(37, 4, 7);
    resumed.set_position(positions[start]);
    for (int i = start; i < 40; ++i) ASSERT_EQ(resumed.next(), run[i]) << "from " << start;
  }
  // The order does not depend on torch's global RNG.
  at::manual_seed(123);
  BatchSampler d(37, 4, 7);
  EXPECT_EQ(d.next(), run[0]);

  EXPECT_THROW(a.set_position({0, 9}), Error);
  EXPECT_THROW(a.set_position({-1, 0}), Error);
  EXPECT_THROW(BatchSampler(3, 4, 0), Error);
  EXPECT_THROW(BatchSampler(3, 0, 0), Error);
}

// Loads the full fetched Twemoji set when SHOESTRING_TWEMOJI_DIR points at it
// (scripts/fetch_twemoji.sh prints the path); skipped otherwise.
TEST(TwemojiDataset, FullDatasetLoadsQuickly) {
  const char* dir = std::getenv("SHOESTRING_TWEMOJI_DIR");
  if (!dir) GTEST_SKIP() << "set SHOESTRING_TWEMOJI_DIR to the fetched dataset to run";
  const auto t0 = std::chrono::steady_clock::now();
  const auto ds = ImageCaptionDataset::load(dir, 64);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_EQ(ds.size() + static_cast<int64_t>(ds.skipped().size()), static_cast<int64_t>(expected_twemoji(dir).size()));
  EXPECT_TRUE(ds.skipped().empty());
  std::printf("loaded %lld images in %.2f s\n", static_cast<long long>(ds.size()), seconds);
}
