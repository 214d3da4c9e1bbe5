// Multi-head scaled dot-product attention (Vaswani et al. 2017) with optional
// grouped-query attention (Ainslie et al. 2023, "GQA", arXiv 2305.13245) and
// a key padding mask. Parameter names follow the Stable Diffusion / LDM
// CrossAttention module: to_q, to_k, to_v (no bias), to_out (with bias; LDM
// files call it to_out.0, see AttentionOptions::layout).
#pragma once
#include <cstdint>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "shoestring/nn/key_layout.h"
#include "shoestring/nn/layers.h"

namespace shoestring::nn {

/// Options for Attention.
struct AttentionOptions {
  AttentionOptions(int64_t query_dim, int64_t heads, int64_t head_dim)
      : query_dim_(query_dim), heads_(heads), head_dim_(head_dim) {}
  /// Channels of the query input and of the output.
  TORCH_ARG(int64_t, query_dim);
  /// Channels of the key/value input; 0 means self-attention (= query_dim).
  TORCH_ARG(int64_t, context_dim) = 0;
  /// Number of query heads.
  TORCH_ARG(int64_t, heads);
  /// Channels per head.
  TORCH_ARG(int64_t, head_dim);
  /// Number of key/value heads; 0 means `heads` (plain multi-head attention).
  /// Must divide `heads`; query head h uses key/value head h / (heads / num_kv_heads).
  TORCH_ARG(int64_t, num_kv_heads) = 0;
  /// Key name of the output projection: kShoestring "to_out", kLdm "to_out.0"
  /// (LDM's to_out is nn.Sequential(Linear, Dropout)).
  TORCH_ARG(KeyLayout, layout) = KeyLayout::kShoestring;
  /// Device/dtype of the parameters; LayerInit{torch::kMeta} allocates nothing.
  TORCH_ARG(LayerInit, init) = LayerInit{};
};

/// Multi-head attention: out = to_out(concat_h softmax(Q_h K_g(h)^T / sqrt(d)) V_g(h)).
///
/// Computes in the dtype of its input and weights (fp32, or bf16 on CPU).
/// Throws shoestring::Error on bad options (non-positive sizes, num_kv_heads
/// not dividing heads).
class AttentionImpl : public torch::nn::Module {
 public:
  explicit AttentionImpl(const AttentionOptions& options);

  /// x: [B, Lq, query_dim]. context: [B, Lk, context_dim], or undefined for
  /// self-attention (then keys/values come from x). key_mask: [B, Lk] bool,
  /// true = the key takes part, or undefined (all keys). A query whose keys are
  /// all masked attends uniformly to all of them (masked scores are set to the
  /// dtype's lowest finite value, not -inf, so no NaN appears).
  /// Returns [B, Lq, query_dim]. Throws shoestring::Error on shape mismatch.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& context = {}, const torch::Tensor& key_mask = {});

  const AttentionOptions& options() const { return options_; }

  Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr}, to_out{nullptr};

 private:
  AttentionOptions options_;
};
TORCH_MODULE(Attention);

}  // namespace shoestring::nn
