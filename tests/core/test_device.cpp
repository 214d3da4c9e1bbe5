// Tests of the device setting (core/device.h): parsing, and resolution
// against every kind of machine (CPU-only libtorch, CUDA libtorch without a
// device, with one or more devices), each failure naming the key, the value
// and the reason.
#include <gtest/gtest.h>

#include <string>

#include "../error_testing.h"
#include "shoestring/core/device.h"
#include "shoestring/core/error.h"

namespace shoestring {
namespace {
using testing::error_of;

TEST(DeviceSetting, ParsesEveryForm) {
  EXPECT_EQ(parse_device("auto", "device").kind, DeviceSetting::Kind::automatic);
  EXPECT_EQ(parse_device("cpu", "device").kind, DeviceSetting::Kind::cpu);
  const DeviceSetting cuda = parse_device("cuda", "device");
  EXPECT_EQ(cuda.kind, DeviceSetting::Kind::cuda);
  EXPECT_EQ(cuda.index, 0);
  const DeviceSetting three = parse_device("cuda:3", "device");
  EXPECT_EQ(three.kind, DeviceSetting::Kind::cuda);
  EXPECT_EQ(three.index, 3);
}

TEST(DeviceSetting, RefusesOtherTextNamingTheSource) {
  for (const char* bad :
       {"", "gpu", "CUDA", "cuda:", "cuda:-1", "cuda:x", "cuda:1:2", "cuda0", "cpu:0", "mps", "cuda:99999"}) {
    const std::string e = error_of([&] { parse_device(bad, "--device"); });
    EXPECT_NE(e.find("--device = \"" + std::string(bad) + "\""), std::string::npos) << e;
    EXPECT_NE(e.find("\"cuda:N\""), std::string::npos) << e;
  }
}

TEST(DeviceSetting, AutoPicksTheFirstCudaDeviceWhenThereIsOne) {
  const DeviceSetting a = parse_device("auto", "device");
  EXPECT_EQ(resolve_device(a, {false, 0}, "auto", "device"), c10::Device(c10::kCPU));
  EXPECT_EQ(resolve_device(a, {true, 0}, "auto", "device"), c10::Device(c10::kCPU));
  EXPECT_EQ(resolve_device(a, {true, 2}, "auto", "device"), c10::Device(c10::kCUDA, 0));
  EXPECT_EQ(resolve_device(parse_device("cpu", "device"), {true, 2}, "cpu", "device"), c10::Device(c10::kCPU));
  EXPECT_EQ(resolve_device(parse_device("cuda:1", "device"), {true, 2}, "cuda:1", "device"),
            c10::Device(c10::kCUDA, 1));
  EXPECT_EQ(resolve_device(parse_device("cuda", "device"), {true, 1}, "cuda", "device"), c10::Device(c10::kCUDA, 0));
}

TEST(DeviceSetting, CudaRequestsThatCannotBeMetSayWhy) {
  const DeviceSetting cuda = parse_device("cuda", "device");
  std::string e = error_of([&] { resolve_device(cuda, {false, 0}, "cuda", "device"); });
  EXPECT_NE(e.find("device = \"cuda\""), std::string::npos) << e;
  EXPECT_NE(e.find("built without CUDA"), std::string::npos) << e;
  e = error_of([&] { resolve_device(cuda, {true, 0}, "cuda", "--device"); });
  EXPECT_NE(e.find("--device = \"cuda\""), std::string::npos) << e;
  EXPECT_NE(e.find("no CUDA device"), std::string::npos) << e;
  e = error_of([&] { resolve_device(parse_device("cuda:3", "device"), {true, 1}, "cuda:3", "device"); });
  EXPECT_NE(e.find("cuda:3 but only 1 CUDA device(s)"), std::string::npos) << e;
}

TEST(DeviceSetting, ThisProcessResolvesWhatItHas) {
  const CudaAvailability here = cuda_availability();
  EXPECT_EQ(resolve_device("cpu", "device"), c10::Device(c10::kCPU));
  if (!here.built_with_cuda) {
    // This machine's libtorch (CPU-only Debian build): auto is the CPU and
    // cuda is refused with the build as the reason.
    EXPECT_EQ(resolve_device("auto", "device"), c10::Device(c10::kCPU));
    const std::string e = error_of([] { resolve_device("cuda:0", "device"); });
    EXPECT_NE(e.find("built without CUDA"), std::string::npos) << e;
  }
  EXPECT_EQ(describe_device(c10::Device(c10::kCPU)), "cpu");
}

TEST(DeviceSetting, Bf16NeedsComputeCapabilityEight) {
  EXPECT_FALSE(cuda_capability_has_bf16(6, 1));  // Pascal (GTX 10x0, P40)
  EXPECT_FALSE(cuda_capability_has_bf16(7, 0));  // V100
  EXPECT_FALSE(cuda_capability_has_bf16(7, 5));  // Turing (T4, RTX 20x0)
  EXPECT_TRUE(cuda_capability_has_bf16(8, 0));   // A100
  EXPECT_TRUE(cuda_capability_has_bf16(8, 6));   // RTX 30x0
  EXPECT_TRUE(cuda_capability_has_bf16(9, 0));   // H100
  EXPECT_FALSE(cuda_compute_capability(c10::Device(c10::kCPU)).has_value());
}

}  // namespace
}  // namespace shoestring
