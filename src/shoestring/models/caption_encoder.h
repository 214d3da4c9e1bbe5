// A small transformer text encoder for captions (the emoji example): token +
// learned position embeddings, pre-norm transformer encoder layers (as GPT-2 /
// CLIP's text tower, Radford et al. 2021, without the causal mask: padding is
// masked instead), and a final LayerNorm. Its hidden states are the UNet's
// cross-attention context.
//
// Parameter paths: token_embedding.weight, position_embedding,
//   layers.<i>.{norm1, attn.to_q|to_k|to_v|to_out, norm2, mlp.proj, mlp.out}.*, final_norm.*
#pragma once
#include <cstdint>

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/pimpl.h>

#include "shoestring/nn/attention.h"
#include "shoestring/nn/block_precision.h"
#include "shoestring/nn/layers.h"
#include "shoestring/nn/transformer.h"

namespace shoestring::models {

/// Hyper-parameters of CaptionEncoder.
struct CaptionEncoderOptions {
  explicit CaptionEncoderOptions(int64_t vocab_size) : vocab_size_(vocab_size) {}
  /// Number of token ids (0 = padding, 2 = <bos> by the tokenizer's convention).
  TORCH_ARG(int64_t, vocab_size);
  /// Longest token sequence (positions).
  TORCH_ARG(int64_t, max_length) = 16;
  TORCH_ARG(int64_t, dim) = 256;
  TORCH_ARG(int64_t, layers) = 2;
  TORCH_ARG(int64_t, heads) = 4;
  /// MLP hidden width = mlp_ratio * dim (GELU MLP).
  TORCH_ARG(int64_t, mlp_ratio) = 4;
  TORCH_ARG(double, dropout) = 0.0;
  /// Device/dtype of the parameters; nn::LayerInit{torch::kMeta} allocates nothing.
  TORCH_ARG(nn::LayerInit, init) = nn::LayerInit{};
};

/// Output of CaptionEncoder::forward.
struct CaptionEncoding {
  /// [B, L, dim] in the model's dtype.
  at::Tensor hidden;
  /// [B, L] bool, true = real token (tokens != 0).
  at::Tensor mask;
};

/// One pre-norm encoder layer: x += dropout(attn(norm1(x), mask)); x += mlp(norm2(x)).
class CaptionEncoderLayerImpl : public torch::nn::Module {
 public:
  explicit CaptionEncoderLayerImpl(const CaptionEncoderOptions& o);
  /// x: [B, L, dim]; mask: [B, L] bool (true = real token). Returns [B, L, dim].
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& mask);

  nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  nn::Attention attn{nullptr};
  nn::FeedForward mlp{nullptr};
  torch::nn::Dropout dropout{nullptr};
};
TORCH_MODULE(CaptionEncoderLayer);

/// Caption encoder. Runs in fp32 or, after `->to(torch::kBFloat16)`, bf16.
class CaptionEncoderImpl : public torch::nn::Module {
 public:
  /// Throws shoestring::Error on non-positive sizes or dim not divisible by heads.
  explicit CaptionEncoderImpl(const CaptionEncoderOptions& options);

  /// tokens: int64 [B, L], 1 <= L <= max_length, ids in [0, vocab_size); 0 is
  /// padding (masked out as a key). Rows should hold at least one non-pad
  /// token (<bos>); a fully padded row gives finite but meaningless output.
  /// Throws shoestring::Error on bad shape, dtype or id range.
  CaptionEncoding forward(const torch::Tensor& tokens);

  const CaptionEncoderOptions& options() const { return options_; }

  /// The blocks of this encoder (every layers.<i>), for per-block compute
  /// dtype and checkpointing (precision::apply).
  nn::BlockTable* block_table() const { return block_table_.get(); }

  nn::Embedding token_embedding{nullptr};
  torch::Tensor position_embedding;  // [max_length, dim]
  torch::nn::ModuleList layers{nullptr};
  nn::LayerNorm final_norm{nullptr};

 private:
  CaptionEncoderOptions options_;
  std::shared_ptr<nn::BlockTable> block_table_ = std::make_shared<nn::BlockTable>();
};
TORCH_MODULE(CaptionEncoder);

}  // namespace shoestring::models
