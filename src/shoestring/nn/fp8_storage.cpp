#include "shoestring/nn/fp8_storage.h"

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/torch_compat.h"
#include "shoestring/nn/layers.h"

namespace shoestring::nn {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kGrain = 1 << 15;

at::Tensor as_bytes(const at::Tensor& bits, const char* what) {
  if (!is_fp8_storage_dtype(bits.scalar_type()) && bits.scalar_type() != at::kByte)
    fail("{}: expected fp8 bytes (uint8 or float8), got a {} tensor", what, c10::toString(bits.scalar_type()));
  at::Tensor b = bits.scalar_type() == at::kByte ? bits : bits.view(at::kByte);
  return b.contiguous();
}

Fp8Storage storage_of(AutogradContext* ctx) {
  Fp8Storage s;
  s.format = ctx->saved_data["format"].toInt() == 0 ? Fp8Format::e4m3fn : Fp8Format::e5m2;
  s.scale = ctx->saved_data["scale"].toDouble();
  return s;
}

void save_storage(AutogradContext* ctx, const at::Tensor& bits, const Fp8Storage& s) {
  // The bytes are the layer's own parameter: saving them costs nothing.
  ctx->saved_data["bits"] = bits;
  ctx->saved_data["format"] = static_cast<int64_t>(s.format == Fp8Format::e4m3fn ? 0 : 1);
  ctx->saved_data["scale"] = s.scale;
}

struct Fp8LinearFunction : public torch::autograd::Function<Fp8LinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& bits, double scale,
                            int64_t format) {
    const Fp8Storage s{format == 0 ? Fp8Format::e4m3fn : Fp8Format::e5m2, scale};
    save_storage(ctx, bits, s);
    return at::linear(x, dequantize_fp8(bits, s, x.scalar_type()));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& g = grads[0];
    const at::Tensor w = dequantize_fp8(ctx->saved_data["bits"].toTensor(), storage_of(ctx), g.scalar_type());
    return {g.matmul(w), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct Fp8Conv2dFunction : public torch::autograd::Function<Fp8Conv2dFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& bits, double scale,
                            int64_t format, int64_t stride, int64_t padding, int64_t groups) {
    const Fp8Storage s{format == 0 ? Fp8Format::e4m3fn : Fp8Format::e5m2, scale};
    save_storage(ctx, bits, s);
    ctx->saved_data["in_h"] = x.size(2);
    ctx->saved_data["in_w"] = x.size(3);
    ctx->saved_data["stride"] = stride;
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["groups"] = groups;
    return at::conv2d(x, dequantize_fp8(bits, s, x.scalar_type()), {}, {stride, stride}, {padding, padding}, {1, 1},
                      groups);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // libtorch's CPU transposed convolution has no bf16 / fp16 kernel
    // (slow_conv_transpose2d): compute the input gradient in fp32 there.
    const bool widen =
        grads[0].device().is_cpu() && grads[0].scalar_type() != at::kFloat && grads[0].scalar_type() != at::kDouble;
    const at::Tensor g = widen ? grads[0].to(at::kFloat) : grads[0];
    const at::Tensor bits = ctx->saved_data["bits"].toTensor();
    const at::Tensor w = dequantize_fp8(bits, storage_of(ctx), g.scalar_type());
    const int64_t stride = ctx->saved_data["stride"].toInt(), padding = ctx->saved_data["padding"].toInt();
    const int64_t k_h = w.size(2), k_w = w.size(3);
    // The transposed convolution of the output gradient; output_padding
    // restores the input rows / columns the forward's stride skipped.
    const int64_t pad_h = ctx->saved_data["in_h"].toInt() - ((g.size(2) - 1) * stride - 2 * padding + k_h);
    const int64_t pad_w = ctx->saved_data["in_w"].toInt() - ((g.size(3) - 1) * stride - 2 * padding + k_w);
    at::Tensor gx = at::conv_transpose2d(g, w, {}, {stride, stride}, {padding, padding}, {pad_h, pad_w},
                                         ctx->saved_data["groups"].toInt(), {1, 1});
    if (widen) gx = gx.to(grads[0].scalar_type());
    return {gx, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

bool is_fp8_storage_dtype(at::ScalarType t) {
  return t == compat::fp8_storage_dtype(true) || t == compat::fp8_storage_dtype(false);
}

at::ScalarType value_dtype(const at::Tensor& param) {
  return is_fp8_storage_dtype(param.scalar_type()) ? at::kFloat : param.scalar_type();
}

at::Tensor dequantize_fp8(const at::Tensor& bits, const Fp8Storage& s, at::ScalarType dtype) {
  if (!at::isFloatingType(dtype) || is_fp8_storage_dtype(dtype))
    fail("dequantize_fp8: target dtype must be fp32, bf16 or fp16, got {}", c10::toString(dtype));
  return fp8_decode_tensor(as_bytes(bits, "dequantize_fp8"), s.format, s.scale, dtype);
}

at::Tensor encode_fp8(const at::Tensor& values, const Fp8Storage& s) {
  if (!values.is_floating_point() || is_fp8_storage_dtype(values.scalar_type()))
    fail("encode_fp8: expected a floating-point tensor, got {}", c10::toString(values.scalar_type()));
  const at::Tensor x = (values.detach().to(at::kCPU, at::kFloat) * s.scale).contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kByte));
  const float* in = x.data_ptr<float>();
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, x.numel(), kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) o[i] = fp8_encode(in[i], s.format);
  });
  const at::ScalarType target = compat::fp8_storage_dtype(s.format == Fp8Format::e4m3fn);
  return (target == at::kByte ? out : out.view(target)).to(values.device());
}

at::Tensor fp8_linear(const at::Tensor& x, const at::Tensor& bits, const Fp8Storage& s) {
  return apply_autograd_function<Fp8LinearFunction>(x, bits, s.scale,
                                                    static_cast<int64_t>(s.format == Fp8Format::e4m3fn ? 0 : 1));
}

at::Tensor fp8_conv2d(const at::Tensor& x, const at::Tensor& bits, const Fp8Storage& s, int64_t stride, int64_t padding,
                      int64_t groups) {
  return apply_autograd_function<Fp8Conv2dFunction>(
      x, bits, s.scale, static_cast<int64_t>(s.format == Fp8Format::e4m3fn ? 0 : 1), stride, padding, groups);
}

std::optional<Fp8Storage>* fp8_slot(torch::nn::Module& owner, const std::string& name) {
  if (name != "weight") return nullptr;
  if (auto* l = dynamic_cast<LinearImpl*>(&owner)) return &l->weight_fp8;
  if (auto* c = dynamic_cast<Conv2dImpl*>(&owner)) return &c->weight_fp8;
  return nullptr;
}

bool can_store_fp8(const torch::nn::Module& owner, const std::string& name) {
  return name == "weight" &&
         (dynamic_cast<const LinearImpl*>(&owner) != nullptr || dynamic_cast<const Conv2dImpl*>(&owner) != nullptr);
}

std::map<std::string, Fp8Storage> fp8_parameters(const torch::nn::Module& root) {
  std::map<std::string, Fp8Storage> out;
  auto add = [&out](const std::string& path, const torch::nn::Module& m) {
    const std::optional<Fp8Storage>* slot = nullptr;
    if (const auto* l = dynamic_cast<const LinearImpl*>(&m)) slot = &l->weight_fp8;
    if (const auto* c = dynamic_cast<const Conv2dImpl*>(&m)) slot = &c->weight_fp8;
    if (slot && *slot) out.emplace(path.empty() ? "weight" : path + ".weight", **slot);
  };
  // The root by reference (it need not be held by a shared_ptr), then its submodules.
  add("", root);
  for (const auto& item : root.named_modules("", /*include_self=*/false)) add(item.key(), *item.value());
  return out;
}

}  // namespace shoestring::nn
