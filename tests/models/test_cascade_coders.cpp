// Stable Cascade's EfficientNet latent encoder and previewer
// (models/cascade_coders.h): the released key layout and parameter counts on
// the meta device, micro-width forwards against an independent PyTorch
// implementation (scripts/gen_cascade_coders_reference.py writes
// tests/data/models/effnet_micro*.{json,bin} and previewer_micro.{json,bin}),
// the [-1, 1] input mapping, and loading a file with torch's BatchNorm counters.
#include <map>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../io/temp_dir.h"
#include "model_testing.h"
#include "shoestring/core/error.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/io/weight_files.h"
#include "shoestring/models/cascade_coders.h"

using namespace shoestring;
using models::EfficientNetEncoder;
using models::EfficientNetEncoderOptions;
using models::Previewer;
using models::PreviewerOptions;
using shoestring::testing::load_case;
using shoestring::testing::module_keys;

namespace {

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

// Tensors of `m` as a released file holds them: parameters, BatchNorm
// statistics, and an int64 num_batches_tracked beside every running_mean.
std::vector<NamedTensor> as_released_file(torch::nn::Module& m) {
  std::vector<NamedTensor> out;
  for (const auto& p : m.named_parameters()) out.push_back({p.key(), p.value().detach(), std::nullopt});
  for (const auto& b : m.named_buffers()) {
    out.push_back({b.key(), b.value(), std::nullopt});
    const std::string suffix = "running_mean";
    if (b.key().size() > suffix.size() && b.key().compare(b.key().size() - suffix.size(), suffix.size(), suffix) == 0) {
      out.push_back({b.key().substr(0, b.key().size() - suffix.size()) + "num_batches_tracked",
                     torch::tensor(int64_t{12345}), std::nullopt});
    }
  }
  return out;
}

}  // namespace

// Counts from the architecture (StableCascade modules/effnet.py on torchvision's
// efficientnet_v2_s features; modules/previewer.py): torchvision documents
// 21,458,488 parameters for V2-S, of which 1,281,000 are the classifier the
// encoder drops; mapper.0 adds 1280 x 16.
TEST(CascadeCoders, ReleasedLayoutAndParameterCounts) {
  EfficientNetEncoder enc(EfficientNetEncoderOptions().init(nn::LayerInit{torch::kMeta}));
  EXPECT_EQ(nn::parameter_count(*enc), 21'458'488 - (1280 * 1000 + 1000) + 1280 * 16);
  auto keys = module_keys(*enc);
  shoestring::testing::expect_shape(keys, "backbone.0.0.weight", {24, 3, 3, 3});
  shoestring::testing::expect_shape(keys, "backbone.1.0.block.0.0.weight", {24, 24, 3, 3});
  shoestring::testing::expect_shape(keys, "backbone.1.0.block.0.1.running_var", {24});
  shoestring::testing::expect_shape(keys, "backbone.2.0.block.1.0.weight", {48, 96, 1, 1});
  shoestring::testing::expect_shape(keys, "backbone.4.0.block.1.0.weight", {256, 1, 3, 3});  // depthwise
  shoestring::testing::expect_shape(keys, "backbone.4.0.block.2.fc1.weight", {16, 256, 1, 1});
  shoestring::testing::expect_shape(keys, "backbone.4.1.block.2.fc1.weight", {32, 512, 1, 1});
  shoestring::testing::expect_shape(keys, "backbone.6.14.block.3.1.bias", {256});
  shoestring::testing::expect_shape(keys, "backbone.7.0.weight", {1280, 256, 1, 1});
  shoestring::testing::expect_shape(keys, "mapper.0.weight", {16, 1280, 1, 1});
  shoestring::testing::expect_shape(keys, "mapper.1.running_var", {16});
  EXPECT_EQ(keys.count("mapper.1.weight"), 0u);
  EXPECT_EQ(keys.count("backbone.8.0.weight"), 0u);
  // The released file's 784 tensors: these plus a num_batches_tracked per BatchNorm.
  int64_t norms = 0;
  for (const auto& kv : keys) norms += kv.first.size() > 12 && kv.first.rfind("running_mean") == kv.first.size() - 12;
  EXPECT_EQ(static_cast<int64_t>(keys.size()) + norms, 784);

  Previewer prev(PreviewerOptions().init(nn::LayerInit{torch::kMeta}));
  EXPECT_EQ(nn::parameter_count(*prev), 3'979'651);
  auto pkeys = module_keys(*prev);
  shoestring::testing::expect_shape(pkeys, "blocks.0.weight", {512, 16, 1, 1});
  shoestring::testing::expect_shape(pkeys, "blocks.6.weight", {512, 256, 2, 2});  // ConvTranspose2d: [in, out, k, k]
  shoestring::testing::expect_shape(pkeys, "blocks.11.running_mean", {256});
  shoestring::testing::expect_shape(pkeys, "blocks.24.weight", {3, 128, 1, 1});
  EXPECT_EQ(pkeys.size(), 6u * 2 + 3 * 2 + 8 * 4);
}

TEST(CascadeCoders, MicroEncoderMatchesPyTorchReference) {
  // effnet_micro_odd (70 x 50 pixels: every stride-2 conv rounds up) holds no
  // parameters: it runs effnet_micro's network.
  EfficientNetEncoder enc(EfficientNetEncoderOptions::micro());
  shoestring::testing::load_params(*enc, load_case("effnet_micro"), /*with_buffers=*/true);
  torch::NoGradGuard g;
  for (const char* name : {"effnet_micro", "effnet_micro_odd"}) {
    auto ref = load_case(name);
    torch::Tensor out = enc->forward(ref.at("input.x"));
    ASSERT_EQ(out.sizes(), ref.at("output").sizes()) << name;
    EXPECT_TRUE(torch::allclose(out, ref.at("output"), 1e-4, 1e-4))
        << name << ": max abs error " << max_abs_diff(out, ref.at("output"));
  }
}

TEST(CascadeCoders, MicroPreviewerMatchesPyTorchReference) {
  auto ref = load_case("previewer_micro");
  Previewer prev(PreviewerOptions().hidden_channels(32));
  shoestring::testing::load_params(*prev, ref, /*with_buffers=*/true);
  torch::NoGradGuard g;
  torch::Tensor out = prev->forward(ref.at("input.x"));
  ASSERT_EQ(out.sizes(), ref.at("output").sizes());
  EXPECT_TRUE(torch::allclose(out, ref.at("output"), 1e-4, 1e-4))
      << "max abs error " << max_abs_diff(out, ref.at("output"));
}

// encode() takes images in [-1, 1]: ((x + 1) / 2 - mean) / std by channel, then
// forward. The BatchNorms use the stored statistics even in training mode.
TEST(CascadeCoders, EncodeNormalisesLikeImageNet) {
  torch::manual_seed(3);
  EfficientNetEncoder enc(EfficientNetEncoderOptions::micro());
  enc->train();
  torch::Tensor images = torch::rand({2, 3, 40, 72}) * 2 - 1;
  const double mean[3] = {0.485, 0.456, 0.406}, std[3] = {0.229, 0.224, 0.225};
  torch::Tensor x = torch::empty_like(images);
  for (int c = 0; c < 3; ++c) x.select(1, c).copy_(((images.select(1, c) + 1) / 2 - mean[c]) / std[c]);
  torch::NoGradGuard g;
  torch::Tensor a = enc->encode(images), b = enc->forward(x);
  EXPECT_EQ(a.sizes(), (std::vector<int64_t>{2, 16, 2, 3}));
  EXPECT_EQ(nn::parameter_count(*enc), 88962);
  EXPECT_LT(max_abs_diff(a, b), 1e-5);
  EXPECT_TRUE(torch::equal(enc->forward(x), b)) << "BatchNorm must not update or use batch statistics";
}

// bf16 parameters: BatchNorm computes in fp32, so the result stays near fp32's.
TEST(CascadeCoders, Bf16CloseToFp32) {
  auto ref = load_case("previewer_micro");
  Previewer prev(PreviewerOptions().hidden_channels(32));
  shoestring::testing::load_params(*prev, ref, true);
  torch::NoGradGuard g;
  torch::Tensor want = prev->forward(ref.at("input.x"));
  prev->to(torch::kBFloat16);
  torch::Tensor got = prev->forward(ref.at("input.x"));
  EXPECT_EQ(got.scalar_type(), torch::kBFloat16);
  const double scale = want.abs().max().item<double>();
  EXPECT_LT(max_abs_diff(got.to(torch::kFloat32), want), 0.05 * scale);
}

// A file as torch saves it (with int64 num_batches_tracked counters) loads;
// the outputs equal the module the file was written from.
TEST(CascadeCoders, LoadsReleasedFileWithBatchNormCounters) {
  shoestring::testing::TempDir dir;
  torch::manual_seed(4);
  Previewer source(PreviewerOptions().hidden_channels(16));
  {
    torch::NoGradGuard g;
    for (auto& b : source->buffers()) b.uniform_(0.5, 1.5);
  }
  save_safetensors(dir.file("previewer.safetensors"), as_released_file(*source));
  Previewer loaded(PreviewerOptions().hidden_channels(16));
  LoadWeightsReport r = models::load_cascade_coder(*loaded, WeightFiles::open(dir.file("previewer.safetensors")));
  EXPECT_EQ(r.loaded, static_cast<int64_t>(source->parameters().size() + source->buffers().size()));
  torch::NoGradGuard g;
  torch::Tensor z = torch::randn({1, 16, 2, 3});
  EXPECT_TRUE(torch::equal(loaded->forward(z), source->forward(z)));

  // A previewer file is not an encoder: the error names the file and keys.
  EfficientNetEncoder enc(EfficientNetEncoderOptions::micro());
  try {
    models::load_cascade_coder(*enc, WeightFiles::open(dir.file("previewer.safetensors")));
    FAIL() << "loaded a previewer into an encoder";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("previewer.safetensors"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("backbone.0.0.weight"), std::string::npos) << e.what();
  }
}

TEST(CascadeCoders, RejectsBadInput) {
  EfficientNetEncoder enc(EfficientNetEncoderOptions::micro());
  EXPECT_THROW(enc->forward(torch::randn({1, 4, 32, 32})), Error);
  EXPECT_THROW(enc->forward(torch::randn({3, 32, 32})), Error);
  auto bad = EfficientNetEncoderOptions::micro();
  auto stages = bad.stages();
  stages[2].in_channels = 17;
  EXPECT_THROW(EfficientNetEncoder(bad.stages(stages)), Error);
  EXPECT_THROW(Previewer(PreviewerOptions().hidden_channels(6)), Error);
  Previewer prev(PreviewerOptions().hidden_channels(8));
  EXPECT_THROW(prev->forward(torch::randn({1, 4, 2, 2})), Error);
  EXPECT_THROW(nn::BatchNorm2d(0), Error);
}
