#include <gtest/gtest.h>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/nn/layers.h"

namespace sn = shoestring::nn;

TEST(Layers, MetaBuildHasShapesButNoStorage) {
  sn::Linear lin(1280, 5120, true, sn::LayerInit{torch::kMeta});
  EXPECT_TRUE(lin->weight.is_meta());
  EXPECT_EQ(lin->weight.sizes(), (std::vector<int64_t>{5120, 1280}));
  EXPECT_EQ(sn::parameter_count(*lin), 1280 * 5120 + 5120);
  sn::Conv2d conv(320, 640, 3, 1, 1, true, sn::LayerInit{torch::kMeta});
  EXPECT_TRUE(conv->weight.is_meta());
  EXPECT_EQ(sn::parameter_count(*conv), 640 * 320 * 9 + 640);
  auto named = conv->named_parameters();
  EXPECT_TRUE(named.contains("weight"));
  EXPECT_TRUE(named.contains("bias"));
}

TEST(Layers, MatchTorchFunctionalAndDefaultInitBounds) {
  torch::manual_seed(0);
  sn::Linear lin(16, 8);
  EXPECT_LE(lin->weight.abs().max().item<float>(), 0.25f);  // 1/sqrt(16)
  torch::Tensor x = torch::randn({3, 16});
  EXPECT_TRUE(torch::allclose(lin(x), torch::matmul(x, lin->weight.t()) + lin->bias));
  sn::GroupNorm gn(4, 8);
  torch::Tensor img = torch::randn({2, 8, 5, 5});
  torch::Tensor g = img.view({2, 4, -1});
  torch::Tensor ref = ((g - g.mean(-1, true)) / torch::sqrt(g.var(-1, false, true) + 1e-5)).view_as(img);
  EXPECT_TRUE(torch::allclose(gn(img), ref, 1e-4, 1e-5));
  // bf16 input: fp32 math, bf16 output.
  EXPECT_EQ(gn(img.to(torch::kBFloat16)).scalar_type(), torch::kBFloat16);
  sn::RMSNorm rms(8);
  torch::Tensor v = torch::randn({4, 8});
  EXPECT_TRUE(torch::allclose(rms(v), v / torch::sqrt(v.pow(2).mean(-1, true) + 1e-6), 1e-5, 1e-6));
}

// A channels-last input is normalised in NCHW layout (the faster kernels)
// and comes back channels-last: values and gradients as libtorch's own
// group_norm on the contiguous tensor, in fp32 and for bf16 inputs.
TEST(Layers, GroupNormOfAChannelsLastInputKeepsItsLayoutAndValues) {
  torch::manual_seed(3);
  sn::GroupNorm gn(4, 16);
  {
    torch::NoGradGuard no_grad;
    gn->weight.uniform_(0.5, 1.5);
    gn->bias.uniform_(-0.5, 0.5);
  }
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    const torch::Tensor base = torch::randn({3, 16, 6, 5}).to(dtype);
    const torch::Tensor x_cl = base.contiguous(torch::MemoryFormat::ChannelsLast).requires_grad_(true);
    ASSERT_FALSE(x_cl.is_contiguous());
    const torch::Tensor y = gn(x_cl);
    EXPECT_TRUE(y.is_contiguous(torch::MemoryFormat::ChannelsLast));
    EXPECT_EQ(y.scalar_type(), dtype);
    const torch::Tensor upstream = torch::randn(y.sizes()).to(dtype);
    (y.to(torch::kFloat32) * upstream.to(torch::kFloat32)).sum().backward();

    const torch::Tensor x_ref = base.to(torch::kFloat32).detach().requires_grad_(true);
    const torch::Tensor w = gn->weight.detach().clone().requires_grad_(true);
    const torch::Tensor b = gn->bias.detach().clone().requires_grad_(true);
    const torch::Tensor ref = torch::group_norm(x_ref, 4, w, b, 1e-5);
    (ref.to(dtype).to(torch::kFloat32) * upstream.to(torch::kFloat32)).sum().backward();
    // Same fp32 math in both; the only rounding is to the output dtype.
    EXPECT_TRUE(torch::equal(y.contiguous(), ref.to(dtype))) << c10::toString(dtype);
    const double tol = dtype == torch::kFloat32 ? 1e-5 : 1e-2;
    EXPECT_TRUE(torch::allclose(x_cl.grad().to(torch::kFloat32), x_ref.grad().to(dtype).to(torch::kFloat32), tol, tol))
        << c10::toString(dtype);
    EXPECT_TRUE(torch::allclose(gn->weight.grad(), w.grad(), 1e-4, 1e-5)) << c10::toString(dtype);
    gn->weight.mutable_grad().reset();
    gn->bias.mutable_grad().reset();
  }
}

TEST(Layers, BadSizesAndInputsAreErrors) {
  EXPECT_THROW(sn::Linear(0, 4), shoestring::Error);
  EXPECT_THROW(sn::GroupNorm(3, 8), shoestring::Error);
  sn::Conv2d conv(4, 4, 3, 1, 1);
  EXPECT_THROW(conv(torch::zeros({1, 3, 8, 8})), shoestring::Error);
  sn::Embedding emb(10, 4);
  EXPECT_THROW(emb(torch::tensor({10}, torch::kLong)), shoestring::Error);
}
