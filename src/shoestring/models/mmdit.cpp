#include "shoestring/models/mmdit.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/units.h"
#include "shoestring/nn/checkpoint.h"

namespace shoestring::models {
namespace {

// A parameterless path component, like a torch.nn.Sequential whose other
// members (SiLU) hold no parameters.
std::shared_ptr<torch::nn::Module> container(torch::nn::Module& parent, const std::string& name) {
  return parent.register_module(name, std::make_shared<torch::nn::Module>("Sequential"));
}

// LayerNorm over the last dimension without affine, eps 1e-6; fp32 math for half types.
torch::Tensor layer_norm_no_affine(const torch::Tensor& x) {
  const bool half = x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kHalf;
  torch::Tensor xf = half ? x.to(torch::kFloat32) : x;
  return torch::layer_norm(xf, {x.size(-1)}, {}, {}, 1e-6).to(x.scalar_type());
}

// x * (1 + scale) + shift with per-sample [B, D] shift / scale over [B, L, D].
torch::Tensor modulate(const torch::Tensor& x, const torch::Tensor& shift, const torch::Tensor& scale) {
  return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1);
}

// Scaled dot-product attention with grouped key/value heads.
// q: [B, L, H, D]; k, v: [B, S, G, D] with G dividing H; query head h uses
// key/value head h / (H / G). Returns [B, L, H * D]. Softmax in fp32.
torch::Tensor grouped_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  const int64_t B = q.size(0), L = q.size(1), H = q.size(2), D = q.size(3), G = k.size(2);
  torch::Tensor qh = q.reshape({B, L, G, H / G, D}).permute({0, 2, 3, 1, 4});  // [B, G, R, L, D]
  torch::Tensor kh = k.permute({0, 2, 1, 3}).unsqueeze(2);                     // [B, G, 1, S, D]
  torch::Tensor vh = v.permute({0, 2, 1, 3}).unsqueeze(2);
  torch::Tensor scores = torch::matmul(qh, kh.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(D)));
  torch::Tensor attn = torch::softmax(scores, -1, torch::kFloat32).to(q.scalar_type());
  return torch::matmul(attn, vh).permute({0, 3, 1, 2, 4}).reshape({B, L, H * D});
}

// Sinusoidal timestep features [cos | sin] (mmditx.py TimestepEmbedder.timestep_embedding).
torch::Tensor timestep_features(const torch::Tensor& t, int64_t dim) {
  const int64_t half = dim / 2;
  torch::Tensor freqs =
      torch::exp(torch::arange(half, torch::TensorOptions().dtype(torch::kFloat32).device(t.device())) *
                 (-std::log(10000.0) / static_cast<double>(half)));
  torch::Tensor args = t.to(torch::kFloat32).unsqueeze(1) * freqs.unsqueeze(0);
  torch::Tensor emb = torch::cat({args.cos(), args.sin()}, 1);
  if (dim % 2) emb = torch::constant_pad_nd(emb, {0, 1});
  return emb;
}

torch::Tensor sincos_1d(int64_t dim, const torch::Tensor& pos) {
  torch::Tensor omega = torch::arange(dim / 2, torch::kFloat64) / (dim / 2.0);
  omega = 1.0 / torch::pow(10000.0, omega);
  torch::Tensor out = pos.to(torch::kFloat64).reshape({-1, 1}) * omega.unsqueeze(0);
  return torch::cat({out.sin(), out.cos()}, 1);
}

}  // namespace

torch::Tensor sincos_pos_embed_2d(int64_t dim, int64_t grid) {
  if (dim % 4 != 0) fail("sincos_pos_embed_2d: dim {} must be divisible by 4", dim);
  // One [grid, dim/2] table (computed in fp64, as the reference's numpy) serves rows and columns.
  torch::Tensor table = sincos_1d(dim / 2, torch::arange(grid, torch::kInt64)).to(torch::kFloat32);
  torch::Tensor idx = torch::arange(grid * grid, torch::kInt64);
  return torch::cat({table.index_select(0, idx.remainder(grid)), table.index_select(0, idx.div(grid, "floor"))}, 1);
}

MMDiTAttentionImpl::MMDiTAttentionImpl(int64_t dim, int64_t h, int64_t g, bool qkv_bias, bool pre_only, bool qk_norm,
                                       const nn::LayerInit& init)
    : heads(h), kv_heads(g), head_dim(dim / h) {
  qkv = register_module("qkv", nn::Linear(dim, (h + 2 * g) * head_dim, qkv_bias, init));
  if (!pre_only) proj = register_module("proj", nn::Linear(h * head_dim, dim, true, init));
  if (qk_norm) {
    ln_q = register_module("ln_q", nn::RMSNorm(head_dim, 1e-6, true, init));
    ln_k = register_module("ln_k", nn::RMSNorm(head_dim, 1e-6, true, init));
  }
}

std::vector<torch::Tensor> MMDiTAttentionImpl::pre_attention(const torch::Tensor& x) {
  const int64_t B = x.size(0), L = x.size(1);
  torch::Tensor y = qkv->forward(x).view({B, L, heads + 2 * kv_heads, head_dim});
  torch::Tensor q = y.slice(2, 0, heads);
  torch::Tensor k = y.slice(2, heads, heads + kv_heads);
  torch::Tensor v = y.slice(2, heads + kv_heads, heads + 2 * kv_heads);
  if (ln_q) {
    q = ln_q->forward(q);
    k = ln_k->forward(k);
  }
  return {q, k, v};
}

MMDiTMlpImpl::MMDiTMlpImpl(int64_t dim, int64_t hidden, const nn::LayerInit& init) {
  fc1 = register_module("fc1", nn::Linear(dim, hidden, true, init));
  fc2 = register_module("fc2", nn::Linear(hidden, dim, true, init));
}

torch::Tensor MMDiTMlpImpl::forward(const torch::Tensor& x) {
  return fc2->forward(torch::gelu(fc1->forward(x), "tanh"));
}

MMDiTStreamBlockImpl::MMDiTStreamBlockImpl(const MMDiTOptions& o, bool pre, bool self_attn2, const nn::LayerInit& init)
    : pre_only(pre), has_attn2(self_attn2) {
  const int64_t H = o.hidden();
  attn = register_module("attn", MMDiTAttention(H, o.heads(), o.kv_heads(), o.qkv_bias(), pre, o.qk_norm(), init));
  if (self_attn2)
    attn2 =
        register_module("attn2", MMDiTAttention(H, o.heads(), o.kv_heads(), o.qkv_bias(), false, o.qk_norm(), init));
  if (!pre) mlp = register_module("mlp", MMDiTMlp(H, static_cast<int64_t>(H * o.mlp_ratio()), init));
  const int64_t n_mods = self_attn2 ? 9 : (pre ? 2 : 6);
  adaLN_modulation = container(*this, "adaLN_modulation")->register_module("1", nn::Linear(H, n_mods * H, true, init));
}

MMDiTJointBlockImpl::MMDiTJointBlockImpl(const MMDiTOptions& o, bool last, bool self_attn2, const nn::LayerInit& init) {
  context_block = register_module("context_block", MMDiTStreamBlock(o, /*pre_only=*/last, false, init));
  x_block = register_module("x_block", MMDiTStreamBlock(o, false, self_attn2, init));
}

std::vector<torch::Tensor> MMDiTJointBlockImpl::forward(const torch::Tensor& context, const torch::Tensor& x,
                                                        const torch::Tensor& c) {
  auto& cb = *context_block;
  auto& xb = *x_block;
  const torch::Tensor silu_c = torch::silu(c);
  auto cm = cb.adaLN_modulation->forward(silu_c).chunk(cb.pre_only ? 2 : 6, 1);
  auto xm = xb.adaLN_modulation->forward(silu_c).chunk(xb.has_attn2 ? 9 : 6, 1);

  auto cqkv = cb.attn->pre_attention(modulate(layer_norm_no_affine(context), cm[0], cm[1]));
  const torch::Tensor x_norm = layer_norm_no_affine(x);
  auto xqkv = xb.attn->pre_attention(modulate(x_norm, xm[0], xm[1]));
  const int64_t Lc = context.size(1);
  torch::Tensor a = grouped_attention(torch::cat({cqkv[0], xqkv[0]}, 1), torch::cat({cqkv[1], xqkv[1]}, 1),
                                      torch::cat({cqkv[2], xqkv[2]}, 1));

  torch::Tensor ctx_out;
  if (!cb.pre_only) {
    ctx_out = context + cm[2].unsqueeze(1) * cb.attn->proj->forward(a.slice(1, 0, Lc));
    ctx_out = ctx_out + cm[5].unsqueeze(1) * cb.mlp->forward(modulate(layer_norm_no_affine(ctx_out), cm[3], cm[4]));
  }
  torch::Tensor y = x + xm[2].unsqueeze(1) * xb.attn->proj->forward(a.slice(1, Lc));
  if (xb.has_attn2) {
    auto q2 = xb.attn2->pre_attention(modulate(x_norm, xm[6], xm[7]));
    y = y + xm[8].unsqueeze(1) * xb.attn2->proj->forward(grouped_attention(q2[0], q2[1], q2[2]));
  }
  y = y + xm[5].unsqueeze(1) * xb.mlp->forward(modulate(layer_norm_no_affine(y), xm[3], xm[4]));
  return {ctx_out, y};
}

MMDiTImpl::MMDiTImpl(const MMDiTOptions& o, const nn::LayerInit& init) : options_(o) {
  const int64_t H = o.hidden(), heads = o.heads(), kv = o.kv_heads();
  if (o.depth() < 1) fail("MMDiT options: depth must be >= 1, got {}", o.depth());
  if (H % heads != 0) fail("MMDiT options: hidden size {} not divisible by {} heads", H, heads);
  if (kv < 1 || heads % kv != 0) fail("MMDiT options: {} key/value heads must divide {} heads", kv, heads);
  if (o.patch_size() < 1 || o.pos_embed_max_size() < 1)
    fail("MMDiT options: patch_size and pos_embed_max_size must be >= 1");
  if (H % 4 != 0) fail("MMDiT options: hidden size {} must be divisible by 4 (2-D sin-cos embedding)", H);
  for (int64_t l : o.x_block_self_attn_layers())
    if (l < 0 || l >= o.depth()) fail("MMDiT options: x_block_self_attn layer {} outside 0..{}", l, o.depth() - 1);

  x_embedder =
      container(*this, "x_embedder")
          ->register_module("proj", nn::Conv2d(o.in_channels(), H, o.patch_size(), o.patch_size(), 0, true, init));
  auto t_mlp = container(*container(*this, "t_embedder"), "mlp");
  t_embedder_0 = t_mlp->register_module("0", nn::Linear(o.frequency_embedding_size(), H, true, init));
  t_embedder_2 = t_mlp->register_module("2", nn::Linear(H, H, true, init));
  auto y_mlp = container(*container(*this, "y_embedder"), "mlp");
  y_embedder_0 = y_mlp->register_module("0", nn::Linear(o.adm_in_channels(), H, true, init));
  y_embedder_2 = y_mlp->register_module("2", nn::Linear(H, H, true, init));
  context_embedder = register_module("context_embedder", nn::Linear(o.context_dim(), H, true, init));

  const int64_t M = o.pos_embed_max_size();
  pos_embed = register_buffer("pos_embed", torch::empty({1, M * M, H}, init.options));

  joint_blocks = register_module("joint_blocks", torch::nn::ModuleList());
  const auto& sa = o.x_block_self_attn_layers();
  for (int64_t i = 0; i < o.depth(); ++i) {
    const bool attn2 = std::find(sa.begin(), sa.end(), i) != sa.end();
    blocks_.push_back(MMDiTJointBlock(o, i == o.depth() - 1, attn2, init));
    joint_blocks->push_back(blocks_.back());
  }
  auto fl = container(*this, "final_layer");
  final_linear =
      fl->register_module("linear", nn::Linear(H, o.patch_size() * o.patch_size() * o.out_channels(), true, init));
  final_adaLN = container(*fl, "adaLN_modulation")->register_module("1", nn::Linear(H, 2 * H, true, init));
  if (init.fills_values()) reset_parameters();
  block_table_->declare(this, /*checkpointable=*/false);
  for (const auto& b : blocks_) block_table_->declare(b.get());
}

void MMDiTImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  for (const auto& m : modules(/*include_self=*/false)) {
    if (auto* l = m->as<nn::LinearImpl>()) {
      torch::nn::init::xavier_uniform_(l->weight);
      if (l->bias.defined()) l->bias.zero_();
    }
  }
  torch::nn::init::xavier_uniform_(x_embedder->weight.view({x_embedder->weight.size(0), -1}));
  x_embedder->bias.zero_();
  for (auto* l : {&t_embedder_0, &t_embedder_2, &y_embedder_0, &y_embedder_2}) (*l)->weight.normal_(0.0, 0.02);
  for (auto& b : blocks_) {
    for (auto* s : {&b->context_block, &b->x_block}) {
      (*s)->adaLN_modulation->weight.zero_();
      (*s)->adaLN_modulation->bias.zero_();
    }
  }
  final_adaLN->weight.zero_();
  final_adaLN->bias.zero_();
  final_linear->weight.zero_();
  final_linear->bias.zero_();
  pos_embed.copy_(sincos_pos_embed_2d(options_.hidden(), options_.pos_embed_max_size()).unsqueeze(0));
}

torch::Tensor MMDiTImpl::cropped_pos_embed(int64_t h, int64_t w, const PosEmbedCrop& crop) const {
  const int64_t M = options_.pos_embed_max_size();
  if (h > M || w > M) fail("MMDiT: a {}x{} patch grid exceeds pos_embed_max_size {}", h, w, M);
  const bool centred = crop.top < 0;
  const int64_t top = centred ? (M - h) / 2 : crop.top, left = centred ? (M - w) / 2 : crop.left;
  if (left < 0 || top + h > M || left + w > M)
    fail("MMDiT: a {}x{} patch grid at ({}, {}) leaves the {}x{} position embedding", h, w, top, left, M, M);
  return pos_embed.view({1, M, M, -1}).slice(1, top, top + h).slice(2, left, left + w).reshape({1, h * w, -1});
}

torch::Tensor MMDiTImpl::forward(const torch::Tensor& x, const torch::Tensor& t, const torch::Tensor& context,
                                 const torch::Tensor& y, const std::vector<int64_t>& skip_layers,
                                 const PosEmbedCrop& crop) {
  std::vector<bool> skip(blocks_.size(), false);  // per joint block
  for (int64_t i : skip_layers) {
    if (i < 0 || i >= static_cast<int64_t>(blocks_.size()))
      fail("MMDiT: skip layer {} is not a joint block index (depth {})", i, blocks_.size());
    skip[static_cast<size_t>(i)] = true;
  }
  if (!block_table_->configured()) return forward_impl(x, t, context, y, skip, crop);
  if (block_table_->find(this)) {
    auto self = std::static_pointer_cast<MMDiTImpl>(shared_from_this());
    const torch::Tensor time = t;  // captured: never rounded to the compute dtype
    return nn::run_block(block_table_.get(), self,
                         [self, time, skip, crop](const std::vector<torch::Tensor>& in) {
                           return std::vector<torch::Tensor>{
                               self->forward_impl(in[0], time, in[1], in[2], skip, crop)};
                         },
                         {x, context, y})[0];
  }
  std::optional<nn::ComputeDtypeGuard> guard;
  if (!nn::current_compute_dtype()) guard.emplace(nn::value_dtype(context_embedder->weight));
  return forward_impl(x, t, context, y, skip, crop);
}

torch::Tensor MMDiTImpl::forward_impl(const torch::Tensor& x_in, const torch::Tensor& t,
                                      const torch::Tensor& context_in, const torch::Tensor& y,
                                      const std::vector<bool>& skip, const PosEmbedCrop& crop) {
  const auto& o = options_;
  const int64_t p = o.patch_size();
  if (x_in.dim() != 4 || x_in.size(1) != o.in_channels() || x_in.size(2) % p != 0 || x_in.size(3) % p != 0)
    fail("MMDiT: expected x [B, {}, H, W] with H, W divisible by {}, got {}", o.in_channels(), p,
         format_shape(x_in.sizes()));
  const int64_t B = x_in.size(0), h = x_in.size(2) / p, w = x_in.size(3) / p;
  if (t.dim() != 1 || t.size(0) != B) fail("MMDiT: expected t [{}], got {}", B, format_shape(t.sizes()));
  if (context_in.dim() != 3 || context_in.size(0) != B || context_in.size(2) != o.context_dim())
    fail("MMDiT: expected context [{}, L, {}], got {}", B, o.context_dim(), format_shape(context_in.sizes()));
  if (y.dim() != 2 || y.size(0) != B || y.size(1) != o.adm_in_channels())
    fail("MMDiT: expected y [{}, {}], got {}", B, o.adm_in_channels(), format_shape(y.sizes()));

  // Inside a precision scope the model computes in the scope's dtype.
  const auto dtype = nn::current_compute_dtype().value_or(nn::value_dtype(context_embedder->weight));
  torch::Tensor x = x_embedder->forward(x_in).flatten(2).transpose(1, 2) + cropped_pos_embed(h, w, crop).to(dtype);
  torch::Tensor tf = timestep_features(t * 1000.0, o.frequency_embedding_size()).to(dtype);
  torch::Tensor c = t_embedder_2->forward(torch::silu(t_embedder_0->forward(tf)));
  c = c + y_embedder_2->forward(torch::silu(y_embedder_0->forward(y)));
  torch::Tensor context = context_embedder->forward(context_in);

  for (size_t i = 0; i < blocks_.size(); ++i) {
    if (skip[i]) continue;  // skip-layer guidance: the block's outputs are its inputs
    MMDiTJointBlock block = blocks_[i];
    const bool last = i + 1 == blocks_.size();  // its context output is undefined
    std::vector<torch::Tensor> out;
    if (block_table_->configured()) {
      // Per block, as the precision rules say (compute dtype, checkpointing).
      out = nn::run_block(block_table_.get(), block.ptr(),
                          [impl = block.ptr(), last](const std::vector<torch::Tensor>& in) {
                            auto r = impl->forward(in[0], in[1], in[2]);
                            return last ? std::vector<torch::Tensor>{r[1]} : r;
                          },
                          {context, x, c});
      if (last) out = {torch::Tensor(), out[0]};
    } else {
      out = block->forward(context, x, c);
    }
    context = out[0];
    x = out[1];
  }
  auto mod = final_adaLN->forward(torch::silu(c)).chunk(2, 1);
  x = final_linear->forward(modulate(layer_norm_no_affine(x), mod[0], mod[1]));  // [B, h*w, p*p*C]
  const int64_t C = o.out_channels();
  return x.reshape({B, h, w, p, p, C}).permute({0, 5, 1, 3, 2, 4}).reshape({B, C, h * p, w * p});
}

MMDiT build_sd35_medium(const nn::LayerInit& init) { return MMDiT(MMDiTOptions::sd35_medium(), init); }

}  // namespace shoestring::models
