// fp8 weight storage in layers (nn/fp8_storage.h): bytes decode to the
// published fp8 values over the scale, Linear / Conv2d computing from bytes
// match the same layers holding the decoded values in fp32 (forward and input
// gradient), autograd keeps only the bytes, and LoRA trains on an fp8 base.
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <tuple>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/core/torch_compat.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/nn/attention.h"
#include "shoestring/nn/block_precision.h"
#include "shoestring/nn/fp8_storage.h"
#include "shoestring/nn/layers.h"
#include "shoestring/nn/lora.h"

using namespace shoestring;
namespace sn = shoestring::nn;

namespace {

// Packs `weight` (a Linear / Conv2d weight) as fp8 bytes with `s`, as
// precision::apply does; returns the decoded fp32 values for a reference layer.
at::Tensor pack(at::Tensor& weight, std::optional<sn::Fp8Storage>& slot, const sn::Fp8Storage& s) {
  torch::NoGradGuard no_grad;
  weight.requires_grad_(false);
  weight.set_data(sn::encode_fp8(weight, s));
  slot = s;
  return sn::dequantize_fp8(weight, s, at::kFloat);
}

// (1 + m/8) * 2^(e-7), written out independently of the codec, for e4m3 patterns 0x08..0x77.
double e4m3_normal(int b) { return (1.0 + (b & 7) / 8.0) * std::pow(2.0, ((b >> 3) & 15) - 7); }

}  // namespace

TEST(Fp8Storage, BytesAreOneBytePerElementInTheVersionsDtype) {
  at::Tensor bits = sn::encode_fp8(torch::tensor({1.0f, -2.0f}), {Fp8Format::e4m3fn, 1.0});
  EXPECT_EQ(bits.element_size(), 1);
  EXPECT_EQ(bits.scalar_type(), compat::fp8_storage_dtype(true));
  EXPECT_TRUE(sn::is_fp8_storage_dtype(bits.scalar_type()));
#if SHOESTRING_HAS_FLOAT8
  EXPECT_EQ(bits.scalar_type(), at::kFloat8_e4m3fn);
#else
  EXPECT_EQ(bits.scalar_type(), at::kByte);
#endif
  at::Tensor raw = bits.view(at::kByte);
  EXPECT_EQ(raw[0].item<int>(), 0x38);  // 1.0 = 0.0111.000
  EXPECT_EQ(raw[1].item<int>(), 0xC0);  // -2.0 = 1.1000.000
}

TEST(Fp8Storage, DequantizeIsThePublishedValueOverTheScale) {
  at::Tensor all = torch::arange(256, torch::kInt).to(torch::kByte);
  for (double scale : {1.0, 16.0, 0.125}) {
    at::Tensor f = sn::dequantize_fp8(all, {Fp8Format::e4m3fn, scale}, at::kFloat);
    at::Tensor b = sn::dequantize_fp8(all, {Fp8Format::e4m3fn, scale}, at::kBFloat16);
    EXPECT_EQ(b.scalar_type(), at::kBFloat16);
    for (int i = 0x08; i < 0x78; ++i) {
      EXPECT_EQ(f[i].item<double>(), e4m3_normal(i) / scale) << i;
      EXPECT_EQ(f[i | 0x80].item<double>(), -e4m3_normal(i) / scale) << i;
      EXPECT_EQ(b[i].item<double>(), e4m3_normal(i) / scale) << i;  // exact in bf16
    }
    EXPECT_TRUE(std::isnan(f[0x7F].item<float>()));
    EXPECT_EQ(f[0x01].item<double>(), std::pow(2.0, -9) / scale);
  }
  at::Tensor e5 = sn::dequantize_fp8(all, {Fp8Format::e5m2, 2.0}, at::kFloat);
  EXPECT_EQ(e5[0x7B].item<double>(), 57344.0 / 2);
  EXPECT_TRUE(std::isinf(e5[0x7C].item<float>()));
  EXPECT_EQ(e5[0x01].item<double>(), std::pow(2.0, -16) / 2);
  EXPECT_THROW(sn::dequantize_fp8(torch::zeros({2}), {Fp8Format::e4m3fn, 1.0}, at::kFloat), Error);
}

TEST(Fp8Storage, EncodeScalesThenRoundsToNearest) {
  // 0.3 * 16 = 4.8: the e4m3 grid in [4, 8) has step 0.5 -> 5; 0.01 * 16 = 0.16: step 2^-6 in
  // [0.125, 0.25) -> 10 * 2^-6 = 0.15625; -100 * 16 = -1600 saturates to -448.
  at::Tensor bits = sn::encode_fp8(torch::tensor({0.3f, 0.01f, -100.0f}), {Fp8Format::e4m3fn, 16.0});
  at::Tensor v = sn::dequantize_fp8(bits, {Fp8Format::e4m3fn, 16.0}, at::kFloat);
  EXPECT_EQ(v[0].item<float>(), 5.0f / 16);
  EXPECT_EQ(v[1].item<float>(), 0.15625f / 16);
  EXPECT_EQ(v[2].item<float>(), -448.0f / 16);  // -1600 saturates
}

TEST(Fp8Storage, LinearMatchesTheDecodedWeightsForwardAndBackward) {
  torch::manual_seed(0);
  sn::Linear lin(24, 10), ref(24, 10);
  const at::Tensor decoded = pack(lin->weight, lin->weight_fp8, {Fp8Format::e4m3fn, 64.0});
  EXPECT_EQ(lin->weight.element_size(), 1);
  {
    torch::NoGradGuard no_grad;
    ref->weight.copy_(decoded);
    ref->bias.copy_(lin->bias);
  }
  ref->weight.requires_grad_(false);
  for (auto shape : {std::vector<int64_t>{5, 24}, std::vector<int64_t>{2, 3, 24}}) {
    at::Tensor x = torch::randn(shape).requires_grad_(true);
    at::Tensor xr = x.detach().clone().requires_grad_(true);
    at::Tensor y = lin(x), yr = ref(xr);
    EXPECT_TRUE(torch::allclose(y, yr, 1e-6, 1e-6));
    at::Tensor g = torch::randn_like(y);
    y.backward(g);
    yr.backward(g);
    EXPECT_TRUE(torch::allclose(x.grad(), xr.grad(), 1e-6, 1e-6));
    EXPECT_TRUE(torch::allclose(lin->bias.grad(), ref->bias.grad(), 1e-5, 1e-5));
    lin->bias.mutable_grad() = at::Tensor();
    ref->bias.mutable_grad() = at::Tensor();
  }
  // In a bf16 block: computed in bf16, against the bf16 reference.
  sn::ComputeDtypeGuard bf16(at::kBFloat16);
  at::Tensor x = torch::randn({4, 24});
  at::Tensor y = lin(x);
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(torch::allclose(y.to(at::kFloat), ref(x).to(at::kFloat), 2e-2, 2e-2));
}

TEST(Fp8Storage, Conv2dMatchesTheDecodedWeightsForwardAndBackward) {
  torch::manual_seed(1);
  struct Case {
    int64_t in, out, k, stride, padding, groups, side;
  };
  for (const Case& c :
       {Case{4, 6, 3, 2, 1, 2, 7}, Case{4, 6, 3, 1, 1, 1, 8}, Case{3, 5, 1, 1, 0, 1, 5}, Case{2, 4, 3, 2, 0, 1, 8}}) {
    SCOPED_TRACE(
        fmt::format("k {} stride {} padding {} groups {} side {}", c.k, c.stride, c.padding, c.groups, c.side));
    sn::Conv2d conv(c.in, c.out, c.k, c.stride, c.padding, true, sn::LayerInit{}, c.groups);
    sn::Conv2d ref(c.in, c.out, c.k, c.stride, c.padding, true, sn::LayerInit{}, c.groups);
    const at::Tensor decoded = pack(conv->weight, conv->weight_fp8, {Fp8Format::e5m2, 8.0});
    {
      torch::NoGradGuard no_grad;
      ref->weight.copy_(decoded);
      ref->bias.copy_(conv->bias);
    }
    ref->weight.requires_grad_(false);
    at::Tensor x = torch::randn({2, c.in, c.side, c.side}).requires_grad_(true);
    at::Tensor xr = x.detach().clone().requires_grad_(true);
    at::Tensor y = conv(x), yr = ref(xr);
    ASSERT_EQ(y.sizes(), yr.sizes());
    EXPECT_TRUE(torch::allclose(y, yr, 1e-5, 1e-5));
    at::Tensor g = torch::randn_like(y);
    y.backward(g);
    yr.backward(g);
    ASSERT_EQ(x.grad().sizes(), x.sizes());
    EXPECT_TRUE(torch::allclose(x.grad(), xr.grad(), 1e-5, 1e-5));
    // In a bf16 block (the CPU has no bf16 transposed convolution: fp32 inside).
    sn::ComputeDtypeGuard bf16(at::kBFloat16);
    at::Tensor xb = x.detach().to(at::kBFloat16).requires_grad_(true);
    at::Tensor yb = conv(xb);
    yb.backward(g.to(at::kBFloat16));
    EXPECT_EQ(xb.grad().scalar_type(), at::kBFloat16);
    EXPECT_TRUE(torch::allclose(xb.grad().to(at::kFloat), xr.grad(), 5e-2, 5e-2));
  }
}

TEST(Fp8Storage, AutogradKeepsOnlyTheBytes) {
  // A 1024 x 1024 fp8 weight decodes to 4 MiB of fp32 for the matmul; after
  // the forward only the output (and the bytes the layer holds anyway) stay.
  auto& ledger = MemoryLedger::global();
  ledger.install();
  torch::manual_seed(2);
  sn::Linear lin(1024, 1024, /*bias=*/false);
  pack(lin->weight, lin->weight_fp8, {Fp8Format::e4m3fn, 16.0});
  at::Tensor x = torch::randn({2, 1024}).requires_grad_(true);
  const int64_t decoded_bytes = 1024 * 1024 * 4;
  const int64_t before = ledger.current_total();
  ledger.reset_peaks();
  at::Tensor y = lin(x);
  const int64_t kept = ledger.current_total() - before;
  EXPECT_GE(kept, static_cast<int64_t>(y.nbytes()));
  EXPECT_LT(kept, 64 * 1024) << "the decoded weight is kept alive by autograd";
  // The decoded weight did exist, for the matmul only.
  EXPECT_GE(ledger.peak_total() - before, decoded_bytes);
  EXPECT_LT(ledger.peak_total() - before, decoded_bytes + 256 * 1024);
  y.sum().backward();
  EXPECT_EQ(x.grad().sizes(), x.sizes());
}

TEST(Fp8Storage, LoraTrainsOnAnFp8Base) {
  // LoRA on a frozen fp8 base (kohya's fp8_base) gets the gradients it gets on
  // the same base held as decoded fp32 values.
  struct Net : torch::nn::Module {
    Net() {
      // Names LoRA adapts by default (attention projections).
      a = register_module("to_q", sn::Linear(8, 16));
      b = register_module("to_k", sn::Linear(16, 4));
    }
    at::Tensor forward(const at::Tensor& x) { return b(torch::gelu(a(x))); }
    sn::Linear a{nullptr}, b{nullptr};
  };
  torch::manual_seed(3);
  auto fp8 = std::make_shared<Net>();
  auto ref = std::make_shared<Net>();
  for (auto* n : {fp8.get(), ref.get()}) {
    for (auto& p : n->parameters()) p.requires_grad_(false);
  }
  {
    torch::NoGradGuard no_grad;
    ref->a->bias.copy_(fp8->a->bias);
    ref->b->bias.copy_(fp8->b->bias);
    ref->a->weight.copy_(pack(fp8->a->weight, fp8->a->weight_fp8, {Fp8Format::e4m3fn, 32.0}));
    ref->b->weight.copy_(pack(fp8->b->weight, fp8->b->weight_fp8, {Fp8Format::e4m3fn, 32.0}));
  }
  const std::vector<sn::LoraComponent> root = {{"lora_unet", ""}};
  sn::LoraNetwork net_fp8(*fp8, root, sn::LoraOptions{});
  sn::LoraNetwork net_ref(*ref, root, sn::LoraOptions{});
  {
    torch::NoGradGuard no_grad;
    auto pf = net_fp8->parameters(), pr = net_ref->parameters();
    ASSERT_EQ(pf.size(), 4u);
    for (size_t i = 0; i < pf.size(); ++i) {
      pf[i].normal_(0.0, 0.1);
      pr[i].copy_(pf[i]);
    }
  }
  at::Tensor x = torch::randn({3, 8});
  at::Tensor yf = fp8->forward(x), yr = ref->forward(x);
  EXPECT_TRUE(torch::allclose(yf, yr, 1e-5, 1e-5));
  yf.pow(2).sum().backward();
  yr.pow(2).sum().backward();
  auto pf = net_fp8->named_parameters(), pr = net_ref->named_parameters();
  for (const auto& item : pf) {
    SCOPED_TRACE(item.key());
    ASSERT_TRUE(item.value().grad().defined());
    EXPECT_TRUE(torch::allclose(item.value().grad(), pr[item.key()].grad(), 1e-5, 1e-5));
  }
  EXPECT_FALSE(fp8->a->weight.grad().defined());
  // Merging into fp8 bytes would corrupt them: refused, naming the layer.
  try {
    net_fp8->merge();
    ADD_FAILURE() << "merge into an fp8 base did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fp8"), std::string::npos) << e.what();
  }
}

TEST(Fp8Storage, SlotsAndInventory) {
  struct Net : torch::nn::Module {
    Net() {
      lin = register_module("lin", sn::Linear(4, 4));
      conv = register_module("conv", sn::Conv2d(2, 2, 3));
      norm = register_module("norm", sn::GroupNorm(1, 2));
    }
    sn::Linear lin{nullptr};
    sn::Conv2d conv{nullptr};
    sn::GroupNorm norm{nullptr};
  } net;
  EXPECT_TRUE(sn::can_store_fp8(*net.lin, "weight"));
  EXPECT_FALSE(sn::can_store_fp8(*net.lin, "bias"));
  EXPECT_TRUE(sn::can_store_fp8(*net.conv, "weight"));
  EXPECT_FALSE(sn::can_store_fp8(*net.norm, "weight"));
  EXPECT_EQ(sn::fp8_slot(*net.norm, "weight"), nullptr);
  EXPECT_EQ(sn::fp8_slot(*net.conv, "weight"), &net.conv->weight_fp8);
  EXPECT_TRUE(sn::fp8_parameters(net).empty());
  pack(net.conv->weight, net.conv->weight_fp8, {Fp8Format::e5m2, 2.0});
  auto inv = sn::fp8_parameters(net);
  ASSERT_EQ(inv.size(), 1u);
  EXPECT_EQ(inv.begin()->first, "conv.weight");
  EXPECT_EQ(inv.begin()->second.scale, 2.0);
  EXPECT_EQ(sn::value_dtype(net.conv->weight), at::kFloat);
  EXPECT_EQ(sn::value_dtype(net.lin->weight), at::kFloat);
}

TEST(Fp8Storage, SafetensorsF8TensorsCarryTheSameBits) {
  // Bytes from encode_fp8 saved as F8_E4M3 / F8_E5M2 (native float8 on
  // libtorch >= 2.1, uint8 with the dtype named on 1.13) come back as the
  // same bytes, and the header names the F8 dtype, as PyTorch writes it.
  const std::string path = (std::filesystem::temp_directory_path() /
                            fmt::format("shoestring_fp8_{}.safetensors", static_cast<long>(::getpid())))
                               .string();
  const at::Tensor values = torch::tensor({1.0f, -0.5f, 448.0f, 0.001953125f, 3.0f});
  const at::Tensor e4 = sn::encode_fp8(values, {Fp8Format::e4m3fn, 1.0});
  const at::Tensor e5 = sn::encode_fp8(values, {Fp8Format::e5m2, 1.0});
  save_safetensors(path, {{"e4", e4, StDtype::F8_E4M3}, {"e5", e5, StDtype::F8_E5M2}});
  std::ifstream in(path, std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_NE(text.find("\"F8_E4M3\""), std::string::npos);
  EXPECT_NE(text.find("\"F8_E5M2\""), std::string::npos);
  const auto file = SafetensorsFile::open(path);
  for (const auto& [name, want, format] :
       {std::tuple{"e4", e4, Fp8Format::e4m3fn}, std::tuple{"e5", e5, Fp8Format::e5m2}}) {
    const at::Tensor got = file.get(name);
    EXPECT_TRUE(sn::is_fp8_storage_dtype(got.scalar_type())) << name;
    EXPECT_TRUE(torch::equal(got.view(at::kByte), want.view(at::kByte))) << name;
    EXPECT_TRUE(torch::equal(sn::dequantize_fp8(got, {format, 1.0}, at::kFloat),
                             sn::dequantize_fp8(want, {format, 1.0}, at::kFloat)))
        << name;
  }
  // The e4m3fn bytes of these values are the published patterns.
  EXPECT_TRUE(
      torch::equal(e4.view(at::kByte), torch::tensor({0x38, 0xB0, 0x7E, 0x01, 0x44}, torch::kInt).to(at::kByte)));
  std::filesystem::remove(path);
}

TEST(Fp8Storage, AttentionFoldsItsScaleIntoAnFp8Query) {
  // Attention uses to_q's weight directly (the 1/sqrt(d) scale folded in); on
  // an fp8 to_q it gives what it gives on the decoded weights.
  torch::manual_seed(5);
  auto options = sn::AttentionOptions(16, 2, 8);
  sn::Attention fp8(options), ref(options);
  {
    torch::NoGradGuard no_grad;
    for (const char* name : {"to_q", "to_k", "to_v", "to_out"}) {
      auto src = fp8->named_modules()[name];
      auto dst = ref->named_modules()[name];
      for (const auto& p : src->named_parameters()) dst->named_parameters()[p.key()].copy_(p.value());
    }
    auto* q = fp8->named_modules()["to_q"]->as<sn::LinearImpl>();
    ref->named_modules()["to_q"]->as<sn::LinearImpl>()->weight.copy_(
        pack(q->weight, q->weight_fp8, {Fp8Format::e4m3fn, 32.0}));
  }
  at::Tensor x = torch::randn({2, 5, 16});
  EXPECT_TRUE(torch::allclose(fp8(x), ref(x), 1e-5, 1e-5));
}
