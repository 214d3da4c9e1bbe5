// core/cpu_features.h: /proc/cpuinfo parsing against hand-written cpuinfo
// texts in the kernel's format (arch/x86/kernel/cpu/proc.c: "key\t\t: value"
// lines, one block per processor, flags named as in
// arch/x86/include/asm/cpufeatures.h).
#include <gtest/gtest.h>

#include <cmath>

#include "../error_testing.h"
#include "shoestring/core/cpu_features.h"
#include "shoestring/core/error.h"
#include "shoestring/core/threads.h"

using namespace shoestring;

namespace {

// An AVX2-only EPYC (the flags this project's CI machines show) followed by a
// second processor whose flags must be ignored.
const char* kAvx2Epyc =
    "processor\t: 0\n"
    "vendor_id\t: AuthenticAMD\n"
    "model name\t: AMD EPYC 7B13\n"
    "flags\t\t: fpu vme sse sse2 ssse3 fma cx16 sse4_1 sse4_2 avx f16c avx2 bmi2\n"
    "\n"
    "processor\t: 1\n"
    "model name\t: Other CPU\n"
    "flags\t\t: avx512f avx512_bf16 amx_bf16\n";

// A Sapphire Rapids Xeon: AVX-512 with BF16 and FP16, AMX tiles.
const char* kSapphireRapids =
    "processor\t: 0\n"
    "model name\t: Intel(R) Xeon(R) Platinum 8480+\n"
    "flags\t\t: fpu avx f16c fma avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16 avx512_fp16 amx_bf16 "
    "amx_tile amx_int8\n";

}  // namespace

TEST(CpuFeatures, ParsesAnAvx2OnlyCpuFromItsFirstProcessor) {
  const CpuFeatures cpu = parse_cpuinfo(kAvx2Epyc);
  EXPECT_EQ(cpu.model, "AMD EPYC 7B13");
  EXPECT_TRUE(cpu.avx2);
  EXPECT_TRUE(cpu.fma);
  EXPECT_TRUE(cpu.f16c);
  EXPECT_FALSE(cpu.avx512f);  // processor 1's flags are not this CPU's
  EXPECT_FALSE(cpu.avx512_bf16);
  EXPECT_FALSE(cpu.amx_bf16);
  EXPECT_FALSE(cpu.fast_bf16());
  EXPECT_EQ(cpu.feature_list(), "avx2 fma f16c");
  EXPECT_EQ(describe(cpu), "CPU: AMD EPYC 7B13 | features: avx2 fma f16c | bf16 units: no");
}

TEST(CpuFeatures, Bf16UnitsAreAvx512Bf16OrAmx) {
  const CpuFeatures spr = parse_cpuinfo(kSapphireRapids);
  EXPECT_EQ(spr.model, "Intel(R) Xeon(R) Platinum 8480+");
  EXPECT_TRUE(spr.avx512f && spr.avx512bw && spr.avx512vl && spr.avx512dq);
  EXPECT_TRUE(spr.avx512_bf16);
  EXPECT_TRUE(spr.avx512_fp16);
  EXPECT_TRUE(spr.amx_bf16);
  EXPECT_TRUE(spr.fast_bf16());
  // AVX-512 without its BF16 extension (Skylake-SP) has no bf16 units.
  const CpuFeatures skx = parse_cpuinfo("model name\t: Skylake\nflags\t\t: avx2 avx512f avx512bw avx512vl\n");
  EXPECT_TRUE(skx.avx512f);
  EXPECT_FALSE(skx.fast_bf16());
  // AMX alone counts.
  EXPECT_TRUE(parse_cpuinfo("flags\t: amx_bf16\n").fast_bf16());
}

TEST(CpuFeatures, MissingOrOddLinesGiveDefaults) {
  const CpuFeatures none = parse_cpuinfo("");
  EXPECT_EQ(none.model, "unknown");
  EXPECT_EQ(none.feature_list(), "none");
  // A key that only starts like "flags" is another key; an empty model name
  // stays "unknown"; a flag that only contains a name does not count.
  const CpuFeatures odd = parse_cpuinfo("model name\t:\nflagsx\t: avx2\nflags\t: xavx2 avx512f_x\n");
  EXPECT_EQ(odd.model, "unknown");
  EXPECT_FALSE(odd.avx2);
  EXPECT_FALSE(odd.avx512f);
}

TEST(CpuFeatures, ThisMachineIsDescribed) {
  const CpuFeatures& cpu = cpu_features();
  EXPECT_EQ(&cpu, &cpu_features());  // read once
  EXPECT_NE(describe(cpu).find("CPU: "), std::string::npos);
  // bf16 units imply the AVX-512 foundation or AMX.
  if (cpu.avx512_bf16) {
    EXPECT_TRUE(cpu.avx512f);
  }
}

TEST(CpuFeatures, Bf16SlowdownIsAPositiveRatio) {
  const double r = measure_bf16_matmul_slowdown(64, 1);
  EXPECT_TRUE(std::isfinite(r));
  EXPECT_GT(r, 0);
  EXPECT_NE(shoestring::testing::error_of([] { measure_bf16_matmul_slowdown(8); }).find("too small"),
            std::string::npos);
  EXPECT_NE(shoestring::testing::error_of([] { measure_bf16_matmul_slowdown(64, 0); }).find("repeats = 0"),
            std::string::npos);
}

TEST(CpuFeatures, OpenBlasKernelsFollowTheCpuWhereOpenBlasFellBack) {
  const CpuFeatures v4 = parse_cpuinfo("flags\t: avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_bf16\n");
  const CpuFeatures v3 = parse_cpuinfo("flags\t: avx2 fma f16c\n");
  const CpuFeatures v2 = parse_cpuinfo("flags\t: sse4_2 avx\n");
  // Generic fallbacks of an OpenBLAS that did not know the CPU are replaced
  // by the newest kernel set the CPU runs.
  EXPECT_EQ(openblas_core_override("Prescott", v4), "SkylakeX");
  EXPECT_EQ(openblas_core_override("Nehalem", v4), "SkylakeX");
  EXPECT_EQ(openblas_core_override("Prescott", v3), "Haswell");
  EXPECT_EQ(openblas_core_override("Sandybridge", v3), "Haswell");
  // Kernels with AVX2 or better are OpenBLAS's informed choice: kept, in any case.
  for (const char* kept : {"Haswell", "ZEN", "SkylakeX", "cooperlake", "SapphireRapids", "Excavator"}) {
    EXPECT_EQ(openblas_core_override(kept, v4), "") << kept;
  }
  // A CPU without AVX2, or no OpenBLAS: nothing to ask for.
  EXPECT_EQ(openblas_core_override("Prescott", v2), "");
  EXPECT_EQ(openblas_core_override("", v4), "");
}
