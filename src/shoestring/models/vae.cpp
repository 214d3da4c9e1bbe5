#include "shoestring/models/vae.h"

#include <cmath>
#include <string>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/text.h"
#include "shoestring/core/units.h"
#include "shoestring/nn/key_layout.h"

namespace shoestring::models {
namespace {


// LDM ResnetBlock: no time embedding, GroupNorm eps 1e-6, default-initialised conv2.
nn::ResBlock vae_res(const VaeOptions& o, int64_t in, int64_t out) {
  return nn::ResBlock(nn::ResBlockOptions(in, out, 0)
                          .groups(o.groups())
                          .eps(1e-6)
                          .zero_init_out(false)
                          .layout(nn::KeyLayout::kLdmAutoencoder)
                          .init(o.init()));
}

nn::GroupNorm vae_norm(const VaeOptions& o, int64_t channels) {
  return nn::GroupNorm(nn::norm_groups(channels, o.groups()), channels, 1e-6, true, o.init());
}

void check_options(const VaeOptions& o) {
  if (o.ch_mult().empty() || o.ch() <= 0 || o.num_res_blocks() <= 0 || o.z_channels() <= 0 || o.in_channels() <= 0 ||
      o.out_channels() <= 0) {
    fail("VAE: ch_mult must be non-empty and ch, num_res_blocks, z_channels, in/out channels positive");
  }
}

}  // namespace

VaeAttentionImpl::VaeAttentionImpl(int64_t c, int64_t groups, const nn::LayerInit& init) {
  norm = register_module("norm", nn::GroupNorm(nn::norm_groups(c, groups), c, 1e-6, true, init));
  q = register_module("q", nn::Conv2d(c, c, 1, 1, 0, true, init));
  k = register_module("k", nn::Conv2d(c, c, 1, 1, 0, true, init));
  v = register_module("v", nn::Conv2d(c, c, 1, 1, 0, true, init));
  proj_out = register_module("proj_out", nn::Conv2d(c, c, 1, 1, 0, true, init));
}

torch::Tensor VaeAttentionImpl::forward(const torch::Tensor& x) {
  const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const torch::Tensor h = norm->forward(x);
  const torch::Tensor qt = q->forward(h).reshape({B, C, H * W}).transpose(1, 2);  // [B, HW, C]
  const torch::Tensor kt = k->forward(h).reshape({B, C, H * W});                  // [B, C, HW]
  const torch::Tensor vt = v->forward(h).reshape({B, C, H * W});                  // [B, C, HW]
  const torch::Tensor w = (torch::bmm(qt, kt) * (1.0 / std::sqrt(static_cast<double>(C)))).softmax(-1);
  const torch::Tensor out = torch::bmm(vt, w.transpose(1, 2)).reshape({B, C, H, W});  // [B, C, HW]
  return x + proj_out->forward(out);
}

VaeMidImpl::VaeMidImpl(int64_t c, const VaeOptions& o) {
  block_1 = register_module("block_1", vae_res(o, c, c));
  attn_1 = register_module("attn_1", VaeAttention(c, o.groups(), o.init()));
  block_2 = register_module("block_2", vae_res(o, c, c));
}

torch::Tensor VaeMidImpl::forward(const torch::Tensor& x) {
  return block_2->forward(attn_1->forward(block_1->forward(x)));
}

VaeEncoderImpl::VaeEncoderImpl(const VaeOptions& o) {
  check_options(o);
  const auto& mult = o.ch_mult();
  const int64_t levels = static_cast<int64_t>(mult.size());
  conv_in = register_module("conv_in", nn::Conv2d(o.in_channels(), o.ch(), 3, 1, 1, true, o.init()));
  down = register_module("down", torch::nn::ModuleList());
  int64_t c = o.ch();
  for (int64_t l = 0; l < levels; ++l) {
    VaeLevel level;
    level->block = level->register_module("block", torch::nn::ModuleList());
    for (int64_t i = 0; i < o.num_res_blocks(); ++i) {
      level->block->push_back(vae_res(o, c, o.ch() * mult[l]));
      c = o.ch() * mult[l];
    }
    if (l + 1 < levels) {
      level->downsample = nn::register_at(*level, "downsample.conv", nn::Conv2d(c, c, 3, 2, 0, true, o.init()));
    }
    down->push_back(level);
  }
  mid = register_module("mid", VaeMid(c, o));
  norm_out = register_module("norm_out", vae_norm(o, c));
  conv_out = register_module("conv_out", nn::Conv2d(c, 2 * o.z_channels(), 3, 1, 1, true, o.init()));
}

torch::Tensor VaeEncoderImpl::forward(const torch::Tensor& x) {
  torch::Tensor h = conv_in->forward(x);
  for (const auto& m : *down) {
    auto* level = m->as<VaeLevelImpl>();
    for (const auto& b : *level->block) h = b->as<nn::ResBlockImpl>()->forward(h);
    // LDM Downsample: pad right and bottom by one, then a 3x3 stride-2 conv without padding.
    if (level->downsample) h = level->downsample->forward(torch::constant_pad_nd(h, {0, 1, 0, 1}, 0));
  }
  h = mid->forward(h);
  return conv_out->forward(torch::silu(norm_out->forward(h)));
}

VaeDecoderImpl::VaeDecoderImpl(const VaeOptions& o) {
  check_options(o);
  const auto& mult = o.ch_mult();
  const int64_t levels = static_cast<int64_t>(mult.size());
  int64_t c = o.ch() * mult.back();
  conv_in = register_module("conv_in", nn::Conv2d(o.z_channels(), c, 3, 1, 1, true, o.init()));
  mid = register_module("mid", VaeMid(c, o));
  // Built deepest first (parameter shapes depend on the running width) but
  // stored at the index of the level, as LDM's `self.up.insert(0, up)`.
  std::vector<VaeLevel> levels_built(levels, nullptr);
  for (int64_t l = levels - 1; l >= 0; --l) {
    VaeLevel level;
    level->block = level->register_module("block", torch::nn::ModuleList());
    for (int64_t i = 0; i <= o.num_res_blocks(); ++i) {
      level->block->push_back(vae_res(o, c, o.ch() * mult[l]));
      c = o.ch() * mult[l];
    }
    if (l > 0) level->upsample = nn::register_at(*level, "upsample.conv", nn::Conv2d(c, c, 3, 1, 1, true, o.init()));
    levels_built[l] = level;
  }
  up = register_module("up", torch::nn::ModuleList());
  for (auto& level : levels_built) up->push_back(level);
  norm_out = register_module("norm_out", vae_norm(o, c));
  conv_out = register_module("conv_out", nn::Conv2d(c, o.out_channels(), 3, 1, 1, true, o.init()));
}

torch::Tensor VaeDecoderImpl::forward(const torch::Tensor& z) {
  torch::Tensor h = mid->forward(conv_in->forward(z));
  for (int64_t l = static_cast<int64_t>(up->size()) - 1; l >= 0; --l) {
    auto* level = up[l]->as<VaeLevelImpl>();
    for (const auto& b : *level->block) h = b->as<nn::ResBlockImpl>()->forward(h);
    if (level->upsample) {
      namespace F = torch::nn::functional;
      h = level->upsample->forward(F::interpolate(
          h,
          F::InterpolateFuncOptions().size(std::vector<int64_t>{h.size(2) * 2, h.size(3) * 2}).mode(torch::kNearest)));
    }
  }
  return conv_out->forward(torch::silu(norm_out->forward(h)));
}

AutoencoderKLImpl::AutoencoderKLImpl(const VaeOptions& options) : options_(options) {
  const auto& o = options_;
  encoder = register_module("encoder", VaeEncoder(o));
  decoder = register_module("decoder", VaeDecoder(o));
  const int64_t z = o.z_channels();
  if (o.use_quant_conv()) {
    quant_conv = register_module("quant_conv", nn::Conv2d(2 * z, 2 * z, 1, 1, 0, true, o.init()));
    post_quant_conv = register_module("post_quant_conv", nn::Conv2d(z, z, 1, 1, 0, true, o.init()));
  }
}

VaePosterior AutoencoderKLImpl::encode(const torch::Tensor& x) {
  const auto& o = options_;
  const int64_t factor = int64_t{1} << (o.ch_mult().size() - 1);
  if (!x.defined() || x.dim() != 4 || x.size(1) != o.in_channels() || x.size(2) % factor != 0 ||
      x.size(3) % factor != 0) {
    fail("VAE encode: x must be [B, {}, H, W] with H, W divisible by {}, got {}", o.in_channels(), factor,
         x.defined() ? format_shape(x.sizes()) : "undefined");
  }
  torch::Tensor h = encoder->forward(x);
  if (quant_conv) h = quant_conv->forward(h);
  const auto moments = h.chunk(2, 1);
  return {moments[0], moments[1].clamp(-30.0, 20.0)};
}

torch::Tensor AutoencoderKLImpl::decode(const torch::Tensor& z) {
  if (!z.defined() || z.dim() != 4 || z.size(1) != options_.z_channels()) {
    fail("VAE decode: z must be [B, {}, h, w], got {}", options_.z_channels(),
         z.defined() ? format_shape(z.sizes()) : "undefined");
  }
  return decoder->forward(post_quant_conv ? post_quant_conv->forward(z) : z);
}

torch::Tensor AutoencoderKLImpl::encode_latents(const torch::Tensor& x, bool sample,
                                                c10::optional<at::Generator> generator) {
  const VaePosterior p = encode(x);
  torch::Tensor z = p.mean;
  if (sample) {
    torch::Tensor eps = at::empty_like(p.mean);
    eps.normal_(0.0, 1.0, generator);
    z = p.mean + torch::exp(0.5 * p.logvar) * eps;
  }
  // SD3LatentFormat.process_in; with shift 0 exactly the SD formula z * scale.
  if (options_.shift_factor() != 0.0) z = z - options_.shift_factor();
  return z * options_.scaling_factor();
}

torch::Tensor AutoencoderKLImpl::decode_latents(const torch::Tensor& z) {
  // SD3LatentFormat.process_out.
  torch::Tensor u = z / options_.scaling_factor();
  if (options_.shift_factor() != 0.0) u = u + options_.shift_factor();
  return decode(u);
}

LoadWeightsReport load_vae(AutoencoderKLImpl& vae, const WeightFiles& files) {
  static const std::string prefix = "first_stage_model.";
  const std::vector<std::string> names = files.names();
  bool prefixed = false;
  for (const auto& n : names) prefixed = prefixed || has_prefix(n, prefix);
  const std::string p = prefixed ? prefix : "";
  const bool want_quant = static_cast<bool>(vae.quant_conv);
  const int64_t z = vae.options().z_channels();
  // Without the encoder's last conv the file holds no VAE: load_weights lists what is missing.
  const TensorInfo* conv_out = files.find(p + "encoder.conv_out.weight");
  for (const char* key : {"quant_conv.weight", "quant_conv.bias", "post_quant_conv.weight", "post_quant_conv.bias"}) {
    const bool has = files.find(p + key) != nullptr;
    if (has && !want_quant) {
      fail(
          "{}: unexpected tensor \"{}{}\": this VAE is built without quant_conv / post_quant_conv (the SD3 / SD3.5 "
          "VAE, {} latent channels); the file holds an SD 1.x / SDXL-style VAE",
          files.path(), p, key, z);
    }
    if (!has && want_quant && conv_out) {
      fail(
          "{}: missing tensor \"{}{}\": this VAE is built with quant_conv / post_quant_conv (the SD 1.x / SDXL "
          "VAE, {} latent channels); a file without them holds an SD3 / SD3.5-style VAE",
          files.path(), p, key, z);
    }
  }
  if (conv_out && !conv_out->shape.empty() && conv_out->shape[0] != 2 * z) {
    fail("{}: \"{}encoder.conv_out.weight\" is {}: the file's VAE has {} latent channels, this one {}", files.path(), p,
         format_shape(conv_out->shape), conv_out->shape[0] / 2, z);
  }
  LoadWeightsOptions lo;
  lo.key_map = [p](const std::string& key) -> std::string {
    if (p.empty()) return key;
    return has_prefix(key, p) ? key.substr(p.size()) : "";
  };
  return load_weights(vae, files, lo);
}

}  // namespace shoestring::models
