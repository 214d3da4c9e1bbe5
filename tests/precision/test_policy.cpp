// Precision rules: glob matching, resolution order, shorthands, validation
// errors, application to a module tree, and the explain table.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/memory_ledger.h"
#include "shoestring/nn/block_precision.h"
#include "shoestring/nn/layers.h"
#include "shoestring/precision/policy.h"

using namespace shoestring;
using namespace shoestring::precision;

namespace {

precision::RuleSpec spec(std::string match) {
  precision::RuleSpec r;
  r.match = std::move(match);
  r.origin = "test.toml";
  return r;
}

/// down.{0,1}.{conv,norm} + head, with down.0 and down.1 declared as blocks.
struct TreeImpl : torch::nn::Module {
  TreeImpl() {
    down = register_module("down", torch::nn::ModuleList());
    for (int i = 0; i < 2; ++i) {
      auto level = std::make_shared<torch::nn::Module>();
      level->register_module("conv", nn::Conv2d(4, 4, 3, 1, 1));
      level->register_module("norm", nn::GroupNorm(2, 4));
      down->push_back(level);
    }
    head = register_module("head", nn::Linear(4, 2));
    table = std::make_shared<nn::BlockTable>();
    table->declare(down[0].get());
    table->declare(down[1].get());
  }
  torch::nn::ModuleList down{nullptr};
  nn::Linear head{nullptr};
  std::shared_ptr<nn::BlockTable> table;
};
TORCH_MODULE(Tree);

}  // namespace

TEST(Glob, AnchoredStarAndQuestionMark) {
  EXPECT_TRUE(glob_match("*", ""));
  EXPECT_TRUE(glob_match("*", "unet.down.0"));
  EXPECT_TRUE(glob_match("*resblock*", "model.resblock.3.conv"));
  EXPECT_TRUE(glob_match("down.1.*", "down.1.res.0"));
  EXPECT_FALSE(glob_match("down.1.*", "down.1"));
  EXPECT_FALSE(glob_match("down.1.*", "unet.down.1.res"));  // anchored
  EXPECT_TRUE(glob_match("*.bias", "a.b.bias"));
  EXPECT_FALSE(glob_match("*.bias", "a.b.bias2"));
  EXPECT_TRUE(glob_match("down.?.conv", "down.7.conv"));
  EXPECT_FALSE(glob_match("down.?.conv", "down.10.conv"));
  EXPECT_TRUE(glob_match("a*b*c", "axxbyyc"));
  EXPECT_FALSE(glob_match("a*b*c", "axxbyy"));
}

TEST(Policy, LaterRulesWinKeyByKeyAndAncestorsApply) {
  auto r1 = spec("*");
  r1.storage = "fp16";
  r1.compute = "fp16";
  auto r2 = spec("down.1");
  r2.storage = "fp32";
  r2.trainable = false;
  r2.checkpoint = true;
  auto r3 = spec("*.bias");
  r3.storage = "bf16";
  Policy p = Policy::from_specs({r1, r2, r3});

  Settings a = p.resolve("down.0.conv.weight");
  EXPECT_EQ(a.storage, Dtype::fp16);
  EXPECT_EQ(a.compute, Dtype::fp16);
  EXPECT_TRUE(a.trainable);
  EXPECT_EQ(a.storage_rule, 1);

  Settings b = p.resolve("down.1.conv.weight");  // rule 2 applies through the ancestor down.1
  EXPECT_EQ(b.storage, Dtype::fp32);
  EXPECT_EQ(b.compute, Dtype::fp16);  // rule 2 does not set compute: rule 1 stays
  EXPECT_FALSE(b.trainable);
  EXPECT_TRUE(b.checkpoint);
  EXPECT_EQ(b.storage_rule, 2);
  EXPECT_EQ(b.compute_rule, 1);

  Settings c = p.resolve("down.1.conv.bias");  // rule 3 is later than rule 2
  EXPECT_EQ(c.storage, Dtype::bf16);
  EXPECT_EQ(c.storage_rule, 3);

  Settings d = Policy().resolve("x.y");
  EXPECT_EQ(d.storage, Dtype::fp32);
  EXPECT_TRUE(d.trainable);
  EXPECT_FALSE(d.checkpoint);
  EXPECT_FALSE(d.master_fp32);
}

TEST(Policy, ShorthandsExpandToRules) {
  auto rules = shorthand_rules("bf16", false, false, true);
  ASSERT_EQ(rules.size(), 2u);
  EXPECT_EQ(rules[0].match, "*");
  EXPECT_EQ(*rules[0].compute, "bf16");
  EXPECT_FALSE(rules[0].storage.has_value());
  EXPECT_TRUE(*rules[1].checkpoint);

  auto full = shorthand_rules("no", true, false, false);
  ASSERT_EQ(full.size(), 1u);
  EXPECT_EQ(*full[0].storage, "bf16");
  EXPECT_EQ(*full[0].compute, "bf16");
  EXPECT_EQ(*full[0].master, "none");

  auto fp16 = shorthand_rules("fp16", false, true, false);
  ASSERT_EQ(fp16.size(), 2u);
  EXPECT_EQ(*fp16[1].storage, "fp16");
  EXPECT_TRUE(shorthand_rules("no", false, false, false).empty());
  EXPECT_THROW(shorthand_rules("no", true, true, false), Error);
  EXPECT_THROW(shorthand_rules("fp8", false, false, false), Error);

  // A user rule placed after the shorthand overrides it.
  auto user = spec("head*");
  user.storage = "fp32";
  full.push_back(user);
  Policy p = Policy::from_specs(full);
  EXPECT_EQ(p.resolve("head.weight").storage, Dtype::fp32);
  EXPECT_EQ(p.resolve("down.0.conv.weight").storage, Dtype::bf16);
}

TEST(Policy, ContradictionsAndUnknownNamesAreErrorsNamingRuleAndKey) {
  auto expect_error = [](std::vector<RuleSpec> specs, std::vector<std::string> needles) {
    try {
      Policy::from_specs(specs);
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      for (const auto& n : needles)
        EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << e.what() << " lacks " << n;
    }
  };
  auto ok = spec("*");
  auto bad_storage = spec("*attn*");
  bad_storage.storage = "float16";
  expect_error({ok, bad_storage}, {"rule 2", "*attn*", "storage", "float16", "test.toml"});
  auto bad_compute = spec("*");
  bad_compute.compute = "fp8_e4m3";
  expect_error({bad_compute}, {"rule 1", "compute", "fp8_e4m3"});
  auto fp8_trainable = spec("*resblock*");
  fp8_trainable.storage = "fp8_e4m3";
  fp8_trainable.trainable = true;
  expect_error({fp8_trainable}, {"rule 1", "*resblock*", "storage", "trainable"});
  auto fp8_master = spec("*");
  fp8_master.storage = "fp8_e5m2";
  fp8_master.trainable = false;
  fp8_master.master = "fp32";
  expect_error({fp8_master}, {"master", "fp8_e5m2"});
  auto bad_master = spec("*");
  bad_master.master = "fp16";
  expect_error({bad_master}, {"master", "fp16"});
  expect_error({spec("")}, {"match"});

  // master = fp32 with fp32 storage is fine.
  auto fine = spec("*");
  fine.storage = "fp32";
  fine.master = "fp32";
  EXPECT_NO_THROW(Policy::from_specs({fine}));

  // fp8 on a parameter that is trainable after resolution: error at resolve().
  Tree tree;
  auto fp8 = spec("down.0.*");
  fp8.storage = "fp8_e4m3";
  Policy p = Policy::from_specs({fp8});
  try {
    resolve(*tree, p, {tree->table.get()});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("down.0.conv.weight"), std::string::npos) << m;
    EXPECT_NE(m.find("rule 1"), std::string::npos) << m;
    EXPECT_NE(m.find("trainable"), std::string::npos) << m;
  }
  fp8.trainable = false;
  EXPECT_NO_THROW(resolve(*tree, Policy::from_specs({fp8}), {tree->table.get()}));
}

TEST(Policy, UnmatchedRuleIsAWarningNamingThePattern) {
  Tree tree;
  auto r = spec("conv.*");  // paths are down.N.conv.*: anchored glob misses
  r.storage = "bf16";
  auto res = resolve(*tree, Policy::from_specs({spec("*"), r}), {tree->table.get()});
  ASSERT_EQ(res.warnings.size(), 1u);
  EXPECT_NE(res.warnings[0].find("conv.*"), std::string::npos) << res.warnings[0];
  EXPECT_NE(res.warnings[0].find("rule 2"), std::string::npos) << res.warnings[0];
  EXPECT_NE(res.warnings[0].find("*.conv.*"), std::string::npos) << res.warnings[0];  // suggestion
}

TEST(Policy, ApplyCastsStorageFreezesAndConfiguresBlocks) {
  torch::manual_seed(0);
  Tree tree;
  auto all = spec("*");
  all.storage = "fp16";
  all.compute = "fp16";
  auto d1 = spec("down.1");
  d1.compute = "bf16";
  d1.trainable = false;
  d1.checkpoint = true;
  auto head = spec("head.*");
  head.storage = "fp8_e4m3";
  head.trainable = false;
  Policy p = Policy::from_specs({all, d1, head});
  auto res = resolve(*tree, p, {tree->table.get()});
  EXPECT_TRUE(res.warnings.empty());
  const at::Tensor head_before = tree->head->weight.detach().clone();
  apply(*tree, res, {tree->table.get()});

  EXPECT_EQ(tree->named_parameters()["down.0.conv.weight"].scalar_type(), at::kHalf);
  EXPECT_TRUE(tree->named_parameters()["down.0.conv.weight"].requires_grad());
  EXPECT_FALSE(tree->named_parameters()["down.1.conv.weight"].requires_grad());
  // A Linear's fp8 weight is one byte per element (the fp8 bit patterns of
  // weight * scale) plus the scale in the layer; its bias keeps its fp8 values
  // in a bf16 container.
  const at::Tensor hw = tree->head->weight;
  EXPECT_EQ(hw.element_size(), 1);
  EXPECT_EQ(hw.scalar_type(), fp8_packed_dtype(Dtype::fp8_e4m3));
  EXPECT_FALSE(hw.requires_grad());
  ASSERT_TRUE(tree->head->weight_fp8.has_value());
  auto q = quantize_fp8(head_before, Dtype::fp8_e4m3);
  EXPECT_EQ(tree->head->weight_fp8->scale, q.scale);
  EXPECT_EQ(tree->head->weight_fp8->format, Fp8Format::e4m3fn);
  EXPECT_TRUE(torch::equal(nn::dequantize_fp8(hw, *tree->head->weight_fp8, at::kFloat), q.dequantized));
  EXPECT_TRUE(torch::equal(q.dequantized, round_to_fp8(head_before * q.scale, Dtype::fp8_e4m3) / q.scale));
  EXPECT_EQ(tree->head->bias.scalar_type(), at::kBFloat16);

  const nn::BlockPrecision* b0 = tree->table->find(tree->down[0].get());
  const nn::BlockPrecision* b1 = tree->table->find(tree->down[1].get());
  ASSERT_TRUE(b0 && b1);
  EXPECT_TRUE(b0->emulate_fp16);  // CPU: fp16 compute is emulated
  EXPECT_EQ(b0->compute, at::kFloat);
  EXPECT_FALSE(b0->checkpoint);
  EXPECT_FALSE(b1->emulate_fp16);
  EXPECT_EQ(b1->compute, at::kBFloat16);
  EXPECT_TRUE(b1->checkpoint);

  // Bytes: subtree sums in the storage containers.
  const ModuleRow* root = nullptr;
  const ModuleRow* d0 = nullptr;
  for (const auto& m : res.modules) {
    if (m.path.empty()) root = &m;
    if (m.path == "down.0") d0 = &m;
  }
  ASSERT_TRUE(root && d0);
  const int64_t d0_params = 4 * 4 * 9 + 4 + 4 + 4;  // conv w+b, norm w+b
  EXPECT_EQ(d0->parameters, d0_params);
  EXPECT_EQ(d0->weight_bytes, 2 * d0_params);
  EXPECT_EQ(d0->trainable_parameters, d0_params);
  EXPECT_TRUE(d0->block);
  EXPECT_EQ(root->parameters, 2 * d0_params + 4 * 2 + 2);
  EXPECT_EQ(root->trainable_parameters, d0_params);
  // Stored bytes: fp16 everywhere but the head: weight 1 byte each (packed), bias 2 (bf16 container).
  EXPECT_EQ(root->weight_bytes, 2 * (2 * d0_params) + 4 * 2 * 1 + 2 * 2);
  for (const auto& prow : res.params) EXPECT_EQ(prow.fp8_packed, prow.path == "head.weight") << prow.path;

  const std::string text = format_explain(res, p);
  EXPECT_NE(text.find("down.1 [block Module]"), std::string::npos) << text;
  EXPECT_NE(text.find("rule 3 ('head.*', test.toml): applies to 10 parameters"), std::string::npos) << text;
}

TEST(Policy, MasterBytesCountOnlyLowPrecisionTrainable) {
  Tree tree;
  auto all = spec("*");
  all.storage = "fp16";
  all.master = "fp32";
  auto frozen = spec("head");
  frozen.trainable = false;
  auto res = resolve(*tree, Policy::from_specs({all, frozen}), {tree->table.get()});
  const int64_t total = tree->parameters().size() ? [&] {
    int64_t n = 0;
    for (auto& p : tree->parameters()) n += p.numel();
    return n;
  }() : 0;
  EXPECT_EQ(res.modules[0].master_bytes, 4 * (total - 10));  // head (8 + 2) is frozen
}

TEST(Policy, Fp8WeightsTakeOneBytePerElementInTheLedger) {
  // The weights category after apply: 1 byte per Linear / Conv2d weight
  // element, 2 per fp8 value kept in a bf16 container (biases, norms).
  auto& ledger = MemoryLedger::global();
  ledger.install();
  const int64_t outside = ledger.current_bytes(MemoryCategory::weights);
  ScopedMemoryCategory category(MemoryCategory::weights);
  {
    Tree tree;
    const int64_t fp32_bytes = 4 * nn::parameter_count(*tree);
    ASSERT_EQ(ledger.current_bytes(MemoryCategory::weights) - outside, fp32_bytes);
    auto all = spec("*");
    all.storage = "fp8_e5m2";
    all.trainable = false;
    auto res = resolve(*tree, Policy::from_specs({all}), {tree->table.get()});
    apply(*tree, res, {tree->table.get()});
    const int64_t conv_w = 4 * 4 * 9, head_w = 4 * 2;
    const int64_t packed = 2 * conv_w + head_w;
    const int64_t container = nn::parameter_count(*tree) - packed;  // conv biases, norms, head bias
    EXPECT_EQ(ledger.current_bytes(MemoryCategory::weights) - outside, packed * 1 + container * 2);
    EXPECT_EQ(res.modules[0].weight_bytes, packed * 1 + container * 2);
  }
  EXPECT_EQ(ledger.current_bytes(MemoryCategory::weights), outside);
}

// `kind` selects modules by class where paths cannot: Stable Cascade's stage C
// numbers its blocks (ResBlock, TimestepBlock, AttnBlock, ...), so "ResBlocks
// in fp32, frozen, checkpointed; the rest fp16" (the fp16 forum recipe) needs
// it. Every parameter under a CascadeResBlock follows the rule, no other does.
TEST(Policy, KindSelectsModulesByClass) {
  Tree tree;  // Conv2d, GroupNorm, Linear, ModuleList
  EXPECT_EQ(module_kind(*tree->down[0]->children()[0]), "Conv2d");
  EXPECT_EQ(module_kind(*tree->head), "Linear");
  auto all = spec("*");
  all.storage = "fp16";
  all.compute = "fp16";
  auto convs = spec("*");
  convs.kind = "Conv2d";
  convs.storage = "fp32";
  convs.trainable = false;
  auto none = spec("down.*");
  none.kind = "Linear";  // no Linear below down: a warning naming the kinds there
  Policy p = Policy::from_specs({all, convs, none});
  Resolution r = resolve(*tree, p, {tree->table.get()});
  for (const auto& row : r.params) {
    const bool conv = row.path.find(".conv.") != std::string::npos;
    EXPECT_EQ(row.settings.storage, conv ? Dtype::fp32 : Dtype::fp16) << row.path;
    EXPECT_EQ(row.settings.trainable, !conv) << row.path;
  }
  ASSERT_EQ(r.warnings.size(), 1u);
  EXPECT_NE(r.warnings[0].find("rule 3 ('down.*' kind Linear, test.toml) matches no module"), std::string::npos)
      << r.warnings[0];
  EXPECT_NE(r.warnings[0].find("Conv2d"), std::string::npos) << r.warnings[0];
  auto empty = spec("*");
  empty.kind = "";
  EXPECT_THROW(Policy::from_specs({empty}), Error);
  // A kind no module has (a misspelling) is an error naming the blocks' kinds.
  auto typo = spec("*");
  typo.kind = "Conv2D";
  try {
    resolve(*tree, Policy::from_specs({typo}), {tree->table.get()});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no module of this model is of kind Conv2D (its blocks' kinds: Module)"),
              std::string::npos)
        << e.what();
  }
  // Block settings follow kind rules too: a block is a module of its kind.
  auto blocks = spec("down.*");
  blocks.kind = "Module";
  blocks.compute = "bf16";
  blocks.checkpoint = true;
  Resolution rb = resolve(*tree, Policy::from_specs({blocks}), {tree->table.get()});
  for (const auto& m : rb.modules) {
    if (m.path == "down.0" || m.path == "down.1") {
      EXPECT_TRUE(m.block);
      EXPECT_EQ(m.settings.compute, Dtype::bf16) << m.path;
      EXPECT_TRUE(m.settings.checkpoint) << m.path;
    }
    if (m.path == "head") {
      EXPECT_EQ(m.settings.compute, Dtype::fp32);
    }
  }
  // Without a kind lookup a kind rule applies nowhere.
  EXPECT_EQ(p.resolve("down.0.conv.weight").storage, Dtype::fp16);
}
