// Chunked (query-blocked) attention against the plain formula: forward and
// gradients in fp32 and bf16, with key masks (including a fully masked row),
// grouped-query layout, block sizes that do and do not divide the rows; and
// its memory: backward never holds a full score matrix.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/nn/attention.h"
#include "shoestring/nn/chunked_attention.h"

using namespace shoestring;

namespace {

struct Grads {
  torch::Tensor out, dq, dk, dv;
};

// Runs attention (plain when block == 0) and backpropagates a fixed random
// upstream gradient; returns the output and the input gradients.
Grads run(const torch::Tensor& q0, const torch::Tensor& k0, const torch::Tensor& v0, const torch::Tensor& mask,
          int64_t block, const torch::Tensor& upstream) {
  auto q = q0.detach().clone().requires_grad_(true);
  auto k = k0.detach().clone().requires_grad_(true);
  auto v = v0.detach().clone().requires_grad_(true);
  torch::Tensor out = block == 0 ? nn::plain_attention(q, k, v, mask) : nn::chunked_attention(q, k, v, mask, block);
  (out * upstream.to(out.scalar_type())).sum().backward();
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

void expect_close(const torch::Tensor& a, const torch::Tensor& b, double atol, double rtol, const char* what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  const double err = (a.to(torch::kDouble) - b.to(torch::kDouble)).abs().max().item<double>();
  const double scale = b.to(torch::kDouble).abs().max().item<double>();
  EXPECT_LE(err, atol + rtol * scale) << what << ": max abs error " << err << " (scale " << scale << ")";
}

}  // namespace

TEST(ChunkedAttention, MatchesPlainForwardAndGradientsFp32) {
  torch::manual_seed(0);
  const int64_t B = 2, Hkv = 2, G = 3, Lq = 19, Lk = 23, d = 8;  // GQA: 6 query heads over 2 kv heads
  auto q = torch::randn({B, Hkv, G * Lq, d}) * 0.7;
  auto k = torch::randn({B, Hkv, Lk, d});
  auto v = torch::randn({B, Hkv, Lk, d});
  auto mask = torch::rand({B, Lk}) > 0.3;
  mask[1].fill_(false);  // batch row 1: every key masked -> uniform attention
  auto up = torch::randn({B, Hkv, G * Lq, d});
  for (bool with_mask : {false, true}) {
    torch::Tensor m = with_mask ? mask : torch::Tensor();
    Grads ref = run(q, k, v, m, 0, up);
    for (int64_t block : std::vector<int64_t>{1, 5, 16, G * Lq, 1000}) {
      SCOPED_TRACE("block " + std::to_string(block) + (with_mask ? " masked" : ""));
      Grads got = run(q, k, v, m, block, up);
      expect_close(got.out, ref.out, 1e-6, 1e-5, "out");
      expect_close(got.dq, ref.dq, 1e-6, 1e-5, "dq");
      expect_close(got.dk, ref.dk, 1e-6, 1e-5, "dk");
      expect_close(got.dv, ref.dv, 1e-6, 1e-5, "dv");
    }
  }
}

TEST(ChunkedAttention, MatchesDoublePrecisionFormula) {
  // Independent of the plain path: the textbook formula in double.
  torch::manual_seed(1);
  auto q = torch::randn({1, 2, 12, 4});
  auto k = torch::randn({1, 2, 9, 4});
  auto v = torch::randn({1, 2, 9, 4});
  auto expected =
      torch::matmul(torch::softmax(torch::matmul(q.to(torch::kDouble), k.to(torch::kDouble).transpose(-1, -2)), -1),
                    v.to(torch::kDouble));
  expect_close(nn::chunked_attention(q, k, v, {}, 5), expected, 1e-6, 1e-6, "out vs double");
}

TEST(ChunkedAttention, MatchesPlainInBf16) {
  torch::manual_seed(2);
  auto q = torch::randn({2, 4, 32, 16}).to(torch::kBFloat16);
  auto k = torch::randn({2, 4, 32, 16}).to(torch::kBFloat16);
  auto v = torch::randn({2, 4, 32, 16}).to(torch::kBFloat16);
  auto up = torch::randn({2, 4, 32, 16});
  Grads ref = run(q, k, v, {}, 0, up);
  Grads got = run(q, k, v, {}, 8, up);
  EXPECT_TRUE(torch::equal(got.out, ref.out));  // same ops row by row
  expect_close(got.dq, ref.dq, 0.05, 0.02, "dq bf16");
  expect_close(got.dk, ref.dk, 0.05, 0.02, "dk bf16");
  expect_close(got.dv, ref.dv, 0.05, 0.02, "dv bf16");
}

TEST(ChunkedAttention, ThresholdChoosesBlocks) {
  // 2 x 4 x 64 rows x 64 keys x 4 bytes = 128 KiB of scores.
  EXPECT_EQ(nn::attention_block_rows(2, 4, 64, 64, 4, 128 << 10), 0);  // fits
  EXPECT_EQ(nn::attention_block_rows(2, 4, 64, 64, 4, 0), 0);          // disabled
  EXPECT_EQ(nn::attention_block_rows(2, 4, 64, 64, 4, 32 << 10), 16);  // a quarter per block
  EXPECT_EQ(nn::attention_block_rows(2, 4, 64, 64, 4, 1), 1);          // at least one row
  EXPECT_THROW(nn::set_attention_chunk_bytes(-1), Error);
}

TEST(ChunkedAttention, AttentionModuleSameWithAndWithoutChunking) {
  torch::manual_seed(3);
  nn::Attention attn(nn::AttentionOptions(32, 4, 8).num_kv_heads(2).context_dim(24));
  auto x = torch::randn({2, 40, 32});
  auto ctx = torch::randn({2, 7, 24});
  auto mask = torch::tensor({1, 1, 1, 0, 1, 0, 0, 1, 1, 1, 1, 1, 0, 0}, torch::kBool).view({2, 7});
  const int64_t saved = nn::attention_chunk_bytes();
  auto run_module = [&](int64_t chunk) {
    nn::set_attention_chunk_bytes(chunk);
    attn->zero_grad();
    auto xi = x.clone().requires_grad_(true);
    auto y = attn->forward(xi, ctx, mask);
    y.pow(2).sum().backward();
    return std::make_pair(y.detach(), xi.grad().clone());
  };
  auto plain = run_module(0);
  auto plain_wq = attn->to_q->weight.grad().clone();
  auto chunked = run_module(256);  // 2*2*80*7*4 bytes of scores > 256: blocks of ~2 rows
  nn::set_attention_chunk_bytes(saved);
  expect_close(chunked.first, plain.first, 1e-6, 1e-5, "module out");
  expect_close(chunked.second, plain.second, 1e-6, 1e-5, "module dx");
  expect_close(attn->to_q->weight.grad(), plain_wq, 1e-6, 1e-5, "module dWq");
}

TEST(ChunkedAttention, BackwardNeverHoldsTheScoreMatrix) {
  auto& ledger = MemoryLedger::global();
  ledger.install();
  torch::manual_seed(4);
  const int64_t B = 1, H = 2, L = 512, d = 16;
  const int64_t score_bytes = B * H * L * L * 4;  // 2 MiB
  auto q = torch::randn({B, H, L, d}).requires_grad_(true);
  auto k = torch::randn({B, H, L, d}).requires_grad_(true);
  auto v = torch::randn({B, H, L, d}).requires_grad_(true);
  auto measure = [&](int64_t block) {
    ScopedMemoryCategory cat(MemoryCategory::temporaries);
    const int64_t base = ledger.current_total();
    ledger.reset_peaks();
    auto out = block == 0 ? nn::plain_attention(q, k, v) : nn::chunked_attention(q, k, v, {}, block);
    const int64_t kept = ledger.current_total() - base;  // what forward keeps for backward (+ output)
    out.sum().backward();
    const int64_t peak = ledger.peak_total() - base;
    q.mutable_grad().reset();
    k.mutable_grad().reset();
    v.mutable_grad().reset();
    return std::make_pair(kept, peak);
  };
  auto plain = measure(0);
  auto chunked = measure(32);                 // blocks of 32 rows: 1/16 of the scores
  EXPECT_GT(plain.first, score_bytes);        // plain keeps the probabilities
  EXPECT_LT(chunked.first, score_bytes / 8);  // chunked keeps q, k, v, out only
  EXPECT_GT(plain.second, 2 * score_bytes);
  EXPECT_LT(chunked.second, score_bytes / 2);
}
