// Checkpoint key names: LDM single-file layout <-> diffusers layout, for the
// Stable Diffusion / SDXL UNet and the SD VAE.
//
// Each map is a table of (LDM prefix, diffusers prefix) pairs for whole
// blocks, generated from the block layout, plus fixed tables for the names
// inside a block. They follow the public conversion scripts:
//   - diffusers scripts/convert_original_stable_diffusion_to_diffusers.py
//     (src/diffusers/pipelines/stable_diffusion/convert_from_ckpt.py:
//     convert_ldm_unet_checkpoint, renew_resnet_paths, renew_vae_resnet_paths,
//     renew_vae_attention_paths, convert_ldm_vae_checkpoint) and
//     scripts/convert_diffusers_to_original_stable_diffusion.py
//     (unet_conversion_map, unet_conversion_map_resnet, vae_conversion_map);
//   - ComfyUI comfy/utils.py unet_to_diffusers (per-block transformer depths,
//     which also cover SSD-1B).
// Only names are mapped. Shapes are equal except the VAE attention q/k/v/
// proj_out weights: LDM stores 1x1 convs [C, C, 1, 1], diffusers Linear [C, C].
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace shoestring::io {

/// What a UNet's blocks contain, enough to name them in both layouts.
struct UNetKeyLayout {
  /// Resolution levels (len(channel_mult)).
  int64_t levels = 4;
  /// ResBlocks per level on the input path (the output path has one more).
  int64_t num_res_blocks = 2;
  /// Per input ResBlock (levels * num_res_blocks): followed by a SpatialTransformer.
  std::vector<bool> input_attention;
  /// Per output block (levels * (num_res_blocks + 1), deepest first).
  std::vector<bool> output_attention;
  /// middle_block.1 is a SpatialTransformer.
  bool middle_attention = true;
  /// The middle block has a second ResBlock (false for SSD-1B: middle_block.0 only).
  bool middle_second_res = true;
  /// label_emb.0 (SDXL's vector conditioning) is present.
  bool label_emb = false;
};

/// Maps one UNet key from the LDM layout (without the `model.diffusion_model.`
/// prefix), e.g. "input_blocks.1.0.in_layers.0.weight", to diffusers
/// ("down_blocks.0.resnets.0.norm1.weight"). Throws shoestring::Error naming
/// the key if no block of `layout` matches it.
std::string unet_ldm_to_diffusers(const std::string& key, const UNetKeyLayout& layout);
/// The inverse of unet_ldm_to_diffusers. Throws shoestring::Error on unknown keys.
std::string unet_diffusers_to_ldm(const std::string& key, const UNetKeyLayout& layout);

/// Maps one VAE key from the LDM layout (without `first_stage_model.`), e.g.
/// "decoder.up.3.block.0.nin_shortcut.weight", to diffusers
/// ("decoder.up_blocks.0.resnets.0.conv_shortcut.weight"); `levels` is
/// len(ch_mult) and `num_res_blocks` the encoder's ResnetBlocks per level
/// (4 and 2 for SD). Throws shoestring::Error on unknown keys.
std::string vae_ldm_to_diffusers(const std::string& key, int64_t levels = 4, int64_t num_res_blocks = 2);
/// The inverse of vae_ldm_to_diffusers. Throws shoestring::Error on unknown keys.
std::string vae_diffusers_to_ldm(const std::string& key, int64_t levels = 4, int64_t num_res_blocks = 2);

}  // namespace shoestring::io
