// Attention against a naive per-element reference, and GQA identities.
#include <cmath>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/nn/attention.h"

using namespace shoestring;

namespace {

// Explicit-loop multi-head attention in double precision. Query head h uses
// key/value head h / (heads / kv_heads). mask: [B, Lk] bool (true = keep).
torch::Tensor naive_attention(nn::AttentionImpl& m, const torch::Tensor& x, const torch::Tensor& ctx,
                              const torch::Tensor& mask) {
  const auto& o = m.options();
  auto xd = x.to(torch::kDouble), cd = ctx.to(torch::kDouble);
  auto q = torch::matmul(xd, m.to_q->weight.to(torch::kDouble).t());
  auto k = torch::matmul(cd, m.to_k->weight.to(torch::kDouble).t());
  auto v = torch::matmul(cd, m.to_v->weight.to(torch::kDouble).t());
  const int64_t B = x.size(0), Lq = x.size(1), Lk = ctx.size(1), H = o.heads(), d = o.head_dim();
  const int64_t G = H / o.num_kv_heads();
  auto out = torch::zeros({B, Lq, H * d}, torch::kDouble);
  auto qa = q.accessor<double, 3>(), ka = k.accessor<double, 3>(), va = v.accessor<double, 3>();
  auto oa = out.accessor<double, 3>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / G;
      for (int64_t i = 0; i < Lq; ++i) {
        std::vector<double> s(Lk, -INFINITY);
        double mx = -INFINITY;
        for (int64_t j = 0; j < Lk; ++j) {
          if (mask.defined() && !mask[b][j].item<bool>()) continue;
          double acc = 0;
          for (int64_t c = 0; c < d; ++c) acc += qa[b][i][h * d + c] * ka[b][j][g * d + c];
          s[j] = acc / std::sqrt(static_cast<double>(d));
          mx = std::max(mx, s[j]);
        }
        double z = 0;
        for (int64_t j = 0; j < Lk; ++j) z += std::exp(s[j] - mx);
        for (int64_t j = 0; j < Lk; ++j) {
          const double p = std::exp(s[j] - mx) / z;
          for (int64_t c = 0; c < d; ++c) oa[b][i][h * d + c] += p * va[b][j][g * d + c];
        }
      }
    }
  }
  return torch::matmul(out, m.to_out->weight.to(torch::kDouble).t()) + m.to_out->bias.to(torch::kDouble);
}

}  // namespace

TEST(Attention, CrossAttentionWithMaskMatchesNaiveLoops) {
  torch::manual_seed(0);
  nn::Attention attn(nn::AttentionOptions(12, 3, 5).context_dim(7));
  auto x = torch::randn({2, 4, 12}), ctx = torch::randn({2, 6, 7});
  auto mask = torch::tensor({1, 1, 1, 0, 1, 0, 1, 0, 0, 0, 0, 0}).to(torch::kBool).view({2, 6});
  torch::NoGradGuard no_grad;
  auto got = attn->forward(x, ctx, mask).to(torch::kDouble);
  auto want = naive_attention(*attn, x, ctx, mask);
  EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-5)) << (got - want).abs().max();
  // The mask matters: without it the result differs.
  auto unmasked = attn->forward(x, ctx).to(torch::kDouble);
  EXPECT_GT((unmasked - want).abs().max().item<double>(), 1e-3);
}

TEST(Attention, GroupedQuerySelfAttentionMatchesNaiveLoops) {
  torch::manual_seed(1);
  nn::Attention attn(nn::AttentionOptions(16, 4, 4).num_kv_heads(2));
  EXPECT_EQ(attn->to_k->weight.size(0), 8);
  auto x = torch::randn({3, 5, 16});
  torch::NoGradGuard no_grad;
  auto got = attn->forward(x).to(torch::kDouble);
  auto want = naive_attention(*attn, x, x, {});
  EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-5)) << (got - want).abs().max();
}

TEST(Attention, KvHeadsEqualToHeadsIsPlainMultiHead) {
  torch::manual_seed(2);
  nn::Attention mha(nn::AttentionOptions(16, 4, 4));
  nn::Attention gqa(nn::AttentionOptions(16, 4, 4).num_kv_heads(4));
  torch::NoGradGuard no_grad;
  for (auto& kv : gqa->named_parameters()) kv.value().copy_(mha->named_parameters()[kv.key()]);
  auto x = torch::randn({2, 6, 16});
  EXPECT_TRUE(torch::equal(mha->forward(x), gqa->forward(x)));
}

TEST(Attention, SingleKvHeadEqualsMultiHeadWithTiledKvWeights) {
  torch::manual_seed(3);
  const int64_t heads = 4, d = 3;
  nn::Attention mqa(nn::AttentionOptions(10, heads, d).context_dim(6).num_kv_heads(1));
  nn::Attention mha(nn::AttentionOptions(10, heads, d).context_dim(6));
  torch::NoGradGuard no_grad;
  mha->to_q->weight.copy_(mqa->to_q->weight);
  mha->to_k->weight.copy_(mqa->to_k->weight.repeat({heads, 1}));  // [d, 6] -> [heads*d, 6]
  mha->to_v->weight.copy_(mqa->to_v->weight.repeat({heads, 1}));
  mha->to_out->weight.copy_(mqa->to_out->weight);
  mha->to_out->bias.copy_(mqa->to_out->bias);
  auto x = torch::randn({2, 5, 10}), ctx = torch::randn({2, 3, 6});
  auto mask = torch::tensor({1, 1, 0, 1, 0, 1}).to(torch::kBool).view({2, 3});
  auto a = mqa->forward(x, ctx, mask), b = mha->forward(x, ctx, mask);
  EXPECT_TRUE(torch::allclose(a, b, 1e-6, 1e-6)) << (a - b).abs().max();
}

TEST(Attention, FullyMaskedRowIsFiniteAndBf16Runs) {
  torch::manual_seed(4);
  nn::Attention attn(nn::AttentionOptions(8, 2, 4).context_dim(8));
  auto x = torch::randn({2, 3, 8}), ctx = torch::randn({2, 4, 8});
  auto mask = torch::zeros({2, 4}, torch::kBool);
  mask[1][0] = true;
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::isfinite(attn->forward(x, ctx, mask)).all().item<bool>());
  auto ref = attn->forward(x, ctx, mask.logical_not());
  attn->to(torch::kBFloat16);
  auto out = attn->forward(x.to(torch::kBFloat16), ctx.to(torch::kBFloat16), mask.logical_not());
  EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::allclose(out.to(torch::kFloat32), ref, 5e-2, 5e-2)) << (out.to(torch::kFloat32) - ref).abs().max();
}

TEST(Attention, RejectsBadShapesAndOptions) {
  EXPECT_THROW(nn::Attention(nn::AttentionOptions(8, 4, 2).num_kv_heads(3)), Error);
  nn::Attention attn(nn::AttentionOptions(8, 2, 4));
  EXPECT_THROW(attn->forward(torch::randn({2, 3, 7})), Error);
  EXPECT_THROW(attn->forward(torch::randn({2, 3, 8}), {}, torch::ones({2, 4}, torch::kBool)), Error);
  EXPECT_THROW(attn->forward(torch::randn({2, 3, 8}), {}, torch::ones({2, 3}, torch::kFloat32)), Error);
}
