// SentencePiece unigram models (data/sentencepiece.h) and T5's tokenizer
// (data/t5_tokenizer.h) on micro models trained by Python SentencePiece
// (tests/data/text/, scripts/gen_t5_tokenizer_fixture.py): one with T5's
// special ids and nmt_nfkc character map, one with the identity normaliser,
// no dummy prefix, whitespace kept and user-defined pieces. Ids against
// SentencePiece's EncodeAsIds for named prompts (ASCII, empty, whitespace,
// NFKC-normalised, unknown text) and 150 random byte strings each (malformed
// UTF-8 included); padding, the attention mask and truncation (kohya's max
// length, EOS kept last) and the reference code's minimum length 77; errors
// naming the file.
#include <algorithm>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "../error_testing.h"
#include "../io/temp_dir.h"
#include "shoestring/core/error.h"
#include "shoestring/data/t5_tokenizer.h"

using namespace shoestring;

namespace {

const std::string kDir = std::string(SHOESTRING_TEST_DATA) + "/text";
const std::string kModel = kDir + "/t5_micro_spiece.model";

const T5Tokenizer& tok() {
  static const T5Tokenizer t = T5Tokenizer::load(kModel);
  return t;
}

using Ids = std::vector<int64_t>;

struct Case {
  std::string name, text, decoded;
  Ids ids;  // SentencePiece's EncodeAsIds (no EOS)
};

nlohmann::json reference_json(const std::string& file) {
  std::ifstream f(kDir + "/" + file);
  return nlohmann::json::parse(f);
}

std::vector<Case> reference_cases(const std::string& file = "t5_tokenizer_reference.json") {
  const auto j = reference_json(file);
  std::vector<Case> out;
  for (const auto& c : j.at("cases")) {
    out.push_back({c.at("name").get<std::string>(), c.at("text").get<std::string>(), c.at("decoded").get<std::string>(),
                   c.at("ids").get<Ids>()});
  }
  return out;
}

Case reference(const std::string& name) {
  for (const Case& c : reference_cases()) {
    if (c.name == name) return c;
  }
  throw std::runtime_error("no reference case " + name);
}

Ids row(const at::Tensor& t, int64_t b) {
  const at::Tensor r = t[b].contiguous();
  return {r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + r.numel()};
}

Ids with_eos(Ids ids) {
  ids.push_back(1);
  return ids;
}

std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out += static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16));
  return out;
}

// Every named prompt and random byte string of `reference` against SentencePieceModel.
void expect_matches_python(const std::string& model_file, const std::string& reference) {
  const SentencePieceModel model = SentencePieceModel::load(kDir + "/" + model_file);
  const auto j = reference_json(reference);
  EXPECT_EQ(model.size(), j.at("piece_size").get<int64_t>());
  EXPECT_EQ(model.pad_id(), j.at("pad_id").get<int64_t>());
  EXPECT_EQ(model.eos_id(), j.at("eos_id").get<int64_t>());
  EXPECT_EQ(model.unk_id(), j.at("unk_id").get<int64_t>());
  for (const Case& c : reference_cases(reference)) {
    EXPECT_EQ(model.encode(c.text), c.ids) << model_file << " " << c.name;
    EXPECT_EQ(model.decode(c.ids), c.decoded) << model_file << " " << c.name;
  }
  int checked = 0, with_unknown = 0;
  for (const auto& r : j.at("random")) {
    const std::string text = from_hex(r.at("hex").get<std::string>());
    const Ids expected = r.at("ids").get<Ids>();
    EXPECT_EQ(model.encode(text), expected) << model_file << " random text (hex) " << r.at("hex");
    with_unknown += std::count(expected.begin(), expected.end(), model.unk_id()) > 0;
    ++checked;
  }
  EXPECT_EQ(checked, 150);
  EXPECT_GT(with_unknown, 10);  // the unknown-character path is exercised
}

}  // namespace

// ---- SentencePiece unigram models --------------------------------------------------

TEST(SentencePiece, NfkcModelMatchesPythonSentencePiece) {
  expect_matches_python("t5_micro_spiece.model", "t5_tokenizer_reference.json");
}

TEST(SentencePiece, IdentityModelWithUserPiecesMatchesPythonSentencePiece) {
  expect_matches_python("spm_user_identity.model", "spm_user_identity_reference.json");
}

TEST(SentencePiece, NormalisesAsTheModelSays) {
  const SentencePieceModel t5 = SentencePieceModel::load(kModel);
  EXPECT_EQ(t5.normalizer_name(), "nmt_nfkc");
  const std::string S = "\xE2\x96\x81";  // U+2581
  // Dummy prefix, spaces as U+2581, runs collapsed, ends trimmed; NFKC ("ﬁne Ａ" -> "fine A").
  EXPECT_EQ(t5.normalize("  a   cat \t"), S + "a" + S + "cat");
  EXPECT_EQ(t5.normalize("\xEF\xAC\x81ne \xEF\xBC\xA1"), S + "fine" + S + "A");
  EXPECT_EQ(t5.normalize(" \t "), "");
  const SentencePieceModel identity = SentencePieceModel::load(kDir + "/spm_user_identity.model");
  EXPECT_EQ(identity.normalizer_name(), "identity");
  EXPECT_EQ(identity.normalize("  a  b "), S + S + "a" + S + S + "b" + S);
  // A user-defined piece is one id wherever it stands.
  const Ids ids = identity.encode("xohwxy");
  int64_t user = -1;
  for (int64_t id = 0; id < identity.size(); ++id) {
    if (identity.piece(id).text == "ohwx") user = id;
  }
  ASSERT_GE(user, 0);
  EXPECT_EQ(identity.piece(user).type, SentencePieceModel::PieceType::kUserDefined);
  EXPECT_NE(std::find(ids.begin(), ids.end(), user), ids.end());
}

// Malformed protobuf and unsupported models are refused with the name given.
TEST(SentencePiece, RejectsMalformedAndUnsupportedModels) {
  auto error = [](const std::string& bytes) {
    return shoestring::testing::error_of([&] { SentencePieceModel::parse(bytes, "m.model"); });
  };
  EXPECT_NE(error("").find("no pieces"), std::string::npos);
  EXPECT_NE(error("\x0a\x05\x0a\x03").find("m.model"), std::string::npos);        // length past the end
  EXPECT_NE(error("\x0b").find("malformed protobuf"), std::string::npos);         // group wire type
  EXPECT_NE(error(std::string("\x0a\x00", 2)).find("empty"), std::string::npos);  // a piece without text
  // Serialised pieces (ModelProto field 1): "a" normal (type 1), "<unk>" unknown (type 2).
  const std::string piece_a = std::string("\x0a\x05\x0a\x01", 4) + "a" + "\x18\x01";
  const std::string piece_unk = std::string("\x0a\x09\x0a\x05", 4) + "<unk>" + "\x18\x02";
  EXPECT_NE(error(piece_a).find("no unknown piece"), std::string::npos);
  const std::string pieces = piece_unk + piece_a;
  EXPECT_NO_THROW(SentencePieceModel::parse(pieces, "m.model"));
  EXPECT_NE(error(pieces + "\x12\x02\x18\x02").find("unigram"), std::string::npos);            // BPE (model_type 2)
  EXPECT_NE(error(pieces + "\x12\x03\x98\x02\x01").find("byte_fallback"), std::string::npos);  // field 35
  EXPECT_NE(error(pieces + piece_a).find("twice"), std::string::npos);
  // NormalizerSpec precompiled_charsmap of 4 bytes: a trie size and nothing else.
  EXPECT_NE(error(pieces + std::string("\x1a\x06\x12\x04\x01\x00\x00\x00", 8)).find("character map"),
            std::string::npos);
  const SentencePieceModel tiny = SentencePieceModel::parse(pieces, "m.model");
  EXPECT_EQ(tiny.eos_id(), -1);  // no control pieces
  EXPECT_EQ(tiny.unk_id(), 0);
  EXPECT_EQ(tiny.encode("a b"), (Ids{0, 1, 0}));  // "▁a▁b": "▁" unknown, "a", then "▁", "b" unknown (one run)
  EXPECT_THROW(tiny.decode({2}), Error);
}

// ---- T5 tokenizer ------------------------------------------------------------------

TEST(T5Tokenizer, LoadsTheModelsSpecialIds) {
  EXPECT_EQ(tok().pad_id(), 0);
  EXPECT_EQ(tok().eos_id(), 1);
  EXPECT_EQ(tok().unk_id(), 2);
  EXPECT_EQ(tok().piece_count(), 200);
  EXPECT_EQ(tok().path(), kModel);
}

// Every reference prompt: the pieces Python's SentencePiece gives, then EOS;
// decode() gives SentencePiece's DecodeIds text.
TEST(T5Tokenizer, MatchesPythonSentencePiece) {
  const std::vector<Case> cases = reference_cases();
  ASSERT_EQ(cases.size(), 8u);
  for (const Case& c : cases) {
    EXPECT_EQ(tok().encode(c.text), with_eos(c.ids)) << c.name;
    EXPECT_EQ(tok().decode(with_eos(c.ids)), c.decoded) << c.name;
  }
  // The normaliser is the model's (NFKC, whitespace): decomposed accents
  // encode as the composed ones, "  A   photo\tof" as "A photo of".
  EXPECT_EQ(tok().encode(reference("decomposed").text), tok().encode(reference("accents").text));
  EXPECT_EQ(tok().encode(""), Ids{1});
  const Ids unknown = tok().encode(reference("unknown").text);
  EXPECT_NE(std::find(unknown.begin(), unknown.end(), 2), unknown.end());
}

TEST(T5Tokenizer, PadsWithZeroAndMasksPadding) {
  const Case plain = reference("plain");
  const T5Tokens t = tok().tokenize({plain.text, ""}, 16);
  ASSERT_EQ(t.ids.sizes(), (std::vector<int64_t>{2, 16}));
  EXPECT_EQ(t.ids.scalar_type(), torch::kLong);
  EXPECT_EQ(t.attention_mask.scalar_type(), torch::kLong);
  Ids expected = with_eos(plain.ids);
  const int64_t n = static_cast<int64_t>(expected.size());
  Ids mask0(16, 0);
  std::fill(mask0.begin(), mask0.begin() + n, 1);
  expected.resize(16, 0);
  EXPECT_EQ(row(t.ids, 0), expected);
  EXPECT_EQ(row(t.attention_mask, 0), mask0);
  Ids empty(16, 0), empty_mask(16, 0);
  empty[0] = 1;
  empty_mask[0] = 1;
  EXPECT_EQ(row(t.ids, 1), empty);
  EXPECT_EQ(row(t.attention_mask, 1), empty_mask);
  // Without padding to max_length: the longest row's length.
  const T5Tokens shortest = tok().tokenize({plain.text, ""}, 256, /*pad=*/false);
  EXPECT_EQ(shortest.ids.size(1), n);
  EXPECT_EQ(row(shortest.ids, 0), with_eos(plain.ids));
}

// kohya's --t5xxl_max_token_length (default 256): the pieces are cut to
// max_length - 1 and EOS stays last.
TEST(T5Tokenizer, TruncatesKeepingEosLast) {
  const Case long_text = reference("long");
  ASSERT_GT(long_text.ids.size(), 300u);
  const T5Tokens t = tok().tokenize({long_text.text, "a cat"});
  ASSERT_EQ(t.ids.sizes(), (std::vector<int64_t>{2, 256}));
  Ids expected(long_text.ids.begin(), long_text.ids.begin() + 255);
  expected.push_back(1);
  EXPECT_EQ(row(t.ids, 0), expected);
  EXPECT_TRUE(t.attention_mask[0].eq(1).all().item<bool>());
  EXPECT_EQ(t.attention_mask[1].sum().item<int64_t>(), static_cast<int64_t>(tok().encode("a cat").size()));
  // 77 (diffusers' train script default); length 1 keeps EOS alone.
  EXPECT_EQ(row(tok().tokenize({long_text.text}, 77).ids, 0).back(), 1);
  EXPECT_EQ(row(tok().tokenize({long_text.text}, 1).ids, 0), Ids{1});
  // A text exactly max_length long (with EOS) is not cut.
  const Ids plain = with_eos(reference("plain").ids);
  EXPECT_EQ(row(tok().tokenize({reference("plain").text}, static_cast<int64_t>(plain.size())).ids, 0), plain);
  EXPECT_THROW(tok().tokenize({"a"}, 0), Error);
}

// Stability's sd3.5 reference: no truncation, padded to at least 77.
TEST(T5Tokenizer, MinimumLengthWithoutTruncation) {
  const Case plain = reference("plain");
  T5Tokens t = tok().tokenize_min_length({plain.text});
  ASSERT_EQ(t.ids.sizes(), (std::vector<int64_t>{1, 77}));
  Ids expected = with_eos(plain.ids);
  expected.resize(77, 0);
  EXPECT_EQ(row(t.ids, 0), expected);
  const Case long_text = reference("long");
  t = tok().tokenize_min_length({plain.text, long_text.text});
  const int64_t n = static_cast<int64_t>(long_text.ids.size()) + 1;
  ASSERT_EQ(t.ids.sizes(), (std::vector<int64_t>{2, n}));
  EXPECT_EQ(row(t.ids, 1), with_eos(long_text.ids));
  EXPECT_EQ(t.attention_mask[0].sum().item<int64_t>(), static_cast<int64_t>(plain.ids.size()) + 1);
  EXPECT_THROW(tok().tokenize_min_length({"a"}, 0), Error);
}

TEST(T5Tokenizer, ErrorsNameTheFile) {
  shoestring::testing::TempDir dir;
  const std::string absent = dir.file("absent/spiece.model");
  std::string e = shoestring::testing::error_of([&] { T5Tokenizer::load(absent); });
  EXPECT_NE(e.find(absent), std::string::npos) << e;
  e = shoestring::testing::error_of([&] { T5Tokenizer::load(dir.file("")); });  // a folder
  EXPECT_NE(e.find("not a file"), std::string::npos) << e;
  const std::string corrupt = dir.file("spiece.model");
  {
    std::ofstream f(corrupt, std::ios::binary);
    f << "this is not a protobuf \x01\x02\x03\xff\xfe";
  }
  e = shoestring::testing::error_of([&] { T5Tokenizer::load(corrupt); });
  EXPECT_NE(e.find(corrupt), std::string::npos) << e;
  EXPECT_NE(e.find("not a SentencePiece model"), std::string::npos) << e;
  // A truncated copy of the real model.
  const std::string truncated = dir.file("truncated.model");
  {
    std::ifstream in(kModel, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::ofstream out(truncated, std::ios::binary);
    out << bytes.substr(0, bytes.size() / 2);
  }
  e = shoestring::testing::error_of([&] { T5Tokenizer::load(truncated); });
  EXPECT_NE(e.find(truncated), std::string::npos) << e;
  EXPECT_THROW(tok().decode({200}), Error);
  EXPECT_THROW(tok().decode({-1}), Error);
}
