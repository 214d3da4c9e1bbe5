// Tests for batch-time caption processing (kohya's caption_dropout_rate,
// shuffle_caption, keep_tokens, caption_tag_dropout_rate). References: the
// definitions in kohya's sd-scripts BaseDataset.process_caption (kept tags stay
// first, the others are permuted uniformly and each kept with probability
// 1 - rate) checked by counting over many draws against binomial bounds.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>

#include <torch/torch.h>

#include "../error_testing.h"
#include "shoestring/data/caption_processing.h"

using shoestring::caption_tags;
using shoestring::CaptionProcessing;
using shoestring::process_captions;
using shoestring::testing::error_of;
using Strings = std::vector<std::string>;

TEST(CaptionProcessing, TagsAreTrimmedAndEmptyOnesLeftOut) {
  EXPECT_EQ(caption_tags(" grinning face, grinning,, smileys & emotion , "),
            (Strings{"grinning face", "grinning", "smileys & emotion"}));
  EXPECT_EQ(caption_tags("one"), (Strings{"one"}));
  EXPECT_TRUE(caption_tags(" , ,\t").empty());
  EXPECT_TRUE(caption_tags("").empty());
}

TEST(CaptionProcessing, WithoutTagOptionsOnlyDropoutChangesCaptionsAndTheRngStreamIsTheOldOne) {
  const Strings in = {"a, b", "c", "d, e, f"};
  torch::manual_seed(7);
  const Strings out = process_captions(in, CaptionProcessing{});
  const at::Tensor after = torch::rand({4});
  EXPECT_EQ(out, in);
  // The stream before tag processing existed: one float uniform per caption.
  torch::manual_seed(7);
  const at::Tensor u = torch::rand({3});
  const at::Tensor after_old = torch::rand({4});
  EXPECT_TRUE(torch::equal(after, after_old));

  // Dropout: caption i is dropped exactly when its uniform is below the rate.
  CaptionProcessing p;
  p.dropout_rate = 0.5;
  torch::manual_seed(7);
  const Strings dropped = process_captions(in, p);
  for (size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ(dropped[i], u[static_cast<int64_t>(i)].item<double>() < 0.5 ? "" : in[i]) << i;
  }
  p.dropout_rate = 1.0;
  EXPECT_EQ(process_captions(in, p), (Strings{"", "", ""}));
}

TEST(CaptionProcessing, ShuffleKeepsLeadingTagsAndPermutesTheRestUniformly) {
  CaptionProcessing p;
  p.shuffle = true;
  p.keep_tokens = 1;
  torch::manual_seed(1);
  const int draws = 6000;
  std::map<std::string, int> seen;
  for (int i = 0; i < draws / 100; ++i) {
    const Strings out = process_captions(Strings(100, "name,  x, y ,z"), p);
    for (const auto& c : out) {
      Strings tags = caption_tags(c);
      ASSERT_EQ(tags.size(), 4u) << c;
      EXPECT_EQ(tags[0], "name") << c;
      Strings sorted(tags.begin() + 1, tags.end());
      std::sort(sorted.begin(), sorted.end());
      EXPECT_EQ(sorted, (Strings{"x", "y", "z"})) << c;
      ++seen[c];
    }
  }
  // 3! orders, each with probability 1/6: within 5 binomial standard deviations.
  ASSERT_EQ(seen.size(), 6u);
  const double mean = draws / 6.0, sd = std::sqrt(draws * (1.0 / 6) * (5.0 / 6));
  for (const auto& [caption, count] : seen) EXPECT_NEAR(count, mean, 5 * sd) << caption;
  EXPECT_EQ(seen.count("name, x, y, z"), 1u);  // joined with ", " as kohya does
}

TEST(CaptionProcessing, TagDropoutDropsEachFlexibleTagWithTheRate) {
  CaptionProcessing p;
  p.tag_dropout_rate = 0.3;
  p.keep_tokens = 2;
  torch::manual_seed(3);
  const int draws = 5000;
  std::map<std::string, int> kept;
  for (int i = 0; i < draws / 100; ++i) {
    for (const auto& c : process_captions(Strings(100, "k1, k2, a, b, c"), p)) {
      const Strings tags = caption_tags(c);
      ASSERT_GE(tags.size(), 2u);
      EXPECT_EQ(tags[0], "k1");
      EXPECT_EQ(tags[1], "k2");
      // Not shuffled: the survivors keep their order.
      EXPECT_TRUE(std::is_sorted(tags.begin() + 2, tags.end())) << c;
      for (size_t k = 2; k < tags.size(); ++k) ++kept[tags[k]];
    }
  }
  const double mean = draws * 0.7, sd = std::sqrt(draws * 0.7 * 0.3);
  for (const char* t : {"a", "b", "c"}) EXPECT_NEAR(kept[t], mean, 5 * sd) << t;
  // keep_tokens larger than the caption keeps all of it.
  p.keep_tokens = 10;
  EXPECT_EQ(process_captions({"a, b"}, p), (Strings{"a, b"}));
}

TEST(CaptionProcessing, BadSettingsNameTheKey) {
  CaptionProcessing p;
  p.tag_dropout_rate = 1.5;
  EXPECT_NE(error_of([&] { process_captions({"a"}, p); }).find("caption_tag_dropout_rate"), std::string::npos);
  p = CaptionProcessing{};
  p.dropout_rate = -0.1;
  EXPECT_NE(error_of([&] { process_captions({"a"}, p); }).find("caption_dropout_rate"), std::string::npos);
  p = CaptionProcessing{};
  p.keep_tokens = -1;
  EXPECT_NE(error_of([&] { process_captions({"a"}, p); }).find("keep_tokens"), std::string::npos);
}
