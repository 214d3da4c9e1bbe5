// CLIP BPE tokenizer (data/clip_tokenizer.h) on a hand-made tokenizer folder,
// tests/data/clip_tokenizer/ (scripts/gen_clip_tokenizer_fixture.py), laid out
// as OpenAI's simple_tokenizer.py lays out CLIP's vocabulary:
//   ids 0..255   byte characters in bytes_to_unicode order: '!'..'~' are ids
//                0..93 (id = ASCII code - 33), bytes 0xA1..0xAC ids 94..105,
//                0xAE..0xFF ids 106..187, then the 68 remaining bytes
//                (0x00..0x20, 0x7F..0xA0, 0xAD, in byte order) ids 188..255
//   ids 256..511 the same characters + "</w>" (id + 256)
//   ids 512..524 the merges, rank r -> id 512 + r:
//     0 "h o"  1 "ho t"  2 "p hot"  3 "phot o</w>"  4 "o t</w>"  5 "t o"  6 "c a"
//     7 "ca t</w>"  8 "o f</w>"  9 "' s</w>"  10 "Ã ©</w>"  11 "d o"  12 "do g</w>"
//   525 <|startoftext|>, 526 <|endoftext|>
// The expected ids below are derived by hand with CLIP's BPE (merge the
// adjacent pair of lowest rank, all its occurrences, until none is a merge);
// the generator re-derives them with an independent Python implementation.
#include <filesystem>
#include <fstream>
#include <functional>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../io/temp_dir.h"
#include "shoestring/core/error.h"
#include "shoestring/data/clip_tokenizer.h"

using namespace shoestring;

namespace {

const std::string kDir = std::string(SHOESTRING_TEST_DATA) + "/clip_tokenizer";

const ClipTokenizer& tok() {
  static const ClipTokenizer t = ClipTokenizer::load(kDir);
  return t;
}

using Ids = std::vector<int64_t>;

std::vector<int64_t> row(const at::Tensor& t, int64_t b) {
  at::Tensor r = t[b].contiguous();
  return {r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + r.numel()};
}

void write(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

}  // namespace

TEST(ClipTokenizer, LoadsTheFolder) {
  EXPECT_EQ(tok().bos_id(), 525);
  EXPECT_EQ(tok().eos_id(), 526);
  EXPECT_EQ(tok().vocab_size(), 527);
  EXPECT_EQ(tok().merge_count(), 13);  // the "#version" header is not a merge
}

TEST(ClipTokenizer, ByteTableIsGpt2s) {
  const auto& t = ClipTokenizer::byte_to_unicode();
  EXPECT_EQ(t['a'], "a");
  EXPECT_EQ(t[0xC3], "\xC3\x83");  // U+00C3 "Ã": printable Latin-1 maps to itself
  EXPECT_EQ(t[0], "\xC4\x80");     // byte 0 -> U+0100
  EXPECT_EQ(t[' '], "\xC4\xA0");   // byte 0x20 is the 33rd unprintable byte -> U+0120 "Ġ"
  EXPECT_EQ(t[0xAD], "\xC5\x83");  // the last one, 0xAD -> U+0100 + 67 = U+0143
}

// "a" is one character, so its only symbol is "a</w>" = 256 + 64 = 320.
// "photo": p h o t o</w> -> (h,o) r0 -> p ho t o</w> -> (ho,t) r1 -> p hot o</w>
//   -> (p,hot) r2 -> phot o</w> -> r3 -> photo</w> = 515.
// "of": o f</w> -> r8 = 520. "cat": c a t</w> -> (c,a) r6 -> ca t</w> -> r7 -> cat</w> = 519.
TEST(ClipTokenizer, EncodesWordsByMergeRank) {
  EXPECT_EQ(tok().encode("a photo of a cat"), (Ids{320, 515, 520, 320, 519}));
  // "tot": t o t</w> has (t,o) r5 and (o,t</w>) r4: the lower rank wins although it
  // is further right -> t ot</w> = [t = 116 - 33 = 83, 512 + 4 = 516].
  EXPECT_EQ(tok().encode("tot"), (Ids{83, 516}));
  // "hohoh": h o h o h</w>: every (h,o) merges in one step -> ho ho h</w>; no pair
  // left -> [512, 512, h</w> = 256 + 71 = 327].
  EXPECT_EQ(tok().encode("hohoh"), (Ids{512, 512, 327}));
  EXPECT_EQ(tok().bpe("hohoh"), (std::vector<std::string>{"ho", "ho", "h</w>"}));
  // No merge applies: z = 122 - 33 = 89, z</w> = 345.
  EXPECT_EQ(tok().encode("zz"), (Ids{89, 345}));
  EXPECT_EQ(tok().encode("dog"), (Ids{524}));
}

TEST(ClipTokenizer, PreTokenizerSplitsAsClipsRegex) {
  // Digits are single tokens: 4</w> = 256 + 19, 2</w> = 256 + 17.
  EXPECT_EQ(tok().encode("42"), (Ids{275, 273}));
  // a, 1, b: 320, 1</w> = 256 + 16, b</w> = 256 + 65.
  EXPECT_EQ(tok().encode("a1b"), (Ids{320, 272, 321}));
  // Contraction "'s": ' s</w> -> r9 = 521.
  EXPECT_EQ(tok().encode("cat's"), (Ids{519, 521}));
  // A punctuation run is one word: ! = 0, !</w> = 256.
  EXPECT_EQ(tok().encode("cat!!"), (Ids{519, 0, 256}));
  EXPECT_EQ(ClipTokenizer::pre_tokenize("it's a dog's-life!! 12ab"),
            (std::vector<std::string>{"it", "'s", "a", "dog", "'s", "-", "life", "!!", "1", "2", "ab"}));
  // The greedy punctuation run swallows the apostrophe, as the regex does.
  EXPECT_EQ(ClipTokenizer::pre_tokenize("?!'s"), (std::vector<std::string>{"?!'", "s"}));
  EXPECT_EQ(ClipTokenizer::pre_tokenize("x<|endoftext|>y"), (std::vector<std::string>{"x", "<|endoftext|>", "y"}));
}

TEST(ClipTokenizer, CleansWhitespaceCaseAndHtml) {
  EXPECT_EQ(tok().encode(" \t a \n\n cat "), (Ids{320, 519}));
  // "&amp;" -> "&": &</w> = 256 + (38 - 33) = 261; dog = 524.
  EXPECT_EQ(tok().encode("cat &amp; dog"), (Ids{519, 261, 524}));
  EXPECT_EQ(ClipTokenizer::clean_text("  A&amp;amp;B\xC2\xA0\xE3\x80\x80 &#65;&#x42; &bogus;  "),
            "a&b ab &bogus;");  // entities twice (so &amp;amp; -> &), NBSP and ideographic space collapse
  EXPECT_EQ(
      ClipTokenizer::clean_text("\xC3\x89T\xC3\x89 \xCE\xA3\xCE\x9F\xCE\xA6\xCE\x99\xCE\x91 \xD0\x9C\xD0\x98\xD0\xA0"),
      "\xC3\xA9t\xC3\xA9 \xCF\x83\xCE\xBF\xCF\x86\xCE\xB9\xCE\xB1 \xD0\xBC\xD0\xB8\xD1\x80");  // été σοφια мир
}

// "café" = c a f 0xC3 0xA9: é is a letter, so one word. Byte 0xC3 -> "Ã"
// (id 106 + 0xC3 - 0xAE = 127), 0xA9 -> "©" (id 94 + 0xA9 - 0xA1 = 102).
// c a f Ã ©</w>: (c,a) r6 first -> ca f Ã ©</w>, then (Ã,©</w>) r10 -> ca f Ã©</w>
// = [518, f = 102 - 33 = 69, 522]. Upper-case É lowercases to é first.
TEST(ClipTokenizer, EncodesUnicode) {
  EXPECT_EQ(tok().encode("caf\xC3\xA9"), (Ids{518, 69, 522}));
  EXPECT_EQ(tok().encode("CAF\xC3\x89"), (Ids{518, 69, 522}));
  // U+1F431 (cat face) = F0 9F 90 B1, not a letter or number: one word.
  // F0 -> id 106 + 0xF0 - 0xAE = 172; 9F is unprintable: 33 + (0x9F - 0x7F) = 65th
  // -> id 188 + 65 = 253; 90 -> 188 + 33 + 17 = 238; B1 -> 106 + 3 = 109, last -> +256 = 365.
  EXPECT_EQ(tok().encode("\xF0\x9F\x90\xB1"), (Ids{172, 253, 238, 365}));
  EXPECT_EQ(ClipTokenizer::pre_tokenize("\xE7\x8C\xAB\xE3\x81\xAD\xE3\x81\x93 \xD9\xA3"),
            (std::vector<std::string>{"\xE7\x8C\xAB\xE3\x81\xAD\xE3\x81\x93", "\xD9\xA3"}));  // 猫ねこ, Arabic-Indic 3
  // Round trip through decode restores the bytes.
  EXPECT_EQ(tok().decode(tok().encode("caf\xC3\xA9 \xF0\x9F\x90\xB1")), "caf\xC3\xA9 \xF0\x9F\x90\xB1 ");
}

TEST(ClipTokenizer, SpecialTokensInTextMapToTheirIds) {
  EXPECT_EQ(tok().encode("<|startoftext|>a cat<|endoftext|>"), (Ids{525, 320, 519, 526}));
}

TEST(ClipTokenizer, BatchAddsSpecialsTruncatesAndPads) {
  const at::Tensor eos_pad = tok().encode_batch({"a photo of a cat", "a cat", ""}, 6, ClipPadding::kEndOfText);
  EXPECT_EQ(eos_pad.scalar_type(), torch::kLong);
  EXPECT_EQ(eos_pad.sizes(), (std::vector<int64_t>{3, 6}));
  // 5 ids do not fit in 6 - 2: the first 4 are kept and <|endoftext|> stays last.
  EXPECT_EQ(row(eos_pad, 0), (Ids{525, 320, 515, 520, 320, 526}));
  EXPECT_EQ(row(eos_pad, 1), (Ids{525, 320, 519, 526, 526, 526}));
  EXPECT_EQ(row(eos_pad, 2), (Ids{525, 526, 526, 526, 526, 526}));
  const at::Tensor zero_pad = tok().encode_batch({"a photo of a cat", "a cat", ""}, 6, ClipPadding::kZero);
  EXPECT_EQ(row(zero_pad, 0), (Ids{525, 320, 515, 520, 320, 526}));
  EXPECT_EQ(row(zero_pad, 1), (Ids{525, 320, 519, 526, 0, 0}));
  EXPECT_EQ(row(zero_pad, 2), (Ids{525, 526, 0, 0, 0, 0}));
  // Default length 77; the EOS is the row's largest id, where CLIP pools.
  const at::Tensor full = tok().encode_batch({"a cat"});
  EXPECT_EQ(full.size(1), 77);
  EXPECT_EQ(full.argmax(1).item<int64_t>(), 3);
  EXPECT_THROW(tok().encode_batch({"a"}, 1), Error);
}

TEST(ClipTokenizer, ErrorsNameTheFile) {
  shoestring::testing::TempDir dir;
  auto expect_error = [](const std::function<void()>& f, const std::string& needle) {
    try {
      f();
      FAIL() << "expected an error mentioning " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([&] { ClipTokenizer::load(dir.path().string()); }, "vocab.json");
  std::filesystem::copy_file(kDir + "/vocab.json", dir.file("vocab.json"));
  expect_error([&] { ClipTokenizer::load(dir.path().string()); }, "merges.txt");
  write(dir.file("merges.txt"), "#version: 0.2\nh o\nbad line here\n");
  expect_error([&] { ClipTokenizer::load(dir.path().string()); }, "merges.txt:3");
  write(dir.file("merges.txt"), "#version: 0.2\nh o\n");
  EXPECT_EQ(ClipTokenizer::load(dir.path().string()).merge_count(), 1);
  write(dir.file("vocab.json"), "{\"a\": 1,");
  expect_error([&] { ClipTokenizer::load(dir.path().string()); }, "vocab.json: not valid JSON");
  write(dir.file("vocab.json"), "{\"a\": 0, \"<|endoftext|>\": 1}");
  expect_error([&] { ClipTokenizer::load(dir.path().string()); }, "<|startoftext|>");
  write(dir.file("vocab.json"), "{\"a\": \"x\"}");
  expect_error([&] { ClipTokenizer::load(dir.path().string()); }, "vocab.json");
}
