// In-memory image/caption datasets and the batch sampler. See dataset.h.
#include "shoestring/data/dataset.h"

#include <algorithm>
#include <filesystem>
#include <random>
#include <set>

#include <ATen/Parallel.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/utf8.h"
#include "shoestring/data/image.h"
#include "shoestring/io/atomic_file.h"

namespace shoestring {
namespace fs = std::filesystem;

namespace {

std::string lowercase(std::string s) {
  for (char& c : s) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return s;
}

std::string trim(std::string_view s) {
  const char* ws = " \t\r\n\f\v";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return "";
  const size_t e = s.find_last_not_of(ws);
  return std::string(s.substr(b, e - b + 1));
}

/// CLDR names of the Fitzpatrick skin-tone modifiers U+1F3FB..U+1F3FF.
std::string skin_tone_name(const std::string& code) {
  const std::string c = lowercase(code);
  if (c == "1f3fb") return "light skin tone";
  if (c == "1f3fc") return "medium-light skin tone";
  if (c == "1f3fd") return "medium skin tone";
  if (c == "1f3fe") return "medium-dark skin tone";
  if (c == "1f3ff") return "dark skin tone";
  return c;
}

/// "1F3FB" -> "light skin tone"; "1F3FB-1F3FF" -> "light skin tone, dark skin
/// tone"; "1F3FC-1F3FC" -> "medium-light skin tone".
std::string skin_tones_text(const std::string& key) {
  std::vector<std::string> tones;
  size_t start = 0;
  while (start <= key.size()) {
    const size_t dash = key.find('-', start);
    const std::string part = key.substr(start, dash == std::string::npos ? std::string::npos : dash - start);
    std::string name = skin_tone_name(part);
    if (!part.empty() && std::find(tones.begin(), tones.end(), name) == tones.end()) {
      tones.push_back(std::move(name));
    }
    if (dash == std::string::npos) break;
    start = dash + 1;
  }
  return fmt::format("{}", fmt::join(tones, ", "));
}

const nlohmann::json& require(const nlohmann::json& entry, const char* key, nlohmann::json::value_t type,
                              const std::string& file, size_t i) {
  const auto it = entry.find(key);
  const bool ok = it != entry.end() &&
                  (it->type() == type || (type == nlohmann::json::value_t::number_integer && it->is_number_integer()));
  if (!ok) {
    nlohmann::json expected(type);
    fail("{}: entry {}: key '{}' must be a {}", file, i, key, expected.type_name());
  }
  return *it;
}

bool is_image_extension(const std::string& ext) {
  return ext == ".png" || ext == ".jpg" || ext == ".jpeg" || ext == ".bmp" || ext == ".gif" || ext == ".tga";
}

/// Lists the files under a dataset folder, following symlinks but visiting
/// each folder once by its canonical path (see load_folder in dataset.h).
class FolderWalk {
 public:
  explicit FolderWalk(const std::string& root) : root_(root) {}

  /// Lists `dir` (canonical path `canonical`) and, depth first in name order,
  /// the folders below it. Throws shoestring::Error if a folder cannot be listed.
  void walk(const fs::path& dir, const fs::path& canonical) {
    chain_.push_back(canonical);
    first_seen_.emplace(canonical, dir);
    std::error_code ec;
    std::vector<fs::directory_entry> entries;
    fs::directory_iterator it(dir, ec);
    if (ec) fail("dataset folder {}: cannot list {}: {}", root_, dir.string(), ec.message());
    for (; it != fs::directory_iterator(); it.increment(ec)) {
      if (ec) fail("dataset folder {}: cannot list {}: {}", root_, dir.string(), ec.message());
      entries.push_back(*it);
    }
    std::sort(entries.begin(), entries.end(),
              [](const fs::directory_entry& a, const fs::directory_entry& b) { return a.path() < b.path(); });
    for (const fs::directory_entry& entry : entries) {
      const std::string fname = entry.path().filename().string();
      if (!fname.empty() && fname[0] == '.') continue;
      if (entry.is_directory(ec)) {  // follows symlinks
        const fs::path target = fs::canonical(entry.path(), ec);
        if (ec) fail("dataset folder {}: cannot resolve {}: {}", root_, entry.path().string(), ec.message());
        const auto first = first_seen_.find(target);
        if (std::find(chain_.begin(), chain_.end(), target) != chain_.end()) {
          warn(entry.path(), fmt::format("{} -> {} is a symlink loop (it leads back to {}, a folder above it); "
                                         "not followed",
                                         entry.path().string(), target.string(), first->second.string()));
        } else if (first != first_seen_.end()) {
          warn(entry.path(), fmt::format("{} -> {} leads to a folder already listed as {}; not listed twice",
                                         entry.path().string(), target.string(), first->second.string()));
        } else {
          walk(entry.path(), target);
        }
      } else if (entry.is_regular_file(ec)) {
        files_.push_back(entry.path());
      }
    }
    chain_.pop_back();
  }

  /// The files found, in the order listed (sorted by path).
  std::vector<fs::path>& files() { return files_; }
  std::vector<DatasetWarning>& warnings() { return warnings_; }

  /// Records and logs a warning about `path`.
  void warn(const fs::path& path, std::string message) {
    spdlog::warn("dataset folder {}: {}", root_, message);
    warnings_.push_back({path.string(), std::move(message)});
  }

 private:
  std::string root_;
  std::vector<fs::path> chain_;              // canonical paths of the folders being listed, outermost first
  std::map<fs::path, fs::path> first_seen_;  // canonical folder -> the path it was listed at
  std::vector<fs::path> files_;
  std::vector<DatasetWarning> warnings_;
};

/// Logs one warning for the images of `paths` (at most 5 named).
void warn_captions(const std::string& source, const std::vector<std::string>& paths, const char* what) {
  if (paths.empty()) return;
  constexpr size_t kShown = 5;
  const std::vector<std::string> shown(paths.begin(),
                                       paths.begin() + static_cast<std::ptrdiff_t>(std::min(kShown, paths.size())));
  spdlog::warn("dataset {}: {} image{} {}; trained with the caption \"\": {}{}", source, paths.size(),
               paths.size() == 1 ? "" : "s", what, fmt::join(shown, ", "),
               paths.size() > kShown ? fmt::format(" and {} more", paths.size() - kShown) : std::string());
}

}  // namespace

ImageCaptionDataset ImageCaptionDataset::load_twemoji(const std::string& root, int resolution,
                                                      const std::vector<std::string>& categories) {
  const std::string json_path = (fs::path(root) / "emoji.json").string();
  nlohmann::json entries;
  try {
    entries = nlohmann::json::parse(read_file(json_path));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON: {}", json_path, e.what());
  }
  if (!entries.is_array()) fail("{}: expected a JSON array of emoji entries", json_path);
  const fs::path img_dir = fs::path(root) / "img" / "twitter" / "64";
  using vt = nlohmann::json::value_t;

  std::set<std::string> wanted, seen_categories;
  for (const std::string& c : categories) wanted.insert(lowercase(c));
  std::vector<Candidate> candidates;
  for (size_t i = 0; i < entries.size(); ++i) {
    const nlohmann::json& e = entries[i];
    if (!e.is_object()) fail("{}: entry {}: expected an object", json_path, i);
    if (!require(e, "has_img_twitter", vt::boolean, json_path, i).get<bool>()) continue;
    const std::string image = require(e, "image", vt::string, json_path, i).get<std::string>();
    const std::string category = require(e, "category", vt::string, json_path, i).get<std::string>();
    seen_categories.insert(category);
    if (!wanted.empty() && wanted.count(lowercase(category)) == 0) continue;
    const nlohmann::json& short_names = require(e, "short_names", vt::array, json_path, i);
    // A few entries of emoji-data have a null name; fall back to the short name.
    const auto name_it = e.find("name");
    std::string name;
    if (name_it != e.end() && name_it->is_string()) {
      name = name_it->get<std::string>();
    } else {
      name = require(e, "short_name", vt::string, json_path, i).get<std::string>();
    }

    auto caption_for = [&](const std::string& tones) {
      std::vector<std::string> parts{lowercase(name)};
      if (!tones.empty()) parts.push_back(tones);
      for (const auto& sn : short_names) {
        if (!sn.is_string()) fail("{}: entry {}: key 'short_names' must hold strings", json_path, i);
        std::string s = sn.get<std::string>();
        std::replace(s.begin(), s.end(), '_', ' ');
        if (std::find(parts.begin(), parts.end(), s) == parts.end()) parts.push_back(std::move(s));
      }
      parts.push_back(lowercase(category));
      return fmt::format("{}", fmt::join(parts, ", "));
    };
    auto add = [&](const std::string& file, const std::string& caption) {
      if (file.empty() || file.find('/') != std::string::npos || file.find('\\') != std::string::npos) {
        fail("{}: entry {}: image '{}' must be a plain file name", json_path, i, file);
      }
      candidates.push_back({(img_dir / file).string(), caption, false, ""});
    };

    add(image, caption_for(""));
    const auto var_it = e.find("skin_variations");
    if (var_it == e.end() || var_it->is_null()) continue;
    if (!var_it->is_object()) fail("{}: entry {}: key 'skin_variations' must be an object", json_path, i);
    for (const auto& [key, var] : var_it->items()) {
      if (!var.is_object()) {
        fail("{}: entry {}: skin_variations.{} must be an object", json_path, i, key);
      }
      const auto has = var.find("has_img_twitter");
      if (has != var.end() && has->is_boolean() && !has->get<bool>()) continue;
      const auto var_image = var.find("image");
      if (var_image == var.end() || !var_image->is_string()) {
        fail("{}: entry {}: skin_variations.{}.image must be a string", json_path, i, key);
      }
      add(var_image->get<std::string>(), caption_for(skin_tones_text(key)));
    }
  }
  std::set<std::string> seen_lowercase;
  for (const std::string& c : seen_categories) seen_lowercase.insert(lowercase(c));
  for (const std::string& c : categories) {
    if (seen_lowercase.count(lowercase(c)) == 0) {
      fail("{}: twemoji_categories: no emoji of category \"{}\"; the file's categories are \"{}\"", json_path, c,
           fmt::join(seen_categories, "\", \""));
    }
  }
  return decode_all(std::move(candidates), resolution, root);
}

ImageCaptionDataset ImageCaptionDataset::load_folder(const std::string& dir, int resolution) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) fail("dataset folder {}: not a directory", dir);
  const fs::path root_canonical = fs::canonical(dir, ec);
  if (ec) fail("dataset folder {}: cannot resolve: {}", dir, ec.message());
  FolderWalk walk(dir);
  walk.walk(fs::path(dir), root_canonical);
  std::vector<fs::path>& files = walk.files();
  std::sort(files.begin(), files.end());

  // An image reached through several paths with the same caption file loads
  // once: key (canonical image, canonical caption file or "").
  std::map<std::pair<fs::path, fs::path>, fs::path> loaded;
  std::vector<Candidate> candidates;
  for (const fs::path& file : files) {
    const std::string ext = lowercase(file.extension().string());
    if (ext == ".webp") {
      candidates.push_back({file.string(), "", false,
                            fmt::format("{}: WebP is not supported (stb_image cannot decode it); "
                                        "convert it to PNG",
                                        file.string())});
      continue;
    }
    if (!is_image_extension(ext)) continue;
    fs::path caption_path = file;
    caption_path.replace_extension(".txt");
    const bool has_caption = fs::is_regular_file(caption_path, ec);
    fs::path image_canonical = fs::canonical(file, ec);
    if (ec) image_canonical = file;
    fs::path caption_canonical = has_caption ? fs::canonical(caption_path, ec) : fs::path();
    if (ec) caption_canonical = caption_path;
    const auto [first, inserted] = loaded.emplace(std::make_pair(image_canonical, caption_canonical), file);
    if (!inserted) {
      walk.warn(file, fmt::format("{} is the same image and caption file as {} (through a symlink); loaded once",
                                  file.string(), first->second.string()));
      continue;
    }
    std::string caption;
    if (has_caption) {
      std::string text = read_file(caption_path.string());
      const size_t bad = utf8_error_offset(text);
      if (bad != std::string::npos) {
        fail("caption file {}: not valid UTF-8 at byte offset {} (byte 0x{:02X}); save it as UTF-8",
             caption_path.string(), bad, static_cast<unsigned char>(text[bad]));
      }
      std::string_view view(text);
      if (view.substr(0, 3) == "\xEF\xBB\xBF") view.remove_prefix(3);  // byte order mark
      caption = trim(view.substr(0, view.find('\n')));
    }
    Candidate c{file.string(), std::move(caption), !has_caption, ""};
    c.empty_caption = has_caption && c.caption.empty();
    candidates.push_back(std::move(c));
  }
  ImageCaptionDataset ds = decode_all(std::move(candidates), resolution, dir);
  ds.warnings_ = std::move(walk.warnings());
  return ds;
}

ImageCaptionDataset ImageCaptionDataset::load(const std::string& path, int resolution,
                                              const std::vector<std::string>& twemoji_categories) {
  std::error_code ec;
  const fs::path p(path);
  if (!fs::exists(p, ec)) {
    fail(
        "dataset path {} does not exist. For the emoji example, run scripts/fetch_twemoji.sh: it "
        "downloads emoji-datasource-twitter@16.0.0 and prints the dataset path to use "
        "(by default ~/.cache/shoestring/emoji-datasource-twitter-16.0.0)",
        path);
  }
  if (fs::is_regular_file(p, ec) && p.filename() == "emoji.json") {
    return load_twemoji(p.parent_path().string(), resolution, twemoji_categories);
  }
  if (!fs::is_directory(p, ec)) {
    fail(
        "dataset path {}: expected a folder (Twemoji layout with emoji.json, or images with "
        ".txt captions)",
        path);
  }
  if (fs::is_regular_file(p / "emoji.json", ec)) return load_twemoji(path, resolution, twemoji_categories);
  if (!twemoji_categories.empty()) {
    fail(
        "dataset folder {}: twemoji_categories applies to the Twemoji layout (a folder with emoji.json) only; "
        "this folder has none",
        path);
  }
  return load_folder(path, resolution);
}

ImageCaptionDataset ImageCaptionDataset::decode_all(std::vector<Candidate> candidates, int resolution,
                                                    const std::string& source) {
  if (resolution < 1) fail("dataset {}: resolution must be >= 1, got {}", source, resolution);
  const int64_t n = static_cast<int64_t>(candidates.size());
  auto all = at::empty({n, 3, resolution, resolution}, at::kByte);
  std::vector<std::string> reasons(static_cast<size_t>(n));
  const int64_t image_bytes = 3LL * resolution * resolution;
  uint8_t* base = all.data_ptr<uint8_t>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      Candidate& c = candidates[static_cast<size_t>(i)];
      if (!c.skip_reason.empty()) {
        reasons[static_cast<size_t>(i)] = c.skip_reason;
        continue;
      }
      try {
        const at::Tensor img = load_image(c.path, resolution);
        std::memcpy(base + i * image_bytes, img.data_ptr<uint8_t>(), static_cast<size_t>(image_bytes));
      } catch (const std::exception& e) {
        reasons[static_cast<size_t>(i)] = e.what();
      }
    }
  });

  ImageCaptionDataset ds;
  ds.resolution_ = resolution;
  std::vector<int64_t> keep;
  std::vector<std::string> missing, empty;
  for (int64_t i = 0; i < n; ++i) {
    Candidate& c = candidates[static_cast<size_t>(i)];
    if (reasons[static_cast<size_t>(i)].empty()) {
      keep.push_back(i);
      if (c.missing_caption) missing.push_back(c.path);
      if (c.empty_caption) empty.push_back(c.path);
      ds.captions_.push_back(std::move(c.caption));
      ds.paths_.push_back(std::move(c.path));
    } else {
      ds.skipped_.push_back({std::move(c.path), std::move(reasons[static_cast<size_t>(i)])});
    }
  }
  if (keep.empty()) {
    fail("dataset {}: no image could be loaded ({} candidates, {} skipped{})", source, n, ds.skipped_.size(),
         ds.skipped_.empty() ? std::string() : "; first: " + ds.skipped_.front().reason);
  }
  ds.images_ = static_cast<int64_t>(keep.size()) == n ? all : all.index_select(0, at::tensor(keep, at::kLong));
  ds.caption_stats_.missing = static_cast<int64_t>(missing.size());
  ds.caption_stats_.empty = static_cast<int64_t>(empty.size());
  warn_captions(source, missing, "without a caption file (.txt beside it)");
  warn_captions(source, empty, "with an empty caption file");
  return ds;
}

at::Tensor ImageCaptionDataset::batch_images(const std::vector<int64_t>& idx) const {
  for (const int64_t i : idx) {
    if (i < 0 || i >= size()) fail("dataset: image index {} is outside [0, {})", i, size());
  }
  auto index = at::tensor(idx, at::kLong);
  return images_.index_select(0, index).to(at::kFloat).div_(127.5).sub_(1.0);
}

std::vector<std::string> ImageCaptionDataset::batch_captions(const std::vector<int64_t>& idx) const {
  std::vector<std::string> out;
  out.reserve(idx.size());
  for (const int64_t i : idx) {
    if (i < 0 || i >= size()) fail("dataset: caption index {} is outside [0, {})", i, size());
    out.push_back(captions_[static_cast<size_t>(i)]);
  }
  return out;
}

// ---------------------------------------------------------------------------

BatchSampler::BatchSampler(int64_t dataset_size, int64_t batch_size, uint64_t seed)
    : dataset_size_(dataset_size), batch_size_(batch_size), seed_(seed) {
  if (batch_size < 1) fail("batch sampler: batch_size must be >= 1, got {}", batch_size);
  if (dataset_size < batch_size) {
    fail(
        "batch sampler: the dataset has {} images, fewer than batch_size {} (batches never "
        "span epochs, so no full batch could be formed)",
        dataset_size, batch_size);
  }
}

std::vector<int64_t> BatchSampler::epoch_permutation(int64_t epoch) const {
  std::vector<int64_t> perm(static_cast<size_t>(dataset_size_));
  for (int64_t i = 0; i < dataset_size_; ++i) perm[static_cast<size_t>(i)] = i;
  const auto e = static_cast<uint64_t>(epoch);
  std::seed_seq seq{static_cast<uint32_t>(seed_), static_cast<uint32_t>(seed_ >> 32), static_cast<uint32_t>(e),
                    static_cast<uint32_t>(e >> 32)};
  std::mt19937_64 gen(seq);
  // Uniform integer in [0, bound] by rejection: draws in the incomplete top
  // block of 2^64 are redrawn, so each value is equally likely.
  auto uniform = [&gen](uint64_t bound) -> uint64_t {
    const uint64_t range = bound + 1;  // bound < 2^63 here, no overflow
    const uint64_t limit = std::numeric_limits<uint64_t>::max() - std::numeric_limits<uint64_t>::max() % range;
    uint64_t r;
    do {
      r = gen();
    } while (r >= limit);
    return r % range;
  };
  for (int64_t i = dataset_size_ - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(uniform(static_cast<uint64_t>(i)));
    std::swap(perm[static_cast<size_t>(i)], perm[static_cast<size_t>(j)]);
  }
  return perm;
}

std::vector<int64_t> BatchSampler::next() {
  if (cached_epoch_ != position_.epoch) {
    permutation_ = epoch_permutation(position_.epoch);
    cached_epoch_ = position_.epoch;
  }
  const auto begin = permutation_.begin() + position_.index * batch_size_;
  std::vector<int64_t> batch(begin, begin + batch_size_);
  if (++position_.index == batches_per_epoch()) {
    position_.index = 0;
    ++position_.epoch;
  }
  return batch;
}

void BatchSampler::set_position(Position p) {
  if (p.epoch < 0 || p.index < 0 || p.index >= batches_per_epoch()) {
    fail(
        "batch sampler: position (epoch {}, batch {}) is invalid; expected epoch >= 0 and batch "
        "in [0, {})",
        p.epoch, p.index, batches_per_epoch());
  }
  position_ = p;
}

}  // namespace shoestring
