// Training the released LDM UNets from a config (model.architecture = sd15 /
// sdxl / ssd1b), at test width (model.tiny = true) on the committed Twemoji
// fixtures: the DDPM schedule against PyTorch, loss finite and falling, the
// final file in the LDM single-file layout with the VAE and text encoders
// beside the UNet and its metadata, fine-tuning and LoRA from that file, and
// the errors a user meets.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>
#include <spdlog/sinks/ringbuffer_sink.h>
#include <spdlog/spdlog.h>
#include <torch/torch.h>

#include "../error_testing.h"
#include "shoestring/core/error.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/io/weight_files.h"
#include "shoestring/models/architecture.h"
#include "shoestring/train/checkpoint_io.h"
#include "shoestring/train/config.h"
#include "shoestring/train/ddpm.h"
#include "shoestring/train/trainer.h"
#include "train_testing.h"

namespace fs = std::filesystem;
using namespace shoestring;
using shoestring::testing::losses_of;
using shoestring::testing::quiet;
using shoestring::testing::run_losses;

namespace {

std::string temp_dir(const std::string& name) { return shoestring::testing::fresh_temp_dir("test_ldm", name); }

TrainConfig ldm_config(const std::string& arch, const std::string& out, const std::string& extra = "") {
  return shoestring::testing::tiny_ldm_config(arch, out, extra);
}

std::vector<models::TensorShape> shapes_of(const WeightFiles& f) {
  std::vector<models::TensorShape> s;
  for (const auto& n : f.names()) s.emplace_back(n, f.find(n)->shape);
  return s;
}

}  // namespace

// Reference: /usr/bin/python3 with torch, float64:
//   b = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float64)**2
//   a = torch.cumprod(1 - b, 0); a[0], a[499], a[999]
// and diffusers' DDIMScheduler (steps_offset 1, "leading"): 50 steps run
// 981, 961, ..., 21, 1.
TEST(Ddpm, StableDiffusionScheduleMatchesPyTorch) {
  DdpmSchedule s = DdpmSchedule::stable_diffusion();
  ASSERT_EQ(s.num_steps(), 1000);
  EXPECT_NEAR(s.alphas_cumprod()[0].item<double>(), 0.99915, 1e-12);
  EXPECT_NEAR(s.alphas_cumprod()[499].item<double>(), 0.27766965045646774, 1e-12);
  EXPECT_NEAR(s.alphas_cumprod()[999].item<double>(), 0.004660098513077241, 1e-12);
  auto ts = s.ddim_timesteps(50);
  ASSERT_EQ(ts.size(), 50u);
  EXPECT_EQ(ts.front(), 981);
  EXPECT_EQ(ts[1], 961);
  EXPECT_EQ(ts.back(), 1);
  EXPECT_THROW(s.ddim_timesteps(0), Error);
}

TEST(Ddpm, TargetsAndDdimStepFollowTheirFormulas) {
  DdpmSchedule s = DdpmSchedule::stable_diffusion();
  torch::manual_seed(0);
  at::Tensor x0 = torch::randn({3, 4, 2, 2}), eps = torch::randn({3, 4, 2, 2});
  at::Tensor t = torch::tensor({0, 500, 999}, torch::kInt64);
  at::Tensor xt = s.add_noise(x0, eps, t);
  at::Tensor v = s.v_target(x0, eps, t);
  for (int i = 0; i < 3; ++i) {
    const double ab = s.alphas_cumprod()[t[i].item<int64_t>()].item<double>();
    EXPECT_TRUE(torch::allclose(xt[i], std::sqrt(ab) * x0[i] + std::sqrt(1 - ab) * eps[i], 1e-5, 1e-6));
    // x0 = sqrt(ab) x_t - sqrt(1 - ab) v and eps = sqrt(ab) v + sqrt(1 - ab) x_t (Salimans & Ho 2022).
    EXPECT_TRUE(torch::allclose(std::sqrt(ab) * xt[i] - std::sqrt(1 - ab) * v[i], x0[i], 1e-4, 1e-5));
    const int64_t ti = t[i].item<int64_t>();
    EXPECT_TRUE(torch::allclose(s.eps_from_v(xt[i], v[i], ti), eps[i], 1e-4, 1e-5));
    // With the true epsilon a DDIM step lands on the forward process at t_prev.
    if (ti > 0) {
      at::Tensor prev = s.ddim_step(xt[i], eps[i], ti, ti - 1);
      const double abp = s.alphas_cumprod()[ti - 1].item<double>();
      EXPECT_TRUE(torch::allclose(prev, std::sqrt(abp) * x0[i] + std::sqrt(1 - abp) * eps[i], 1e-4, 1e-5));
    }
  }
}

class LdmTraining : public ::testing::TestWithParam<std::string> {};

TEST_P(LdmTraining, TinyVariantTrainsAndSavesAnLdmSingleFile) {
  const std::string arch = GetParam();
  TrainConfig cfg = ldm_config(arch, temp_dir(arch), "save_precision = \"bf16\"\n");
  auto summary = train(cfg, quiet());
  auto losses = run_losses(summary.run_dir);
  ASSERT_EQ(losses.size(), 8u);
  for (double l : losses) EXPECT_TRUE(std::isfinite(l));
  const double last3 = (losses[5] + losses[6] + losses[7]) / 3;
  EXPECT_LT(last3, 0.9 * losses[0]) << "first " << losses[0] << " last-3 mean " << last3;

  // The final file: UNet under model.diffusion_model., VAE and text encoders
  // beside it, detected as the architectures they are, in bf16 (save_precision).
  const std::string path = summary.run_dir + "/model.safetensors";
  WeightFiles f = WeightFiles::open(path);
  std::set<std::string> found;
  for (const auto& d : models::detect_architectures(shapes_of(f))) {
    EXPECT_TRUE(d.exact()) << d.architecture << " under " << d.prefix;
    EXPECT_TRUE(d.tiny) << d.architecture;
    found.insert(d.architecture);
  }
  EXPECT_TRUE(found.count(arch));
  EXPECT_TRUE(found.count("vae"));
  // The text encoders' test widths are the trainer's (they must add up to the
  // tiny UNet's context width), not the registry's tiny ones; check the keys.
  const std::string clip_l = arch == "sd15" ? "cond_stage_model.transformer." : "conditioner.embedders.0.transformer.";
  EXPECT_NE(f.find(clip_l + "text_model.final_layer_norm.weight"), nullptr);
  EXPECT_EQ(f.find("conditioner.embedders.1.model.ln_final.weight") != nullptr, arch != "sd15");
  EXPECT_EQ(f.get("model.diffusion_model.out.2.weight").scalar_type(), torch::kBFloat16);
  EXPECT_EQ(f.get("first_stage_model.decoder.conv_out.weight").scalar_type(), torch::kBFloat16);
  const auto& meta = f.metadata();
  EXPECT_EQ(meta.at("architecture"), arch);
  EXPECT_EQ(meta.at("step"), "8");
  EXPECT_EQ(meta.at("objective"), "epsilon");
  EXPECT_EQ(meta.at("config_hash").size(), 16u);
  EXPECT_EQ(meta.at("dtype"), "bf16");
  EXPECT_TRUE(fs::exists(summary.last_sample));
}

INSTANTIATE_TEST_SUITE_P(Architectures, LdmTraining, ::testing::Values("sd15", "sdxl", "ssd1b"));

TEST(LdmTraining, FineTuneAndLoraStartFromTheSavedFile) {
  // A short full run in fp32 gives the base file.
  TrainConfig base_cfg = ldm_config("sd15", temp_dir("base"));
  base_cfg.max_train_steps = 2;
  const std::string base = train(base_cfg, quiet()).run_dir + "/model.safetensors";

  // Fine-tune: starts from exactly the base UNet (step-0 weights are the file's).
  TrainConfig ft = ldm_config("sd15", temp_dir("ft"), "pretrained_model_name_or_path = \"" + base + "\"\n");
  ft.max_train_steps = 1;
  ft.learning_rate = 0;  // the step changes nothing: the saved UNet must equal the base's
  auto s = train(ft, quiet());
  auto a = load_safetensors(base), b = load_safetensors(s.run_dir + "/model.safetensors");
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [k, v] : a) {
    ASSERT_TRUE(b.count(k)) << k;
    EXPECT_TRUE(torch::equal(v, b[k])) << k;
  }

  // full_fp16 with the ResBlocks kept fp32 and frozen by a rule: those hold the
  // base file's values exactly (the UNet is built in fp32 before the rest is
  // cast down: build_dtype), not their fp16 rounding.
  TrainConfig fp16 = ldm_config("sd15", temp_dir("fp16_rule"),
                                "pretrained_model_name_or_path = \"" + base +
                                    "\"\nfull_fp16 = true\n[[precision.rule]]\nmatch = \"*\"\nkind = \"ResBlock\"\n"
                                    "storage = \"fp32\"\ntrainable = false\n");
  fp16.max_train_steps = 1;
  auto h = load_safetensors(train(fp16, quiet()).run_dir + "/model.safetensors");
  int64_t kept_fp32 = 0;
  for (const auto& [k, v] : h) {
    if (k.rfind("model.diffusion_model.", 0) != 0 || v.scalar_type() != torch::kFloat32) continue;
    ++kept_fp32;
    EXPECT_TRUE(torch::equal(v, a.at(k))) << k;
  }
  EXPECT_GT(kept_fp32, 0);

  // LoRA on it: kohya names from the LDM layout, base weights untouched.
  TrainConfig lora = ldm_config(
      "sd15", temp_dir("lora"),
      "pretrained_model_name_or_path = \"" + base + "\"\nnetwork_module = \"networks.lora\"\nnetwork_dim = 2\n");
  lora.max_train_steps = 3;
  auto ls = train(lora, quiet());
  for (double l : run_losses(ls.run_dir)) EXPECT_TRUE(std::isfinite(l));
  auto lf = SafetensorsFile::open(ls.run_dir + "/lora.safetensors");
  EXPECT_NE(lf.find("lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_q.lora_down.weight"), nullptr);
  EXPECT_NE(lf.find("lora_unet_output_blocks_11_1_transformer_blocks_0_attn2_to_out_0.lora_up.weight"), nullptr);
  // The base comes back from the pretrained file: only adapters are written.
  EXPECT_FALSE(fs::exists(ls.run_dir + "/model.safetensors"));

  // A resumed LoRA run (checkpoints hold the adapters and the state, not the
  // base) equals the uninterrupted one.
  TrainConfig part = lora;
  part.output_dir = temp_dir("lora_part");
  part.max_train_steps = 2;
  part.save_every_n_steps = 1;
  const std::string dir = train(part, quiet()).run_dir;
  EXPECT_FALSE(fs::exists(dir + "/checkpoints/step-000002/model.safetensors"));
  EXPECT_TRUE(fs::exists(dir + "/checkpoints/step-000002/lora.safetensors"));
  part.max_train_steps = 3;
  TrainRunOptions o = quiet();
  o.resume_dir = dir;
  train(part, o);
  EXPECT_EQ(run_losses(dir), run_losses(ls.run_dir));
  auto resumed = load_safetensors(dir + "/lora.safetensors"),
       whole = load_safetensors(ls.run_dir + "/lora.safetensors");
  ASSERT_EQ(resumed.size(), whole.size());
  for (const auto& [k, v] : whole) EXPECT_TRUE(torch::equal(v, resumed.at(k))) << k;

  // network_weights that do not fit the network (a lora_up missing) are
  // refused before any slow work: before the text encoders are built, which
  // here would fail on clip_skip = 3 (the tiny encoder has 2 layers).
  std::vector<NamedTensor> kept;
  const std::string dropped = "lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_q.lora_up.weight";
  for (const auto& [k, v] : whole) {
    if (k != dropped) kept.push_back({k, v, std::nullopt});
  }
  const std::string broken = temp_dir("broken_lora") + ".safetensors";
  save_safetensors(broken, kept);
  TrainConfig bad = lora;
  bad.output_dir = temp_dir("lora_bad");
  bad.network_weights = broken;
  bad.clip_skip = 3;
  try {
    train(bad, quiet());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(broken + ": LoRA keys do not match the network; 1 missing: " + dropped), std::string::npos) << m;
  }
  EXPECT_FALSE(fs::exists(bad.output_dir));  // nothing left to block a retry
  // network_weights holding NaN are refused by name, not trained into NaN.
  std::vector<NamedTensor> poisoned;
  const std::string nan_key = "lora_unet_input_blocks_1_1_transformer_blocks_0_attn1_to_q.lora_down.weight";
  for (const auto& [k, v] : whole) poisoned.push_back({k, k == nan_key ? torch::full_like(v, NAN) : v, std::nullopt});
  save_safetensors(broken, poisoned);
  bad.clip_skip = lora.clip_skip;
  try {
    train(bad, quiet());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(broken + ": tensor \"" + nan_key + "\" holds"), std::string::npos) << m;
  }
  EXPECT_FALSE(fs::exists(bad.output_dir));
  fs::remove(broken);
}

TEST(LdmTraining, ResumeEqualsTheUninterruptedRun) {
  TrainConfig full = ldm_config("sdxl", temp_dir("full"), "full_bf16 = true\n");
  full.max_train_steps = 4;
  auto whole = run_losses(train(full, quiet()).run_dir);

  TrainConfig part = ldm_config("sdxl", temp_dir("part"), "full_bf16 = true\nsave_every_n_steps = 2\n");
  part.max_train_steps = 2;
  const std::string dir = train(part, quiet()).run_dir;
  part.max_train_steps = 4;
  TrainRunOptions o = quiet();
  o.resume_dir = dir;
  train(part, o);
  auto resumed = run_losses(dir);
  ASSERT_EQ(resumed.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(resumed[i], whole[i]) << "step " << i + 1;

  // A config that changes what the checkpoint depends on is refused, naming
  // the key, before any work; so is a step count already reached.
  TrainConfig other = part;
  other.max_train_steps = 6;
  other.architecture = "ssd1b";
  other.clip_skip = 2;
  try {
    train(other, o);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("model.architecture (run: \"sdxl\", now: \"ssd1b\")"), std::string::npos) << m;
    EXPECT_NE(m.find("clip_skip"), std::string::npos) << m;
  }
  try {
    train(part, o);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("already at step 4"), std::string::npos) << e.what();
  }
}

TEST(LdmTraining, BadSetupsNameWhatIsWrong) {
  auto message = [](const TrainConfig& c) {
    try {
      train(c, quiet());
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  // Full width without base weights.
  TrainConfig c = ldm_config("sd15", temp_dir("e1"));
  c.tiny = false;
  EXPECT_NE(message(c).find("pretrained_model_name_or_path"), std::string::npos) << message(c);
  // A resolution the UNet cannot downsample.
  c = ldm_config("sd15", temp_dir("e2"));
  c.resolution = 48;
  EXPECT_NE(message(c).find("multiple of 64"), std::string::npos) << message(c);
  // Not a denoiser: not trainable from a config.
  c = ldm_config("sd15", temp_dir("e3"));
  c.architecture = "vae";
  EXPECT_NE(message(c).find("training it from a config is not supported"), std::string::npos) << message(c);
  // clip_skip beyond the text encoder's layers (the tiny one has 2).
  c = ldm_config("sd15", temp_dir("e5"));
  c.clip_skip = 3;
  EXPECT_NE(message(c).find("clip_skip = 3: the text encoder has 2 layers"), std::string::npos) << message(c);
  // A checkpoint of another architecture.
  TrainConfig base_cfg = ldm_config("ssd1b", temp_dir("e4base"));
  base_cfg.max_train_steps = 1;
  const std::string ssd = train(base_cfg, quiet()).run_dir + "/model.safetensors";
  c = ldm_config("sdxl", temp_dir("e4"), "pretrained_model_name_or_path = \"" + ssd + "\"\n");
  const std::string m = message(c);
  EXPECT_NE(m.find("holds no sdxl (tiny) UNet"), std::string::npos) << m;
  EXPECT_NE(m.find("ssd1b (tiny)"), std::string::npos) << m;
  // A UNet-only file (a checkpoint) is no base for a run that needs the text
  // encoders and VAE: never random parts beside a real base.
  const std::string unet_only = fs::path(ssd).parent_path().string() + "/checkpoints/step-000001/model.safetensors";
  c = ldm_config("ssd1b", temp_dir("e6"), "pretrained_model_name_or_path = \"" + unet_only + "\"\n");
  EXPECT_NE(message(c).find("holds no text encoder"), std::string::npos) << message(c);
  // A base file holding NaN is refused at load, naming the file and tensor,
  // and leaves no run folder behind to block a retry.
  {
    std::vector<NamedTensor> tensors;
    const std::string poisoned_key = "model.diffusion_model.out.2.weight";
    for (auto& [k, v] : load_safetensors(ssd)) {
      at::Tensor t = v.clone();
      if (k == poisoned_key) t.view({-1})[5] = NAN;
      tensors.push_back({k, t, std::nullopt});
    }
    const std::string nan_base = temp_dir("nan_base") + ".safetensors";
    save_safetensors(nan_base, tensors);
    c = ldm_config("ssd1b", temp_dir("e8"), "pretrained_model_name_or_path = \"" + nan_base + "\"\n");
    const std::string e = message(c);
    EXPECT_NE(e.find(nan_base + ": tensor \"" + poisoned_key + "\" holds 1 non-finite value"), std::string::npos) << e;
    EXPECT_FALSE(fs::exists(c.output_dir));
    fs::remove(nan_base);
  }
  // A tiny file with model.tiny = false says so.
  c = ldm_config("ssd1b", temp_dir("e7"), "pretrained_model_name_or_path = \"" + ssd + "\"\n");
  c.tiny = false;
  EXPECT_NE(message(c).find("set model.tiny = true"), std::string::npos) << message(c);
}

// Every shipped example config parses (their paths point at the user's files).
TEST(Examples, EveryExampleConfigParses) {
  const fs::path dir = fs::path(SHOESTRING_TEST_DATA).parent_path().parent_path() / "examples";
  int n = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".toml") continue;
    EXPECT_NO_THROW(load_config(entry.path().string())) << entry.path();
    ++n;
  }
  EXPECT_GE(n, 3);
}

// The precision modes run on the LDM UNet's block table (per-block compute
// dtype; fp16 emulated on the CPU with loss scaling): every step finite.
TEST(LdmTraining, PrecisionModesTrainFinite) {
  for (const std::string mode : {"mixed_precision = \"bf16\"\n", "full_fp16 = true\nprecision.auto_upcast = true\n",
                                 "mixed_precision = \"fp16\"\ngradient_checkpointing = true\n"}) {
    TrainConfig c = ldm_config("sd15", temp_dir("prec"), mode);
    c.max_train_steps = 3;
    auto s = train(c, quiet());
    for (double l : run_losses(s.run_dir)) EXPECT_TRUE(std::isfinite(l)) << mode;
  }
}

// kohya's loss and noise options through the trainer: every combination a
// kohya user would carry over trains finite; the weights and noise change
// the first step's loss against the same seed's plain run (they act); and
// the contradictions are refused naming the key.
TEST(LdmTraining, KohyaLossOptionsTrainFinite) {
  TrainConfig plain = ldm_config("sd15", temp_dir("loss_plain"));
  plain.max_train_steps = 2;
  const std::vector<double> base = run_losses(train(plain, quiet()).run_dir);
  for (const std::string extra :
       {"min_snr_gamma = 5\nnoise_offset = 0.1\nadaptive_noise_scale = 0.05\n",
        "multires_noise_iterations = 4\nmultires_noise_discount = 0.3\nloss_type = \"huber\"\n",
        "v_parameterization = true\ndebiased_estimation_loss = true\nloss_type = \"smooth_l1\"\n"
        "huber_schedule = \"exponential\"\n",
        "loss_type = \"l1\"\nmin_snr_gamma = 1\n"}) {
    TrainConfig c = ldm_config("sd15", temp_dir("loss_opts"), extra);
    c.max_train_steps = 2;
    const std::vector<double> losses = run_losses(train(c, quiet()).run_dir);
    ASSERT_EQ(losses.size(), 2u) << extra;
    for (double l : losses) EXPECT_TRUE(std::isfinite(l)) << extra;
    EXPECT_NE(losses[0], base[0]) << extra;
  }
  auto error_for = [&](const std::string& extra, const std::string& arch = "sd15") {
    return shoestring::testing::error_of([&] {
      TrainConfig c =
          arch == "sd15" ? ldm_config("sd15", temp_dir("loss_bad"), extra) : parse_config(extra, "emoji.toml");
      c.max_train_steps = 1;
      train(c, quiet());
    });
  };
  EXPECT_NE(error_for("adaptive_noise_scale = 0.1\n").find("noise_offset"), std::string::npos);
  {
    // Refused before the run folder is written (a rerun with a fixed value then starts afresh).
    const std::string out = temp_dir("loss_bad_huber");
    const std::string e = shoestring::testing::error_of([&] {
      train(ldm_config("sd15", out, "loss_type = \"huber\"\nhuber_schedule = \"exponential\"\nhuber_c = 2\n"), quiet());
    });
    EXPECT_NE(e.find("(0, 1]"), std::string::npos) << e;
    EXPECT_FALSE(fs::exists(fs::path(out) / "metrics.jsonl"));
  }
  const std::string e = error_for(fmt::format("train_data_dir = \"{}/twemoji\"\nloss_type = \"huber\"\n"
                                              "output_dir = \"{}\"\n",
                                              SHOESTRING_TEST_DATA, temp_dir("loss_bad_emoji")),
                                  "tiny-unet");
  EXPECT_NE(e.find("huber_schedule = \"constant\""), std::string::npos) << e;
}

// A LoRA on a randomly initialised tiny base: the UNet's output convolution
// starts at zero (as Stable Diffusion's), so no gradient reaches the
// adapters. Training goes on, but the run says so instead of passing silently.
TEST(LdmTraining, ZeroGradientNormIsWarnedAbout) {
  TrainConfig cfg = ldm_config("sd15", temp_dir("zero_grad"), "network_module = \"networks.lora\"\nnetwork_dim = 2\n");
  cfg.max_train_steps = 3;
  auto sink = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(256);
  const auto saved = spdlog::default_logger();
  spdlog::set_default_logger(std::make_shared<spdlog::logger>("capture", sink));
  TrainRunOptions loud;
  const auto summary = train(cfg, loud);
  spdlog::set_default_logger(saved);
  std::ifstream metrics(summary.run_dir + "/metrics.jsonl");
  int64_t lines = 0;
  for (std::string line; std::getline(metrics, line); ++lines)
    EXPECT_EQ(nlohmann::json::parse(line).at("grad_norm"), 0.0);
  EXPECT_EQ(lines, 3);
  std::string warnings;
  for (const std::string& line : sink->last_formatted()) warnings += line;
  EXPECT_NE(warnings.find("steps 1..3: the gradient norm is exactly 0"), std::string::npos) << warnings;
}
