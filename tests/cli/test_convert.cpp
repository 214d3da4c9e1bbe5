// `shoestring convert`: LDM <-> diffusers round trips on tiny-width SD 1.5 /
// SDXL UNets and the VAE (same block structure and key names as the released
// models, small channels), dtype conversion through the range guard, and the
// errors a user meets.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>
#include "run_cli.h"

#include <array>
#include <cstdio>
#include <filesystem>

#include <torch/torch.h>

#include "shoestring/io/safetensors.h"
#include "shoestring/io/weight_files.h"
#include "shoestring/models/architecture.h"

namespace fs = std::filesystem;

namespace {

using Result = shoestring::testing::CliResult;

Result run(const std::string& args) { return shoestring::testing::run_cli(args); }

struct Dir {
  fs::path path;
  Dir() {
    path = fs::temp_directory_path() / ("shoestring_convert_" + std::to_string(::getpid()) + "_" +
                                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~Dir() { fs::remove_all(path); }
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

// Full single-file keys ("model.diffusion_model.*" / "first_stage_model.*") of
// tiny-width models with random values.
std::vector<shoestring::NamedTensor> tiny_checkpoint(const std::vector<std::string>& archs) {
  std::vector<shoestring::NamedTensor> out;
  torch::manual_seed(1);
  for (const auto& arch : archs) {
    auto root = shoestring::models::build_checkpoint_root(arch, {}, /*tiny=*/true);
    for (const auto& p : root->named_parameters()) out.push_back({p.key(), p.value().detach().clone(), {}});
  }
  return out;
}

}  // namespace

TEST(Convert, UNetRoundTripLdmDiffusersLdmIsExact) {
  for (const std::string arch : {"sd15", "sdxl"}) {
    Dir dir;
    auto tensors = tiny_checkpoint({arch, "vae"});
    shoestring::save_safetensors(dir / "full.safetensors", tensors);
    // A full file holds two models: the user must pick one.
    Result r = run("convert " + (dir / "full.safetensors") + " --to diffusers " + (dir / "unet.safetensors"));
    EXPECT_NE(r.code, 0);
    EXPECT_NE(r.output.find("--component"), std::string::npos) << r.output;
    r = run("convert " + (dir / "full.safetensors") + " --to diffusers --component unet " + (dir / "unet.safetensors"));
    ASSERT_EQ(r.code, 0) << r.output;
    auto diff = shoestring::load_safetensors(dir / "unet.safetensors");
    EXPECT_TRUE(diff.count("down_blocks.0.resnets.0.norm1.weight")) << arch;
    EXPECT_TRUE(diff.count("conv_in.weight"));
    EXPECT_TRUE(diff.count("time_embedding.linear_1.weight"));
    r = run("convert " + (dir / "unet.safetensors") + " --to ldm " + (dir / "back.safetensors"));
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find(arch), std::string::npos) << r.output;
    auto back = shoestring::load_safetensors(dir / "back.safetensors");
    size_t unet_tensors = 0;
    for (const auto& t : tensors) {
      if (t.name.rfind("model.diffusion_model.", 0) != 0) continue;
      ++unet_tensors;
      ASSERT_TRUE(back.count(t.name)) << t.name;
      EXPECT_TRUE(torch::equal(back.at(t.name), t.tensor)) << t.name;
    }
    EXPECT_EQ(back.size(), unet_tensors);
    EXPECT_EQ(diff.size(), unet_tensors);
  }
}

TEST(Convert, VaeAttentionWeightsChangeShapeBothWays) {
  Dir dir;
  auto tensors = tiny_checkpoint({"vae"});
  shoestring::save_safetensors(dir / "vae.safetensors", tensors);
  Result r = run("convert " + (dir / "vae.safetensors") + " --to diffusers " + (dir / "d.safetensors"));
  ASSERT_EQ(r.code, 0) << r.output;
  auto d = shoestring::load_safetensors(dir / "d.safetensors");
  ASSERT_TRUE(d.count("encoder.mid_block.attentions.0.to_q.weight"));
  EXPECT_EQ(d.at("encoder.mid_block.attentions.0.to_q.weight").dim(), 2);  // Linear in diffusers
  r = run("convert " + (dir / "d.safetensors") + " --to ldm " + (dir / "l.safetensors"));
  ASSERT_EQ(r.code, 0) << r.output;
  auto l = shoestring::load_safetensors(dir / "l.safetensors");
  for (const auto& t : tensors) {
    ASSERT_TRUE(l.count(t.name)) << t.name;
    EXPECT_TRUE(torch::equal(l.at(t.name), t.tensor)) << t.name;  // 1x1 conv again
  }
}

TEST(Convert, DtypeGoesThroughTheRangeGuard) {
  Dir dir;
  auto tensors = tiny_checkpoint({"sd15"});
  shoestring::save_safetensors(dir / "ok.safetensors", tensors);
  Result r = run("convert " + (dir / "ok.safetensors") + " --to diffusers --dtype bf16 " + (dir / "b.safetensors"));
  ASSERT_EQ(r.code, 0) << r.output;
  shoestring::WeightFiles b = shoestring::WeightFiles::open(dir / "b.safetensors");
  EXPECT_EQ(b.find("conv_in.weight")->dtype, shoestring::StDtype::BF16);
  // A weight beyond fp16's range: refused, no output file, unless --force.
  for (auto& t : tensors) {
    if (t.name == "model.diffusion_model.input_blocks.0.0.weight") t.tensor.view(-1)[0] = 1e6;
  }
  shoestring::save_safetensors(dir / "big.safetensors", tensors);
  r = run("convert " + (dir / "big.safetensors") + " --to diffusers --dtype fp16 " + (dir / "h.safetensors"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("conv_in.weight"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir / "h.safetensors"));
  r = run("convert " + (dir / "big.safetensors") + " --to diffusers --dtype fp16 --force " + (dir / "h.safetensors"));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir / "h.safetensors"));
}

TEST(Convert, BadInputsAreClearErrors) {
  Dir dir;
  shoestring::save_safetensors(dir / "junk.safetensors", {{"foo.weight", torch::ones({2}), {}}});
  Result r = run("convert " + (dir / "junk.safetensors") + " --to diffusers " + (dir / "o.safetensors"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("holds no SD 1.5"), std::string::npos) << r.output;
  r = run("convert " + (dir / "junk.safetensors") + " --to ldm " + (dir / "o.safetensors"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("not a diffusers-layout UNet or VAE"), std::string::npos) << r.output;
  r = run("convert " + (dir / "junk.safetensors") + " --to onnx " + (dir / "o.safetensors"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("ldm or diffusers"), std::string::npos) << r.output;
  // The same file spelled another way is still the same file: never overwritten.
  const std::string before = shoestring::load_safetensors(dir / "junk.safetensors").begin()->first;
  r = run("convert " + (dir / "junk.safetensors") + " " + dir.path.string() + "/./junk.safetensors --to diffusers");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("same file"), std::string::npos) << r.output;
  EXPECT_EQ(shoestring::load_safetensors(dir / "junk.safetensors").begin()->first, before);
  r = run("convert " + (dir / "junk.safetensors") + " --to diffusers --dtype fp12 " + (dir / "o.safetensors"));
  EXPECT_NE(r.output.find("--dtype must be keep, fp32, bf16 or fp16"), std::string::npos) << r.output;
  r = run("convert " + (dir / "junk.safetensors") + " --to diffusers " + (dir / "no/such/o.safetensors"));
  EXPECT_NE(r.output.find("output folder"), std::string::npos) << r.output;
  r = run("convert " + (dir / "missing.safetensors") + " --to ldm " + (dir / "o.safetensors"));
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.output.find("missing.safetensors"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir / "o.safetensors"));
}
