#include "shoestring/data/t5_tokenizer.h"

#include <algorithm>
#include <utility>

#include <ATen/ATen.h>

#include "shoestring/core/error.h"

namespace shoestring {

T5Tokenizer T5Tokenizer::load(const std::string& path) {
  T5Tokenizer t;
  t.model_ = std::make_shared<const SentencePieceModel>(SentencePieceModel::load(path));
  t.path_ = path;
  t.eos_ = t.model_->eos_id();
  t.pad_ = t.model_->pad_id();
  t.unk_ = t.model_->unk_id();
  if (t.eos_ < 0 || t.pad_ < 0)
    fail("T5 tokenizer: {} defines no {} control piece (T5's spiece.model has <pad> 0 and </s> 1)", path,
         t.eos_ < 0 ? "end-of-sequence" : "padding");
  return t;
}

std::vector<int64_t> T5Tokenizer::encode(std::string_view text) const {
  std::vector<int64_t> ids = model_->encode(text);
  ids.push_back(eos_);
  return ids;
}

T5Tokens T5Tokenizer::pad_rows(std::vector<std::vector<int64_t>> rows, int64_t length) const {
  const auto B = static_cast<int64_t>(rows.size());
  at::Tensor ids = at::full({B, length}, pad_, at::kLong);
  at::Tensor mask = at::zeros({B, length}, at::kLong);
  auto id = ids.accessor<int64_t, 2>();
  auto m = mask.accessor<int64_t, 2>();
  for (int64_t b = 0; b < B; ++b) {
    const std::vector<int64_t>& row = rows[static_cast<size_t>(b)];
    for (size_t i = 0; i < row.size(); ++i) {
      id[b][static_cast<int64_t>(i)] = row[i];
      m[b][static_cast<int64_t>(i)] = 1;
    }
  }
  return {ids, mask};
}

T5Tokens T5Tokenizer::tokenize(const std::vector<std::string>& texts, int64_t max_length, bool pad) const {
  if (max_length < 1) fail("T5 tokenizer: max_length must be >= 1 (room for EOS), got {}", max_length);
  std::vector<std::vector<int64_t>> rows;
  int64_t longest = 0;
  for (const std::string& text : texts) {
    std::vector<int64_t> row = encode(text);
    if (static_cast<int64_t>(row.size()) > max_length) {
      row.resize(static_cast<size_t>(max_length));
      row.back() = eos_;  // pieces cut to max_length - 1, EOS kept last (HF truncation with special tokens)
    }
    longest = std::max(longest, static_cast<int64_t>(row.size()));
    rows.push_back(std::move(row));
  }
  return pad_rows(std::move(rows), pad ? max_length : longest);
}

T5Tokens T5Tokenizer::tokenize_min_length(const std::vector<std::string>& texts, int64_t min_length) const {
  if (min_length < 1) fail("T5 tokenizer: min_length must be >= 1, got {}", min_length);
  std::vector<std::vector<int64_t>> rows;
  int64_t length = min_length;
  for (const std::string& text : texts) {
    rows.push_back(encode(text));
    length = std::max(length, static_cast<int64_t>(rows.back().size()));
  }
  return pad_rows(std::move(rows), length);
}

std::string T5Tokenizer::decode(const std::vector<int64_t>& ids) const {
  for (const int64_t id : ids) {
    if (id < 0 || id >= model_->size()) fail("T5 tokenizer ({}): id {} is outside [0, {})", path_, id, model_->size());
  }
  return model_->decode(ids);  // pad and EOS are control pieces: dropped
}

}  // namespace shoestring
