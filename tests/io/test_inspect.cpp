#include "shoestring/io/inspect.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/io/atomic_file.h"
#include "shoestring/io/safetensors.h"
#include "temp_dir.h"

namespace shoestring {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;

/// A small checkpoint-like file: F32 conv weight, F16 bias, BF16 scalar, I64 counter.
std::string make_file(const testing::TempDir& dir) {
  std::string path = dir.file("model.safetensors");
  save_safetensors(path,
                   {{"conv.weight", torch::zeros({8, 4, 3, 3}), std::nullopt},
                    {"conv.bias", torch::zeros({8}, torch::kHalf), std::nullopt},
                    {"scale", torch::scalar_tensor(1.0, torch::kBFloat16), std::nullopt},
                    {"step", torch::zeros({2}, torch::kLong), std::nullopt},
                    {"empty", torch::zeros({0, 7}), std::nullopt}},
                   {{"ss_network_dim", "16"}, {"note", "line one\nline two"}});
  return path;
}

TEST(Inspect, JsonSummary) {
  testing::TempDir dir;
  std::string path = make_file(dir);
  json j = inspect_json(SafetensorsFile::open(path));
  EXPECT_EQ(j["file"], path);
  // 8*4*3*3 + 8 + 1 + 2 + 0 elements.
  EXPECT_EQ(j["parameters"].get<uint64_t>(), 288u + 8 + 1 + 2);
  // 288*4 + 8*2 + 1*2 + 2*8 bytes.
  EXPECT_EQ(j["bytes"].get<uint64_t>(), 1152u + 16 + 2 + 16);
  EXPECT_EQ(j["bytes_per_dtype"], json({{"F32", 1152}, {"F16", 16}, {"BF16", 2}, {"I64", 16}}));
  EXPECT_EQ(j["metadata"], json({{"ss_network_dim", "16"}, {"note", "line one\nline two"}}));
  ASSERT_EQ(j["tensors"].size(), 5u);
  std::map<std::string, json> by_name;
  for (const auto& t : j["tensors"]) by_name[t["name"].get<std::string>()] = t;
  EXPECT_EQ(
      by_name["conv.weight"],
      json({{"name", "conv.weight"}, {"dtype", "F32"}, {"shape", {8, 4, 3, 3}}, {"parameters", 288}, {"bytes", 1152}}));
  EXPECT_EQ(by_name["scale"]["shape"], json::array());
  EXPECT_EQ(by_name["scale"]["parameters"], 1);
  EXPECT_EQ(by_name["empty"]["parameters"], 0);
  EXPECT_EQ(by_name["empty"]["shape"], json({0, 7}));
}

TEST(Inspect, JsonTotalsOnPythonReference) {
  const std::string dir = std::string(SHOESTRING_TEST_DATA) + "/safetensors/";
  json expected = json::parse(read_file(dir + "reference.json"));
  json j = inspect_json(SafetensorsFile::open(dir + "reference.safetensors"));
  uint64_t params = 0, bytes = 0;
  for (const auto& [name, t] : expected["tensors"].items()) {
    uint64_t n = 1;
    for (const auto& d : t["shape"]) n *= d.get<uint64_t>();
    params += n;
    bytes += t["end"].get<uint64_t>() - t["begin"].get<uint64_t>();
  }
  EXPECT_EQ(j["parameters"].get<uint64_t>(), params);
  EXPECT_EQ(j["bytes"].get<uint64_t>(), bytes);
  EXPECT_EQ(j["metadata"], expected["metadata"]);
  EXPECT_EQ(j["tensors"].size(), expected["tensors"].size());
}

TEST(Inspect, TextSummary) {
  testing::TempDir dir;
  std::string path = make_file(dir);
  std::string text = inspect_text(SafetensorsFile::open(path));
  EXPECT_THAT(text, HasSubstr(path + ": 5 tensors"));
  EXPECT_THAT(text, ::testing::ContainsRegex("conv\\.weight +F32 +\\[8, 4, 3, 3\\] +288\n"));
  EXPECT_THAT(text, ::testing::ContainsRegex("scale +BF16 +\\[\\] +1\n"));
  EXPECT_THAT(text, ::testing::ContainsRegex("empty +F32 +\\[0, 7\\] +0\n"));
  EXPECT_THAT(text, HasSubstr("total: 299 parameters, 1,186 bytes (0.00 MiB)"));
  EXPECT_THAT(text, ::testing::ContainsRegex("F32 +1,152 bytes"));
  EXPECT_THAT(text, ::testing::ContainsRegex("I64 +16 bytes"));
  EXPECT_THAT(text, HasSubstr("ss_network_dim = 16\n"));
  EXPECT_THAT(text, HasSubstr("note = line one\\nline two\n"));  // one line per key
  EXPECT_EQ(text.back(), '\n');
}

TEST(Inspect, TextGroupsThousandsAndCutsLongMetadata) {
  testing::TempDir dir;
  std::string path = dir.file("big.safetensors");
  save_safetensors(path, {{"w", torch::zeros({1000, 1234}, torch::kByte), std::nullopt}},
                   {{"long", std::string(5000, 'x')}});
  std::string text = inspect_text(SafetensorsFile::open(path));
  EXPECT_THAT(text, HasSubstr("1,234,000"));
  EXPECT_THAT(text, HasSubstr("(1.18 MiB)"));
  EXPECT_THAT(text, HasSubstr("... (5000 characters in all)"));
  EXPECT_LT(text.size(), 1000u);
}

TEST(Inspect, TextEscapesControlCharactersInNamesAndMetadata) {
  testing::TempDir dir;
  std::string path = dir.file("hostile.safetensors");
  save_safetensors(path,
                   {{"a\x1b[31mred", torch::zeros({2}), std::nullopt},
                    {"b\n  forged  F32  [9]  9", torch::zeros({1}), std::nullopt}},
                   {{"k\x1b]0;title\x07", "v\x1b[2J"}});
  std::string text = inspect_text(SafetensorsFile::open(path));
  EXPECT_EQ(text.find('\x1b'), std::string::npos) << text;
  EXPECT_EQ(text.find('\x07'), std::string::npos) << text;
  EXPECT_THAT(text, ::testing::ContainsRegex(R"(a\\x1b\[31mred +F32 +\[2\] +2)"
                                             "\n"));
  EXPECT_THAT(text, ::testing::ContainsRegex(R"(b\\n  forged  F32  \[9\]  9 +F32 +\[1\] +1)"
                                             "\n"));
  EXPECT_THAT(text, HasSubstr(R"(k\x1b]0;title\x07 = v\x1b[2J)"));
  // One line per tensor: the header line, two tensor lines, nothing forged.
  EXPECT_EQ(text.find("\n  forged"), std::string::npos);
  // The JSON summary keeps names exactly (its encoder escapes them).
  json j = inspect_json(SafetensorsFile::open(path));
  EXPECT_EQ(j["tensors"][0]["name"].get<std::string>() + j["tensors"][1]["name"].get<std::string>(),
            "a\x1b[31mred"
            "b\n  forged  F32  [9]  9");
}

TEST(Inspect, TextForFileWithoutTensors) {
  testing::TempDir dir;
  std::string path = dir.file("none.safetensors");
  save_safetensors(path, {});
  std::string text = inspect_text(SafetensorsFile::open(path));
  EXPECT_THAT(text, HasSubstr(": 0 tensors"));
  EXPECT_THAT(text, HasSubstr("total: 0 parameters, 0 bytes"));
  EXPECT_THAT(text, HasSubstr("metadata: none"));
}

}  // namespace
}  // namespace shoestring
