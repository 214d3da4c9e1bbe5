// precision/compute_choice.h and Policy's compute substitution: which compute
// dtype runs where the rules say bf16, per precision.bf16_compute and the
// hardware; storage, trainable and master are never changed by it.
#include <gtest/gtest.h>

#include "../error_testing.h"
#include "shoestring/core/cpu_features.h"
#include "shoestring/precision/compute_choice.h"
#include "shoestring/precision/policy.h"

using namespace shoestring;
using namespace shoestring::precision;

namespace {

ComputeHardware hardware(bool bf16_units) {
  CpuFeatures cpu;
  cpu.model = "Test CPU";
  cpu.avx2 = true;
  cpu.avx512f = cpu.avx512_bf16 = bf16_units;
  return cpu_hardware(cpu);
}

/// full_bf16's rule, then a user rule: fp16 compute for "head.*".
Policy full_bf16_with_fp16_head() {
  std::vector<RuleSpec> specs = shorthand_rules("no", /*full_bf16=*/true, false, false);
  RuleSpec head;
  head.match = "head";
  head.compute = "fp16";
  specs.push_back(head);
  return Policy::from_specs(specs);
}

}  // namespace

TEST(ComputeChoice, ParsesTheThreeValuesAndNamesTheKeyOtherwise) {
  EXPECT_EQ(parse_bf16_compute("auto"), Bf16Compute::automatic);
  EXPECT_EQ(parse_bf16_compute("bf16"), Bf16Compute::bf16);
  EXPECT_EQ(parse_bf16_compute("fp32"), Bf16Compute::fp32);
  const std::string e = shoestring::testing::error_of([] { parse_bf16_compute("BF16"); });
  EXPECT_NE(e.find("precision.bf16_compute"), std::string::npos) << e;
  EXPECT_NE(e.find("\"BF16\""), std::string::npos) << e;
}

TEST(ComputeChoice, AutoSubstitutesFp32OnlyWithoutBf16Units) {
  EXPECT_FALSE(choose_bf16_compute(Bf16Compute::automatic, hardware(true)));
  const auto slow = choose_bf16_compute(Bf16Compute::automatic, hardware(false));
  ASSERT_TRUE(slow);
  EXPECT_EQ(slow->from, Dtype::bf16);
  EXPECT_EQ(slow->to, Dtype::fp32);
  EXPECT_NE(slow->reason.find("CPU Test CPU has no AVX-512 BF16 / AMX BF16"), std::string::npos) << slow->reason;
  // "bf16" insists everywhere; "fp32" substitutes everywhere.
  EXPECT_FALSE(choose_bf16_compute(Bf16Compute::bf16, hardware(false)));
  ASSERT_TRUE(choose_bf16_compute(Bf16Compute::fp32, hardware(true)));
  EXPECT_EQ(choose_bf16_compute(Bf16Compute::fp32, hardware(true))->to, Dtype::fp32);
}

TEST(ComputeChoice, InsistingOnASlowCpuWarnsWithTheMeasuredSlowdown) {
  const std::string w = bf16_compute_warning(Bf16Compute::bf16, hardware(false), 14.64);
  EXPECT_NE(w.find("14.6x slower than fp32"), std::string::npos) << w;
  EXPECT_NE(w.find("Test CPU"), std::string::npos) << w;
  EXPECT_EQ(w.find('\n'), std::string::npos) << "one line";
  EXPECT_EQ(bf16_compute_warning(Bf16Compute::bf16, hardware(true), 0.5), "");
  EXPECT_EQ(bf16_compute_warning(Bf16Compute::automatic, hardware(false), 14), "");
}

TEST(ComputeChoice, SubstitutionChangesOnlyBf16ComputeAndKeepsStorage) {
  Policy policy = full_bf16_with_fp16_head();
  EXPECT_EQ(policy.resolve("down.0").compute, Dtype::bf16);
  policy.set_compute_substitution(*choose_bf16_compute(Bf16Compute::automatic, hardware(false)));
  const Settings body = policy.resolve("down.0.conv.weight");
  EXPECT_EQ(body.compute, Dtype::fp32);
  EXPECT_TRUE(body.compute_substituted);
  EXPECT_EQ(body.compute_rule, 1);       // still the full_bf16 rule's key
  EXPECT_EQ(body.storage, Dtype::bf16);  // bf16 weights keep their memory saving
  EXPECT_FALSE(body.master_fp32);        // and their stochastically rounded updates
  EXPECT_NE(body.describe().find("compute fp32 (substituted)"), std::string::npos) << body.describe();
  const Settings head = policy.resolve("head.weight");
  EXPECT_EQ(head.compute, Dtype::fp16);  // only bf16 is substituted
  EXPECT_FALSE(head.compute_substituted);
  EXPECT_EQ(head.storage, Dtype::bf16);
}
