#include "shoestring/models/cascade_coders.h"

#include <algorithm>
#include <string>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/units.h"

namespace shoestring::models {
namespace {

// A parameterless child that only contributes a path component (an
// nn.Sequential of the reference whose members are registered below it).
std::shared_ptr<torch::nn::Module> container(torch::nn::Module& parent, const std::string& name) {
  return parent.register_module(name, std::make_shared<torch::nn::Module>("Sequential"));
}

void require_image(const torch::Tensor& x, int64_t channels, const char* what) {
  if (x.dim() != 4 || x.size(1) != channels || x.size(2) < 1 || x.size(3) < 1)
    fail("{}: expected input [B, {}, H, W], got {}", what, channels, format_shape(x.sizes()));
}

constexpr double kBackboneNormEps = 1e-3;  // torchvision efficientnet_v2_*: BatchNorm2d(eps=1e-3)

}  // namespace

std::vector<EfficientNetStage> EfficientNetEncoderOptions::v2_s_stages() {
  return {{true, 1, 3, 1, 24, 24, 2},   {true, 4, 3, 2, 24, 48, 4},    {true, 4, 3, 2, 48, 64, 4},
          {false, 4, 3, 2, 64, 128, 6}, {false, 6, 3, 1, 128, 160, 9}, {false, 6, 3, 2, 160, 256, 15}};
}

EfficientNetEncoderOptions EfficientNetEncoderOptions::micro() {
  return EfficientNetEncoderOptions()
      .stem_channels(8)
      .stages({{true, 1, 3, 1, 8, 8, 2},
               {true, 2, 3, 2, 8, 16, 2},
               {true, 2, 3, 2, 16, 24, 1},
               {false, 4, 3, 2, 24, 32, 2},
               {false, 4, 3, 1, 32, 40, 2},
               {false, 4, 3, 2, 40, 48, 1}})
      .head_channels(64);
}

ConvNormActivationImpl::ConvNormActivationImpl(int64_t in, int64_t out, int64_t kernel, int64_t stride, int64_t groups,
                                               bool act, const nn::LayerInit& init)
    : activation(act) {
  conv = register_module("0", nn::Conv2d(in, out, kernel, stride, (kernel - 1) / 2, /*bias=*/false, init, groups));
  norm = register_module("1", nn::BatchNorm2d(out, kBackboneNormEps, /*affine=*/true, init));
}

torch::Tensor ConvNormActivationImpl::forward(const torch::Tensor& x) {
  torch::Tensor y = norm->forward(conv->forward(x));
  return activation ? torch::silu(y) : y;
}

SqueezeExcitationImpl::SqueezeExcitationImpl(int64_t channels, int64_t squeeze, const nn::LayerInit& init) {
  fc1 = register_module("fc1", nn::Conv2d(channels, squeeze, 1, 1, 0, true, init));
  fc2 = register_module("fc2", nn::Conv2d(squeeze, channels, 1, 1, 0, true, init));
}

torch::Tensor SqueezeExcitationImpl::forward(const torch::Tensor& x) {
  torch::Tensor s = x.mean({2, 3}, /*keepdim=*/true);
  s = torch::sigmoid(fc2->forward(torch::silu(fc1->forward(s))));
  return x * s.to(x.scalar_type());
}

EfficientNetBlockImpl::EfficientNetBlockImpl(const EfficientNetStage& st, int64_t in, int64_t stride,
                                             const nn::LayerInit& init)
    : residual(stride == 1 && in == st.out_channels) {
  auto block = container(*this, "block");
  const int64_t hidden = in * st.expand_ratio;
  auto add = [&](const std::string& name, ConvNormActivation m) {
    layers.push_back(block->register_module(name, std::move(m)));
  };
  if (st.fused) {
    if (st.expand_ratio == 1) {
      add("0", ConvNormActivation(in, st.out_channels, st.kernel, stride, 1, true, init));
    } else {
      add("0", ConvNormActivation(in, hidden, st.kernel, stride, 1, true, init));
      add("1", ConvNormActivation(hidden, st.out_channels, 1, 1, 1, false, init));
    }
  } else {
    add("0", ConvNormActivation(in, hidden, 1, 1, 1, true, init));
    add("1", ConvNormActivation(hidden, hidden, st.kernel, stride, hidden, true, init));
    se = block->register_module("2", SqueezeExcitation(hidden, std::max<int64_t>(1, in / 4), init));
    add("3", ConvNormActivation(hidden, st.out_channels, 1, 1, 1, false, init));
  }
}

torch::Tensor EfficientNetBlockImpl::forward(const torch::Tensor& x) {
  torch::Tensor h = x;
  for (size_t i = 0; i < layers.size(); ++i) {
    h = layers[i]->forward(h);
    if (se && i == 1) h = se->forward(h);
  }
  return residual ? h + x : h;
}

EfficientNetEncoderImpl::EfficientNetEncoderImpl(const EfficientNetEncoderOptions& o) : options_(o) {
  const nn::LayerInit& init = o.init();
  if (o.stages().empty()) fail("EfficientNetEncoder: no stages");
  auto backbone = container(*this, "backbone");
  stem = backbone->register_module("0", ConvNormActivation(3, o.stem_channels(), 3, 2, 1, true, init));
  int64_t channels = o.stem_channels();
  for (size_t s = 0; s < o.stages().size(); ++s) {
    const EfficientNetStage& st = o.stages()[s];
    if (st.in_channels != channels)
      fail("EfficientNetEncoder: stage {} takes {} channels but the layer before gives {}", s + 1, st.in_channels,
           channels);
    if (st.layers < 1 || st.expand_ratio < 1 || st.kernel < 1 || st.stride < 1 || st.out_channels < 1)
      fail("EfficientNetEncoder: stage {} has a non-positive size", s + 1);
    auto stage = container(*backbone, std::to_string(s + 1));
    std::vector<EfficientNetBlock> blocks;
    for (int64_t i = 0; i < st.layers; ++i) {
      const int64_t in = i == 0 ? st.in_channels : st.out_channels;
      blocks.push_back(
          stage->register_module(std::to_string(i), EfficientNetBlock(st, in, i == 0 ? st.stride : 1, init)));
    }
    stages.push_back(std::move(blocks));
    channels = st.out_channels;
  }
  head = backbone->register_module(std::to_string(o.stages().size() + 1),
                                   ConvNormActivation(channels, o.head_channels(), 1, 1, 1, true, init));
  auto mapper = container(*this, "mapper");
  mapper_conv = mapper->register_module("0", nn::Conv2d(o.head_channels(), o.latent_channels(), 1, 1, 0, false, init));
  mapper_norm = mapper->register_module("1", nn::BatchNorm2d(o.latent_channels(), 1e-5, /*affine=*/false, init));
}

torch::Tensor EfficientNetEncoderImpl::forward(const torch::Tensor& x) {
  require_image(x, 3, "EfficientNetEncoder");
  torch::Tensor h = stem->forward(x.to(stem->conv->weight.scalar_type()));
  for (auto& blocks : stages) {
    for (auto& b : blocks) h = b->forward(h);
  }
  h = head->forward(h);
  return mapper_norm->forward(mapper_conv->forward(h));
}

torch::Tensor EfficientNetEncoderImpl::encode(const torch::Tensor& images) {
  require_image(images, 3, "EfficientNetEncoder::encode");
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(images.device());
  torch::Tensor mean = torch::tensor({0.485, 0.456, 0.406}, f32).view({1, 3, 1, 1});
  torch::Tensor std = torch::tensor({0.229, 0.224, 0.225}, f32).view({1, 3, 1, 1});
  torch::Tensor x = ((images.to(torch::kFloat32) + 1) * 0.5 - mean) / std;
  return forward(x);
}

PreviewerImpl::PreviewerImpl(const PreviewerOptions& o) : options_(o) {
  const int64_t h = o.hidden_channels();
  if (h < 4 || h % 4 != 0) fail("Previewer: hidden_channels must be a positive multiple of 4, got {}", h);
  const nn::LayerInit& init = o.init();
  auto blocks = container(*this, "blocks");
  auto conv = [&](int index, int64_t in, int64_t out, int64_t k) {
    convs.push_back(blocks->register_module(std::to_string(index), nn::Conv2d(in, out, k, 1, (k - 1) / 2, true, init)));
  };
  auto up = [&](int index, int64_t in, int64_t out) {
    upsamplers.push_back(
        blocks->register_module(std::to_string(index), nn::ConvTranspose2d(in, out, 2, 2, 0, true, init)));
  };
  auto norm = [&](int index, int64_t c) {
    norms.push_back(blocks->register_module(std::to_string(index), nn::BatchNorm2d(c, 1e-5, true, init)));
  };
  // (GELUs sit at the indices between, holding no parameters.)
  conv(0, o.in_channels(), h, 1);
  norm(2, h);
  conv(3, h, h, 3);
  norm(5, h);
  up(6, h, h / 2);
  norm(8, h / 2);
  conv(9, h / 2, h / 2, 3);
  norm(11, h / 2);
  up(12, h / 2, h / 4);
  norm(14, h / 4);
  conv(15, h / 4, h / 4, 3);
  norm(17, h / 4);
  up(18, h / 4, h / 4);
  norm(20, h / 4);
  conv(21, h / 4, h / 4, 3);
  norm(23, h / 4);
  conv(24, h / 4, o.out_channels(), 1);
}

torch::Tensor PreviewerImpl::forward(const torch::Tensor& latents) {
  require_image(latents, options_.in_channels(), "Previewer");
  const torch::Tensor z = latents.to(convs[0]->weight.scalar_type());
  // conv -> GELU -> BN, then (upsampler or conv) -> GELU -> BN, ...; the last conv has neither.
  auto step = [&](torch::Tensor x, size_t n) { return norms[n]->forward(torch::gelu(x)); };
  torch::Tensor x = step(convs[0]->forward(z), 0);
  x = step(convs[1]->forward(x), 1);
  for (size_t level = 0; level < 3; ++level) {
    x = step(upsamplers[level]->forward(x), 2 + 2 * level);
    x = step(convs[2 + level]->forward(x), 3 + 2 * level);
  }
  return convs[5]->forward(x);
}

LoadWeightsReport load_cascade_coder(torch::nn::Module& module, const WeightFiles& files) {
  LoadWeightsOptions lo;
  lo.key_map = [](const std::string& key) -> std::string {
    static const std::string counter = ".num_batches_tracked";
    const bool is_counter =
        key.size() >= counter.size() && key.compare(key.size() - counter.size(), counter.size(), counter) == 0;
    return is_counter ? "" : key;
  };
  return load_weights(module, files, lo);
}

}  // namespace shoestring::models
