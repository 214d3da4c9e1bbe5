#include "shoestring/models/cascade.h"

#include <cmath>
#include <numeric>
#include <optional>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/units.h"
#include "shoestring/nn/checkpoint.h"

namespace shoestring::models {
namespace {

// A parameterless child that only contributes a path component, as a
// torch.nn.Sequential whose other members (activations, norms without
// affine, dropout) hold no parameters.
std::shared_ptr<torch::nn::Module> container(torch::nn::Module& parent, const std::string& name) {
  return parent.register_module(name, std::make_shared<torch::nn::Module>("Sequential"));
}

torch::Tensor float_if_half(const torch::Tensor& x) {
  return (x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kHalf) ? x.to(torch::kFloat32) : x;
}

// LayerNorm over channels of [B, C, H, W] without affine (StableCascade
// LayerNorm2d, eps 1e-6) of a stream held at `scale` times its reference
// value (activation rescaling): LN(s x, s^2 eps) = LN(x, eps) exactly, so the
// rescaled model is the reference function however small s gets.
torch::Tensor layer_norm_2d(const torch::Tensor& x, double scale = 1.0) {
  torch::Tensor xf = float_if_half(x).permute({0, 2, 3, 1});
  return torch::layer_norm(xf, {x.size(1)}, {}, {}, 1e-6 * scale * scale).permute({0, 3, 1, 2}).to(x.scalar_type());
}

// s Linear(x) = W (s x) + s b for the stream scale s (activation rescaling,
// StageCImpl::set_activation_rescale), never larger than the scaled result;
// the plain Linear at s = 1.
torch::Tensor scaled_output(nn::Linear& fc, const torch::Tensor& x, double s) {
  return s == 1.0 ? fc->forward(x) : fc->forward(x * s, s);
}

// Channels-last MLP shared by ResBlock and FeedForwardBlock:
// Linear -> GELU (erf) -> GRN -> Dropout -> Linear, its output times s.
torch::Tensor channelwise(nn::Linear& fc1, GlobalResponseNorm& grn, nn::Linear& fc2, const torch::Tensor& x, double p,
                          bool training, double s) {
  torch::Tensor h = torch::gelu(fc1->forward(x));
  h = grn->forward(h);
  if (p > 0) h = torch::dropout(h, p, training);
  return scaled_output(fc2, h, s);
}

// Bilinear resampling with align_corners=True (UpDownBlock2d's nn.Upsample).
torch::Tensor resample(const torch::Tensor& x, double factor) {
  namespace F = torch::nn::functional;
  return F::interpolate(x, F::InterpolateFuncOptions()
                               .scale_factor(std::vector<double>{factor, factor})
                               .mode(torch::kBilinear)
                               .align_corners(true));
}

torch::Tensor resize_to(const torch::Tensor& x, const torch::Tensor& like) {
  namespace F = torch::nn::functional;
  return F::interpolate(x, F::InterpolateFuncOptions()
                               .size(std::vector<int64_t>{like.size(2), like.size(3)})
                               .mode(torch::kBilinear)
                               .align_corners(true));
}

void require(bool ok, const char* what) {
  if (!ok) fail("StageC options: {}", what);
}

}  // namespace

StageCOptions StageCOptions::cascade_c_lite() {
  return StageCOptions().cond_dim(1536).hidden({1536, 1536}).heads({24, 24}).down_blocks({4, 12}).up_blocks({12, 4});
}

StageCOptions StageCOptions::tiny() {
  return StageCOptions()
      .cond_dim(32)
      .hidden({32, 32})
      .heads({2, 2})
      .down_blocks({1, 2})
      .up_blocks({2, 1})
      .dropout(0.0)
      .clip_text_dim(32)
      .clip_text_pooled_dim(32)
      .clip_image_dim(32);
}

GlobalResponseNormImpl::GlobalResponseNormImpl(int64_t dim, const nn::LayerInit& init) {
  gamma = register_parameter("gamma", torch::empty({1, 1, 1, dim}, init.options));
  beta = register_parameter("beta", torch::empty({1, 1, 1, dim}, init.options));
  if (init.fills_values()) {
    torch::NoGradGuard no_grad;
    gamma.zero_();
    beta.zero_();
  }
}

torch::Tensor GlobalResponseNormImpl::forward(const torch::Tensor& x) {
  if (x.dim() != 4 || x.size(3) != gamma.size(3))
    fail("GlobalResponseNorm: expected [B, H, W, {}], got {}", gamma.size(3), format_shape(x.sizes()));
  torch::Tensor xf = float_if_half(x);
  torch::Tensor g = torch::linalg_vector_norm(xf, 2, torch::IntArrayRef{1, 2}, /*keepdim=*/true);
  torch::Tensor n = g / (g.mean(-1, /*keepdim=*/true) + 1e-6);
  torch::Tensor y = gamma.to(xf.scalar_type()) * (xf * n) + beta.to(xf.scalar_type()) + xf;
  return y.to(x.scalar_type());
}

CascadeResBlockImpl::CascadeResBlockImpl(int64_t c, int64_t skip, int64_t k, double p, const nn::LayerInit& init)
    : c_skip(skip), dropout(p) {
  depthwise = register_module("depthwise", nn::Conv2d(c, c, k, 1, k / 2, true, init, /*groups=*/c));
  auto cw = container(*this, "channelwise");
  fc1 = cw->register_module("0", nn::Linear(c + skip, 4 * c, true, init));
  grn = cw->register_module("2", GlobalResponseNorm(4 * c, init));
  fc2 = cw->register_module("4", nn::Linear(4 * c, c, true, init));
}

torch::Tensor CascadeResBlockImpl::forward(const torch::Tensor& x, const torch::Tensor& skip, double s) {
  // W * (s h) + s b = s conv(h): the LayerNorm2d (eps s^2 eps) sees the reference.
  torch::Tensor h = layer_norm_2d(depthwise->forward(x, s), s);
  if (c_skip > 0) {
    if (!skip.defined() || skip.dim() != 4 || skip.size(1) != c_skip || skip.size(2) != x.size(2) ||
        skip.size(3) != x.size(3))
      fail("StageC ResBlock: expected skip [B, {}, {}, {}], got {}", c_skip, x.size(2), x.size(3),
           skip.defined() ? format_shape(skip.sizes()) : std::string("none"));
    h = torch::cat({h, skip}, 1);
  }
  h = channelwise(fc1, grn, fc2, h.permute({0, 2, 3, 1}), dropout, is_training(), s).permute({0, 3, 1, 2});
  return h + x;
}

CascadeFeedForwardBlockImpl::CascadeFeedForwardBlockImpl(int64_t c, double p, const nn::LayerInit& init) : dropout(p) {
  auto cw = container(*this, "channelwise");
  fc1 = cw->register_module("0", nn::Linear(c, 4 * c, true, init));
  grn = cw->register_module("2", GlobalResponseNorm(4 * c, init));
  fc2 = cw->register_module("4", nn::Linear(4 * c, c, true, init));
}

torch::Tensor CascadeFeedForwardBlockImpl::forward(const torch::Tensor& x, double s) {
  torch::Tensor h = layer_norm_2d(x, s).permute({0, 2, 3, 1});
  return x + channelwise(fc1, grn, fc2, h, dropout, is_training(), s).permute({0, 3, 1, 2});
}

CascadeTimestepBlockImpl::CascadeTimestepBlockImpl(int64_t c, int64_t r_dim, const std::vector<std::string>& conds,
                                                   const nn::LayerInit& init) {
  mappers.push_back(register_module("mapper", nn::Linear(r_dim, 2 * c, true, init)));
  for (const auto& name : conds)
    mappers.push_back(register_module("mapper_" + name, nn::Linear(r_dim, 2 * c, true, init)));
}

torch::Tensor CascadeTimestepBlockImpl::forward(const torch::Tensor& x, const torch::Tensor& t, double scale_in,
                                                double scale_out) {
  if (!(scale_in > 0) || !(scale_out > 0))
    fail("StageC TimestepBlock: stream scales must be > 0, got {} -> {}", scale_in, scale_out);
  const int64_t n = static_cast<int64_t>(mappers.size());
  const int64_t r_dim = mappers[0]->in_features;
  if (t.dim() != 2 || t.size(1) != n * r_dim)
    fail("StageC TimestepBlock: expected t [B, {}], got {}", n * r_dim, format_shape(t.sizes()));
  torch::Tensor ab;
  for (int64_t i = 0; i < n; ++i) {
    torch::Tensor m = mappers[i]->forward(t.slice(1, i * r_dim, (i + 1) * r_dim));
    ab = ab.defined() ? ab + m : m;
  }
  auto parts = ab.unsqueeze(-1).unsqueeze(-1).chunk(2, 1);
  if (scale_in == 1.0 && scale_out == 1.0) return x * (1 + parts[0]) + parts[1];
  return x * ((scale_out / scale_in) * (1 + parts[0])) + scale_out * parts[1];
}

PackedMultiheadAttentionImpl::PackedMultiheadAttentionImpl(int64_t c_, int64_t h, double p, const nn::LayerInit& init)
    : c(c_), heads(h), dropout(p) {
  if (h <= 0 || c_ % h != 0) fail("StageC attention: {} channels not divisible by {} heads", c_, h);
  in_proj_weight = register_parameter("in_proj_weight", torch::empty({3 * c_, c_}, init.options));
  in_proj_bias = register_parameter("in_proj_bias", torch::empty({3 * c_}, init.options));
  out_proj = register_module("out_proj", nn::Linear(c_, c_, true, init));
  if (init.fills_values()) {  // torch.nn.MultiheadAttention._reset_parameters
    torch::NoGradGuard no_grad;
    torch::nn::init::xavier_uniform_(in_proj_weight);
    in_proj_bias.zero_();
    out_proj->bias.zero_();
  }
}

torch::Tensor PackedMultiheadAttentionImpl::forward(const torch::Tensor& q_in, const torch::Tensor& kv,
                                                    double out_scale) {
  const int64_t B = q_in.size(0), L = q_in.size(1), S = kv.size(1), d = c / heads;
  if (q_in.dim() != 3 || q_in.size(2) != c || kv.dim() != 3 || kv.size(0) != B || kv.size(2) != c)
    fail("StageC attention: expected q [B, L, {0}] and kv [B, S, {0}], got {1} and {2}", c, format_shape(q_in.sizes()),
         format_shape(kv.sizes()));
  // (precision: nn/block_precision.h; in_proj is a raw parameter, not an nn::Linear)
  auto w = nn::to_compute_dtype(in_proj_weight).chunk(3, 0);
  auto b = nn::to_compute_dtype(in_proj_bias).chunk(3, 0);
  auto project = [&](const torch::Tensor& x, int i) {
    torch::Tensor y = torch::linear(x, w[i], b[i]);
    return adapters_[i] ? y + adapters_[i](x) : y;
  };
  torch::Tensor q = project(q_in, 0).view({B, L, heads, d}).transpose(1, 2);
  torch::Tensor k = project(kv, 1).view({B, S, heads, d}).transpose(1, 2);
  torch::Tensor v = project(kv, 2).view({B, S, heads, d}).transpose(1, 2);
  torch::Tensor scores = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(d)));
  torch::Tensor attn = torch::softmax(scores, -1, torch::kFloat32).to(q.scalar_type());
  if (dropout > 0) attn = torch::dropout(attn, dropout, is_training());
  torch::Tensor out = torch::matmul(attn, v).transpose(1, 2).reshape({B, L, c});
  return scaled_output(out_proj, out, out_scale);
}

torch::Tensor PackedMultiheadAttentionImpl::packed_weight(size_t i) const {
  if (i >= 3) fail("StageC attention: packed map {} out of range (q, k, v)", i);
  return in_proj_weight.narrow(0, static_cast<int64_t>(i) * c, c);
}

nn::LayerAdapter& PackedMultiheadAttentionImpl::packed_adapter(size_t i) {
  if (i >= 3) fail("StageC attention: packed map {} out of range (q, k, v)", i);
  return adapters_[i];
}

CascadeAttnBlockImpl::CascadeAttnBlockImpl(int64_t c, int64_t cond_dim, int64_t heads, bool self, double p,
                                           const nn::LayerInit& init)
    : self_attn(self) {
  attn = container(*this, "attention")->register_module("attn", PackedMultiheadAttention(c, heads, p, init));
  kv_mapper = container(*this, "kv_mapper")->register_module("1", nn::Linear(cond_dim, c, true, init));
}

torch::Tensor CascadeAttnBlockImpl::forward(const torch::Tensor& x, const torch::Tensor& cond, double s) {
  const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  torch::Tensor kv = kv_mapper->forward(torch::silu(cond));
  torch::Tensor q = layer_norm_2d(x, s).reshape({B, C, H * W}).transpose(1, 2);  // [B, HW, C]
  if (self_attn) kv = torch::cat({q, kv}, 1);
  torch::Tensor out = attn->forward(q, kv, s).transpose(1, 2).reshape({B, C, H, W});
  return x + out;
}

StageCImpl::StageCImpl(const StageCOptions& o, const nn::LayerInit& init) : options_(o) {
  const size_t levels = o.hidden().size();
  require(levels >= 1, "hidden must not be empty");
  require(o.heads().size() == levels && o.down_blocks().size() == levels && o.up_blocks().size() == levels &&
              o.down_repeat().size() == levels && o.up_repeat().size() == levels && o.level_config().size() == levels,
          "heads, down_blocks, up_blocks, down_repeat, up_repeat and level_config need one entry per level");
  require(o.switch_level().size() + 1 >= levels, "switch_level needs one entry per level transition");
  require(o.r_dim() >= 4 && o.clip_seq() >= 1 && o.patch_size() >= 1 && o.kernel_size() % 2 == 1,
          "r_dim >= 4, clip_seq >= 1, patch_size >= 1 and an odd kernel_size are required");
  for (size_t i = 0; i < levels; ++i) {
    require(o.down_repeat()[i] >= 1 && o.up_repeat()[i] >= 1, "repeats must be >= 1");
    for (char letter : o.level_config()[i])
      if (letter != 'C' && letter != 'T' && letter != 'A' && letter != 'F')
        fail("StageC options: unknown block type '{}' in level_config '{}' (expected C, T, A or F)", letter,
             o.level_config()[i]);
  }

  clip_txt_mapper = register_module("clip_txt_mapper", nn::Linear(o.clip_text_dim(), o.cond_dim(), true, init));
  clip_txt_pooled_mapper = register_module(
      "clip_txt_pooled_mapper", nn::Linear(o.clip_text_pooled_dim(), o.cond_dim() * o.clip_seq(), true, init));
  clip_img_mapper =
      register_module("clip_img_mapper", nn::Linear(o.clip_image_dim(), o.cond_dim() * o.clip_seq(), true, init));
  const int64_t p2 = o.patch_size() * o.patch_size();
  embedding_conv = container(*this, "embedding")
                       ->register_module("1", nn::Conv2d(o.in_channels() * p2, o.hidden()[0], 1, 1, 0, true, init));

  auto make_block = [&](char type, int64_t level, int64_t c_skip) -> std::shared_ptr<torch::nn::Module> {
    const int64_t c = o.hidden()[level];
    switch (type) {
      case 'C': return CascadeResBlock(c, c_skip, o.kernel_size(), o.dropout(), init).ptr();
      case 'A': return CascadeAttnBlock(c, o.cond_dim(), o.heads()[level], o.self_attn(), o.dropout(), init).ptr();
      case 'F': return CascadeFeedForwardBlock(c, o.dropout(), init).ptr();
      default: return CascadeTimestepBlock(c, o.r_dim(), o.t_conds(), init).ptr();
    }
  };

  down_blocks = register_module("down_blocks", torch::nn::ModuleList());
  down_downscalers = register_module("down_downscalers", torch::nn::ModuleList());
  down_repeat_mappers = register_module("down_repeat_mappers", torch::nn::ModuleList());
  for (size_t i = 0; i < levels; ++i) {
    const int64_t c = o.hidden()[i];
    if (i > 0) {
      // Sequential(LayerNorm2d, UpDownBlock2d(blocks = [conv 1x1, interpolation]))
      auto seq = std::make_shared<torch::nn::Module>("Sequential");
      auto blocks = container(*container(*seq, "1"), "blocks");
      downscale_convs_.push_back(blocks->register_module("0", nn::Conv2d(o.hidden()[i - 1], c, 1, 1, 0, true, init)));
      down_downscalers->push_back(seq);
    } else {
      downscale_convs_.push_back(nullptr);
      down_downscalers->push_back(std::make_shared<torch::nn::Module>("Identity"));
    }
    torch::nn::ModuleList level;
    for (int64_t r = 0; r < o.down_blocks()[i]; ++r)
      for (char type : o.level_config()[i]) level->push_back(make_block(type, static_cast<int64_t>(i), 0));
    down_blocks->push_back(level);
    torch::nn::ModuleList mappers;
    for (int64_t r = 0; r + 1 < o.down_repeat()[i]; ++r) mappers->push_back(nn::Conv2d(c, c, 1, 1, 0, true, init));
    down_repeat_mappers->push_back(mappers);
    down_levels_.push_back(level);
    down_maps_.push_back(mappers);
  }

  up_blocks = register_module("up_blocks", torch::nn::ModuleList());
  up_upscalers = register_module("up_upscalers", torch::nn::ModuleList());
  up_repeat_mappers = register_module("up_repeat_mappers", torch::nn::ModuleList());
  for (size_t k = 0; k < levels; ++k) {
    const size_t i = levels - 1 - k;  // level of up_blocks.<k>
    const int64_t c = o.hidden()[i];
    if (i > 0) {
      // Sequential(LayerNorm2d, UpDownBlock2d(blocks = [interpolation, conv 1x1]))
      auto seq = std::make_shared<torch::nn::Module>("Sequential");
      auto blocks = container(*container(*seq, "1"), "blocks");
      upscale_convs_.push_back(blocks->register_module("1", nn::Conv2d(c, o.hidden()[i - 1], 1, 1, 0, true, init)));
      up_upscalers->push_back(seq);
    } else {
      upscale_convs_.push_back(nullptr);
      up_upscalers->push_back(std::make_shared<torch::nn::Module>("Identity"));
    }
    torch::nn::ModuleList level;
    for (int64_t j = 0; j < o.up_blocks()[k]; ++j) {
      const std::string& pattern = o.level_config()[i];
      for (size_t t = 0; t < pattern.size(); ++t) {
        const int64_t c_skip = (i + 1 < levels && j == 0 && t == 0) ? c : 0;
        level->push_back(make_block(pattern[t], static_cast<int64_t>(i), c_skip));
      }
    }
    up_blocks->push_back(level);
    torch::nn::ModuleList mappers;
    for (int64_t r = 0; r + 1 < o.up_repeat()[k]; ++r) mappers->push_back(nn::Conv2d(c, c, 1, 1, 0, true, init));
    up_repeat_mappers->push_back(mappers);
    up_levels_.push_back(level);
    up_maps_.push_back(mappers);
  }

  clf_conv = container(*this, "clf")
                 ->register_module("1", nn::Conv2d(o.hidden()[0], o.out_channels() * p2, 1, 1, 0, true, init));
  if (init.fills_values()) reset_parameters();
  block_table_->declare(this, /*checkpointable=*/false);
  for (const auto* levels : {&down_levels_, &up_levels_})
    for (const auto& level : *levels)
      for (const auto& block : *level) block_table_->declare(block.get());
}

void StageCImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  // General init (StageC._init_weights): xavier-uniform weights, zero biases.
  for (const auto& m : modules(/*include_self=*/false)) {
    if (auto* l = m->as<nn::LinearImpl>()) {
      torch::nn::init::xavier_uniform_(l->weight);
      if (l->bias.defined()) l->bias.zero_();
    } else if (auto* c = m->as<nn::Conv2dImpl>()) {
      torch::nn::init::xavier_uniform_(c->weight);
      if (c->bias.defined()) c->bias.zero_();
    }
  }
  clip_txt_mapper->weight.normal_(0.0, 0.02);
  clip_txt_pooled_mapper->weight.normal_(0.0, 0.02);
  clip_img_mapper->weight.normal_(0.0, 0.02);
  torch::nn::init::xavier_uniform_(embedding_conv->weight, 0.02);
  clf_conv->weight.zero_();
  const int64_t down_total = std::accumulate(options_.down_blocks().begin(), options_.down_blocks().end(), int64_t{0});
  const double scale = std::sqrt(1.0 / static_cast<double>(down_total));
  for (const auto* levels : {&down_levels_, &up_levels_}) {
    for (const auto& level : *levels) {
      for (const auto& block : *level) {
        if (auto* r = block->as<CascadeResBlockImpl>()) r->fc2->weight.mul_(scale);
        if (auto* f = block->as<CascadeFeedForwardBlockImpl>()) f->fc2->weight.mul_(scale);
        if (auto* t = block->as<CascadeTimestepBlockImpl>())
          for (auto& m : t->mappers) m->weight.zero_();
      }
    }
  }
}

torch::Tensor StageCImpl::r_embedding(const torch::Tensor& r) const {
  const int64_t half = options_.r_dim() / 2;
  const double step = std::log(10000.0) / static_cast<double>(half - 1);
  torch::Tensor freqs =
      torch::exp(torch::arange(half, torch::TensorOptions().dtype(torch::kFloat32).device(r.device())) * -step);
  torch::Tensor args = (r.to(torch::kFloat32) * 10000.0).unsqueeze(1) * freqs.unsqueeze(0);
  torch::Tensor emb = torch::cat({args.sin(), args.cos()}, 1);
  if (options_.r_dim() % 2 == 1) emb = torch::constant_pad_nd(emb, {0, 1});
  return emb;
}

torch::Tensor StageCImpl::condition_tokens(const torch::Tensor& clip_text, const torch::Tensor& pooled_in,
                                           const torch::Tensor& img_in) {
  const auto& o = options_;
  if (clip_text.dim() != 3 || clip_text.size(2) != o.clip_text_dim())
    fail("StageC: expected clip_text [B, L, {}], got {}", o.clip_text_dim(), format_shape(clip_text.sizes()));
  const int64_t B = clip_text.size(0);
  torch::Tensor pooled = pooled_in.dim() == 2 ? pooled_in.unsqueeze(1) : pooled_in;
  torch::Tensor img = img_in.dim() == 2 ? img_in.unsqueeze(1) : img_in;
  if (pooled.dim() != 3 || pooled.size(0) != B || pooled.size(2) != o.clip_text_pooled_dim())
    fail("StageC: expected clip_text_pooled [{}, 1, {}], got {}", B, o.clip_text_pooled_dim(),
         format_shape(pooled_in.sizes()));
  if (img.dim() != 3 || img.size(0) != B || img.size(2) != o.clip_image_dim())
    fail("StageC: expected clip_img [{}, 1, {}], got {}", B, o.clip_image_dim(), format_shape(img_in.sizes()));
  torch::Tensor txt = clip_txt_mapper->forward(clip_text);
  torch::Tensor pool = clip_txt_pooled_mapper->forward(pooled).reshape({B, pooled.size(1) * o.clip_seq(), -1});
  torch::Tensor im = clip_img_mapper->forward(img).reshape({B, img.size(1) * o.clip_seq(), -1});
  torch::Tensor clip = torch::cat({txt, pool, im}, 1);
  return torch::layer_norm(float_if_half(clip), {o.cond_dim()}, {}, {}, 1e-6).to(clip.scalar_type());
}

torch::Tensor StageCImpl::run_level(const torch::nn::ModuleList& blocks, const torch::nn::ModuleList& repeat_mappers,
                                    torch::Tensor x, const torch::Tensor& r_embed, const torch::Tensor& cond,
                                    const torch::Tensor& skip, double rescale, double* stream_scale) {
  const nn::BlockTable* table = block_table_->configured() ? block_table_.get() : nullptr;
  // Runs call(block, inputs) directly or, with a configured table, per block
  // as the precision rules say (compute dtype, checkpointing). `call` holds
  // the block's stream scales by value, so a checkpoint's recompute sees the
  // scales of this run even where repeats run the block again.
  auto run = [table](auto block, auto call, std::vector<torch::Tensor> in) -> torch::Tensor {
    if (table)
      return nn::run_block(
          table, block, [block, call](const std::vector<torch::Tensor>& v) { return std::vector{call(*block, v)}; },
          in)[0];
    return call(*block, in);
  };
  // The residual stream is held as `scale` times its reference value
  // (activation rescaling: each TimestepBlock multiplies scale by `rescale`).
  double scale = 1.0;
  const size_t repeats = repeat_mappers->size() + 1;
  for (size_t j = 0; j < repeats; ++j) {
    for (size_t b = 0; b < blocks->size(); ++b) {
      const auto& block = blocks->ptr(b);
      if (auto res = std::dynamic_pointer_cast<CascadeResBlockImpl>(block)) {
        torch::Tensor s = (b == 0 && res->c_skip > 0) ? skip : torch::Tensor();
        if (s.defined() && (x.size(2) != s.size(2) || x.size(3) != s.size(3))) x = resize_to(x, s);
        if (res->c_skip > 0 && !s.defined()) fail("StageC: ResBlock {} of an up level needs a skip input", b);
        if (s.defined()) {
          x = run(res, [scale](auto& m, const auto& v) { return m.forward(v[0], v[1], scale); }, {x, s});
        } else {
          x = run(res, [scale](auto& m, const auto& v) { return m.forward(v[0], torch::Tensor(), scale); }, {x});
        }
      } else if (auto attn = std::dynamic_pointer_cast<CascadeAttnBlockImpl>(block)) {
        x = run(attn, [scale](auto& m, const auto& v) { return m.forward(v[0], v[1], scale); }, {x, cond});
      } else if (auto ts = std::dynamic_pointer_cast<CascadeTimestepBlockImpl>(block)) {
        const double out = scale * rescale;
        x = run(ts, [scale, out](auto& m, const auto& v) { return m.forward(v[0], v[1], scale, out); }, {x, r_embed});
        scale = out;
      } else {
        auto ff = std::dynamic_pointer_cast<CascadeFeedForwardBlockImpl>(block);
        x = run(ff, [scale](auto& m, const auto& v) { return m.forward(v[0], scale); }, {x});
      }
    }
    if (j + 1 < repeats) {
      // W * (s h) + s b = s conv(h): the repeat mapper carries the scale too.
      x = repeat_mappers->ptr<nn::Conv2dImpl>(j)->forward(x, scale);
    }
  }
  if (stream_scale) *stream_scale = scale;
  return x;  // `scale` times the reference: what follows is a LayerNorm2d
}

torch::Tensor StageCImpl::forward(const torch::Tensor& x, const torch::Tensor& r, const torch::Tensor& clip_text,
                                  const torch::Tensor& clip_text_pooled, const torch::Tensor& clip_img,
                                  const std::vector<torch::Tensor>& t_cond_values) {
  if (!block_table_->configured()) return forward_impl(x, r, clip_text, clip_text_pooled, clip_img, t_cond_values);
  if (block_table_->find(this)) {
    auto self = std::static_pointer_cast<StageCImpl>(shared_from_this());
    const torch::Tensor rr = r;  // captured: never rounded to the compute dtype
    const std::vector<torch::Tensor> conds = t_cond_values;
    return nn::run_block(block_table_.get(), self,
                         [self, rr, conds](const std::vector<torch::Tensor>& in) {
                           return std::vector<torch::Tensor>{self->forward_impl(in[0], rr, in[1], in[2], in[3], conds)};
                         },
                         {x, clip_text, clip_text_pooled, clip_img})[0];
  }
  std::optional<nn::ComputeDtypeGuard> guard;
  if (!nn::current_compute_dtype()) guard.emplace(nn::value_dtype(clip_txt_mapper->weight));
  return forward_impl(x, r, clip_text, clip_text_pooled, clip_img, t_cond_values);
}

torch::Tensor StageCImpl::forward_impl(const torch::Tensor& x_in, const torch::Tensor& r,
                                       const torch::Tensor& clip_text, const torch::Tensor& clip_text_pooled,
                                       const torch::Tensor& clip_img, const std::vector<torch::Tensor>& t_cond_values) {
  const auto& o = options_;
  const int64_t p = o.patch_size();
  if (x_in.dim() != 4 || x_in.size(1) != o.in_channels() || x_in.size(2) % p != 0 || x_in.size(3) % p != 0)
    fail("StageC: expected x [B, {}, H, W] with H, W divisible by {}, got {}", o.in_channels(), p,
         format_shape(x_in.sizes()));
  const int64_t B = x_in.size(0);
  if (r.dim() != 1 || r.size(0) != B) fail("StageC: expected r [{}], got {}", B, format_shape(r.sizes()));
  if (clip_text.dim() != 3 || clip_text.size(0) != B)
    fail("StageC: expected clip_text [{}, L, {}], got {}", B, o.clip_text_dim(), format_shape(clip_text.sizes()));
  if (t_cond_values.size() > o.t_conds().size())
    fail("StageC: {} t_cond values given for {} conditions", t_cond_values.size(), o.t_conds().size());

  // Inside a precision scope the model computes in the scope's dtype.
  const auto dtype = nn::current_compute_dtype().value_or(nn::value_dtype(clip_txt_mapper->weight));
  std::vector<torch::Tensor> embeds{r_embedding(r)};
  for (size_t i = 0; i < o.t_conds().size(); ++i) {
    torch::Tensor v = i < t_cond_values.size() && t_cond_values[i].defined() ? t_cond_values[i] : torch::zeros_like(r);
    if (v.dim() != 1 || v.size(0) != B)
      fail("StageC: expected t_cond '{}' [{}], got {}", o.t_conds()[i], B, format_shape(v.sizes()));
    embeds.push_back(r_embedding(v));
  }
  const torch::Tensor r_embed = torch::cat(embeds, 1).to(dtype);
  const torch::Tensor cond = condition_tokens(clip_text, clip_text_pooled, clip_img);

  torch::Tensor x = p > 1 ? torch::pixel_unshuffle(x_in, p) : x_in;
  x = layer_norm_2d(embedding_conv->forward(x));

  const size_t levels = o.hidden().size();
  std::vector<torch::Tensor> level_outputs;  // deepest first, as the reference's _down_encode
  for (size_t i = 0; i < levels; ++i) {
    if (i > 0) {
      x = downscale_convs_[i]->forward(layer_norm_2d(x));
      if (o.switch_level()[i - 1]) x = resample(x, 0.5);
    }
    x = run_level(down_levels_[i], down_maps_[i], x, r_embed, cond, {}, 1.0, nullptr);
    level_outputs.insert(level_outputs.begin(), x);
  }
  x = level_outputs[0];
  double scale = 1.0;                    // of the stream leaving the up group
  for (size_t k = 0; k < levels; ++k) {  // up_blocks.<k> is level levels-1-k
    // Only the last group is rescaled; each group's output goes through a
    // LayerNorm2d (level transition or clf), which removes its scale.
    x = run_level(up_levels_[k], up_maps_[k], x, r_embed, cond, k > 0 ? level_outputs[k] : torch::Tensor(),
                  k + 1 == levels ? activation_rescale_ : 1.0, &scale);
    if (k + 1 < levels) {
      x = layer_norm_2d(x, scale);
      if (o.switch_level()[levels - 2 - k]) x = resample(x, 2.0);
      x = upscale_convs_[k]->forward(x);
    }
  }
  x = clf_conv->forward(layer_norm_2d(x, scale));
  return p > 1 ? torch::pixel_shuffle(x, p) : x;
}

void StageCImpl::set_activation_rescale(double factor) {
  if (!(factor > 0.0 && factor <= 1.0))
    fail("StageC activation rescale: expected a factor in (0, 1] per TimestepBlock, got {}", factor);
  activation_rescale_ = factor;
}

StageC build_cascade_c(const nn::LayerInit& init) { return StageC(StageCOptions::cascade_c(), init); }
StageC build_cascade_c_lite(const nn::LayerInit& init) { return StageC(StageCOptions::cascade_c_lite(), init); }

}  // namespace shoestring::models
