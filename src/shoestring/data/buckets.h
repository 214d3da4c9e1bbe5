// Aspect-ratio buckets as kohya's sd-scripts make them: the bucket list
// (library/model_util.py make_bucket_resolutions), the choice of a bucket for
// an image and the size it is resized to (library/train_util.py BucketManager:
// make_buckets, add_if_new_reso, round_to_steps, select_bucket, and its
// bucket_no_upscale path), the crop into the bucket (trim_and_resize_if_required)
// and the crop box SDXL is conditioned on (BucketManager.get_crop_ltrb).
// Numbers follow kohya's Python exactly (float64 ratios, int() truncation,
// numpy argmin's first minimum), so a user moving from kohya gets the same
// buckets and crops; tests/data/test_buckets.cpp checks them against
// scripts/gen_bucket_reference.py.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace shoestring {

/// A size in pixels, width first (kohya's (width, height) tuples). Ordered as
/// Python orders tuples: by width, then height.
struct BucketReso {
  int64_t width = 0;
  int64_t height = 0;
  bool operator==(const BucketReso& o) const { return width == o.width && height == o.height; }
  bool operator!=(const BucketReso& o) const { return !(*this == o); }
  bool operator<(const BucketReso& o) const { return width != o.width ? width < o.width : height < o.height; }
};

/// The predefined buckets of kohya's make_bucket_resolutions
/// (library/model_util.py): with max_area = max_reso.width x max_reso.height,
/// the square of side floor(sqrt(max_area) / divisible) x divisible, and for
/// each width w = min_size, min_size + divisible, ... <= max_size the pair
/// (w, h) and (h, w) with h = min(max_size, floor(floor(max_area / w) /
/// divisible) x divisible), when h >= min_size. Returned sorted, without
/// duplicates. Sizes in pixels. Throws shoestring::Error if a size is < 1.
std::vector<BucketReso> make_bucket_resolutions(BucketReso max_reso, int64_t min_size, int64_t max_size,
                                                int64_t divisible);

/// The bucket options of one dataset, kohya's names and defaults
/// (library/config_util.py DreamBoothDatasetParams).
struct BucketSettings {
  BucketReso resolution;  ///< the dataset's resolution (width, height): max_reso of the buckets
  bool enable_bucket = false;
  int64_t min_bucket_reso = 256;
  int64_t max_bucket_reso = 1024;
  int64_t bucket_reso_steps = 64;
  bool bucket_no_upscale = false;
};

/// kohya's BaseDataset.adjust_min_max_bucket_reso_by_steps
/// (library/train_util.py): min_bucket_reso rounded down and max_bucket_reso
/// rounded up to multiples of bucket_reso_steps (each change appended to
/// `notes` as kohya logs it as a warning), then min(resolution) >=
/// min_bucket_reso and max(resolution) <= max_bucket_reso are required.
/// `where` names the settings' source in messages. Settings with
/// enable_bucket false are returned unchanged. Throws shoestring::Error
/// naming `where` and the key when a requirement fails or bucket_reso_steps < 1.
BucketSettings adjust_bucket_settings(BucketSettings s, const std::string& where, std::vector<std::string>* notes);

/// What select_bucket decided for an image.
struct BucketChoice {
  BucketReso bucket;    ///< the bucket (training size of the image, pixels)
  BucketReso resized;   ///< size the image is resized to before the crop (covers the bucket)
  double ar_error = 0;  ///< bucket width / height minus the image's width / height
};

/// kohya's BucketManager (library/train_util.py): predefined buckets
/// (make_buckets, or set_predefined_resos for a single fixed size) or, with
/// no_upscale, buckets made from each image's own size; the buckets in use in
/// the order they were first chosen (add_if_new_reso) until sort().
class BucketManager {
 public:
  /// As kohya's constructor: max_size (when set) must be >= both sides of
  /// max_reso and >= min_size. Throws shoestring::Error otherwise, or if
  /// reso_steps is set and < 1.
  BucketManager(bool no_upscale, BucketReso max_reso, std::optional<int64_t> min_size, std::optional<int64_t> max_size,
                std::optional<int64_t> reso_steps);

  /// The manager kohya's BaseDataset.make_buckets sets up for `s` (already
  /// adjusted by adjust_bucket_settings): with enable_bucket, the
  /// make_bucket_resolutions buckets (none predefined with
  /// bucket_no_upscale); without, the one bucket s.resolution.
  static BucketManager for_settings(const BucketSettings& s);

  /// Predefines make_bucket_resolutions(max_reso, min_size, max_size, reso_steps).
  void make_buckets();
  /// Predefines `resos` (kohya's set_predefined_resos).
  void set_predefined_resos(std::vector<BucketReso> resos);
  const std::vector<BucketReso>& predefined_resos() const { return predefined_; }

  /// kohya's select_bucket for an image of `width` x `height` pixels.
  /// Upscaling allowed: the image's own size when it is a predefined bucket,
  /// else the predefined bucket of least |aspect-ratio error| (the first of
  /// equal ones); resized by the scale that makes the image cover it (height
  /// matched when the image is wider than the bucket, else width), each side
  /// rounded as int(x + 0.5). no_upscale: an image of more than max_area
  /// pixels is scaled to max_area keeping its aspect ratio, the width or the
  /// height rounded to reso_steps (whichever keeps the ratio closer); a
  /// smaller one keeps its size; the bucket is the resized size rounded down
  /// to multiples of reso_steps. The bucket is added to resos() when new.
  /// Throws shoestring::Error for a size < 1, and (no_upscale) when the image
  /// is too narrow for a bucket (a side under reso_steps), where kohya fails.
  BucketChoice select_bucket(int64_t width, int64_t height);

  /// kohya's round_to_steps: int(x + 0.5) rounded down to a multiple of reso_steps.
  int64_t round_to_steps(double x) const;

  /// The buckets chosen so far: in the order first chosen, or sorted after sort().
  const std::vector<BucketReso>& resos() const { return resos_; }
  /// Sorts resos() (kohya sorts them once every image is assigned).
  void sort();
  /// Index of `reso` in resos(), or -1.
  int64_t index_of(BucketReso reso) const;

 private:
  bool no_upscale_;
  BucketReso max_reso_;
  int64_t max_area_;
  std::optional<int64_t> min_size_, max_size_, reso_steps_;
  std::vector<BucketReso> predefined_;
  std::vector<double> predefined_ar_;
  std::vector<BucketReso> resos_;
};

/// kohya's BucketManager.get_crop_ltrb: the box (left, top, right, bottom) in
/// bucket pixels that the image of `image` size takes when fitted inside
/// `bucket` (height matched when the bucket is wider than the image, else
/// width), left / top = floor of half the margin; Stability's crop
/// conditioning of SDXL. Floats, as kohya's (int() is applied by the caller).
struct CropLtrb {
  double left = 0, top = 0, right = 0, bottom = 0;
};
CropLtrb crop_ltrb(BucketReso bucket, BucketReso image);

/// Top-left corner, in pixels of the resized image, of the bucket-sized crop
/// (kohya's trim_and_resize_if_required): on each axis where the resized
/// image is larger than the bucket, trim = resized - bucket and the offset is
/// trim / 2 (floor), or with `random_crop` uniform in [0, trim] (both ends
/// included, as Python's random.randint) from std::mt19937_64 seeded with
/// `seed` (x first, then y; rejection sampling, the same on every platform).
/// Throws shoestring::Error if the resized image is smaller than the bucket.
struct CropOffset {
  int64_t x = 0, y = 0;
};
CropOffset bucket_crop_offset(BucketReso resized, BucketReso bucket, bool random_crop, uint64_t seed);

/// "512x768" (width x height).
std::string to_string(BucketReso r);

}  // namespace shoestring
