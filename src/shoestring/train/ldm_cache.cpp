#include "shoestring/train/ldm_cache.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <thread>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "shoestring/core/content_hash.h"
#include "shoestring/core/device.h"
#include "shoestring/core/error.h"
#include "shoestring/core/threads.h"
#include "shoestring/data/dataset.h"
#include "shoestring/io/atomic_file.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/models/architecture.h"
#include "shoestring/train/config.h"
#include "shoestring/train/dataset_config.h"
#include "shoestring/train/device_precision.h"
#include "shoestring/train/training_model.h"

namespace shoestring {
namespace fs = std::filesystem;

std::string ldm_cache_dir(const TrainConfig& config) {
  if (!config.cache_dir.empty()) return expand_path(config.cache_dir);
  if (!config.dataset_config.empty()) {
    return (fs::path(expand_path(config.dataset_config)).parent_path() / ".shoestring-cache").string();
  }
  return (fs::path(expand_path(config.train_data_dir)) / ".shoestring-cache").string();
}

std::string file_content_key(const std::string& path) { return content_key128(read_file(path)); }

std::string weights_identity(const WeightFiles& files, const std::string& prefix, const std::string& memo_dir) {
  std::vector<std::string> names;
  for (const std::string& n : files.names()) {
    if (n.compare(0, prefix.size(), prefix) == 0) names.push_back(n);
  }
  if (names.empty()) fail("{}: no tensor named '{}*' to identify", files.path(), prefix);
  std::sort(names.begin(), names.end());
  // The memo key: the files holding those tensors, with sizes and times.
  std::set<std::string> holders;
  for (const std::string& n : names) holders.insert(files.file_of(n));
  std::string memo_key = "prefix=" + prefix;
  for (const std::string& f : holders) {
    std::error_code ec;
    const std::string canonical = fs::weakly_canonical(f, ec).string();
    const auto size = fs::file_size(f, ec);
    const auto time = fs::last_write_time(f, ec).time_since_epoch().count();
    memo_key += fmt::format("|{}:{}:{}", canonical, static_cast<uint64_t>(size), static_cast<int64_t>(time));
  }
  const std::string memo_path = memo_dir.empty() ? "" : (fs::path(memo_dir) / "encoders.json").string();
  nlohmann::json memo = nlohmann::json::object();
  if (!memo_path.empty() && fs::exists(memo_path)) {
    try {
      memo = nlohmann::json::parse(read_file(memo_path));
    } catch (const nlohmann::json::exception&) {
      memo = nlohmann::json::object();  // a memo only: rebuilt
    }
    if (!memo.is_object()) memo = nlohmann::json::object();
    auto it = memo.find(memo_key);
    if (it != memo.end() && it->is_string()) return it->get<std::string>();
  }
  std::string text = "weights";
  uint64_t a = 0x7765696768747331ull, b = 0x7765696768747332ull;
  for (const std::string& n : names) {
    const TensorInfo* info = files.find(n);
    const at::Tensor t = files.get(n);  // raw bytes (fp8 as uint8 without float8), zero-copy
    const std::string head = fmt::format("{}|{}|{}", n, to_string(info->dtype), fmt::join(info->shape, "x"));
    a = content_hash64(head, a);
    b = content_hash64(head, b);
    a = content_hash64(t.data_ptr(), static_cast<size_t>(t.nbytes()), a);
    b = content_hash64(t.data_ptr(), static_cast<size_t>(t.nbytes()), b);
  }
  const std::string identity = hex64(a) + hex64(b);
  if (!memo_path.empty()) {
    memo[memo_key] = identity;
    ensure_writable_dir(memo_dir);
    write_bytes_atomic(memo_path, memo.dump(1) + "\n");
  }
  return identity;
}

CacheShare cache_share(int rank, int world_size, double ddp_timeout_minutes) {
  CacheShare share;
  share.rank = rank;
  share.world_size = world_size;
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(ddp_timeout_minutes * 60'000));
  share.patience = std::max<std::chrono::milliseconds>(timeout, std::chrono::minutes(10));
  return share;
}

int cache_key_owner(const std::string& key, int world_size) {
  if (world_size < 1) fail("cache_key_owner: world size {} must be at least 1", world_size);
  const size_t n = std::min<size_t>(key.size(), 8);
  uint64_t v = 0;
  for (size_t i = key.size() - n; i < key.size(); ++i) {
    const char ch = key[i];
    int d = -1;
    if (ch >= '0' && ch <= '9') d = ch - '0';
    if (ch >= 'a' && ch <= 'f') d = ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F') d = ch - 'A' + 10;
    if (d < 0) fail("cache key '{}' is not hexadecimal", key);
    v = v * 16 + static_cast<uint64_t>(d);
  }
  if (n == 0) fail("cache key is empty");
  return static_cast<int>(v % static_cast<uint64_t>(world_size));
}

TensorCache wait_for_cache_entries(const std::string& dir, const std::string& kind,
                                   const std::vector<std::string>& keys, const CacheShare& share, const char* what,
                                   const std::vector<std::string>& excluded) {
  using clock = std::chrono::steady_clock;
  const std::set<std::string> wanted(keys.begin(), keys.end());
  auto count_missing = [&](const TensorCache& cache) {
    int64_t missing = 0;
    for (const std::string& k : wanted) missing += cache.contains(k) ? 0 : 1;
    return missing;
  };
  TensorCache cache = TensorCache::open(dir, kind, "");
  cache.exclude_shards(excluded);
  int64_t missing = count_missing(cache);
  auto last_progress = clock::now();
  bool announced = false;
  while (missing > 0) {
    if (clock::now() - last_progress >= share.patience) {
      std::map<int, int64_t> by_rank;
      for (const std::string& k : wanted) {
        if (!cache.contains(k)) ++by_rank[cache_key_owner(k, share.world_size)];
      }
      std::vector<std::string> parts;
      for (const auto& [r, n] : by_rank) parts.push_back(fmt::format("rank {}: {}", r, n));
      fail(
          "{} cache {}: rank {} waited {:.1f} min without a new entry from the other ranks; {} entr{} still missing "
          "({}). A rank encodes the entries it owns into this folder, which every rank must see (one file system); "
          "did a rank stop, or is its encoding slower than that (the wait is ddp_timeout, at least 10 min)?",
          what, dir, share.rank, std::chrono::duration<double>(share.patience).count() / 60.0, missing,
          missing == 1 ? "y is" : "ies are", fmt::join(parts, ", "));
    }
    if (!announced) {
      spdlog::info("{} cache: waiting for {} entr{} the other ranks encode", what, missing, missing == 1 ? "y" : "ies");
      announced = true;
    }
    std::this_thread::sleep_for(std::chrono::seconds(1));
    TensorCache again = TensorCache::open(dir, kind, "");
    again.exclude_shards(excluded);
    const int64_t now_missing = count_missing(again);
    if (now_missing < missing) last_progress = clock::now();
    missing = now_missing;
    cache = std::move(again);
  }
  return cache;
}

LdmCacheStats build_ldm_caches(const TrainConfig& config_in, bool quiet, const CacheShare& share) {
  TrainConfig c = config_in;
  const models::Architecture& arch = models::find_architecture(c.architecture);
  if (arch.family != models::Family::ldm_unet) {
    fail("cache: model.architecture = \"{}\" {}; `shoestring cache` is for the LDM architectures (sd15, sdxl, ssd1b)",
         c.architecture,
         arch.family == models::Family::stage_c
             ? "keeps its latents and text embeddings in memory (no disk caches for Stable Cascade yet)"
             : "trains on images, not cached latents");
  }
  const c10::Device device = resolve_device(c.device, "device");
  adapt_precision_to_device(c, device);  // the cache dtype follows the run's storage dtype
  check_training_config(c);
  configure_threads(c.num_threads);
  torch::manual_seed(static_cast<uint64_t>(c.seed));
  // An image is decoded only when its latent entry is missing.
  const DatasetSelection selection{c.max_train_images, static_cast<uint64_t>(c.max_train_images_seed),
                                   /*decode_on_demand=*/true};
  ImageCaptionDataset dataset;
  if (uses_kohya_datasets(c)) {
    const std::vector<DatasetSpec> specs = dataset_specs(c);
    check_training_datasets(c, specs);
    dataset = ImageCaptionDataset::load_buckets(specs, static_cast<uint64_t>(c.seed), selection);
  } else {
    dataset = ImageCaptionDataset::load(expand_path(c.train_data_dir), static_cast<int>(c.resolution),
                                        c.twemoji_categories, selection);
  }
  if (!quiet) {
    spdlog::info("dataset: {} images ({} skipped)", dataset.size(), dataset.skipped().size());
    for (const SkippedImage& sk : dataset.skipped()) {
      // Most reasons start with the file's path already.
      spdlog::warn("  skipped {}", sk.reason.rfind(sk.path, 0) == 0 ? sk.reason : sk.path + ": " + sk.reason);
    }
  }
  c.cache_latents_to_disk = true;
  c.cache_text_encoder_outputs_to_disk = true;
  LdmCacheStats stats;
  ModelSource source;
  if (!c.pretrained_model_name_or_path.empty()) source.pretrained = expand_path(c.pretrained_model_name_or_path);
  source.device = device;
  source.quiet = quiet;
  source.encode_only = true;
  source.cache_stats = &stats;
  source.cache_share = share;
  make_training_model(c, dataset, source);
  return stats;
}

}  // namespace shoestring
