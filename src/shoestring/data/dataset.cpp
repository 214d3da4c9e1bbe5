// In-memory image/caption datasets and the batch sampler. See dataset.h.
#include "shoestring/data/dataset.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <numeric>
#include <random>
#include <set>
#include <sstream>

#include <ATen/Parallel.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/text.h"
#include "shoestring/core/utf8.h"
#include "shoestring/data/image.h"
#include "shoestring/data/random_draw.h"
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

/// The caption of a caption file: its first line, trimmed, a UTF-8 byte
/// order mark dropped. Throws shoestring::Error naming the file and the byte
/// offset when it is not valid UTF-8.
std::string read_caption_file(const std::string& path) {
  std::string text = read_file(path);
  const size_t bad = utf8_error_offset(text);
  if (bad != std::string::npos) {
    fail("caption file {}: not valid UTF-8 at byte offset {} (byte 0x{:02X}); save it as UTF-8", path, bad,
         static_cast<unsigned char>(text[bad]));
  }
  std::string_view view(text);
  if (view.substr(0, 3) == "\xEF\xBB\xBF") view.remove_prefix(3);  // byte order mark
  return trim(view.substr(0, view.find('\n')));
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

/// Keeps the DatasetSelection's subset of `items` (all of them without one), in their order.
template <class T>
void keep_selected(std::vector<T>& items, const DatasetSelection& selection) {
  if (selection.max_images <= 0 || selection.max_images >= static_cast<int64_t>(items.size())) return;
  std::vector<T> kept;
  for (const int64_t i : seeded_subset(static_cast<int64_t>(items.size()), selection.max_images, selection.seed))
    kept.push_back(std::move(items[static_cast<size_t>(i)]));
  items = std::move(kept);
}

}  // namespace

std::vector<int64_t> seeded_subset(int64_t n, int64_t count, uint64_t seed) {
  if (n < 0 || count < 0) fail("seeded subset: n ({}) and count ({}) must be >= 0", n, count);
  count = std::min(count, n);
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  std::seed_seq seq{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
  std::mt19937_64 gen(seq);
  for (int64_t i = 0; i < count; ++i) {
    const int64_t j = i + static_cast<int64_t>(uniform_up_to(gen, static_cast<uint64_t>(n - 1 - i)));
    std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(j)]);
  }
  order.resize(static_cast<size_t>(count));
  std::sort(order.begin(), order.end());
  return order;
}

ImageCaptionDataset ImageCaptionDataset::load_twemoji(const std::string& root, int resolution,
                                                      const std::vector<std::string>& categories,
                                                      const DatasetSelection& selection) {
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
  return decode_all(std::move(candidates), resolution, root, selection);
}

ImageCaptionDataset ImageCaptionDataset::load_folder(const std::string& dir, int resolution,
                                                     const DatasetSelection& selection) {
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
    const std::string caption = has_caption ? read_caption_file(caption_path.string()) : std::string();
    Candidate c{file.string(), std::move(caption), !has_caption, ""};
    c.empty_caption = has_caption && c.caption.empty();
    candidates.push_back(std::move(c));
  }
  ImageCaptionDataset ds = decode_all(std::move(candidates), resolution, dir, selection);
  ds.warnings_ = std::move(walk.warnings());
  return ds;
}

ImageCaptionDataset ImageCaptionDataset::load(const std::string& path, int resolution,
                                              const std::vector<std::string>& twemoji_categories,
                                              const DatasetSelection& selection) {
  std::error_code ec;
  const fs::path p(path);
  if (!fs::exists(p, ec)) {
    fail(
        "dataset path {} does not exist (train_data_dir: a folder of images with caption files, or the Twemoji "
        "set; a relative path is taken from the working directory). The emoji example's Twemoji set comes from "
        "scripts/fetch_twemoji.sh, which prints its path (by default "
        "~/.cache/shoestring/emoji-datasource-twitter-16.0.0)",
        path);
  }
  if (fs::is_regular_file(p, ec) && p.filename() == "emoji.json") {
    return load_twemoji(p.parent_path().string(), resolution, twemoji_categories, selection);
  }
  if (!fs::is_directory(p, ec)) {
    fail(
        "dataset path {}: expected a folder (Twemoji layout with emoji.json, or images with "
        ".txt captions)",
        path);
  }
  if (fs::is_regular_file(p / "emoji.json", ec)) return load_twemoji(path, resolution, twemoji_categories, selection);
  if (!twemoji_categories.empty()) {
    fail(
        "dataset folder {}: twemoji_categories applies to the Twemoji layout (a folder with emoji.json) only; "
        "this folder has none",
        path);
  }
  return load_folder(path, resolution, selection);
}

ImageCaptionDataset ImageCaptionDataset::decode_all(std::vector<Candidate> candidates, int resolution,
                                                    const std::string& source, const DatasetSelection& selection) {
  if (resolution < 1) fail("dataset {}: resolution must be >= 1, got {}", source, resolution);
  const auto listed = static_cast<int64_t>(candidates.size());
  keep_selected(candidates, selection);
  const int64_t n = static_cast<int64_t>(candidates.size());
  const bool on_demand = selection.decode_on_demand;
  // Decoding on demand: only the headers are read now (nothing is held).
  auto all = at::empty({on_demand ? 0 : n, 3, resolution, resolution}, at::kByte);
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
        if (on_demand) {
          (void)image_file_size(c.path);
          continue;
        }
        const at::Tensor img = load_image(c.path, resolution);
        std::memcpy(base + i * image_bytes, img.data_ptr<uint8_t>(), static_cast<size_t>(image_bytes));
      } catch (const std::exception& e) {
        reasons[static_cast<size_t>(i)] = e.what();
      }
    }
  });

  ImageCaptionDataset ds;
  ds.resolution_ = resolution;
  ds.listed_ = listed;
  ds.on_demand_ = on_demand;
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
  if (!on_demand) {
    ds.images_ = static_cast<int64_t>(keep.size()) == n ? all : all.index_select(0, at::tensor(keep, at::kLong));
  }
  ds.caption_stats_.missing = static_cast<int64_t>(missing.size());
  ds.caption_stats_.empty = static_cast<int64_t>(empty.size());
  warn_captions(source, missing, "without a caption file (.txt beside it)");
  warn_captions(source, empty, "with an empty caption file");
  return ds;
}

namespace {

/// An image of load_buckets before it is decoded.
struct BucketItem {
  std::string path;
  std::string caption;
  size_t spec = 0;
  const DatasetSubset* subset = nullptr;
  bool missing_caption = false;
  bool empty_caption = false;
  std::string skip_reason;
  BucketReso original;
  BucketChoice choice;
  CropOffset crop;
  int64_t bucket = -1;
  int64_t row = -1;
};

/// The images of a DreamBooth-style subset: the files of image_dir (not
/// recursive; names starting with '.' ignored), sorted, with their captions.
void list_folder_subset(const DatasetSubset& sub, size_t spec, std::vector<BucketItem>& out) {
  std::error_code ec;
  if (!fs::is_directory(sub.image_dir, ec)) fail("{}: image_dir {}: not a directory", sub.where, sub.image_dir);
  std::vector<fs::path> files;
  if (sub.recursive) {
    const fs::path root_canonical = fs::canonical(sub.image_dir, ec);
    if (ec) fail("{}: image_dir {}: cannot resolve: {}", sub.where, sub.image_dir, ec.message());
    FolderWalk walk(sub.image_dir);
    walk.walk(fs::path(sub.image_dir), root_canonical);
    files = std::move(walk.files());
  }
  fs::directory_iterator it(sub.recursive ? fs::directory_iterator() : fs::directory_iterator(sub.image_dir, ec));
  if (ec) fail("{}: image_dir {}: cannot list: {}", sub.where, sub.image_dir, ec.message());
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) fail("{}: image_dir {}: cannot list: {}", sub.where, sub.image_dir, ec.message());
    const std::string name = it->path().filename().string();
    if (name.empty() || name[0] == '.' || !it->is_regular_file(ec)) continue;
    files.push_back(it->path());
  }
  std::sort(files.begin(), files.end());
  const size_t before = out.size();
  for (const fs::path& file : files) {
    const std::string ext = lowercase(file.extension().string());
    BucketItem item;
    item.path = file.string();
    item.spec = spec;
    item.subset = &sub;
    if (ext == ".webp") {
      item.skip_reason =
          fmt::format("{}: WebP is not supported (stb_image cannot decode it); convert it to PNG", file.string());
      out.push_back(std::move(item));
      continue;
    }
    if (!is_image_extension(ext)) continue;
    fs::path caption_path = file;
    caption_path.replace_extension(sub.caption_extension);
    if (fs::is_regular_file(caption_path, ec)) {
      item.caption = read_caption_file(caption_path.string());
      item.empty_caption = item.caption.empty();
    } else {
      item.missing_caption = true;
      item.caption = sub.class_tokens;  // kohya: class_tokens stand in for a missing caption file
    }
    out.push_back(std::move(item));
  }
  if (out.size() == before) {
    // kohya warns too ("no image"); a typo'd or empty folder should not pass unnoticed.
    spdlog::warn("{}: image_dir {} holds no images (.png .jpg .jpeg .bmp .gif .tga{}); the subset adds nothing",
                 sub.where, sub.image_dir, sub.recursive ? ", searched recursively" : "");
  }
}

/// A string member of a metadata entry, or "" when absent or null.
std::string metadata_text(const nlohmann::json& entry, const char* key, const std::string& at) {
  const auto it = entry.find(key);
  if (it == entry.end() || it->is_null()) return "";
  if (!it->is_string()) fail("{}: '{}' must be a string", at, key);
  const std::string v = it->get<std::string>();
  const size_t bad = utf8_error_offset(v);
  if (bad != std::string::npos) fail("{}: '{}' is not valid UTF-8 at byte offset {}", at, key, bad);
  return v;
}

/// The images of a fine-tuning subset: kohya's metadata JSON (or JSON Lines).
void list_metadata_subset(const DatasetSubset& sub, size_t spec, std::vector<BucketItem>& out) {
  const std::string& file = sub.metadata_file;
  std::error_code ec;
  if (!fs::is_regular_file(file, ec)) fail("{}: metadata_file {} does not exist", sub.where, file);
  const std::string text = read_file(file);
  std::vector<std::pair<std::string, nlohmann::json>> entries;  // image key -> entry
  const bool lines = lowercase(fs::path(file).extension().string()) == ".jsonl";
  try {
    if (lines) {
      std::istringstream in(text);
      std::string line;
      int64_t n = 0;
      while (std::getline(in, line)) {
        ++n;
        if (trim(line).empty()) continue;
        nlohmann::json e = nlohmann::json::parse(line);
        const std::string at = fmt::format("{}:{}", file, n);
        if (!e.is_object()) fail("{}: expected an object", at);
        const auto p = e.find("image_path");
        if (p == e.end() || !p->is_string()) fail("{}: 'image_path' must be a string", at);
        const std::string key = p->get<std::string>();
        e.erase("image_path");
        entries.emplace_back(key, std::move(e));
      }
    } else {
      nlohmann::json all = nlohmann::json::parse(text);
      if (!all.is_object()) fail("{}: expected a JSON object {{image key: {{\"caption\": ..., \"tags\": ...}}}}", file);
      for (auto& [key, e] : all.items()) entries.emplace_back(key, e);
    }
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON: {}", file, e.what());
  }
  std::sort(entries.begin(), entries.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  for (const auto& [key, e] : entries) {
    const std::string at = fmt::format("{}: entry \"{}\"", file, printable(key));
    if (!e.is_object()) fail("{}: expected an object", at);
    for (const auto& [k, v] : e.items()) {
      if (k != "caption" && k != "tags" && k != "image_size" && k != "train_resolution") {
        fail("{}: unknown key '{}' (kohya's fine-tuning metadata has caption, tags, image_size, train_resolution)", at,
             k);
      }
      (void)v;
    }
    BucketItem item;
    item.spec = spec;
    item.subset = &sub;
    // kohya: caption, then the tags after caption_separator (",").
    std::string caption = metadata_text(e, "caption", at);
    const std::string tags = metadata_text(e, "tags", at);
    if (!tags.empty()) caption = caption.empty() ? tags : caption + "," + tags;
    item.caption = caption;
    item.missing_caption = caption.empty();
    fs::path path(key);
    if (path.is_relative()) {
      if (sub.image_dir.empty()) {
        fail("{}: the image key is a relative path, so the subset needs image_dir (kohya requires it too)", at);
      }
      path = fs::path(sub.image_dir) / path;
    }
    if (!fs::exists(path, ec) && !is_image_extension(lowercase(path.extension().string()))) {
      // kohya's metadata keys are often the file name without its extension.
      for (const char* ext : {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tga", ".webp", ".PNG", ".JPG", ".JPEG"}) {
        fs::path candidate = path;
        candidate += ext;
        if (fs::exists(candidate, ec)) {
          path = candidate;
          break;
        }
      }
    }
    if (!fs::exists(path, ec)) fail("{}: image {} does not exist", at, path.string());
    item.path = path.string();
    if (lowercase(path.extension().string()) == ".webp") {
      item.skip_reason =
          fmt::format("{}: WebP is not supported (stb_image cannot decode it); convert it to PNG", item.path);
    }
    out.push_back(std::move(item));
  }
}

}  // namespace

ImageCaptionDataset ImageCaptionDataset::load_buckets(const std::vector<DatasetSpec>& specs_in, uint64_t seed,
                                                      const DatasetSelection& selection) {
  if (specs_in.empty()) fail("datasets: none given");
  std::vector<DatasetSpec> specs = specs_in;
  std::vector<BucketItem> items;
  for (size_t d = 0; d < specs.size(); ++d) {
    std::vector<std::string> notes;
    specs[d].buckets = adjust_bucket_settings(specs[d].buckets, specs[d].where, &notes);
    for (const auto& n : notes) spdlog::warn("{}", n);
    if (specs[d].batch_size < 1) fail("{}: batch_size must be >= 1, got {}", specs[d].where, specs[d].batch_size);
    if (specs[d].subsets.empty()) fail("{}: the dataset has no subsets", specs[d].where);
    for (const DatasetSubset& sub : specs[d].subsets) {
      if (sub.num_repeats < 1) {
        spdlog::warn("{}: num_repeats = {} is less than 1; the subset is left out (as kohya does)", sub.where,
                     sub.num_repeats);
        continue;
      }
      if (sub.metadata_file.empty()) {
        list_folder_subset(sub, d, items);
      } else {
        list_metadata_subset(sub, d, items);
      }
    }
  }
  const auto listed = static_cast<int64_t>(items.size());
  keep_selected(items, selection);
  // Sizes from the headers.
  const auto n = static_cast<int64_t>(items.size());
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      BucketItem& it = items[static_cast<size_t>(i)];
      if (!it.skip_reason.empty()) continue;
      try {
        const auto [w, h] = image_file_size(it.path);
        it.original = {w, h};
      } catch (const std::exception& e) {
        it.skip_reason = e.what();
      }
    }
  });
  // Buckets, per dataset, in image order (kohya: select_bucket for each image, then sort).
  std::vector<BucketManager> managers;
  for (const DatasetSpec& spec : specs) managers.push_back(BucketManager::for_settings(spec.buckets));
  for (size_t i = 0; i < items.size(); ++i) {
    BucketItem& it = items[i];
    if (!it.skip_reason.empty()) continue;
    try {
      it.choice = managers[it.spec].select_bucket(it.original.width, it.original.height);
      it.crop = bucket_crop_offset(it.choice.resized, it.choice.bucket, it.subset->random_crop,
                                   seed ^ (0x9E3779B97F4A7C15ULL * (i + 1)));
    } catch (const Error& e) {
      it.skip_reason = fmt::format("{}: {}", it.path, e.what());
    }
  }
  // Decode each image into its bucket size (on demand: later, in batch_images).
  std::vector<at::Tensor> decoded(items.size());
  at::parallel_for(0, selection.decode_on_demand ? 0 : n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      BucketItem& it = items[static_cast<size_t>(i)];
      if (!it.skip_reason.empty()) continue;
      try {
        decoded[static_cast<size_t>(i)] = decode_image_fitted(
            read_file(it.path), it.path, static_cast<int>(it.choice.resized.width),
            static_cast<int>(it.choice.resized.height), static_cast<int>(it.crop.x), static_cast<int>(it.crop.y),
            static_cast<int>(it.choice.bucket.width), static_cast<int>(it.choice.bucket.height));
      } catch (const std::exception& e) {
        it.skip_reason = e.what();
      }
    }
  });

  ImageCaptionDataset ds;
  ds.listed_ = listed;
  ds.on_demand_ = selection.decode_on_demand;
  std::vector<std::string> missing, empty;
  std::vector<std::vector<at::Tensor>> rows;
  std::map<std::pair<size_t, BucketReso>, int64_t> bucket_id;
  // Bucket ids: per dataset, its buckets in sorted order (those with images).
  for (size_t d = 0; d < specs.size(); ++d) {
    std::set<BucketReso> used;
    for (const BucketItem& it : items) {
      if (it.spec == d && it.skip_reason.empty()) used.insert(it.choice.bucket);
    }
    for (const BucketReso& r : used) {
      bucket_id.emplace(std::make_pair(d, r), static_cast<int64_t>(ds.buckets_.size()));
      DatasetBucket b;
      b.dataset = static_cast<int64_t>(d);
      b.reso = r;
      b.batch_size = specs[d].batch_size;
      ds.buckets_.push_back(std::move(b));
      rows.emplace_back();
    }
  }
  double ar_error_sum = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    BucketItem& it = items[i];
    if (!it.skip_reason.empty()) {
      ds.skipped_.push_back({it.path, it.skip_reason});
      continue;
    }
    const int64_t image = static_cast<int64_t>(ds.captions_.size());
    const int64_t b = bucket_id.at({it.spec, it.choice.bucket});
    DatasetBucket& bucket = ds.buckets_[static_cast<size_t>(b)];
    ds.bucket_of_.push_back(b);
    ds.row_in_bucket_.push_back(static_cast<int64_t>(bucket.images.size()));
    bucket.images.push_back(image);
    bucket.entries += it.subset->num_repeats;
    if (!ds.on_demand_) rows[static_cast<size_t>(b)].push_back(decoded[i]);
    ds.geometry_.push_back({it.original, it.choice.resized, it.crop, crop_ltrb(it.choice.bucket, it.original)});
    ds.flip_.push_back(it.subset->flip_aug);
    ds.repeats_.push_back(it.subset->num_repeats);
    ds.dropout_.push_back(it.subset->caption_dropout_rate);
    ds.random_crop_ = ds.random_crop_ || it.subset->random_crop;
    ar_error_sum += std::abs(it.choice.ar_error);
    if (it.missing_caption && it.caption.empty()) missing.push_back(it.path);
    if (it.missing_caption && !it.caption.empty()) ++ds.caption_stats_.class_tokens;
    if (it.empty_caption) empty.push_back(it.path);
    ds.captions_.push_back(std::move(it.caption));
    ds.paths_.push_back(std::move(it.path));
  }
  if (ds.captions_.empty()) {
    fail("datasets {}: no image could be loaded ({} candidates, {} skipped{})", specs.front().where, items.size(),
         ds.skipped_.size(), ds.skipped_.empty() ? std::string() : "; first: " + ds.skipped_.front().reason);
  }
  if (!ds.on_demand_) {
    for (auto& r : rows) ds.bucket_images_.push_back(torch::stack(r, 0));
  }
  for (const DatasetSpec& spec : specs) ds.resolutions_.push_back(spec.buckets.resolution);
  ds.mean_ar_error_ = ar_error_sum / static_cast<double>(ds.captions_.size());
  ds.caption_stats_.missing = static_cast<int64_t>(missing.size());
  ds.caption_stats_.empty = static_cast<int64_t>(empty.size());
  warn_captions(specs.front().where, missing, "without a caption (no caption file, class_tokens or metadata caption)");
  warn_captions(specs.front().where, empty, "with an empty caption file");
  return ds;
}

std::vector<std::string> ImageCaptionDataset::bucket_report() const {
  std::vector<std::string> lines;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const DatasetBucket& k = buckets_[b];
    lines.push_back(fmt::format("bucket {}: resolution {}, count {} ({} image{}, dataset {}, batch_size {})", b,
                                to_string(k.reso), k.entries, k.images.size(), k.images.size() == 1 ? "" : "s",
                                k.dataset, k.batch_size));
  }
  lines.push_back(fmt::format("mean ar error (without repeats): {:.6g}", mean_ar_error_));
  return lines;
}

std::vector<SamplerBucket> sampler_buckets(const ImageCaptionDataset& dataset) {
  std::vector<SamplerBucket> out;
  for (const DatasetBucket& b : dataset.buckets()) {
    SamplerBucket s;
    s.batch_size = b.batch_size;
    for (const int64_t i : b.images) {
      for (int64_t r = 0; r < dataset.num_repeats(i); ++r) s.samples.push_back(i);
    }
    out.push_back(std::move(s));
  }
  return out;
}

const at::Tensor& ImageCaptionDataset::bucket_images(int64_t b) const {
  if (on_demand_) fail("dataset: bucket_images: the images are decoded on demand (batch_images), none are held");
  if (b < 0 || b >= static_cast<int64_t>(bucket_images_.size()))
    fail("dataset: bucket {} is outside [0, {})", b, bucket_images_.size());
  return bucket_images_[static_cast<size_t>(b)];
}

at::Tensor ImageCaptionDataset::batch_images(const std::vector<int64_t>& idx) const {
  for (const int64_t i : idx) {
    if (i < 0 || i >= size()) fail("dataset: image index {} is outside [0, {})", i, size());
  }
  if (bucketed()) {
    if (idx.empty()) fail("dataset: empty batch");
    const int64_t b = bucket_of(idx.front());
    std::vector<int64_t> rows;
    for (const int64_t i : idx) {
      if (bucket_of(i) != b) {
        fail("dataset: images {} and {} of one batch are in different buckets ({} and {})", idx.front(), i,
             to_string(buckets_[static_cast<size_t>(b)].reso),
             to_string(buckets_[static_cast<size_t>(bucket_of(i))].reso));
      }
      rows.push_back(row_in_bucket_[static_cast<size_t>(i)]);
    }
    if (on_demand_) return decode_batch(idx);
    return bucket_images(b).index_select(0, at::tensor(rows, at::kLong)).to(at::kFloat).div_(127.5).sub_(1.0);
  }
  if (on_demand_) return decode_batch(idx);
  auto index = at::tensor(idx, at::kLong);
  return images_.index_select(0, index).to(at::kFloat).div_(127.5).sub_(1.0);
}

at::Tensor ImageCaptionDataset::decode_batch(const std::vector<int64_t>& idx) const {
  // As loading decodes them: the square resize, or the bucket's fit and crop.
  std::vector<at::Tensor> decoded(idx.size());
  at::parallel_for(0, static_cast<int64_t>(idx.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t i = idx[static_cast<size_t>(k)];
      const std::string& path = paths_[static_cast<size_t>(i)];
      if (!bucketed()) {
        decoded[static_cast<size_t>(k)] = load_image(path, resolution_);
        continue;
      }
      const ImageGeometry& g = geometry_[static_cast<size_t>(i)];
      const BucketReso reso = buckets_[static_cast<size_t>(bucket_of(i))].reso;
      decoded[static_cast<size_t>(k)] =
          decode_image_fitted(read_file(path), path, static_cast<int>(g.resized.width),
                              static_cast<int>(g.resized.height), static_cast<int>(g.crop.x),
                              static_cast<int>(g.crop.y), static_cast<int>(reso.width), static_cast<int>(reso.height));
    }
  });
  return torch::stack(decoded, 0).to(at::kFloat).div_(127.5).sub_(1.0);
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

namespace {

/// Fisher-Yates (Durstenfeld) shuffle of `v` with bounded draws by rejection
/// (std::uniform_int_distribution's output is implementation-defined).
template <class T>
void shuffle_in_place(std::vector<T>& v, std::mt19937_64& gen) {
  for (int64_t i = static_cast<int64_t>(v.size()) - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(uniform_up_to(gen, static_cast<uint64_t>(i)));
    std::swap(v[static_cast<size_t>(i)], v[static_cast<size_t>(j)]);
  }
}

}  // namespace

BatchSampler::BatchSampler(int64_t dataset_size, int64_t batch_size, uint64_t seed) : seed_(seed) {
  if (batch_size < 1) fail("batch sampler: batch_size must be >= 1, got {}", batch_size);
  if (dataset_size < batch_size) {
    fail(
        "batch sampler: the dataset has {} images, fewer than batch_size {} (batches never "
        "span epochs, so no full batch could be formed)",
        dataset_size, batch_size);
  }
  SamplerBucket all;
  all.batch_size = batch_size;
  for (int64_t i = 0; i < dataset_size; ++i) all.samples.push_back(i);
  buckets_.push_back(std::move(all));
  dataset_size_ = dataset_size;
  batch_size_ = batch_size;
  batches_per_epoch_ = dataset_size / batch_size;
}

BatchSampler::BatchSampler(std::vector<SamplerBucket> buckets, uint64_t seed, bool partial_batches)
    : buckets_(std::move(buckets)), partial_batches_(partial_batches), seed_(seed) {
  if (buckets_.empty()) fail("batch sampler: no buckets");
  for (const SamplerBucket& b : buckets_) {
    if (b.batch_size < 1) fail("batch sampler: batch_size must be >= 1, got {}", b.batch_size);
    const auto n = static_cast<int64_t>(b.samples.size());
    dataset_size_ += n;
    batch_size_ = std::max(batch_size_, b.batch_size);
    batches_per_epoch_ += partial_batches ? (n + b.batch_size - 1) / b.batch_size : n / b.batch_size;
  }
  if (batches_per_epoch_ == 0) {
    fail(
        "batch sampler: no bucket has batch_size entries ({} entries in {} buckets, batch_size {}; without partial "
        "batches a bucket's leftovers are not used), so no full batch could be formed",
        dataset_size_, buckets_.size(), batch_size_);
  }
}

std::vector<int64_t> BatchSampler::epoch_permutation(int64_t epoch) const {
  std::vector<int64_t> out;
  const auto e = static_cast<uint64_t>(epoch);
  std::seed_seq seq{static_cast<uint32_t>(seed_), static_cast<uint32_t>(seed_ >> 32), static_cast<uint32_t>(e),
                    static_cast<uint32_t>(e >> 32)};
  std::mt19937_64 gen(seq);
  for (const SamplerBucket& b : buckets_) {
    std::vector<int64_t> entries = b.samples;
    shuffle_in_place(entries, gen);
    out.insert(out.end(), entries.begin(), entries.end());
  }
  return out;
}

std::vector<std::vector<int64_t>> BatchSampler::epoch_batches(int64_t epoch) const {
  const auto e = static_cast<uint64_t>(epoch);
  std::seed_seq seq{static_cast<uint32_t>(seed_), static_cast<uint32_t>(seed_ >> 32), static_cast<uint32_t>(e),
                    static_cast<uint32_t>(e >> 32)};
  std::mt19937_64 gen(seq);
  std::vector<std::vector<int64_t>> batches;
  for (const SamplerBucket& b : buckets_) {
    std::vector<int64_t> entries = b.samples;
    shuffle_in_place(entries, gen);
    const auto n = static_cast<int64_t>(entries.size());
    for (int64_t start = 0; start < n; start += b.batch_size) {
      const int64_t stop = std::min(n, start + b.batch_size);
      if (stop - start < b.batch_size && !partial_batches_) break;
      batches.emplace_back(entries.begin() + start, entries.begin() + stop);
    }
  }
  if (buckets_.size() > 1) shuffle_in_place(batches, gen);
  return batches;
}

std::vector<int64_t> BatchSampler::next() {
  if (cached_epoch_ != position_.epoch) {
    batches_ = epoch_batches(position_.epoch);
    cached_epoch_ = position_.epoch;
  }
  std::vector<int64_t> batch = batches_[static_cast<size_t>(position_.index)];
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
