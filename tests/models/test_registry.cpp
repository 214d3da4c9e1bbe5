// The architecture registry's per-row facts (family, trainability, saved-file
// identifiers, objective, conditioning shapes) against the models they
// describe, and the Denoiser interface every denoiser family implements.
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/models/architecture.h"
#include "shoestring/models/cascade.h"
#include "shoestring/models/clip_text.h"
#include "shoestring/models/denoiser.h"
#include "shoestring/models/mmdit.h"
#include "shoestring/models/tiny_unet.h"
#include "shoestring/models/unet_ldm.h"
#include "shoestring/models/vae.h"

using namespace shoestring;
using models::Family;

namespace {

std::shared_ptr<torch::nn::Module> meta_build(const std::string& name, bool tiny = false) {
  return models::build_architecture(name, nn::LayerInit{torch::kMeta}, tiny);
}

}  // namespace

// The conditioning facts agree with the options of the full-width builds.
TEST(Registry, ConditioningMatchesTheModels) {
  for (const auto& a : models::architectures()) {
    const models::Conditioning& c = a.conditioning;
    auto m = meta_build(a.name);
    switch (a.family) {
      case Family::ldm_unet: {
        const auto& o = std::dynamic_pointer_cast<models::LdmUNetImpl>(m)->options();
        EXPECT_EQ(c.latent_channels, o.in_channels()) << a.name;
        EXPECT_EQ(c.context_width, o.context_dim()) << a.name;
        EXPECT_EQ(c.pooled_width, o.adm_in_channels()) << a.name;
        EXPECT_EQ(c.vae_downscale, 8) << a.name;
        EXPECT_EQ(c.context_tokens, 77) << a.name;
        break;
      }
      case Family::mmdit: {
        const auto& o = std::dynamic_pointer_cast<models::MMDiTImpl>(m)->options();
        EXPECT_EQ(c.latent_channels, o.in_channels()) << a.name;
        EXPECT_EQ(c.context_width, o.context_dim()) << a.name;
        EXPECT_EQ(c.pooled_width, o.adm_in_channels()) << a.name;
        break;
      }
      case Family::stage_c: {
        const auto& o = std::dynamic_pointer_cast<models::StageCImpl>(m)->options();
        EXPECT_EQ(c.latent_channels, o.in_channels()) << a.name;
        EXPECT_EQ(c.context_width, o.clip_text_dim()) << a.name;
        EXPECT_EQ(c.pooled_width, o.clip_text_pooled_dim()) << a.name;
        EXPECT_EQ(c.vae_downscale, 32) << a.name;
        EXPECT_EQ(a.latent_side(768), 24) << a.name;  // Stability's stage C training size
        break;
      }
      case Family::tiny_unet: {
        const auto& o = std::dynamic_pointer_cast<models::TinyUNetImpl>(m)->options();
        EXPECT_EQ(c.latent_channels, o.in_channels()) << a.name;
        EXPECT_EQ(c.vae_downscale, 1) << a.name;
        break;
      }
      case Family::vae: {
        auto vae = std::dynamic_pointer_cast<models::AutoencoderKLImpl>(m);
        ASSERT_TRUE(vae) << a.name;
        EXPECT_EQ(c.latent_channels, vae->options().z_channels()) << a.name;
        EXPECT_EQ(c.vae_downscale, int64_t{1} << (vae->options().ch_mult().size() - 1)) << a.name;
        break;
      }
      case Family::text_encoder: {
        auto te = std::dynamic_pointer_cast<models::ClipTextModelImpl>(m);
        ASSERT_TRUE(te) << a.name;
        const auto& o = te->options();
        EXPECT_EQ(c.context_tokens, o.max_positions()) << a.name;
        EXPECT_EQ(c.context_width, o.width()) << a.name;
        EXPECT_EQ(c.pooled_width, o.projection_dim() > 0 ? o.projection_dim() : o.width()) << a.name;
        break;
      }
    }
  }
}

// Every denoiser family implements models::Denoiser with the model's own
// block table; VAE and text encoders do not.
TEST(Registry, DenoisersImplementTheInterface) {
  for (const auto& a : models::architectures()) {
    auto m = meta_build(a.name, /*tiny=*/true);
    const models::Denoiser* d = models::as_denoiser(*m);
    EXPECT_EQ(d != nullptr, models::is_denoiser(a.family)) << a.name;
    if (!d) continue;
    ASSERT_NE(d->block_table(), nullptr) << a.name;
    EXPECT_TRUE(d->block_table()->is_block(m.get()) ||
                a.family == Family::tiny_unet)  // the tiny UNet declares only its ResBlocks and transformers
        << a.name << ": the root is a scope of its table";
    // Under a checkpoint root, the UNet's table is found in the module tree.
    if (!a.prefix.empty()) {
      auto root = models::build_checkpoint_root(a.name, nn::LayerInit{torch::kMeta}, true);
      const auto tables = models::denoiser_block_tables(*root);
      ASSERT_EQ(tables.size(), 1u) << a.name;
      EXPECT_EQ(models::as_denoiser(*root), nullptr) << a.name;
    }
  }
}

// The lists that configs and messages use, and the saved files' identifiers.
TEST(Registry, NamesFamiliesAndIdentifiers) {
  EXPECT_EQ(models::denoiser_architectures(),
            (std::vector<std::string>{"tiny-unet", "sd15", "sdxl", "ssd1b", "sd35m", "cascade-c", "cascade-c-lite"}));
  EXPECT_EQ(models::denoiser_architectures(/*trainable_only=*/true),
            (std::vector<std::string>{"tiny-unet", "sd15", "sdxl", "ssd1b", "sd35m", "cascade-c", "cascade-c-lite"}));
  EXPECT_EQ(models::join_names({"a", "b", "c"}), "a, b, c");
  EXPECT_EQ(models::find_architecture(models::kTinyUNet).family, Family::tiny_unet);

  // Names as std::string lvalues: GCC 14 takes a reference returned for a temporary argument
  // for a dangling one (-Wdangling-reference), though the registry outlives the call.
  const std::string sd15_name = "sd15";
  const auto& sd15 = models::find_architecture(sd15_name);
  EXPECT_EQ(sd15.kohya_base_model_version, "sd_v1");
  EXPECT_EQ(sd15.modelspec_architecture, "stable-diffusion-v1");
  EXPECT_EQ(sd15.modelspec_lora_architecture, "stable-diffusion-v1/lora");
  for (const std::string xl : {"sdxl", "ssd1b"}) {
    const auto& a = models::find_architecture(xl);
    EXPECT_EQ(a.kohya_base_model_version, "sdxl_base_v1-0") << xl;
    EXPECT_EQ(a.modelspec_lora_architecture, "stable-diffusion-xl-v1-base/lora") << xl;
  }
  EXPECT_EQ(models::find_architecture("sdxl").modelspec_architecture, "stable-diffusion-xl-v1-base");
  EXPECT_EQ(models::find_architecture("ssd1b").modelspec_architecture, "segmind-ssd-1b");
  for (const std::string other : {"sd35m", "cascade-c", "cascade-c-lite", "tiny-unet"}) {
    const auto& a = models::find_architecture(other);
    EXPECT_EQ(a.kohya_base_model_version, "") << other;
    EXPECT_EQ(a.modelspec_architecture, "") << other;
    EXPECT_EQ(a.modelspec_lora_architecture, "") << other;
  }

  for (const auto& a : models::architectures()) {
    EXPECT_EQ(a.default_objective == models::Objective::none, !models::is_denoiser(a.family)) << a.name;
    EXPECT_EQ(a.ldm_preset != nullptr, a.family == Family::ldm_unet) << a.name;
  }
  EXPECT_STREQ(models::to_string(models::find_architecture("sd35m").default_objective), "flow_matching");
  EXPECT_STREQ(models::to_string(models::find_architecture("sdxl").default_objective), "epsilon");
  EXPECT_STREQ(models::to_string(Family::stage_c), "stage_c");
}

// ldm_unet_options gives the preset (and its tiny variant) the builder uses.
TEST(Registry, LdmUNetOptionsAreThePresets) {
  EXPECT_EQ(models::ldm_unet_options("sdxl").context_dim(), models::LdmUNetOptions::sdxl().context_dim());
  EXPECT_EQ(models::ldm_unet_options("ssd1b").transformer_depth_middle(), -1);
  EXPECT_EQ(models::ldm_unet_options("sd15", /*tiny=*/true).model_channels(),
            models::LdmUNetOptions::sd15().tiny().model_channels());
  auto built = std::dynamic_pointer_cast<models::LdmUNetImpl>(meta_build("sdxl", /*tiny=*/true));
  EXPECT_EQ(built->options().adm_in_channels(), models::ldm_unet_options("sdxl", true).adm_in_channels());
  EXPECT_THROW(models::ldm_unet_options("sd35m"), Error);
  EXPECT_THROW(models::ldm_unet_options("no-such-arch"), Error);
}
