#include "shoestring/train/ldm_cache.h"

#include <algorithm>
#include <filesystem>
#include <map>
#include <optional>
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
#include "shoestring/train/ldm_components.h"
#include "shoestring/train/training_model.h"

namespace shoestring {
namespace fs = std::filesystem;

std::string cache_dtype_key(at::ScalarType dtype) { return to_string(st_dtype_of(dtype)); }

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
  if (arch.family != models::Family::ldm_unet && arch.family != models::Family::mmdit &&
      arch.family != models::Family::stage_c) {
    fail("cache: model.architecture = \"{}\" trains on images, not cached latents; `shoestring cache` is for the "
         "latent architectures (sd15, sdxl, ssd1b, sd35m, cascade-c, cascade-c-lite)",
         c.architecture);
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

namespace {

// A shard is written once it holds this many entries or bytes...
constexpr size_t kShardEntries = 256;
constexpr int64_t kShardBytes = int64_t{64} << 20;
// ... or this long after the last write, so a killed run loses at most this much encoding.
constexpr std::chrono::seconds kShardInterval{30};

/// The log's note of entries other ranks encoded ("" when none).
std::string by_others(int64_t waited) {
  return waited > 0 ? fmt::format(" (and {} by the other ranks)", waited) : std::string();
}

/// Opens the cache folder `dir` and checks the shards holding `keys`.
/// Reading needs no lock and no write access, so unless `tidy` the cache is
/// first opened to read; only when an entry this rank owns (`share`,
/// cache_key_owner) is missing (or was in a damaged shard), or with `tidy`
/// (`shoestring cache`), is it opened as `writer` (taking that writer's
/// lock, removing its interrupted writes' temporaries, recording its
/// unlisted shards in its manifest, deleting its damaged ones) and checked,
/// for the caller to encode what is missing. `*writing` says which it is.
/// The paths of the damaged shards found go to `damaged`: a later open of
/// the folder (to read what was encoded) must leave them out, since another
/// writer's damaged shard stays on disk, and its manifest still lists its
/// entries, until that writer deletes it.
TensorCache open_cache(const std::string& dir, const char* kind, const std::vector<std::string>& keys,
                       const DiskCacheRun& run, const char* what, std::vector<std::string>& problems,
                       std::vector<std::string>& damaged, bool* writing) {
  // The keys the writer checks: all of them (tidy), else those the read-only
  // check found missing or damaged (the intact shards are not read twice).
  std::vector<std::string> to_check = keys;
  if (!run.tidy) {
    TensorCache cache = TensorCache::open(dir, kind, "");
    const CacheVerifyReport checked = cache.verify(keys);
    damaged.insert(damaged.end(), checked.failed_shards.begin(), checked.failed_shards.end());
    to_check.clear();
    for (const std::string& k : keys) {
      if (!cache.contains(k) && cache_key_owner(k, run.share.world_size) == run.share.rank) to_check.push_back(k);
    }
    *writing = !to_check.empty();
    if (!*writing) return cache;
  }
  *writing = true;
  std::optional<TensorCache> opened;
  try {
    opened.emplace(TensorCache::open(dir, kind, run.writer));
  } catch (const Error& e) {
    // Name the setting that chose the folder: a cache is the one write a run makes outside output_dir.
    fail("{} cache (cache_dir, else .shoestring-cache beside the dataset): {}", what, e.what());
  }
  TensorCache cache = std::move(*opened);
  cache.exclude_shards(damaged);
  const CacheVerifyReport report = cache.verify(to_check);  // deletes this writer's damaged shards
  damaged.insert(damaged.end(), report.failed_shards.begin(), report.failed_shards.end());
  if (!run.quiet) {
    for (const std::string& n : cache.notes()) spdlog::info("{} cache: {}", what, n);
  }
  for (const std::string& p : report.problems) {
    spdlog::warn("{} cache: {}; its entries are encoded again", what, p);
    problems.push_back(p);
  }
  return cache;
}

}  // namespace

ShardWriter::ShardWriter(TensorCache& cache) : cache_(cache), last_(std::chrono::steady_clock::now()) {}

void ShardWriter::add(CacheEntry entry) {
  for (const auto& [name, t] : entry.tensors) bytes_ += t.nbytes();
  pending_.push_back(std::move(entry));
  ++added_;
  if (pending_.size() >= kShardEntries || bytes_ >= kShardBytes ||
      std::chrono::steady_clock::now() - last_ >= kShardInterval)
    flush();
}

void ShardWriter::flush() {
  if (pending_.empty()) return;
  cache_.write_shard(pending_);
  pending_.clear();
  bytes_ = 0;
  last_ = std::chrono::steady_clock::now();
}

FilledCache fill_disk_cache(const std::string& dir, const char* kind, const char* what,
                            const std::vector<std::string>& keys, const DiskCacheRun& run,
                            std::vector<std::string>& problems,
                            const std::function<void(const std::vector<size_t>&, ShardWriter&)>& encode) {
  bool writing = false;
  std::vector<std::string> damaged;  // shards to leave out when the folder is opened again
  TensorCache cache = open_cache(dir, kind, keys, run, what, problems, damaged, &writing);
  std::set<std::string> distinct;
  std::vector<size_t> missing;
  int64_t by_other_ranks = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!distinct.insert(keys[i]).second || cache.contains(keys[i])) continue;
    if (cache_key_owner(keys[i], run.share.world_size) != run.share.rank) {
      ++by_other_ranks;  // another rank's share: waited for below
      continue;
    }
    missing.push_back(i);
  }
  int64_t encoded = 0;
  if (!missing.empty()) {
    ShardWriter shards(cache);
    encode(missing, shards);
    shards.flush();
    encoded = shards.added();
  }
  // Training reads without the writer's lock: other runs may share the folder.
  if (run.share.world_size > 1) {
    cache = wait_for_cache_entries(dir, kind, keys, run.share, what, damaged);
  } else if (writing) {
    cache = TensorCache::open(dir, kind, "");
    cache.exclude_shards(damaged);
  }
  const int64_t waited = run.share.world_size > 1 ? by_other_ranks : 0;
  const auto entries = static_cast<int64_t>(distinct.size());
  if (!run.quiet) {
    spdlog::info("{} cache: {} of {} entries encoded{}, {} reused ({})", what, encoded, entries, by_others(waited),
                 entries - encoded - waited, cache.dir());
  }
  return FilledCache{std::move(cache), entries, encoded, waited};
}

std::vector<std::string> latent_entry_keys(const ImageCaptionDataset& dataset, const std::string& head) {
  const int64_t n = dataset.size();
  std::vector<std::string> keys(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    std::string geometry;
    if (dataset.bucketed()) {
      const ImageGeometry& g = dataset.geometry(i);
      const BucketReso reso = dataset.buckets()[static_cast<size_t>(dataset.bucket_of(i))].reso;
      geometry = fmt::format("bucket {}x{} resized {}x{} crop {},{}", reso.width, reso.height, g.resized.width,
                             g.resized.height, g.crop.x, g.crop.y);
    } else {
      geometry = fmt::format("square {}", dataset.resolution());
    }
    const std::string& path = dataset.paths()[static_cast<size_t>(i)];
    keys[static_cast<size_t>(i)] = content_key128(
        fmt::format("{}|image {}|{}|flip {}", head, file_content_key(path), geometry, dataset.flip_aug(i) ? 1 : 0));
  }
  return keys;
}

void encode_missing_latents(const ImageCaptionDataset& dataset, const std::vector<std::string>& keys,
                            const std::vector<size_t>& missing, ShardWriter& shards, at::Device device,
                            at::ScalarType cache_dtype,
                            const std::function<at::Tensor(const at::Tensor&)>& encode) {
  torch::NoGradGuard no_grad;
  const std::set<size_t> wanted(missing.begin(), missing.end());
  // Images whose pixels cannot be decoded (only their headers were read at
  // load): the others are encoded and kept, then the run stops naming them all.
  std::vector<std::string> undecodable;
  // Each group's missing images, in the batches encode_bucket_latents makes (the same bits as in memory).
  for (const std::vector<int64_t>& images : latent_groups(dataset)) {
    std::vector<int64_t> todo;
    for (const int64_t i : images)
      if (wanted.count(static_cast<size_t>(i))) todo.push_back(i);
    if (todo.empty()) continue;
    const int64_t chunk = latent_chunk_size(dataset, images);
    const auto m = static_cast<int64_t>(todo.size());
    for (int64_t i = 0; i < m; i += chunk) {
      std::vector<int64_t> idx(todo.begin() + i, todo.begin() + std::min(m, i + chunk));
      at::Tensor pixels;
      try {
        pixels = dataset.batch_images(idx);  // decoded now (DatasetSelection::decode_on_demand)
      } catch (const Error&) {
        std::vector<int64_t> decodable;
        for (const int64_t k : idx) {
          try {
            (void)dataset.batch_images({k});
            decodable.push_back(k);
          } catch (const Error& e) {
            undecodable.push_back(e.what());
          }
        }
        idx = decodable;
        if (idx.empty()) continue;
        pixels = dataset.batch_images(idx);
      }
      pixels = pixels.to(device);
      const at::Tensor latents = encode(pixels).to(at::kCPU, cache_dtype);
      bool any_flip = false;
      for (const int64_t k : idx) any_flip = any_flip || dataset.flip_aug(k);
      at::Tensor mirrored;
      if (any_flip) mirrored = encode(pixels.flip({3})).to(at::kCPU, cache_dtype);
      for (size_t r = 0; r < idx.size(); ++r) {
        const auto rr = static_cast<int64_t>(r);
        CacheEntry e{keys[static_cast<size_t>(idx[r])], {{"latent", latents[rr]}}};
        if (dataset.flip_aug(idx[r])) e.tensors.emplace_back("flipped", mirrored[rr]);
        shards.add(std::move(e));
      }
    }
  }
  if (!undecodable.empty()) {
    shards.flush();
    const size_t shown = std::min<size_t>(undecodable.size(), 5);
    fail(
        "{} image{} cannot be decoded ({}{}); the other images' latents are in the cache. Latents encoded into the "
        "disk cache (cache_latents_to_disk, `shoestring cache`) decode each image only then (its header alone is read "
        "at load, so it is not skipped there): fix or remove {}",
        undecodable.size(), undecodable.size() == 1 ? "" : "s",
        fmt::join(undecodable.begin(), undecodable.begin() + static_cast<std::ptrdiff_t>(shown), "; "),
        undecodable.size() > shown ? fmt::format("; and {} more", undecodable.size() - shown) : "",
        undecodable.size() == 1 ? "the file" : "the files");
  }
}

std::pair<at::Tensor, at::Tensor> read_cached_latents(TensorCache& cache, const std::vector<std::string>& keys,
                                                      const std::vector<int64_t>& idx, bool flip) {
  std::vector<at::Tensor> rows_x0, rows_mirror;
  for (const int64_t i : idx) {
    std::vector<at::Tensor> entry = cache.read(keys.at(static_cast<size_t>(i)));
    rows_x0.push_back(entry[0]);
    rows_mirror.push_back(entry.size() > 1 ? entry[1] : entry[0]);  // no mirror: never drawn
  }
  at::Tensor mirror;
  if (flip) mirror = torch::stack(rows_mirror).to(torch::kFloat32);
  return {torch::stack(rows_x0).to(torch::kFloat32), mirror};
}

}  // namespace shoestring
