// Precision block tables of the released architectures (tiny width): which
// modules are blocks and scopes, per-block compute dtype from rules (checked
// against the whole model cast to bf16, the legacy full-bf16 path), and
// checkpoint rules that keep the gradients while storing fewer activations.
#include <set>
#include <string>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../bf16_testing.h"
#include "../nn/graph_testing.h"
#include "arch_training.h"
#include "shoestring/precision/overflow.h"
#include "shoestring/precision/policy.h"

using namespace shoestring;
namespace st = shoestring::testing;
using st::FixedBatch;
using st::TinyArch;

namespace {

precision::RuleSpec rule(const std::string& match, std::optional<std::string> compute,
                         std::optional<bool> checkpoint = std::nullopt) {
  precision::RuleSpec r;
  r.match = match;
  r.compute = std::move(compute);
  r.checkpoint = checkpoint;
  r.origin = "test";
  return r;
}

precision::Resolution configure(TinyArch& a, const std::vector<precision::RuleSpec>& rules) {
  auto policy = precision::Policy::from_specs(rules);
  auto res = precision::resolve(*a.module, policy, {a.table});
  precision::apply(*a.module, res, {a.table});
  return res;
}

const torch::nn::Module* module_at(const torch::nn::Module& root, const std::string& path) {
  for (const auto& item : root.named_modules("", /*include_self=*/true)) {
    if (item.key() == path) return item.value().get();
  }
  ADD_FAILURE() << "no module at '" << path << "'";
  return nullptr;
}

// Blocks ("block") and scopes ("scope") of the resolution, by path.
std::map<std::string, std::string> block_kinds(const precision::Resolution& res) {
  std::map<std::string, std::string> kinds;
  for (const auto& m : res.modules) {
    if (m.block) kinds[m.path] = m.checkpointable ? "block" : "scope";
  }
  return kinds;
}

int64_t sum(const std::vector<int64_t>& v) {
  int64_t s = 0;
  for (int64_t x : v) s += x;
  return s;
}

}  // namespace

// The declared blocks, counted independently from each architecture's options.
TEST(ArchBlocks, LdmDeclaresResBlocksTransformerBlocksAndScopes) {
  for (const std::string arch : {"sd15", "sdxl", "ssd1b"}) {
    TinyArch a = st::tiny_arch(arch);
    auto kinds = block_kinds(precision::resolve(*a.module, precision::Policy(), {a.table}));
    const auto& o = std::dynamic_pointer_cast<models::LdmUNetImpl>(a.module)->options();
    const int64_t levels = static_cast<int64_t>(o.channel_mult().size()), nrb = o.num_res_blocks();
    const int64_t mid = o.transformer_depth_middle();
    const int64_t res_blocks = levels * nrb + levels * (nrb + 1) + (mid >= 0 ? 2 : 1);
    const int64_t transformer_blocks =
        sum(o.transformer_depth()) + sum(o.transformer_depth_output()) + std::max<int64_t>(mid, 0);
    int64_t spatial = mid > 0 ? 1 : 0;
    for (int64_t d : o.transformer_depth()) spatial += d > 0;
    for (int64_t d : o.transformer_depth_output()) spatial += d > 0;
    int64_t blocks = 0, scopes = 0;
    for (const auto& [path, kind] : kinds) (kind == "block" ? blocks : scopes)++;
    EXPECT_EQ(blocks, res_blocks + transformer_blocks) << arch;
    EXPECT_EQ(scopes, spatial + 1) << arch;  // + the UNet itself
    EXPECT_EQ(kinds[""], "scope") << arch;
    EXPECT_EQ(kinds["input_blocks.1.0"], "block") << arch;  // a ResBlock
    EXPECT_EQ(kinds["output_blocks.0.0"], "block") << arch;
    EXPECT_EQ(kinds.count("input_blocks.0.0"), 0u) << arch;  // conv_in: not a block
    EXPECT_EQ(kinds.count("input_blocks.3.0"), 0u) << arch;  // downsample
    if (arch == "sd15") {
      EXPECT_EQ(kinds["input_blocks.1.1"], "scope");
      EXPECT_EQ(kinds["input_blocks.1.1.transformer_blocks.0"], "block");
      EXPECT_EQ(kinds["middle_block.1.transformer_blocks.0"], "block");
    } else if (arch == "sdxl") {
      // The 10-deep blocks: each transformer block on its own (layer by layer).
      EXPECT_EQ(kinds["input_blocks.7.1"], "scope");
      EXPECT_EQ(kinds["input_blocks.7.1.transformer_blocks.9"], "block");
      EXPECT_EQ(kinds["middle_block.1.transformer_blocks.9"], "block");
      EXPECT_EQ(kinds.count("input_blocks.1.1"), 0u);  // level 0 has no attention
    } else {
      EXPECT_EQ(kinds["middle_block.0"], "block");  // SSD-1B: a single middle ResBlock
      EXPECT_EQ(kinds.count("middle_block.1"), 0u);
      EXPECT_EQ(kinds["output_blocks.2.1.transformer_blocks.9"], "block");
    }
  }
}

TEST(ArchBlocks, MMDiTAndStageCDeclareTheirBlocks) {
  {
    TinyArch a = st::tiny_arch("sd35m");
    auto kinds = block_kinds(precision::resolve(*a.module, precision::Policy(), {a.table}));
    std::map<std::string, std::string> expected{{"", "scope"}};
    const int64_t depth = std::dynamic_pointer_cast<models::MMDiTImpl>(a.module)->options().depth();
    for (int64_t i = 0; i < depth; ++i) expected["joint_blocks." + std::to_string(i)] = "block";
    EXPECT_EQ(kinds, expected);
  }
  for (const std::string arch : {"cascade-c", "cascade-c-lite"}) {
    TinyArch a = st::tiny_arch(arch);
    auto kinds = block_kinds(precision::resolve(*a.module, precision::Policy(), {a.table}));
    const auto& o = std::dynamic_pointer_cast<models::StageCImpl>(a.module)->options();
    int64_t expected = 0;
    for (size_t l = 0; l < o.hidden().size(); ++l) {
      expected += (o.down_blocks()[l] + o.up_blocks()[o.hidden().size() - 1 - l]) *
                  static_cast<int64_t>(o.level_config()[l].size());
    }
    EXPECT_EQ(static_cast<int64_t>(kinds.size()), expected + 1) << arch;
    EXPECT_EQ(kinds[""], "scope");
    for (const auto& [path, kind] : kinds) {
      if (path.empty()) continue;
      EXPECT_EQ(kind, "block") << path;
      EXPECT_TRUE(path.rfind("down_blocks.", 0) == 0 || path.rfind("up_blocks.", 0) == 0) << path;
      EXPECT_EQ(std::count(path.begin(), path.end(), '.'), 2) << path;  // <list>.<level>.<i>
    }
    EXPECT_EQ(kinds["down_blocks.0.2"], "block");  // the first AttnBlock ("CTA")
    EXPECT_EQ(kinds["up_blocks.1.0"], "block");
  }
}

class ArchPrecision : public ::testing::TestWithParam<std::string> {};

// compute = "bf16" on everything with fp32 weights gives exactly the output
// of the whole model cast to bf16 (the legacy full-bf16 path) on the same,
// bf16-exact weights and bf16-rounded inputs; without the rule the model
// computes in fp32 (a different result within bf16 error).
TEST_P(ArchPrecision, ComputeBf16RuleMatchesModelCastToBf16) {
  const std::string arch = GetParam();
  TinyArch a = st::tiny_arch(arch), b = st::tiny_arch(arch);
  st::perturb(*a.module, 0.05, 1, torch::kBFloat16);
  {
    torch::NoGradGuard ng;
    auto pb = b.module->named_parameters();
    for (const auto& p : a.module->named_parameters()) pb[p.key()].copy_(p.value());
  }
  a.module->eval();
  b.module->eval();
  FixedBatch batch = st::fixed_batch(a, 8);
  torch::NoGradGuard ng;
  const torch::Tensor fp32 = a.forward(batch.x_t(), batch.sigma, batch.cond);

  configure(a, {rule("*", "bf16")});
  for (const auto& p : a.module->parameters()) ASSERT_EQ(p.scalar_type(), torch::kFloat32);  // storage unchanged
  const torch::Tensor y = a.forward(batch.x_t(), batch.sigma, batch.cond);
  EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
  EXPECT_FALSE(nn::current_compute_dtype().has_value());

  // The same inputs rounded to bf16, as the root scope rounds them.
  b.module->to(torch::kBFloat16);
  std::vector<torch::Tensor> cond;
  for (const auto& c : batch.cond) cond.push_back(c.to(torch::kBFloat16));
  const torch::Tensor ref = b.forward(batch.x_t().to(torch::kBFloat16), batch.sigma, cond).to(torch::kFloat32);
  const double scale = ref.abs().max().item<double>();
  ASSERT_GT(scale, 0.0);
  // Same weights, same input rounding, the same bf16 arithmetic: bit for bit.
  const double diff = (y.to(torch::kFloat32) - ref).abs().max().item<double>();
  EXPECT_EQ(diff, 0.0) << arch << ": bf16 rule vs model cast to bf16 (max |y| " << scale << ")";
  // The rule changed the arithmetic: the result is bf16, not the fp32 one
  // (a rule that did nothing would give exactly fp32, and fail the bit-exact
  // check above too).
  const double max_err = (y.to(torch::kFloat32) - fp32).abs().max().item<double>();
  EXPECT_GT(max_err, 0.0) << arch;
  // ... and stays within bf16 error of it. Where the CPU sums bf16 products
  // in fp32 (oneDNN, AVX-512) the whole network stays within 5% of max |y|.
  // Where it sums them in bf16 (AVX2-only), each convolution output carries
  // the error of k roundings of its running sum instead of one
  // (bf16_testing.h), with k = 9 * 256 for the tiny LDMs (measured: 8-11% of max |y|
  // for the LDMs, 1-2% for the linear-layer models); bound: 4 standard
  // deviations of the longest such dot product, 4 u sqrt((k + 1) / 6)
  // (~0.30 for k = 2304). Either bound fails a result that is not the same
  // function (wrong layer, overflow, garbage: errors of order max |y|).
  const int64_t k = st::longest_weight_reduction(*a.module);
  const double bound = st::bf16_mm_accumulates_in_fp32() ? 5e-2 : 4.0 * st::bf16_dot_relative_error(k);
  EXPECT_LE(max_err, bound * scale) << arch << ": bf16 vs fp32, longest reduction " << k
                                    << ", bf16 mm sums in fp32: " << st::bf16_mm_accumulates_in_fp32();
}

// A rule on some blocks changes exactly those: their table entries compute
// in bf16, the rest (and the root scope) in fp32, so the output stays fp32.
TEST_P(ArchPrecision, RuleOnSomeBlocksSetsOnlyThose) {
  const std::string arch = GetParam();
  TinyArch a = st::tiny_arch(arch);
  st::perturb(*a.module, 0.05, 2);
  a.module->eval();
  FixedBatch batch = st::fixed_batch(a, 8);
  torch::NoGradGuard ng;
  const torch::Tensor fp32 = a.forward(batch.x_t(), batch.sigma, batch.cond);
  std::string pattern;
  std::vector<std::string> in_rule, outside;
  if (arch == "sd35m") {
    pattern = "joint_blocks.1";
    in_rule = {"joint_blocks.1"};
    outside = {"", "joint_blocks.0", "joint_blocks.2"};
  } else if (arch.rfind("cascade", 0) == 0) {
    pattern = "down_blocks.*";
    in_rule = {"down_blocks.0.0", "down_blocks.1.2"};
    outside = {"", "up_blocks.0.0", "up_blocks.1.2"};
  } else {
    // The first SpatialTransformer of the output path, its ResBlock and its first transformer block.
    std::string st_path;
    for (const auto& item : a.module->named_modules()) {
      const std::string& k = item.key();
      if (k.rfind("output_blocks.", 0) == 0 && k.size() > 21 &&
          k.compare(k.size() - 21, 21, ".transformer_blocks.0") == 0) {
        st_path = k.substr(0, k.size() - 21);
        break;
      }
    }
    ASSERT_FALSE(st_path.empty());
    pattern = "*transformer_blocks*";
    in_rule = {st_path + ".transformer_blocks.0"};
    outside = {"", st_path, st_path.substr(0, st_path.size() - 1) + "0"};
  }
  auto res = configure(a, {rule(pattern, "bf16")});
  for (const auto& p : in_rule) {
    const auto* entry = a.table->find(module_at(*a.module, p));
    ASSERT_NE(entry, nullptr) << p;
    EXPECT_EQ(entry->compute, torch::kBFloat16) << p;
  }
  for (const auto& p : outside) {
    const auto* entry = a.table->find(module_at(*a.module, p));
    ASSERT_NE(entry, nullptr) << p;
    EXPECT_EQ(entry->compute, torch::kFloat32) << p;
  }
  const torch::Tensor y = a.forward(batch.x_t(), batch.sigma, batch.cond);
  EXPECT_EQ(y.scalar_type(), torch::kFloat32);
  const double scale = fp32.abs().max().item<double>();
  const double diff = (y - fp32).abs().max().item<double>();
  EXPECT_GT(diff, 0.0) << arch << ": the bf16 blocks must change the result";
  EXPECT_LE(diff, 5e-2 * scale) << arch;
}

// checkpoint = true by rule: the same gradients as the configured run
// without it and as the legacy (unconfigured) run, with fewer autograd nodes
// kept alive.
TEST_P(ArchPrecision, CheckpointRuleKeepsGradients) {
  const std::string arch = GetParam();
  auto grads = [&](int mode, size_t* nodes) {  // 0 legacy, 1 configured, 2 configured + checkpoint
    torch::manual_seed(11);
    TinyArch a = st::tiny_arch(arch);
    st::perturb(*a.module, 0.02, 3);
    if (mode == 1) configure(a, {rule("*", "fp32")});
    if (mode == 2) configure(a, {rule("*", "fp32", true)});
    a.module->train();
    FixedBatch batch = st::fixed_batch(a, 8);
    torch::Tensor loss = st::eps_loss(a, batch);
    if (nodes) *nodes = st::count_graph_nodes(loss);
    loss.backward();
    std::vector<torch::Tensor> g;
    for (const auto& p : a.module->parameters())
      g.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
    return g;
  };
  size_t plain_nodes = 0, ckpt_nodes = 0;
  auto legacy = grads(0, nullptr), plain = grads(1, &plain_nodes), ckpt = grads(2, &ckpt_nodes);
  ASSERT_EQ(plain.size(), ckpt.size());
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_TRUE(torch::allclose(plain[i], ckpt[i], 1e-5, 1e-7)) << arch << " parameter " << i;
    EXPECT_TRUE(torch::allclose(legacy[i], plain[i], 1e-5, 1e-7)) << arch << " parameter " << i;
  }
  EXPECT_LT(ckpt_nodes * 2, plain_nodes) << arch << ": checkpointed " << ckpt_nodes << " nodes, plain " << plain_nodes;
}

INSTANTIATE_TEST_SUITE_P(Tiny, ArchPrecision, ::testing::Values("sd15", "sdxl", "ssd1b", "sd35m", "cascade-c"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (auto& c : n) c = c == '-' ? '_' : c;
                           return n;
                         });

// Checkpoint rule on SDXL's transformer blocks only: each of the 10-deep
// blocks is checkpointed on its own, ResBlocks are not.
TEST(ArchBlocks, SdxlTransformerBlockCheckpointRule) {
  TinyArch a = st::tiny_arch("sdxl");
  configure(a, {rule("*transformer_blocks*", std::nullopt, true)});
  EXPECT_TRUE(a.table->find(module_at(*a.module, "input_blocks.7.1.transformer_blocks.3"))->checkpoint);
  EXPECT_FALSE(a.table->find(module_at(*a.module, "input_blocks.7.0"))->checkpoint);
  // The scope is not checkpointable even under a matching rule.
  configure(a, {rule("*", std::nullopt, true)});
  EXPECT_TRUE(a.table->find(module_at(*a.module, "input_blocks.7.1"))->checkpoint);
  EXPECT_FALSE(a.table->is_checkpointable(module_at(*a.module, "input_blocks.7.1")));
}

// fp16 compute (emulated on the CPU) with the overflow monitor: a joint block
// of MMDiT whose MLP output exceeds fp16's range is flagged by path, the
// blocks after it (that only pass the inf on) and the enclosing root scope are
// not; upcast_flagged() moves exactly that block to fp32 compute.
TEST(ArchBlocks, Fp16OverflowMonitorNamesTheMMDiTJointBlock) {
  TinyArch a = st::tiny_arch("sd35m");
  st::perturb(*a.module, 0.02, 8);
  auto params = a.module->named_parameters();
  const int64_t H = std::dynamic_pointer_cast<models::MMDiTImpl>(a.module)->options().hidden();
  {
    torch::NoGradGuard ng;
    params["joint_blocks.1.x_block.mlp.fc2.bias"].fill_(7e4);  // beyond 65504
    // The MLP gate (adaLN chunk 5 of 9 in an attn2 block) near 1.
    params["joint_blocks.1.x_block.adaLN_modulation.1.bias"].narrow(0, 5 * H, H).fill_(1.0);
  }
  configure(a, {rule("*", "fp16")});
  const auto* block1 = a.table->find(module_at(*a.module, "joint_blocks.1"));
  ASSERT_NE(block1, nullptr);
  EXPECT_TRUE(block1->emulate_fp16);
  precision::OverflowOptions oo;
  auto monitor = precision::OverflowMonitor::attach(*a.module, {a.table}, oo);
  a.module->eval();
  FixedBatch batch = st::fixed_batch(a, 8);
  torch::NoGradGuard ng;
  monitor->begin_pass();
  torch::Tensor y = a.forward(batch.x_t(), batch.sigma, batch.cond);
  EXPECT_FALSE(torch::isfinite(y).all().item<bool>());
  ASSERT_EQ(monitor->events().size(), 1u);
  EXPECT_EQ(monitor->events()[0].path, "joint_blocks.1");
  EXPECT_TRUE(monitor->events()[0].nonfinite);

  EXPECT_EQ(monitor->upcast_flagged(), std::vector<std::string>{"joint_blocks.1"});
  EXPECT_EQ(a.table->find(module_at(*a.module, "joint_blocks.1"))->compute, torch::kFloat32);
  EXPECT_FALSE(a.table->find(module_at(*a.module, "joint_blocks.1"))->emulate_fp16);
  // The other blocks keep emulating fp16.
  EXPECT_TRUE(a.table->find(module_at(*a.module, "joint_blocks.0"))->emulate_fp16);
  EXPECT_TRUE(a.table->find(module_at(*a.module, "joint_blocks.2"))->emulate_fp16);
}
