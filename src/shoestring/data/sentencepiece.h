// SentencePiece unigram models (Kudo & Richardson 2018, "SentencePiece: A
// simple and language independent subword tokenizer"; Kudo 2018, "Subword
// Regularization" for the unigram language model), read from a `.model` file
// and run here, without the SentencePiece library.
//
// Why not libsentencepiece: Debian's libsentencepiece.so.0 (0.1.97) carries
// its own protobuf-lite 3.14 and exports its symbols; in a process that also
// loads libtorch (which needs libprotobuf 3.21) the two copies bind to each
// other and the process crashes in protobuf's static initialisers, or aborts
// on protobuf's version check, before main(). (google/sentencepiece issues
// #723, #927 describe the same clash with other protobuf users.)
//
// The file is a serialised `sentencepiece.ModelProto` (sentencepiece_model.proto;
// proto2 wire format): pieces (text, score, type), TrainerSpec (model_type,
// special pieces, unk_surface, ...), NormalizerSpec (precompiled_charsmap,
// add_dummy_prefix, remove_extra_whitespaces, escape_whitespaces).
//
// encode() reproduces SentencePieceProcessor::Encode for unigram models:
// 1. normalise: at each position the longest user-defined piece, else the
//    longest rule of the precompiled character map (a darts-clone double-array
//    trie over UTF-8 bytes whose values index NUL-terminated replacements,
//    e.g. NFKC for T5's "nmt_nfkc"), else the next UTF-8 character (a
//    malformed byte becomes U+FFFD); leading whitespace dropped, runs of
//    whitespace collapsed, trailing whitespace dropped (remove_extra_whitespaces);
//    a space prepended (add_dummy_prefix); spaces written as U+2581 "▁"
//    (escape_whitespaces).
// 2. segment: the Viterbi path of highest total score over all pieces
//    (normal, user-defined, not unused) matching the normalised bytes; a
//    character no piece starts with is one unknown node scored
//    min(normal scores) - 10; user-defined pieces score length * max_score - 0.1;
//    scores add in float; ties keep the earlier start.
// 3. runs of unknown nodes become one unknown id.
// Not supported (refused at load): BPE / word / char models, byte_fallback
// models, treat_whitespace_as_suffix. Verified against Python SentencePiece
// 0.1.97 on the fixtures of scripts/gen_t5_tokenizer_fixture.py.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace shoestring {

/// A SentencePiece unigram model (see the file comment). Immutable after
/// loading; encode / decode are thread-safe.
class SentencePieceModel {
 public:
  /// sentencepiece.ModelProto.SentencePiece.Type.
  enum class PieceType : int { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };
  struct Piece {
    std::string text;
    float score = 0;
    PieceType type = PieceType::kNormal;
  };

  /// Reads a `.model` file. Throws shoestring::Error naming the path when it
  /// is missing, unreadable, or not a usable model (see parse()).
  static SentencePieceModel load(const std::string& path);
  /// Parses serialised ModelProto bytes; `name` is used in errors. Throws
  /// shoestring::Error for malformed protobuf, no pieces, an empty or
  /// duplicate piece, not exactly one unknown piece, a broken character map,
  /// or an unsupported model (not unigram, byte_fallback, whitespace as suffix).
  static SentencePieceModel parse(std::string_view bytes, const std::string& name);

  /// Step 1 of the file comment: the normalised UTF-8 text.
  std::string normalize(std::string_view text) const;
  /// Ids of `text` (steps 1-3); "" or all-whitespace text gives {}.
  std::vector<int64_t> encode(std::string_view text) const;
  /// The pieces of encode(text) (merged unknown runs as their normalised text).
  std::vector<std::string> encode_pieces(std::string_view text) const;
  /// SentencePieceProcessor::Decode: control pieces dropped, unknown ->
  /// unk_surface (" ⁇ "), "▁" -> " ", the first piece's leading "▁" dropped.
  /// Throws shoestring::Error for an id outside [0, size()).
  std::string decode(const std::vector<int64_t>& ids) const;

  int64_t size() const { return static_cast<int64_t>(pieces_.size()); }
  const Piece& piece(int64_t id) const { return pieces_.at(static_cast<size_t>(id)); }
  /// Id of the control piece named by TrainerSpec eos_piece / pad_piece /
  /// bos_piece ("</s>", "<pad>", "<s>" by default), -1 when there is none
  /// (as SentencePieceProcessor::eos_id() etc.).
  int64_t eos_id() const { return eos_; }
  int64_t pad_id() const { return pad_; }
  int64_t bos_id() const { return bos_; }
  int64_t unk_id() const { return unk_; }
  /// NormalizerSpec name ("nmt_nfkc" for T5; "" when absent).
  const std::string& normalizer_name() const { return normalizer_name_; }

 private:
  // A byte trie: node -> (byte -> child), node -> value (-1: none).
  struct ByteTrie {
    std::unordered_map<uint64_t, int32_t> next;  // (node << 8 | byte) -> child
    std::vector<int32_t> value{-1};
    void insert(std::string_view key, int32_t v);
    int32_t child(int32_t node, unsigned char byte) const;
  };
  // Longest match of the character map at the start of `s`: bytes consumed (0: none) and the replacement.
  size_t charsmap_match(std::string_view s, std::string_view* replacement) const;
  // The normalised prefix of `s` (step 1) and the input bytes it consumed.
  std::pair<std::string_view, size_t> normalize_prefix(std::string_view s) const;
  std::vector<std::pair<std::string_view, int64_t>> segment(std::string_view normalized) const;

  std::vector<Piece> pieces_;
  ByteTrie piece_trie_;  // normal, user-defined, unused pieces -> id
  ByteTrie user_trie_;   // user-defined pieces -> id
  bool has_user_defined_ = false;
  float min_score_ = 0, max_score_ = 0;
  int64_t unk_ = -1, eos_ = -1, pad_ = -1, bos_ = -1;
  std::string unk_surface_ = " \xE2\x81\x87 ";
  std::string normalizer_name_;
  bool add_dummy_prefix_ = true, remove_extra_whitespaces_ = true, escape_whitespaces_ = true;
  std::vector<uint32_t> charsmap_units_;  // darts-clone double array
  std::string charsmap_strings_;          // NUL-terminated replacements
};

}  // namespace shoestring
