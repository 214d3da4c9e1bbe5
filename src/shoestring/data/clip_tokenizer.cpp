#include "shoestring/data/clip_tokenizer.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "shoestring/core/error.h"

namespace shoestring {
namespace {

constexpr const char* kStartOfText = "<|startoftext|>";
constexpr const char* kEndOfText = "<|endoftext|>";
constexpr const char* kWordEnd = "</w>";
// simple_tokenizer.py / HF CLIPTokenizer read merges[1 : 49152 - 256 - 2 + 1].
constexpr int64_t kMaxMerges = 49152 - 256 - 2;

// ---- UTF-8 ---------------------------------------------------------------------

struct CodePoint {
  char32_t cp;  // 0xFFFD for an invalid byte
  size_t len;   // bytes
};

// Decodes the code point starting at s[i]; an invalid or truncated sequence
// yields U+FFFD of length 1, so every byte is kept.
CodePoint decode_at(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = b(0);
  if (c < 0x80) return {c, 1};
  size_t n = 0;
  char32_t cp = 0;
  if ((c & 0xE0) == 0xC0) {
    n = 2;
    cp = c & 0x1F;
  } else if ((c & 0xF0) == 0xE0) {
    n = 3;
    cp = c & 0x0F;
  } else if ((c & 0xF8) == 0xF0) {
    n = 4;
    cp = c & 0x07;
  } else {
    return {0xFFFD, 1};
  }
  if (i + n > s.size()) return {0xFFFD, 1};
  for (size_t k = 1; k < n; ++k) {
    if ((b(k) & 0xC0) != 0x80) return {0xFFFD, 1};
    cp = (cp << 6) | (b(k) & 0x3F);
  }
  return {cp, n};
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

// ---- character classes (approximations of Unicode \s, \p{L}, \p{N}) -----------

bool in(char32_t c, char32_t lo, char32_t hi) { return c >= lo && c <= hi; }

// Python's \s for str patterns.
bool is_space(char32_t c) {
  return in(c, 0x09, 0x0D) || c == 0x20 || in(c, 0x1C, 0x1F) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         in(c, 0x2000, 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// Indic blocks U+0900..U+0DFF share one layout: digits at offsets 0x66..0x6F.
bool is_indic_digit(char32_t c) { return in(c, 0x900, 0xDFF) && in(c & 0x7F, 0x66, 0x6F); }

bool is_number(char32_t c) {
  if (c < 0x80) return in(c, '0', '9');
  return c == 0xB2 || c == 0xB3 || c == 0xB9 || in(c, 0xBC, 0xBE) || in(c, 0x660, 0x669) || in(c, 0x6F0, 0x6F9) ||
         in(c, 0x7C0, 0x7C9) || is_indic_digit(c) || in(c, 0xE50, 0xE59) || in(c, 0xED0, 0xED9) ||
         in(c, 0xF20, 0xF33) || in(c, 0x1040, 0x1049) || in(c, 0x1369, 0x137C) || in(c, 0x17E0, 0x17E9) ||
         in(c, 0x1810, 0x1819) || c == 0x2070 || in(c, 0x2074, 0x2079) || in(c, 0x2080, 0x2089) ||
         in(c, 0x2150, 0x2189) || in(c, 0x2460, 0x249B) || in(c, 0x24EA, 0x24FF) || in(c, 0x2776, 0x2793) ||
         c == 0x3007 || in(c, 0x3021, 0x3029) || in(c, 0x3038, 0x303A) || in(c, 0x3192, 0x3195) ||
         in(c, 0x3220, 0x3229) || in(c, 0x3248, 0x324F) || in(c, 0x3251, 0x325F) || in(c, 0x3280, 0x3289) ||
         in(c, 0x32B1, 0x32BF) || in(c, 0xFF10, 0xFF19) || in(c, 0x1D7CE, 0x1D7FF);
}

bool is_letter(char32_t c) {
  if (c < 0x80) return in(c, 'a', 'z') || in(c, 'A', 'Z');
  if (c == 0xAA || c == 0xB5 || c == 0xBA) return true;
  if (c < 0xC0) return false;
  if (c <= 0x2C1) return c != 0xD7 && c != 0xF7;  // Latin-1 letters, Latin Extended-A/B, IPA
  if (in(c, 0x2C6, 0x2D1) || in(c, 0x2E0, 0x2E4) || c == 0x2EC || c == 0x2EE) return true;
  if (in(c, 0x370, 0x3FF))  // Greek
    return !(in(c, 0x375, 0x375) || c == 0x378 || c == 0x379 || c == 0x37E || in(c, 0x380, 0x385) || c == 0x387 ||
             c == 0x38B || c == 0x38D || c == 0x3A2 || c == 0x3F6);
  if (in(c, 0x400, 0x481) || in(c, 0x48A, 0x52F)) return true;  // Cyrillic (not the combining 0x483..0x489)
  if (in(c, 0x531, 0x556) || c == 0x559 || in(c, 0x560, 0x588)) return true;  // Armenian
  if (in(c, 0x5D0, 0x5EA) || in(c, 0x5EF, 0x5F2)) return true;                // Hebrew
  if (in(c, 0x620, 0x64A) || in(c, 0x66E, 0x66F) || in(c, 0x671, 0x6D3) || c == 0x6D5 || in(c, 0x6E5, 0x6E6) ||
      in(c, 0x6EE, 0x6EF) || in(c, 0x6FA, 0x6FC) || c == 0x6FF)
    return true;              // Arabic
  if (in(c, 0x900, 0xDFF)) {  // Indic scripts: vowels and consonants; signs (marks) are not letters
    const char32_t o = c & 0x7F;
    return in(o, 0x05, 0x39) || o == 0x3D || o == 0x50 || in(o, 0x58, 0x61) || in(o, 0x71, 0x7F);
  }
  if (in(c, 0xE01, 0xE30) || in(c, 0xE32, 0xE33) || in(c, 0xE40, 0xE46)) return true;  // Thai
  if (in(c, 0xE81, 0xEB0) || in(c, 0xEB2, 0xEB3) || in(c, 0xEBD, 0xEC6)) return true;  // Lao
  if (in(c, 0x10A0, 0x10FF) || in(c, 0x1100, 0x11FF) || in(c, 0x1200, 0x1368) || in(c, 0x13A0, 0x13F5))
    return true;  // Georgian, Hangul Jamo, Ethiopic, Cherokee
  if (in(c, 0x1E00, 0x1FBC) || in(c, 0x1FC2, 0x1FCC) || in(c, 0x1FD0, 0x1FDB) || in(c, 0x1FE0, 0x1FEC) ||
      in(c, 0x1FF2, 0x1FFC))
    return true;  // Latin Extended Additional, Greek Extended
  if (c == 0x2071 || c == 0x207F || in(c, 0x2090, 0x209C) || c == 0x2102 || c == 0x2107 || in(c, 0x210A, 0x2113) ||
      c == 0x2115 || in(c, 0x2119, 0x211D) || c == 0x2124 || c == 0x2126 || c == 0x2128 || in(c, 0x212A, 0x212D) ||
      in(c, 0x212F, 0x2139))
    return true;  // letterlike symbols
  if (in(c, 0x2C00, 0x2CE4) || in(c, 0x2D00, 0x2D25)) return true;
  if (in(c, 0x3005, 0x3006) || in(c, 0x3031, 0x3035) || in(c, 0x303B, 0x303C)) return true;
  if (in(c, 0x3041, 0x3096) || in(c, 0x309D, 0x309F) || in(c, 0x30A1, 0x30FA) || in(c, 0x30FC, 0x30FF))
    return true;  // kana
  if (in(c, 0x3105, 0x312F) || in(c, 0x3131, 0x318E) || in(c, 0x31A0, 0x31BF) || in(c, 0x31F0, 0x31FF)) return true;
  if (in(c, 0x3400, 0x4DBF) || in(c, 0x4E00, 0x9FFF) || in(c, 0xF900, 0xFAFF)) return true;  // CJK ideographs
  if (in(c, 0xA000, 0xA48C) || in(c, 0xA4D0, 0xA4FD) || in(c, 0xA500, 0xA60C) || in(c, 0xA640, 0xA66E) ||
      in(c, 0xA680, 0xA69D) || in(c, 0xA722, 0xA788) || in(c, 0xA78B, 0xA7CA))
    return true;
  if (in(c, 0xAC00, 0xD7A3) || in(c, 0xD7B0, 0xD7FB)) return true;  // Hangul syllables
  if (in(c, 0xFB00, 0xFB06) || in(c, 0xFB1D, 0xFB4F) || in(c, 0xFB50, 0xFDFB) || in(c, 0xFE70, 0xFEFC)) return true;
  if (in(c, 0xFF21, 0xFF3A) || in(c, 0xFF41, 0xFF5A) || in(c, 0xFF66, 0xFFDC)) return true;  // fullwidth, halfwidth
  return in(c, 0x20000, 0x323AF);                                                            // CJK extensions B..H
}

// str.lower() for the scripts listed in the header.
char32_t to_lower(char32_t c) {
  if (in(c, 'A', 'Z')) return c + 32;
  if (c < 0xC0) return c;
  if (in(c, 0xC0, 0xDE) && c != 0xD7) return c + 32;
  if (in(c, 0x100, 0x12F) || in(c, 0x132, 0x137) || in(c, 0x14A, 0x177)) return (c % 2 == 0) ? c + 1 : c;
  if (in(c, 0x139, 0x148) || in(c, 0x179, 0x17E)) return (c % 2 == 1) ? c + 1 : c;
  if (c == 0x178) return 0xFF;
  if (c == 0x386) return 0x3AC;
  if (in(c, 0x388, 0x38A)) return c + 37;
  if (c == 0x38C) return 0x3CC;
  if (in(c, 0x38E, 0x38F)) return c + 63;
  if (in(c, 0x391, 0x3AB) && c != 0x3A2) return c + 32;
  if (in(c, 0x400, 0x40F)) return c + 80;
  if (in(c, 0x410, 0x42F)) return c + 32;
  if (in(c, 0x460, 0x481) || in(c, 0x48A, 0x4BF) || in(c, 0x4D0, 0x52F)) return (c % 2 == 0) ? c + 1 : c;
  if (in(c, 0x531, 0x556)) return c + 48;
  if (in(c, 0x1E00, 0x1E95) || in(c, 0x1EA0, 0x1EFF)) return (c % 2 == 0) ? c + 1 : c;
  if (in(c, 0xFF21, 0xFF3A)) return c + 32;
  return c;
}

// ---- HTML entities (html.unescape for the common cases) -------------------------

// Replaces "&name;" (amp, lt, gt, quot, apos, nbsp, and upper-case AMP/LT/GT/QUOT)
// and numeric "&#NNN;" / "&#xHH;" references; anything else is kept.
std::string html_unescape(std::string_view s) {
  static const std::pair<const char*, char32_t> kNamed[] = {{"amp", '&'},   {"lt", '<'},    {"gt", '>'},  {"quot", '"'},
                                                            {"apos", '\''}, {"nbsp", 0xA0}, {"AMP", '&'}, {"LT", '<'},
                                                            {"GT", '>'},    {"QUOT", '"'}};
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    if (s[i] == '&') {
      const size_t semi = s.find(';', i + 1);
      if (semi != std::string_view::npos && semi - i <= 10) {
        const std::string_view name = s.substr(i + 1, semi - i - 1);
        char32_t cp = 0;
        if (name.size() >= 2 && name[0] == '#') {
          const bool hex = name[1] == 'x' || name[1] == 'X';
          const std::string_view digits = name.substr(hex ? 2 : 1);
          bool ok = !digits.empty();
          uint32_t v = 0;
          for (char d : digits) {
            int x = -1;
            if (d >= '0' && d <= '9') x = d - '0';
            else if (hex && d >= 'a' && d <= 'f') x = d - 'a' + 10;
            else if (hex && d >= 'A' && d <= 'F') x = d - 'A' + 10;
            if (x < 0 || v > 0x10FFFF) {
              ok = false;
              break;
            }
            v = v * (hex ? 16 : 10) + x;
          }
          if (ok && v > 0 && v <= 0x10FFFF && !(v >= 0xD800 && v <= 0xDFFF)) cp = v;
        } else {
          for (const auto& [n, c] : kNamed) {
            if (name == n) cp = c;
          }
        }
        if (cp != 0) {
          append_utf8(out, cp);
          i = semi + 1;
          continue;
        }
      }
    }
    out += s[i++];
  }
  return out;
}

std::string read_file(const std::string& path, const char* what) {
  if (!std::filesystem::is_regular_file(path)) fail("{}: {} not found", path, what);
  std::ifstream f(path, std::ios::binary);
  if (!f) fail("{}: cannot read {}", path, what);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

bool starts_with(std::string_view s, size_t i, std::string_view p) { return s.compare(i, p.size(), p) == 0; }

}  // namespace

// ---- static helpers ---------------------------------------------------------------

const std::vector<std::string>& ClipTokenizer::byte_to_unicode() {
  static const std::vector<std::string> table = [] {
    std::vector<std::string> t(256);
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = in(b, '!', '~') || in(b, 0xA1, 0xAC) || in(b, 0xAE, 0xFF);
      std::string s;
      append_utf8(s, printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + n++));
      t[b] = s;
    }
    return t;
  }();
  return table;
}

std::string ClipTokenizer::clean_text(std::string_view text) {
  const std::string unescaped = html_unescape(html_unescape(text));
  std::string out;
  out.reserve(unescaped.size());
  bool pending_space = false;
  for (size_t i = 0; i < unescaped.size();) {
    const CodePoint cp = decode_at(unescaped, i);
    if (is_space(cp.cp)) {
      pending_space = !out.empty();
    } else {
      if (pending_space) out += ' ';
      pending_space = false;
      if (cp.cp == 0xFFFD && cp.len == 1) {
        out += unescaped[i];  // keep an invalid byte as it is
      } else {
        append_utf8(out, to_lower(cp.cp));
      }
    }
    i += cp.len;
  }
  return out;
}

std::vector<std::string> ClipTokenizer::pre_tokenize(std::string_view s) {
  static constexpr std::string_view kContractions[] = {"s", "t", "re", "ve", "m", "ll", "d"};
  std::vector<std::string> words;
  for (size_t i = 0; i < s.size();) {
    if (starts_with(s, i, kStartOfText)) {
      words.emplace_back(kStartOfText);
      i += std::strlen(kStartOfText);
      continue;
    }
    if (starts_with(s, i, kEndOfText)) {
      words.emplace_back(kEndOfText);
      i += std::strlen(kEndOfText);
      continue;
    }
    if (s[i] == '\'') {  // 's|'t|'re|'ve|'m|'ll|'d, case-insensitive
      size_t matched = 0;
      for (std::string_view c : kContractions) {
        if (i + 1 + c.size() > s.size()) continue;
        bool eq = true;
        for (size_t k = 0; k < c.size(); ++k) eq = eq && std::tolower(static_cast<unsigned char>(s[i + 1 + k])) == c[k];
        if (eq) {
          matched = 1 + c.size();
          break;
        }
      }
      if (matched) {
        words.emplace_back(s.substr(i, matched));
        i += matched;
        continue;
      }
    }
    const CodePoint first = decode_at(s, i);
    if (is_space(first.cp)) {
      i += first.len;
      continue;
    }
    size_t j = i + first.len;
    if (is_letter(first.cp)) {  // [\p{L}]+
      while (j < s.size()) {
        const CodePoint c = decode_at(s, j);
        if (!is_letter(c.cp)) break;
        j += c.len;
      }
    } else if (!is_number(first.cp)) {  // [^\s\p{L}\p{N}]+ (a number is one code point)
      while (j < s.size()) {
        const CodePoint c = decode_at(s, j);
        if (is_space(c.cp) || is_letter(c.cp) || is_number(c.cp)) break;
        j += c.len;
      }
    }
    words.emplace_back(s.substr(i, j - i));
    i = j;
  }
  return words;
}

// ---- loading ------------------------------------------------------------------------

ClipTokenizer ClipTokenizer::load(const std::string& dir) {
  return from_files((std::filesystem::path(dir) / "vocab.json").string(),
                    (std::filesystem::path(dir) / "merges.txt").string());
}

ClipTokenizer ClipTokenizer::from_files(const std::string& vocab_json, const std::string& merges_txt) {
  ClipTokenizer t;
  const std::string vocab_text = read_file(vocab_json, "CLIP vocabulary (vocab.json)");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(vocab_text);
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON: {}", vocab_json, e.what());
  }
  if (!j.is_object() || j.empty()) fail("{}: expected a non-empty JSON object of token -> id", vocab_json);
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (!it.value().is_number_integer() || it.value().get<int64_t>() < 0)
      fail("{}: the id of token \"{}\" is not a non-negative integer", vocab_json, it.key());
    const int64_t id = it.value().get<int64_t>();
    if (!t.tokens_.emplace(id, it.key()).second)
      fail("{}: id {} is used by both \"{}\" and \"{}\"", vocab_json, id, t.tokens_[id], it.key());
    t.vocab_[it.key()] = id;
    t.vocab_size_ = std::max(t.vocab_size_, id + 1);
  }
  for (const char* special : {kStartOfText, kEndOfText}) {
    if (!t.vocab_.count(special)) fail("{}: lacks the special token \"{}\"", vocab_json, special);
  }
  t.bos_ = t.vocab_.at(kStartOfText);
  t.eos_ = t.vocab_.at(kEndOfText);

  const std::string merges_text = read_file(merges_txt, "CLIP BPE merges (merges.txt)");
  std::istringstream lines(merges_text);
  int64_t line_no = 0;
  for (std::string line; std::getline(lines, line);) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (line_no == 1 && line.rfind("#version", 0) == 0)) continue;
    if (static_cast<int64_t>(t.ranks_.size()) >= kMaxMerges) break;
    const size_t space = line.find(' ');
    if (space == std::string::npos || space == 0 || space + 1 >= line.size() ||
        line.find(' ', space + 1) != std::string::npos)
      fail("{}:{}: expected a merge \"a b\" (two tokens separated by one space), got \"{}\"", merges_txt, line_no,
           line);
    t.ranks_.emplace(line, static_cast<int64_t>(t.ranks_.size()));  // first occurrence keeps its rank
  }
  if (t.ranks_.empty()) fail("{}: no merges", merges_txt);
  return t;
}

// ---- encoding --------------------------------------------------------------------------

std::vector<std::string> ClipTokenizer::bpe(const std::string& word) const {
  if (word == kStartOfText || word == kEndOfText) return {word};
  if (word.empty()) return {};
  const auto& table = byte_to_unicode();
  std::vector<std::string> parts;
  parts.reserve(word.size());
  for (unsigned char b : word) parts.push_back(table[b]);
  parts.back() += kWordEnd;
  std::string key;
  while (parts.size() > 1) {
    int64_t best = std::numeric_limits<int64_t>::max();
    size_t best_i = 0;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      key.assign(parts[i]).append(" ").append(parts[i + 1]);
      auto it = ranks_.find(key);
      if (it != ranks_.end() && it->second < best) {
        best = it->second;
        best_i = i;
      }
    }
    if (best == std::numeric_limits<int64_t>::max()) break;
    const std::string first = parts[best_i], second = parts[best_i + 1];
    std::vector<std::string> merged;
    merged.reserve(parts.size());
    for (size_t i = 0; i < parts.size();) {
      if (i + 1 < parts.size() && parts[i] == first && parts[i + 1] == second) {
        merged.push_back(first + second);
        i += 2;
      } else {
        merged.push_back(parts[i]);
        i += 1;
      }
    }
    parts = std::move(merged);
  }
  return parts;
}

std::vector<int64_t> ClipTokenizer::encode(std::string_view text) const {
  std::vector<int64_t> ids;
  for (const std::string& word : pre_tokenize(clean_text(text))) {
    for (const std::string& token : bpe(word)) {
      auto it = vocab_.find(token);
      ids.push_back(it == vocab_.end() ? eos_ : it->second);  // HF: unknown -> unk_token <|endoftext|>
    }
  }
  return ids;
}

at::Tensor ClipTokenizer::encode_batch(const std::vector<std::string>& captions, int64_t max_length,
                                       ClipPadding pad) const {
  if (max_length < 2) fail("ClipTokenizer: max_length must be at least 2 (start and end tokens), got {}", max_length);
  const int64_t pad_id = pad == ClipPadding::kEndOfText ? eos_ : 0;
  at::Tensor out = torch::full({static_cast<int64_t>(captions.size()), max_length}, pad_id, torch::kLong);
  auto acc = out.accessor<int64_t, 2>();
  for (size_t b = 0; b < captions.size(); ++b) {
    std::vector<int64_t> ids = encode(captions[b]);
    if (static_cast<int64_t>(ids.size()) > max_length - 2) ids.resize(max_length - 2);
    int64_t k = 0;
    acc[b][k++] = bos_;
    for (int64_t id : ids) acc[b][k++] = id;
    acc[b][k] = eos_;
  }
  return out;
}

std::string ClipTokenizer::decode(const std::vector<int64_t>& ids) const {
  static const std::unordered_map<std::string, unsigned char> byte_of = [] {
    std::unordered_map<std::string, unsigned char> m;
    const auto& t = byte_to_unicode();
    for (int b = 0; b < 256; ++b) m[t[b]] = static_cast<unsigned char>(b);
    return m;
  }();
  std::string out;
  for (int64_t id : ids) {
    auto it = tokens_.find(id);
    if (it == tokens_.end()) fail("ClipTokenizer: unknown id {} (vocabulary size {})", id, vocab_size_);
    std::string token = it->second;
    if (token == kStartOfText || token == kEndOfText) {
      out += token;
      continue;
    }
    bool word_end = false;
    if (token.size() >= 4 && token.compare(token.size() - 4, 4, kWordEnd) == 0) {
      token.resize(token.size() - 4);
      word_end = true;
    }
    for (size_t i = 0; i < token.size();) {
      const CodePoint cp = decode_at(token, i);
      auto b = byte_of.find(token.substr(i, cp.len));
      if (b != byte_of.end()) out += static_cast<char>(b->second);
      i += cp.len;
    }
    if (word_end) out += ' ';
  }
  return out;
}

}  // namespace shoestring
