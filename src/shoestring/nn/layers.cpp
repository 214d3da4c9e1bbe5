#include "shoestring/nn/layers.h"

#include <cmath>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/units.h"
#include "shoestring/nn/block_precision.h"

namespace shoestring::nn {
namespace {

// U(-bound, bound) in place unless the tensor lives on the meta device.
torch::Tensor uniform_param(std::vector<int64_t> shape, double bound, const LayerInit& init) {
  torch::Tensor t = torch::empty(shape, init.options);
  if (init.fills_values()) {
    torch::NoGradGuard no_grad;
    t.uniform_(-bound, bound);
  }
  return t;
}

torch::Tensor filled_param(int64_t n, double value, const LayerInit& init) {
  torch::Tensor t = torch::empty({n}, init.options);
  if (init.fills_values()) {
    torch::NoGradGuard no_grad;
    t.fill_(value);
  }
  return t;
}

void require_positive(const char* what, int64_t v) {
  if (v <= 0) fail("{} must be positive, got {}", what, v);
}

// Normalisation layers compute in fp32 for half types (as autocast does).
torch::Tensor to_float_if_half(const torch::Tensor& x) {
  return (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kHalf) ? x.to(torch::kFloat32) : x;
}

}  // namespace

LinearImpl::LinearImpl(int64_t in, int64_t out, bool with_bias, const LayerInit& init)
    : in_features(in), out_features(out) {
  require_positive("Linear in_features", in);
  require_positive("Linear out_features", out);
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  weight = register_parameter("weight", uniform_param({out, in}, bound, init));
  if (with_bias) bias = register_parameter("bias", uniform_param({out}, bound, init));
}

torch::Tensor LinearImpl::forward(const torch::Tensor& x, double bias_scale) {
  if (x.dim() < 1 || x.size(-1) != in_features)
    fail("Linear: expected input [..., {}], got {}", in_features, format_shape(x.sizes()));
  torch::Tensor y;
  if (weight_fp8 || bias_scale != 1.0) {
    y = weight_fp8 ? fp8_linear(to_compute_dtype(x), weight, *weight_fp8)
                   : torch::linear(to_compute_dtype(x), to_compute_dtype(weight));
    if (bias.defined()) y = y + (bias_scale == 1.0 ? to_compute_dtype(bias) : to_compute_dtype(bias) * bias_scale);
  } else {
    y = torch::linear(to_compute_dtype(x), to_compute_dtype(weight), to_compute_dtype(bias));
  }
  return adapter ? y + adapter(x) : y;
}

Conv2dImpl::Conv2dImpl(int64_t in, int64_t out, int64_t k, int64_t s, int64_t p, bool with_bias, const LayerInit& init,
                       int64_t g)
    : in_channels(in), out_channels(out), kernel_size(k), stride(s), padding(p), groups(g) {
  require_positive("Conv2d in_channels", in);
  require_positive("Conv2d out_channels", out);
  require_positive("Conv2d kernel_size", k);
  require_positive("Conv2d stride", s);
  require_positive("Conv2d groups", g);
  if (p < 0) fail("Conv2d padding must be >= 0, got {}", p);
  if (in % g != 0 || out % g != 0) fail("Conv2d: groups {} must divide in {} and out {}", g, in, out);
  const double bound = 1.0 / std::sqrt(static_cast<double>(in / g * k * k));
  weight = register_parameter("weight", uniform_param({out, in / g, k, k}, bound, init));
  if (with_bias) bias = register_parameter("bias", uniform_param({out}, bound, init));
}

torch::Tensor Conv2dImpl::forward(const torch::Tensor& x, double bias_scale) {
  if (x.dim() != 4 || x.size(1) != in_channels)
    fail("Conv2d: expected input [B, {}, H, W], got {}", in_channels, format_shape(x.sizes()));
  torch::Tensor y;
  if (weight_fp8 || bias_scale != 1.0) {
    y = weight_fp8 ? fp8_conv2d(to_compute_dtype(x), weight, *weight_fp8, stride, padding, groups)
                   : torch::conv2d(to_compute_dtype(x), to_compute_dtype(weight), {}, {stride, stride},
                                   {padding, padding}, {1, 1}, groups);
    if (bias.defined()) {
      torch::Tensor b = to_compute_dtype(bias);
      y = y + (bias_scale == 1.0 ? b : b * bias_scale).view({1, -1, 1, 1});
    }
  } else {
    y = torch::conv2d(to_compute_dtype(x), to_compute_dtype(weight), to_compute_dtype(bias), {stride, stride},
                      {padding, padding}, {1, 1}, groups);
  }
  return adapter ? y + adapter(x) : y;
}

ConvTranspose2dImpl::ConvTranspose2dImpl(int64_t in, int64_t out, int64_t k, int64_t s, int64_t p, bool with_bias,
                                         const LayerInit& init, int64_t g)
    : in_channels(in), out_channels(out), kernel_size(k), stride(s), padding(p), groups(g) {
  require_positive("ConvTranspose2d in_channels", in);
  require_positive("ConvTranspose2d out_channels", out);
  require_positive("ConvTranspose2d kernel_size", k);
  require_positive("ConvTranspose2d stride", s);
  require_positive("ConvTranspose2d groups", g);
  if (p < 0) fail("ConvTranspose2d padding must be >= 0, got {}", p);
  if (in % g != 0 || out % g != 0) fail("ConvTranspose2d: groups {} must divide in {} and out {}", g, in, out);
  const double bound = 1.0 / std::sqrt(static_cast<double>(out / g * k * k));
  weight = register_parameter("weight", uniform_param({in, out / g, k, k}, bound, init));
  if (with_bias) bias = register_parameter("bias", uniform_param({out}, bound, init));
}

torch::Tensor ConvTranspose2dImpl::forward(const torch::Tensor& x) {
  if (x.dim() != 4 || x.size(1) != in_channels)
    fail("ConvTranspose2d: expected input [B, {}, H, W], got {}", in_channels, format_shape(x.sizes()));
  torch::Tensor xc = to_compute_dtype(x), w = to_compute_dtype(weight), b = to_compute_dtype(bias);
  // libtorch's CPU kernel has no fp16 form, and its bf16 (oneDNN) form reads
  // the weight as [out, in, k, k] and fails (1.13): compute those in fp32.
  const bool half = xc.scalar_type() == torch::kBFloat16 || xc.scalar_type() == torch::kHalf;
  if (half && xc.device().is_cpu()) {
    auto f32 = [](const torch::Tensor& t) { return t.defined() ? t.to(torch::kFloat32) : t; };
    return torch::conv_transpose2d(f32(xc), f32(w), f32(b), {stride, stride}, {padding, padding}, {0, 0}, groups)
        .to(xc.scalar_type());
  }
  return torch::conv_transpose2d(xc, w, b, {stride, stride}, {padding, padding}, {0, 0}, groups);
}

BatchNorm2dImpl::BatchNorm2dImpl(int64_t c, double e, bool affine, const LayerInit& init) : channels(c), eps(e) {
  require_positive("BatchNorm2d channels", c);
  if (!(e > 0)) fail("BatchNorm2d eps must be > 0, got {}", e);
  if (affine) {
    weight = register_parameter("weight", filled_param(c, 1.0, init));
    bias = register_parameter("bias", filled_param(c, 0.0, init));
  }
  running_mean = register_buffer("running_mean", filled_param(c, 0.0, init));
  running_var = register_buffer("running_var", filled_param(c, 1.0, init));
}

torch::Tensor BatchNorm2dImpl::forward(const torch::Tensor& x) {
  if (x.dim() != 4 || x.size(1) != channels)
    fail("BatchNorm2d: expected input [B, {}, H, W], got {}", channels, format_shape(x.sizes()));
  torch::Tensor xf = to_float_if_half(x);
  auto as = [&](const torch::Tensor& t) { return t.defined() ? t.to(xf.scalar_type()) : t; };
  return torch::batch_norm(xf, as(weight), as(bias), as(running_mean), as(running_var), /*training=*/false,
                           /*momentum=*/0.0, eps, /*cudnn_enabled=*/true)
      .to(x.scalar_type());
}

GroupNormImpl::GroupNormImpl(int64_t g, int64_t c, double e, bool affine, const LayerInit& init)
    : groups(g), channels(c), eps(e) {
  require_positive("GroupNorm groups", g);
  require_positive("GroupNorm channels", c);
  if (c % g != 0) fail("GroupNorm: {} groups do not divide {} channels", g, c);
  if (affine) {
    weight = register_parameter("weight", filled_param(c, 1.0, init));
    bias = register_parameter("bias", filled_param(c, 0.0, init));
  }
}

torch::Tensor GroupNormImpl::forward(const torch::Tensor& x) {
  if (x.dim() < 2 || x.size(1) != channels)
    fail("GroupNorm: expected input [B, {}, ...], got {}", channels, format_shape(x.sizes()));
  // A channels-last input is normalised in contiguous (NCHW) layout and
  // returned channels-last: libtorch 1.13's channels-last GroupNorm CPU
  // kernels are 3-10x slower than its contiguous ones, more than the two
  // layout copies cost (forward + backward, batch 32, 2 threads, Xeon with
  // AVX-512: [32, 32, 16, 16] fp32 6.34 ms -> 0.87 ms, bf16 6.33 -> 1.90 ms;
  // [32, 128, 4, 4] fp32 0.52 -> 0.20 ms). The tiny UNet runs channels-last
  // (models/tiny_unet.h) for its convolutions.
  const bool channels_last = x.dim() == 4 && !x.is_contiguous() && x.is_contiguous(torch::MemoryFormat::ChannelsLast);
  const at::ScalarType compute =
      x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kHalf ? torch::kFloat32 : x.scalar_type();
  const auto layout = channels_last ? torch::MemoryFormat::Contiguous : torch::MemoryFormat::Preserve;
  const torch::Tensor xf = x.to(compute, /*non_blocking=*/false, /*copy=*/false, layout);
  const torch::Tensor w = weight.defined() ? weight.to(compute) : weight;
  const torch::Tensor b = bias.defined() ? bias.to(compute) : bias;
  return torch::group_norm(xf, groups, w, b, eps)
      .to(x.scalar_type(), false, false,
          channels_last ? torch::MemoryFormat::ChannelsLast : torch::MemoryFormat::Preserve);
}

LayerNormImpl::LayerNormImpl(int64_t d, double e, bool affine, bool with_bias, const LayerInit& init) : dim(d), eps(e) {
  require_positive("LayerNorm dim", d);
  if (affine) {
    weight = register_parameter("weight", filled_param(d, 1.0, init));
    if (with_bias) bias = register_parameter("bias", filled_param(d, 0.0, init));
  }
}

torch::Tensor LayerNormImpl::forward(const torch::Tensor& x) {
  if (x.dim() < 1 || x.size(-1) != dim)
    fail("LayerNorm: expected input [..., {}], got {}", dim, format_shape(x.sizes()));
  torch::Tensor xf = to_float_if_half(x);
  torch::Tensor w = weight.defined() ? weight.to(xf.scalar_type()) : weight;
  torch::Tensor b = bias.defined() ? bias.to(xf.scalar_type()) : bias;
  return torch::layer_norm(xf, {dim}, w, b, eps).to(x.scalar_type());
}

RMSNormImpl::RMSNormImpl(int64_t d, double e, bool affine, const LayerInit& init) : dim(d), eps(e) {
  require_positive("RMSNorm dim", d);
  if (affine) weight = register_parameter("weight", filled_param(d, 1.0, init));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  if (x.dim() < 1 || x.size(-1) != dim) fail("RMSNorm: expected input [..., {}], got {}", dim, format_shape(x.sizes()));
  torch::Tensor xf = to_float_if_half(x);
  torch::Tensor y = xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);
  if (weight.defined()) y = y * weight.to(y.scalar_type());
  return y.to(x.scalar_type());
}

EmbeddingImpl::EmbeddingImpl(int64_t n, int64_t d, const LayerInit& init) : num_embeddings(n), dim(d) {
  require_positive("Embedding num_embeddings", n);
  require_positive("Embedding dim", d);
  torch::Tensor t = torch::empty({n, d}, init.options);
  if (init.fills_values()) {
    torch::NoGradGuard no_grad;
    t.normal_(0.0, 1.0);
  }
  weight = register_parameter("weight", t);
}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& ids) {
  if (ids.scalar_type() != torch::kLong) fail("Embedding: ids must be int64, got {}", c10::toString(ids.scalar_type()));
  if (ids.numel() > 0) {
    const int64_t lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
    if (lo < 0 || hi >= num_embeddings) fail("Embedding: id out of range [0, {}): saw {}..{}", num_embeddings, lo, hi);
  }
  return to_compute_dtype(torch::embedding(weight, ids));
}

int64_t parameter_count(const torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters(/*recurse=*/true)) n += p.numel();
  return n;
}

}  // namespace shoestring::nn
