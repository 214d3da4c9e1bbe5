// The LDM families' caches on disk (kohya's cache_latents_to_disk and
// cache_text_encoder_outputs_to_disk), on io/tensor_cache.h's shards:
// where they live, what their entries are keyed by, and `shoestring cache`.
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
#include <cstdint>
#include <string>
#include <vector>

#include "shoestring/io/tensor_cache.h"
#include "shoestring/io/weight_files.h"

namespace shoestring {

struct TrainConfig;

/// Part of every cache key; bumped when what an entry holds for the same
/// inputs changes (image decoding, VAE / text-encoder forward).
inline constexpr const char* kLdmCacheVersion = "ldm-cache-1";

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
