#include <cmath>
#include <limits>

#include <gtest/gtest.h>

#include <torch/torch.h>

#include "../error_testing.h"
#include "shoestring/core/error.h"
#include "shoestring/core/torch_compat.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/io/weight_files.h"
#include "temp_dir.h"

using shoestring::Error;
using shoestring::WeightFiles;
using shoestring::testing::TempDir;

using shoestring::testing::error_of;

namespace {

struct Holder : torch::nn::Module {};

struct TwoLayers : torch::nn::Module {
  TwoLayers() {
    a = register_module("a", std::make_shared<Holder>())->register_parameter("weight", torch::zeros({2, 3}));
    b = register_module("b", std::make_shared<Holder>())
            ->register_parameter("weight", torch::zeros({4}, torch::kBFloat16));
    s = register_buffer("stats", torch::zeros({2}));
  }
  torch::Tensor a, b, s;
};

// Writes a two-shard checkpoint of TwoLayers' tensors (values 1..n) and its index.
std::string write_sharded(const TempDir& dir, const std::string& extra_index_entry = "") {
  shoestring::save_safetensors(dir.file("m-00001-of-00002.safetensors"),
                               {{"a.weight", torch::arange(6, torch::kFloat32).view({2, 3}), {}}});
  shoestring::save_safetensors(dir.file("m-00002-of-00002.safetensors"),
                               {{"b.weight", torch::full({4}, 2.5), {}}, {"stats", torch::ones({2}), {}}});
  return dir.write("m.safetensors.index.json", R"({"metadata": {"total_size": 48}, "weight_map": {)" +
                                                   extra_index_entry +
                                                   R"("a.weight": "m-00001-of-00002.safetensors",
                          "b.weight": "m-00002-of-00002.safetensors",
                          "stats": "m-00002-of-00002.safetensors"}})");
}

}  // namespace

TEST(WeightFiles, ShardedIndexLoadsEveryShardIntoTheModel) {
  TempDir dir;
  const std::string index = write_sharded(dir);
  WeightFiles files = WeightFiles::open(index);
  EXPECT_EQ(files.file_count(), 2u);
  EXPECT_EQ(files.names(), (std::vector<std::string>{"a.weight", "b.weight", "stats"}));
  EXPECT_EQ(files.metadata().at("total_size"), "48");
  EXPECT_EQ(files.file_of("b.weight"), dir.file("m-00002-of-00002.safetensors"));
  TwoLayers m;
  auto report = shoestring::load_weights(m, files);
  EXPECT_EQ(report.loaded, 3);
  EXPECT_TRUE(torch::equal(m.a, torch::arange(6, torch::kFloat32).view({2, 3})));
  EXPECT_EQ(m.b.scalar_type(), torch::kBFloat16);  // converted to the model's dtype
  EXPECT_TRUE(torch::equal(m.b.to(torch::kFloat32), torch::full({4}, 2.5)));
  EXPECT_TRUE(torch::equal(m.s, torch::ones({2})));
}

TEST(WeightFiles, BadIndexesNameTheProblem) {
  TempDir dir;
  write_sharded(dir);
  EXPECT_NE(error_of([&] { WeightFiles::open(dir.write("x.index.json", "{not json")); }).find("JSON"),
            std::string::npos);
  EXPECT_NE(error_of([&] { WeightFiles::open(dir.write("y.index.json", R"({"metadata": {}})")); }).find("weight_map"),
            std::string::npos);
  std::string msg = error_of(
      [&] { WeightFiles::open(dir.write("z.index.json", R"({"weight_map": {"a.weight": "gone.safetensors"}})")); });
  EXPECT_NE(msg.find("gone.safetensors"), std::string::npos) << msg;
  msg = error_of(
      [&] { WeightFiles::open(dir.write("w.index.json", R"({"weight_map": {"a.weight": "../m.safetensors"}})")); });
  EXPECT_NE(msg.find("inside the index's folder"), std::string::npos) << msg;
  // The index names a tensor its shard lacks.
  msg = error_of([&] { WeightFiles::open(write_sharded(dir, R"("ghost": "m-00001-of-00002.safetensors", )")); });
  EXPECT_NE(msg.find("ghost"), std::string::npos) << msg;
  // A shard holds a tensor the index does not list.
  msg = error_of([&] {
    WeightFiles::open(dir.write("v.index.json", R"({"weight_map": {"a.weight": "m-00001-of-00002.safetensors",
                                                                  "b.weight": "m-00002-of-00002.safetensors"}})"));
  });
  EXPECT_NE(msg.find("stats"), std::string::npos) << msg;
  // A tensor listed twice (JSON parsers keep one of the two silently), in
  // two shards: the index is ambiguous.
  msg = error_of([&] { WeightFiles::open(write_sharded(dir, R"("b.weight": "m-00001-of-00002.safetensors", )")); });
  EXPECT_NE(msg.find("weight_map lists \"b.weight\" twice"), std::string::npos) << msg;
  // Deep nesting is refused before the JSON is built (an index needs 2 levels).
  msg = error_of([&] {
    WeightFiles::open(dir.write("deep.index.json", R"({"metadata": {"a": [[[[[[[[[1]]]]]]]]]}, "weight_map": {}})"));
  });
  EXPECT_NE(msg.find("nested deeper than 8 levels (at byte"), std::string::npos) << msg;
}

TEST(WeightFiles, MissingUnexpectedAndMisShapedKeysAreListed) {
  TempDir dir;
  const std::string path = dir.file("one.safetensors");
  shoestring::save_safetensors(
      path,
      {{"a.weight", torch::ones({3, 2}), {}}, {"b.weight", torch::ones({4}), {}}, {"extra", torch::ones({1}), {}}});
  WeightFiles files = WeightFiles::open(path);
  TwoLayers m;
  const std::string msg = error_of([&] { shoestring::load_weights(m, files); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("missing keys: stats"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unexpected keys: extra"), std::string::npos) << msg;
  EXPECT_NE(msg.find("a.weight (file 3x2, model 2x3)"), std::string::npos) << msg;
  EXPECT_TRUE(torch::equal(m.b, torch::zeros({4}, torch::kBFloat16)));  // nothing written on failure
}

TEST(WeightFiles, PartialLoadAndKeyMapping) {
  TempDir dir;
  const std::string path = dir.file("diffusers.safetensors");
  shoestring::save_safetensors(path, {{"first.w", torch::full({2, 3}, 7.0), {}}, {"other", torch::ones({5}), {}}});
  WeightFiles files = WeightFiles::open(path);
  TwoLayers m;
  shoestring::LoadWeightsOptions opt;
  opt.key_map = [](const std::string& k) { return k == "first.w" ? std::string("a.weight") : k; };
  EXPECT_THROW(shoestring::load_weights(m, files, opt), Error);
  opt.allow_partial = true;
  auto report = shoestring::load_weights(m, files, opt);
  EXPECT_EQ(report.loaded, 1);
  EXPECT_EQ(report.diff.missing, (std::vector<std::string>{"b.weight", "stats"}));
  EXPECT_EQ(report.diff.unexpected, (std::vector<std::string>{"other"}));
  EXPECT_TRUE(torch::equal(m.a, torch::full({2, 3}, 7.0)));
  // Two file keys onto one name is ambiguous.
  opt.key_map = [](const std::string&) { return std::string("a.weight"); };
  EXPECT_NE(error_of([&] { shoestring::load_weights(m, files, opt); }).find("both map to"), std::string::npos);
}

TEST(WeightFiles, MetaModelCannotBeLoaded) {
  TempDir dir;
  const std::string path = dir.file("x.safetensors");
  shoestring::save_safetensors(path, {{"w", torch::ones({2}), {}}});
  torch::nn::Module m;
  m.register_parameter("w", torch::empty({2}, torch::TensorOptions().device(torch::kMeta)));
  EXPECT_NE(error_of([&] { shoestring::load_weights(m, WeightFiles::open(path)); }).find("meta"), std::string::npos);
}

TEST(WeightFiles, SaveCastsOneTensorAtATime) {
  TempDir dir;
  const std::string src = dir.file("fp32.safetensors"), dst = dir.file("bf16.safetensors");
  torch::Tensor w = torch::randn({17, 5});
  shoestring::save_safetensors(src, {{"w", w, {}}, {"i", torch::arange(3), {}}});
  WeightFiles in = WeightFiles::open(src);
  shoestring::save_safetensors(dst, {{"w", in.get("w"), {}, torch::kBFloat16}, {"i", in.get("i"), {}}});
  WeightFiles out = WeightFiles::open(dst);
  EXPECT_EQ(out.find("w")->dtype, shoestring::StDtype::BF16);
  EXPECT_TRUE(torch::equal(out.get("w"), w.to(torch::kBFloat16)));  // round-to-nearest-even, as Tensor::to
  EXPECT_TRUE(torch::equal(out.get("i"), torch::arange(3)));
}

// A base model with NaN / inf weights is refused at load, naming the file,
// the tensor and how many values are bad (reference: counted here with
// torch::isfinite on the tensor written).
TEST(WeightFiles, NonFiniteParametersAreRefusedNamingFileAndTensor) {
  TempDir dir;
  torch::Tensor a = torch::arange(6, torch::kFloat32).view({2, 3});
  a[1][0] = std::numeric_limits<float>::quiet_NaN();
  a[1][2] = std::numeric_limits<float>::infinity();
  const std::string path = dir.file("bad.safetensors");
  shoestring::save_safetensors(
      path, {{"a.weight", a, {}}, {"b.weight", torch::ones({4}), {}}, {"stats", torch::full({2}, -INFINITY), {}}});
  TwoLayers m;
  const int64_t bad = a.isfinite().logical_not().sum().item<int64_t>();
  const std::string e = error_of([&] { shoestring::load_weights(m, WeightFiles::open(path)); });
  EXPECT_NE(e.find(path), std::string::npos) << e;
  EXPECT_NE(e.find("\"a.weight\""), std::string::npos) << e;
  EXPECT_NE(e.find(fmt::format("holds {} non-finite", bad)), std::string::npos) << e;
  EXPECT_NE(e.find("flat index 3"), std::string::npos) << e;

  // The buffer's -inf (a mask, say) is not a weight; with require_finite off
  // everything loads as it is.
  a[1][0] = 0;
  a[1][2] = 0;
  shoestring::save_safetensors(
      path, {{"a.weight", a, {}}, {"b.weight", torch::ones({4}), {}}, {"stats", torch::full({2}, -INFINITY), {}}});
  EXPECT_EQ(error_of([&] { shoestring::load_weights(m, WeightFiles::open(path)); }), "");
  EXPECT_TRUE(torch::equal(m.s, torch::full({2}, -INFINITY)));
}

// Finite fp32 values that overflow the parameter's dtype are refused too
// (bf16 keeps fp32's range: 1e39 cannot be written in fp32, so use an fp16
// parameter, whose largest finite value is 65504).
TEST(WeightFiles, ValuesOverflowingTheParameterDtypeAreRefused) {
  TempDir dir;
  struct Half : torch::nn::Module {
    Half() { w = register_parameter("w", torch::zeros({3}, torch::kHalf)); }
    torch::Tensor w;
  } m;
  const std::string path = dir.file("big.safetensors");
  shoestring::save_safetensors(path, {{"w", torch::tensor({1.0f, 7e4f, -1e5f}), {}}});
  const std::string e = error_of([&] { shoestring::load_weights(m, WeightFiles::open(path)); });
  EXPECT_NE(e.find("\"w\" overflows Half: 2 of its 3 values"), std::string::npos) << e;
  shoestring::LoadWeightsOptions off;
  off.require_finite = false;
  EXPECT_EQ(error_of([&] { shoestring::load_weights(m, WeightFiles::open(path), off); }), "");
}

// An fp8 pretrained file (F8_E4M3 / F8_E5M2 tensors, as kohya's and
// ComfyUI's fp8 checkpoints are stored) loads into float parameters as the
// published values of its bit patterns, on every libtorch: native float8
// casts on >= 2.1, decoded bit patterns on 1.13. Reference: the OCP OFP8
// formulas written out here, independently of core/fp8.
TEST(WeightFiles, Fp8TensorsLoadAsTheirPublishedValues) {
  // e4m3fn: bias 7, 3 mantissa bits, 0x7F / 0xFF NaN, no inf.
  // e5m2: bias 15, 2 mantissa bits, exponent 31 is inf / NaN.
  auto value = [](int b, bool e4m3) -> double {
    const int mbits = e4m3 ? 3 : 2, bias = e4m3 ? 7 : 15;
    const int m = b & ((1 << mbits) - 1), e = (b & 0x7F) >> mbits;
    const double v = e == 0 ? m * std::pow(2.0, 1 - bias - mbits) : (1.0 + m / double(1 << mbits)) * std::pow(2.0, e - bias);
    return (b & 0x80) ? -v : v;
  };
  auto finite = [](int b, bool e4m3) { return e4m3 ? (b & 0x7F) != 0x7F : ((b & 0x7F) >> 2) != 31; };
  for (const bool e4m3 : {true, false}) {
    std::vector<int64_t> patterns;
    for (int b = 0; b < 256; ++b) {
      if (finite(b, e4m3)) patterns.push_back(b);
    }
    const int64_t n = static_cast<int64_t>(patterns.size());
    const at::Tensor bytes = torch::tensor(patterns, torch::kLong).to(torch::kByte);
    std::vector<double> want_values;
    for (int64_t b : patterns) want_values.push_back(value(static_cast<int>(b), e4m3));
    const at::Tensor want = torch::tensor(want_values, torch::kDouble);
    for (const auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kHalf}) {
      TempDir dir;
      const std::string path = dir.file("fp8.safetensors");
      shoestring::save_safetensors(path, {{"w", bytes.view(shoestring::compat::fp8_storage_dtype(e4m3)),
                                           e4m3 ? shoestring::StDtype::F8_E4M3 : shoestring::StDtype::F8_E5M2}});
      struct One : torch::nn::Module {
        One(int64_t n, torch::Dtype d) { w = register_parameter("w", torch::zeros({n}, d)); }
        torch::Tensor w;
      } m(n, dtype);
      ASSERT_EQ(error_of([&] { shoestring::load_weights(m, WeightFiles::open(path)); }), "")
          << (e4m3 ? "e4m3" : "e5m2") << " into " << dtype;
      // Every finite value of both formats is exact in fp32, bf16 and fp16.
      EXPECT_TRUE(torch::equal(m.w.to(torch::kDouble), want)) << (e4m3 ? "e4m3" : "e5m2") << " into " << dtype;
    }
  }
  // A NaN pattern in a weight is refused like any NaN weight, naming the tensor.
  TempDir dir;
  const std::string path = dir.file("nan.safetensors");
  const at::Tensor nan_bytes = torch::tensor({0x38, 0x7F}, torch::kLong).to(torch::kByte);
  shoestring::save_safetensors(
      path, {{"w", nan_bytes.view(shoestring::compat::fp8_storage_dtype(true)), shoestring::StDtype::F8_E4M3}});
  struct Two : torch::nn::Module {
    Two() { w = register_parameter("w", torch::zeros({2})); }
    torch::Tensor w;
  } m;
  const std::string e = error_of([&] { shoestring::load_weights(m, WeightFiles::open(path)); });
  EXPECT_NE(e.find("\"w\""), std::string::npos) << e;
  EXPECT_NE(e.find("non-finite"), std::string::npos) << e;
}

// get_values: F8 bit patterns come back as their values in bf16 (exact) where
// libtorch has no float8 dtype, so copies and casts of a file's tensors
// (final files, convert) never write fp8 bytes out as integers; and integer
// tensors are never loaded into floating-point parameters as numbers.
TEST(WeightFiles, Fp8ValuesAndIntegerTensorsIntoFloats) {
  TempDir dir;
  const std::string path = dir.file("mixed.safetensors");
  const at::Tensor bytes = torch::tensor({0x38, 0xC0, 0x01}, torch::kLong).to(torch::kByte);  // 1, -2, 2^-9
  shoestring::save_safetensors(path, {{"f8", bytes.view(shoestring::compat::fp8_storage_dtype(true)),
                                       shoestring::StDtype::F8_E4M3},
                                      {"u8", bytes, shoestring::StDtype::U8}});
  const WeightFiles files = WeightFiles::open(path);
  const at::Tensor v = files.get_values("f8");
  EXPECT_TRUE(v.is_floating_point());
  EXPECT_TRUE(torch::equal(v.to(torch::kDouble), torch::tensor({1.0, -2.0, std::ldexp(1.0, -9)}, torch::kDouble)));
  EXPECT_EQ(files.get_values("u8").scalar_type(), torch::kByte);  // other dtypes as stored
  struct U : torch::nn::Module {
    U() { w = register_parameter("u8", torch::zeros({3})); }
    torch::Tensor w;
  } m;
  shoestring::LoadWeightsOptions partial;
  partial.allow_partial = true;
  const std::string e = error_of([&] { shoestring::load_weights(m, files, partial); });
  EXPECT_NE(e.find("\"u8\" is U8 (integers)"), std::string::npos) << e;
}
