// Runtime side of the precision policy: block execution (compute dtype, fp16
// emulation, checkpoint), the loss scaler (GradScaler's rule), the overflow
// guard with auto-upcast on a model whose block overflows, fp32 master
// weights, the save-time range guard, and fp8 rounding.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/nn/block_precision.h"
#include "shoestring/nn/layers.h"
#include "shoestring/precision/dtype.h"
#include "shoestring/precision/loss_scaler.h"
#include "shoestring/precision/master_weights.h"
#include "shoestring/precision/overflow.h"
#include "shoestring/precision/policy.h"
#include "shoestring/precision/save_guard.h"

using namespace shoestring;
using namespace shoestring::precision;

namespace {

/// blocks.<i>: LayerNorm -> Linear(8, 8), each a declared block; the model
/// output is their chain. A block with huge weights overflows fp16.
struct ChainImpl : torch::nn::Module {
  explicit ChainImpl(int n) {
    blocks = register_module("blocks", torch::nn::ModuleList());
    table = std::make_shared<nn::BlockTable>();
    for (int i = 0; i < n; ++i) {
      auto b = std::make_shared<torch::nn::Module>();
      b->register_module("norm", nn::LayerNorm(8));
      b->register_module("fc", nn::Linear(8, 8));
      blocks->push_back(b);
      table->declare(blocks[i].get());
    }
  }
  at::Tensor forward(at::Tensor x) {
    for (size_t i = 0; i < blocks->size(); ++i) {
      std::shared_ptr<torch::nn::Module> b = blocks->ptr(i);
      x = nn::run_block(table.get(), b,
                        [b](const std::vector<at::Tensor>& in) {
                          auto* norm = b->named_children()["norm"]->as<nn::LayerNormImpl>();
                          auto* fc = b->named_children()["fc"]->as<nn::LinearImpl>();
                          return std::vector<at::Tensor>{fc->forward(norm->forward(in[0]))};
                        },
                        {x})[0];
    }
    return x;
  }
  nn::LinearImpl* fc(int i) { return blocks[i]->named_children()["fc"]->as<nn::LinearImpl>(); }
  torch::nn::ModuleList blocks{nullptr};
  std::shared_ptr<nn::BlockTable> table;
};
TORCH_MODULE(Chain);

Policy full_fp16_policy(bool master) {
  RuleSpec r;
  r.match = "*";
  r.storage = "fp16";
  r.compute = "fp16";
  r.master = master ? "fp32" : "none";
  return Policy::from_specs({r});
}

}  // namespace

TEST(BlockPrecision, Fp16EmulationRoundsOutputsAndOverflowsToInf) {
  torch::manual_seed(1);
  Chain chain(2);
  auto res = resolve(*chain, full_fp16_policy(false), {chain->table.get()});
  apply(*chain, res, {chain->table.get()});
  EXPECT_EQ(chain->fc(0)->weight.scalar_type(), at::kHalf);
  at::Tensor x = torch::randn({4, 8});
  at::Tensor y = chain->forward(x);
  EXPECT_EQ(y.scalar_type(), at::kFloat);
  // Every output value is an fp16 value.
  EXPECT_TRUE(torch::equal(y, y.to(at::kHalf).to(at::kFloat)));
  // Reference: the same math in fp32 from the fp16-stored weights, rounded per block.
  at::Tensor h = x;
  for (int i = 0; i < 2; ++i) {
    auto* fc = chain->fc(i);
    at::Tensor n = torch::layer_norm(h, {8}, torch::ones({8}), torch::zeros({8}), 1e-5);
    h = torch::linear(n, fc->weight.to(at::kFloat), fc->bias.to(at::kFloat)).to(at::kHalf).to(at::kFloat);
  }
  EXPECT_TRUE(torch::allclose(y, h, 0, 0)) << (y - h).abs().max();

  // A block whose output exceeds 65504 gives inf exactly there.
  {
    torch::NoGradGuard ng;
    chain->fc(1)->weight.copy_(torch::eye(8) * 30000.0);
    chain->fc(1)->bias.fill_(60000.0);
  }
  at::Tensor z = chain->forward(torch::ones({1, 8}) + torch::arange(8).to(at::kFloat));
  EXPECT_TRUE(z.isinf().any().item<bool>());
}

TEST(BlockPrecision, ComputeDtypeAndLegacyPath) {
  torch::manual_seed(2);
  Chain chain(1);
  at::Tensor x = torch::randn({2, 8});
  at::Tensor legacy = chain->forward(x);  // table not configured: plain fp32
  EXPECT_EQ(legacy.scalar_type(), at::kFloat);
  RuleSpec r;
  r.match = "*";
  r.compute = "bf16";
  apply(*chain, resolve(*chain, Policy::from_specs({r}), {chain->table.get()}), {chain->table.get()});
  EXPECT_EQ(chain->fc(0)->weight.scalar_type(), at::kFloat);  // storage unchanged
  at::Tensor y = chain->forward(x);
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(torch::allclose(y.to(at::kFloat), legacy, 0.05, 0.05));
  EXPECT_FALSE(nn::current_compute_dtype().has_value());  // guard restored
}

TEST(BlockPrecision, CheckpointByRuleGivesSameGradients) {
  torch::manual_seed(3);
  Chain a(3), b(3);
  {
    torch::NoGradGuard ng;
    for (auto& item : b->named_parameters()) item.value().copy_(a->named_parameters()[item.key()]);
  }
  RuleSpec r;
  r.match = "*";
  r.compute = "fp16";
  RuleSpec ck;
  ck.match = "blocks.1";
  ck.checkpoint = true;
  apply(*a, resolve(*a, Policy::from_specs({r}), {a->table.get()}), {a->table.get()});
  apply(*b, resolve(*b, Policy::from_specs({r, ck}), {b->table.get()}), {b->table.get()});
  EXPECT_TRUE(b->table->find(b->blocks[1].get())->checkpoint);
  EXPECT_FALSE(b->table->find(b->blocks[0].get())->checkpoint);
  at::Tensor x = torch::randn({4, 8});
  a->forward(x).pow(2).sum().backward();
  b->forward(x).pow(2).sum().backward();
  for (auto& item : a->named_parameters()) {
    EXPECT_TRUE(torch::equal(item.value().grad(), b->named_parameters()[item.key()].grad())) << item.key();
  }
}

/// A streaming of one block that really frees its parameters between uses
/// (kept aside, empty in the module, as ZeRO stage 3 does on a rank that does
/// not own them) and logs every call, with whether the block's gradients
/// were there at release(true).
struct RecordingStreaming : nn::BlockParameterStreaming {
  const torch::nn::Module* block = nullptr;
  std::vector<at::Tensor> params, kept;
  std::vector<std::string> log;
  bool streams(const torch::nn::Module* b) const override { return b == block; }
  void fetch(const torch::nn::Module*) override {
    log.push_back("fetch");
    for (size_t i = 0; i < params.size(); ++i) params[i].set_data(kept[i].clone());
  }
  void release(const torch::nn::Module*, bool gradients_complete) override {
    bool grads = true;
    for (const auto& p : params) grads = grads && p.grad().defined();
    log.push_back(gradients_complete ? (grads ? "release after backward, gradients there" : "release, no gradients")
                                     : "release");
    for (auto& p : params) p.set_data(at::empty({0}, p.options()));
  }
};

// BlockParameterStreaming around a checkpointed block: fetched for the
// forward and released, fetched again for the recompute and released after
// its backward, once the block's gradients exist; the gradients equal those
// of the same model without streaming. A block that would keep activations
// for backward (not checkpointed) cannot stream.
TEST(BlockPrecision, StreamedBlocksAreFetchedAndReleasedAroundEachUse) {
  torch::manual_seed(4);
  Chain plain(3), streamed(3);
  {
    torch::NoGradGuard ng;
    for (auto& item : streamed->named_parameters()) item.value().copy_(plain->named_parameters()[item.key()]);
  }
  RuleSpec ck;
  ck.match = "blocks.1";
  ck.checkpoint = true;
  for (Chain* c : {&plain, &streamed})
    apply(**c, resolve(**c, Policy::from_specs({ck}), {(*c)->table.get()}), {(*c)->table.get()});
  EXPECT_EQ(streamed->table->checkpointed_blocks(), std::vector<const torch::nn::Module*>{streamed->blocks[1].get()});
  auto streaming = std::make_shared<RecordingStreaming>();
  streaming->block = streamed->blocks[1].get();
  streaming->params = streamed->blocks[1]->parameters();
  for (const auto& p : streaming->params) streaming->kept.push_back(p.detach().clone());
  for (auto& p : streaming->params) p.set_data(at::empty({0}, p.options()));
  streamed->table->streaming = streaming;

  const at::Tensor x = torch::randn({4, 8});
  const at::Tensor y = streamed->forward(x);
  EXPECT_EQ(streaming->log, (std::vector<std::string>{"fetch", "release"}));
  for (const auto& p : streaming->params) EXPECT_EQ(p.numel(), 0) << "released after the forward";
  y.pow(2).sum().backward();
  plain->forward(x).pow(2).sum().backward();
  EXPECT_EQ(streaming->log,
            (std::vector<std::string>{"fetch", "release", "fetch", "release after backward, gradients there"}));
  for (auto& item : plain->named_parameters()) {
    EXPECT_TRUE(torch::equal(item.value().grad(), streamed->named_parameters()[item.key()].grad())) << item.key();
  }
  // Without autograd (sampling): fetched and released around the block.
  streaming->log.clear();
  {
    torch::NoGradGuard ng;
    EXPECT_TRUE(torch::equal(streamed->forward(x), plain->forward(x)));
  }
  EXPECT_EQ(streaming->log, (std::vector<std::string>{"fetch", "release"}));
  // Autograd on, the block not checkpointed: refused, naming the block.
  streamed->table->set(streamed->blocks[1].get(), nn::BlockPrecision{});
  EXPECT_THROW(
      {
        try {
          streamed->forward(x);
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("gradient_checkpointing = true"), std::string::npos) << e.what();
          throw;
        }
      },
      Error);
}

TEST(LossScaler, FollowsGradScalerRule) {
  // Hand-derived trajectory of torch.cuda.amp.GradScaler's update rule with
  // init 65536, growth 2 every 3 clean steps, backoff 0.5.
  LossScalerOptions o;
  o.growth_interval = 3;
  LossScaler s(o);
  EXPECT_EQ(s.scale(), 65536.0);
  const std::vector<bool> inf = {false, false, true, false, false, false, false, false, false, true, true, false};
  const std::vector<double> scale = {65536, 65536, 32768,  32768, 32768, 65536,
                                     65536, 65536, 131072, 65536, 32768, 32768};
  const std::vector<int64_t> tracker = {1, 2, 0, 1, 2, 0, 1, 2, 0, 0, 0, 1};
  for (size_t i = 0; i < inf.size(); ++i) {
    s.update(inf[i]);
    EXPECT_EQ(s.scale(), scale[i]) << "step " << i;
    EXPECT_EQ(s.growth_tracker(), tracker[i]) << "step " << i;
  }
  // Defaults are GradScaler's.
  LossScaler d;
  EXPECT_EQ(d.options().init_scale, 65536.0);
  EXPECT_EQ(d.options().growth_factor, 2.0);
  EXPECT_EQ(d.options().backoff_factor, 0.5);
  EXPECT_EQ(d.options().growth_interval, 2000);
  for (int i = 0; i < 1999; ++i) d.update(false);
  EXPECT_EQ(d.scale(), 65536.0);
  d.update(false);
  EXPECT_EQ(d.scale(), 131072.0);
  // Growth that would overflow fp32 is not applied (the kernel's isfinite check).
  LossScalerOptions big;
  big.init_scale = 3.0e38;
  big.growth_interval = 1;
  LossScaler b(big);
  b.update(false);
  EXPECT_EQ(b.scale(), static_cast<double>(3.0e38f));
  EXPECT_EQ(b.growth_tracker(), 0);
  // State round trip.
  LossScaler r;
  r.load_state(1024.0, 17);
  EXPECT_EQ(r.scale(), 1024.0);
  EXPECT_EQ(r.growth_tracker(), 17);
  EXPECT_THROW(r.load_state(-1, 0), Error);
  // Disabled: scale 1, update does nothing.
  LossScalerOptions off;
  off.enabled = false;
  LossScaler z(off);
  z.update(true);
  EXPECT_EQ(z.scale(), 1.0);
}

TEST(LossScaler, UnscalesIntoFp32AndFindsInf) {
  LossScaler s;
  std::vector<at::Tensor> g = {torch::full({3}, 32768.0).to(at::kHalf), at::Tensor(),
                               torch::tensor({1.0, 2.0}).to(at::kBFloat16)};
  EXPECT_FALSE(s.unscale(g));
  EXPECT_EQ(g[0].scalar_type(), at::kFloat);
  // 65536 does not fit fp16: the fp16 gradient is inf, and unscaling finds it.
  std::vector<at::Tensor> h = {torch::full({2}, 65536.0).to(at::kHalf)};
  EXPECT_TRUE(s.unscale(h));
  std::vector<at::Tensor> k = {torch::tensor({32768.0f, 16.0f}).to(at::kHalf)};
  EXPECT_FALSE(s.unscale(k));
  EXPECT_EQ(k[0].scalar_type(), at::kFloat);
  EXPECT_FLOAT_EQ(k[0][0].item<float>(), 0.5f);
  EXPECT_FLOAT_EQ(k[0][1].item<float>(), 16.0f / 65536.0f);
}

namespace {

/// One SGD step of `chain` on a fixed batch with loss scaling; returns the loss.
struct StepResult {
  double loss;
  bool skipped;
  std::vector<std::string> flagged;
};

StepResult train_step(Chain& chain, MasterWeights& mw, LossScaler& scaler, OverflowMonitor& monitor,
                      const at::Tensor& x, const at::Tensor& target) {
  monitor.begin_pass();
  at::Tensor loss = (chain->forward(x) - target).pow(2).mean();
  scaler.scale_loss(loss).backward();
  StepResult r{loss.item<double>(), false, {}};
  for (const auto& e : monitor.events()) r.flagged.push_back(e.path);
  const bool found_inf = mw.collect_grads(scaler);
  if (!found_inf) {
    torch::NoGradGuard ng;
    for (auto& [name, p] : mw.optimizer_params()) {
      if (p.grad().defined()) p.sub_(p.grad() * 1e-2);
    }
    mw.write_back();
  }
  r.skipped = found_inf;
  mw.zero_grads();
  scaler.update(found_inf);
  if (monitor.options().auto_upcast) monitor.upcast_flagged();
  return r;
}

}  // namespace

class OverflowGuard : public ::testing::TestWithParam<bool> {};

TEST_P(OverflowGuard, FlagsExactlyTheOverflowingBlockAndUpcastKeepsTrainingFinite) {
  const bool auto_upcast = GetParam();
  torch::manual_seed(4);
  Chain chain(4);
  {
    torch::NoGradGuard ng;
    // blocks.2 maps a layer-normed input (|x| ~ 1) to 60000 +- 28000: beyond
    // fp16's 65504 for many elements, while its weights still fit fp16.
    chain->fc(2)->weight.normal_(0.0, 1.0).mul_(1e4).clamp_(-6e4, 6e4);
    chain->fc(2)->bias.fill_(6e4);
  }
  auto tables = std::vector<nn::BlockTable*>{chain->table.get()};
  apply(*chain, resolve(*chain, full_fp16_policy(/*master=*/true), {chain->table.get()}), tables);
  std::vector<std::pair<std::string, at::Tensor>> trainable;
  for (auto& item : chain->named_parameters()) trainable.emplace_back(item.key(), item.value());
  MasterWeights mw(trainable, std::vector<bool>(trainable.size(), true));
  EXPECT_EQ(mw.master_count(), static_cast<int64_t>(trainable.size()));
  LossScaler scaler;
  OverflowOptions oo;
  oo.auto_upcast = auto_upcast;
  auto monitor = OverflowMonitor::attach(*chain, tables, oo);
  at::Tensor x = torch::randn({16, 8});
  at::Tensor target = torch::randn({16, 8});

  std::vector<StepResult> steps;
  for (int i = 0; i < 6; ++i) steps.push_back(train_step(chain, mw, scaler, *monitor, x, target));

  // First pass: exactly blocks.2 is flagged (blocks.3 only passes on its inf).
  ASSERT_EQ(steps[0].flagged, std::vector<std::string>{"blocks.2"});
  EXPECT_FALSE(std::isfinite(steps[0].loss));
  EXPECT_TRUE(steps[0].skipped);
  if (!auto_upcast) {
    for (const auto& s : steps) {
      EXPECT_FALSE(std::isfinite(s.loss));
      EXPECT_TRUE(s.skipped);
    }
    EXPECT_EQ(scaler.scale(), 65536.0 / 64);  // six backoffs
    EXPECT_TRUE(monitor->upcast_paths().empty());
  } else {
    EXPECT_EQ(monitor->upcast_paths(), std::vector<std::string>{"blocks.2"});
    for (size_t i = 1; i < steps.size(); ++i) {
      EXPECT_TRUE(std::isfinite(steps[i].loss)) << "step " << i;
      EXPECT_FALSE(steps[i].skipped) << "step " << i;
      EXPECT_TRUE(steps[i].flagged.empty()) << "step " << i;
    }
    EXPECT_LT(steps.back().loss, steps[1].loss);  // it trains
    EXPECT_EQ(scaler.scale(), 32768.0);           // one backoff, then clean steps
    const auto* b2 = chain->table->find(chain->blocks[2].get());
    EXPECT_FALSE(b2->emulate_fp16);
    EXPECT_EQ(b2->compute, at::kFloat);
    for (int i : {0, 1, 3}) EXPECT_TRUE(chain->table->find(chain->blocks[i].get())->emulate_fp16) << i;
    // The fp16 weights equal their fp32 masters rounded to nearest.
    for (size_t i = 0; i < trainable.size(); ++i) {
      EXPECT_TRUE(torch::equal(trainable[i].second, mw.optimizer_params()[i].second.to(at::kHalf)));
    }
  }
}
INSTANTIATE_TEST_SUITE_P(AutoUpcast, OverflowGuard, ::testing::Values(false, true));

TEST(OverflowGuard, ThresholdFlagsLargeButFiniteOutputs) {
  torch::manual_seed(5);
  Chain chain(2);
  {
    torch::NoGradGuard ng;
    chain->fc(0)->weight.fill_(0).index_put_({0, 0}, 40000.0 / 2.0);  // output ~ 40000 > 0.5 * 65504
  }
  auto tables = std::vector<nn::BlockTable*>{chain->table.get()};
  apply(*chain, resolve(*chain, full_fp16_policy(false), {chain->table.get()}), tables);
  OverflowOptions o;
  o.threshold = 0.5;
  auto monitor = OverflowMonitor::attach(*chain, tables, o);
  at::Tensor x = torch::zeros({1, 8});
  x.index_put_({0, 0}, 10.0);  // layer norm makes element 0 ~ 2.65
  monitor->begin_pass();
  chain->forward(x);
  ASSERT_EQ(monitor->events().size(), 1u);
  EXPECT_EQ(monitor->events()[0].path, "blocks.0");
  EXPECT_FALSE(monitor->events()[0].nonfinite);
  EXPECT_GT(monitor->events()[0].max_abs, 32752.0);
  o.threshold = 1.0;  // only inf/NaN
  auto lax = OverflowMonitor::attach(*chain, tables, o);
  lax->begin_pass();
  chain->forward(x);
  EXPECT_TRUE(lax->events().empty());
  EXPECT_THROW(lax->upcast({"blocks.9"}), Error);
  lax->upcast({"blocks.1"});
  EXPECT_FALSE(chain->table->find(chain->blocks[1].get())->emulate_fp16);
}

TEST(MasterWeights, StateRoundTripAndFp32ParamsNeedNoMaster) {
  at::Tensor half = torch::randn({3, 3}).to(at::kHalf).requires_grad_(true);
  at::Tensor full = torch::randn({3}).requires_grad_(true);
  MasterWeights mw({{"a", half}, {"b", full}}, {true, true});
  EXPECT_EQ(mw.master_count(), 1);
  EXPECT_EQ(mw.master_bytes(), 36);
  EXPECT_EQ(mw.optimizer_params()[0].second.scalar_type(), at::kFloat);
  EXPECT_TRUE(mw.optimizer_params()[1].second.is_same(full));
  auto state = mw.state_tensors();
  ASSERT_EQ(state.size(), 1u);
  EXPECT_EQ(state[0].first, "a");
  at::Tensor saved = torch::full({3, 3}, 0.1f);
  mw.load_state_tensors({{"a", saved}});
  EXPECT_TRUE(torch::equal(mw.optimizer_params()[0].second, saved));
  EXPECT_TRUE(torch::equal(half, saved.to(at::kHalf)));
  EXPECT_THROW(mw.load_state_tensors({}), Error);
  // fp16 gradients reach the optimizer as unscaled fp32.
  half.mutable_grad() = torch::full({3, 3}, 2048.0).to(at::kHalf);
  LossScalerOptions o;
  o.init_scale = 1024;
  EXPECT_FALSE(mw.collect_grads(LossScaler(o)));
  EXPECT_FALSE(half.grad().defined());
  EXPECT_EQ(mw.optimizer_params()[0].second.grad().scalar_type(), at::kFloat);
  EXPECT_TRUE(torch::equal(mw.optimizer_params()[0].second.grad(), torch::full({3, 3}, 2.0f)));
}

TEST(SaveGuard, OverflowAndBulkFlushAreErrorsNamingTensors) {
  at::Tensor ok = torch::randn({100});
  at::Tensor big = torch::randn({100});
  big.index_put_({3}, 70000.0);
  big.index_put_({7}, -1e6);
  at::Tensor tiny = torch::randn({100});
  tiny.slice(0, 0, 5).fill_(1e-9);  // 5% of nonzero values flush to zero in fp16
  at::Tensor few = torch::randn({1000});
  few.index_put_({0}, 1e-9);  // 0.1%: tolerated
  NarrowingReport r = check_narrowing("big", big, Dtype::fp16);
  EXPECT_EQ(r.overflow, 2);
  EXPECT_EQ(r.max_abs, 1e6);
  EXPECT_EQ(check_narrowing("tiny", tiny, Dtype::fp16).flushed, 5);
  EXPECT_EQ(check_narrowing("big", big, Dtype::bf16).overflow, 0);  // bf16 has fp32's range
  // 65519 rounds to 65504 (finite); 65520 rounds to inf.
  EXPECT_EQ(check_narrowing("edge", torch::tensor({65519.0f, -65519.0f}), Dtype::fp16).overflow, 0);
  EXPECT_EQ(check_narrowing("edge", torch::tensor({65520.0f}), Dtype::fp16).overflow, 1);

  std::vector<std::pair<std::string, at::Tensor>> tensors = {
      {"ok", ok}, {"unet.big", big}, {"unet.tiny", tiny}, {"few", few}, {"ids", torch::arange(4)}};
  try {
    convert_for_save(tensors, Dtype::fp16, {}, "run/model.safetensors");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("run/model.safetensors"), std::string::npos) << m;
    EXPECT_NE(m.find("unet.big: 2 of 100 values overflow fp16"), std::string::npos) << m;
    EXPECT_NE(m.find("unet.tiny: 5 of 100 nonzero values"), std::string::npos) << m;
    EXPECT_EQ(m.find("few"), std::string::npos) << m;
    EXPECT_NE(m.find("save_precision_force"), std::string::npos) << m;
  }
  SaveGuardOptions force;
  force.force = true;
  auto out = convert_for_save(tensors, Dtype::fp16, force, "x");
  ASSERT_EQ(out.size(), 5u);
  EXPECT_EQ(out[1].cast, std::optional<at::ScalarType>(at::kHalf));  // converted while writing
  EXPECT_FALSE(out[4].cast.has_value());
  EXPECT_EQ(out[4].tensor.scalar_type(), at::kLong);
  EXPECT_NO_THROW(convert_for_save({{"ok", ok}, {"few", few}}, Dtype::bf16, {}, "x"));
  EXPECT_EQ(parse_save_precision("float"), Dtype::fp32);
  EXPECT_THROW(parse_save_precision("fp8"), Error);
}

TEST(Fp8, RoundingMatchesFormatDefinitions) {
  // e4m3fn: 3 mantissa bits, min normal 2^-6, max 448, subnormal step 2^-9.
  at::Tensor x = torch::tensor(
      {1.0f, 1.0625f, 1.1875f, 448.0f, 464.0f, 1000.0f, std::ldexp(1.0f, -10), std::ldexp(3.0f, -11), -0.3f});
  at::Tensor y = round_to_fp8(x, Dtype::fp8_e4m3);
  std::vector<float> want = {1.0f,
                             1.0f /*tie to even*/,
                             1.25f /*tie to even*/,
                             448.0f,
                             448.0f /*saturates*/,
                             448.0f,
                             0.0f /*half of 2^-9 ties to 0*/,
                             std::ldexp(2.0f, -10),
                             -0.3125f};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(y[i].item<float>(), want[i]) << i;
  // e5m2: 2 mantissa bits, max 57344, overflow to inf at 61440.
  at::Tensor z = round_to_fp8(torch::tensor({57344.0f, 61439.0f, 61440.0f, 1.125f, 1.375f}), Dtype::fp8_e5m2);
  EXPECT_EQ(z[0].item<float>(), 57344.0f);
  EXPECT_EQ(z[1].item<float>(), 57344.0f);
  EXPECT_TRUE(std::isinf(z[2].item<float>()));
  EXPECT_EQ(z[3].item<float>(), 1.0f);
  EXPECT_EQ(z[4].item<float>(), 1.5f);
  // Per-tensor power-of-two scale: amax 3 -> scale 2^floor(log2(448/3)) = 128.
  auto q = quantize_fp8(torch::tensor({3.0f, -1.0f, 0.01f}), Dtype::fp8_e4m3);
  EXPECT_EQ(q.scale, 128.0);
  EXPECT_EQ(q.dequantized[0].item<float>(), 3.0f);
  EXPECT_TRUE(torch::equal(q.dequantized, q.dequantized.to(at::kBFloat16).to(at::kFloat)));
  EXPECT_EQ(max_finite(Dtype::fp16), 65504.0);
  EXPECT_EQ(min_positive(Dtype::fp16), std::ldexp(1.0, -24));
}
