// Residual block with timestep conditioning, as in DDPM (Ho et al. 2020) and
// the Latent Diffusion / Stable Diffusion UNet (Rombach et al. 2022, CompVis
// `openaimodel.ResBlock`; diffusers `ResnetBlock2D`):
//   h = conv1(SiLU(norm1(x))) + time_emb_proj(SiLU(temb))[:, :, None, None]
//   h = conv2(dropout(SiLU(norm2(h))))
//   out = conv_shortcut(x) + h          (conv_shortcut: 1x1, only when channels change)
// The same block is the VAE's ResnetBlock (ldm/modules/diffusionmodules/model.py)
// with temb_dim 0 and eps 1e-6; `layout` picks the checkpoint's key names.
#pragma once
#include <cstdint>

#include <torch/nn/module.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/pimpl.h>

#include "shoestring/nn/key_layout.h"
#include "shoestring/nn/layers.h"

namespace shoestring::nn {

/// Number of GroupNorm groups for `channels`: the largest g <= max_groups that
/// divides channels (32 for the usual SD widths). Throws shoestring::Error if
/// channels or max_groups is not positive.
int64_t norm_groups(int64_t channels, int64_t max_groups = 32);

/// Options for ResBlock.
struct ResBlockOptions {
  ResBlockOptions(int64_t in_channels, int64_t out_channels, int64_t temb_dim)
      : in_channels_(in_channels), out_channels_(out_channels), temb_dim_(temb_dim) {}
  TORCH_ARG(int64_t, in_channels);
  TORCH_ARG(int64_t, out_channels);
  /// Width of the timestep embedding; 0 = no time conditioning (no time_emb_proj).
  TORCH_ARG(int64_t, temb_dim);
  /// Upper bound on GroupNorm groups (see norm_groups()).
  TORCH_ARG(int64_t, groups) = 32;
  TORCH_ARG(double, dropout) = 0.0;
  TORCH_ARG(double, eps) = 1e-5;
  /// Zero-initialise conv2 so the block starts as the identity (LDM's `zero_module`).
  TORCH_ARG(bool, zero_init_out) = true;
  /// Condition by scale and shift of norm2 instead of adding to conv1's
  /// output ("adaptive group normalization", ADM's use_scale_shift_norm,
  /// Dhariwal & Nichol 2021): time_emb_proj gives [scale, shift] (2 x
  /// out_channels) and h = norm2(h) * (1 + scale) + shift.
  TORCH_ARG(bool, scale_shift) = false;
  /// Key names (see KeyLayout): kShoestring norm1, conv1, time_emb_proj, norm2,
  /// conv2, conv_shortcut; kLdm in_layers.0, in_layers.2, emb_layers.1,
  /// out_layers.0, out_layers.3, skip_connection; kLdmAutoencoder norm1, conv1,
  /// temb_proj, norm2, conv2, nin_shortcut.
  TORCH_ARG(KeyLayout, layout) = KeyLayout::kShoestring;
  /// Device/dtype of the parameters; LayerInit{torch::kMeta} allocates nothing.
  TORCH_ARG(LayerInit, init) = LayerInit{};
};

/// DDPM / LDM residual block. Layers: norm1, conv1, time_emb_proj (if
/// temb_dim > 0), norm2, dropout, conv2, conv_shortcut (if channels change),
/// registered under the names of options.layout().
/// Runs in the dtype of its parameters (fp32 or bf16).
class ResBlockImpl : public torch::nn::Module {
 public:
  /// Throws shoestring::Error on non-positive channel counts.
  explicit ResBlockImpl(const ResBlockOptions& options);

  /// x: [B, in_channels, H, W]; temb: [B, temb_dim] (same dtype as x), or
  /// undefined when temb_dim == 0. Returns [B, out_channels, H, W].
  /// Throws shoestring::Error on shape mismatch.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& temb = {});

  const ResBlockOptions& options() const { return options_; }

  GroupNorm norm1{nullptr}, norm2{nullptr};
  Conv2d conv1{nullptr}, conv2{nullptr}, conv_shortcut{nullptr};
  Linear time_emb_proj{nullptr};
  torch::nn::Dropout dropout{nullptr};

 private:
  ResBlockOptions options_;
};
TORCH_MODULE(ResBlock);

}  // namespace shoestring::nn
