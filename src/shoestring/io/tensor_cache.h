// A content-addressed cache of tensor entries on disk: the LDM families'
// latent and text-encoder caches (train/ldm_cache.h; kohya's
// cache_latents_to_disk / cache_text_encoder_outputs_to_disk).
//
// A cache is a folder of immutable safetensors shards and manifests:
//
//   <dir>/manifest-<writer>.json        the shards one writer added, in order
//   <dir>/<writer>-NNNNNN.safetensors   one shard: a few hundred entries
//
// An entry is a short list of named tensors stored under "<key>.<name>"; its
// key (32 hex digits) is a hash of everything the tensors depend on, chosen
// by the caller. Each entry carries a checksum (core/content_hash.h over its
// tensors' dtype, shape and bytes), kept in the manifest and in the shard's
// own metadata ("shoestring.cache_entries"), so a shard is self-describing.
//
// Writes: a shard is written whole and atomically (io/atomic_file.h), then
// the writer's manifest is rewritten atomically to list it. A process killed
// between the two leaves a complete shard the manifest does not list: the
// next open adopts it from its metadata (nothing is encoded twice); killed
// inside a write, it leaves a temporary, removed on the next open for
// writing. Nothing ever reads a half-written shard.
//
// Data parallel: each rank opens the cache as writer "r<rank>", encodes its
// disjoint share of the missing keys (train/ldm_cache.h, cache_key_owner)
// into its own shards and manifest, and every reader takes the union of all
// manifests (and shards), so writers never touch each other's files. One process writes as a given writer at a time (a
// FolderLock on
// "<dir>/.lock-<writer>").
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "shoestring/io/atomic_file.h"
#include "shoestring/io/safetensors.h"

namespace shoestring {

/// One entry to write: its key and its tensors, in order, by name (names of
/// letters, digits and '_'; the tensors on any device, any dtype the format has).
struct CacheEntry {
  std::string key;
  std::vector<std::pair<std::string, at::Tensor>> tensors;
};

/// What TensorCache::verify found.
struct CacheVerifyReport {
  int64_t shards_checked = 0;
  int64_t entries_checked = 0;
  /// One line per shard that failed ("<path>: <why>"); its entries are
  /// dropped from the index (to be encoded again) and, when the shard is this
  /// writer's, the file is deleted and the manifest rewritten without it.
  std::vector<std::string> problems;
  /// The paths of those shards (for TensorCache::exclude_shards of a later open).
  std::vector<std::string> failed_shards;
};

/// The checksum of an entry's tensors: content_hash64 over, per tensor in
/// order, its name, dtype name, shape and contiguous CPU bytes.
uint64_t cache_entry_checksum(const std::vector<std::pair<std::string, at::Tensor>>& tensors);

class TensorCache {
 public:
  /// Opens (creating it when `writer` is not empty) the cache folder `dir`.
  /// `kind` ("latents", "text") is recorded in manifests and shards, and a
  /// folder of another kind is refused. With a writer: takes the writer's
  /// lock (throws naming the folder when another process holds it), removes
  /// the temporaries killed writes left, and adopts this writer's shards the
  /// manifest does not list yet. Reads every manifest-*.json (and adopts
  /// every unlisted shard into the index, whoever wrote it). Throws
  /// shoestring::Error naming the file and key for an unreadable or
  /// malformed manifest, or a folder of another kind. A shard that is
  /// unreadable (truncated, not safetensors) is not an error here: verify()
  /// reports it.
  static TensorCache open(const std::string& dir, const std::string& kind, const std::string& writer = "r0");

  TensorCache(TensorCache&&) noexcept;
  TensorCache& operator=(TensorCache&&) noexcept;
  ~TensorCache();

  const std::string& dir() const;
  /// Entries in the index (valid as far as known: see verify).
  int64_t size() const;
  /// True when `key` is in the index.
  bool contains(const std::string& key) const;
  /// Every key in the index, sorted.
  std::vector<std::string> keys() const;
  /// Path of the shard that holds `key` ("" when absent).
  std::string shard_of(const std::string& key) const;
  /// Log lines of what open() did that a user should know (shards adopted,
  /// temporaries removed).
  const std::vector<std::string>& notes() const;

  /// Checks the shards holding any of `keys`: each opens as a valid
  /// safetensors file of this kind, and every entry's tensors match its
  /// checksum. Failing shards are dropped (see CacheVerifyReport::problems);
  /// an entry another shard also holds falls back to that copy, checked too.
  /// Memory: one shard at a time. Throws shoestring::Error naming the shard
  /// when it exists but this process may not read it (a permission error is
  /// not damage: the shard is neither dropped nor deleted).
  CacheVerifyReport verify(const std::vector<std::string>& keys);
  /// Drops the shards at `paths` (CacheVerifyReport::failed_shards of an
  /// earlier verify, maybe of another TensorCache over this folder) from the
  /// index without touching the files: their entries fall back to other
  /// shards' copies, or count as absent. Paths not in the folder are ignored.
  void exclude_shards(const std::vector<std::string>& paths);

  /// Writes `entries` as one new shard of this writer, then its manifest
  /// (each atomically). Entries whose key is already in the index are
  /// written again (the new copy wins). Throws shoestring::Error when the
  /// cache was opened without a writer, for a bad tensor name, and whatever
  /// the writes throw.
  void write_shard(const std::vector<CacheEntry>& entries);

  /// The tensors of `key`, in the order written, as owned CPU tensors (not
  /// views of the mapping), verified against the entry's checksum. At most
  /// a few shards stay mapped (least recently used first out), so reading a
  /// large cache entry by entry keeps host memory bounded. Throws
  /// shoestring::Error naming the key when absent, and naming the shard and
  /// key when the bytes do not match the checksum or the shard cannot be read
  /// (changed since verify; `shoestring cache` encodes it again).
  std::vector<at::Tensor> read(const std::string& key) const;

 private:
  struct State;
  /// verify's check of shard `i`: dropped (and reported) when it fails.
  void verify_shard(size_t i, CacheVerifyReport& report);
  explicit TensorCache(std::unique_ptr<State> s);
  std::unique_ptr<State> s_;
};

}  // namespace shoestring
