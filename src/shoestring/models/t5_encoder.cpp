#include "shoestring/models/t5_encoder.h"

#include <cmath>
#include <limits>
#include <map>
#include <vector>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/units.h"
#include "shoestring/nn/block_precision.h"
#include "shoestring/nn/key_layout.h"

namespace shoestring::models {
namespace {

void check_options(const T5EncoderOptions& o) {
  if (o.vocab_size() <= 0 || o.d_model() <= 0 || o.num_heads() <= 0 || o.d_kv() <= 0 || o.d_ff() <= 0 ||
      o.num_layers() <= 0)
    fail("T5EncoderOptions: sizes must be positive (vocab {}, d_model {}, heads {}, d_kv {}, d_ff {}, layers {})",
         o.vocab_size(), o.d_model(), o.num_heads(), o.d_kv(), o.d_ff(), o.num_layers());
  if (o.num_buckets() < 4 || o.max_distance() <= o.num_buckets() / 2 / 2)
    fail("T5EncoderOptions: need num_buckets >= 4 and max_distance > num_buckets / 4, got {} and {}", o.num_buckets(),
         o.max_distance());
  if (!(o.eps() > 0)) fail("T5EncoderOptions: eps must be positive, got {}", o.eps());
}

// The most negative finite value of `dtype` (torch.finfo(dtype).min): HF's
// additive mask value.
double lowest(at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble: return std::numeric_limits<double>::lowest();
    case at::kFloat: return std::numeric_limits<float>::lowest();
    case at::kBFloat16: return static_cast<double>(std::numeric_limits<c10::BFloat16>::lowest());
    case at::kHalf: return static_cast<double>(std::numeric_limits<c10::Half>::lowest());
    default: fail("T5Encoder: unsupported compute dtype {}", c10::toString(dtype));
  }
}

// HF T5Block: an fp16 residual stream is clamped below fp16's max after each
// sub-layer, further (by 1000) when it already holds an inf.
torch::Tensor clamp_fp16(const torch::Tensor& x) {
  if (x.scalar_type() != at::kHalf) return x;
  const double top = 65504.0 - (torch::isinf(x).any().item<bool>() ? 1000.0 : 0.0);
  return x.clamp(-top, top);
}

}  // namespace

T5EncoderOptions T5EncoderOptions::xxl() {
  return T5EncoderOptions()
      .vocab_size(32128)
      .d_model(4096)
      .num_heads(64)
      .d_kv(64)
      .d_ff(10240)
      .num_layers(24)
      .num_buckets(32)
      .max_distance(128)
      .eps(1e-6);
}

T5EncoderOptions T5EncoderOptions::tiny() {
  return xxl().vocab_size(64).d_model(32).num_heads(4).d_kv(8).d_ff(48).num_layers(2);
}

torch::Tensor t5_relative_position_bucket(const torch::Tensor& relative, int64_t num_buckets, int64_t max_distance) {
  if (!at::isIntegralType(relative.scalar_type(), /*includeBool=*/false))
    fail("t5_relative_position_bucket: relative positions must be integers, got {}",
         c10::toString(relative.scalar_type()));
  const int64_t half = num_buckets / 2;  // buckets per sign
  const int64_t exact = half / 2;        // distances below this get a bucket each
  if (num_buckets < 4 || max_distance <= exact)
    fail("t5_relative_position_bucket: need num_buckets >= 4 and max_distance > num_buckets / 4, got {} and {}",
         num_buckets, max_distance);
  const torch::Tensor r = relative.to(torch::kLong);
  const torch::Tensor offset = r.gt(0).to(torch::kLong) * half;  // keys after the query
  const torch::Tensor n = r.abs();
  // float32 as HF (the released models' buckets); n < exact takes the other branch of where().
  const torch::Tensor ratio = n.clamp_min(exact).to(torch::kFloat32) / static_cast<double>(exact);
  torch::Tensor large =
      exact + (torch::log(ratio) / std::log(static_cast<double>(max_distance) / static_cast<double>(exact)) *
               static_cast<double>(half - exact))
                  .to(torch::kLong);
  large = large.clamp_max(half - 1);
  return offset + torch::where(n.lt(exact), n, large);
}

// ---- block ---------------------------------------------------------------------

T5BlockImpl::T5BlockImpl(const T5EncoderOptions& opt, bool has_relative_bias) : options_(opt) {
  const nn::LayerInit& init = opt.init();
  const int64_t d = opt.d_model(), inner = opt.num_heads() * opt.d_kv();
  attention_norm = nn::register_at(*this, "layer.0.layer_norm", nn::RMSNorm(d, opt.eps(), true, init));
  q = nn::register_at(*this, "layer.0.SelfAttention.q", nn::Linear(d, inner, false, init));
  k = nn::register_at(*this, "layer.0.SelfAttention.k", nn::Linear(d, inner, false, init));
  v = nn::register_at(*this, "layer.0.SelfAttention.v", nn::Linear(d, inner, false, init));
  o = nn::register_at(*this, "layer.0.SelfAttention.o", nn::Linear(inner, d, false, init));
  if (has_relative_bias)
    relative_attention_bias = nn::register_at(*this, "layer.0.SelfAttention.relative_attention_bias",
                                              nn::Embedding(opt.num_buckets(), opt.num_heads(), init));
  ff_norm = nn::register_at(*this, "layer.1.layer_norm", nn::RMSNorm(d, opt.eps(), true, init));
  wi_0 = nn::register_at(*this, "layer.1.DenseReluDense.wi_0", nn::Linear(d, opt.d_ff(), false, init));
  wi_1 = nn::register_at(*this, "layer.1.DenseReluDense.wi_1", nn::Linear(d, opt.d_ff(), false, init));
  wo = nn::register_at(*this, "layer.1.DenseReluDense.wo", nn::Linear(opt.d_ff(), d, false, init));
}

torch::Tensor T5BlockImpl::forward(const torch::Tensor& x, const torch::Tensor& bias) {
  const int64_t B = x.size(0), L = x.size(1), H = options_.num_heads(), D = options_.d_kv();
  const at::ScalarType compute = bias.scalar_type();
  // Self-attention (HF T5LayerSelfAttention / T5Attention), no 1/sqrt(d_kv) scaling.
  torch::Tensor h = attention_norm(x).to(compute);                                            // [B, L, d_model]
  auto heads = [&](const torch::Tensor& t) { return t.view({B, L, H, D}).transpose(1, 2); };  // [B, H, L, d_kv]
  const torch::Tensor qh = heads(q(h)), kh = heads(k(h)), vh = heads(v(h));
  torch::Tensor scores = torch::matmul(qh, kh.transpose(-2, -1)) + bias;  // [B, H, L, L]
  const torch::Tensor probs = torch::softmax(scores, -1, torch::kFloat32).to(vh.scalar_type());
  const torch::Tensor a = torch::matmul(probs, vh).transpose(1, 2).reshape({B, L, H * D});  // [B, L, inner]
  torch::Tensor y = clamp_fp16(x + o(a));
  // Gated-GELU feed-forward (HF T5LayerFF / T5DenseGatedActDense).
  h = ff_norm(y).to(compute);
  torch::Tensor g = torch::gelu(wi_0(h), "tanh") * wi_1(h);  // [B, L, d_ff]
  // HF casts the product to wo's dtype when they differ (wo kept in fp32 for fp16 models).
  const at::ScalarType wo_dtype = wo->weight.scalar_type();
  if (!nn::current_compute_dtype() && !wo->weight_fp8 && at::isFloatingType(wo_dtype) && wo_dtype != g.scalar_type())
    g = g.to(wo_dtype);
  return clamp_fp16(y + wo(g));
}

// ---- encoder -------------------------------------------------------------------

T5EncoderImpl::T5EncoderImpl(const T5EncoderOptions& opt) : options_(opt) {
  check_options(opt);
  const nn::LayerInit& init = opt.init();
  shared = register_module("shared", nn::Embedding(opt.vocab_size(), opt.d_model(), init));
  auto encoder = register_module("encoder", std::make_shared<torch::nn::Module>("T5Stack"));
  blocks = torch::nn::ModuleList();
  for (int64_t i = 0; i < opt.num_layers(); ++i) blocks->push_back(T5Block(opt, /*has_relative_bias=*/i == 0));
  encoder->register_module("block", blocks);
  final_layer_norm = encoder->register_module("final_layer_norm", nn::RMSNorm(opt.d_model(), opt.eps(), true, init));
}

torch::Tensor T5EncoderImpl::attention_bias(int64_t length, const torch::Tensor& attention_mask, at::ScalarType dtype) {
  const T5EncoderOptions& opt = options_;
  T5BlockImpl& first = blocks->at<T5BlockImpl>(0);
  const auto device = first.relative_attention_bias->weight.device();
  const torch::Tensor positions = torch::arange(length, torch::TensorOptions().dtype(torch::kLong).device(device));
  const torch::Tensor relative = positions.view({1, length}) - positions.view({length, 1});  // [query, key]: k - q
  const torch::Tensor buckets = t5_relative_position_bucket(relative, opt.num_buckets(), opt.max_distance());
  torch::Tensor bias = first.relative_attention_bias(buckets).to(dtype);  // [L, L, H]
  bias = bias.permute({2, 0, 1}).unsqueeze(0);                            // [1, H, L, L]
  if (attention_mask.defined()) {
    const torch::Tensor m = attention_mask.to(bias.device(), dtype);
    bias = bias + ((1 - m) * lowest(dtype)).view({m.size(0), 1, 1, length});  // [B, H, L, L]
  }
  return bias;
}

torch::Tensor T5EncoderImpl::forward(const torch::Tensor& ids, const torch::Tensor& attention_mask) {
  const T5EncoderOptions& opt = options_;
  if (ids.dim() != 2 || ids.size(1) < 1)
    fail("T5Encoder: ids must be [batch, length] with length >= 1, got {}", format_shape(ids.sizes()));
  if (ids.scalar_type() != torch::kLong) fail("T5Encoder: ids must be int64, got {}", c10::toString(ids.scalar_type()));
  if (ids.numel() > 0) {
    const int64_t lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
    if (lo < 0 || hi >= opt.vocab_size())
      fail("T5Encoder: token ids must be in [0, {}), saw {}..{}", opt.vocab_size(), lo, hi);
  }
  if (attention_mask.defined()) {
    if (attention_mask.sizes() != ids.sizes())
      fail("T5Encoder: attention_mask must have the shape of ids {}, got {}", format_shape(ids.sizes()),
           format_shape(attention_mask.sizes()));
    const torch::Tensor m = attention_mask.to(ids.device());
    if (!m.eq(0).logical_or(m.eq(1)).all().item<bool>())
      fail("T5Encoder: attention_mask values must be 0 (padding) or 1 (token)");
  }
  torch::Tensor x = shared(ids);  // [B, L, d_model] in the compute dtype
  const at::ScalarType compute = x.scalar_type();
  if (compute == at::kHalf && x.device().is_cpu())
    fail(
        "T5Encoder: fp16 on the CPU is not supported (libtorch has no CPU fp16 matmul / GELU / softmax kernels); "
        "run the encoder in fp32 or bf16 on the CPU");
  const torch::Tensor bias = attention_bias(ids.size(1), attention_mask, compute);  // [1 or B, H, L, L]
  for (size_t i = 0; i < blocks->size(); ++i) x = blocks->at<T5BlockImpl>(i).forward(x, bias);
  return final_layer_norm(x).to(compute);
}

void cast_t5_encoder(T5EncoderImpl& model, at::ScalarType dtype, bool keep_wo_fp32) {
  if (!at::isFloatingType(dtype)) fail("cast_t5_encoder: {} is not a floating-point dtype", c10::toString(dtype));
  torch::NoGradGuard no_grad;
  const std::string wo = "DenseReluDense.wo.weight";
  for (auto& p : model.named_parameters()) {
    const std::string& key = p.key();
    const bool is_wo = key.size() >= wo.size() && key.compare(key.size() - wo.size(), wo.size(), wo) == 0;
    p.value().set_data(p.value().to(is_wo && keep_wo_fp32 ? at::kFloat : dtype));
  }
}

// ---- loading -------------------------------------------------------------------

LoadWeightsReport load_t5_encoder_weights(T5EncoderImpl& model, const WeightFiles& files, const std::string& prefix) {
  auto starts_with = [](const std::string& s, const std::string& p) { return s.compare(0, p.size(), p) == 0; };
  const bool has_shared = files.find(prefix + "shared.weight") != nullptr;
  // File key -> module name ("" = not read).
  auto key_map = [&](const std::string& key) -> std::string {
    if (!starts_with(key, prefix)) return "";
    const std::string rest = key.substr(prefix.size());
    if (starts_with(rest, "decoder.") || starts_with(rest, "lm_head.")) return "";        // T5ForConditionalGeneration
    if (rest == "encoder.embed_tokens.weight") return has_shared ? "" : "shared.weight";  // the tied copy
    return rest;
  };
  std::map<std::string, std::vector<int64_t>> expected, found;
  for (const auto& p : model.named_parameters()) expected[prefix + p.key()] = p.value().sizes().vec();
  bool any = false;
  for (const std::string& key : files.names()) {
    any = any || starts_with(key, prefix);
    const std::string name = key_map(key);
    if (!name.empty()) found[prefix + name] = files.find(key)->shape;
  }
  if (!any) fail("{}: no tensor starts with '{}' (expected the T5 encoder there)", files.path(), prefix);
  const KeyDiff diff = diff_keys(expected, found);
  if (!diff.empty()) {
    const T5EncoderOptions& o = model.options();
    fail(
        "{}: the T5 encoder under '{}' does not match the model (vocab {}, d_model {}, {} heads x {}, d_ff {}, {} "
        "layers): {}{}",
        files.path(), prefix, o.vocab_size(), o.d_model(), o.num_heads(), o.d_kv(), o.d_ff(), o.num_layers(),
        diff.describe(),
        found.count(prefix + "shared.weight") ? ""
                                              : fmt::format(" ('{}shared.weight' may also be stored as "
                                                            "'{}encoder.embed_tokens.weight'; the file has neither)",
                                                            prefix, prefix));
  }
  LoadWeightsOptions opts;
  opts.key_map = key_map;
  return load_weights(model, files, opts);
}

LoadWeightsReport load_t5_encoder_weights(T5EncoderImpl& model, const WeightFiles& files) {
  const std::string sd3 = kSd3T5xxlPrefix;
  for (const std::string& key : files.names()) {
    if (key.compare(0, sd3.size(), sd3) == 0) return load_t5_encoder_weights(model, files, sd3);
  }
  return load_t5_encoder_weights(model, files, "");
}

}  // namespace shoestring::models
