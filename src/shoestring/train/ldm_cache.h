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
#include <cstdint>
#include <string>
#include <vector>

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

/// What the caches of one run (or `shoestring cache`) held and did.
struct LdmCacheStats {
  std::string dir;                 ///< ldm_cache_dir
  int64_t latent_entries = 0;      ///< distinct latent entries the dataset needs (0: latents not on disk)
  int64_t latents_encoded = 0;     ///< of them, encoded now
  int64_t text_entries = 0;        ///< distinct text entries (captions, "", sample prompts; 0: not on disk)
  int64_t text_encoded = 0;        ///< of them, encoded now
  std::vector<std::string> problems;  ///< corrupt / unreadable shards found (then encoded again), by file
};

/// `shoestring cache CONFIG`: loads the config's dataset as `train` does and
/// brings both disk caches (latents and text-encoder outputs, whatever the
/// two cache keys say) up to date for it, encoding only the entries missing;
/// builds no UNet and writes no run folder. Logs one line per cache
/// ("latent cache: 0 of N entries encoded, N reused (DIR)"). Throws
/// shoestring::Error for a config whose architecture is not an LDM one, and
/// whatever loading the dataset and encoders throws.
LdmCacheStats build_ldm_caches(const TrainConfig& config, bool quiet = false);

}  // namespace shoestring
