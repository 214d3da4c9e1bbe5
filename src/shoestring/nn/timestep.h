// Timestep conditioning for diffusion UNets: the sinusoidal embedding of
// Vaswani et al. 2017 as used by DDPM / LDM (`timestep_embedding` in CompVis
// `ldm/modules/diffusionmodules/util.py`), followed by an MLP
// (diffusers `TimestepEmbedding`: linear_1 -> SiLU -> linear_2).
#pragma once
#include <cstdint>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "shoestring/nn/key_layout.h"
#include "shoestring/nn/layers.h"

namespace shoestring::nn {

/// Sinusoidal embedding of (possibly fractional) timesteps, LDM layout:
/// freqs_i = exp(-ln(max_period) * i / half), i < half = dim / 2;
/// out = [cos(t * freqs), sin(t * freqs)], zero-padded by one column when dim
/// is odd. t: [B] any floating/integer dtype (DDPM scale: 0..1000).
/// Returns [B, dim] float32. Throws shoestring::Error if t is not 1-d or dim < 2.
torch::Tensor timestep_embedding(const torch::Tensor& t, int64_t dim, double max_period = 10000.0);

/// MLP on the sinusoidal embedding: linear_2(SiLU(linear_1(x))).
/// Submodules: linear_1 [in_dim -> time_dim], linear_2 [time_dim -> time_dim],
/// named linear_1 / linear_2 (kShoestring, as diffusers' TimestepEmbedding) or
/// 0 / 2 (kLdm: LDM's nn.Sequential(Linear, SiLU, Linear) `time_embed`, also
/// SDXL's `label_emb.0`). Throws shoestring::Error on non-positive sizes.
class TimestepEmbeddingImpl : public torch::nn::Module {
 public:
  TimestepEmbeddingImpl(int64_t in_dim, int64_t time_dim, KeyLayout layout = KeyLayout::kShoestring,
                        const LayerInit& init = {});
  /// x: [B, in_dim] (any floating dtype; cast to the weights' dtype).
  /// Returns [B, time_dim] in the weights' dtype.
  torch::Tensor forward(const torch::Tensor& x);

  Linear linear_1{nullptr}, linear_2{nullptr};
};
TORCH_MODULE(TimestepEmbedding);

}  // namespace shoestring::nn
