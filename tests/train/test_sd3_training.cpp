// Training SD3.5 Medium from a config (model.architecture = "sd35m"), at test
// width (model.tiny = true) on the committed Twemoji fixtures: SD3 VAE
// latents and CLIP-L + bigG (+ T5) conditioning cached, rectified flow, the
// final file in the SD3 single-file layout, fine-tuning, LoRA and resume from
// it, T5 from a file with its SentencePiece model, and the errors a user meets.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <set>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/data/dataset.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/io/weight_files.h"
#include "shoestring/models/architecture.h"
#include "shoestring/models/mmdit.h"
#include "shoestring/models/t5_encoder.h"
#include "shoestring/train/config.h"
#include "shoestring/train/trainer.h"
#include "shoestring/train/training_model.h"
#include "train_testing.h"

namespace fs = std::filesystem;
using namespace shoestring;
using shoestring::testing::quiet;
using shoestring::testing::run_losses;
using shoestring::testing::train_error;

namespace {

std::string temp_dir(const std::string& name) { return shoestring::testing::fresh_temp_dir("test_sd3", name); }

// 64 px images: 8 x 8 latents, 4 x 4 patches.
TrainConfig sd3_config(const std::string& out, const std::string& extra = "") {
  TrainConfig c = shoestring::testing::tiny_ldm_config("sd35m", out, extra);
  c.resolution = 64;
  return c;
}


}  // namespace

TEST(Sd3Training, TinyTrainsSamplesAndSavesTheSingleFileLayout) {
  TrainConfig cfg = sd3_config(temp_dir("tiny"));
  cfg.max_train_steps = 40;
  auto summary = train(cfg, quiet());
  auto losses = run_losses(summary.run_dir);
  ASSERT_EQ(losses.size(), 40u);
  for (double l : losses) EXPECT_TRUE(std::isfinite(l));
  double first = 0, last = 0;
  for (int i = 0; i < 10; ++i) first += losses[static_cast<size_t>(i)], last += losses[static_cast<size_t>(30 + i)];
  EXPECT_LT(last, 0.8 * first) << "first-10 mean " << first / 10 << " last-10 mean " << last / 10;
  EXPECT_TRUE(fs::exists(summary.last_sample));

  // The MMDiT under model.diffusion_model. beside the SD3 VAE (16 latent
  // channels, no quant convs) under first_stage_model.
  WeightFiles f = WeightFiles::open(summary.run_dir + "/model.safetensors");
  auto reference = models::build_architecture("sd35m", nn::LayerInit{torch::kMeta}, /*tiny=*/true);
  std::set<std::string> want, got_mmdit;
  for (const auto& p : reference->named_parameters()) want.insert("model.diffusion_model." + p.key());
  for (const auto& p : reference->named_buffers()) want.insert("model.diffusion_model." + p.key());  // pos_embed
  bool vae = false, quant = false;
  for (const auto& n : f.names()) {
    if (n.rfind("model.diffusion_model.", 0) == 0) got_mmdit.insert(n);
    vae = vae || n.rfind("first_stage_model.decoder.", 0) == 0;
    quant = quant || n.find("quant_conv") != std::string::npos;
  }
  EXPECT_EQ(got_mmdit, want);
  EXPECT_TRUE(vae);
  EXPECT_FALSE(quant);
  ASSERT_TRUE(f.find("first_stage_model.decoder.conv_in.weight"));
  EXPECT_EQ(f.find("first_stage_model.decoder.conv_in.weight")->shape.at(1), 16);
  EXPECT_EQ(f.metadata().at("architecture"), "sd35m");
  EXPECT_EQ(f.metadata().at("objective"), "flow_matching_velocity");

  // Fine-tuning starts from exactly that file (a zero learning rate saves it back unchanged).
  TrainConfig ft =
      sd3_config(temp_dir("ft"), "pretrained_model_name_or_path = \"" + summary.run_dir + "/model.safetensors\"\n");
  ft.max_train_steps = 1;
  ft.learning_rate = 0;
  auto a = load_safetensors(summary.run_dir + "/model.safetensors");
  auto b = load_safetensors(train(ft, quiet()).run_dir + "/model.safetensors");
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [k, v] : a) EXPECT_TRUE(torch::equal(v, b.at(k))) << k;

  // LoRA on it: kohya's sd3 prefix lora_unet, adapters only.
  TrainConfig lora = sd3_config(temp_dir("lora"), "pretrained_model_name_or_path = \"" + summary.run_dir +
                                                      "/model.safetensors\"\nnetwork_module = \"networks.lora\"\n"
                                                      "network_dim = 2\n");
  lora.max_train_steps = 2;
  auto ls = train(lora, quiet());
  EXPECT_FALSE(fs::exists(ls.run_dir + "/model.safetensors"));
  auto lf = SafetensorsFile::open(ls.run_dir + "/lora.safetensors");
  bool joint = false;
  for (const auto& t : lf.tensors()) joint = joint || t.name.rfind("lora_unet_joint_blocks_", 0) == 0;
  EXPECT_TRUE(joint);
}

// SD3's objective options change the run (and a resumed run replays it).
TEST(Sd3Training, ResumeEqualsTheUninterruptedRun) {
  const std::string opts =
      "full_bf16 = true\nsample_every_n_steps = 1\ntimestep_sampling = \"mode\"\ntraining_shift = 3.0\n"
      "weighting_scheme = \"cosmap\"\npos_emb_random_crop_rate = 0.5\n";
  TrainConfig full = sd3_config(temp_dir("full"), opts);
  full.max_train_steps = 4;
  full.caption_dropout_rate = 0.5;
  auto whole = run_losses(train(full, quiet()).run_dir);

  TrainConfig part = sd3_config(temp_dir("part"), opts + "save_every_n_steps = 2\n");
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

  // The default objective (logit-normal, no shift, no weight) gives other losses.
  TrainConfig plain = sd3_config(temp_dir("plain"), "full_bf16 = true\n");
  plain.max_train_steps = 4;
  plain.caption_dropout_rate = 0.5;
  auto other = run_losses(train(plain, quiet()).run_dir);
  EXPECT_NE(other, whole);
}

// T5 from a file, tokenised with the SentencePiece model in tokenizer_dir
// (beside CLIP's vocab.json and merges.txt): the T5 tokens are part of the
// context, so a different T5 file gives different losses.
TEST(Sd3Training, T5FromItsFileWithSentencePiece) {
  const std::string dir = temp_dir("t5");
  fs::create_directories(dir + "/tok");
  for (const char* f : {"vocab.json", "merges.txt"})
    fs::copy_file(std::string(SHOESTRING_TEST_DATA) + "/clip_tokenizer/" + f, dir + "/tok/" + f);
  fs::copy_file(std::string(SHOESTRING_TEST_DATA) + "/text/t5_micro_spiece.model", dir + "/tok/spiece.model");
  auto save_t5 = [&](const std::string& path, uint64_t seed) {
    torch::manual_seed(static_cast<int64_t>(seed));
    models::T5Encoder t5(models::T5EncoderOptions::tiny().vocab_size(200));
    std::vector<NamedTensor> tensors;
    for (const auto& p : t5->named_parameters()) tensors.push_back({p.key(), p.value().detach(), std::nullopt});
    save_safetensors(path, tensors);
  };
  save_t5(dir + "/t5_a.safetensors", 1);
  save_t5(dir + "/t5_b.safetensors", 2);
  auto run = [&](const std::string& name, const std::string& t5) {
    TrainConfig c = sd3_config(temp_dir(name), "tokenizer_dir = \"" + dir + "/tok\"\n" +
                                                   (t5.empty() ? "" : "t5xxl = \"" + t5 + "\"\n"));
    // A fresh MMDiT's zero adaLN gates and output layer keep the context out
    // of the first two steps' losses; from the third on it counts.
    c.max_train_steps = 4;
    c.sample_prompts.clear();
    return run_losses(train(c, quiet()).run_dir);
  };
  const auto with_a = run("t5a", dir + "/t5_a.safetensors"), with_b = run("t5b", dir + "/t5_b.safetensors");
  const auto without = run("t5none", "");
  ASSERT_EQ(with_a.size(), 4u);
  for (double l : with_a) EXPECT_TRUE(std::isfinite(l));
  EXPECT_NE(with_a, with_b);
  EXPECT_NE(with_a, without);

  // A file without a T5 encoder (here a single VAE tensor) is named before anything is loaded.
  save_safetensors(dir + "/not_t5.safetensors", {{"decoder.conv_in.weight", torch::zeros({2, 2}), std::nullopt}});
  {
    TrainConfig c = sd3_config(temp_dir("not_t5"), "tokenizer_dir = \"" + dir + "/tok\"\nt5xxl = \"" + dir +
                                                       "/not_t5.safetensors\"\n");
    const std::string m = train_error(c);
    EXPECT_NE(m.find("t5xxl: " + dir + "/not_t5.safetensors holds no T5 encoder"), std::string::npos) << m;
  }

  // t5xxl without the SentencePiece model is refused by name.
  TrainConfig c = sd3_config(temp_dir("t5err"), "t5xxl = \"" + dir + "/t5_a.safetensors\"\n");
  std::string m = train_error(c);
  EXPECT_NE(m.find("tokenizer_dir"), std::string::npos) << m;
  fs::remove(dir + "/tok/spiece.model");
  c = sd3_config(temp_dir("t5err2"), "tokenizer_dir = \"" + dir + "/tok\"\nt5xxl = \"" + dir + "/t5_a.safetensors\"\n");
  m = train_error(c);
  EXPECT_NE(m.find("spiece.model"), std::string::npos) << m;
}

// kohya's / diffusers' loss is on x0 = x_t - t v, i.e. t^2 times the
// velocity loss, and weighting_scheme multiplies that: sigma_sqrt (1 / t^2)
// on the preconditioned loss is exactly OneTrainer's plain velocity loss.
TEST(Sd3Training, WeightingSchemeActsOnThePreconditionedLoss) {
  auto losses = [&](const std::string& name, const std::string& extra) {
    TrainConfig c = sd3_config(temp_dir(name), extra);
    c.max_train_steps = 3;
    c.sample_prompts.clear();
    return run_losses(train(c, quiet()).run_dir);
  };
  const auto kohya_flat = losses("w1", "weighting_scheme = \"sigma_sqrt\"\n");
  const auto onetrainer = losses("w2", "precondition_outputs = false\n");
  const auto kohya_default = losses("w3", "");
  ASSERT_EQ(kohya_flat.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(kohya_flat[i], onetrainer[i], 1e-6 * onetrainer[i]) << "step " << i + 1;
  EXPECT_NE(kohya_default, onetrainer);
}

TEST(Sd3Training, RefusesWhatItCannotTrain) {
  std::string m = train_error(sd3_config(temp_dir("e2"), "v_parameterization = true\n"));
  EXPECT_NE(m.find("rectified flow"), std::string::npos) << m;
  TrainConfig c = sd3_config(temp_dir("e3"));
  c.resolution = 72;  // not a multiple of 16
  m = train_error(c);
  EXPECT_NE(m.find("16"), std::string::npos) << m;
  c = sd3_config(temp_dir("e4"));
  c.tiny = false;
  m = train_error(c);
  EXPECT_NE(m.find("pretrained_model_name_or_path"), std::string::npos) << m;
  try {
    sd3_config(temp_dir("e5"), "weighting_scheme = \"bogus\"\n");
    ADD_FAILURE() << "weighting_scheme = \"bogus\" was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("weighting_scheme"), std::string::npos) << e.what();
  }
  m = train_error(sd3_config(temp_dir("e6"), "clip_l = \"" + temp_dir("e6") + "/missing.safetensors\"\n"));
  EXPECT_NE(m.find("clip_l"), std::string::npos) << m;
  EXPECT_NE(m.find("model.tiny"), std::string::npos) << m;
  // The tiny MMDiT's position embedding covers 32 x 32 patches: 512 px.
  c = sd3_config(temp_dir("e7"));
  c.resolution = 528;
  m = train_error(c);
  EXPECT_NE(m.find("at most 512 px"), std::string::npos) << m;
}

// pos_emb_random_crop_rate: the share of batches whose patch grid takes a
// random crop of the position embedding, drawn after the batch's other draws;
// each crop fits the table; rate 0 draws nothing and keeps the centre.
TEST(Sd3Training, PosEmbedRandomCropDrawsPlacesThatFit) {
  auto crops = [&](double rate) {
    TrainConfig c = sd3_config(temp_dir("crop"), fmt::format("pos_emb_random_crop_rate = {}\n", rate));
    c.sample_prompts.clear();
    const ImageCaptionDataset data = ImageCaptionDataset::load(c.train_data_dir, static_cast<int>(c.resolution));
    ModelSource source;
    source.quiet = true;
    auto model = make_training_model(c, data, source);
    torch::manual_seed(3);
    std::vector<std::pair<int64_t, int64_t>> out;
    for (int i = 0; i < 40; ++i) {
      const at::Tensor crop = model->prepare({0, 1}).inputs.at(4);
      EXPECT_EQ(crop.sizes(), (std::vector<int64_t>{1, 2}));
      out.emplace_back(crop[0][0].item<int64_t>(), crop[0][1].item<int64_t>());
    }
    return out;
  };
  // Tiny MMDiT: a 32 x 32 table; 64 px images are 4 x 4 patches, so 0 .. 28 fit.
  const int64_t most = models::MMDiTOptions::tiny().pos_embed_max_size() - 4;
  int64_t placed = 0;
  std::set<int64_t> tops;
  for (const auto& [top, left] : crops(0.5)) {
    if (top < 0) {
      EXPECT_EQ(left, -1);
      continue;
    }
    ++placed;
    tops.insert(top);
    EXPECT_LE(top, most);
    EXPECT_GE(left, 0);
    EXPECT_LE(left, most);
  }
  EXPECT_GT(placed, 8);   // about half of 40
  EXPECT_LT(placed, 32);
  EXPECT_GT(tops.size(), 4u);
  for (const auto& [top, left] : crops(0.0)) EXPECT_EQ(std::make_pair(top, left), std::make_pair(int64_t{-1}, int64_t{-1}));
  for (const auto& [top, left] : crops(1.0)) EXPECT_GE(top, 0);
}
