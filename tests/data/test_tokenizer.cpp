// Tests for the word-level caption tokenizer.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/data/tokenizer.h"

using shoestring::Error;
using shoestring::WordTokenizer;
using Ids = std::vector<int64_t>;

TEST(Tokenizer, SplitsLowercaseAlphanumericRuns) {
  EXPECT_EQ(WordTokenizer::split_words("Grinning FACE, smileys & emotion! 100%  x2"),
            (std::vector<std::string>{"grinning", "face", "smileys", "emotion", "100", "x2"}));
  EXPECT_EQ(WordTokenizer::split_words("medium-light_skin"), (std::vector<std::string>{"medium", "light", "skin"}));
  EXPECT_EQ(WordTokenizer::split_words("caf\xc3\xa9 ok"), (std::vector<std::string>{"caf", "ok"}));
  EXPECT_TRUE(WordTokenizer::split_words(" ,;- ").empty());
}

TEST(Tokenizer, VocabularyByCountThenAlphabetical) {
  // counts: a=3, b=2, c=2, z=1, y=1.
  const auto tok = WordTokenizer::build({"b a z", "A c", "a, b c y"}, 6);
  EXPECT_EQ(tok.vocab(), (std::vector<std::string>{"<pad>", "<unk>", "<bos>", "a", "b", "c", "y", "z"}));
  EXPECT_EQ(tok.vocab_size(), 8);
  EXPECT_EQ(tok.max_length(), 6);
  // Same captions in another order: same ids.
  const auto again = WordTokenizer::build({"a, b c y", "A c", "b a z"}, 6);
  EXPECT_EQ(again.vocab(), tok.vocab());
  // min_count drops rare words.
  const auto common = WordTokenizer::build({"b a z", "A c", "a, b c y"}, 6, 2);
  EXPECT_EQ(common.vocab(), (std::vector<std::string>{"<pad>", "<unk>", "<bos>", "a", "b", "c"}));
}

TEST(Tokenizer, EncodePadsTruncatesAndMapsUnknown) {
  const auto tok = WordTokenizer::build({"red heart", "red apple", "green apple"}, 5);
  // vocab: apple=3 (2), red=4 (2), green=5, heart=6.
  ASSERT_EQ(tok.id_of("apple"), 3);
  ASSERT_EQ(tok.id_of("red"), 4);
  EXPECT_EQ(tok.encode("Red Apple"), (Ids{2, 4, 3, 0, 0}));
  EXPECT_EQ(tok.encode("blue apple"), (Ids{2, 1, 3, 0, 0}));
  EXPECT_EQ(tok.encode("red red red red red red"), (Ids{2, 4, 4, 4, 4}));
  EXPECT_EQ(tok.encode(""), (Ids{2, 0, 0, 0, 0}));
  EXPECT_EQ(tok.id_of("<bos>"), WordTokenizer::kUnk);  // specials are not words
  EXPECT_EQ(tok.decode(tok.encode("green zebra heart")), "green <unk> heart");
  EXPECT_THROW(tok.decode({99}), Error);

  const at::Tensor batch = tok.encode_batch({"red apple", "", "heart"});
  ASSERT_EQ(batch.scalar_type(), at::kLong);
  ASSERT_EQ(batch.sizes(), (std::vector<int64_t>{3, 5}));
  EXPECT_TRUE(batch.equal(at::tensor({2, 4, 3, 0, 0, 2, 0, 0, 0, 0, 2, 6, 0, 0, 0}, at::kLong).view({3, 5})));
  EXPECT_EQ(tok.encode_batch({}).sizes(), (std::vector<int64_t>{0, 5}));

  const auto tiny = WordTokenizer::build({"a"}, 1);
  EXPECT_EQ(tiny.encode("a a"), (Ids{2}));
  EXPECT_THROW(WordTokenizer::build({"a"}, 0), Error);
  EXPECT_THROW(WordTokenizer::build({"a"}, 4, 0), Error);
}

TEST(Tokenizer, JsonRoundTrip) {
  const auto tok = WordTokenizer::build({"waving hand, medium skin tone", "grinning face"}, 8);
  const nlohmann::json j = tok.to_json();
  EXPECT_EQ(j.at("kind"), "word");
  EXPECT_EQ(j.at("max_length"), 8);
  const auto back = WordTokenizer::from_json(nlohmann::json::parse(j.dump()));
  EXPECT_EQ(back.vocab(), tok.vocab());
  EXPECT_EQ(back.max_length(), tok.max_length());
  EXPECT_EQ(back.encode("grinning hand zebra"), tok.encode("grinning hand zebra"));
}

TEST(Tokenizer, MalformedJsonThrowsNamingTheKey) {
  const nlohmann::json good = WordTokenizer::build({"a b"}, 4).to_json();
  auto expect_error = [](const nlohmann::json& j, const std::string& needle) {
    try {
      WordTokenizer::from_json(j);
      ADD_FAILURE() << "no error for " << j.dump();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error(nlohmann::json::array(), "object");
  nlohmann::json j = good;
  j["kind"] = "bpe";
  expect_error(j, "kind");
  j = good;
  j.erase("max_length");
  expect_error(j, "max_length");
  j = good;
  j["max_length"] = 0;
  expect_error(j, "max_length");
  j = good;
  j["vocab"] = "a b";
  expect_error(j, "vocab");
  j = good;
  j["vocab"][1] = "<bos>";
  expect_error(j, "vocab[1]");
  j = good;
  j["vocab"].push_back("a");
  expect_error(j, "repeats");
  j = good;
  j["vocab"].push_back("Bad Word");
  expect_error(j, "vocab[5]");
  j = good;
  j["vocab"].push_back(3);
  expect_error(j, "vocab[5]");
}
