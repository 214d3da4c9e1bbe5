// Aspect-ratio buckets (kohya sd-scripts' rules). See buckets.h.
#include "shoestring/data/buckets.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <set>

#include <fmt/format.h>

#include "shoestring/core/error.h"
#include "shoestring/data/random_draw.h"

namespace shoestring {

std::string to_string(BucketReso r) { return fmt::format("{}x{}", r.width, r.height); }

std::vector<BucketReso> make_bucket_resolutions(BucketReso max_reso, int64_t min_size, int64_t max_size,
                                                int64_t divisible) {
  if (max_reso.width < 1 || max_reso.height < 1 || min_size < 1 || max_size < 1 || divisible < 1) {
    fail("bucket resolutions: sizes must be >= 1 (max {}, min {}, max side {}, steps {})", to_string(max_reso),
         min_size, max_size, divisible);
  }
  const int64_t max_area = max_reso.width * max_reso.height;
  std::set<BucketReso> resos;
  // Python: int(math.sqrt(max_area) // divisible) * divisible.
  const int64_t side =
      static_cast<int64_t>(std::floor(std::sqrt(static_cast<double>(max_area)) / static_cast<double>(divisible))) *
      divisible;
  resos.insert({side, side});
  for (int64_t w = min_size; w <= max_size; w += divisible) {
    const int64_t h = std::min(max_size, ((max_area / w) / divisible) * divisible);
    if (h >= min_size) {
      resos.insert({w, h});
      resos.insert({h, w});
    }
  }
  return {resos.begin(), resos.end()};
}

BucketSettings adjust_bucket_settings(BucketSettings s, const std::string& where, std::vector<std::string>* notes) {
  if (!s.enable_bucket) return s;
  if (s.bucket_reso_steps < 1) fail("{}: bucket_reso_steps must be >= 1, got {}", where, s.bucket_reso_steps);
  const int64_t steps = s.bucket_reso_steps;
  const int64_t shorter = std::min(s.resolution.width, s.resolution.height);
  if (shorter < steps) {
    fail(
        "{}: resolution {} is smaller than bucket_reso_steps = {}, and every bucket side is a multiple of it: set "
        "bucket_reso_steps to at most {} (and min_bucket_reso to a multiple of it)",
        where, to_string(s.resolution), steps, shorter);
  }
  if (s.min_bucket_reso % steps != 0) {
    // Rounded down, as kohya does, but never to 0.
    const int64_t adjusted = std::max(steps, s.min_bucket_reso - s.min_bucket_reso % steps);
    if (notes) {
      notes->push_back(fmt::format("{}: min_bucket_reso {} is not a multiple of bucket_reso_steps {}; using {}", where,
                                   s.min_bucket_reso, steps, adjusted));
    }
    s.min_bucket_reso = adjusted;
  }
  if (s.max_bucket_reso % steps != 0) {
    const int64_t adjusted = s.max_bucket_reso + steps - s.max_bucket_reso % steps;
    if (notes) {
      notes->push_back(fmt::format("{}: max_bucket_reso {} is not a multiple of bucket_reso_steps {}; using {}", where,
                                   s.max_bucket_reso, steps, adjusted));
    }
    s.max_bucket_reso = adjusted;
  }
  const int64_t lo = std::min(s.resolution.width, s.resolution.height);
  const int64_t hi = std::max(s.resolution.width, s.resolution.height);
  if (lo < s.min_bucket_reso) {
    fail(
        "{}: min_bucket_reso = {} is larger than the resolution's shorter side {} (resolution {}); lower "
        "min_bucket_reso or raise resolution (kohya refuses it too)",
        where, s.min_bucket_reso, lo, to_string(s.resolution));
  }
  if (hi > s.max_bucket_reso) {
    fail(
        "{}: max_bucket_reso = {} is smaller than the resolution's longer side {} (resolution {}); raise "
        "max_bucket_reso or lower resolution (kohya refuses it too)",
        where, s.max_bucket_reso, hi, to_string(s.resolution));
  }
  return s;
}

BucketManager::BucketManager(bool no_upscale, BucketReso max_reso, std::optional<int64_t> min_size,
                             std::optional<int64_t> max_size, std::optional<int64_t> reso_steps)
    : no_upscale_(no_upscale),
      max_reso_(max_reso),
      max_area_(max_reso.width * max_reso.height),
      min_size_(min_size),
      max_size_(max_size),
      reso_steps_(reso_steps) {
  if (max_reso.width < 1 || max_reso.height < 1) fail("buckets: resolution {} must be >= 1", to_string(max_reso));
  if (max_size) {
    if (*max_size < max_reso.width || *max_size < max_reso.height) {
      fail("buckets: max_bucket_reso {} must be at least the resolution's sides ({})", *max_size, to_string(max_reso));
    }
    if (min_size && *max_size < *min_size) {
      fail("buckets: max_bucket_reso {} must be at least min_bucket_reso {}", *max_size, *min_size);
    }
  }
  if (reso_steps && *reso_steps < 1) fail("buckets: bucket_reso_steps must be >= 1, got {}", *reso_steps);
}

BucketManager BucketManager::for_settings(const BucketSettings& s) {
  if (!s.enable_bucket) {
    BucketManager m(false, s.resolution, std::nullopt, std::nullopt, std::nullopt);
    m.set_predefined_resos({s.resolution});
    return m;
  }
  BucketManager m(s.bucket_no_upscale, s.resolution, s.min_bucket_reso, s.max_bucket_reso, s.bucket_reso_steps);
  if (!s.bucket_no_upscale) m.make_buckets();
  return m;
}

void BucketManager::make_buckets() {
  if (!min_size_ || !max_size_ || !reso_steps_) fail("buckets: make_buckets needs min, max and steps");
  set_predefined_resos(make_bucket_resolutions(max_reso_, *min_size_, *max_size_, *reso_steps_));
}

void BucketManager::set_predefined_resos(std::vector<BucketReso> resos) {
  predefined_ = std::move(resos);
  predefined_ar_.clear();
  for (const BucketReso& r : predefined_) {
    predefined_ar_.push_back(static_cast<double>(r.width) / static_cast<double>(r.height));
  }
}

int64_t BucketManager::round_to_steps(double x) const {
  const int64_t steps = reso_steps_.value_or(1);
  const auto v = static_cast<int64_t>(x + 0.5);
  return v - v % steps;
}

int64_t BucketManager::index_of(BucketReso reso) const {
  const auto it = std::find(resos_.begin(), resos_.end(), reso);
  return it == resos_.end() ? -1 : static_cast<int64_t>(it - resos_.begin());
}

void BucketManager::sort() { std::sort(resos_.begin(), resos_.end()); }

BucketChoice BucketManager::select_bucket(int64_t width, int64_t height) {
  if (width < 1 || height < 1) fail("buckets: image size {}x{} must be >= 1", width, height);
  const double w = static_cast<double>(width), h = static_cast<double>(height);
  const double aspect = w / h;
  BucketChoice out;
  if (!no_upscale_) {
    if (predefined_.empty()) fail("buckets: no predefined buckets");
    BucketReso reso{width, height};
    if (std::find(predefined_.begin(), predefined_.end(), reso) == predefined_.end()) {
      size_t best = 0;
      double best_err = std::numeric_limits<double>::infinity();
      for (size_t i = 0; i < predefined_ar_.size(); ++i) {
        const double err = std::abs(predefined_ar_[i] - aspect);
        if (err < best_err) {  // strict: the first minimum, as numpy's argmin
          best_err = err;
          best = i;
        }
      }
      reso = predefined_[best];
    }
    const double bucket_ar = static_cast<double>(reso.width) / static_cast<double>(reso.height);
    // Wider than the bucket: match the height; else the width.
    const double scale =
        aspect > bucket_ar ? static_cast<double>(reso.height) / h : static_cast<double>(reso.width) / w;
    out.bucket = reso;
    out.resized = {static_cast<int64_t>(w * scale + 0.5), static_cast<int64_t>(h * scale + 0.5)};
  } else {
    const int64_t steps = reso_steps_.value_or(1);
    if (width * height > max_area_) {
      // Scale to max_area keeping the aspect ratio; round the width or the
      // height to steps, whichever keeps the ratio closer.
      const double rw = std::sqrt(static_cast<double>(max_area_) * aspect);
      const double rh = static_cast<double>(max_area_) / rw;
      const int64_t bw = round_to_steps(rw);
      const int64_t bh_in_w = round_to_steps(static_cast<double>(bw) / aspect);
      const int64_t bh = round_to_steps(rh);
      const int64_t bw_in_h = round_to_steps(static_cast<double>(bh) * aspect);
      if (bh_in_w == 0 || bh == 0) {
        fail(
            "buckets: an image of {}x{} is too narrow for bucket_reso_steps {} with bucket_no_upscale (kohya fails "
            "on it too); crop it or drop it",
            width, height, steps);
      }
      const double ar_w = static_cast<double>(bw) / static_cast<double>(bh_in_w);
      const double ar_h = static_cast<double>(bw_in_h) / static_cast<double>(bh);
      if (std::abs(ar_w - aspect) < std::abs(ar_h - aspect)) {
        out.resized = {bw, static_cast<int64_t>(static_cast<double>(bw) / aspect + 0.5)};
      } else {
        out.resized = {static_cast<int64_t>(static_cast<double>(bh) * aspect + 0.5), bh};
      }
    } else {
      out.resized = {width, height};
    }
    out.bucket = {out.resized.width - out.resized.width % steps, out.resized.height - out.resized.height % steps};
    if (out.bucket.width < 1 || out.bucket.height < 1) {
      fail(
          "buckets: an image of {}x{} has a side under bucket_reso_steps {}, so bucket_no_upscale leaves no bucket "
          "for it; upscale it or drop it",
          width, height, steps);
    }
  }
  if (index_of(out.bucket) < 0) resos_.push_back(out.bucket);
  out.ar_error = static_cast<double>(out.bucket.width) / static_cast<double>(out.bucket.height) - aspect;
  return out;
}

CropLtrb crop_ltrb(BucketReso bucket, BucketReso image) {
  const double bucket_ar = static_cast<double>(bucket.width) / static_cast<double>(bucket.height);
  const double image_ar = static_cast<double>(image.width) / static_cast<double>(image.height);
  double rw, rh;
  if (bucket_ar > image_ar) {
    rw = static_cast<double>(bucket.height) * image_ar;
    rh = static_cast<double>(bucket.height);
  } else {
    rw = static_cast<double>(bucket.width);
    rh = static_cast<double>(bucket.width) / image_ar;
  }
  CropLtrb c;
  c.left = std::floor((static_cast<double>(bucket.width) - rw) / 2);
  c.top = std::floor((static_cast<double>(bucket.height) - rh) / 2);
  c.right = c.left + rw;
  c.bottom = c.top + rh;
  return c;
}

CropOffset bucket_crop_offset(BucketReso resized, BucketReso bucket, bool random_crop, uint64_t seed) {
  if (resized.width < bucket.width || resized.height < bucket.height) {
    fail("buckets: resized image {} does not cover its bucket {}", to_string(resized), to_string(bucket));
  }
  std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
  std::mt19937_64 gen(seq);
  CropOffset o;
  const int64_t tx = resized.width - bucket.width, ty = resized.height - bucket.height;
  if (tx > 0) o.x = random_crop ? static_cast<int64_t>(uniform_up_to(gen, static_cast<uint64_t>(tx))) : tx / 2;
  if (ty > 0) o.y = random_crop ? static_cast<int64_t>(uniform_up_to(gen, static_cast<uint64_t>(ty))) : ty / 2;
  return o;
}

}  // namespace shoestring
