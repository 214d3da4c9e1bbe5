// The latent families' caches on disk (kohya's cache_latents_to_disk and
// cache_text_encoder_outputs_to_disk) for the LDM UNets, SD3.5 Medium and
// Stable Cascade stage C, on io/tensor_cache.h's shards: where they live,
// what their entries are keyed by, how a run fills them (fill_disk_cache,
// the latents' encode_missing_latents), and `shoestring cache`. The keys
// below are the LDM families'; SD3 and Cascade key their text entries by
// their own encoders and token ids (train/sd3_model.cpp,
// train/cascade_model.cpp) and their latent entries as below with their own
// encoder (the SD3 VAE, the EfficientNet).
//
// Entries and their keys (content_key128 of a canonical text, so any change
// of what an entry depends on gives another key and only that entry is
// encoded again; kLdmCacheVersion is part of every key and changes when the
// encoding itself changes):
//  - latents (cache_dir/latents), one entry per image: "latent" [4, h, w]
//    (the VAE posterior's mean, scaled) and, for an image of a flip_aug
//    subset, "flipped" (its mirror image's), in the cache dtype (bf16 with
//    full_bf16, else fp32). Keyed by the image file's content hash, the VAE's
//    weights identity (weights_identity), the training size, resized size
//    and crop of the image (bucket geometry; square: the resolution), flip,
//    dtype.
//  - text (cache_dir/text), one entry per distinct caption, the empty caption
//    (caption dropout) and each sample prompt: "context" [77, D] (cache
//    dtype) and, SDXL, "pooled" [P] (fp32). Keyed by the caption's token ids
//    (as each encoder is fed them: the tokenizer is part of the key through
//    them), the encoders' weights identities, clip_skip and dtype.
#pragma once
#include <chrono>
#include <functional>
#include <cstdint>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "shoestring/io/tensor_cache.h"
#include "shoestring/io/weight_files.h"

namespace shoestring {

struct TrainConfig;
class ImageCaptionDataset;

/// Part of every cache key; bumped when what an entry holds for the same
/// inputs changes (image decoding, VAE / text-encoder forward).
inline constexpr const char* kLdmCacheVersion = "ldm-cache-1";

/// The name of a cache dtype in keys ("F32", "BF16", ...: the safetensors name).
std::string cache_dtype_key(at::ScalarType dtype);

/// The folder of a run's disk caches: `cache_dir` (expanded) when set;
/// else ".shoestring-cache" inside the folder of `dataset_config` when set,
/// else inside train_data_dir (the folder loaders skip names starting with '.').
std::string ldm_cache_dir(const TrainConfig& config);

/// Hex content hash (content_key128) of the file at `path`'s bytes.
/// Throws shoestring::Error naming the path when it cannot be read.
std::string file_content_key(const std::string& path);

/// The identity of the tensors of `files` whose names start with `prefix`
/// ("" = all): a content hash over their sorted names, dtypes, shapes and
/// bytes, as 32 hex digits. Hashing reads the tensors once; the result is
/// remembered in `<memo_dir>/encoders.json` under the files' paths, sizes and
/// modification times, so an unchanged file is not read again (a file
/// rewritten in place with the same size and time would not be noticed).
/// `memo_dir` "" = no memo. Throws shoestring::Error when no tensor has the
/// prefix, or for unreadable files.
std::string weights_identity(const WeightFiles& files, const std::string& prefix, const std::string& memo_dir);

/// This process's part in filling the disk caches when several processes
/// (the ranks of a data-parallel run, or `shoestring launch -- cache`) share
/// them: each rank encodes the missing entries it owns (cache_key_owner) as
/// its own writer "r<rank>" (io/tensor_cache.h), then waits until the others'
/// entries are on disk too. The processes coordinate through the cache folder
/// alone (it must be one folder all ranks see, as kohya's caches must be):
/// no collective runs while they encode, so encoding longer than ddp_timeout
/// is fine.
struct CacheShare {
  int rank = 0;        ///< 0 <= rank < world_size
  int world_size = 1;  ///< 1: this process encodes every missing entry
  /// How long a rank waits for the other ranks' entries while none appears
  /// before it stops with an error naming the ranks whose share is missing.
  std::chrono::milliseconds patience{std::chrono::minutes(10)};
};

/// The CacheShare of a run whose collectives wait `ddp_timeout_minutes`:
/// patience is that, but at least 10 minutes (one VAE encode of a large
/// image on a CPU takes a minute, and a rank also loads its encoders first).
CacheShare cache_share(int rank, int world_size, double ddp_timeout_minutes);

/// The rank (0 .. world_size - 1) that encodes the entry `key` (a cache key:
/// hex digits, as content_key128 makes them): its last 8 hex digits as a
/// number, mod world_size, so every rank agrees without talking, duplicates
/// of one key have one owner, and shares are even (the keys are hashes).
/// Throws shoestring::Error for world_size < 1 or a key that is not hex.
int cache_key_owner(const std::string& key, int world_size);

/// Waits until every key of `keys` is in the cache folder `dir` (of `kind`:
/// "latents", "text"), re-reading its manifests every second, and returns
/// the cache opened to read (no lock). Used by a rank of a CacheShare after
/// encoding its own share. `what` ("latent", "text") names the cache in
/// messages. Throws shoestring::Error naming the cache folder, the ranks
/// whose entries are missing (cache_key_owner) and how many, when no new
/// entry appeared for `share.patience`; and what TensorCache::open throws.
/// The shards at `excluded` (found damaged by this rank's check; their
/// writer encodes their entries again) never count.
TensorCache wait_for_cache_entries(const std::string& dir, const std::string& kind,
                                   const std::vector<std::string>& keys, const CacheShare& share, const char* what,
                                   const std::vector<std::string>& excluded = {});

/// Encoded entries waiting to be written as one shard of a cache opened as a
/// writer: written once they reach 256 entries or 64 MiB, or 30 s after the
/// last write (a killed run loses at most that much encoding), and by flush().
class ShardWriter {
 public:
  explicit ShardWriter(TensorCache& cache);
  /// Queues `entry` (its tensors are written as they are: CPU, contiguous).
  void add(CacheEntry entry);
  /// Writes what is queued as one shard (nothing when empty).
  void flush();
  /// Entries added so far.
  int64_t added() const { return added_; }

 private:
  TensorCache& cache_;
  std::vector<CacheEntry> pending_;
  int64_t bytes_ = 0, added_ = 0;
  std::chrono::steady_clock::time_point last_;
};

/// How a run (or `shoestring cache`) fills its disk caches.
struct DiskCacheRun {
  CacheShare share;    ///< which entries this process encodes
  std::string writer;  ///< the writer name of this process ("r<rank>")
  bool tidy = false;   ///< `shoestring cache`: open as writer and check every entry, not only the missing ones
  bool quiet = false;  ///< no log lines
};

/// What fill_disk_cache did.
struct FilledCache {
  TensorCache cache;    ///< opened to read (no lock), damaged shards left out
  int64_t entries = 0;  ///< distinct keys
  int64_t encoded = 0;  ///< entries this process encoded
  int64_t waited = 0;   ///< entries missing at the start that other ranks encoded
};

/// Brings the cache folder `dir` of `kind` ("latents", "text"; `what`:
/// "latent", "text" in messages) up to date for `keys` (duplicates allowed):
/// opens it to read, checks the shards holding the keys, and only when an
/// entry this process owns (cache_key_owner) is missing, or with run.tidy,
/// opens it as run.writer (removing that writer's interrupted writes,
/// deleting its damaged shards) and calls `encode(missing, shards)` with the
/// indices into `keys` of the first occurrence of each owned missing key, in
/// order; `encode` adds one entry per index to `shards` (the caller's
/// encoder, in the caller's batches), and may flush and throw (e.g. naming
/// undecodable images). Then, with several ranks, waits for the other ranks'
/// entries (wait_for_cache_entries). Corrupt shards found go to `problems`
/// (a warning each: their entries are encoded again). Logs "{what} cache: N
/// of M entries encoded, K reused (DIR)" unless run.quiet. Throws
/// shoestring::Error naming the folder's setting when it cannot be opened
/// as a writer, and as wait_for_cache_entries and `encode`.
FilledCache fill_disk_cache(const std::string& dir, const char* kind, const char* what,
                            const std::vector<std::string>& keys, const DiskCacheRun& run,
                            std::vector<std::string>& problems,
                            const std::function<void(const std::vector<size_t>&, ShardWriter&)>& encode);

/// The latent entry key of every image of `dataset` (a list parallel to its
/// images): content_key128 of `head` (version, encoder identity, dtype),
/// the image file's content hash, its training geometry (bucket, resized
/// size and crop; square: the resolution) and its flip. Throws
/// shoestring::Error naming an unreadable image file.
std::vector<std::string> latent_entry_keys(const ImageCaptionDataset& dataset, const std::string& head);

/// The encode callback of fill_disk_cache for latents: the images
/// `missing` (indices into `keys`, one per image) bucket by bucket in each
/// bucket's order and in chunks of about 256 K pixels x 4 (the in-memory
/// encoding's batches), each decoded now, encoded by `encode` (pixels [n, 3,
/// H, W] in [-1, 1] on `device` -> latents [n, C, h, w]) into entries
/// "latent" and, for flip_aug images, "flipped" (the mirror image's), in
/// `cache_dtype`. Images that cannot be decoded are skipped; after the
/// others are written, throws shoestring::Error naming them all.
void encode_missing_latents(const ImageCaptionDataset& dataset, const std::vector<std::string>& keys,
                            const std::vector<size_t>& missing, ShardWriter& shards, at::Device device,
                            at::ScalarType cache_dtype,
                            const std::function<at::Tensor(const at::Tensor&)>& encode);

/// float32 latents [B, C, h, w] of images `idx` read from `cache` (entries
/// keyed by `keys`, one per image) and, when `flip`, their mirror images'
/// (an image without one repeats its own: it is never drawn); undefined
/// otherwise. Throws as TensorCache::read.
std::pair<at::Tensor, at::Tensor> read_cached_latents(TensorCache& cache, const std::vector<std::string>& keys,
                                                      const std::vector<int64_t>& idx, bool flip);

/// What the caches of one run (or `shoestring cache`) held and did.
struct LdmCacheStats {
  std::string dir;                    ///< ldm_cache_dir
  int64_t latent_entries = 0;         ///< distinct latent entries the dataset needs (0: latents not on disk)
  int64_t latents_encoded = 0;        ///< of them, encoded now (by this rank, with a CacheShare of several)
  int64_t text_entries = 0;           ///< distinct text entries (captions, "", sample prompts; 0: not on disk)
  int64_t text_encoded = 0;           ///< of them, encoded now (by this rank)
  int64_t latents_waited = 0;         ///< latent entries missing at the start that other ranks encoded
  int64_t text_waited = 0;            ///< text entries missing at the start that other ranks encoded
  std::vector<std::string> problems;  ///< corrupt / unreadable shards found (then encoded again), by file
};

/// `shoestring cache CONFIG`: loads the config's dataset as `train` does and
/// brings both disk caches (latents and text-encoder outputs, whatever the
/// two cache keys say) up to date for it, encoding only the entries missing;
/// builds no UNet and writes no run folder. Logs one line per cache
/// ("latent cache: 0 of N entries encoded, N reused (DIR)"). With a `share`
/// of several ranks, this rank encodes its share and waits for the others'
/// (CacheShare). Throws shoestring::Error for a config whose architecture is
/// not an LDM one, when the other ranks' entries stop appearing (naming
/// them), and whatever loading the dataset and encoders throws.
LdmCacheStats build_ldm_caches(const TrainConfig& config, bool quiet = false, const CacheShare& share = {});

}  // namespace shoestring
