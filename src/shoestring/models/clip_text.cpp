#include "shoestring/models/clip_text.h"

#include <cmath>
#include <limits>
#include <map>
#include <set>

#include <fmt/format.h>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/units.h"
#include "shoestring/nn/key_layout.h"

namespace shoestring::models {
namespace {

bool is_hf(const ClipTextOptions& o) { return o.layout() == ClipTextLayout::kHuggingFace; }

// A new parameter-sized tensor: empty on meta or when values come from a file next.
torch::Tensor new_tensor(const nn::LayerInit& init, at::IntArrayRef shape) { return torch::empty(shape, init.options); }

void check_options(const ClipTextOptions& o) {
  if (o.vocab_size() <= 0 || o.max_positions() <= 0 || o.width() <= 0 || o.layers() <= 0 || o.heads() <= 0 ||
      o.mlp_width() <= 0 || o.projection_dim() < 0)
    fail(
        "ClipTextOptions: sizes must be positive (vocab {}, positions {}, width {}, layers {}, heads {}, mlp {}, "
        "projection {})",
        o.vocab_size(), o.max_positions(), o.width(), o.layers(), o.heads(), o.mlp_width(), o.projection_dim());
  if (o.width() % o.heads() != 0) fail("ClipTextOptions: heads {} do not divide width {}", o.heads(), o.width());
  if (is_hf(o) && o.logit_scale())
    fail("ClipTextOptions: logit_scale exists only in the OpenCLIP layout (HF CLIPTextModelWithProjection has none)");
}

}  // namespace

ClipTextOptions ClipTextOptions::clip_l() {
  return ClipTextOptions()
      .layout(ClipTextLayout::kHuggingFace)
      .vocab_size(49408)
      .max_positions(77)
      .width(768)
      .layers(12)
      .heads(12)
      .mlp_width(3072)
      .activation(ClipActivation::kQuickGelu);
}

ClipTextOptions ClipTextOptions::clip_g() {
  return ClipTextOptions()
      .layout(ClipTextLayout::kOpenClip)
      .vocab_size(49408)
      .max_positions(77)
      .width(1280)
      .layers(32)
      .heads(20)
      .mlp_width(5120)
      .activation(ClipActivation::kGelu)
      .projection_dim(1280)
      .logit_scale(true);
}

ClipTextOptions ClipTextOptions::clip_g_hf() {
  return clip_g().layout(ClipTextLayout::kHuggingFace).logit_scale(false);
}

ClipTextOptions ClipTextOptions::tiny(int64_t w) const {
  ClipTextOptions o = *this;
  o.width(w).layers(2).heads(4).mlp_width(4 * w);
  if (projection_dim() > 0) o.projection_dim(w);
  return o;
}

// ---- layer --------------------------------------------------------------------

ClipTextLayerImpl::ClipTextLayerImpl(const ClipTextOptions& o) : options_(o) {
  const int64_t w = o.width();
  const nn::LayerInit& init = o.init();
  const double eps = o.layer_norm_eps();
  if (is_hf(o)) {
    norm1 = register_module("layer_norm1", nn::LayerNorm(w, eps, true, true, init));
    q_proj = nn::register_at(*this, "self_attn.q_proj", nn::Linear(w, w, true, init));
    k_proj = nn::register_at(*this, "self_attn.k_proj", nn::Linear(w, w, true, init));
    v_proj = nn::register_at(*this, "self_attn.v_proj", nn::Linear(w, w, true, init));
    out_proj = nn::register_at(*this, "self_attn.out_proj", nn::Linear(w, w, true, init));
    norm2 = register_module("layer_norm2", nn::LayerNorm(w, eps, true, true, init));
    fc1 = nn::register_at(*this, "mlp.fc1", nn::Linear(w, o.mlp_width(), true, init));
    fc2 = nn::register_at(*this, "mlp.fc2", nn::Linear(o.mlp_width(), w, true, init));
  } else {
    norm1 = register_module("ln_1", nn::LayerNorm(w, eps, true, true, init));
    // torch.nn.MultiheadAttention's names: packed in_proj_weight/in_proj_bias + out_proj.
    auto attn = register_module("attn", std::make_shared<torch::nn::Module>("MultiheadAttention"));
    in_proj_weight = attn->register_parameter("in_proj_weight", new_tensor(init, {3 * w, w}));
    in_proj_bias = attn->register_parameter("in_proj_bias", new_tensor(init, {3 * w}));
    out_proj = attn->register_module("out_proj", nn::Linear(w, w, true, init));
    if (init.fills_values()) {
      torch::NoGradGuard no_grad;
      torch::nn::init::xavier_uniform_(in_proj_weight);  // torch.nn.MultiheadAttention's init
      in_proj_bias.zero_();
      out_proj->bias.zero_();
    }
    norm2 = register_module("ln_2", nn::LayerNorm(w, eps, true, true, init));
    fc1 = nn::register_at(*this, "mlp.c_fc", nn::Linear(w, o.mlp_width(), true, init));
    fc2 = nn::register_at(*this, "mlp.c_proj", nn::Linear(o.mlp_width(), w, true, init));
  }
}

torch::Tensor ClipTextLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& padding) {
  const int64_t B = x.size(0), L = x.size(1), W = options_.width(), H = options_.heads(), D = W / H;
  torch::Tensor h = norm1(x);
  torch::Tensor q, k, v;
  if (q_proj) {
    q = q_proj(h);
    k = k_proj(h);
    v = v_proj(h);
  } else {
    auto qkv = torch::linear(h, in_proj_weight.to(h.scalar_type()), in_proj_bias.to(h.scalar_type())).chunk(3, -1);
    q = qkv[0];
    k = qkv[1];
    v = qkv[2];
  }
  auto heads = [&](const torch::Tensor& t) { return t.reshape({B, L, H, D}).transpose(1, 2); };  // [B, H, L, D]
  q = heads(q);
  k = heads(k);
  v = heads(v);
  torch::Tensor scores = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(D)));
  // Causal mask: query i attends to keys 0..i (HF _build_causal_attention_mask, OpenCLIP build_attention_mask).
  torch::Tensor masked = torch::ones({L, L}, torch::TensorOptions().dtype(torch::kBool).device(x.device())).triu(1);
  // Padding keys: HF's expanded attention_mask, torch's key_padding_mask ([B, 1, 1, L] over the heads and queries).
  if (padding.defined()) masked = masked.logical_or(padding.view({B, 1, 1, L}));
  scores = scores.masked_fill(masked, -std::numeric_limits<float>::infinity());
  torch::Tensor probs = torch::softmax(scores, -1, torch::kFloat32).to(v.scalar_type());
  torch::Tensor a = torch::matmul(probs, v).transpose(1, 2).reshape({B, L, W});
  torch::Tensor y = x + out_proj(a);
  h = fc1(norm2(y));
  if (options_.activation() == ClipActivation::kQuickGelu) {
    h = h * torch::sigmoid(1.702 * h);
  } else {
    h = torch::gelu(h);  // exact (erf) GELU, torch.nn.GELU()'s default
  }
  return y + fc2(h);
}

// ---- model --------------------------------------------------------------------

ClipTextModelImpl::ClipTextModelImpl(const ClipTextOptions& o) : options_(o) {
  check_options(o);
  const nn::LayerInit& init = o.init();
  const int64_t w = o.width();
  torch::NoGradGuard no_grad;
  token_embedding = nn::Embedding(o.vocab_size(), w, init);
  layers = torch::nn::ModuleList();
  for (int64_t i = 0; i < o.layers(); ++i) layers->push_back(ClipTextLayer(o));
  final_layer_norm = nn::LayerNorm(w, o.layer_norm_eps(), true, true, init);
  if (init.fills_values()) token_embedding->weight.normal_(0.0, 0.02);  // HF and OpenCLIP init

  if (is_hf(o)) {
    auto embeddings = std::make_shared<torch::nn::Module>("CLIPTextEmbeddings");
    nn::register_at(*this, "text_model.embeddings", embeddings);
    embeddings->register_module("token_embedding", token_embedding);
    auto position = embeddings->register_module("position_embedding", nn::Embedding(o.max_positions(), w, init));
    position_table = position->weight;
    if (init.fills_values()) position_table.normal_(0.0, 0.02);
    torch::Tensor ids = torch::empty({1, o.max_positions()}, init.options.dtype(torch::kLong));
    if (!init.is_meta()) ids.copy_(torch::arange(o.max_positions(), torch::kLong).unsqueeze(0));
    embeddings->register_buffer("position_ids", ids);
    nn::register_at(*this, "text_model.encoder.layers", layers);
    nn::register_at(*this, "text_model.final_layer_norm", final_layer_norm);
    if (o.projection_dim() > 0) {
      // CLIPTextModelWithProjection.text_projection = nn.Linear(width, P, bias=False): weight [P, W].
      // Kept as the file stores it and used transposed (projection_matrix()), so both layouts share one
      // forward; a parameter rather than an nn::Linear, since it is applied as a matrix there.
      auto linear = register_module("text_projection", std::make_shared<torch::nn::Module>("Linear"));
      text_projection = linear->register_parameter("weight", new_tensor(init, {o.projection_dim(), w}));
      if (init.fills_values()) text_projection.normal_(0.0, 1.0 / std::sqrt(static_cast<double>(w)));
    }
  } else {
    register_module("token_embedding", token_embedding);
    position_table = register_parameter("positional_embedding", new_tensor(init, {o.max_positions(), w}));
    if (init.fills_values()) position_table.normal_(0.0, 0.01);  // OpenCLIP init_parameters
    register_module("transformer", std::make_shared<torch::nn::Module>("Transformer"))
        ->register_module("resblocks", layers);
    register_module("ln_final", final_layer_norm);
    if (o.projection_dim() > 0) {
      text_projection = register_parameter("text_projection", new_tensor(init, {w, o.projection_dim()}));
      if (init.fills_values()) text_projection.normal_(0.0, 1.0 / std::sqrt(static_cast<double>(w)));
    }
    if (o.logit_scale()) {
      torch::Tensor s = torch::empty({}, init.options.dtype(torch::kFloat32));
      if (!init.is_meta()) s.fill_(std::log(1.0 / 0.07));  // CLIP's initial temperature
      register_buffer("logit_scale", s);
    }
  }
}

torch::Tensor ClipTextModelImpl::final_norm(const torch::Tensor& x) { return final_layer_norm(x); }

torch::Tensor ClipTextModelImpl::projection_matrix() const {
  if (!text_projection.defined()) return {};
  // A view taken per call: a view kept as a member would keep pointing at the old storage after
  // Module::to() (which swaps the parameter's data in place).
  return is_hf(options_) ? text_projection.t() : text_projection;
}

ClipTextOutput ClipTextModelImpl::forward(const torch::Tensor& ids, int64_t skip, const torch::Tensor& attention_mask) {
  const ClipTextOptions& o = options_;
  if (ids.dim() != 2 || ids.size(1) < 1 || ids.size(1) > o.max_positions())
    fail("ClipTextModel: ids must be [batch, length] with 1 <= length <= {}, got {}", o.max_positions(),
         format_shape(ids.sizes()));
  if (ids.scalar_type() != torch::kLong)
    fail("ClipTextModel: ids must be int64, got {}", c10::toString(ids.scalar_type()));
  if (skip < 1 || skip > o.layers())
    fail("ClipTextModel: skip must be in [1, {}] (hidden_states[-skip]), got {}", o.layers(), skip);
  const int64_t L = ids.size(1);
  torch::Tensor padding;
  if (attention_mask.defined()) {
    if (attention_mask.sizes() != ids.sizes())
      fail("ClipTextModel: attention_mask must have the shape of ids {}, got {}", format_shape(ids.sizes()),
           format_shape(attention_mask.sizes()));
    const torch::Tensor m = attention_mask.to(ids.device());
    if (!m.eq(0).logical_or(m.eq(1)).all().item<bool>())
      fail("ClipTextModel: attention_mask values must be 0 (padding) or 1 (token)");
    if (!m.select(1, 0).eq(1).all().item<bool>())
      fail("ClipTextModel: attention_mask masks the first position of a row (BOS): nothing would be left to attend");
    padding = m.eq(0);
  }
  torch::Tensor x = token_embedding(ids);
  x = x + position_table.slice(0, 0, L).to(x.scalar_type());
  ClipTextOutput out;
  const int64_t n = static_cast<int64_t>(layers->size());
  for (int64_t i = 0; i < n; ++i) {
    x = layers->at<ClipTextLayerImpl>(i).forward(x, padding);
    if (i + 1 == n + 1 - skip) out.hidden = x;  // HF hidden_states[n + 1 - skip]
  }
  out.last_hidden = final_layer_norm(x);
  out.hidden_normed = skip == 1 ? out.last_hidden : final_layer_norm(out.hidden);
  const torch::Tensor eos = ids.argmax(-1);  // first position of the largest id (EOS)
  out.pooled_unprojected = out.last_hidden.index({torch::arange(ids.size(0), eos.options()), eos});
  out.pooled = out.pooled_unprojected;
  if (text_projection.defined())
    out.pooled = torch::matmul(out.pooled, projection_matrix().to(out.pooled.scalar_type()));
  return out;
}

torch::Tensor clip_attention_mask(const torch::Tensor& ids, int64_t eos_id) {
  if (ids.dim() != 2 || ids.scalar_type() != torch::kLong)
    fail("clip_attention_mask: ids must be int64 [batch, length], got {} {}", c10::toString(ids.scalar_type()),
         format_shape(ids.sizes()));
  const torch::Tensor is_eos = ids.eq(eos_id);
  // Position of each row's first EOS (argmax of a 0/1 row gives the first 1), length - 1 without one.
  torch::Tensor first = is_eos.to(torch::kInt).argmax(1, /*keepdim=*/true);
  first = torch::where(is_eos.any(1, /*keepdim=*/true), first, torch::full_like(first, ids.size(1) - 1));
  return torch::arange(ids.size(1), ids.options()).unsqueeze(0).le(first).to(torch::kLong);
}

// ---- layout detection ---------------------------------------------------------

namespace {

using KeyShapes = std::map<std::string, std::vector<int64_t>>;

// The tensors under `prefix`, named below it.
KeyShapes keys_under(const WeightFiles& files, const std::string& prefix) {
  KeyShapes found;
  for (const std::string& key : files.names()) {
    if (key.compare(0, prefix.size(), prefix) == 0) found[key.substr(prefix.size())] = files.find(key)->shape;
  }
  return found;
}

const char* layout_name(ClipTextLayout layout) {
  return layout == ClipTextLayout::kHuggingFace ? "Hugging Face" : "OpenCLIP";
}

std::string describe_layout(ClipTextLayout layout, int64_t projection_dim) {
  return projection_dim > 0 ? fmt::format("{} layout with a {}-wide projection", layout_name(layout), projection_dim)
                            : fmt::format("{} layout without a projection", layout_name(layout));
}

// The number of blocks `<head><i>.` (0..n-1) among the keys; fails on a gap.
int64_t count_blocks(const KeyShapes& keys, const std::string& head, const std::string& file,
                     const std::string& prefix) {
  std::set<int64_t> seen;
  for (const auto& [key, shape] : keys) {
    if (key.compare(0, head.size(), head) != 0) continue;
    const size_t dot = key.find('.', head.size());
    const std::string index = key.substr(head.size(), dot == std::string::npos ? std::string::npos : dot - head.size());
    if (index.empty() || index.find_first_not_of("0123456789") != std::string::npos || index.size() > 9)
      fail("{}: key '{}{}' is not '{}<layer>...'", file, prefix, key, head);
    seen.insert(std::stoll(index));
  }
  const int64_t n = seen.empty() ? 0 : *seen.rbegin() + 1;
  if (static_cast<int64_t>(seen.size()) != n)
    fail("{}: the layers '{}{}<i>.' under '{}' are not numbered 0..{} without gaps", file, prefix, head, prefix, n - 1);
  return n;
}

}  // namespace

ClipTextOptions ClipTextFileLayout::options(ClipTextOptions base) const {
  return base.layout(layout).projection_dim(projection_dim).logit_scale(logit_scale);
}

ClipTextFileLayout detect_clip_text_layout(const WeightFiles& files, const std::string& prefix) {
  const KeyShapes keys = keys_under(files, prefix);
  const std::string& file = files.path();
  if (keys.empty()) fail("{}: no tensor starts with '{}' (expected a CLIP text encoder there)", file, prefix);
  // The shape of `key`, which must be there with `dims` dimensions.
  auto shape_of = [&](const std::string& key, size_t dims) -> const std::vector<int64_t>& {
    auto it = keys.find(key);
    if (it == keys.end()) fail("{}: the CLIP text encoder under '{}' lacks '{}{}'", file, prefix, prefix, key);
    if (it->second.size() != dims)
      fail("{}: '{}{}' has shape {}, expected {} dimensions", file, prefix, key, format_shape(it->second), dims);
    return it->second;
  };
  const bool hf = keys.count("text_model.embeddings.token_embedding.weight") > 0;
  const bool openclip =
      keys.count("token_embedding.weight") > 0 && keys.count("transformer.resblocks.0.attn.in_proj_weight") > 0;
  if (hf && openclip)
    fail("{}: under '{}' there are both Hugging Face (text_model.*) and OpenCLIP (token_embedding, "
         "transformer.resblocks.*) CLIP keys",
         file, prefix);
  if (!hf && !openclip)
    fail("{}: no CLIP text encoder under '{}': neither '{}text_model.embeddings.token_embedding.weight' (Hugging "
         "Face) nor '{}token_embedding.weight' with '{}transformer.resblocks.0.attn.in_proj_weight' (OpenCLIP)",
         file, prefix, prefix, prefix, prefix);
  ClipTextFileLayout out;
  out.layout = hf ? ClipTextLayout::kHuggingFace : ClipTextLayout::kOpenClip;
  // (key of the projection this layout uses, key of the other layout's projection)
  const std::string projection_key = hf ? "text_projection.weight" : "text_projection";
  const std::string foreign_projection = hf ? "text_projection" : "text_projection.weight";
  if (keys.count(foreign_projection))
    fail("{}: '{}{}' is the {} projection, but the encoder under '{}' has the {} layout (expected '{}{}')", file,
         prefix, foreign_projection, hf ? "OpenCLIP" : "Hugging Face", prefix, layout_name(out.layout), prefix,
         projection_key);
  if (hf) {
    const auto& token = shape_of("text_model.embeddings.token_embedding.weight", 2);
    out.vocab_size = token[0];
    out.width = token[1];
    out.max_positions = shape_of("text_model.embeddings.position_embedding.weight", 2)[0];
    out.layers = count_blocks(keys, "text_model.encoder.layers.", file, prefix);
    if (out.layers == 0) fail("{}: the CLIP text encoder under '{}' has no text_model.encoder.layers", file, prefix);
    out.mlp_width = shape_of("text_model.encoder.layers.0.mlp.fc1.weight", 2)[0];
  } else {
    const auto& token = shape_of("token_embedding.weight", 2);
    out.vocab_size = token[0];
    out.width = token[1];
    out.max_positions = shape_of("positional_embedding", 2)[0];
    out.layers = count_blocks(keys, "transformer.resblocks.", file, prefix);
    out.mlp_width = shape_of("transformer.resblocks.0.mlp.c_fc.weight", 2)[0];
    out.logit_scale = keys.count("logit_scale") > 0;
  }
  if (keys.count(projection_key)) {
    const auto& p = shape_of(projection_key, 2);
    // HF nn.Linear weight [P, W]; OpenCLIP matrix [W, P].
    const int64_t in = hf ? p[1] : p[0], projected = hf ? p[0] : p[1];
    if (in != out.width || projected <= 0)
      fail("{}: '{}{}' has shape {}, expected {} for width {}", file, prefix, projection_key, format_shape(p),
           hf ? "[P, width]" : "[width, P]", out.width);
    out.projection_dim = projected;
  }
  return out;
}

// ---- loading ------------------------------------------------------------------

bool is_optional_clip_text_key(const std::string& key) {
  return key == "text_model.embeddings.position_ids" || key == "logit_scale";
}

LoadWeightsReport load_clip_text_weights(ClipTextModelImpl& model, const WeightFiles& files,
                                         const std::string& prefix) {
  KeyShapes expected;
  for (const auto& p : model.named_parameters()) expected[p.key()] = p.value().sizes().vec();
  for (const auto& b : model.named_buffers()) expected[b.key()] = b.value().sizes().vec();
  const KeyShapes found = keys_under(files, prefix);
  KeyDiff diff = diff_keys(expected, found);
  std::vector<std::string> missing;
  for (const auto& k : diff.missing) {
    if (!is_optional_clip_text_key(k)) missing.push_back(k);
  }
  diff.missing = missing;
  if (found.empty())
    fail("{}: no tensor starts with '{}' (expected the CLIP text encoder there)", files.path(), prefix);
  if (!diff.empty()) {
    // Name a layout or projection difference outright: it is the likely cause of a long key list.
    std::string hint;
    try {
      const ClipTextFileLayout in_file = detect_clip_text_layout(files, prefix);
      const ClipTextOptions& o = model.options();
      if (in_file.layout != o.layout() || in_file.projection_dim != o.projection_dim())
        hint = fmt::format(" (the file holds the {}, the model has the {}; build the model from "
                           "detect_clip_text_layout()'s options)",
                           describe_layout(in_file.layout, in_file.projection_dim),
                           describe_layout(o.layout(), o.projection_dim()));
    } catch (const Error&) {
      // Not a recognisable encoder: the key list says enough.
    }
    fail("{}: the CLIP text encoder under '{}' does not match the model: {}{}", files.path(), prefix, diff.describe(),
         hint);
  }
  LoadWeightsOptions opts;
  opts.allow_partial = true;  // only optional buffers can still be absent
  opts.key_map = [&prefix](const std::string& key) {
    return key.compare(0, prefix.size(), prefix) == 0 ? key.substr(prefix.size()) : std::string();
  };
  return load_weights(model, files, opts);
}

}  // namespace shoestring::models
