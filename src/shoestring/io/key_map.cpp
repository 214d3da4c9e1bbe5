#include "shoestring/io/key_map.h"

#include <utility>

#include <fmt/format.h>

#include "shoestring/core/error.h"

namespace shoestring::io {
namespace {

using NameTable = std::vector<std::pair<const char*, const char*>>;

// Names inside a UNet ResBlock (LDM openaimodel.ResBlock -> diffusers
// ResnetBlock2D), as unet_conversion_map_resnet of
// convert_diffusers_to_original_stable_diffusion.py.
const NameTable kUNetResnet = {
    {"in_layers.0.", "norm1."},  {"in_layers.2.", "conv1."},  {"emb_layers.1.", "time_emb_proj."},
    {"out_layers.0.", "norm2."}, {"out_layers.3.", "conv2."}, {"skip_connection.", "conv_shortcut."},
};
// Names inside a VAE ResnetBlock (vae_conversion_map: only the shortcut differs).
const NameTable kVaeResnet = {
    {"norm1.", "norm1."},
    {"conv1.", "conv1."},
    {"norm2.", "norm2."},
    {"conv2.", "conv2."},
    {"nin_shortcut.", "conv_shortcut."},
};
// Names inside the VAE AttnBlock (diffusers >= 0.14 Attention names; LDM 1x1
// convs become Linear layers), as renew_vae_attention_paths / vae_conversion_map_attn.
const NameTable kVaeAttention = {
    {"norm.", "group_norm."}, {"q.", "to_q."}, {"k.", "to_k."}, {"v.", "to_v."}, {"proj_out.", "to_out.0."},
};

// One block: key prefixes in both layouts, and the table for the names
// inside it (nullptr: the rest of the key is the same in both).
struct Block {
  std::string ldm, diffusers;
  const NameTable* inner = nullptr;
};

std::string map_key(const std::string& key, const std::vector<Block>& blocks, bool from_ldm, const char* what) {
  const Block* best = nullptr;
  size_t best_len = 0;
  for (const Block& b : blocks) {
    const std::string& from = from_ldm ? b.ldm : b.diffusers;
    if (from.size() > best_len && key.compare(0, from.size(), from) == 0) {
      best = &b;
      best_len = from.size();
    }
  }
  if (!best) {
    fail("{} key '{}' is not part of this {} layout", from_ldm ? "LDM" : "diffusers", key, what);
  }
  const std::string rest = key.substr(best_len);
  const std::string& to = from_ldm ? best->diffusers : best->ldm;
  if (!best->inner) return to + rest;
  for (const auto& [ldm, diffusers] : *best->inner) {
    const std::string from = from_ldm ? ldm : diffusers;
    if (rest.compare(0, from.size(), from) == 0) return to + (from_ldm ? diffusers : ldm) + rest.substr(from.size());
  }
  fail("{} key '{}': '{}' is not a known layer of a {} block", from_ldm ? "LDM" : "diffusers", key, rest, what);
}

std::vector<Block> unet_blocks(const UNetKeyLayout& L) {
  const int64_t nrb = L.num_res_blocks;
  if (L.levels <= 0 || nrb <= 0 || static_cast<int64_t>(L.input_attention.size()) != L.levels * nrb ||
      static_cast<int64_t>(L.output_attention.size()) != L.levels * (nrb + 1)) {
    fail("UNetKeyLayout: levels {} and num_res_blocks {} do not match {} input / {} output attention flags", L.levels,
         nrb, L.input_attention.size(), L.output_attention.size());
  }
  std::vector<Block> b = {
      {"time_embed.0.", "time_embedding.linear_1."},
      {"time_embed.2.", "time_embedding.linear_2."},
      {"input_blocks.0.0.", "conv_in."},
      {"out.0.", "conv_norm_out."},
      {"out.2.", "conv_out."},
  };
  if (L.label_emb) {
    b.push_back({"label_emb.0.0.", "add_embedding.linear_1."});
    b.push_back({"label_emb.0.2.", "add_embedding.linear_2."});
  }
  for (int64_t l = 0; l < L.levels; ++l) {
    for (int64_t j = 0; j < nrb; ++j) {
      const int64_t n = 1 + l * (nrb + 1) + j;
      b.push_back(
          {fmt::format("input_blocks.{}.0.", n), fmt::format("down_blocks.{}.resnets.{}.", l, j), &kUNetResnet});
      if (L.input_attention[l * nrb + j]) {
        b.push_back({fmt::format("input_blocks.{}.1.", n), fmt::format("down_blocks.{}.attentions.{}.", l, j)});
      }
    }
    if (l + 1 < L.levels) {
      b.push_back({fmt::format("input_blocks.{}.0.op.", (l + 1) * (nrb + 1)),
                   fmt::format("down_blocks.{}.downsamplers.0.conv.", l)});
    }
  }
  b.push_back({"middle_block.0.", "mid_block.resnets.0.", &kUNetResnet});
  int64_t m = 1;
  if (L.middle_attention) b.push_back({fmt::format("middle_block.{}.", m++), "mid_block.attentions.0."});
  if (L.middle_second_res) b.push_back({fmt::format("middle_block.{}.", m), "mid_block.resnets.1.", &kUNetResnet});
  for (int64_t k = 0; k < L.levels; ++k) {  // k = 0 is the deepest level (up_blocks.0)
    for (int64_t j = 0; j <= nrb; ++j) {
      const int64_t n = k * (nrb + 1) + j;
      b.push_back({fmt::format("output_blocks.{}.0.", n), fmt::format("up_blocks.{}.resnets.{}.", k, j), &kUNetResnet});
      int64_t idx = 1;
      if (L.output_attention[n]) {
        b.push_back({fmt::format("output_blocks.{}.1.", n), fmt::format("up_blocks.{}.attentions.{}.", k, j)});
        idx = 2;
      }
      if (k + 1 < L.levels && j == nrb) {
        b.push_back(
            {fmt::format("output_blocks.{}.{}.conv.", n, idx), fmt::format("up_blocks.{}.upsamplers.0.conv.", k)});
      }
    }
  }
  return b;
}

std::vector<Block> vae_blocks(int64_t levels, int64_t nrb) {
  if (levels <= 0 || nrb <= 0) fail("VAE key map: levels {} and num_res_blocks {} must be positive", levels, nrb);
  std::vector<Block> b;
  for (const char* part : {"encoder", "decoder"}) {
    const std::string p = part;
    b.push_back({p + ".conv_in.", p + ".conv_in."});
    b.push_back({p + ".conv_out.", p + ".conv_out."});
    b.push_back({p + ".norm_out.", p + ".conv_norm_out."});
    b.push_back({p + ".mid.block_1.", p + ".mid_block.resnets.0.", &kVaeResnet});
    b.push_back({p + ".mid.attn_1.", p + ".mid_block.attentions.0.", &kVaeAttention});
    b.push_back({p + ".mid.block_2.", p + ".mid_block.resnets.1.", &kVaeResnet});
  }
  b.push_back({"quant_conv.", "quant_conv."});
  b.push_back({"post_quant_conv.", "post_quant_conv."});
  for (int64_t l = 0; l < levels; ++l) {
    for (int64_t j = 0; j < nrb; ++j) {
      b.push_back({fmt::format("encoder.down.{}.block.{}.", l, j),
                   fmt::format("encoder.down_blocks.{}.resnets.{}.", l, j), &kVaeResnet});
    }
    if (l + 1 < levels) {
      b.push_back({fmt::format("encoder.down.{}.downsample.conv.", l),
                   fmt::format("encoder.down_blocks.{}.downsamplers.0.conv.", l)});
    }
    // The decoder stores level l at up.<l>; diffusers counts up_blocks from the deepest.
    const int64_t k = levels - 1 - l;
    for (int64_t j = 0; j <= nrb; ++j) {
      b.push_back({fmt::format("decoder.up.{}.block.{}.", l, j), fmt::format("decoder.up_blocks.{}.resnets.{}.", k, j),
                   &kVaeResnet});
    }
    if (l > 0) {
      b.push_back(
          {fmt::format("decoder.up.{}.upsample.conv.", l), fmt::format("decoder.up_blocks.{}.upsamplers.0.conv.", k)});
    }
  }
  return b;
}

}  // namespace

std::string unet_ldm_to_diffusers(const std::string& key, const UNetKeyLayout& layout) {
  return map_key(key, unet_blocks(layout), true, "UNet");
}

std::string unet_diffusers_to_ldm(const std::string& key, const UNetKeyLayout& layout) {
  return map_key(key, unet_blocks(layout), false, "UNet");
}

std::string vae_ldm_to_diffusers(const std::string& key, int64_t levels, int64_t num_res_blocks) {
  return map_key(key, vae_blocks(levels, num_res_blocks), true, "VAE");
}

std::string vae_diffusers_to_ldm(const std::string& key, int64_t levels, int64_t num_res_blocks) {
  return map_key(key, vae_blocks(levels, num_res_blocks), false, "VAE");
}

}  // namespace shoestring::io
