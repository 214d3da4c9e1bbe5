// Word-level tokenizer built from a dataset's captions: the text input of the
// small from-scratch models (no pretrained text encoder needed). Words are
// lowercase runs of [a-z0-9]; ids are assigned by frequency, deterministically.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <nlohmann/json_fwd.hpp>

namespace shoestring {

/// Word-level tokenizer. Vocabulary: id 0 = "<pad>", 1 = "<unk>", 2 = "<bos>",
/// then the caption words, most frequent first, ties broken alphabetically
/// (byte order), so the same captions always give the same ids.
/// A caption encodes to exactly max_length ids: <bos>, the word ids (unknown
/// words -> <unk>), truncated to max_length, padded with <pad>. The empty
/// caption encodes to <bos> + padding: the unconditional input used by
/// classifier-free guidance (Ho & Salimans 2022).
class WordTokenizer {
 public:
  static constexpr int64_t kPad = 0;
  static constexpr int64_t kUnk = 1;
  static constexpr int64_t kBos = 2;
  static constexpr int64_t kNumSpecial = 3;

  /// Splits text into words: maximal runs of ASCII letters and digits,
  /// lowercased; every other byte (punctuation, spaces, non-ASCII) separates.
  static std::vector<std::string> split_words(std::string_view text);

  /// Builds the vocabulary from `captions`, keeping words seen at least
  /// `min_count` times. Throws shoestring::Error if max_length < 1 or
  /// min_count < 1.
  static WordTokenizer build(const std::vector<std::string>& captions, int64_t max_length, int64_t min_count = 1);

  /// Restores a tokenizer saved with to_json. Throws shoestring::Error naming
  /// the key when the json is malformed (wrong kind, missing/mistyped keys,
  /// special tokens not at ids 0..2, duplicate or invalid words).
  static WordTokenizer from_json(const nlohmann::json& j);

  /// {"kind": "word", "max_length": L, "vocab": ["<pad>", "<unk>", "<bos>", words...]}.
  nlohmann::json to_json() const;

  /// Exactly max_length() ids (see the class comment).
  std::vector<int64_t> encode(std::string_view caption) const;

  /// int64 [B, max_length()]: encode() of each caption, one per row.
  at::Tensor encode_batch(const std::vector<std::string>& captions) const;

  /// For debugging: the words of `ids` joined by spaces; <pad> and <bos> are
  /// dropped, <unk> is written as "<unk>". Throws shoestring::Error for an id
  /// outside [0, vocab_size()).
  std::string decode(const std::vector<int64_t>& ids) const;

  /// Number of ids, special tokens included.
  int64_t vocab_size() const { return static_cast<int64_t>(vocab_.size()); }
  /// Number of ids every encoding has.
  int64_t max_length() const { return max_length_; }
  /// Token strings by id.
  const std::vector<std::string>& vocab() const { return vocab_; }
  /// Id of `word` (already lowercase), or kUnk if not in the vocabulary.
  int64_t id_of(std::string_view word) const;

 private:
  WordTokenizer(std::vector<std::string> vocab, int64_t max_length);

  std::vector<std::string> vocab_;
  std::unordered_map<std::string, int64_t> ids_;
  int64_t max_length_ = 0;
};

}  // namespace shoestring
