// Aspect-ratio buckets (data/buckets.h) against the independent Python
// re-implementation of kohya's rules, scripts/gen_bucket_reference.py
// (tests/data/buckets/reference.json): the predefined bucket list, each
// image's bucket, resized size, aspect-ratio error and SDXL crop box, and
// the sorted buckets in use; then the crop offsets and the settings checks.
#include <gtest/gtest.h>

#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "../error_testing.h"
#include "shoestring/core/error.h"
#include "shoestring/data/buckets.h"

using namespace shoestring;
using shoestring::testing::error_of;

#define EXPECT_THROW_WITH(expr, text) \
  EXPECT_NE(error_of([&] { (void)(expr); }).find(text), std::string::npos) << error_of([&] { (void)(expr); })

namespace {

nlohmann::json reference() {
  std::ifstream in(std::string(SHOESTRING_TEST_DATA) + "/buckets/reference.json");
  return nlohmann::json::parse(in);
}

BucketReso reso(const nlohmann::json& j) { return {j[0].get<int64_t>(), j[1].get<int64_t>()}; }

BucketSettings settings_of(const nlohmann::json& s) {
  BucketSettings b;
  b.resolution = reso(s["resolution"]);
  b.enable_bucket = s["enable_bucket"].get<bool>();
  b.min_bucket_reso = s["min_bucket_reso"].get<int64_t>();
  b.max_bucket_reso = s["max_bucket_reso"].get<int64_t>();
  b.bucket_reso_steps = s["bucket_reso_steps"].get<int64_t>();
  b.bucket_no_upscale = s["bucket_no_upscale"].get<bool>();
  return b;
}

}  // namespace

TEST(Buckets, MatchTheKohyaReference) {
  const nlohmann::json ref = reference();
  ASSERT_GE(ref["cases"].size(), 8u);
  for (const auto& c : ref["cases"]) {
    const std::string name = c["name"].get<std::string>();
    const BucketSettings s = adjust_bucket_settings(settings_of(c["settings"]), name, nullptr);
    BucketManager m = BucketManager::for_settings(s);
    std::vector<BucketReso> want_predefined;
    for (const auto& b : c["buckets"]) want_predefined.push_back(reso(b));
    EXPECT_EQ(m.predefined_resos(), want_predefined) << name;
    for (const auto& im : c["images"]) {
      const BucketReso size = reso(im["size"]);
      const BucketChoice got = m.select_bucket(size.width, size.height);
      const std::string what = name + " image " + to_string(size);
      EXPECT_EQ(got.bucket, reso(im["bucket"])) << what << ": " << to_string(got.bucket);
      EXPECT_EQ(got.resized, reso(im["resized"])) << what << ": " << to_string(got.resized);
      EXPECT_DOUBLE_EQ(got.ar_error, im["ar_error"].get<double>()) << what;
      EXPECT_GE(got.resized.width, got.bucket.width) << what;  // the image covers its bucket
      EXPECT_GE(got.resized.height, got.bucket.height) << what;
      const CropLtrb box = crop_ltrb(got.bucket, size);
      EXPECT_DOUBLE_EQ(box.left, im["crop_ltrb"][0].get<double>()) << what;
      EXPECT_DOUBLE_EQ(box.top, im["crop_ltrb"][1].get<double>()) << what;
      EXPECT_DOUBLE_EQ(box.right, im["crop_ltrb"][2].get<double>()) << what;
      EXPECT_DOUBLE_EQ(box.bottom, im["crop_ltrb"][3].get<double>()) << what;
    }
    m.sort();
    std::vector<BucketReso> want_used;
    for (const auto& b : c["used"]) want_used.push_back(reso(b));
    EXPECT_EQ(m.resos(), want_used) << name;
  }
}

TEST(Buckets, CropOffsetsCentreOrDrawInTheTrim) {
  // Centre: floor(trim / 2) on each axis that is larger than the bucket.
  const CropOffset c = bucket_crop_offset({101, 64}, {64, 64}, false, 0);
  EXPECT_EQ(c.x, 18);  // (101 - 64) // 2
  EXPECT_EQ(c.y, 0);
  // Random: within [0, trim], both ends reachable, the same for the same seed.
  std::set<int64_t> seen;
  for (uint64_t seed = 0; seed < 400; ++seed) {
    const CropOffset r = bucket_crop_offset({67, 64}, {64, 64}, true, seed);
    EXPECT_GE(r.x, 0);
    EXPECT_LE(r.x, 3);
    EXPECT_EQ(r.y, 0);
    seen.insert(r.x);
    EXPECT_EQ(r.x, bucket_crop_offset({67, 64}, {64, 64}, true, seed).x);
  }
  EXPECT_EQ(seen, (std::set<int64_t>{0, 1, 2, 3}));
  EXPECT_THROW(bucket_crop_offset({60, 64}, {64, 64}, false, 0), Error);
}

TEST(Buckets, SettingsAreAdjustedAndCheckedAsKohyaDoes) {
  BucketSettings s;
  s.resolution = {512, 512};
  s.enable_bucket = true;
  s.min_bucket_reso = 300;   // -> 256
  s.max_bucket_reso = 1000;  // -> 1024
  std::vector<std::string> notes;
  const BucketSettings a = adjust_bucket_settings(s, "d.toml: datasets[0]", &notes);
  EXPECT_EQ(a.min_bucket_reso, 256);
  EXPECT_EQ(a.max_bucket_reso, 1024);
  ASSERT_EQ(notes.size(), 2u);
  EXPECT_NE(notes[0].find("min_bucket_reso 300"), std::string::npos) << notes[0];
  s.min_bucket_reso = 576;
  EXPECT_THROW_WITH(adjust_bucket_settings(s, "d.toml: datasets[0]", nullptr), "d.toml: datasets[0]: min_bucket_reso");
  s.min_bucket_reso = 256;
  s.max_bucket_reso = 448;
  EXPECT_THROW_WITH(adjust_bucket_settings(s, "x", nullptr), "max_bucket_reso = 448");
  // A resolution under bucket_reso_steps has no bucket: named with the key to change.
  BucketSettings small;
  small.resolution = {32, 32};
  small.enable_bucket = true;
  small.min_bucket_reso = 32;
  small.max_bucket_reso = 1024;
  EXPECT_THROW_WITH(adjust_bucket_settings(small, "run.toml", nullptr), "set bucket_reso_steps to at most 32");
  // A min_bucket_reso under the steps rounds up to one step, never to 0.
  small.resolution = {128, 128};
  EXPECT_EQ(adjust_bucket_settings(small, "run.toml", nullptr).min_bucket_reso, 64);
  // no_upscale: an image with a side under the steps has no bucket.
  BucketManager m(true, {512, 512}, 256, 1024, 64);
  EXPECT_THROW_WITH(m.select_bucket(40, 300), "under bucket_reso_steps");
}
