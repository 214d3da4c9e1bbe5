// kohya's dataset TOML and in_json as DatasetSpecs. See dataset_config.h.
#include "shoestring/train/dataset_config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <limits>
#include <map>
#include <optional>
#include <variant>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <toml++/toml.h>

#include "shoestring/core/error.h"
#include "shoestring/io/atomic_file.h"

namespace shoestring {
namespace {

enum Level : unsigned { kGeneral = 1u << 0, kDataset = 1u << 1, kSubset = 1u << 2 };
enum class Kind { boolean, integer, number, text, reso };

/// One key of the dataset TOML (kohya's library/config_util.py schema).
struct DatasetKey {
  const char* key;
  unsigned levels;  ///< Level bits: where kohya takes it
  Kind kind;
  double min;
  double max;
  const char* kohya_default;
  const char* help;
};

constexpr unsigned kAll = kGeneral | kDataset | kSubset;
constexpr unsigned kDatasetLevels = kGeneral | kDataset;

const std::vector<DatasetKey>& dataset_keys() {
  static const std::vector<DatasetKey> keys = {
      {"resolution", kDatasetLevels, Kind::reso, 8, 16384, "main config's",
       "training resolution: an integer (square) or [width, height]; the buckets' area"},
      {"batch_size", kDatasetLevels, Kind::integer, 1, 65536, "train_batch_size",
       "images per batch of this dataset (with several processes it must equal train_batch_size)"},
      {"enable_bucket", kDatasetLevels, Kind::boolean, 0, 0, "false", "aspect-ratio buckets"},
      {"min_bucket_reso", kDatasetLevels, Kind::integer, 1, 16384, "256", "smallest bucket side, pixels"},
      {"max_bucket_reso", kDatasetLevels, Kind::integer, 1, 16384, "1024", "largest bucket side, pixels"},
      {"bucket_reso_steps", kDatasetLevels, Kind::integer, 1, 4096, "64", "bucket sides are multiples of this"},
      {"bucket_no_upscale", kDatasetLevels, Kind::boolean, 0, 0, "false",
       "buckets from each image's own size, never enlarged"},
      {"image_dir", kSubset, Kind::text, 0, 0, "(required without metadata_file)",
       "folder of the images (its own files, not sub-folders); with metadata_file, the folder relative image "
       "keys are joined to"},
      {"metadata_file", kSubset, Kind::text, 0, 0, "(none)",
       "kohya's fine-tuning metadata JSON / JSON Lines (captions and tags per image): a fine-tuning subset"},
      {"num_repeats", kAll, Kind::integer, -1e9, 1e6, "dataset_repeats (1)",
       "each image is this many entries of its bucket per epoch; a subset with < 1 is left out, as in kohya"},
      {"caption_extension", kAll, Kind::text, 0, 0, "main config's (\".txt\"; kohya: \".caption\")",
       "caption file of a.png: a + caption_extension (DreamBooth subsets)"},
      {"class_tokens", kAll, Kind::text, 0, 0, "\"\"", "caption of an image without a caption file"},
      {"shuffle_caption", kAll, Kind::boolean, 0, 0, "main config's",
       "shuffle tags per draw; refused by the LDM families (cached text-encoder outputs)"},
      {"keep_tokens", kAll, Kind::integer, 0, 1000, "main config's", "leading tags shuffle_caption leaves in place"},
      {"flip_aug", kAll, Kind::boolean, 0, 0, "main config's", "also train on the mirrored image (probability 1/2)"},
      {"random_crop", kAll, Kind::boolean, 0, 0, "main config's",
       "random crop offset; refused by the LDM families (latents encoded once, as kohya with cache_latents)"},
      {"caption_dropout_rate", kAll, Kind::number, 0, 1, "main config's",
       "probability of the empty caption for this subset's images"},
      {"caption_tag_dropout_rate", kAll, Kind::number, 0, 1, "main config's",
       "per-tag dropout; refused by the LDM families (cached text-encoder outputs)"},
  };
  return keys;
}

/// kohya keys shoestring does not implement (an error that says so, not "unknown").
const std::vector<std::string>& unimplemented_kohya_keys() {
  static const std::vector<std::string> keys = {"color_aug",
                                                "face_crop_aug_range",
                                                "keep_tokens_separator",
                                                "secondary_separator",
                                                "caption_separator",
                                                "enable_wildcard",
                                                "token_warmup_min",
                                                "token_warmup_step",
                                                "caption_prefix",
                                                "caption_suffix",
                                                "custom_attributes",
                                                "validation_seed",
                                                "validation_split",
                                                "resize_interpolation",
                                                "caption_dropout_every_n_epochs",
                                                "is_reg",
                                                "alpha_mask",
                                                "cache_info",
                                                "network_multiplier",
                                                "prior_loss_weight",
                                                "debug_dataset",
                                                "max_token_length",
                                                "conditioning_data_dir"};
  return keys;
}

const DatasetKey* find_key(const std::string& key) {
  for (const auto& k : dataset_keys()) {
    if (key == k.key) return &k;
  }
  return nullptr;
}

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t prev = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t cur = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, prev + (a[i - 1] == b[j - 1] ? 0 : 1)});
      prev = cur;
    }
  }
  return row[b.size()];
}

std::string nearest(const std::string& key) {
  std::string best;
  size_t d = std::numeric_limits<size_t>::max();
  for (const auto& k : dataset_keys()) {
    const size_t e = edit_distance(key, k.key);
    if (e < d) {
      d = e;
      best = k.key;
    }
  }
  return best;
}

std::string levels_text(unsigned levels) {
  std::vector<std::string> v;
  if (levels & kGeneral) v.emplace_back("[general]");
  if (levels & kDataset) v.emplace_back("[[datasets]]");
  if (levels & kSubset) v.emplace_back("[[datasets.subsets]]");
  return fmt::format("{}", fmt::join(v, ", "));
}

using Value = std::variant<bool, int64_t, double, std::string, BucketReso>;
using Table = std::map<std::string, Value>;

std::string at_line(const std::string& source, const toml::node& node) {
  const auto& pos = node.source().begin;
  return pos.line == 0 ? source : fmt::format("{}:{}", source, pos.line);
}

/// Reads the keys of one table at `level` (sub-tables named in `skip` excepted).
Table read_table(const toml::table& t, unsigned level, const std::string& source, const std::string& table_name,
                 const std::vector<std::string>& skip = {}) {
  Table out;
  for (const auto& [kk, node] : t) {
    const std::string key(kk.str());
    if (std::find(skip.begin(), skip.end(), key) != skip.end()) continue;
    const std::string at = fmt::format("{}: {}", at_line(source, node), table_name);
    const DatasetKey* k = find_key(key);
    if (!k) {
      const auto& un = unimplemented_kohya_keys();
      if (std::find(un.begin(), un.end(), key) != un.end()) {
        fail("{}: '{}' is a kohya dataset key shoestring does not implement; remove it", at, key);
      }
      fail("{}: unknown key '{}' (did you mean '{}'?)", at, key, nearest(key));
    }
    if (!(k->levels & level)) {
      fail("{}: '{}' cannot be set here; kohya takes it in {}", at, key, levels_text(k->levels));
    }
    auto bad = [&]() -> Value {
      const char* what = k->kind == Kind::boolean   ? "true or false"
                         : k->kind == Kind::integer ? "an integer"
                         : k->kind == Kind::number  ? "a number"
                         : k->kind == Kind::text    ? "a string"
                                                    : "an integer or [width, height]";
      fail("{}: invalid value for '{}': expected {}{}", at, key, what,
           k->kind == Kind::integer || k->kind == Kind::number || k->kind == Kind::reso
               ? fmt::format(" in [{}, {}]", k->min, k->max)
               : std::string());
    };
    auto in_range = [&](double v) { return v >= k->min && v <= k->max; };
    Value v;
    switch (k->kind) {
      case Kind::boolean: v = node.is_boolean() ? Value(*node.value<bool>()) : bad(); break;
      case Kind::integer:
        v = node.is_integer() && in_range(static_cast<double>(*node.value<int64_t>())) ? Value(*node.value<int64_t>())
                                                                                       : bad();
        break;
      case Kind::number:
        v = node.is_number() && std::isfinite(*node.value<double>()) && in_range(*node.value<double>())
                ? Value(*node.value<double>())
                : bad();
        break;
      case Kind::text: v = node.is_string() ? Value(*node.value<std::string>()) : bad(); break;
      case Kind::reso: {
        if (node.is_integer() && in_range(static_cast<double>(*node.value<int64_t>()))) {
          v = BucketReso{*node.value<int64_t>(), *node.value<int64_t>()};
        } else if (const toml::array* a = node.as_array(); a && a->size() == 2 && (*a)[0].is_integer() &&
                                                           (*a)[1].is_integer() &&
                                                           in_range(static_cast<double>(*(*a)[0].value<int64_t>())) &&
                                                           in_range(static_cast<double>(*(*a)[1].value<int64_t>()))) {
          v = BucketReso{*(*a)[0].value<int64_t>(), *(*a)[1].value<int64_t>()};
        } else {
          v = bad();
        }
        break;
      }
    }
    out.emplace(key, v);
  }
  return out;
}

/// The main config's value of a dataset key (kohya's argparse fallback).
Value main_value(const std::string& key, const TrainConfig& c) {
  if (key == "resolution") return BucketReso{c.resolution, c.resolution};
  if (key == "batch_size") return c.train_batch_size;
  if (key == "enable_bucket") return c.enable_bucket;
  if (key == "min_bucket_reso") return c.min_bucket_reso;
  if (key == "max_bucket_reso") return c.max_bucket_reso;
  if (key == "bucket_reso_steps") return c.bucket_reso_steps;
  if (key == "bucket_no_upscale") return c.bucket_no_upscale;
  if (key == "num_repeats") return c.dataset_repeats;
  if (key == "caption_extension") return c.caption_extension;
  if (key == "class_tokens") return std::string();
  if (key == "shuffle_caption") return c.shuffle_caption;
  if (key == "keep_tokens") return c.keep_tokens;
  if (key == "flip_aug") return c.flip_aug;
  if (key == "random_crop") return c.random_crop;
  if (key == "caption_dropout_rate") return c.caption_dropout_rate;
  if (key == "caption_tag_dropout_rate") return c.caption_tag_dropout_rate;
  if (key == "image_dir" || key == "metadata_file") return std::string();
  fail("internal: dataset key '{}' has no main-config fallback", key);
}

/// A key resolved through subset -> dataset -> general -> main config.
struct Chain {
  const Table* subset = nullptr;
  const Table* dataset = nullptr;
  const Table* general = nullptr;
  const TrainConfig* config = nullptr;

  Value get(const std::string& key) const {
    for (const Table* t : {subset, dataset, general}) {
      if (!t) continue;
      const auto it = t->find(key);
      if (it != t->end()) return it->second;
    }
    return main_value(key, *config);
  }
  template <class T>
  T as(const std::string& key) const {
    return std::get<T>(get(key));
  }
};

DatasetSubset make_subset(const Chain& chain, const std::string& where) {
  DatasetSubset s;
  s.image_dir = expand_path(chain.as<std::string>("image_dir"));
  s.metadata_file = expand_path(chain.as<std::string>("metadata_file"));
  s.num_repeats = chain.as<int64_t>("num_repeats");
  s.caption_extension = chain.as<std::string>("caption_extension");
  s.class_tokens = chain.as<std::string>("class_tokens");
  s.flip_aug = chain.as<bool>("flip_aug");
  s.random_crop = chain.as<bool>("random_crop");
  s.shuffle_caption = chain.as<bool>("shuffle_caption");
  s.keep_tokens = chain.as<int64_t>("keep_tokens");
  s.caption_dropout_rate = chain.as<double>("caption_dropout_rate");
  s.caption_tag_dropout_rate = chain.as<double>("caption_tag_dropout_rate");
  s.where = where;
  return s;
}

DatasetSpec make_spec(const Chain& chain, const std::string& where) {
  DatasetSpec d;
  d.buckets.resolution = chain.as<BucketReso>("resolution");
  d.buckets.enable_bucket = chain.as<bool>("enable_bucket");
  d.buckets.min_bucket_reso = chain.as<int64_t>("min_bucket_reso");
  d.buckets.max_bucket_reso = chain.as<int64_t>("max_bucket_reso");
  d.buckets.bucket_reso_steps = chain.as<int64_t>("bucket_reso_steps");
  d.buckets.bucket_no_upscale = chain.as<bool>("bucket_no_upscale");
  d.batch_size = chain.as<int64_t>("batch_size");
  d.where = where;
  return d;
}

constexpr const char* kRepeatsForm =
    "<repeats>_<class tokens>, e.g. \"10_sks dog\" (each image of it 10 entries per epoch, captioned \"sks dog\" "
    "without a caption file)";

/// The subfolders of `dir`, not hidden, sorted by name.
std::vector<std::filesystem::path> subfolders(const std::string& dir) {
  namespace fs = std::filesystem;
  std::vector<fs::path> out;
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  if (ec) return out;
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) break;
    const std::string name = it->path().filename().string();
    if (!name.empty() && name[0] != '.' && it->is_directory(ec)) out.push_back(it->path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

/// kohya's DreamBooth layout of train_data_dir: one subset per "<repeats>_<class tokens>" subfolder.
std::vector<DatasetSubset> repeats_folder_subsets(const std::string& dir, const TrainConfig& c, const Chain& chain) {
  namespace fs = std::filesystem;
  std::vector<fs::path> folders = subfolders(dir);
  std::string example;
  for (const fs::path& f : folders) {
    if (parse_repeats_folder_name(f.filename().string())) {
      example = f.filename().string();
      break;
    }
  }
  const std::string layout = fmt::format(
      "train_data_dir {} is in kohya's DreamBooth layout (its subfolder \"{}\" is named <repeats>_<class tokens>)", dir,
      example);
  if (c.dataset_repeats != TrainConfig{}.dataset_repeats) {
    fail("{}, whose folder names give the repeats; dataset_repeats = {} contradicts them: remove it", layout,
         c.dataset_repeats);
  }
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    std::string ext = e.path().extension().string();
    std::transform(ext.begin(), ext.end(), ext.begin(), [](unsigned char ch) { return std::tolower(ch); });
    const bool image = ext == ".png" || ext == ".jpg" || ext == ".jpeg" || ext == ".bmp" || ext == ".gif" ||
                       ext == ".tga" || ext == ".webp";
    if (!name.empty() && name[0] != '.' && image && e.is_regular_file(ec)) {
      fail("{}: image {} is in no subfolder, so it has no repeats (kohya ignores it); move it into a folder named {}",
           layout, e.path().string(), kRepeatsForm);
    }
  }
  std::vector<DatasetSubset> out;
  for (const fs::path& f : folders) {
    const std::string name = f.filename().string();
    const std::optional<RepeatsFolderName> parsed = parse_repeats_folder_name(name);
    if (!parsed) {
      fail("{}, so every subfolder must be: {} is not (expected {}); rename it, or move it out of train_data_dir",
           layout, f.string(), kRepeatsForm);
    }
    DatasetSubset s = make_subset(chain, fmt::format("main config: train_data_dir {}", f.string()));
    s.image_dir = f.string();
    s.num_repeats = parsed->num_repeats;
    s.class_tokens = parsed->class_tokens;
    s.recursive = false;  // kohya's glob_images: the folder's own files
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace

std::optional<RepeatsFolderName> parse_repeats_folder_name(const std::string& name) {
  size_t digits = 0;
  while (digits < name.size() && name[digits] >= '0' && name[digits] <= '9') ++digits;
  if (digits == 0 || (digits < name.size() && name[digits] != '_')) return std::nullopt;
  constexpr int64_t kMaxRepeats = 1000000;  // num_repeats' range (dataset_keys)
  RepeatsFolderName out;
  for (size_t i = 0; i < digits; ++i) {
    out.num_repeats = out.num_repeats * 10 + (name[i] - '0');
    if (out.num_repeats > kMaxRepeats) {
      fail("folder \"{}\": {} repeats is more than {} (num_repeats' range)", name, name.substr(0, digits), kMaxRepeats);
    }
  }
  out.class_tokens = digits < name.size() ? name.substr(digits + 1) : std::string();
  return out;
}

bool has_repeats_folders(const std::string& dir) {
  for (const auto& f : subfolders(dir)) {
    try {
      if (parse_repeats_folder_name(f.filename().string())) return true;
    } catch (const Error&) {
      return true;  // in the layout, with repeats out of range: dataset_specs says so
    }
  }
  return false;
}

bool uses_kohya_datasets(const TrainConfig& c) {
  const TrainConfig d;
  return !c.dataset_config.empty() || !c.in_json.empty() || c.enable_bucket || c.flip_aug || c.random_crop ||
         c.caption_extension != d.caption_extension || c.dataset_repeats != d.dataset_repeats ||
         has_repeats_folders(expand_path(c.train_data_dir));
}

std::vector<DatasetSpec> parse_dataset_config(const std::string& toml_text, const std::string& source,
                                              const TrainConfig& config) {
  toml::table root;
  try {
    root = toml::parse(toml_text, source);
  } catch (const toml::parse_error& e) {
    fail("{}:{}: TOML syntax error: {}", source, e.source().begin.line, e.description());
  }
  Table general;
  const toml::array* datasets = nullptr;
  for (const auto& [kk, node] : root) {
    const std::string key(kk.str());
    if (key == "general") {
      const toml::table* t = node.as_table();
      if (!t) fail("{}: 'general' must be a table, written [general]", at_line(source, node));
      general = read_table(*t, kGeneral, source, "[general]");
    } else if (key == "datasets") {
      datasets = node.as_array();
      if (!datasets) fail("{}: 'datasets' must be an array of tables, written [[datasets]]", at_line(source, node));
    } else {
      fail(
          "{}: unknown top-level key '{}' (a dataset config has [general] and [[datasets]]; dataset keys go "
          "inside them)",
          at_line(source, node), key);
    }
  }
  if (!datasets || datasets->empty()) fail("{}: no [[datasets]] (at least one with a [[datasets.subsets]])", source);
  std::vector<DatasetSpec> specs;
  for (size_t i = 0; i < datasets->size(); ++i) {
    const std::string dname = fmt::format("datasets[{}]", i);
    const toml::table* dt = (*datasets)[i].as_table();
    if (!dt) fail("{}: {} must be a table", source, dname);
    const Table dataset = read_table(*dt, kDataset, source, dname, {"subsets"});
    Chain chain{nullptr, &dataset, &general, &config};
    DatasetSpec spec = make_spec(chain, fmt::format("{}: {}", source, dname));
    const toml::node* subs_node = dt->get("subsets");
    const toml::array* subs = subs_node ? subs_node->as_array() : nullptr;
    if (subs_node && !subs)
      fail("{}: {}.subsets must be an array of tables, written [[datasets.subsets]]", source, dname);
    if (!subs || subs->empty()) fail("{}: {} has no [[datasets.subsets]]", source, dname);
    size_t fine_tuning = 0;
    for (size_t j = 0; j < subs->size(); ++j) {
      const std::string sname = fmt::format("{}.subsets[{}]", dname, j);
      const toml::table* st = (*subs)[j].as_table();
      if (!st) fail("{}: {} must be a table", source, sname);
      const Table subset = read_table(*st, kSubset, source, sname);
      chain.subset = &subset;
      DatasetSubset s = make_subset(chain, fmt::format("{}: {}", source, sname));
      if (s.metadata_file.empty() && s.image_dir.empty()) {
        fail(
            "{}: {}: needs image_dir (a DreamBooth subset: images with caption files) or metadata_file (a "
            "fine-tuning subset)",
            source, sname);
      }
      if (!s.metadata_file.empty()) {
        ++fine_tuning;
        for (const char* k : {"caption_extension", "class_tokens"}) {
          if (subset.count(k)) {
            fail(
                "{}: {}: '{}' does not apply to a fine-tuning subset (metadata_file gives the captions; kohya "
                "refuses it there too)",
                source, sname, k);
          }
        }
      }
      spec.subsets.push_back(std::move(s));
    }
    if (fine_tuning != 0 && fine_tuning != spec.subsets.size()) {
      fail(
          "{}: {} mixes fine-tuning subsets (metadata_file) and DreamBooth subsets (image_dir only); kohya refuses "
          "that too: put them in separate [[datasets]]",
          source, dname);
    }
    specs.push_back(std::move(spec));
  }
  return specs;
}

std::vector<DatasetSpec> dataset_specs(const TrainConfig& c) {
  const TrainConfig defaults;
  if (!c.dataset_config.empty()) {
    if (!c.in_json.empty()) {
      fail(
          "dataset_config and in_json are both set: the dataset TOML names its metadata files itself "
          "(metadata_file in [[datasets.subsets]]); keep one");
    }
    if (c.train_data_dir != defaults.train_data_dir) {
      fail(
          "dataset_config and train_data_dir are both set: the dataset TOML names its image folders itself "
          "(image_dir in [[datasets.subsets]]); keep one");
    }
    const std::string path = expand_path(c.dataset_config);
    return parse_dataset_config(read_file(path), path, c);
  }
  Chain chain{nullptr, nullptr, nullptr, &c};
  DatasetSpec spec = make_spec(chain, "main config");
  DatasetSubset s = make_subset(chain, "main config: train_data_dir");
  s.image_dir = expand_path(c.train_data_dir);
  s.metadata_file = c.in_json.empty() ? std::string() : expand_path(c.in_json);
  std::error_code ec;
  if (std::filesystem::exists(std::filesystem::path(s.image_dir) / "emoji.json", ec)) {
    fail(
        "train_data_dir {} is the Twemoji layout (square 64 px images captioned from emoji.json); enable_bucket, "
        "in_json, flip_aug, random_crop, caption_extension and dataset_repeats need kohya's layout (images with "
        "caption files)",
        s.image_dir);
  }
  if (s.metadata_file.empty() && has_repeats_folders(s.image_dir)) {
    spec.subsets = repeats_folder_subsets(s.image_dir, c, chain);
    return {spec};
  }
  s.recursive = true;
  if (!s.metadata_file.empty()) s.where = "main config: in_json";
  spec.subsets.push_back(std::move(s));
  return {spec};
}

std::string dataset_config_reference_markdown() {
  std::string out =
      "\n## Dataset config (`dataset_config`)\n\n"
      "kohya's dataset TOML: `[general]` (fallbacks for every dataset), `[[datasets]]` (one bucket set and batch "
      "size each) with `[[datasets.subsets]]` (an image folder with caption files, or a fine-tuning metadata "
      "file). A key not set in a subset comes from its dataset, then `[general]`, then the main config (the "
      "\"default\" column), as in kohya. Unknown keys, keys kohya takes elsewhere and kohya keys shoestring does "
      "not implement are errors naming the file, table and key. See [datasets.md](datasets.md).\n\n"
      "| key | where | default | meaning |\n|---|---|---|---|\n";
  for (const auto& k : dataset_keys()) {
    out += fmt::format("| `{}` | {} | {} | {} |\n", k.key, levels_text(k.levels), k.kohya_default, k.help);
  }
  out += fmt::format("\nkohya keys not implemented (an error): {}.\n",
                     fmt::format("`{}`", fmt::join(unimplemented_kohya_keys(), "`, `")));
  return out;
}

}  // namespace shoestring
