#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "shoestring/core/error.h"
#include "shoestring/train/config.h"

using shoestring::Error;
using shoestring::parse_config;

namespace {
std::string error_of(const std::string& text, const std::vector<std::string>& sets = {}) {
  try {
    parse_config(text, "run.toml", sets);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(Config, DefaultsAndKohyaKeys) {
  auto c = parse_config(
      "learning_rate = 2e-4\ntrain_batch_size = 8\nmax_train_steps = 100\n"
      "gradient_accumulation_steps = 2\ngradient_checkpointing = true\nfull_bf16 = true\n"
      "mixed_precision = \"bf16\"\nmax_grad_norm = 0.5\nsave_every_n_steps = 50\nseed = 7\n"
      "[model]\nbase_channels = 32\n",
      "run.toml");
  EXPECT_DOUBLE_EQ(c.learning_rate, 2e-4);
  EXPECT_EQ(c.train_batch_size, 8);
  EXPECT_EQ(c.max_train_steps, 100);
  EXPECT_EQ(c.gradient_accumulation_steps, 2);
  EXPECT_TRUE(c.gradient_checkpointing);
  EXPECT_TRUE(c.full_bf16);
  EXPECT_EQ(c.mixed_precision, "bf16");
  EXPECT_DOUBLE_EQ(c.max_grad_norm, 0.5);
  EXPECT_EQ(c.save_every_n_steps, 50);
  EXPECT_EQ(c.seed, 7);
  EXPECT_EQ(c.base_channels, 32);
  EXPECT_EQ(c.resolution, shoestring::TrainConfig{}.resolution);  // untouched key keeps its default
}

TEST(Config, UnknownKeyNamesFileLineAndNearestKey) {
  std::string e = error_of("seed = 1\nlearning_rat = 1e-4\n");
  EXPECT_NE(e.find("run.toml:2"), std::string::npos) << e;
  EXPECT_NE(e.find("unknown key 'learning_rat'"), std::string::npos) << e;
  EXPECT_NE(e.find("did you mean 'learning_rate'"), std::string::npos) << e;
  std::string e2 = error_of("[model]\nbase_chanels = 3\n");
  EXPECT_NE(e2.find("model.base_channels"), std::string::npos) << e2;
}

TEST(Config, WrongTypeAndRangeNameKeyValueAndAllowed) {
  std::string e = error_of("train_batch_size = \"eight\"\n");
  EXPECT_NE(e.find("train_batch_size"), std::string::npos) << e;
  EXPECT_NE(e.find("\"eight\""), std::string::npos) << e;
  EXPECT_NE(e.find("an integer"), std::string::npos) << e;
  std::string r = error_of("caption_dropout_rate = 1.5\n");
  EXPECT_NE(r.find("caption_dropout_rate"), std::string::npos) << r;
  EXPECT_NE(r.find("[0, 1]"), std::string::npos) << r;
  // A float is shown as written, not with its binary expansion (0.050000000000000003).
  std::string t = error_of("ddp_timeout = 0.05\n");
  EXPECT_NE(t.find("invalid value 0.05 for 'ddp_timeout'"), std::string::npos) << t;
  std::string ch = error_of("mixed_precision = \"fp8\"\n");
  EXPECT_NE(ch.find("one of \"no\", \"bf16\""), std::string::npos) << ch;
  std::string syn = error_of("seed = = 3\n");
  EXPECT_NE(syn.find("run.toml:1"), std::string::npos) << syn;
  EXPECT_NE(syn.find("TOML syntax error"), std::string::npos) << syn;
}

TEST(Config, CrossKeyValidation) {
  EXPECT_NE(error_of("resolution = 30\n").find("divisible by 4"), std::string::npos);
  EXPECT_NE(error_of("[model]\nattention_levels = [5]\n").find("attention_levels"), std::string::npos);
  EXPECT_NE(error_of("optimizer_args = [\"weight_decay\"]\n").find("key=value"), std::string::npos);
}

TEST(Config, SetOverrides) {
  auto c =
      parse_config("seed = 1\n", "run.toml",
                   {"seed=5", "output_dir=runs/x", "model.channel_mult=[1,2]", "attention_levels=[1]", "num_heads=2"});
  EXPECT_EQ(c.seed, 5);
  EXPECT_EQ(c.output_dir, "runs/x");
  EXPECT_EQ(c.channel_mult, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(c.num_heads, 2);
  std::string e = error_of("", {"sede=3"});
  EXPECT_NE(e.find("did you mean 'seed'"), std::string::npos) << e;
  EXPECT_NE(error_of("", {"seed"}).find("key=value"), std::string::npos);
  EXPECT_NE(error_of("", {"seed=abc"}).find("'seed'"), std::string::npos);
}

// What a resume changes is listed, [[precision.rule]] entries included
// (helper-23: a rule changed from master = "fp32" to "none" went unsaid).
TEST(Config, ChangedKeysListsKeysAndPrecisionRules) {
  const std::string rule = "[[precision.rule]]\nmatch = \"*\"\nstorage = \"fp16\"\nmaster = \"fp32\"\n";
  const shoestring::TrainConfig was = parse_config("learning_rate = 1e-4\n" + rule, "run.toml");
  EXPECT_TRUE(shoestring::changed_keys(was, was).empty());
  const shoestring::TrainConfig lr = parse_config("learning_rate = 2e-4\n" + rule, "run.toml");
  const std::vector<std::string> one = shoestring::changed_keys(was, lr);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_NE(one[0].find("learning_rate"), std::string::npos) << one[0];
  std::string no_master = rule;
  no_master.replace(no_master.find("\"fp32\""), 6, "\"none\"");
  const std::vector<std::string> rules =
      shoestring::changed_keys(was, parse_config("learning_rate = 1e-4\n" + no_master, "run.toml"));
  ASSERT_EQ(rules.size(), 1u);
  EXPECT_EQ(rules[0],
            "precision.rule (run: {match = \"*\", storage = \"fp16\", master = \"fp32\"}, now: {match = \"*\", "
            "storage = \"fp16\", master = \"none\"})");
  const std::vector<std::string> none =
      shoestring::changed_keys(was, parse_config("learning_rate = 1e-4\n", "run.toml"));
  ASSERT_EQ(none.size(), 1u);
  EXPECT_NE(none[0].find("now: none)"), std::string::npos) << none[0];
}

TEST(Config, ResolvedTomlWritesShortestFloats) {
  // toml++ prints 17 significant digits (0.29999999999999999); the resolved
  // file keeps what a user would write, and each value reads back exactly.
  auto c = parse_config("max_train_minutes = 0.3\nlearning_rate = 1e-4\nmin_snr_gamma = 5.0\n", "run.toml");
  const std::string text = shoestring::to_toml(c);
  EXPECT_NE(text.find("\nmax_train_minutes = 0.3\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\nlearning_rate = 0.0001\n"), std::string::npos) << text;
  EXPECT_NE(text.find("\nmin_snr_gamma = 5.0\n"), std::string::npos) << text;
  EXPECT_EQ(text.find("99999999"), std::string::npos) << text;
  EXPECT_EQ(text.find("00000001"), std::string::npos) << text;
  const auto d = parse_config(text, "resolved.toml");
  EXPECT_EQ(d.max_train_minutes, 0.3);
  EXPECT_EQ(d.learning_rate, 1e-4);
  EXPECT_EQ(d.min_snr_gamma, 5.0);
}

TEST(Config, ResolvedTomlRoundTrips) {
  auto c = parse_config("learning_rate = 3e-4\nsample_prompts = [\"a\", \"b c\"]\nfull_bf16 = true\n", "run.toml");
  std::string text = shoestring::to_toml(c);
  auto d = parse_config(text, "resolved.toml");
  EXPECT_EQ(shoestring::to_toml(d), text);
  EXPECT_DOUBLE_EQ(d.learning_rate, 3e-4);
  EXPECT_EQ(d.sample_prompts, (std::vector<std::string>{"a", "b c"}));
  EXPECT_TRUE(d.full_bf16);
  // Every schema key appears in the resolved file.
  for (const auto& key : shoestring::config_keys()) {
    auto leaf = key.substr(key.rfind('.') == std::string::npos ? 0 : key.rfind('.') + 1);
    EXPECT_NE(text.find(leaf + " = "), std::string::npos) << key;
  }
}

TEST(Config, ExpandsCachePath) {
  setenv("SHOESTRING_CACHE", "/tmp/cachex", 1);
  EXPECT_EQ(shoestring::expand_path("${SHOESTRING_CACHE}/data"), "/tmp/cachex/data");
  unsetenv("SHOESTRING_CACHE");
  setenv("HOME", "/home/u", 1);
  EXPECT_EQ(shoestring::expand_path("${SHOESTRING_CACHE}/d"), "/home/u/.cache/shoestring/d");
  // Any other variable is refused by name (it would become a folder "${NOPE}").
  try {
    (void)shoestring::expand_path("${NOPE}/x");
    ADD_FAILURE() << "expected an error";
  } catch (const shoestring::Error& e) {
    EXPECT_NE(std::string(e.what()).find("path '${NOPE}/x': unknown variable ${NOPE}"), std::string::npos) << e.what();
  }
}

TEST(Config, DocsPageIsCurrent) {
  std::string path = std::string(SHOESTRING_SOURCE_DIR) + "/docs/config.md";
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string expected = shoestring::config_reference_markdown();
  if (ss.str() != expected) {
    std::ofstream out(std::string(::testing::TempDir()) + "/config.md");
    out << expected;
  }
  EXPECT_EQ(ss.str(), expected) << "docs/config.md is stale: copy " << ::testing::TempDir() << "config.md over it";
}

// The schema's resume attributes: every key a checkpoint depends on is
// compared, paths after expansion, ema_decay only as "EMA on or off".
TEST(Config, ResumeDifferencesNameEachKeyTheCheckpointDependsOn) {
  const auto was = parse_config("optimizer_type = \"AdamW\"\nema_decay = 0.99\n", "run.toml");
  EXPECT_TRUE(shoestring::resume_differences(was, was).empty());
  // Keys the checkpoint does not depend on may change.
  auto now =
      parse_config("optimizer_type = \"AdamW\"\nema_decay = 0.9\nlearning_rate = 1\nmax_train_steps = 9\n", "now.toml");
  EXPECT_TRUE(shoestring::resume_differences(was, now).empty());
  now = parse_config(
      "optimizer_type = \"Lion\"\nema_decay = 0\n[model]\nchannel_mult = [1, 2]\nattention_levels = [1]\n", "now.toml");
  const auto diffs = shoestring::resume_differences(was, now);
  ASSERT_EQ(diffs.size(), 4u);
  EXPECT_EQ(diffs[0], "model.channel_mult (run: \"[1, 2, 4]\", now: \"[1, 2]\")");
  EXPECT_EQ(diffs[1], "model.attention_levels (run: \"[1, 2]\", now: \"[1]\")");
  EXPECT_EQ(diffs[2], "optimizer_type (run: \"AdamW\", now: \"Lion\")");
  EXPECT_EQ(diffs[3], "ema_decay > 0 (run: \"true\", now: \"false\")");
  // A path is compared as the file it names: "~" and "${SHOESTRING_CACHE}" expand first.
  const std::string home = std::getenv("HOME") ? std::getenv("HOME") : "/root";
  auto tilde = parse_config("train_data_dir = \"~/data\"\n", "a.toml");
  auto absolute = parse_config("train_data_dir = \"" + home + "/data\"\n", "b.toml");
  EXPECT_TRUE(shoestring::resume_differences(tilde, absolute).empty());
  auto other = parse_config("train_data_dir = \"" + home + "/other\"\n", "c.toml");
  ASSERT_EQ(shoestring::resume_differences(tilde, other).size(), 1u);
  EXPECT_EQ(shoestring::resume_differences(tilde, other)[0].rfind("train_data_dir (run: ", 0), 0u);
}

TEST(Config, IgnoredKeysAreTheOtherFamilysKeysSetAwayFromTheirDefaults) {
  const auto defaults = parse_config("", "run.toml");
  EXPECT_TRUE(shoestring::ignored_keys(defaults, true).empty());
  EXPECT_TRUE(shoestring::ignored_keys(defaults, false).empty());
  const auto c = parse_config("clip_skip = 2\nvae = \"v.safetensors\"\n[model]\nbase_channels = 32\n", "run.toml");
  EXPECT_EQ(shoestring::ignored_keys(c, /*emoji_model=*/true), (std::vector<std::string>{"vae", "clip_skip"}));
  EXPECT_EQ(shoestring::ignored_keys(c, /*emoji_model=*/false), (std::vector<std::string>{"model.base_channels"}));
}
