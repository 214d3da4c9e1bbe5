// Fused single-pass optimizer kernels (optim/fused_kernels.h) against the
// libtorch op chains they replace: the same fp32 operations written as tensor
// ops, then stochastic_round_into with the same keys (the reference path of
// AdamW::update and Lion::update). Sizes are not multiples of any vector
// width, so vector tails are covered.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/stochastic_rounding.h"
#include "shoestring/optim/adafactor.h"
#include "shoestring/optim/adamw8bit.h"
#include "shoestring/optim/fused_kernels.h"
#include "shoestring/optim/lion.h"
#include "shoestring/optim/optimizer.h"
#include "shoestring/optim/quantization.h"

using namespace shoestring;

namespace {

at::Tensor f32(const at::Tensor& t) { return t.to(torch::kFloat32); }

// Stores the fp32 value `value` into `dst` as Optimizer does: fp32 copy, bf16
// by SR with `key` (or round-to-nearest when !sr).
void reference_store(at::Tensor& dst, const at::Tensor& value, const RoundingKey& key, bool sr) {
  if (dst.scalar_type() == torch::kFloat32) {
    dst.copy_(value);
  } else if (sr) {
    stochastic_round_into(value.contiguous(), dst, key);
  } else {
    dst.copy_(value);
  }
}

// The op chain of AdamW::update (same operation order as torch.optim.AdamW 1.13).
void reference_adamw(at::Tensor& param, const at::Tensor& grad, at::Tensor& m_stored, at::Tensor& v_stored,
                     const FusedAdamWScalars& s, const FusedRoundingKeys& k) {
  torch::NoGradGuard no_grad;
  at::Tensor g = f32(grad).mul_(s.grad_scale);
  at::Tensor p = f32(param).clone();
  at::Tensor m = f32(m_stored).clone();
  at::Tensor v = f32(v_stored).clone();
  p.mul_(1.0 - s.lr * s.weight_decay);
  m.mul_(s.beta1).add_(g, 1.0 - s.beta1);
  v.mul_(s.beta2).addcmul_(g, g, 1.0 - s.beta2);
  const double bc1 = 1.0 - std::pow(s.beta1, static_cast<double>(s.step));
  const double bc2 = 1.0 - std::pow(s.beta2, static_cast<double>(s.step));
  at::Tensor denom = (v.sqrt() / std::sqrt(bc2)).add_(s.eps);
  p.addcdiv_(m, denom, -(s.lr / bc1));
  reference_store(m_stored, m, k.state1, true);
  reference_store(v_stored, v, k.state2, true);
  reference_store(param, p, k.param, k.stochastic_rounding);
}

// The op chain of optim/lion.cpp.
void reference_lion(at::Tensor& param, const at::Tensor& grad, at::Tensor& m_stored, const FusedLionScalars& s,
                    const FusedRoundingKeys& k) {
  torch::NoGradGuard no_grad;
  at::Tensor g = f32(grad).mul_(s.grad_scale);
  at::Tensor p = f32(param).clone();
  at::Tensor m = f32(m_stored).clone();
  p.mul_(1.0 - s.lr * s.weight_decay);
  at::Tensor direction = (m * s.beta1).add_(g, 1.0 - s.beta1).sign_();
  p.add_(direction, -s.lr);
  m.mul_(s.beta2).add_(g, 1.0 - s.beta2);
  reference_store(m_stored, m, k.state1, true);
  reference_store(param, p, k.param, k.stochastic_rounding);
}

struct Tensors {
  at::Tensor p, g, m, v;
  Tensors clone() const { return {p.clone(), g.clone(), m.clone(), v.clone()}; }
};

// Values spread over several binades, second moment >= 0 (as Adam keeps it).
Tensors make_tensors(int64_t n, at::ScalarType pt, at::ScalarType gt, at::ScalarType st, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto randn = [&](double scale) { return at::randn({n}, gen, torch::TensorOptions(torch::kFloat32)) * scale; };
  Tensors t;
  t.p = randn(0.5).to(pt);
  t.g = (randn(1.0) * at::exp(randn(2.0))).to(gt);
  t.m = randn(0.1).to(st);
  t.v = (randn(0.1) * randn(0.1)).abs_().to(st);
  return t;
}

FusedRoundingKeys keys_for(uint64_t seed, uint64_t step, uint64_t index, bool sr = true) {
  FusedRoundingKeys k;
  k.stochastic_rounding = sr;
  k.param = {seed, step, index * 16};
  k.state1 = {seed, step, index * 16 + 1};
  k.state2 = {seed, step, index * 16 + 2};
  return k;
}

double max_relative(const at::Tensor& a, const at::Tensor& b) {
  return ((f32(a) - f32(b)).abs() / f32(b).abs().clamp_min(1e-6)).max().item<double>();
}

int64_t mismatches(const at::Tensor& a, const at::Tensor& b) {
  // Bitwise comparison (NaN-safe): compare raw 16/32-bit patterns.
  const auto it = a.scalar_type() == torch::kFloat32 ? torch::kInt32 : torch::kInt16;
  return a.view(it).ne(b.view(it)).sum().item<int64_t>();
}

// Every (instruction-set limit, case) pair: the kernels' AVX-512, AVX2 and
// portable compilations (each where the CPU has it; a lower limit than the
// CPU's best is always honoured).
template <typename Cases>
auto every_isa(const Cases& cases) {
  using Case = std::decay_t<decltype(*std::begin(cases))>;
  std::vector<std::pair<FusedKernelIsa, Case>> out;
  for (FusedKernelIsa isa : {FusedKernelIsa::avx512, FusedKernelIsa::avx2, FusedKernelIsa::portable}) {
    for (const Case& c : cases) out.emplace_back(isa, c);
  }
  return out;
}

}  // namespace

TEST(FusedKernels, IsaLimitIsHonoured) {
  const FusedKernelIsa best = fused_kernels_isa();
  fused_kernels_limit_isa(FusedKernelIsa::portable);
  EXPECT_EQ(fused_kernels_isa(), FusedKernelIsa::portable);
  fused_kernels_limit_isa(FusedKernelIsa::avx2);
  EXPECT_LE(fused_kernels_isa(), FusedKernelIsa::avx2);
  fused_kernels_limit_isa(FusedKernelIsa::avx512);
  EXPECT_EQ(fused_kernels_isa(), best);
  EXPECT_STREQ(fused_kernel_isa_name(FusedKernelIsa::avx2), "avx2");
}

TEST(FusedAdamW, Fp32MatchesOpChain) {
  const int64_t n = 10007;
  FusedAdamWScalars s;
  s.lr = 3e-3;
  s.weight_decay = 0.05;
  for (int64_t step : {1, 2, 37}) {
    s.step = step;
    Tensors a = make_tensors(n, torch::kFloat32, torch::kFloat32, torch::kFloat32, 11 + step);
    Tensors b = a.clone();
    const auto k = keys_for(5, step, 3);
    fused_adamw_step(a.p, a.g, a.m, a.v, s, k);
    reference_adamw(b.p, b.g, b.m, b.v, s, k);
    EXPECT_LT(max_relative(a.p, b.p), 1e-6) << "step " << step;
    EXPECT_LT(max_relative(a.m, b.m), 1e-6);
    EXPECT_LT(max_relative(a.v, b.v), 1e-6);
    EXPECT_TRUE(torch::equal(a.g, b.g));  // grad is read only
    // Same operations in the same order: bit-identical on x86-64 with
    // libtorch's GCC-built AVX2 / AVX-512 kernels (see fused_kernels.h).
    EXPECT_EQ(mismatches(a.p, b.p) + mismatches(a.m, b.m) + mismatches(a.v, b.v), 0) << "step " << step;
  }
}

TEST(FusedAdamW, Bf16StochasticRoundingBitIdenticalToReference) {
  const int64_t n = 8191;
  FusedAdamWScalars s;
  s.lr = 1e-2;
  s.weight_decay = 0.01;
  s.step = 4;
  s.grad_scale = 0.75;
  struct Case {
    at::ScalarType p, g, st;
    bool sr;
  };
  const Case cases[] = {{torch::kBFloat16, torch::kBFloat16, torch::kBFloat16, true},
                        {torch::kBFloat16, torch::kFloat32, torch::kFloat32, true},
                        {torch::kFloat32, torch::kBFloat16, torch::kBFloat16, true},
                        {torch::kBFloat16, torch::kBFloat16, torch::kBFloat16, false}};
  for (auto [isa, c] : every_isa(cases)) {
    fused_kernels_limit_isa(isa);
    SCOPED_TRACE(fmt::format("isa {} param {} grad {} state {} sr {}", fused_kernel_isa_name(isa),
                             c10::toString(c.p), c10::toString(c.g), c10::toString(c.st), c.sr));
    Tensors a = make_tensors(n, c.p, c.g, c.st, 21);
    Tensors b = a.clone();
    const auto k = keys_for(99, 4, 7, c.sr);
    fused_adamw_step(a.p, a.g, a.m, a.v, s, k);
    reference_adamw(b.p, b.g, b.m, b.v, s, k);
    EXPECT_EQ(mismatches(a.p, b.p), 0);
    EXPECT_EQ(mismatches(a.m, b.m), 0);
    EXPECT_EQ(mismatches(a.v, b.v), 0);
    // The parameter moved (the test would pass vacuously otherwise).
    EXPECT_GT(mismatches(a.p, make_tensors(n, c.p, c.g, c.st, 21).p), n / 4);
  }
  fused_kernels_limit_isa(FusedKernelIsa::avx512);
}

TEST(FusedAdamW, ResultsDoNotDependOnThreadCount) {
  const int64_t n = 200003;  // several parallel tasks
  FusedAdamWScalars s;
  s.step = 3;
  const int before = at::get_num_threads();
  Tensors a = make_tensors(n, torch::kBFloat16, torch::kBFloat16, torch::kBFloat16, 4);
  Tensors b = a.clone();
  const auto k = keys_for(1, 3, 0);
  at::set_num_threads(1);
  fused_adamw_step(a.p, a.g, a.m, a.v, s, k);
  at::set_num_threads(2);
  fused_adamw_step(b.p, b.g, b.m, b.v, s, k);
  at::set_num_threads(before);
  EXPECT_EQ(mismatches(a.p, b.p) + mismatches(a.m, b.m) + mismatches(a.v, b.v), 0);
}

TEST(FusedAdamW, RejectsWhatItCannotDo) {
  auto p = torch::zeros({4, 6});
  auto g = torch::zeros({4, 6});
  auto m = torch::zeros({4, 6});
  auto v = torch::zeros({4, 6});
  EXPECT_TRUE(fused_adamw_supported(p, g, m, v));
  auto pt = p.t();  // non-contiguous view
  EXPECT_FALSE(fused_adamw_supported(pt, g, m, v));
  try {
    fused_adamw_step(pt, g, m, v, {}, {});
    FAIL() << "expected shoestring::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("param is not contiguous"), std::string::npos) << e.what();
  }
  auto half = torch::zeros({4, 6}, torch::kHalf);
  EXPECT_FALSE(fused_adamw_supported(half, g, m, v));
  EXPECT_FALSE(fused_adamw_supported(p, g, half, half));
  auto short_grad = torch::zeros({5});
  EXPECT_FALSE(fused_adamw_supported(p, short_grad, m, v));
  EXPECT_THROW(fused_adamw_step(p, short_grad, m, v, {}, {}), Error);
  auto v16 = torch::zeros({4, 6}, torch::kBFloat16);
  EXPECT_FALSE(fused_adamw_supported(p, g, m, v16));  // mixed state dtypes
  FusedAdamWScalars bad;
  bad.step = 0;
  EXPECT_THROW(fused_adamw_step(p, g, m, v, bad, {}), Error);
  // An in-place update bumps the autograd version counter.
  const auto version = p._version();
  fused_adamw_step(p, g, m, v, {}, {});
  EXPECT_GT(p._version(), version);
}

// AdamW takes the fused path for contiguous CPU tensors and the op chain for a
// non-contiguous parameter: both must give the same bits, step after step.
TEST(FusedAdamW, AdamWClassFusedAndFallbackAgree) {
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    auto base = torch::randn({37, 53}).to(dtype);
    auto contiguous = base.clone().requires_grad_(true);
    auto strided = base.t().contiguous().t();  // [37, 53] view of a [53, 37] tensor
    strided.requires_grad_(true);
    ASSERT_FALSE(strided.is_contiguous());
    AdamWOptions adam;
    OptimizerOptions o;
    o.seed = 17;
    o.state_dtype = dtype;
    AdamW fused({{"w", contiguous, 0.02}}, adam, o);
    AdamW chain({{"w", strided, 0.02}}, adam, o);
    for (int step = 0; step < 5; ++step) {
      auto g = torch::randn({37, 53}).to(dtype);
      contiguous.mutable_grad() = g.clone();
      strided.mutable_grad() = g.t().contiguous().t();  // non-contiguous gradient too
      fused.step(1e-2);
      chain.step(1e-2);
    }
    EXPECT_EQ(mismatches(contiguous.detach().contiguous(), strided.detach().contiguous()), 0);
    auto fs = fused.state_tensors();
    auto cs = chain.state_tensors();
    ASSERT_EQ(fs.size(), cs.size());
    for (size_t i = 0; i < fs.size(); ++i) {
      EXPECT_EQ(mismatches(fs[i].second.contiguous(), cs[i].second.contiguous()), 0) << fs[i].first;
    }
  }
}

TEST(FusedLion, MatchesOpChainBitForBit) {
  const int64_t n = 8191;
  FusedLionScalars s;
  s.lr = 3e-4;
  s.weight_decay = 0.1;
  s.grad_scale = 0.5;
  for (auto [isa, dtype] : every_isa(std::vector<at::ScalarType>{torch::kFloat32, torch::kBFloat16})) {
    fused_kernels_limit_isa(isa);
    SCOPED_TRACE(fmt::format("isa {} {}", fused_kernel_isa_name(isa), c10::toString(dtype)));
    Tensors a = make_tensors(n, dtype, dtype, dtype, 8);
    a.g.index_put_({torch::indexing::Slice(0, 64)}, 0);  // sign(c) = 0 where m = g = 0
    a.m.index_put_({torch::indexing::Slice(0, 64)}, 0);
    Tensors b = a.clone();
    const auto k = keys_for(3, 2, 5);
    fused_lion_step(a.p, a.g, a.m, s, k);
    reference_lion(b.p, b.g, b.m, s, k);
    EXPECT_EQ(mismatches(a.p, b.p), 0);
    EXPECT_EQ(mismatches(a.m, b.m), 0);
  }
  fused_kernels_limit_isa(FusedKernelIsa::avx512);
  auto p = torch::zeros({3});
  auto m = torch::zeros({3}, torch::kHalf);
  EXPECT_FALSE(fused_lion_supported(p, p, m));
  EXPECT_THROW(fused_lion_step(p, p, m, s, {}), Error);
}

namespace {
// Reference of fused_adamw8bit_step from the public pieces: dequantize_blockwise,
// the per-element update of AdamW8bit written out in scalar fp32 (as
// fused_kernels.h documents it), quantize_blockwise, then the parameter stored
// as Optimizer::write_param would (elements whose update is skipped keep their
// old bits).
void reference_adamw8bit(at::Tensor& param, const at::Tensor& grad, at::Tensor& mq, at::Tensor& ma, at::Tensor& vq,
                         at::Tensor& va, int64_t bs, const FusedAdamWScalars& s, const FusedRoundingKeys& k) {
  torch::NoGradGuard no_grad;
  const QuantizationMap& smap = signed_dynamic_map();
  const QuantizationMap& umap = unsigned_dynamic_map();
  at::Tensor m = dequantize_blockwise(mq, ma, smap, bs).view(-1);
  at::Tensor v = dequantize_blockwise(vq, va, umap, bs).view(-1);
  at::Tensor p = f32(param).contiguous().view(-1).clone();
  at::Tensor g = f32(grad).contiguous().view(-1);
  at::Tensor skipped = torch::zeros({p.numel()}, torch::kBool);
  const double bc1 = 1.0 - std::pow(s.beta1, static_cast<double>(s.step));
  const double bc2 = 1.0 - std::pow(s.beta2, static_cast<double>(s.step));
  const auto gs = static_cast<float>(s.grad_scale), decay = static_cast<float>(1.0 - s.lr * s.weight_decay),
             b1 = static_cast<float>(s.beta1), omb1 = static_cast<float>(1.0 - s.beta1),
             b2 = static_cast<float>(s.beta2), omb2 = static_cast<float>(1.0 - s.beta2),
             bc2_sqrt = static_cast<float>(std::sqrt(bc2)), eps = static_cast<float>(s.eps),
             neg_step = -static_cast<float>(s.lr / bc1);
  float* pp = p.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  bool* sk = skipped.data_ptr<bool>();
  for (int64_t i = 0; i < p.numel(); ++i) {
    volatile float gi = gp[i] * gs;  // volatile: no contraction into fmas
    volatile float p1 = pp[i] * decay;
    volatile float m1 = std::fma(static_cast<float>(gi), omb1, mp[i] * b1);
    volatile float t = omb2 * gi;
    volatile float t2 = t * gi;
    volatile float vb = vp[i] * b2;
    volatile float v1 = vb + t2;
    volatile float denom = std::sqrt(static_cast<float>(v1)) / bc2_sqrt + eps;
    volatile float num = neg_step * m1;
    volatile float p2 = p1 + num / denom;
    if (std::isfinite(static_cast<float>(gi)) && std::isfinite(static_cast<float>(m1)) &&
        std::isfinite(static_cast<float>(v1)) && std::isfinite(static_cast<float>(p2))) {
      pp[i] = p2;
      mp[i] = m1;
      vp[i] = v1;
    } else {
      sk[i] = true;
    }
  }
  BlockwiseQuantized qm = quantize_blockwise(m, smap, bs);
  BlockwiseQuantized qv = quantize_blockwise(v, umap, bs);
  mq.view(-1).copy_(qm.codes);
  ma.copy_(qm.absmax);
  vq.view(-1).copy_(qv.codes);
  va.copy_(qv.absmax);
  at::Tensor old = param.clone();
  at::Tensor updated = param.clone();
  reference_store(updated, p.view(param.sizes()), k.param, k.stochastic_rounding);
  param.copy_(torch::where(skipped.view(param.sizes()), old, updated));
}
}  // namespace

// Every dtype variant, block sizes with and without a vector-width multiple,
// a short last block, an all-zero block and non-finite gradient elements.
// The AVX-512 and AVX2 kernels (each where the CPU has it) and the portable one.
TEST(FusedAdamW8bit, BitIdenticalToReference) {
  torch::manual_seed(41);
  for (auto [isa, bs] :
       {std::pair{FusedKernelIsa::avx512, int64_t{256}}, std::pair{FusedKernelIsa::avx512, int64_t{1256}},
        std::pair{FusedKernelIsa::avx2, int64_t{256}}, std::pair{FusedKernelIsa::avx2, int64_t{1256}},
        std::pair{FusedKernelIsa::avx2, int64_t{100}}, std::pair{FusedKernelIsa::portable, int64_t{100}},
        std::pair{FusedKernelIsa::portable, int64_t{256}}}) {
    fused_kernels_limit_isa(isa);
    const int64_t n = 256 * 23 + 77;
    const int64_t blocks = (n + bs - 1) / bs;
    for (auto pdtype : {torch::kFloat32, torch::kBFloat16}) {
      for (auto gdtype : {torch::kFloat32, torch::kBFloat16}) {
        for (bool sr : {true, false}) {
          if (pdtype == torch::kFloat32 && !sr) continue;
          at::Tensor init = (torch::randn({n}) * 0.1).to(pdtype);
          at::Tensor m0 = torch::randn({n}) * 1e-2 * torch::pow(10.0, torch::rand({n}) * -3.0);
          at::Tensor v0 = torch::rand({n}) * 1e-4;
          m0.narrow(0, bs, bs).zero_();  // the second block: all zero, gradient zero too
          v0.narrow(0, bs, bs).zero_();
          auto qm = quantize_blockwise(m0, signed_dynamic_map(), bs);
          auto qv = quantize_blockwise(v0, unsigned_dynamic_map(), bs);
          at::Tensor p_fused = init.clone(), p_ref = init.clone();
          at::Tensor mq_f = qm.codes.clone(), ma_f = qm.absmax.clone(), vq_f = qv.codes.clone(),
                     va_f = qv.absmax.clone();
          at::Tensor mq_r = qm.codes.clone(), ma_r = qm.absmax.clone(), vq_r = qv.codes.clone(),
                     va_r = qv.absmax.clone();
          ASSERT_EQ(ma_f.numel(), blocks);
          for (int64_t step = 1; step <= 2; ++step) {
            at::Tensor g = torch::randn({n}) * 1e-2;
            g.narrow(0, bs, bs).zero_();
            g[5] = std::numeric_limits<float>::quiet_NaN();
            g[n - 3] = std::numeric_limits<float>::infinity();
            g[bs * 2 + 17] = -std::numeric_limits<float>::infinity();
            g = g.to(gdtype);
            FusedAdamWScalars s;
            s.lr = 1e-2;
            s.weight_decay = 0.1;
            s.step = step;
            s.grad_scale = 0.75;
            FusedRoundingKeys k;
            k.stochastic_rounding = sr;
            k.param = {9, static_cast<uint64_t>(step), 32};
            fused_adamw8bit_step(p_fused, g, mq_f, ma_f, vq_f, va_f, bs, s, k);
            reference_adamw8bit(p_ref, g, mq_r, ma_r, vq_r, va_r, bs, s, k);
            const std::string what = std::string("isa ") + std::to_string(static_cast<int>(isa)) + " bs " +
                                     std::to_string(bs) + " " + c10::toString(pdtype) + " " + c10::toString(gdtype) +
                                     (sr ? " sr" : " rn") + " step " + std::to_string(step);
            ASSERT_TRUE(torch::equal(p_fused, p_ref)) << what;
            ASSERT_TRUE(torch::equal(mq_f, mq_r)) << what;
            ASSERT_TRUE(torch::equal(ma_f, ma_r)) << what;
            ASSERT_TRUE(torch::equal(vq_f, vq_r)) << what;
            ASSERT_TRUE(torch::equal(va_f, va_r)) << what;
          }
          EXPECT_FALSE(torch::equal(p_fused, init));
          EXPECT_TRUE(torch::equal(p_fused[5], init[5]));  // NaN gradient: untouched
          EXPECT_EQ(ma_f[1].item<float>(), 0.0f);          // the all-zero block stays zero
        }
      }
    }
  }
  fused_kernels_limit_isa(FusedKernelIsa::avx512);
}

TEST(FusedAdamW8bit, RejectsWhatItCannotDo) {
  at::Tensor p = torch::zeros({1000}), g = torch::zeros({1000});
  at::Tensor mq = torch::zeros({1000}, torch::kByte), vq = torch::zeros({1000}, torch::kByte);
  at::Tensor ma = torch::zeros({4}), va = torch::zeros({4});
  EXPECT_TRUE(fused_adamw8bit_supported(p, g, mq, ma, vq, va, 256));
  EXPECT_FALSE(fused_adamw8bit_supported(p, g, mq, ma, vq, va, 100));  // absmax needs 10 blocks
  EXPECT_FALSE(fused_adamw8bit_supported(p.to(torch::kHalf), g, mq, ma, vq, va, 256));
  EXPECT_FALSE(fused_adamw8bit_supported(p, g, mq.to(torch::kFloat), ma, vq, va, 256));
  at::Tensor p16 = p.to(torch::kHalf);
  EXPECT_THROW(fused_adamw8bit_step(p16, g, mq, ma, vq, va, 256, {}, {}), Error);
  EXPECT_THROW(fused_adamw8bit_step(p, g, mq, ma, vq, va, 0, {}, {}), Error);
}

// ---- multi-tensor steps (*_step_many) ----------------------------------------

namespace {

// Sizes around the chunking: tiny tensors packed into shared chunks, one of
// exactly a chunk, one just over, several chunks with a short tail.
const int64_t kManySizes[] = {1, 129, 16384, 16385, 7, 50001, 4096, 300};

at::ScalarType many_dtype(size_t i) { return i % 3 == 1 ? torch::kFloat32 : torch::kBFloat16; }

}  // namespace

TEST(FusedMultiTensor, AdamWAndLionManyAreTheOneByOneBits) {
  for (int threads : {1, 2}) {
    const int before = at::get_num_threads();
    at::set_num_threads(threads);
    std::vector<Tensors> many, one;
    std::vector<FusedAdamWTensor> adamw;
    std::vector<FusedLionTensor> lion;
    for (size_t i = 0; i < std::size(kManySizes); ++i) {
      const at::ScalarType dt = many_dtype(i);
      many.push_back(make_tensors(kManySizes[i], dt, torch::kBFloat16, dt, 100 + i));
      one.push_back(many.back().clone());
    }
    FusedAdamWScalars s;
    s.step = 3;
    s.grad_scale = 0.5;
    FusedLionScalars ls;
    ls.weight_decay = 0.1;
    for (size_t i = 0; i < many.size(); ++i) {
      s.weight_decay = i % 2 ? 0.0 : 0.01;
      const auto k = keys_for(7, 3, i, i != 5);
      adamw.push_back({many[i].p, many[i].g, many[i].m, many[i].v, s, k});
      fused_adamw_step(one[i].p, one[i].g, one[i].m, one[i].v, s, k);
    }
    fused_adamw_step_many(adamw);
    for (size_t i = 0; i < many.size(); ++i) {
      lion.push_back({many[i].p, many[i].g, many[i].m, ls, keys_for(8, 4, i)});
      fused_lion_step(one[i].p, one[i].g, one[i].m, ls, keys_for(8, 4, i));
    }
    fused_lion_step_many(lion);
    at::set_num_threads(before);
    for (size_t i = 0; i < many.size(); ++i) {
      SCOPED_TRACE(fmt::format("threads {} tensor {} ({} elements)", threads, i, kManySizes[i]));
      EXPECT_EQ(mismatches(many[i].p, one[i].p), 0);
      EXPECT_EQ(mismatches(many[i].m, one[i].m), 0);
      EXPECT_EQ(mismatches(many[i].v, one[i].v), 0);
    }
  }
}

TEST(FusedMultiTensor, AdamW8bitManyIsTheOneByOneBits) {
  struct State {
    at::Tensor p, g, mq, ma, vq, va;
    int64_t bs;
  };
  auto make = [](int64_t n, int64_t bs, at::ScalarType dt, uint64_t seed) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    const int64_t blocks = (n + bs - 1) / bs;
    State st;
    st.bs = bs;
    st.p = (at::randn({n}, gen) * 0.1).to(dt);
    st.g = (at::randn({n}, gen) * 1e-2).to(dt);
    auto qm = quantize_blockwise(at::randn({n}, gen) * 1e-2, signed_dynamic_map(), bs);
    auto qv = quantize_blockwise(at::rand({n}, gen) * 1e-4, unsigned_dynamic_map(), bs);
    st.mq = qm.codes;
    st.ma = qm.absmax;
    st.vq = qv.codes;
    st.va = qv.absmax;
    EXPECT_EQ(st.ma.numel(), blocks);
    return st;
  };
  auto clone = [](const State& s) {
    return State{s.p.clone(), s.g.clone(), s.mq.clone(), s.ma.clone(), s.vq.clone(), s.va.clone(), s.bs};
  };
  std::vector<State> many, one;
  std::vector<FusedAdamW8bitTensor> tasks;
  FusedAdamWScalars s;
  s.step = 2;
  s.weight_decay = 0.01;
  s.grad_scale = 0.75;
  for (size_t i = 0; i < std::size(kManySizes); ++i) {
    const int64_t bs = i == 3 ? 100 : 256;  // one tensor with another block size
    many.push_back(make(kManySizes[i], bs, many_dtype(i), 200 + i));
    one.push_back(clone(many.back()));
  }
  for (size_t i = 0; i < many.size(); ++i) {
    State& m = many[i];
    const auto k = keys_for(9, 2, i);
    tasks.push_back({m.p, m.g, m.mq, m.ma, m.vq, m.va, m.bs, s, k});
    State& o = one[i];
    fused_adamw8bit_step(o.p, o.g, o.mq, o.ma, o.vq, o.va, o.bs, s, k);
  }
  fused_adamw8bit_step_many(tasks);
  for (size_t i = 0; i < many.size(); ++i) {
    SCOPED_TRACE(fmt::format("tensor {} ({} elements)", i, kManySizes[i]));
    EXPECT_EQ(mismatches(many[i].p, one[i].p), 0);
    EXPECT_TRUE(torch::equal(many[i].mq, one[i].mq));
    EXPECT_TRUE(torch::equal(many[i].ma, one[i].ma));
    EXPECT_TRUE(torch::equal(many[i].vq, one[i].vq));
    EXPECT_TRUE(torch::equal(many[i].va, one[i].va));
  }
}

TEST(FusedMultiTensor, ChecksEveryEntryBeforeWritingAny) {
  Tensors a = make_tensors(1000, torch::kFloat32, torch::kFloat32, torch::kFloat32, 1);
  Tensors b = make_tensors(1000, torch::kFloat32, torch::kFloat32, torch::kFloat32, 2);
  const Tensors a0 = a.clone();
  at::Tensor bad_grad = torch::zeros({999});
  try {
    fused_adamw_step_many({{a.p, a.g, a.m, a.v, {}, {}}, {b.p, bad_grad, b.m, b.v, {}, {}}});
    FAIL() << "expected shoestring::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 1 of 2"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("grad has 999 elements"), std::string::npos) << e.what();
  }
  EXPECT_EQ(mismatches(a.p, a0.p) + mismatches(a.m, a0.m) + mismatches(a.v, a0.v), 0);
  fused_adamw_step_many({});  // nothing to do
}

// Optimizer::step with a gradient scale: the fused kernels take the scale
// (no scaled fp32 copy of each gradient); the bits are those of the op
// chains, which scale a copy first (forced through the generic path).
TEST(FusedMultiTensor, StepWithGradScaleMatchesTheOpChains) {
  for (const char* type : {"AdamW", "Lion", "AdamW8bit"}) {
    SCOPED_TRACE(type);
    std::vector<at::Tensor> result[2];
    for (bool generic : {false, true}) {
      force_device_generic_optimizers(generic);
      torch::manual_seed(3);
      std::vector<OptimParam> params;
      for (int64_t n : {5000, 40, 20000}) {
        params.push_back({"p" + std::to_string(n), (torch::randn({n}) * 0.1).to(torch::kBFloat16), 0.01});
      }
      OptimizerOptions o;
      o.seed = 4;
      o.state_dtype = torch::kBFloat16;
      std::unique_ptr<Optimizer> opt;
      if (std::string(type) == "AdamW") opt = std::make_unique<AdamW>(params, AdamWOptions{}, o);
      if (std::string(type) == "Lion") opt = std::make_unique<Lion>(params, LionOptions{}, o);
      if (std::string(type) == "AdamW8bit") opt = std::make_unique<AdamW8bit>(params, AdamW8bitOptions{}, o);
      for (int step = 0; step < 3; ++step) {
        for (auto& p : params) p.param.mutable_grad() = torch::randn(p.param.sizes()).to(torch::kBFloat16);
        opt->step(1e-2, 0.3);
      }
      for (auto& p : params) result[generic ? 1 : 0].push_back(p.param.clone());
      for (auto& [name, t] : opt->state_tensors()) result[generic ? 1 : 0].push_back(t.clone());
    }
    force_device_generic_optimizers(false);
    ASSERT_EQ(result[0].size(), result[1].size());
    for (size_t i = 0; i < result[0].size(); ++i) {
      EXPECT_TRUE(torch::equal(result[0][i], result[1][i])) << "tensor " << i;
    }
  }
}

// The factored Adafactor step runs its two passes in one parallel region,
// cutting the rows into chunks fixed by the shape: the bits must not depend
// on the thread count or the instruction set (the shape is above the size
// that runs on the calling thread, with a short last chunk).
TEST(FusedAdafactor, ResultsDoNotDependOnThreadsOrIsa) {
  const int64_t n = 333, m = 517;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(12);
  const at::Tensor p0 = (at::randn({n, m}, gen) * 0.1).to(torch::kBFloat16);
  const at::Tensor g = (at::randn({n, m}, gen) * 1e-2).to(torch::kBFloat16);
  const at::Tensor row0 = at::rand({n}, gen) * 1e-4, col0 = at::rand({m}, gen) * 1e-4;
  FusedAdafactorScalars s;
  s.beta2t = 0.3;
  s.step_size = 1e-3;
  s.weight_decay = 0.01;
  FusedRoundingKeys k = keys_for(6, 2, 1);
  auto run = [&](int threads, FusedKernelIsa isa) {
    const int before = at::get_num_threads();
    at::set_num_threads(threads);
    fused_kernels_limit_isa(isa);
    at::Tensor p = p0.clone(), row = row0.clone(), col = col0.clone();
    fused_adafactor_factored_step(p, g, row, col, n, m, s, k);
    fused_kernels_limit_isa(FusedKernelIsa::avx512);
    at::set_num_threads(before);
    return std::vector<at::Tensor>{p, row, col};
  };
  const auto reference = run(1, FusedKernelIsa::avx512);
  EXPECT_GT(mismatches(reference[0], p0), n * m / 4);  // the weights moved
  for (auto [threads, isa] : {std::pair{2, FusedKernelIsa::avx512}, std::pair{2, FusedKernelIsa::avx2},
                              std::pair{1, FusedKernelIsa::portable}, std::pair{2, FusedKernelIsa::portable}}) {
    const auto other = run(threads, isa);
    for (size_t i = 0; i < other.size(); ++i) {
      EXPECT_EQ(mismatches(other[i], reference[i]), 0)
          << "threads " << threads << " isa " << fused_kernel_isa_name(isa) << " tensor " << i;
    }
  }
}

// Adafactor's vectors (unfactored, no beta1) take fused_adafactor_unfactored_step:
// the op chain's bits (the generic path is the op chain), with fp32 and bf16
// weights and state, weight decay, and clipping active at step 1 (RMS(U) near 1).
TEST(FusedAdafactor, UnfactoredStepIsTheOpChainBits) {
  for (auto [pdtype, sdtype] : {std::pair{torch::kFloat32, torch::kFloat32}, std::pair{torch::kBFloat16, torch::kBFloat16},
                                std::pair{torch::kBFloat16, torch::kFloat32}}) {
    std::vector<at::Tensor> result[2];
    for (bool generic : {false, true}) {
      force_device_generic_optimizers(generic);
      torch::manual_seed(21);
      std::vector<OptimParam> params = {{"b", (torch::randn({1000}) * 0.1).to(pdtype), 0.01},
                                        {"n", (torch::randn({7}) * 0.1).to(pdtype), 0.0}};
      OptimizerOptions o;
      o.seed = 8;
      o.state_dtype = sdtype;
      AdafactorOptions a;
      a.relative_step = false;
      a.scale_parameter = false;
      a.weight_decay = 0.01;
      Adafactor opt(params, a, o);
      for (int step = 0; step < 4; ++step) {
        for (auto& p : params) p.param.mutable_grad() = (torch::randn(p.param.sizes()) * (step + 1)).to(pdtype);
        opt.step(1e-2);
      }
      for (auto& p : params) result[generic ? 1 : 0].push_back(p.param.clone());
      for (auto& [name, t] : opt.state_tensors()) result[generic ? 1 : 0].push_back(t.clone());
    }
    force_device_generic_optimizers(false);
    ASSERT_EQ(result[0].size(), result[1].size());
    for (size_t i = 0; i < result[0].size(); ++i) {
      EXPECT_EQ(mismatches(result[0][i], result[1][i]), 0)
          << c10::toString(pdtype) << " / " << c10::toString(sdtype) << " tensor " << i;
    }
  }
}
