// The SD3 / SD3.5 VAE (VaeOptions::sd3(): the SD encoder/decoder with 16
// latent channels, no quant_conv / post_quant_conv, latents (z - 0.0609) *
// 1.5305): parameter counts in closed form, keys and shapes on the meta
// device, a micro model against scripts/gen_ldm_reference.py's functional
// PyTorch forward (ldm_vae_sd3_micro), the shift/scale latent formula, and
// loading from SD3.5-style single files (models::load_vae).
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "../io/temp_dir.h"
#include "../nn/reference_data.h"
#include "shoestring/core/error.h"
#include "shoestring/io/safetensors.h"
#include "shoestring/io/weight_files.h"
#include "shoestring/models/vae.h"

using namespace shoestring;
using models::AutoencoderKL;
using models::VaeOptions;

namespace {

// Closed-form parameter counts of the LDM autoencoder (weights + biases),
// written from the layer shapes of ldm/modules/diffusionmodules/model.py,
// independent of the module code under test.
int64_t conv_params(int64_t in, int64_t out, int64_t k) { return in * out * k * k + out; }
int64_t norm_params(int64_t c) { return 2 * c; }
int64_t resnet_params(int64_t in, int64_t out) {
  int64_t n = norm_params(in) + conv_params(in, out, 3) + norm_params(out) + conv_params(out, out, 3);
  return in == out ? n : n + conv_params(in, out, 1);  // nin_shortcut
}
int64_t attn_params(int64_t c) { return norm_params(c) + 4 * conv_params(c, c, 1); }  // norm, q, k, v, proj_out
int64_t mid_params(int64_t c) { return 2 * resnet_params(c, c) + attn_params(c); }

int64_t encoder_params(int64_t ch, const std::vector<int64_t>& mult, int64_t nrb, int64_t z) {
  int64_t n = conv_params(3, ch, 3), c = ch;
  for (size_t l = 0; l < mult.size(); ++l) {
    for (int64_t i = 0; i < nrb; ++i, c = ch * mult[l]) n += resnet_params(c, ch * mult[l]);
    if (l + 1 < mult.size()) n += conv_params(c, c, 3);  // downsample.conv
  }
  return n + mid_params(c) + norm_params(c) + conv_params(c, 2 * z, 3);
}

int64_t decoder_params(int64_t ch, const std::vector<int64_t>& mult, int64_t nrb, int64_t z) {
  int64_t c = ch * mult.back();
  int64_t n = conv_params(z, c, 3) + mid_params(c);
  for (int64_t l = static_cast<int64_t>(mult.size()) - 1; l >= 0; --l) {
    for (int64_t i = 0; i <= nrb; ++i, c = ch * mult[l]) n += resnet_params(c, ch * mult[l]);
    if (l > 0) n += conv_params(c, c, 3);  // upsample.conv
  }
  return n + norm_params(c) + conv_params(c, 3, 3);
}

// The micro SD3-structured VAE of scripts/gen_ldm_reference.py vae_sd3_case.
VaeOptions micro_sd3() { return VaeOptions::sd3().ch(8).ch_mult({1, 2, 2}).num_res_blocks(2).groups(4); }

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

std::vector<NamedTensor> as_file(torch::nn::Module& m, const std::string& prefix) {
  std::vector<NamedTensor> out;
  for (const auto& p : m.named_parameters()) out.push_back({prefix + p.key(), p.value().detach().clone(), {}});
  return out;
}

void expect_error_mentions(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

}  // namespace

// 83,819,683 = encoder 34,274,208 + decoder 49,545,475 (the SD VAE's
// 83,653,863 with conv_out 512->32 and conv_in 16->512, less the quant convs).
TEST(Sd3Vae, ParameterCountsMatchClosedForm) {
  const std::vector<int64_t> mult{1, 2, 4, 4};
  // The formula reproduces the published SD VAE count (diffusers
  // num_parameters() of stabilityai/sd-vae-ft-mse) with its quant convs.
  EXPECT_EQ(
      encoder_params(128, mult, 2, 4) + decoder_params(128, mult, 2, 4) + conv_params(8, 8, 1) + conv_params(4, 4, 1),
      83'653'863);
  EXPECT_EQ(encoder_params(128, mult, 2, 16), 34'274'208);
  EXPECT_EQ(decoder_params(128, mult, 2, 16), 49'545'475);

  AutoencoderKL vae(VaeOptions::sd3().init(nn::LayerInit{torch::kMeta}));
  EXPECT_EQ(nn::parameter_count(*vae->encoder), 34'274'208);
  EXPECT_EQ(nn::parameter_count(*vae->decoder), 49'545'475);
  EXPECT_EQ(nn::parameter_count(*vae), 83'819'683);
  EXPECT_FALSE(vae->quant_conv);
  EXPECT_FALSE(vae->post_quant_conv);

  // The SD VAE stays as it was.
  AutoencoderKL sd(VaeOptions().init(nn::LayerInit{torch::kMeta}));
  EXPECT_EQ(nn::parameter_count(*sd), 83'653'863);
  EXPECT_TRUE(VaeOptions().use_quant_conv());
  EXPECT_EQ(VaeOptions().shift_factor(), 0.0);
}

TEST(Sd3Vae, OptionsKeysAndShapesOnMeta) {
  const VaeOptions o = VaeOptions::sd3();
  EXPECT_EQ(o.z_channels(), 16);
  EXPECT_FALSE(o.use_quant_conv());
  EXPECT_DOUBLE_EQ(o.scaling_factor(), 1.5305);
  EXPECT_DOUBLE_EQ(o.shift_factor(), 0.0609);
  EXPECT_EQ(o.ch(), 128);
  EXPECT_EQ(o.ch_mult(), (std::vector<int64_t>{1, 2, 4, 4}));
  EXPECT_EQ(o.num_res_blocks(), 2);
  EXPECT_EQ(o.groups(), 32);

  AutoencoderKL vae(VaeOptions::sd3().init(nn::LayerInit{torch::kMeta}));
  std::map<std::string, std::vector<int64_t>> s;
  for (const auto& p : vae->named_parameters()) {
    EXPECT_TRUE(p.value().is_meta()) << p.key();
    EXPECT_EQ(p.key().find("quant_conv"), std::string::npos) << p.key();
    s[p.key()] = p.value().sizes().vec();
  }
  const std::vector<std::pair<std::string, std::vector<int64_t>>> want = {
      {"encoder.conv_in.weight", {128, 3, 3, 3}},
      {"encoder.mid.attn_1.q.weight", {512, 512, 1, 1}},
      {"encoder.conv_out.weight", {32, 512, 3, 3}},
      {"encoder.conv_out.bias", {32}},
      {"decoder.conv_in.weight", {512, 16, 3, 3}},
      {"decoder.up.3.block.2.conv1.weight", {512, 512, 3, 3}},
      {"decoder.up.0.block.0.nin_shortcut.weight", {128, 256, 1, 1}},
      {"decoder.conv_out.weight", {3, 128, 3, 3}},
  };
  for (const auto& [k, shape] : want) {
    auto it = s.find(k);
    ASSERT_NE(it, s.end()) << k;
    EXPECT_EQ(it->second, shape) << k;
  }
}

// Encoder moments, decoder, and the latent format against the functional
// PyTorch forward: fp32 on both sides, so only summation order differs.
TEST(Sd3Vae, MicroMatchesPyTorchReference) {
  auto ref = shoestring::testing::load_reference("ldm_vae_sd3_micro");
  AutoencoderKL vae(micro_sd3());
  shoestring::testing::load_params(*vae, ref);
  torch::NoGradGuard g;
  const torch::Tensor img = ref.at("input.image");
  models::VaePosterior post = vae->encode(img);
  ASSERT_EQ(post.mean.sizes(), (std::vector<int64_t>{2, 16, 4, 3}));
  const double e_mean = max_abs_diff(post.mean, ref.at("output.mean"));
  const double e_logvar = max_abs_diff(post.logvar, ref.at("output.logvar"));
  torch::Tensor rec = vae->decode(post.mean);
  ASSERT_EQ(rec.sizes(), img.sizes());
  const double e_dec = max_abs_diff(rec, ref.at("output.decoded"));
  torch::Tensor lat = vae->encode_latents(img, /*sample=*/false);
  const double e_lat = max_abs_diff(lat, ref.at("output.latent"));
  torch::Tensor rec2 = vae->decode_latents(ref.at("input.latent"));
  const double e_lat_dec = max_abs_diff(rec2, ref.at("output.latent_decoded"));
  std::cout << "sd3 micro VAE max abs diff: mean " << e_mean << ", logvar " << e_logvar << ", decoded " << e_dec
            << ", latent " << e_lat << ", latent decoded " << e_lat_dec << "\n";
  EXPECT_LT(e_mean, 1e-5);
  EXPECT_LT(e_logvar, 1e-5);
  EXPECT_LT(e_dec, 1e-5);
  EXPECT_LT(e_lat, 1e-5);
  EXPECT_LT(e_lat_dec, 1e-5);
}

// encode_latents = (mean + exp(logvar/2) eps - shift) * scale with eps from
// the generator; decode_latents inverts the affine map exactly.
TEST(Sd3Vae, LatentShiftAndScale) {
  torch::manual_seed(21);
  AutoencoderKL vae(micro_sd3());
  torch::NoGradGuard g;
  torch::Tensor img = torch::rand({1, 3, 8, 8}) * 2 - 1;
  models::VaePosterior post = vae->encode(img);

  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(99);
  torch::Tensor sampled = vae->encode_latents(img, /*sample=*/true, gen);
  at::Generator gen2 = at::make_generator<at::CPUGeneratorImpl>(99);
  torch::Tensor eps = at::empty_like(post.mean);
  eps.normal_(0.0, 1.0, gen2);
  torch::Tensor want = (post.mean + torch::exp(0.5 * post.logvar) * eps - 0.0609) * 1.5305;
  EXPECT_LT(max_abs_diff(sampled, want), 1e-6);

  torch::Tensor lat = vae->encode_latents(img, /*sample=*/false);
  EXPECT_LT(max_abs_diff(lat, (post.mean - 0.0609) * 1.5305), 1e-6);
  EXPECT_LT(max_abs_diff(lat / 1.5305 + 0.0609, post.mean), 1e-6);
  EXPECT_LT(max_abs_diff(vae->decode_latents(lat), vae->decode(post.mean)), 1e-5);

  // Shift 0 keeps the SD formula.
  AutoencoderKL sd(VaeOptions().ch(8).ch_mult({1, 2}).num_res_blocks(1).groups(4));
  models::VaePosterior p2 = sd->encode(img);
  EXPECT_TRUE(torch::equal(sd->encode_latents(img, false), p2.mean * 0.18215));
}

// An SD3.5 single file holds the VAE under first_stage_model. beside the
// MMDiT and text encoders; a standalone VAE file has bare keys.
TEST(Sd3Vae, LoadsFromSingleFileAndStandaloneFile) {
  shoestring::testing::TempDir dir;
  torch::manual_seed(22);
  AutoencoderKL source(micro_sd3());
  auto single = as_file(*source, "first_stage_model.");
  single.push_back({"model.diffusion_model.x_embedder.proj.weight", torch::randn({4, 16, 2, 2}), {}});
  single.push_back({"text_encoders.clip_l.transformer.text_model.final_layer_norm.weight", torch::randn({8}), {}});
  save_safetensors(dir.file("sd3.5_micro.safetensors"), single);
  save_safetensors(dir.file("vae.safetensors"), as_file(*source, ""));

  torch::Tensor img = torch::rand({1, 3, 8, 8}) * 2 - 1;
  for (const char* name : {"sd3.5_micro.safetensors", "vae.safetensors"}) {
    torch::manual_seed(23);
    AutoencoderKL loaded(micro_sd3());
    LoadWeightsReport r = models::load_vae(*loaded, WeightFiles::open(dir.file(name)));
    EXPECT_EQ(r.loaded, static_cast<int64_t>(source->parameters().size())) << name;
    torch::NoGradGuard g;
    EXPECT_TRUE(torch::equal(loaded->encode(img).mean, source->encode(img).mean)) << name;
  }
}

// Wrong VAE kind for the file: the error names the file and the tensor.
TEST(Sd3Vae, LoadRejectsQuantConvMismatchAndLatentChannels) {
  shoestring::testing::TempDir dir;
  torch::manual_seed(24);
  AutoencoderKL sd3(micro_sd3());
  // An SD3 VAE file plus an SD-style quant_conv.
  auto with_quant = as_file(*sd3, "first_stage_model.");
  with_quant.push_back({"first_stage_model.quant_conv.weight", torch::randn({32, 32, 1, 1}), {}});
  with_quant.push_back({"first_stage_model.quant_conv.bias", torch::randn({32}), {}});
  save_safetensors(dir.file("quant.safetensors"), with_quant);
  expect_error_mentions([&] { models::load_vae(*sd3, WeightFiles::open(dir.file("quant.safetensors"))); },
                        {"quant.safetensors", "first_stage_model.quant_conv.weight", "unexpected"});
  // The generic loader (load_weights, prefix stripped) reports it as an unexpected key too.
  expect_error_mentions(
      [&] {
        LoadWeightsOptions lo;
        lo.key_map = [](const std::string& k) -> std::string {
          const std::string p = "first_stage_model.";
          return k.compare(0, p.size(), p) == 0 ? k.substr(p.size()) : "";
        };
        load_weights(*sd3, WeightFiles::open(dir.file("quant.safetensors")), lo);
      },
      {"quant.safetensors", "unexpected keys: quant_conv.bias, quant_conv.weight"});

  // An SD3 file given to an SD-style VAE (with quant convs): named as missing.
  save_safetensors(dir.file("sd3.safetensors"), as_file(*sd3, "first_stage_model."));
  AutoencoderKL sd(micro_sd3().use_quant_conv(true));
  expect_error_mentions([&] { models::load_vae(*sd, WeightFiles::open(dir.file("sd3.safetensors"))); },
                        {"sd3.safetensors", "missing tensor", "first_stage_model.quant_conv.weight"});

  // A file without a VAE: load_weights' list of missing keys, not the quant_conv message.
  save_safetensors(dir.file("mmdit.safetensors"),
                   {{"model.diffusion_model.x_embedder.proj.weight", torch::randn({4, 16, 2, 2}), {}}});
  expect_error_mentions([&] { models::load_vae(*sd, WeightFiles::open(dir.file("mmdit.safetensors"))); },
                        {"mmdit.safetensors", "missing keys: decoder.conv_in.bias"});

  // Same structure, other latent width: the channels are named.
  AutoencoderKL z8(micro_sd3().z_channels(8));
  expect_error_mentions([&] { models::load_vae(*z8, WeightFiles::open(dir.file("sd3.safetensors"))); },
                        {"sd3.safetensors", "encoder.conv_out.weight", "16 latent channels"});
}
