// CLIP's byte-level BPE tokenizer (Radford et al. 2021; OpenAI CLIP
// simple_tokenizer.py, Hugging Face transformers CLIPTokenizer, open_clip
// tokenizer.py), reading a Hugging Face tokenizer folder: `vocab.json`
// (token -> id) and `merges.txt` (one "a b" merge per line, best first, after
// a "#version" header), as shipped in diffusers' `tokenizer/` and
// `tokenizer_2/` folders (runwayml/stable-diffusion-v1-5,
// stabilityai/stable-diffusion-xl-base-1.0), openai/clip-vit-large-patch14 and
// ComfyUI's `comfy/sd1_tokenizer/`. SD 1.x and SDXL's two encoders share the
// same 49408-token vocabulary; only the padding differs (see ClipPadding).
//
// Steps of encode(), as in simple_tokenizer.py:
// 1. clean_text(): HTML entities unescaped (twice, as CLIP's basic_clean),
//    every run of Unicode whitespace replaced by one space, ends trimmed,
//    lowercased. NOT done: ftfy.fix_text (mojibake repair) and Unicode NFC
//    normalisation (HF's fast tokenizer normalises to NFC; text that is
//    already NFC, as nearly all text is, is unaffected); lowercasing covers
//    ASCII, Latin-1, Latin Extended-A, Greek and Cyrillic, not every script.
//    This is OpenAI's / open_clip's clean-up (and HF CLIPTokenizerFast's);
//    HF's slow CLIPTokenizer run WITHOUT ftfy installed instead uses BERT's
//    BasicTokenizer, which also puts spaces around CJK ideographs.
// 2. pre_tokenize(): the regex
//    <\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+
//    (leftmost alternative first); \p{L} / \p{N} are approximated by code-point
//    tables of the common scripts (Latin, Greek, Cyrillic, Armenian, Hebrew,
//    Arabic, Indic letters, Thai, Georgian, Hangul, kana, CJK ideographs,
//    fullwidth forms); combining marks count as "other", as in Unicode.
// 3. Each word's UTF-8 bytes map to printable characters (bytes_to_unicode),
//    the last one gets "</w>", and BPE merges the adjacent pair of lowest rank
//    (all its non-overlapping occurrences, left to right) until no pair is a
//    merge. The two special tokens map to their ids directly.
// 4. Tokens map to ids through vocab.json; a token absent from it (only
//    possible with a vocabulary lacking some byte) becomes <|endoftext|>, HF's
//    unk_token.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>

namespace shoestring {

/// How encode_batch() fills the positions after <|endoftext|>.
enum class ClipPadding {
  /// With <|endoftext|> (49407): HF CLIPTokenizer of openai/clip-vit-large-patch14
  /// (pad_token "<|endoftext|>"): SD 1.x and SDXL embedder 0.
  kEndOfText,
  /// With id 0: open_clip.tokenize (SDXL embedder 1, sgm FrozenOpenCLIPEmbedder2;
  /// diffusers' tokenizer_2 pads with "!", which is id 0).
  kZero,
};

/// CLIP BPE tokenizer. Immutable after loading; encode* are thread-safe.
class ClipTokenizer {
 public:
  /// Loads `dir`/vocab.json and `dir`/merges.txt. Throws shoestring::Error
  /// naming the file when one is missing or unreadable, vocab.json is not a
  /// JSON object of token -> non-negative integer id or lacks <|startoftext|>
  /// / <|endoftext|>, or a merges.txt line is not two space-separated tokens.
  static ClipTokenizer load(const std::string& dir);
  /// As load(), with explicit paths.
  static ClipTokenizer from_files(const std::string& vocab_json, const std::string& merges_txt);

  /// Step 1 of the file comment (UTF-8 in, UTF-8 out).
  static std::string clean_text(std::string_view text);
  /// Step 2: splits cleaned text into words (UTF-8 substrings).
  static std::vector<std::string> pre_tokenize(std::string_view cleaned);
  /// The byte -> character table of step 3 (GPT-2 / CLIP bytes_to_unicode):
  /// printable Latin-1 bytes ('!'..'~', 0xA1..0xAC, 0xAE..0xFF) map to
  /// themselves, the other 68 bytes to U+0100.. in byte order. UTF-8 strings.
  static const std::vector<std::string>& byte_to_unicode();

  /// BPE tokens of one pre-tokenized word (the last carries "</w>"), or the
  /// special token itself.
  std::vector<std::string> bpe(const std::string& word) const;
  /// Ids of `text` without <|startoftext|> / <|endoftext|> around it.
  std::vector<int64_t> encode(std::string_view text) const;
  /// int64 [B, max_length]: per caption <|startoftext|>, encode(caption)
  /// truncated to max_length - 2 ids, <|endoftext|>, then padding (`pad`).
  /// The empty caption gives <|startoftext|> <|endoftext|> + padding.
  /// Throws shoestring::Error if max_length < 2.
  at::Tensor encode_batch(const std::vector<std::string>& captions, int64_t max_length = 77,
                          ClipPadding pad = ClipPadding::kEndOfText) const;
  /// For debugging: ids back to text (bytes restored, "</w>" -> space,
  /// special tokens kept as written). Throws shoestring::Error for an unknown id.
  std::string decode(const std::vector<int64_t>& ids) const;

  int64_t bos_id() const { return bos_; }
  int64_t eos_id() const { return eos_; }
  /// Largest id + 1.
  int64_t vocab_size() const { return vocab_size_; }
  /// Number of merges in use (CLIP caps merges.txt at 48894 = 49152 - 256 - 2).
  int64_t merge_count() const { return static_cast<int64_t>(ranks_.size()); }

 private:
  std::unordered_map<std::string, int64_t> vocab_;
  std::unordered_map<int64_t, std::string> tokens_;
  std::unordered_map<std::string, int64_t> ranks_;  // "a b" -> rank
  int64_t bos_ = 0, eos_ = 0, vocab_size_ = 0;
};

}  // namespace shoestring
