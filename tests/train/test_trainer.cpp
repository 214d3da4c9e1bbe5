// End-to-end training tests on the committed Twemoji fixtures (no network).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/data/tokenizer.h"
#include "shoestring/io/atomic_file.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/train/checkpoint_io.h"
#include "shoestring/train/config.h"
#include "shoestring/train/run.h"
#include "shoestring/train/sampling.h"
#include "shoestring/train/tiny_unet_model.h"
#include "shoestring/train/trainer.h"
#include "train_testing.h"

namespace fs = std::filesystem;
using namespace shoestring;
using shoestring::testing::losses_of;
using shoestring::testing::quiet;

namespace {

std::string temp_dir(const std::string& name) { return shoestring::testing::fresh_temp_dir("test", name); }

/// A model small enough to train for a few steps in a second or two, with a
/// 2-seed sample grid of 3 steps.
TrainConfig tiny_config(const std::string& out) {
  TrainConfig c = shoestring::testing::tiny_emoji_config(out);
  c.sample_seeds = 2;
  c.sample_steps = 3;
  return c;
}

}  // namespace

TEST(Trainer, LossFallsOnFixtures) {
  auto cfg = tiny_config(temp_dir("loss"));
  cfg.max_train_steps = 60;
  cfg.caption_dropout_rate = 0.0;
  cfg.timestep_sampling = "uniform";
  auto summary = train(cfg, quiet());
  auto losses = losses_of(summary.run_dir + "/metrics.jsonl");
  ASSERT_EQ(losses.size(), 60u);
  double first = 0, last = 0;
  for (int i = 0; i < 10; ++i) first += losses[i] / 10;
  for (int i = 50; i < 60; ++i) last += losses[i] / 10;
  EXPECT_LT(last, 0.8 * first) << "first 10 mean " << first << ", last 10 mean " << last;
  // The run folder holds what the README promises.
  EXPECT_TRUE(fs::exists(summary.run_dir + "/config.toml"));
  EXPECT_TRUE(fs::exists(summary.run_dir + "/model.safetensors"));
  EXPECT_TRUE(fs::exists(summary.last_sample));
  EXPECT_TRUE(fs::exists(summary.run_dir + "/checkpoints/latest.json"));
  auto rec = nlohmann::json::parse([&] {
    std::ifstream in(summary.run_dir + "/metrics.jsonl");
    std::string l;
    std::getline(in, l);
    return l;
  }());
  for (const char* key : {"step", "loss", "lr", "seconds", "images_per_second", "peak_bytes", "peak_weights_bytes",
                          "peak_gradients_bytes", "peak_optimizer_state_bytes", "peak_activations_bytes"}) {
    EXPECT_TRUE(rec.contains(key)) << key;
  }
  EXPECT_GT(rec["peak_weights_bytes"].get<int64_t>(), 0);
  EXPECT_GT(rec["peak_gradients_bytes"].get<int64_t>(), 0);
  EXPECT_GT(rec["peak_activations_bytes"].get<int64_t>(), 0);
  fs::remove_all(summary.run_dir);
}

/// Precision/optimizer variants whose interrupted-and-resumed runs must match.
struct Variant {
  const char* name;
  bool full_bf16;
  const char* optimizer;
  bool fused;
  const char* accumulation;  // gradient_accumulation_dtype
};

class ResumeTest : public ::testing::TestWithParam<Variant> {};

TEST_P(ResumeTest, ResumedLossesEqualUninterruptedRun) {
  const Variant v = GetParam();
  const bool bf16 = v.full_bf16;
  auto full = tiny_config(temp_dir(std::string("full_") + v.name));
  full.full_bf16 = bf16;
  full.optimizer_type = v.optimizer;
  full.fused_backward_pass = v.fused;
  full.gradient_accumulation_dtype = v.accumulation;
  if (full.optimizer_type == "Adafactor") {
    full.optimizer_args = {"scale_parameter=False", "relative_step=False", "warmup_init=False"};
  }
  full.ema_decay = 0.9;
  full.gradient_accumulation_steps = 2;
  full.caption_dropout_rate = 0.3;
  full.max_train_steps = 6;
  auto a = train(full, quiet());
  auto expected = losses_of(a.run_dir + "/metrics.jsonl");
  ASSERT_EQ(expected.size(), 6u);

  // Interrupted run: 2 steps, resume to 4, resume to 6 (counters stay cumulative).
  auto part = full;
  part.output_dir = temp_dir(std::string("part_") + v.name);
  part.max_train_steps = 2;
  auto b = train(part, quiet());
  TrainRunOptions resume = quiet();
  resume.resume_dir = b.run_dir;
  part.max_train_steps = 4;
  auto b2 = train(part, resume);
  EXPECT_EQ(b2.first_step, 3);
  part.max_train_steps = 6;
  auto b3 = train(part, resume);
  EXPECT_EQ(b3.first_step, 5);
  EXPECT_EQ(b3.last_step, 6);
  auto got = losses_of(b.run_dir + "/metrics.jsonl");
  ASSERT_EQ(got.size(), 6u);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(got[i], expected[i]) << "step " << i + 1;

  // Final weights are bit-identical too.
  auto wa = load_safetensors(a.run_dir + "/model.safetensors");
  auto wb = load_safetensors(b.run_dir + "/model.safetensors");
  ASSERT_EQ(wa.size(), wb.size());
  for (auto& [name, t] : wa) EXPECT_TRUE(torch::equal(t, wb.at(name))) << name;
  auto state = SafetensorsFile::open(b.run_dir + "/checkpoints/step-000006/state.safetensors");
  auto meta = nlohmann::json::parse(state.metadata().at("training_state"));
  EXPECT_EQ(meta["images_seen"].get<int64_t>(), 6 * 4 * 2);
  fs::remove_all(a.run_dir);
  fs::remove_all(b.run_dir);
}
INSTANTIATE_TEST_SUITE_P(Precision, ResumeTest,
                         ::testing::Values(Variant{"fp32_adamw", false, "AdamW", false, "fp32"},
                                           Variant{"bf16_adamw", true, "AdamW", false, "fp32"},
                                           Variant{"bf16_adamw8bit_sr_accumulation", true, "AdamW8bit", false,
                                                   "bf16_sr"},
                                           Variant{"bf16_adafactor_fused", true, "Adafactor", true, "bf16_sr"},
                                           Variant{"fp32_lion_fused", false, "Lion", true, "fp32"},
                                           Variant{"bf16_compass", true, "Compass", false, "fp32"}),
                         [](const auto& info) { return std::string(info.param.name); });

// A run killed before its first checkpoint is resumed by starting it over
// from its own config.toml: the same losses as the first attempt.
TEST(Trainer, ResumeWithoutCheckpointStartsOver) {
  TrainConfig c = shoestring::testing::tiny_emoji_config(temp_dir("no_checkpoint"));
  c.max_train_steps = 3;
  const std::string dir = train(c, quiet()).run_dir;
  const std::vector<double> first = losses_of(dir + "/metrics.jsonl");
  std::filesystem::remove_all(dir + "/checkpoints");  // as if killed before saving any
  std::filesystem::remove(dir + "/model.safetensors");
  TrainRunOptions o = quiet();
  o.resume_dir = dir;
  const TrainSummary again = train(load_config(dir + "/config.toml"), o);
  EXPECT_EQ(again.first_step, 1);
  EXPECT_EQ(losses_of(dir + "/metrics.jsonl"), first);
  EXPECT_TRUE(std::filesystem::exists(dir + "/model.safetensors"));
  // Asking for fewer steps than the run has is not "complete": it says so.
  TrainConfig fewer = load_config(dir + "/config.toml");
  fewer.max_train_steps = 2;
  try {
    train(fewer, o);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("is at step 3, beyond max_train_steps 2"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

// A run folder is trained in by one process at a time; the stale-temporary
// cleanup touches only temporaries of the files a run writes; a checkpoint
// with a NaN weight is refused by name.
TEST(Trainer, RunFolderIsLockedCleanedNarrowlyAndCheckedForNaN) {
  namespace fs = std::filesystem;
  TrainConfig c = shoestring::testing::tiny_emoji_config(temp_dir("locked"));
  c.max_train_steps = 2;
  c.save_every_n_steps = 1;
  fs::create_directories(c.output_dir + "/projects");
  const std::string foreign = c.output_dir + "/thesis.docx.tmp.99999.3";
  const std::string below = c.output_dir + "/projects/model.safetensors.tmp.1.1";
  const std::string stale = c.output_dir + "/config.toml.tmp.1.0";
  for (const auto& p : {foreign, below, stale}) std::ofstream(p) << "x";
  {
    FolderLock held(c.output_dir, kRunLockFile);  // another process's run, as far as train() can tell
    try {
      train(c, quiet());
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("in use by another shoestring process"), std::string::npos) << e.what();
    }
  }
  const std::string dir = train(c, quiet()).run_dir;
  EXPECT_TRUE(fs::exists(foreign));
  EXPECT_TRUE(fs::exists(below));
  EXPECT_FALSE(fs::exists(stale));

  // NaN in the latest checkpoint's weights: the resume names file and tensor.
  const std::string ckpt = dir + "/checkpoints/step-000002/model.safetensors";
  std::vector<NamedTensor> tensors;
  std::string poisoned;
  for (auto& [k, v] : load_safetensors(ckpt)) {
    at::Tensor t = v.clone();
    if (poisoned.empty() && t.is_floating_point() && t.numel() > 1) {
      poisoned = k;
      t.view({-1})[1] = NAN;
    }
    tensors.push_back({k, t, std::nullopt});
  }
  const auto metadata = SafetensorsFile::open(ckpt).metadata();  // the tokenizer lives there
  save_safetensors(ckpt, tensors, metadata);
  TrainRunOptions o = quiet();
  o.resume_dir = dir;
  c.max_train_steps = 3;
  try {
    train(c, o);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find(ckpt + ": tensor \"" + poisoned + "\" holds 1 non-finite"), std::string::npos) << m;
  }
  fs::remove_all(dir);
}

TEST(Trainer, RefusesToOverwriteAndReportsMissingDataset) {
  auto cfg = tiny_config(temp_dir("missing"));
  cfg.train_data_dir = "/nonexistent/emoji";
  try {
    train(cfg, quiet());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fetch_twemoji"), std::string::npos) << e.what();
  }
  auto bad = tiny_config("/proc/shoestring_cannot_write_here");
  EXPECT_THROW(train(bad, quiet()), Error);
}

TEST(Checkpoint, SaveLoadIsBitExact) {
  for (bool bf16 : {false, true}) {
    auto cfg = tiny_config("unused");
    torch::manual_seed(1);
    TinyUNetModel a(TinyUNetModelOptions::from_config(cfg, 20));
    torch::manual_seed(2);
    TinyUNetModel b(TinyUNetModelOptions::from_config(cfg, 20));
    if (bf16) {
      a->to(torch::kBFloat16);
      b->to(torch::kBFloat16);
    }
    std::string path = temp_dir("ckpt") + ".safetensors";
    save_module(path, *a, {{"k", "v"}});
    auto tensors = load_safetensors(path);
    load_module(*b, tensors, path);
    auto ta = module_tensors(*a), tb = module_tensors(*b);
    ASSERT_EQ(ta.size(), tb.size());
    for (size_t i = 0; i < ta.size(); ++i) {
      EXPECT_EQ(ta[i].second.scalar_type(), tb[i].second.scalar_type());
      EXPECT_TRUE(torch::equal(ta[i].second, tb[i].second)) << ta[i].first;
    }
    // A checkpoint with a missing tensor is an error naming it.
    tensors.erase(ta[0].first);
    try {
      load_module(*b, tensors, path);
      FAIL();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(ta[0].first), std::string::npos) << e.what();
    }
    fs::remove(path);
  }
}

// model_config in checkpoint metadata: every field round-trips; files written
// before model.pooled_context, model.scale_shift_norm and model.prediction
// existed (no such fields) rebuild as they were trained: no pooled context,
// additive time embedding, velocity prediction.
TEST(Checkpoint, ModelConfigRoundTripsAndOldFilesKeepTheirModel) {
  auto cfg = tiny_config("unused");
  for (bool on : {false, true}) {
    cfg.pooled_context = on;
    cfg.scale_shift_norm = on;
    cfg.prediction = on ? "x0" : "velocity";
    const TinyUNetModelOptions o = TinyUNetModelOptions::from_config(cfg, 20);
    EXPECT_EQ(o.unet.pooled_context(), on);
    EXPECT_EQ(o.unet.scale_shift_norm(), on);
    EXPECT_EQ(o.predict_x0, on);
    const nlohmann::json j = o.to_json();
    EXPECT_EQ(TinyUNetModelOptions::from_json(j).to_json(), j);
    nlohmann::json old = j;
    old["unet"].erase("pooled_context");
    old["unet"].erase("scale_shift_norm");
    old.erase("prediction");
    EXPECT_FALSE(TinyUNetModelOptions::from_json(old).unet.pooled_context());
    EXPECT_FALSE(TinyUNetModelOptions::from_json(old).unet.scale_shift_norm());
    EXPECT_FALSE(TinyUNetModelOptions::from_json(old).predict_x0);
    nlohmann::json bad = j;
    bad["unet"]["pooled_context"] = "yes";
    EXPECT_THROW(TinyUNetModelOptions::from_json(bad), Error);
    bad = j;
    bad["prediction"] = "eps";
    EXPECT_THROW(TinyUNetModelOptions::from_json(bad), Error);
  }
}

// x0 prediction: the model returns the velocity of the rectified flow
// x_t = (1 - t) x0 + t eps, whose x0 is the UNet's output: v = (x_t - x0) / t,
// with t clamped at 0.05. For an exact x0 that is eps - x0, the target.
TEST(TinyUNetModel, X0PredictionReturnsTheVelocityOfTheDenoisedImage) {
  auto cfg = tiny_config("unused");
  cfg.prediction = "x0";
  torch::manual_seed(3);
  TinyUNetModel model(TinyUNetModelOptions::from_config(cfg, 20));
  {
    torch::NoGradGuard g;
    for (auto& p : model->parameters()) p.add_(torch::randn_like(p) * 0.05);  // conv_out is zero-initialised
  }
  const int64_t R = cfg.resolution;
  const at::Tensor x_t = torch::randn({3, 3, R, R});
  const at::Tensor t = torch::tensor({0.01f, 0.5f, 1.0f});
  const at::Tensor tokens = torch::tensor({2, 5, 6, 2, 7, 0, 2, 0, 0}, torch::kInt64).view({3, 3});
  torch::NoGradGuard g;
  const at::Tensor x0 = model->denoise(x_t, t, tokens);
  const at::Tensor expected = (x_t - x0) / torch::tensor({0.05f, 0.5f, 1.0f}).view({3, 1, 1, 1});
  EXPECT_TRUE(torch::allclose(model->forward(x_t, t, tokens), expected, 1e-5, 1e-6));
  // The identity behind it: with x0 exact, (x_t - x0) / t = eps - x0.
  const at::Tensor clean = torch::rand({1, 3, R, R}), eps = torch::randn({1, 3, R, R});
  const at::Tensor xt = 0.7 * clean + 0.3 * eps;
  EXPECT_TRUE(torch::allclose(model->velocity(xt, torch::tensor({0.3f}), clean), eps - clean, 1e-4, 1e-5));
}

TEST(Sampling, OutputShapeAndRange) {
  auto cfg = tiny_config("unused");
  auto tok = WordTokenizer::build({"red heart", "grinning face"}, cfg.max_caption_length);
  torch::manual_seed(0);
  TinyUNetModel model(TinyUNetModelOptions::from_config(cfg, tok.vocab_size()));
  // Give the zero-initialised output layer some weight so images vary.
  {
    torch::NoGradGuard ng;
    for (auto& p : model->parameters()) p.add_(torch::randn_like(p) * 0.05);
  }
  SampleRequest req;
  req.prompts = {"red heart", "grinning face", "unknown words"};
  req.seeds = {0, 1};
  req.steps = 4;
  at::Tensor img = generate_images(model, tok, req);
  EXPECT_EQ(img.scalar_type(), torch::kUInt8);
  EXPECT_EQ(img.sizes(), (std::vector<int64_t>{6, 3, 16, 16}));
  EXPECT_GT(img.to(torch::kFloat32).std().item<double>(), 0.0);
  // Same seed, same prompt -> same image; the global RNG is untouched.
  torch::manual_seed(5);
  auto before = torch::rand({1});
  torch::manual_seed(5);
  at::Tensor again = generate_images(model, tok, req);
  EXPECT_TRUE(torch::equal(torch::rand({1}), before));
  EXPECT_TRUE(torch::equal(img, again));
  std::string path = temp_dir("grid") + ".png";
  save_sample_grid(path, img, req);
  EXPECT_TRUE(fs::exists(path));
  EXPECT_TRUE(fs::exists(path.substr(0, path.size() - 4) + ".txt"));
  fs::remove(path);
}
