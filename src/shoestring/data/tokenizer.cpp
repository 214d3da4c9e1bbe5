// Word-level tokenizer. See tokenizer.h.
#include "shoestring/data/tokenizer.h"

#include <map>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "shoestring/core/error.h"

namespace shoestring {
namespace {

const char* const kSpecial[WordTokenizer::kNumSpecial] = {"<pad>", "<unk>", "<bos>"};

bool is_word_char(char c) { return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9'); }

char to_lower_ascii(char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c; }

}  // namespace

std::vector<std::string> WordTokenizer::split_words(std::string_view text) {
  std::vector<std::string> words;
  std::string current;
  for (char raw : text) {
    const char c = to_lower_ascii(raw);
    if (is_word_char(c)) {
      current.push_back(c);
    } else if (!current.empty()) {
      words.push_back(std::move(current));
      current.clear();
    }
  }
  if (!current.empty()) words.push_back(std::move(current));
  return words;
}

WordTokenizer::WordTokenizer(std::vector<std::string> vocab, int64_t max_length)
    : vocab_(std::move(vocab)), max_length_(max_length) {
  for (size_t i = 0; i < vocab_.size(); ++i) ids_.emplace(vocab_[i], static_cast<int64_t>(i));
}

WordTokenizer WordTokenizer::build(const std::vector<std::string>& captions, int64_t max_length, int64_t min_count) {
  if (max_length < 1) fail("tokenizer: max_length must be >= 1 (room for <bos>), got {}", max_length);
  if (min_count < 1) fail("tokenizer: min_count must be >= 1, got {}", min_count);
  std::map<std::string, int64_t> counts;
  for (const std::string& caption : captions) {
    for (std::string& w : split_words(caption)) ++counts[std::move(w)];
  }
  std::vector<std::pair<std::string, int64_t>> sorted;
  for (auto& [word, count] : counts) {
    if (count >= min_count) sorted.emplace_back(word, count);
  }
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) {
    if (a.second != b.second) return a.second > b.second;
    return a.first < b.first;
  });
  std::vector<std::string> vocab(std::begin(kSpecial), std::end(kSpecial));
  for (auto& entry : sorted) vocab.push_back(std::move(entry.first));
  return WordTokenizer(std::move(vocab), max_length);
}

WordTokenizer WordTokenizer::from_json(const nlohmann::json& j) {
  if (!j.is_object()) fail("tokenizer json: expected an object, got {}", j.type_name());
  const auto kind = j.find("kind");
  if (kind == j.end() || !kind->is_string() || kind->get<std::string>() != "word") {
    fail("tokenizer json: key 'kind' must be the string \"word\"");
  }
  const auto len = j.find("max_length");
  if (len == j.end() || !len->is_number_integer() || len->get<int64_t>() < 1) {
    fail("tokenizer json: key 'max_length' must be an integer >= 1");
  }
  const auto vocab_it = j.find("vocab");
  if (vocab_it == j.end() || !vocab_it->is_array()) {
    fail("tokenizer json: key 'vocab' must be an array of strings");
  }
  if (vocab_it->size() < static_cast<size_t>(kNumSpecial)) {
    fail("tokenizer json: key 'vocab' must start with \"<pad>\", \"<unk>\", \"<bos>\"");
  }
  std::vector<std::string> vocab;
  std::unordered_map<std::string, size_t> seen;
  for (size_t i = 0; i < vocab_it->size(); ++i) {
    const auto& v = (*vocab_it)[i];
    if (!v.is_string()) fail("tokenizer json: vocab[{}] must be a string, got {}", i, v.type_name());
    std::string word = v.get<std::string>();
    if (i < static_cast<size_t>(kNumSpecial)) {
      if (word != kSpecial[i]) {
        fail("tokenizer json: vocab[{}] must be \"{}\", got \"{}\"", i, kSpecial[i], word);
      }
    } else if (word.empty() || !std::all_of(word.begin(), word.end(), is_word_char)) {
      fail("tokenizer json: vocab[{}] = \"{}\" is not a word of [a-z0-9]", i, word);
    }
    if (!seen.emplace(word, i).second) {
      fail("tokenizer json: vocab[{}] = \"{}\" repeats vocab[{}]", i, word, seen[word]);
    }
    vocab.push_back(std::move(word));
  }
  return WordTokenizer(std::move(vocab), len->get<int64_t>());
}

nlohmann::json WordTokenizer::to_json() const {
  return nlohmann::json{{"kind", "word"}, {"max_length", max_length_}, {"vocab", vocab_}};
}

int64_t WordTokenizer::id_of(std::string_view word) const {
  const auto it = ids_.find(std::string(word));
  if (it == ids_.end() || it->second < kNumSpecial) return kUnk;
  return it->second;
}

std::vector<int64_t> WordTokenizer::encode(std::string_view caption) const {
  std::vector<int64_t> ids(static_cast<size_t>(max_length_), kPad);
  ids[0] = kBos;
  size_t pos = 1;
  for (const std::string& w : split_words(caption)) {
    if (pos >= ids.size()) break;
    ids[pos++] = id_of(w);
  }
  return ids;
}

at::Tensor WordTokenizer::encode_batch(const std::vector<std::string>& captions) const {
  auto out = at::empty({static_cast<int64_t>(captions.size()), max_length_}, at::kLong);
  int64_t* data = out.data_ptr<int64_t>();
  for (size_t b = 0; b < captions.size(); ++b) {
    const std::vector<int64_t> ids = encode(captions[b]);
    std::copy(ids.begin(), ids.end(), data + b * static_cast<size_t>(max_length_));
  }
  return out;
}

std::string WordTokenizer::decode(const std::vector<int64_t>& ids) const {
  std::string text;
  for (const int64_t id : ids) {
    if (id < 0 || id >= vocab_size()) {
      fail("tokenizer: id {} is outside the vocabulary [0, {})", id, vocab_size());
    }
    if (id == kPad || id == kBos) continue;
    if (!text.empty()) text.push_back(' ');
    text += vocab_[static_cast<size_t>(id)];
  }
  return text;
}

}  // namespace shoestring
