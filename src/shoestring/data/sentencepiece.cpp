#include "shoestring/data/sentencepiece.h"

#include <algorithm>
#include <cfloat>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <utility>

#include "shoestring/core/error.h"
#include "shoestring/core/text.h"

namespace shoestring {
namespace {

constexpr std::string_view kSpaceSymbol = "\xE2\x96\x81";      // U+2581, SentencePiece's visible space
constexpr std::string_view kReplacementChar = "\xEF\xBF\xBD";  // U+FFFD for a malformed byte
constexpr float kUnknownPenalty = 10.0f;                       // unknown node score = min score - 10


// ---- protobuf wire format (proto2; developers.google.com/protocol-buffers/docs/encoding) ----

class WireReader {
 public:
  WireReader(std::string_view data, const std::string& name) : data_(data), name_(name) {}
  bool done() const { return pos_ >= data_.size(); }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= data_.size()) bad("a truncated varint");
      const auto b = static_cast<unsigned char>(data_[pos_++]);
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) return v;
    }
    bad("a varint longer than 10 bytes");
  }
  std::string_view bytes() {
    const uint64_t n = varint();
    if (n > data_.size() - pos_) bad("a length past the end of the data");
    const std::string_view s = data_.substr(pos_, static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return s;
  }
  uint32_t fixed32() {
    if (data_.size() - pos_ < 4) bad("a truncated fixed32");
    uint32_t v = 0;
    for (int i = 3; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(data_[pos_ + static_cast<size_t>(i)]);
    pos_ += 4;
    return v;
  }
  /// Next field: (number, wire type).
  std::pair<uint32_t, int> key() {
    const uint64_t k = varint();
    if ((k >> 3) == 0 || (k >> 3) > 0x1FFFFFFF) bad("field number 0");
    return {static_cast<uint32_t>(k >> 3), static_cast<int>(k & 7)};
  }
  void skip(int wire) {
    switch (wire) {
      case 0: varint(); return;
      case 1:
        if (data_.size() - pos_ < 8) bad("a truncated fixed64");
        pos_ += 8;
        return;
      case 2: bytes(); return;
      case 5: fixed32(); return;
      default: bad("an unsupported wire type (groups)");
    }
  }
  void expect(int wire, int expected, uint32_t field) {
    if (wire != expected) bad(("field " + std::to_string(field) + " with the wrong wire type").c_str());
  }
  [[noreturn]] void bad(const char* what) const {
    fail("{}: not a SentencePiece model file (malformed protobuf: {})", name_, what);
  }

 private:
  std::string_view data_;
  size_t pos_ = 0;
  const std::string& name_;
};

// ---- darts-clone double array (the precompiled character map's trie) ----------
// A unit packs: bit 8 has_leaf; bits 0..7 (and 31 for a leaf) the label;
// bits 10..31 the offset, shifted left by 8 more when bit 9 is set; a leaf
// unit holds the value in bits 0..30.
bool unit_has_leaf(uint32_t u) { return ((u >> 8) & 1) == 1; }
uint32_t unit_value(uint32_t u) { return u & ((1U << 31) - 1); }
uint32_t unit_label(uint32_t u) { return u & ((1U << 31) | 0xFF); }
uint32_t unit_offset(uint32_t u) { return (u >> 10) << ((u & (1U << 9)) >> 6); }

// SentencePiece's UTF-8 reading (util.h DecodeUTF8 / IsValidDecodeUTF8):
// the length of the character at the start of `s` and whether it is well
// formed (no overlong forms, no surrogates, at most U+10FFFF).
size_t utf8_char(std::string_view s, bool* valid) {
  auto byte = [&](size_t i) { return static_cast<unsigned char>(s[i]); };
  auto trail = [&](size_t i) { return (byte(i) & 0xC0) == 0x80; };
  auto ok = [](uint32_t cp) { return cp < 0xD800 || (cp >= 0xE000 && cp <= 0x10FFFF); };
  *valid = true;
  const unsigned char c = byte(0);
  if (c < 0x80) return 1;
  if (s.size() >= 2 && (c & 0xE0) == 0xC0) {
    const uint32_t cp = ((c & 0x1Fu) << 6) | (byte(1) & 0x3Fu);
    if (trail(1) && cp >= 0x80 && ok(cp)) return 2;
  } else if (s.size() >= 3 && (c & 0xF0) == 0xE0) {
    const uint32_t cp = ((c & 0x0Fu) << 12) | ((byte(1) & 0x3Fu) << 6) | (byte(2) & 0x3Fu);
    if (trail(1) && trail(2) && cp >= 0x800 && ok(cp)) return 3;
  } else if (s.size() >= 4 && (c & 0xF8) == 0xF0) {
    const uint32_t cp = ((c & 0x07u) << 18) | ((byte(1) & 0x3Fu) << 12) | ((byte(2) & 0x3Fu) << 6) | (byte(3) & 0x3Fu);
    if (trail(1) && trail(2) && trail(3) && cp >= 0x10000 && ok(cp)) return 4;
  }
  *valid = false;
  return 1;
}

// Byte length of a UTF-8 character from its first byte (SentencePiece's
// OneCharLen: no validation; continuation bytes count as 1).
size_t one_char_len(unsigned char c) {
  static constexpr unsigned char kLen[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
  return kLen[c >> 4];
}

}  // namespace

// ---- byte trie -------------------------------------------------------------------

void SentencePieceModel::ByteTrie::insert(std::string_view key, int32_t v) {
  int32_t node = 0;
  for (const char ch : key) {
    const uint64_t k = (static_cast<uint64_t>(node) << 8) | static_cast<unsigned char>(ch);
    auto it = next.find(k);
    if (it == next.end()) {
      it = next.emplace(k, static_cast<int32_t>(value.size())).first;
      value.push_back(-1);
    }
    node = it->second;
  }
  value[static_cast<size_t>(node)] = v;
}

int32_t SentencePieceModel::ByteTrie::child(int32_t node, unsigned char byte) const {
  const auto it = next.find((static_cast<uint64_t>(node) << 8) | byte);
  return it == next.end() ? -1 : it->second;
}

// ---- loading -----------------------------------------------------------------------

SentencePieceModel SentencePieceModel::load(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    fail("{} does not exist or is not a file (expected a SentencePiece model)", path);
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("cannot read {}", path);
  const std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (f.bad()) fail("cannot read {}", path);
  return parse(bytes, path);
}

SentencePieceModel SentencePieceModel::parse(std::string_view bytes, const std::string& name) {
  SentencePieceModel m;
  int64_t model_type = 1;
  bool byte_fallback = false, whitespace_suffix = false;
  std::string unk_piece = "<unk>", bos_piece = "<s>", eos_piece = "</s>", pad_piece = "<pad>";
  std::string_view charsmap;

  WireReader model(bytes, name);
  while (!model.done()) {
    const auto [field, wire] = model.key();
    if (field == 1) {  // repeated SentencePiece pieces
      model.expect(wire, 2, field);
      WireReader r(model.bytes(), name);
      Piece p;
      while (!r.done()) {
        const auto [f, w] = r.key();
        if (f == 1) {
          r.expect(w, 2, f);
          p.text = std::string(r.bytes());
        } else if (f == 2) {
          r.expect(w, 5, f);
          const uint32_t bits = r.fixed32();
          std::memcpy(&p.score, &bits, sizeof(float));
        } else if (f == 3) {
          r.expect(w, 0, f);
          const uint64_t t = r.varint();
          if (t < 1 || t > 6) r.bad("an unknown piece type");
          p.type = static_cast<PieceType>(t);
        } else {
          r.skip(w);
        }
      }
      m.pieces_.push_back(std::move(p));
    } else if (field == 2) {  // TrainerSpec
      model.expect(wire, 2, field);
      WireReader r(model.bytes(), name);
      while (!r.done()) {
        const auto [f, w] = r.key();
        auto text = [&] {
          r.expect(w, 2, f);
          return std::string(r.bytes());
        };
        auto number = [&] {
          r.expect(w, 0, f);
          return r.varint();
        };
        if (f == 3) {
          model_type = static_cast<int64_t>(number());
        } else if (f == 24) {
          whitespace_suffix = number() != 0;
        } else if (f == 35) {
          byte_fallback = number() != 0;
        } else if (f == 44) {
          m.unk_surface_ = text();
        } else if (f == 45) {
          unk_piece = text();
        } else if (f == 46) {
          bos_piece = text();
        } else if (f == 47) {
          eos_piece = text();
        } else if (f == 48) {
          pad_piece = text();
        } else {
          r.skip(w);
        }
      }
    } else if (field == 3) {  // NormalizerSpec
      model.expect(wire, 2, field);
      WireReader r(model.bytes(), name);
      while (!r.done()) {
        const auto [f, w] = r.key();
        if (f == 1) {
          r.expect(w, 2, f);
          m.normalizer_name_ = std::string(r.bytes());
        } else if (f == 2) {
          r.expect(w, 2, f);
          charsmap = r.bytes();
        } else if (f == 3 || f == 4 || f == 5) {
          r.expect(w, 0, f);
          const bool v = r.varint() != 0;
          (f == 3 ? m.add_dummy_prefix_ : f == 4 ? m.remove_extra_whitespaces_ : m.escape_whitespaces_) = v;
        } else {
          r.skip(w);
        }
      }
    } else {
      model.skip(wire);
    }
  }

  if (m.pieces_.empty()) fail("{}: not a SentencePiece model file (no pieces)", name);
  if (model_type != 1)
    fail("{}: a SentencePiece model of type {} (only unigram models, type 1, are supported; T5's is unigram)", name,
         model_type);
  if (byte_fallback) fail("{}: SentencePiece models with byte_fallback are not supported", name);
  if (whitespace_suffix) fail("{}: SentencePiece models with treat_whitespace_as_suffix are not supported", name);

  // Pieces the segmentation matches (normal, user-defined, unused) and the reserved ones (SentencePiece's
  // ModelInterface::InitializePieces), each set without duplicates; exactly one unknown piece.
  std::map<std::string_view, int64_t> matched, reserved;
  m.min_score_ = FLT_MAX;
  m.max_score_ = FLT_MIN;  // SentencePiece's initial value (the smallest positive float)
  for (size_t i = 0; i < m.pieces_.size(); ++i) {
    const Piece& p = m.pieces_[i];
    const auto id = static_cast<int64_t>(i);
    if (p.text.empty()) fail("{}: SentencePiece model: piece {} is empty", name, id);
    const bool is_matched =
        p.type == PieceType::kNormal || p.type == PieceType::kUserDefined || p.type == PieceType::kUnused;
    if (!(is_matched ? matched : reserved).emplace(p.text, id).second)
      fail("{}: SentencePiece model: piece '{}' is defined twice", name, p.text);
    if (p.type == PieceType::kUnknown) {
      if (m.unk_ >= 0) fail("{}: SentencePiece model: two unknown pieces ({} and {})", name, m.unk_, id);
      m.unk_ = id;
    }
    if (p.type == PieceType::kNormal) {
      m.min_score_ = std::min(m.min_score_, p.score);
      m.max_score_ = std::max(m.max_score_, p.score);
    }
    if (is_matched) m.piece_trie_.insert(p.text, static_cast<int32_t>(id));
    if (p.type == PieceType::kUserDefined) {
      m.user_trie_.insert(p.text, static_cast<int32_t>(id));
      m.has_user_defined_ = true;
    }
  }
  if (m.unk_ < 0) fail("{}: SentencePiece model: no unknown piece", name);
  auto control = [&](const std::string& piece) -> int64_t {
    const auto it = reserved.find(piece);
    return it != reserved.end() && m.pieces_[static_cast<size_t>(it->second)].type == PieceType::kControl ? it->second
                                                                                                          : -1;
  };
  m.eos_ = control(eos_piece);
  m.pad_ = control(pad_piece);
  m.bos_ = control(bos_piece);
  (void)unk_piece;  // the unknown piece is found by its type, as SentencePiece does

  // <trie size: uint32 LE><double-array units><NUL-terminated replacements> (normalizer.cc's layout).
  if (!charsmap.empty()) {
    uint32_t trie_bytes = 0;
    if (charsmap.size() > 4) {
      for (int i = 3; i >= 0; --i) trie_bytes = (trie_bytes << 8) | static_cast<unsigned char>(charsmap[i]);
    }
    if (charsmap.size() <= 4 || trie_bytes % 4 != 0 || trie_bytes > charsmap.size() - 4 || trie_bytes == 0)
      fail("{}: SentencePiece model: the precompiled character map is broken", name);
    m.charsmap_units_.resize(trie_bytes / 4);
    for (size_t i = 0; i < m.charsmap_units_.size(); ++i) {
      uint32_t u = 0;
      for (int b = 3; b >= 0; --b) u = (u << 8) | static_cast<unsigned char>(charsmap[4 + 4 * i + b]);
      m.charsmap_units_[i] = u;
    }
    m.charsmap_strings_ = std::string(charsmap.substr(4 + trie_bytes));
  }
  return m;
}

// ---- normalisation -------------------------------------------------------------------

size_t SentencePieceModel::charsmap_match(std::string_view s, std::string_view* replacement) const {
  const std::vector<uint32_t>& units = charsmap_units_;
  if (units.empty()) return 0;
  size_t longest = 0;
  uint32_t value = 0;
  size_t node = unit_offset(units[0]);
  for (size_t i = 0; i < s.size(); ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    node ^= c;
    if (node >= units.size()) break;
    const uint32_t unit = units[node];
    if (unit_label(unit) != c) break;
    node ^= unit_offset(unit);
    if (node >= units.size()) break;
    if (unit_has_leaf(unit)) {
      longest = i + 1;  // matches come shortest first: the last is the longest
      value = unit_value(units[node]);
    }
  }
  if (longest == 0 || value >= charsmap_strings_.size()) return 0;
  const size_t end = charsmap_strings_.find('\0', value);
  *replacement = std::string_view(charsmap_strings_).substr(value, end == std::string::npos ? end : end - value);
  return longest;
}

std::pair<std::string_view, size_t> SentencePieceModel::normalize_prefix(std::string_view s) const {
  if (has_user_defined_) {  // user-defined pieces are kept as written
    size_t longest = 0;
    int32_t node = 0;
    for (size_t i = 0; i < s.size() && node >= 0; ++i) {
      node = user_trie_.child(node, static_cast<unsigned char>(s[i]));
      if (node >= 0 && user_trie_.value[static_cast<size_t>(node)] >= 0) longest = i + 1;
    }
    if (longest > 0) return {s.substr(0, longest), longest};
  }
  std::string_view replacement;
  if (const size_t n = charsmap_match(s, &replacement); n > 0) return {replacement, n};
  bool valid = true;
  const size_t n = utf8_char(s, &valid);
  if (!valid) return {kReplacementChar, 1};
  return {s.substr(0, n), n};
}

std::string SentencePieceModel::normalize(std::string_view text) const {
  std::string out;
  if (remove_extra_whitespaces_) {  // leading whitespace
    while (!text.empty()) {
      const auto [piece, consumed] = normalize_prefix(text);
      if (piece != " ") break;
      text.remove_prefix(consumed);
    }
  }
  if (text.empty()) return out;
  out.reserve(text.size() * 3);
  const std::string_view space = escape_whitespaces_ ? kSpaceSymbol : std::string_view(" ");
  if (add_dummy_prefix_) out += space;
  bool previous_space = remove_extra_whitespaces_;
  while (!text.empty()) {
    auto [piece, consumed] = normalize_prefix(text);
    while (previous_space && has_prefix(piece, " ")) piece.remove_prefix(1);  // collapse runs of spaces
    if (!piece.empty()) {
      for (const char ch : piece) {
        if (ch == ' ' && escape_whitespaces_) {
          out += kSpaceSymbol;
        } else {
          out += ch;
        }
      }
      previous_space = has_suffix(piece, " ");
    }
    text.remove_prefix(consumed);
    if (!remove_extra_whitespaces_) previous_space = false;
  }
  if (remove_extra_whitespaces_) {  // trailing whitespace
    while (has_suffix(out, space)) out.resize(out.size() - space.size());
  }
  return out;
}

// ---- segmentation ----------------------------------------------------------------------

std::vector<std::pair<std::string_view, int64_t>> SentencePieceModel::segment(std::string_view normalized) const {
  struct Best {
    int64_t id = -1;
    float score = 0;     // best total score of a path ending here
    int64_t start = -1;  // where its last piece starts
  };
  const size_t size = normalized.size();
  std::vector<Best> best(size + 1);
  const float unknown_score = min_score_ - kUnknownPenalty;
  for (size_t start = 0; start < size;) {
    const float till_here = best[start].score;
    const size_t char_len = std::min(one_char_len(static_cast<unsigned char>(normalized[start])), size - start);
    bool has_single_char_piece = false;
    int32_t node = 0;
    for (size_t end = start; end < size;) {
      node = piece_trie_.child(node, static_cast<unsigned char>(normalized[end]));
      ++end;
      if (node < 0) break;
      const int32_t id = piece_trie_.value[static_cast<size_t>(node)];
      if (id < 0) continue;
      const Piece& p = pieces_[static_cast<size_t>(id)];
      if (p.type == PieceType::kUnused) continue;
      const size_t length = end - start;
      Best& target = best[end];
      // SentencePiece forms the candidate in double (its user-defined bonus is a double
      // expression) and keeps the best score in float.
      const double score = p.type == PieceType::kUserDefined ? static_cast<float>(length) * max_score_ - 0.1
                                                             : static_cast<double>(p.score);
      const double candidate = score + till_here;
      if (target.start == -1 || candidate > target.score) {
        target.score = static_cast<float>(candidate);
        target.start = static_cast<int64_t>(start);
        target.id = id;
      }
      if (length == char_len) has_single_char_piece = true;
    }
    if (!has_single_char_piece) {  // one unknown node for this character
      Best& target = best[start + char_len];
      const float candidate = unknown_score + till_here;
      if (target.start == -1 || candidate > target.score) {
        target.score = candidate;
        target.start = static_cast<int64_t>(start);
        target.id = unk_;
      }
    }
    start += char_len;
  }
  std::vector<std::pair<std::string_view, int64_t>> out;
  for (size_t end = size; end > 0;) {
    const Best& b = best[end];
    const auto start = static_cast<size_t>(b.start);
    out.emplace_back(normalized.substr(start, end - start), b.id);
    end = start;
  }
  std::reverse(out.begin(), out.end());
  return out;
}

std::vector<std::string> SentencePieceModel::encode_pieces(std::string_view text) const {
  const std::string normalized = normalize(text);
  std::vector<std::string> out;
  bool previous_unknown = false;
  for (const auto& [piece, id] : segment(normalized)) {
    const bool unknown = id == unk_;
    if (unknown && previous_unknown) {
      out.back() += piece;  // runs of unknown characters are one unknown piece
    } else {
      out.emplace_back(piece);
    }
    previous_unknown = unknown;
  }
  return out;
}

std::vector<int64_t> SentencePieceModel::encode(std::string_view text) const {
  const std::string normalized = normalize(text);
  std::vector<int64_t> out;
  bool previous_unknown = false;
  for (const auto& piece_id : segment(normalized)) {
    const bool unknown = piece_id.second == unk_;
    if (!(unknown && previous_unknown)) out.push_back(piece_id.second);
    previous_unknown = unknown;
  }
  return out;
}

std::string SentencePieceModel::decode(const std::vector<int64_t>& ids) const {
  std::string text;
  for (const int64_t id : ids) {
    if (id < 0 || id >= size()) fail("SentencePiece decode: id {} is outside [0, {})", id, size());
    const Piece& p = pieces_[static_cast<size_t>(id)];
    if (p.type == PieceType::kControl) continue;
    if (p.type == PieceType::kUnknown) {
      text += unk_surface_;
      continue;
    }
    std::string_view piece = p.text;
    if (text.empty() && (add_dummy_prefix_ || remove_extra_whitespaces_) && has_prefix(piece, kSpaceSymbol))
      piece.remove_prefix(kSpaceSymbol.size());
    for (size_t at = piece.find(kSpaceSymbol); at != std::string_view::npos; at = piece.find(kSpaceSymbol)) {
      text += piece.substr(0, at);
      text += ' ';
      piece.remove_prefix(at + kSpaceSymbol.size());
    }
    text += piece;
  }
  return text;
}

}  // namespace shoestring
