#include "shoestring/io/safetensors.h"

#include <cstring>
#include <filesystem>
#include <fstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/torch_compat.h"
#include "shoestring/io/atomic_file.h"
#include "temp_dir.h"

namespace shoestring {
namespace {

using ::testing::HasSubstr;
using testing::TempDir;
using json = nlohmann::json;

constexpr StDtype kAllDtypes[] = {StDtype::F64,     StDtype::F32,     StDtype::F16, StDtype::BF16,
                                  StDtype::F8_E4M3, StDtype::F8_E5M2, StDtype::I64, StDtype::I32,
                                  StDtype::I16,     StDtype::I8,      StDtype::U8,  StDtype::BOOL};

bool is_f8(StDtype d) { return d == StDtype::F8_E4M3 || d == StDtype::F8_E5M2; }

/// Raw bytes of a tensor (made contiguous), independent of dtype.
std::string raw(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size());
}

/// A safetensors file from a header text and a data buffer, built by hand.
std::string st_file(const std::string& header, const std::string& data = "") {
  uint64_t n = header.size();
  std::string out(reinterpret_cast<const char*>(&n), 8);  // little-endian host
  return out + header + data;
}

std::string u64(uint64_t v) { return std::string(reinterpret_cast<const char*>(&v), 8); }

/// Header entry text for one tensor.
std::string entry(const std::string& dtype, const std::string& shape, uint64_t begin, uint64_t end) {
  return fmt::format(R"({{"dtype":"{}","shape":{},"data_offsets":[{},{}]}})", dtype, shape, begin, end);
}

/// Header length N as written in the file at `path`.
uint64_t header_len(const std::string& path) {
  std::string bytes = read_file(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  return n;
}

// ---------------------------------------------------------------------------
// dtypes

TEST(Safetensors, DtypeNamesRoundTrip) {
  const char* names[] = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "I64", "I32", "I16", "I8", "U8", "BOOL"};
  int i = 0;
  for (StDtype d : kAllDtypes) {
    EXPECT_STREQ(to_string(d), names[i++]);
    EXPECT_EQ(st_dtype_from_string(to_string(d), "ctx"), d);
  }
  try {
    st_dtype_from_string("f32", "tensor 'w'");
    FAIL() << "lower-case accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("tensor 'w'"));
    EXPECT_THAT(e.what(), HasSubstr("unknown dtype 'f32'"));
  }
}

TEST(Safetensors, DtypesMatchLibtorch) {
  for (StDtype d : kAllDtypes) {
    at::ScalarType t = to_scalar_type(d);
    EXPECT_EQ(element_size(d), static_cast<int64_t>(c10::elementSize(t))) << to_string(d);
    if (is_f8(d)) {
#if SHOESTRING_HAS_FLOAT8
      EXPECT_EQ(st_dtype_of(t), d);
#else
      EXPECT_EQ(t, at::kByte);
#endif
    } else {
      EXPECT_EQ(st_dtype_of(t), d) << to_string(d);
    }
  }
  EXPECT_THROW(st_dtype_of(at::kComplexFloat), Error);
}

// ---------------------------------------------------------------------------
// round trip

std::vector<NamedTensor> every_dtype_tensors() {
  torch::manual_seed(7);
  auto inf = std::numeric_limits<double>::infinity();
  auto nan = std::numeric_limits<double>::quiet_NaN();
  at::Tensor f64 = torch::randn({3, 2}, torch::kDouble);
  f64[0][0] = inf;
  f64[1][1] = nan;
  f64[2][0] = -0.0;
  at::Tensor f32 = torch::randn({4, 5});
  f32[0][1] = -inf;
  f32[3][4] = 1e-40;  // subnormal
  at::Tensor i64 = torch::tensor(
      {std::numeric_limits<int64_t>::min(), int64_t{-1}, int64_t{0}, std::numeric_limits<int64_t>::max()});
  return {
      {"f64", f64, std::nullopt},
      {"f32", f32, std::nullopt},
      {"f32.transposed", torch::arange(12, torch::kFloat).reshape({3, 4}).t(), std::nullopt},
      {"f16", torch::randn({7}).to(torch::kHalf), std::nullopt},
      {"bf16", torch::randn({2, 3, 2}).to(torch::kBFloat16), std::nullopt},
      {"f8_e4m3", torch::arange(256, torch::kInt).to(torch::kByte).reshape({16, 16}), StDtype::F8_E4M3},
      {"f8_e5m2", torch::tensor({0x3c, 0xbc, 0x7b, 0x04, 0xff}, torch::kInt).to(torch::kByte), StDtype::F8_E5M2},
      {"i64", i64, std::nullopt},
      {"i32", torch::randint(-(1LL << 31), (1LL << 31) - 1, {3, 3}, torch::kInt), std::nullopt},
      {"i16", torch::randint(-32768, 32767, {9}, torch::kShort), std::nullopt},
      {"i8", torch::arange(-128, 128, torch::kInt).to(torch::kChar), std::nullopt},
      {"u8", torch::arange(256, torch::kInt).to(torch::kByte).flip(0), std::nullopt},
      {"bool", torch::randn({5, 3}) > 0, std::nullopt},
      {"scalar", torch::scalar_tensor(3.25, torch::kFloat), std::nullopt},
      {"empty.f32", torch::empty({0, 3}), std::nullopt},
      {"empty.i16", torch::empty({2, 0, 4}, torch::kShort), std::nullopt},
  };
}

TEST(Safetensors, RoundTripEveryDtypeBitExact) {
  TempDir dir;
  std::string path = dir.file("all.safetensors");
  auto tensors = every_dtype_tensors();
  std::map<std::string, std::string> metadata = {{"format", "pt"}, {"unicode", "\xc3\xbc \xe2\x9c\x93"}, {"empty", ""}};
  save_safetensors(path, tensors, metadata);
  EXPECT_EQ(dir.entries(), std::vector<std::string>{"all.safetensors"});

  auto file = SafetensorsFile::open(path);
  EXPECT_EQ(file.path(), path);
  EXPECT_EQ(file.metadata(), metadata);
  ASSERT_EQ(file.tensors().size(), tensors.size());
  for (size_t i = 1; i < file.tensors().size(); ++i) {
    EXPECT_EQ(file.tensors()[i - 1].end, file.tensors()[i].begin) << "not in data order";
  }
  auto loaded = load_safetensors(path);
  ASSERT_EQ(loaded.size(), tensors.size());
  for (const auto& nt : tensors) {
    SCOPED_TRACE(nt.name);
    const TensorInfo* info = file.find(nt.name);
    ASSERT_NE(info, nullptr);
    StDtype want = nt.dtype ? *nt.dtype : st_dtype_of(nt.tensor.scalar_type());
    EXPECT_EQ(info->dtype, want);
    EXPECT_EQ(info->shape, nt.tensor.sizes().vec());
    for (const at::Tensor& got : {file.get(nt.name), loaded.at(nt.name)}) {
      EXPECT_EQ(got.scalar_type(), to_scalar_type(want));
      EXPECT_EQ(got.sizes(), nt.tensor.sizes());
      EXPECT_EQ(got.dim(), nt.tensor.dim());
      EXPECT_TRUE(got.is_contiguous());
      EXPECT_EQ(raw(got), raw(nt.tensor));
    }
  }
  EXPECT_EQ(file.find("absent"), nullptr);
}

TEST(Safetensors, WriterAlignsDataSoReadsAreZeroCopy) {
  TempDir dir;
  std::string path = dir.file("all.safetensors");
  auto tensors = every_dtype_tensors();
  save_safetensors(path, tensors);
  auto file = SafetensorsFile::open(path);
  for (const auto& info : file.tensors()) {
    SCOPED_TRACE(info.name);
    EXPECT_EQ((8 + file.header_size() + info.begin) % element_size(info.dtype), 0u);
    if (info.nbytes() > 0) {
      EXPECT_EQ(file.get(info).data_ptr(), static_cast<const void*>(file.bytes(info).data()));
    }
  }
}

TEST(Safetensors, HeaderPaddedWithSpacesToMultipleOf8) {
  TempDir dir;
  std::set<uint64_t> raw_lengths_mod8;  // exercise every padding amount
  for (int len = 1; len <= 16; ++len) {
    std::string path = dir.file(fmt::format("p{}.safetensors", len));
    save_safetensors(path, {{std::string(len, 'n'), torch::ones({3}, torch::kByte), std::nullopt}},
                     {{"k", std::string(len % 5, 'v')}});
    uint64_t n = header_len(path);
    EXPECT_EQ((8 + n) % 8, 0u) << path;
    std::string header = read_file(path).substr(8, n);
    json j = json::parse(header);  // padding is JSON whitespace
    std::string compact = j.dump();
    // Our header is compact JSON followed only by spaces.
    size_t last = header.find_last_not_of(' ');
    ASSERT_NE(last, std::string::npos);
    EXPECT_EQ(header.substr(last + 1), std::string(header.size() - last - 1, ' '));
    EXPECT_LT(header.size() - last - 1, 8u);
    raw_lengths_mod8.insert((8 + last + 1) % 8);
  }
  EXPECT_EQ(raw_lengths_mod8.size(), 8u);
}

TEST(Safetensors, TensorsOutliveFileAndUnlinkedPath) {
  TempDir dir;
  std::string path = dir.file("x.safetensors");
  at::Tensor src = torch::randn({4, 4});
  save_safetensors(path, {{"w", src, std::nullopt}});
  at::Tensor view;
  {
    auto file = SafetensorsFile::open(path);
    view = file.get("w");
  }
  std::filesystem::remove(path);
  EXPECT_TRUE(torch::equal(view, src));
}

TEST(Safetensors, GetAbsentTensorNamesIt) {
  TempDir dir;
  std::string path = dir.file("x.safetensors");
  save_safetensors(path, {{"w", torch::ones({1}), std::nullopt}});
  auto file = SafetensorsFile::open(path);
  try {
    file.get("missing.weight");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("'missing.weight'"));
    EXPECT_THAT(e.what(), HasSubstr(path));
  }
}

TEST(Safetensors, EmptyFileWithNoTensors) {
  TempDir dir;
  std::string path = dir.file("empty.safetensors");
  save_safetensors(path, {});
  auto file = SafetensorsFile::open(path);
  EXPECT_TRUE(file.tensors().empty());
  EXPECT_TRUE(file.metadata().empty());
  EXPECT_EQ(file.data_size(), 0u);
  EXPECT_TRUE(load_safetensors(path).empty());
}

// ---------------------------------------------------------------------------
// independent reference written by scripts/gen_safetensors_fixture.py

TEST(Safetensors, ReadsReferenceFileFromPython) {
  const std::string dir = std::string(SHOESTRING_TEST_DATA) + "/safetensors/";
  json expected = json::parse(read_file(dir + "reference.json"));
  auto file = SafetensorsFile::open(dir + "reference.safetensors");
  EXPECT_NE((8 + file.header_size()) % 8, 0u) << "fixture should be unpadded";
  EXPECT_EQ(json(file.metadata()), expected["metadata"]);
  ASSERT_EQ(file.tensors().size(), expected["tensors"].size());
  int zero_copy = 0, copied = 0;
  for (const auto& [name, want] : expected["tensors"].items()) {
    SCOPED_TRACE(name);
    const TensorInfo* info = file.find(name);
    ASSERT_NE(info, nullptr);
    EXPECT_EQ(to_string(info->dtype), want["dtype"].get<std::string>());
    EXPECT_EQ(info->shape, want["shape"].get<std::vector<int64_t>>());
    EXPECT_EQ(info->begin, want["begin"].get<uint64_t>());
    EXPECT_EQ(info->end, want["end"].get<uint64_t>());
    at::Tensor t = file.get(name);
    EXPECT_EQ(t.scalar_type(), to_scalar_type(info->dtype));
    EXPECT_EQ(t.sizes().vec(), info->shape);
    const json& values = want["values"];
    ASSERT_EQ(static_cast<size_t>(t.numel()), values.size());
    at::Tensor flat = t.reshape({-1});
    if (info->dtype == StDtype::BOOL) {
      for (size_t i = 0; i < values.size(); ++i) {
        EXPECT_EQ(flat[i].item<bool>(), values[i].get<bool>()) << i;
      }
    } else if (is_f8(info->dtype)) {
      std::string_view bytes = file.bytes(*info);
      for (size_t i = 0; i < values.size(); ++i) {
        EXPECT_EQ(static_cast<unsigned char>(bytes[i]), values[i].get<int>()) << i;
      }
#if SHOESTRING_HAS_FLOAT8
      at::Tensor d = flat.to(at::kDouble);
      for (size_t i = 0; i < values.size(); ++i) {
        EXPECT_EQ(d[i].item<double>(), want["decoded"][i].get<double>()) << i;
      }
#else
      EXPECT_EQ(raw(t), std::string(bytes));
#endif
    } else if (at::isFloatingType(t.scalar_type())) {
      at::Tensor d = flat.to(at::kDouble);
      for (size_t i = 0; i < values.size(); ++i) {
        EXPECT_EQ(d[i].item<double>(), values[i].get<double>()) << i;
      }
    } else {
      at::Tensor d = flat.to(at::kLong);
      for (size_t i = 0; i < values.size(); ++i) {
        EXPECT_EQ(d[i].item<int64_t>(), values[i].get<int64_t>()) << i;
      }
    }
    if (info->nbytes() > 0) {
      bool aligned = (8 + file.header_size() + info->begin) % element_size(info->dtype) == 0;
      bool is_view = t.data_ptr() == static_cast<const void*>(file.bytes(*info).data());
      EXPECT_EQ(is_view, aligned);
      (is_view ? zero_copy : copied)++;
    }
  }
  // The fixture is laid out so that both read paths are exercised.
  EXPECT_GT(zero_copy, 0);
  EXPECT_GT(copied, 0);
}

// ---------------------------------------------------------------------------
// writer rejections

void expect_save_error(const std::vector<NamedTensor>& tensors, const std::vector<std::string>& needles) {
  TempDir dir;
  std::string path = dir.file("bad.safetensors");
  try {
    save_safetensors(path, tensors);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(path));
    for (const auto& n : needles) EXPECT_THAT(e.what(), HasSubstr(n));
  }
  EXPECT_TRUE(dir.entries().empty()) << "a failed save left files behind";
}

TEST(Safetensors, SaveRejectsBadInput) {
  at::Tensor x = torch::ones({2});
  expect_save_error({{"a", x, std::nullopt}, {"a", x, std::nullopt}}, {"duplicate", "'a'"});
  expect_save_error({{"", x, std::nullopt}}, {"empty name"});
  expect_save_error({{"__metadata__", x, std::nullopt}}, {"__metadata__", "reserved"});
  expect_save_error({{"w", x, StDtype::F8_E4M3}}, {"'w'", "does not match", "F8_E4M3"});
  expect_save_error({{"u", torch::ones({4}, torch::kByte), StDtype::F32}}, {"'u'", "does not match", "F32"});
  expect_save_error({{"z", torch::empty({0}, torch::kByte), StDtype::I16}}, {"'z'", "does not match"});
  expect_save_error({{"c", torch::ones({2}, torch::kComplexFloat), std::nullopt}},
                    {"'c'", "no safetensors equivalent"});
}

TEST(Safetensors, SaveToMissingDirectoryNamesPath) {
  TempDir dir;
  std::string path = dir.file("no/such/dir/x.safetensors");
  try {
    save_safetensors(path, {{"w", torch::ones({1}), std::nullopt}});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(path));
  }
}

// ---------------------------------------------------------------------------
// reader rejections

struct BadFile {
  std::string label;
  std::string bytes;
  std::vector<std::string> needles;  // all must appear in the message
};

/// "[1,1,...,1]" with `rank` ones (a shape of one element).
std::string ones_shape(int rank) {
  std::string s = "[1";
  for (int i = 1; i < rank; ++i) s += ",1";
  return s + "]";
}

std::vector<BadFile> bad_files() {
  const std::string f32x2 = entry("F32", "[2]", 0, 8);
  const std::string d8(8, '\0');
  return {
      {"Empty", "", {"shorter than 8 bytes"}},
      {"Short", std::string("\x02\0\0\0\0", 5), {"shorter than 8 bytes"}},
      {"HeaderTooLong", u64(100'000'001) + "{}", {"header length 100000001 exceeds the limit"}},
      {"HeaderPastEnd", u64(1000) + "{}", {"header length 1000 runs past the end of the file"}},
      {"InvalidJson", st_file(R"({"a":)"), {"not valid JSON"}},
      {"InvalidUtf8", st_file("{\"\xff\":" + f32x2 + "}", d8), {"not valid JSON"}},
      {"TrailingGarbage", st_file("{}x"), {"not valid JSON"}},
      {"HeaderNotObject", st_file("[1,2]"), {"header is not a JSON object"}},
      {"EntryNotObject", st_file(R"({"w":5})"), {"tensor 'w'", "entry is not a JSON object"}},
      {"MissingDtype", st_file(R"({"w":{"shape":[2],"data_offsets":[0,8]}})", d8), {"tensor 'w'", "missing \"dtype\""}},
      {"DtypeNotString",
       st_file(R"({"w":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", d8),
       {"tensor 'w'", "\"dtype\" must be a string"}},
      {"MissingShape",
       st_file(R"({"w":{"dtype":"F32","data_offsets":[0,8]}})", d8),
       {"tensor 'w'", "missing \"shape\""}},
      {"ShapeNotArray",
       st_file("{\"w\":" + entry("F32", "\"2\"", 0, 8) + "}", d8),
       {"tensor 'w'", "\"shape\" must be an array of integers"}},
      {"ShapeFloat",
       st_file("{\"w\":" + entry("F32", "[2.0]", 0, 8) + "}", d8),
       {"tensor 'w'", "\"shape\" must be an array of integers"}},
      {"ShapeNegative",
       st_file("{\"w\":" + entry("F32", "[-2]", 0, 8) + "}", d8),
       {"tensor 'w'", "negative dimension -2"}},
      {"ShapeOverflow",
       st_file("{\"w\":" + entry("F32", "[4611686018427387904,4]", 0, 8) + "}", d8),
       {"tensor 'w'", "too large"}},
      {"MissingOffsets",
       st_file(R"({"w":{"dtype":"F32","shape":[2]}})", d8),
       {"tensor 'w'", "missing \"data_offsets\""}},
      {"OffsetsOneNumber",
       st_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8]}})", d8),
       {"tensor 'w'", "\"data_offsets\" must be an array of two non-negative integers"}},
      {"OffsetsNegative",
       st_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})", d8),
       {"tensor 'w'", "\"data_offsets\" must be an array of two non-negative integers"}},
      {"OffsetsNotArray",
       st_file(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":"0-8"}})", d8),
       {"tensor 'w'", "\"data_offsets\" must be an array of two non-negative integers"}},
      {"MetadataNotObject",
       st_file(R"({"__metadata__":["a"]})"),
       {"__metadata__ must be an object mapping strings to strings"}},
      {"MetadataValueNotString",
       st_file(R"({"__metadata__":{"epoch":3}})"),
       {"__metadata__ must be an object mapping strings to strings", "'epoch'"}},
      {"UnknownDtype",
       st_file("{\"w\":" + entry("F128", "[2]", 0, 8) + "}", d8),
       {"tensor 'w'", "unknown dtype 'F128'"}},
      {"SizeMismatch",
       st_file("{\"w\":" + entry("F32", "[2,2]", 0, 12) + "}", std::string(12, 0)),
       {"tensor 'w'", "hold 12 bytes", "needs 16 bytes", "does not match"}},
      {"BeginAfterEnd",
       st_file("{\"w\":" + entry("U8", "[0]", 8, 0) + "}", d8),
       {"tensor 'w'", "begin greater than end"}},
      {"Overlap",
       st_file("{\"a\":" + entry("F32", "[2]", 0, 8) + ",\"b\":" + entry("F32", "[2]", 4, 12) + "}",
               std::string(12, 0)),
       {"tensor 'b'", "overlap tensor 'a'"}},
      {"OverlapIdentical",
       st_file("{\"a\":" + entry("F32", "[2]", 0, 8) + ",\"b\":" + entry("I32", "[2]", 0, 8) + "}", d8),
       {"tensor 'b'", "overlap tensor 'a'"}},
      {"HoleBetween",
       st_file("{\"a\":" + entry("F32", "[1]", 0, 4) + ",\"b\":" + entry("F32", "[1]", 8, 12) + "}",
               std::string(12, 0)),
       {"tensor 'b'", "hole of 4 bytes after tensor 'a'"}},
      {"HoleAtStart",
       st_file("{\"a\":" + entry("F32", "[1]", 4, 8) + "}", d8),
       {"tensor 'a'", "hole of 4 bytes at the start"}},
      {"PastEnd",
       st_file("{\"a\":" + entry("F32", "[4]", 0, 16) + "}", d8),
       {"tensor 'a'", "past the end of the file"}},
      {"UnusedBytesAtEnd", st_file("{\"a\":" + entry("F32", "[1]", 0, 4) + "}", d8), {"4 unused bytes at the end"}},
      {"DuplicateName",
       st_file("{\"a\":" + entry("F32", "[2]", 0, 8) + ",\"a\":" + entry("F32", "[2]", 0, 8) + "}", d8),
       {"duplicate tensor name 'a'"}},
      {"DuplicateKeyInEntry",
       st_file(R"({"w":{"dtype":"F32","dtype":"I32","shape":[2],"data_offsets":[0,8]}})", d8),
       {"duplicate key 'dtype'", "'w'"}},
      {"HeaderEmpty", st_file(""), {"header is not a JSON object", "start with '{'", "an empty header"}},
      {"LeadingSpace", st_file(" {}"), {"header is not a JSON object", "start with '{'", "found ' '"}},
      {"LeadingControlByte", st_file("\x1b{}"), {"header is not a JSON object", "found byte 0x1b"}},
      {"NestedTooDeep",
       st_file("{\"w\":" + entry("F32", "[[[[[[[[2]]]]]]]]", 0, 8) + "}", d8),
       {"deeper than 8 levels", "at byte 34 of the header"}},
      {"NestedBracketsMegabyte",
       st_file("{\"a\":" + std::string(1 << 20, '[') + std::string(1 << 20, ']') + "}"),
       {"deeper than 8 levels", "at byte 12 of the header"}},
      {"ArrayTooLong",
       st_file("{\"w\":" + entry("U8", ones_shape(1025), 0, 1) + "}", std::string(1, '\0')),
       {"array of more than 1024 elements"}},
  };
}

class SafetensorsRejects : public ::testing::TestWithParam<BadFile> {};

TEST_P(SafetensorsRejects, WithErrorNamingFileAndRule) {
  const BadFile& bad = GetParam();
  TempDir dir;
  std::string path = dir.write("bad.safetensors", bad.bytes);
  try {
    SafetensorsFile::open(path);
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr(path));
    for (const auto& n : bad.needles) EXPECT_THAT(e.what(), HasSubstr(n));
  }
}

INSTANTIATE_TEST_SUITE_P(Safetensors, SafetensorsRejects, ::testing::ValuesIn(bad_files()),
                         [](const ::testing::TestParamInfo<BadFile>& info) { return info.param.label; });

TEST(Safetensors, AcceptsZeroElementTensorsAnywhere) {
  TempDir dir;
  // Zero-element tensors at the start, between, and at the end of the buffer.
  std::string header = "{\"z0\":" + entry("F32", "[0,3]", 0, 0) + ",\"a\":" + entry("I16", "[2]", 0, 4) +
                       ",\"z1\":" + entry("F64", "[0]", 4, 4) + ",\"b\":" + entry("U8", "[4]", 4, 8) +
                       ",\"z2\":" + entry("BOOL", "[5,0]", 8, 8) + "}";
  std::string data("\x01\x00\xff\xff\x05\x06\x07\x08", 8);
  std::string path = dir.write("z.safetensors", st_file(header, data));
  auto file = SafetensorsFile::open(path);
  ASSERT_EQ(file.tensors().size(), 5u);
  EXPECT_EQ(file.get("z0").sizes(), (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(file.get("z2").scalar_type(), at::kBool);
  EXPECT_EQ(file.get("a")[0].item<int>(), 1);
  EXPECT_EQ(file.get("a")[1].item<int>(), -1);
  EXPECT_EQ(file.get("b")[3].item<int>(), 8);
  // No tensors at all and an empty buffer is a valid file too.
  EXPECT_TRUE(SafetensorsFile::open(dir.write("e.safetensors", st_file("{}"))).tensors().empty());
}

TEST(Safetensors, BracketsInsideStringsDoNotCountAsNesting) {
  TempDir dir;
  // Names and metadata may hold any characters; only structure counts towards the depth bound.
  const std::string name = std::string(20, '[') + "\\\"" + std::string(20, '{');  // JSON text [[..[\"{{..{
  const std::string header = "{\"__metadata__\":{\"note\":\"" + std::string(30, '[') + "\"},\"" + name +
                             "\":" + entry("U8", ones_shape(1024), 0, 1) + "}";
  auto file = SafetensorsFile::open(dir.write("s.safetensors", st_file(header, std::string(1, '\x07'))));
  ASSERT_EQ(file.tensors().size(), 1u);
  EXPECT_EQ(file.tensors()[0].name, std::string(20, '[') + "\"" + std::string(20, '{'));
  EXPECT_EQ(file.tensors()[0].shape.size(), 1024u);
  EXPECT_EQ(file.metadata().at("note"), std::string(30, '['));
}

// A header of many tensors opens in time linear in its size (the ctest
// TIMEOUT of this test, set in tests/io/timeouts.cmake, bounds it; before the
// fix, 40,000 tensors took minutes). Also: a duplicate name at the end of such
// a header is still found.
std::string many_tensors_header(int n) {
  std::string header = "{";
  for (int i = 0; i < n; ++i) header += (i ? ",\"t" : "\"t") + std::to_string(i) + "\":" + entry("F32", "[0]", 0, 0);
  return header;
}

TEST(SafetensorsScale, Opens100000TensorHeader) {
  TempDir dir;
  constexpr int kTensors = 100'000;
  auto file = SafetensorsFile::open(dir.write("many.safetensors", st_file(many_tensors_header(kTensors) + "}")));
  ASSERT_EQ(file.tensors().size(), static_cast<size_t>(kTensors));
  for (int i : {0, 1, 4242, kTensors - 1}) {
    const TensorInfo* t = file.find("t" + std::to_string(i));
    ASSERT_NE(t, nullptr) << i;
    EXPECT_EQ(t->dtype, StDtype::F32);
    EXPECT_EQ(t->shape, std::vector<int64_t>{0});
  }
  const std::string dup = many_tensors_header(kTensors) + ",\"t17\":" + entry("F32", "[0]", 0, 0) + "}";
  try {
    SafetensorsFile::open(dir.write("dup.safetensors", st_file(dup)));
    FAIL() << "accepted a duplicate name";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("duplicate tensor name 't17'"));
  }
}

TEST(Safetensors, RejectsMissingFileAndDirectory) {
  TempDir dir;
  for (const std::string& path : {dir.file("nope.safetensors"), dir.path().string()}) {
    try {
      SafetensorsFile::open(path);
      ADD_FAILURE() << "accepted " << path;
    } catch (const Error& e) {
      EXPECT_THAT(e.what(), HasSubstr(path));
    }
  }
}

TEST(Safetensors, BoolBytesOtherThanZeroOrOneRejectedOnGet) {
  TempDir dir;
  std::string path = dir.write(
      "b.safetensors", st_file("{\"mask\":" + entry("BOOL", "[3]", 0, 3) + "}", std::string("\x01\x02\x00", 3)));
  auto file = SafetensorsFile::open(path);
  try {
    file.get("mask");
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("'mask'"));
    EXPECT_THAT(e.what(), HasSubstr(path));
  }
}

}  // namespace
}  // namespace shoestring
