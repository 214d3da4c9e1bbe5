// TinyUNet: shapes, names, size, zero-init output, bf16, checkpointing.
#include <chrono>
#include <cstdlib>
#include <unordered_set>

#include <gtest/gtest.h>

#include <torch/torch.h>
#include "../nn/graph_testing.h"

#include "model_testing.h"
#include "shoestring/core/error.h"
#include "shoestring/models/tiny_unet.h"

using namespace shoestring;
using models::TinyUNet;
using models::TinyUNetOptions;

namespace {

TinyUNetOptions small_options() { return shoestring::testing::small_tiny_unet_options(); }

// Replaces the zero-initialised convs so that every parameter gets a gradient.
void perturb_parameters(torch::nn::Module& m, uint64_t seed) {
  torch::manual_seed(seed);
  torch::NoGradGuard no_grad;
  for (auto& p : m.parameters()) p.add_(torch::randn_like(p) * 0.05);
}

struct Inputs {
  torch::Tensor x, t, ctx, mask;
};

Inputs make_inputs(const TinyUNetOptions& o, int64_t B, int64_t H, torch::ScalarType dtype = torch::kFloat32) {
  torch::manual_seed(42);
  Inputs in;
  in.x = torch::randn({B, o.in_channels(), H, H}).to(dtype);
  in.t = torch::rand({B});
  in.ctx = torch::randn({B, 5, o.context_dim()}).to(dtype);
  in.mask = torch::ones({B, 5}, torch::kBool);
  in.mask.slice(1, 3) = false;  // two padded tokens per row
  return in;
}

using shoestring::testing::count_graph_nodes;

}  // namespace

TEST(TinyUNet, OutputShapeAndParameterNames) {
  TinyUNet net(small_options().out_channels(4));
  auto in = make_inputs(net->options(), 2, 16);
  auto out = net->forward(in.x, in.t, in.ctx, in.mask);
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{2, 4, 16, 16}));
  auto params = net->named_parameters();
  for (const char* key :
       {"time_embed.linear_1.weight", "time_embed.linear_2.bias", "conv_in.weight", "down.0.res.0.norm1.weight",
        "down.0.downsample.weight", "down.1.res.0.conv_shortcut.weight", "down.1.attn.0.proj_in.weight",
        "down.1.attn.0.blocks.0.attn2.to_k.weight", "down.1.attn.0.blocks.0.ff.proj.weight",
        "mid.res1.time_emb_proj.weight", "mid.attn.blocks.0.attn1.to_q.weight", "mid.res2.conv2.bias",
        "up.1.res.1.norm1.weight", "up.1.attn.1.proj_out.weight", "up.1.upsample.weight",
        "up.0.res.0.conv_shortcut.weight", "norm_out.weight", "conv_out.weight"}) {
    EXPECT_TRUE(params.contains(key)) << key;
  }
  EXPECT_FALSE(params.contains("up.0.upsample.weight"));
  EXPECT_FALSE(params.contains("down.1.downsample.weight"));
  EXPECT_FALSE(params.contains("down.0.attn.0.proj_in.weight"));
}

TEST(TinyUNet, DefaultsHaveTenToFortyMillionParameters) {
  TinyUNet net;
  const int64_t n = net->parameter_count();
  int64_t sum = 0;
  for (const auto& p : net->parameters()) sum += p.numel();
  EXPECT_EQ(n, sum);
  EXPECT_GE(n, 10'000'000);
  EXPECT_LE(n, 40'000'000);
  std::printf("TinyUNet defaults: %lld parameters\n", static_cast<long long>(n));
}

TEST(TinyUNet, ZeroInitialisedOutputConvGivesExactlyZero) {
  TinyUNet net(small_options());
  auto in = make_inputs(net->options(), 2, 8);
  auto out = net->forward(in.x, in.t, in.ctx, in.mask);
  EXPECT_TRUE(torch::equal(out, torch::zeros_like(out)));
}

TEST(TinyUNet, DefaultsRunInBf16At32x32) {
  TinyUNet net;
  perturb_parameters(*net, 1);
  net->to(torch::kBFloat16);
  for (const auto& p : net->parameters()) ASSERT_EQ(p.scalar_type(), torch::kBFloat16);
  auto in = make_inputs(net->options(), 2, 32, torch::kBFloat16);
  torch::NoGradGuard no_grad;
  auto out = net->forward(in.x, in.t, in.ctx, in.mask);
  EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{2, 3, 32, 32}));
  EXPECT_TRUE(torch::isfinite(out).all().item<bool>());
  EXPECT_GT(out.abs().max().item<float>(), 0.0f);
}

TEST(TinyUNet, Bf16ForwardTracksFp32) {
  TinyUNet net(small_options());
  perturb_parameters(*net, 2);
  auto in = make_inputs(net->options(), 2, 16);
  torch::NoGradGuard no_grad;
  auto ref = net->forward(in.x, in.t, in.ctx, in.mask);
  net->to(torch::kBFloat16);
  auto out = net->forward(in.x.to(torch::kBFloat16), in.t, in.ctx.to(torch::kBFloat16), in.mask).to(torch::kFloat32);
  const double rel = ((out - ref).norm() / ref.norm()).item<double>();
  EXPECT_LT(rel, 0.03) << "relative L2 error of bf16 vs fp32";
  std::printf("bf16 vs fp32 relative L2 error %g\n", rel);
}

TEST(TinyUNet, ChannelsLastMatchesContiguousLayout) {
  TinyUNet cl(small_options()), nchw(small_options().channels_last(false));
  perturb_parameters(*cl, 6);
  torch::NoGradGuard no_grad;
  for (auto& kv : nchw->named_parameters()) kv.value().copy_(cl->named_parameters()[kv.key()]);
  auto in = make_inputs(cl->options(), 2, 8);
  auto a = cl->forward(in.x, in.t, in.ctx, in.mask), b = nchw->forward(in.x, in.t, in.ctx, in.mask);
  EXPECT_TRUE(a.is_contiguous());
  EXPECT_TRUE(torch::allclose(a, b, 1e-4, 1e-5)) << (a - b).abs().max();
}

TEST(TinyUNet, ContextMaskHidesPaddedTokens) {
  TinyUNet net(small_options());
  perturb_parameters(*net, 3);
  auto in = make_inputs(net->options(), 2, 8);
  torch::NoGradGuard no_grad;
  auto out = net->forward(in.x, in.t, in.ctx, in.mask);
  auto ctx2 = in.ctx.clone();
  ctx2.slice(1, 3) = torch::randn({2, 2, 12}) * 10;  // change only the padded tokens
  EXPECT_TRUE(torch::allclose(out, net->forward(in.x, in.t, ctx2, in.mask), 1e-5, 1e-6));
  EXPECT_FALSE(torch::allclose(out, net->forward(in.x, in.t, ctx2, torch::Tensor()), 1e-3, 1e-4));
}

// pooled_context adds text_embed(masked mean of the context) to the timestep
// embedding. For one image that is the same as a model without the option
// whose time_embed.linear_2 bias is shifted by W * mean + b: the reference.
TEST(TinyUNet, PooledContextAddsProjectedMaskedMeanToTimeEmbedding) {
  TinyUNet pooled(small_options().pooled_context(true));
  TinyUNet plain(small_options());
  perturb_parameters(*pooled, 5);
  {
    torch::NoGradGuard no_grad;
    auto src = pooled->named_parameters();
    for (auto& p : plain->named_parameters()) p.value().copy_(src[p.key()]);
    EXPECT_EQ(src.size(), plain->named_parameters().size() + 2);  // text_embed.weight, .bias
  }
  auto in = make_inputs(pooled->options(), 1, 8);
  torch::NoGradGuard no_grad;
  const torch::Tensor mean = in.ctx.slice(1, 0, 3).mean(1);  // the 3 real tokens: [1, 12]
  const torch::Tensor shift = (mean.matmul(pooled->text_embed->weight.t()) + pooled->text_embed->bias).squeeze(0);
  plain->time_embed->linear_2->bias.add_(shift);
  const torch::Tensor got = pooled->forward(in.x, in.t, in.ctx, in.mask);
  EXPECT_TRUE(torch::allclose(got, plain->forward(in.x, in.t, in.ctx, in.mask), 1e-5, 1e-6));
}

namespace {
struct UNetGrads {
  torch::Tensor out, x_grad, ctx_grad;
  std::vector<torch::Tensor> grads;
};

UNetGrads train_step(TinyUNet& net, bool checkpointing) {
  net->train();
  shoestring::testing::checkpoint_by_rule(*net, checkpointing);
  net->zero_grad();
  auto in = make_inputs(net->options(), 2, 8);
  in.x.requires_grad_(true);
  in.ctx.requires_grad_(true);
  torch::manual_seed(7);  // dropout masks
  auto out = net->forward(in.x, in.t, in.ctx, in.mask);
  out.pow(2).mean().backward();
  UNetGrads g{out.detach(), in.x.grad(), in.ctx.grad(), {}};
  for (const auto& p : net->parameters()) g.grads.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  return g;
}

void expect_same_grads(TinyUNet& net, const UNetGrads& a, const UNetGrads& b) {
  EXPECT_TRUE(torch::equal(a.out, b.out));
  EXPECT_TRUE(torch::equal(a.x_grad, b.x_grad));
  EXPECT_TRUE(torch::equal(a.ctx_grad, b.ctx_grad));
  auto names = net->named_parameters().keys();
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) {
    ASSERT_TRUE(a.grads[i].defined() && b.grads[i].defined()) << names[i];
    EXPECT_TRUE(torch::equal(a.grads[i], b.grads[i])) << names[i];
  }
}
}  // namespace

TEST(TinyUNet, CheckpointingGivesBitwiseEqualGradients) {
  TinyUNet net(small_options());
  perturb_parameters(*net, 4);
  auto plain = train_step(net, false);
  auto ck = train_step(net, true);
  expect_same_grads(net, plain, ck);
  EXPECT_GT(plain.grads[0].abs().sum().item<double>(), 0.0);
}

TEST(TinyUNet, CheckpointingWithDropoutGivesBitwiseEqualGradients) {
  TinyUNet net(small_options().dropout(0.2));
  perturb_parameters(*net, 5);
  auto plain = train_step(net, false);
  auto ck = train_step(net, true);
  expect_same_grads(net, plain, ck);
  // Dropout is active in training: evaluation mode gives another output.
  net->eval();
  auto in = make_inputs(net->options(), 2, 8);
  torch::NoGradGuard no_grad;
  EXPECT_FALSE(torch::equal(plain.out, net->forward(in.x, in.t, in.ctx, in.mask)));
}

TEST(TinyUNet, CheckpointingKeepsFewerGraphNodes) {
  TinyUNet net(small_options());
  net->train();
  auto in = make_inputs(net->options(), 1, 8);
  in.x.requires_grad_(true);
  shoestring::testing::checkpoint_by_rule(*net, false);
  const size_t plain = count_graph_nodes(net->forward(in.x, in.t, in.ctx, in.mask));
  shoestring::testing::checkpoint_by_rule(*net, true);
  const size_t ck = count_graph_nodes(net->forward(in.x, in.t, in.ctx, in.mask));
  EXPECT_LT(ck * 4, plain) << "plain " << plain << " nodes, checkpointed " << ck;
  // Evaluation mode ignores the rule.
  net->eval();
  EXPECT_EQ(count_graph_nodes(net->forward(in.x, in.t, in.ctx, in.mask)), plain);
}

TEST(TinyUNet, RejectsBadInputsAndOptions) {
  EXPECT_THROW(TinyUNet(small_options().attention_levels({2})), Error);
  EXPECT_THROW(TinyUNet(small_options().channel_mult({})), Error);
  EXPECT_THROW(TinyUNet(small_options().num_heads(3)), Error);
  TinyUNet net(small_options());
  auto in = make_inputs(net->options(), 2, 8);
  EXPECT_THROW(net->forward(in.x.slice(2, 0, 7).slice(3, 0, 7), in.t, in.ctx, in.mask), Error);  // odd size
  EXPECT_THROW(net->forward(in.x.slice(1, 0, 2), in.t, in.ctx, in.mask), Error);
  EXPECT_THROW(net->forward(in.x, in.t.slice(0, 0, 1), in.ctx, in.mask), Error);
  EXPECT_THROW(net->forward(in.x, in.t, in.ctx.slice(2, 0, 4), in.mask), Error);
  EXPECT_THROW(net->forward(in.x, in.t, in.ctx, in.mask.to(torch::kFloat32)), Error);
  EXPECT_THROW(net->forward(in.x.to(torch::kBFloat16), in.t, in.ctx, in.mask), Error);
}

// Timing for the emoji example's default model; run with
// --gtest_also_run_disabled_tests --gtest_filter='*Timing*' on a quiet machine
// (OpenMP threads stall badly when another process holds a core).
// SHOESTRING_BENCH_THREADS=n sets the thread count (default: test_main's 2).
TEST(TinyUNet, DISABLED_ForwardBackwardTiming) {
  if (const char* n = std::getenv("SHOESTRING_BENCH_THREADS")) torch::set_num_threads(std::atoi(n));
  for (auto dtype : {torch::kBFloat16, torch::kFloat32}) {
    for (bool ckpt : {false, true}) {
      if (dtype == torch::kFloat32 && ckpt) continue;  // fp32 is slow; one run tells enough
      TinyUNet net;
      net->to(dtype);
      net->train();
      shoestring::testing::checkpoint_by_rule(*net, ckpt);
      auto in = make_inputs(net->options(), 32, 32, dtype);
      in.ctx = torch::randn({32, 16, 256}).to(dtype);
      in.mask = torch::ones({32, 16}, torch::kBool);
      double best = 1e9;
      const int iters = dtype == torch::kFloat32 ? 2 : 4;
      for (int it = 0; it < iters; ++it) {
        const auto t0 = std::chrono::steady_clock::now();
        net->zero_grad();
        net->forward(in.x, in.t, in.ctx, in.mask).pow(2).mean().backward();
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (it > 0) best = std::min(best, s);
      }
      std::printf("TinyUNet defaults, batch 32 @ 32x32, %s, checkpointing %s: forward+backward %.3f s (%d threads)\n",
                  c10::toString(dtype), ckpt ? "on" : "off", best, torch::get_num_threads());
    }
  }
}
