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

TEST(Layers, BadSizesAndInputsAreErrors) {
  EXPECT_THROW(sn::Linear(0, 4), shoestring::Error);
  EXPECT_THROW(sn::GroupNorm(3, 8), shoestring::Error);
  sn::Conv2d conv(4, 4, 3, 1, 1);
  EXPECT_THROW(conv(torch::zeros({1, 3, 8, 8})), shoestring::Error);
  sn::Embedding emb(10, 4);
  EXPECT_THROW(emb(torch::tensor({10}, torch::kLong)), shoestring::Error);
}
