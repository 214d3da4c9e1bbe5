// T5's tokenizer: a SentencePiece unigram model read from the user's
// `spiece.model` (google/t5-v1_1-xxl, diffusers' `tokenizer_3/` of SD3 /
// SD3.5; the file must come with the user's model files) and run by
// data/sentencepiece.h. Ids: the model's own pieces (32000 for T5: pad 0
// "<pad>", eos 1 "</s>", unk 2 "<unk>", no BOS), EOS appended.
//
// What this reproduces: SentencePiece's EncodeAsIds + [EOS], which is Hugging
// Face's T5Tokenizer(Fast) for ordinary prompts (the model's own normaliser:
// NFKC, whitespace runs collapsed, ends trimmed; a "▁" prefix). Not
// reproduced: the 100 `<extra_id_N>` sentinels (ids 32000..32099, HF's
// additions, unused by SD3) and HF's parsing of special-token text inside a
// prompt (a literal "</s>" is tokenized as characters here, as SentencePiece
// does, where HF maps it to id 1).
//
// Lengths (how SD3 trainers call it):
//  - tokenize(texts, max_length, pad): kohya sd-scripts (strategy_sd3.py,
//    `--t5xxl_max_token_length`, default 256; HF padding="max_length",
//    truncation=True): pieces cut to max_length - 1, EOS, padding with 0 to
//    max_length (or, with pad = false, to the longest row);
//  - tokenize_min_length(texts, 77): Stability's sd3.5 reference code
//    (other_impls.py T5XXLTokenizer: min_length 77, no truncation) and ComfyUI:
//    every piece, EOS, padding with 0 to at least 77 (to the longest row in a batch).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/core/Tensor.h>

#include "shoestring/data/sentencepiece.h"

namespace shoestring {

/// A padded batch of token ids.
struct T5Tokens {
  /// int64 [B, L]: pieces, EOS (1), then padding (0).
  at::Tensor ids;
  /// int64 [B, L]: 1 at pieces and EOS, 0 at padding (HF's attention_mask).
  at::Tensor attention_mask;
};

/// SentencePiece tokenizer for T5. Immutable after loading; copies share the
/// model; encode / tokenize are thread-safe.
class T5Tokenizer {
 public:
  /// Loads a SentencePiece model file (`spiece.model`). Throws
  /// shoestring::Error naming the path when the file is missing or
  /// unreadable, is not a usable SentencePiece unigram model
  /// (SentencePieceModel::parse), or defines no EOS or padding piece.
  static T5Tokenizer load(const std::string& spiece_model);

  /// Pieces of `text` (UTF-8; a malformed byte reads as U+FFFD, as in
  /// SentencePiece) followed by EOS; "" gives {EOS}.
  std::vector<int64_t> encode(std::string_view text) const;
  /// The kohya / HF convention (see the file comment): each row is
  /// encode(text) with the pieces cut to max_length - 1 so EOS stays last,
  /// padded with pad_id() to max_length (`pad`) or to the longest row.
  /// Throws shoestring::Error when max_length < 1.
  T5Tokens tokenize(const std::vector<std::string>& texts, int64_t max_length = 256, bool pad = true) const;
  /// Stability's reference convention: encode(text) uncut, padded with
  /// pad_id() to max(min_length, longest row). Throws shoestring::Error when
  /// min_length < 1.
  T5Tokens tokenize_min_length(const std::vector<std::string>& texts, int64_t min_length = 77) const;
  /// Text of `ids` (pad and EOS dropped), for logs and debugging. Throws
  /// shoestring::Error for an id outside [0, piece_count()).
  std::string decode(const std::vector<int64_t>& ids) const;

  int64_t eos_id() const { return eos_; }
  int64_t pad_id() const { return pad_; }
  /// The id unknown characters map to (-1 when the model has none).
  int64_t unk_id() const { return unk_; }
  /// Number of pieces in the model (32000 for T5's spiece.model).
  int64_t piece_count() const { return model_->size(); }
  const std::string& path() const { return path_; }
  const SentencePieceModel& model() const { return *model_; }

 private:
  T5Tokenizer() = default;
  T5Tokens pad_rows(std::vector<std::vector<int64_t>> rows, int64_t length) const;

  std::shared_ptr<const SentencePieceModel> model_;
  std::string path_;
  int64_t eos_ = 1, pad_ = 0, unk_ = 2;
};

}  // namespace shoestring
