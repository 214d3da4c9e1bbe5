// nn blocks against PyTorch reference vectors (scripts/gen_nn_reference.py).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "reference_data.h"
#include "shoestring/nn/attention.h"
#include "shoestring/nn/resblock.h"
#include "shoestring/nn/timestep.h"
#include "shoestring/nn/transformer.h"

using namespace shoestring;
using shoestring::testing::load_params;
using shoestring::testing::load_reference;

namespace {
void expect_close(const torch::Tensor& got, const torch::Tensor& want, double atol = 1e-5, double rtol = 1e-5) {
  ASSERT_EQ(got.sizes(), want.sizes());
  const double err = (got - want).abs().max().item<double>();
  EXPECT_TRUE(torch::allclose(got, want, rtol, atol)) << "max abs error " << err;
}
}  // namespace

TEST(NnReference, ResBlockMatchesPyTorch) {
  auto ref = load_reference("resblock");
  nn::ResBlock block(nn::ResBlockOptions(8, 16, 12).groups(4));
  load_params(*block, ref);
  torch::NoGradGuard no_grad;
  expect_close(block->forward(ref.at("input.x"), ref.at("input.temb")), ref.at("output"));
}

TEST(NnReference, ScaleShiftResBlockMatchesGuidedDiffusionFormula) {
  auto ref = load_reference("resblock_scale_shift");
  nn::ResBlock block(nn::ResBlockOptions(8, 16, 12).groups(4).scale_shift(true));
  ASSERT_EQ(block->time_emb_proj->weight.size(0), 32);  // [scale, shift]
  load_params(*block, ref);
  torch::NoGradGuard no_grad;
  expect_close(block->forward(ref.at("input.x"), ref.at("input.temb")), ref.at("output"));
}

TEST(NnReference, GroupedQueryAttentionWithMaskMatchesPyTorch) {
  auto ref = load_reference("attention_gqa");
  nn::Attention attn(nn::AttentionOptions(16, 4, 4).context_dim(12).num_kv_heads(2));
  load_params(*attn, ref);
  torch::NoGradGuard no_grad;
  auto mask = ref.at("input.mask").to(torch::kBool);
  expect_close(attn->forward(ref.at("input.x"), ref.at("input.context"), mask), ref.at("output"));
}

TEST(NnReference, SpatialTransformerMatchesPyTorch) {
  auto ref = load_reference("spatial_transformer");
  nn::SpatialTransformer st(nn::TransformerOptions(16, 2, 8).context_dim(12).groups(4));
  load_params(*st, ref);
  torch::NoGradGuard no_grad;
  auto mask = ref.at("input.mask").to(torch::kBool);
  expect_close(st->forward(ref.at("input.x"), ref.at("input.context"), mask), ref.at("output"));
}

TEST(NnReference, TimestepEmbeddingMatchesLdm) {
  auto ref = load_reference("timestep_embedding");
  // cos/sin of arguments up to 999 rad: allow a few fp32 ulps of the argument.
  expect_close(nn::timestep_embedding(ref.at("input.t"), 8), ref.at("output.dim8"), 1e-4, 0);
  expect_close(nn::timestep_embedding(ref.at("input.t"), 7), ref.at("output.dim7"), 1e-4, 0);
}
