// CaptionEncoder: shapes, mask, padding invariance, an independent re-computation.
#include <cmath>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/models/caption_encoder.h"

using namespace shoestring;
using models::CaptionEncoder;
using models::CaptionEncoderOptions;

namespace {

CaptionEncoderOptions small() { return CaptionEncoderOptions(50).max_length(8).dim(16).layers(2).heads(4); }

// The encoder written out with plain tensor ops from its parameters: pre-norm
// layers with -inf key masking and a GELU MLP.
torch::Tensor manual_encode(CaptionEncoder& enc, const torch::Tensor& tokens) {
  auto p = enc->named_parameters();
  const int64_t dim = enc->options().dim(), heads = enc->options().heads(), d = dim / heads;
  const int64_t B = tokens.size(0), L = tokens.size(1);
  auto ln = [&](const torch::Tensor& x, const std::string& name) {
    return torch::layer_norm(x, {dim}, p[name + ".weight"], p[name + ".bias"], 1e-5);
  };
  auto lin = [&](const torch::Tensor& x, const std::string& name, bool bias = true) {
    return torch::linear(x, p[name + ".weight"], bias ? p[name + ".bias"] : torch::Tensor());
  };
  auto h = p["token_embedding.weight"].index_select(0, tokens.flatten()).view({B, L, dim}) +
           p["position_embedding"].slice(0, 0, L);
  auto keep = tokens.ne(0).view({B, 1, 1, L});
  for (int64_t i = 0; i < enc->options().layers(); ++i) {
    const std::string pre = "layers." + std::to_string(i);
    auto x = ln(h, pre + ".norm1");
    auto split = [&](const torch::Tensor& t) { return t.view({B, L, heads, d}).permute({0, 2, 1, 3}); };
    auto q = split(lin(x, pre + ".attn.to_q", false)), k = split(lin(x, pre + ".attn.to_k", false));
    auto v = split(lin(x, pre + ".attn.to_v", false));
    auto s = torch::matmul(q, k.transpose(-1, -2)) / std::sqrt(static_cast<double>(d));
    s = s.masked_fill(keep.logical_not(), -INFINITY);
    auto a = torch::matmul(s.softmax(-1), v).permute({0, 2, 1, 3}).reshape({B, L, dim});
    h = h + lin(a, pre + ".attn.to_out");
    h = h + lin(torch::gelu(lin(ln(h, pre + ".norm2"), pre + ".mlp.proj")), pre + ".mlp.out");
  }
  return ln(h, "final_norm");
}

}  // namespace

TEST(CaptionEncoder, ShapesMaskAndNames) {
  torch::manual_seed(0);
  CaptionEncoder enc(small());
  auto tokens = torch::tensor({2, 7, 9, 0, 0, 2, 4, 4, 4, 1}, torch::kInt64).view({2, 5});
  auto out = enc->forward(tokens);
  EXPECT_EQ(out.hidden.sizes(), (std::vector<int64_t>{2, 5, 16}));
  EXPECT_TRUE(torch::equal(out.mask, tokens.ne(0)));
  auto params = enc->named_parameters();
  for (const char* key :
       {"token_embedding.weight", "position_embedding", "layers.1.norm1.weight", "layers.0.attn.to_q.weight",
        "layers.0.attn.to_out.bias", "layers.1.mlp.proj.weight", "layers.1.mlp.out.bias", "final_norm.weight"}) {
    EXPECT_TRUE(params.contains(key)) << key;
  }
  EXPECT_EQ(params["position_embedding"].sizes(), (std::vector<int64_t>{8, 16}));
}

TEST(CaptionEncoder, MatchesManualComputation) {
  torch::manual_seed(1);
  CaptionEncoder enc(small());
  {
    torch::NoGradGuard no_grad;  // make LayerNorm affine parameters non-trivial
    for (auto& p : enc->parameters()) p.add_(torch::randn_like(p) * 0.05);
  }
  auto tokens = torch::tensor({2, 7, 9, 0, 0, 0, 2, 4, 4, 4, 1, 3}, torch::kInt64).view({2, 6});
  torch::NoGradGuard no_grad;
  auto got = enc->forward(tokens).hidden;
  auto want = manual_encode(enc, tokens);
  EXPECT_TRUE(torch::allclose(got, want, 1e-5, 1e-5)) << (got - want).abs().max();
}

TEST(CaptionEncoder, RealTokensIgnoreTrailingPadding) {
  torch::manual_seed(2);
  CaptionEncoder enc(small());
  auto long_tokens = torch::tensor({{2, 11, 12, 13, 0, 0, 0, 0}}, torch::kInt64);
  auto short_tokens = long_tokens.slice(1, 0, 4);
  torch::NoGradGuard no_grad;
  auto a = enc->forward(long_tokens).hidden.slice(1, 0, 4);
  auto b = enc->forward(short_tokens).hidden;
  EXPECT_TRUE(torch::allclose(a, b, 1e-5, 1e-6)) << (a - b).abs().max();
}

TEST(CaptionEncoder, RunsInBf16AndBackward) {
  torch::manual_seed(3);
  CaptionEncoder enc(CaptionEncoderOptions(100));  // defaults: dim 256, 2 layers, max_length 16
  auto tokens = torch::randint(1, 100, {4, 16}, torch::kInt64);
  tokens.slice(1, 10) = 0;
  tokens.select(1, 0) = 2;
  auto ref = enc->forward(tokens).hidden.detach();
  enc->forward(tokens).hidden.pow(2).sum().backward();
  EXPECT_TRUE(enc->position_embedding.grad().defined());
  EXPECT_GT(enc->layers[0]->as<models::CaptionEncoderLayerImpl>()->attn->to_q->weight.grad().abs().sum().item<float>(),
            0.0f);
  enc->to(torch::kBFloat16);
  torch::NoGradGuard no_grad;
  auto out = enc->forward(tokens).hidden;
  EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::isfinite(out).all().item<bool>());
  const double rel = ((out.to(torch::kFloat32) - ref).norm() / ref.norm()).item<double>();
  EXPECT_LT(rel, 0.05);
}

TEST(CaptionEncoder, RejectsBadTokens) {
  CaptionEncoder enc(small());
  EXPECT_THROW(enc->forward(torch::zeros({2, 9}, torch::kInt64)), Error);     // longer than max_length
  EXPECT_THROW(enc->forward(torch::zeros({2, 4}, torch::kInt32)), Error);     // dtype
  EXPECT_THROW(enc->forward(torch::zeros({4}, torch::kInt64)), Error);        // rank
  EXPECT_THROW(enc->forward(torch::full({1, 3}, 50, torch::kInt64)), Error);  // id out of range
  EXPECT_THROW(enc->forward(torch::full({1, 3}, -1, torch::kInt64)), Error);
  EXPECT_THROW(CaptionEncoder(CaptionEncoderOptions(10).dim(10).heads(4)), Error);
}
