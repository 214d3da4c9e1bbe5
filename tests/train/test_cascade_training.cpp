// Training Stable Cascade stage C from a config (model.architecture =
// "cascade-c"), at test width (model.tiny = true) on the committed Twemoji
// fixtures: EfficientNet latents and bigG text states cached, GDF's
// objective, samples through the previewer, the final file in the released
// key layout, fine-tuning, LoRA and resume from it, the frozen parts from
// their own files (kohya's effnet_checkpoint_path, previewer_checkpoint_path,
// text_model_checkpoint_path), and the errors a user meets.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <set>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/data/dataset.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/io/weight_files.h"
#include "shoestring/models/architecture.h"
#include "shoestring/models/cascade_coders.h"
#include "shoestring/models/clip_text.h"
#include "shoestring/train/config.h"
#include "shoestring/train/gdf.h"
#include "shoestring/train/trainer.h"
#include "shoestring/train/training_model.h"
#include "train_testing.h"

namespace fs = std::filesystem;
using namespace shoestring;
using shoestring::testing::quiet;
using shoestring::testing::run_losses;
using shoestring::testing::train_error;

namespace {

std::string temp_dir(const std::string& name) { return shoestring::testing::fresh_temp_dir("test_cascade", name); }

// 64 px images: 2 x 2 EfficientNet latents.
TrainConfig cascade_config(const std::string& out, const std::string& extra = "") {
  TrainConfig c = shoestring::testing::tiny_ldm_config("cascade-c", out, extra);
  c.resolution = 64;
  return c;
}


void save_module(torch::nn::Module& m, const std::string& path, const std::string& prefix = "") {
  std::vector<NamedTensor> tensors;
  for (const auto& p : m.named_parameters()) tensors.push_back({prefix + p.key(), p.value().detach(), std::nullopt});
  for (const auto& b : m.named_buffers()) tensors.push_back({prefix + b.key(), b.value(), std::nullopt});
  save_safetensors(path, tensors);
}

}  // namespace

TEST(CascadeTraining, TinyTrainsSamplesAndSavesTheReleasedLayout) {
  TrainConfig cfg = cascade_config(temp_dir("tiny"));
  cfg.max_train_steps = 40;
  auto summary = train(cfg, quiet());
  auto losses = run_losses(summary.run_dir);
  ASSERT_EQ(losses.size(), 40u);
  for (double l : losses) EXPECT_TRUE(std::isfinite(l));
  // GDF draws a time per sample, so single losses are noisy: compare the first and last ten.
  double first = 0, last = 0;
  for (int i = 0; i < 10; ++i) first += losses[static_cast<size_t>(i)], last += losses[static_cast<size_t>(30 + i)];
  EXPECT_LT(last, 0.8 * first) << "first-10 mean " << first / 10 << " last-10 mean " << last / 10;
  EXPECT_TRUE(fs::exists(summary.last_sample));

  // The final file holds stage C alone, under the released keys (no prefix),
  // detected as the tiny cascade-c.
  WeightFiles f = WeightFiles::open(summary.run_dir + "/model.safetensors");
  auto reference = models::build_architecture("cascade-c", nn::LayerInit{torch::kMeta}, /*tiny=*/true);
  std::set<std::string> want, got;
  for (const auto& p : reference->named_parameters()) want.insert(p.key());
  for (const auto& n : f.names()) got.insert(n);
  EXPECT_EQ(got, want);
  EXPECT_EQ(f.metadata().at("architecture"), "cascade-c");
  EXPECT_EQ(f.metadata().at("objective"), "gdf_epsilon");

  // Fine-tuning starts from exactly that file (a zero learning rate saves it back unchanged).
  TrainConfig ft =
      cascade_config(temp_dir("ft"), "pretrained_model_name_or_path = \"" + summary.run_dir + "/model.safetensors\"\n");
  ft.max_train_steps = 1;
  ft.learning_rate = 0;
  auto a = load_safetensors(summary.run_dir + "/model.safetensors");
  auto b = load_safetensors(train(ft, quiet()).run_dir + "/model.safetensors");
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [k, v] : a) EXPECT_TRUE(torch::equal(v, b.at(k))) << k;

  // The fp16 recipe (examples/cascade_c_fp16.toml): fp16 weights and compute
  // with loss scaling, the ResBlocks (a precision rule by kind) fp32 and frozen.
  TrainConfig fp16 = cascade_config(temp_dir("fp16"), "pretrained_model_name_or_path = \"" + summary.run_dir +
                                                          "/model.safetensors\"\nfull_fp16 = true\n"
                                                          "[[precision.rule]]\nmatch = \"*\"\n"
                                                          "kind = \"CascadeResBlock\"\nstorage = \"fp32\"\n"
                                                          "compute = \"fp32\"\ntrainable = false\n"
                                                          "checkpoint = true\n");
  fp16.max_train_steps = 3;
  const std::string fp16_dir = train(fp16, quiet()).run_dir;
  for (double l : run_losses(fp16_dir)) EXPECT_TRUE(std::isfinite(l));
  auto h = load_safetensors(fp16_dir + "/model.safetensors");
  int64_t res_blocks = 0, moved = 0;
  for (const auto& [k, v] : h) {
    // ResBlocks: depthwise conv and channelwise MLP (no other block has them in CTA levels).
    const bool res = k.find(".depthwise.") != std::string::npos || k.find(".channelwise.") != std::string::npos;
    EXPECT_EQ(v.scalar_type(), res ? torch::kFloat32 : torch::kHalf) << k;
    if (res) {
      ++res_blocks;
      EXPECT_TRUE(torch::equal(v, a.at(k))) << "frozen ResBlock weight moved: " << k;
    } else {
      moved += !torch::equal(v.to(torch::kFloat32), a.at(k).to(torch::kHalf).to(torch::kFloat32));
    }
  }
  EXPECT_GT(res_blocks, 0);
  EXPECT_GT(moved, 0);

  // LoRA on it: OneTrainer's / kohya's stage C prefix, adapters only.
  TrainConfig lora = cascade_config(temp_dir("lora"), "pretrained_model_name_or_path = \"" + summary.run_dir +
                                                          "/model.safetensors\"\nnetwork_module = \"networks.lora\"\n"
                                                          "network_dim = 2\n");
  lora.max_train_steps = 2;
  auto ls = train(lora, quiet());
  EXPECT_FALSE(fs::exists(ls.run_dir + "/model.safetensors"));
  auto lf = SafetensorsFile::open(ls.run_dir + "/lora.safetensors");
  bool prior = false;
  for (const auto& t : lf.tensors()) prior = prior || t.name.rfind("lora_prior_unet_", 0) == 0;
  EXPECT_TRUE(prior);
}

// The fp16 fix (examples/cascade_c_fp16.toml): weights that drive the last
// up group's hidden state past fp16's range (its input ~100 from the
// upscaler's bias, then x (1 + a) with a = 3000 in the TimestepBlock: ~3e5 >
// 65504), as the released stage C's last group does in fp16. The fp16 recipe
// stops on NaN losses and names the fix; with precision.activation_rescale
// = 1/64 the same run finishes with finite losses, and the saved weights are
// the trained ones, not rescaled copies.
TEST(CascadeTraining, ForcedFp16OverflowFinishesWithActivationRescale) {
  const std::string dir = temp_dir("overflow");
  fs::create_directories(dir);
  torch::manual_seed(12);
  auto net = models::build_architecture("cascade-c", nn::LayerInit{}, /*tiny=*/true);
  std::map<std::string, torch::Tensor> params;
  for (const auto& p : net->named_parameters()) params[p.key()] = p.value();
  {
    torch::NoGradGuard no_grad;
    params.at("up_upscalers.0.1.blocks.1.bias").fill_(100.0);
    // up_blocks.1 = level 0, blocks C, T, A: the a-half (first 32 rows) of the TimestepBlock's bias.
    params.at("up_blocks.1.1.mapper.bias").narrow(0, 0, 32).fill_(3000.0);
  }
  const std::string base = dir + "/overflowing.safetensors";
  save_module(*net, base);

  auto config = [&](const std::string& name, const std::string& rescale) {
    const std::string recipe = "pretrained_model_name_or_path = \"" + base +
                               "\"\nfull_fp16 = true\nmax_nonfinite_steps = 2\n[precision]\n" + rescale +
                               "[[precision.rule]]\nmatch = \"*\"\nkind = \"CascadeResBlock\"\nstorage = \"fp32\"\n"
                               "compute = \"fp32\"\ntrainable = false\ncheckpoint = true\n";
    TrainConfig c = cascade_config(temp_dir(name), recipe);
    c.max_train_steps = 3;
    c.sample_prompts.clear();
    return c;
  };
  const std::string plain = train_error(config("overflow_plain", ""));
  EXPECT_NE(plain.find("non-finite"), std::string::npos) << plain;
  EXPECT_NE(plain.find("precision.activation_rescale"), std::string::npos) << plain;

  const std::string fixed_dir = train(config("overflow_fixed", "activation_rescale = 0.015625\n"), quiet()).run_dir;
  const auto losses = run_losses(fixed_dir);
  ASSERT_EQ(losses.size(), 3u);
  for (double l : losses) EXPECT_TRUE(std::isfinite(l));
  auto saved = load_safetensors(fixed_dir + "/model.safetensors");
  EXPECT_EQ(saved.size(), params.size());
  // Trained by a few small steps from 3000, not stored as 3000 / 64.
  const torch::Tensor a = saved.at("up_blocks.1.1.mapper.bias").narrow(0, 0, 32).to(torch::kFloat32);
  EXPECT_LT((a - 3000.0).abs().max().item<float>(), 10.0f);
}

// prepare() wires GDF as train_c.py does: with the draws replayed in order
// (caption dropout, eps, times), the target is eps, the time input is
// CosineTNoiseCond(logSNR(t)), the weight is P2's 1 / (1 + SNR), and x_t is
// a x0 + b eps for one x0 per image (the same from two different draws).
TEST(CascadeTraining, PrepareFollowsGdf) {
  TrainConfig c = cascade_config(temp_dir("prepare"));
  c.sample_prompts.clear();
  const ImageCaptionDataset data = ImageCaptionDataset::load(c.train_data_dir, static_cast<int>(c.resolution));
  ModelSource source;
  source.quiet = true;
  auto model = make_training_model(c, data, source);
  const std::vector<int64_t> idx{3, 0, 7};
  const GdfCosineSchedule schedule;
  std::vector<at::Tensor> x0s;
  for (const int64_t seed : {1, 2}) {
    torch::manual_seed(seed);
    const TrainBatch batch = model->prepare(idx);
    torch::manual_seed(seed);
    torch::rand({3});  // caption dropout
    const at::Tensor eps = torch::randn({3, 16, 2, 2});
    const at::Tensor t = gdf_sample_times(3);
    const at::Tensor log_snr = schedule.log_snr(t);
    EXPECT_TRUE(torch::equal(batch.target, eps));
    EXPECT_TRUE(torch::allclose(batch.inputs[1], schedule.noise_cond(log_snr)));
    EXPECT_TRUE(torch::allclose(batch.loss_weight, (1 / (1 + log_snr.exp())).to(torch::kFloat32)));
    auto [a, b] = gdf_vp_scalers(log_snr);
    const at::Tensor a4 = a.view({3, 1, 1, 1}).to(torch::kFloat32), b4 = b.view({3, 1, 1, 1}).to(torch::kFloat32);
    x0s.push_back((batch.inputs[0] - b4 * eps) / a4);
    EXPECT_EQ(batch.inputs[2].sizes(), (std::vector<int64_t>{3, 77, 32}));  // bigG's last layer, tiny width
    EXPECT_EQ(batch.inputs[3].sizes(), (std::vector<int64_t>{3, 1, 32}));   // pooled
    EXPECT_TRUE(batch.inputs[4].eq(0).all().item<bool>());                  // clip_img zeros
  }
  EXPECT_TRUE(torch::allclose(x0s[0], x0s[1], 1e-4, 1e-4)) << (x0s[0] - x0s[1]).abs().max().item<double>();
}

TEST(CascadeTraining, ResumeEqualsTheUninterruptedRun) {
  // Caption dropout draws, and a sample grid every step: sampling must leave the training stream alone.
  TrainConfig full = cascade_config(temp_dir("full"), "full_bf16 = true\nsample_every_n_steps = 1\n");
  full.max_train_steps = 4;
  full.caption_dropout_rate = 0.5;
  auto whole = run_losses(train(full, quiet()).run_dir);

  TrainConfig part =
      cascade_config(temp_dir("part"), "full_bf16 = true\nsave_every_n_steps = 2\nsample_every_n_steps = 1\n");
  part.caption_dropout_rate = 0.5;
  part.max_train_steps = 2;
  const std::string dir = train(part, quiet()).run_dir;
  part.max_train_steps = 4;
  TrainRunOptions o = quiet();
  o.resume_dir = dir;
  train(part, o);
  auto resumed = run_losses(dir);
  ASSERT_EQ(resumed.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(resumed[i], whole[i]) << "step " << i + 1;
}

// The frozen parts from files (as kohya's stable-cascade scripts take them):
// the run encodes with them, so a different encoder file gives different
// losses; a file of the wrong kind is refused by name.
TEST(CascadeTraining, FrozenPartsFromTheirFiles) {
  const std::string dir = temp_dir("files");
  fs::create_directories(dir);
  torch::manual_seed(11);
  models::EfficientNetEncoder effnet(models::EfficientNetEncoderOptions::micro());
  models::Previewer previewer(models::PreviewerOptions().hidden_channels(32));
  models::ClipTextModel big_g(models::ClipTextOptions::clip_g().tiny(32));
  save_module(*effnet, dir + "/effnet_encoder.safetensors");
  save_module(*previewer, dir + "/previewer.safetensors");
  save_module(*big_g, dir + "/sdxl.safetensors", models::kSdxlClipGPrefix);  // as an SDXL single file holds it

  const std::string files = "effnet_checkpoint_path = \"" + dir + "/effnet_encoder.safetensors\"\n" +
                            "previewer_checkpoint_path = \"" + dir + "/previewer.safetensors\"\n" +
                            "text_model_checkpoint_path = \"" + dir + "/sdxl.safetensors\"\n";
  TrainConfig with_files = cascade_config(temp_dir("with_files"), files);
  with_files.max_train_steps = 2;
  auto own = run_losses(train(with_files, quiet()).run_dir);
  TrainConfig random = cascade_config(temp_dir("random"));
  random.max_train_steps = 2;
  auto rand_losses = run_losses(train(random, quiet()).run_dir);
  ASSERT_EQ(own.size(), 2u);
  EXPECT_TRUE(std::isfinite(own[1]));
  // Stage C's output conv starts at zero (as Stability initialises it), so the
  // first loss is the noise's alone; the second sees the latents and text.
  EXPECT_EQ(own[0], rand_losses[0]);
  EXPECT_NE(own[1], rand_losses[1]);

  TrainConfig wrong =
      cascade_config(temp_dir("wrong"), "effnet_checkpoint_path = \"" + dir + "/previewer.safetensors\"\n");
  const std::string m = train_error(wrong);
  EXPECT_NE(m.find("previewer.safetensors"), std::string::npos) << m;
  EXPECT_NE(m.find("backbone.0.0.weight"), std::string::npos) << m;
  TrainConfig no_text =
      cascade_config(temp_dir("no_text"), "text_model_checkpoint_path = \"" + dir + "/effnet_encoder.safetensors\"\n");
  const std::string t = train_error(no_text);
  EXPECT_NE(t.find("holds no OpenCLIP text tower"), std::string::npos) << t;
  EXPECT_NE(m.find("effnet_checkpoint_path: expected Stable Cascade's effnet_encoder.safetensors"), std::string::npos)
      << m;
  // A bad previewer is refused at the start, not when the first samples are drawn.
  TrainConfig bad_preview =
      cascade_config(temp_dir("bad_preview"), "previewer_checkpoint_path = \"" + dir + "/missing.safetensors\"\n");
  const std::string pv = train_error(bad_preview);
  EXPECT_NE(pv.find("previewer_checkpoint_path = \"" + dir + "/missing.safetensors\""), std::string::npos) << pv;
  EXPECT_FALSE(fs::exists(bad_preview.output_dir));
  // A base file that is not stage C: refused from its header, naming what it holds.
  TrainConfig not_c =
      cascade_config(temp_dir("not_c"), "pretrained_model_name_or_path = \"" + dir + "/sdxl.safetensors\"\n");
  const std::string nc = train_error(not_c);
  EXPECT_NE(nc.find("expected cascade-c (tiny) stage C with the released keys"), std::string::npos) << nc;
  EXPECT_FALSE(fs::exists(not_c.output_dir));
  fs::remove_all(dir);
}

TEST(CascadeTraining, RefusesWhatItCannotTrain) {
  TrainConfig c = cascade_config(temp_dir("e1"));
  c.tiny = false;
  EXPECT_NE(train_error(c).find("pretrained_model_name_or_path"), std::string::npos) << train_error(c);
  c = cascade_config(temp_dir("e2"));
  c.resolution = 48;
  EXPECT_NE(train_error(c).find("multiples of 32 pixels"), std::string::npos) << train_error(c);
  c = cascade_config(temp_dir("e4"), "v_parameterization = true\n");
  EXPECT_NE(train_error(c).find("v_parameterization: model.architecture = \"cascade-c\" trains on GDF"),
            std::string::npos)
      << train_error(c);
  c = cascade_config(temp_dir("e5"), "min_snr_gamma = 5\n");
  EXPECT_NE(train_error(c).find("min_snr_gamma"), std::string::npos) << train_error(c);
  // A sample size the EfficientNet grid cannot take: refused before training, not at the first grid.
  c = cascade_config(temp_dir("e6"));
  c.sample_prompts = {"red heart --w 50"};
  EXPECT_NE(train_error(c).find("sample_prompts[0] (--w / --h) 50 x 64 px"), std::string::npos) << train_error(c);
  EXPECT_FALSE(fs::exists(c.output_dir));  // refused before the run folder exists
}
