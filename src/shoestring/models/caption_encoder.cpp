#include "shoestring/models/caption_encoder.h"

#include <torch/torch.h>

#include "shoestring/core/error.h"

namespace shoestring::models {

CaptionEncoderLayerImpl::CaptionEncoderLayerImpl(const CaptionEncoderOptions& o) {
  const int64_t dim = o.dim();
  norm1 = register_module("norm1", nn::LayerNorm(dim, 1e-5, true, true, o.init()));
  attn = register_module("attn", nn::Attention(nn::AttentionOptions(dim, o.heads(), dim / o.heads()).init(o.init())));
  norm2 = register_module("norm2", nn::LayerNorm(dim, 1e-5, true, true, o.init()));
  mlp = register_module("mlp", nn::FeedForward(dim, o.mlp_ratio() * dim, /*gated=*/false, o.dropout(),
                                               nn::KeyLayout::kShoestring, o.init()));
  dropout = register_module("dropout", torch::nn::Dropout(o.dropout()));
}

torch::Tensor CaptionEncoderLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& mask) {
  torch::Tensor h = x + dropout->forward(attn->forward(norm1->forward(x), {}, mask));
  return h + mlp->forward(norm2->forward(h));
}

CaptionEncoderImpl::CaptionEncoderImpl(const CaptionEncoderOptions& options) : options_(options) {
  const auto& o = options_;
  if (o.vocab_size() <= 0 || o.max_length() <= 0 || o.dim() <= 0 || o.layers() < 0 || o.heads() <= 0 ||
      o.mlp_ratio() <= 0) {
    fail("CaptionEncoder: bad sizes (vocab_size {}, max_length {}, dim {}, layers {}, heads {}, mlp_ratio {})",
         o.vocab_size(), o.max_length(), o.dim(), o.layers(), o.heads(), o.mlp_ratio());
  }
  if (o.dim() % o.heads() != 0) fail("CaptionEncoder: dim {} not divisible by heads {}", o.dim(), o.heads());
  token_embedding = register_module("token_embedding", nn::Embedding(o.vocab_size(), o.dim(), o.init()));
  position_embedding =
      register_parameter("position_embedding", torch::empty({o.max_length(), o.dim()}, o.init().options));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < o.layers(); ++i) {
    layers->push_back(CaptionEncoderLayer(o));
    block_table_->declare(layers[i].get());
  }
  final_norm = register_module("final_norm", nn::LayerNorm(o.dim(), 1e-5, true, true, o.init()));
  if (o.init().is_meta()) return;
  // Initialisation as CLIP's text tower: token std 0.02, position std 0.01.
  torch::NoGradGuard no_grad;
  token_embedding->weight.normal_(0.0, 0.02);
  position_embedding.normal_(0.0, 0.01);
}

CaptionEncoding CaptionEncoderImpl::forward(const torch::Tensor& tokens) {
  const auto& o = options_;
  if (!tokens.defined() || tokens.dim() != 2 || tokens.scalar_type() != torch::kInt64) {
    fail("CaptionEncoder: tokens must be an int64 tensor [B, L]");
  }
  const int64_t L = tokens.size(1);
  if (L < 1 || L > o.max_length()) fail("CaptionEncoder: token length {} not in [1, {}]", L, o.max_length());
  if (tokens.numel() > 0) {
    const int64_t lo = tokens.min().item<int64_t>(), hi = tokens.max().item<int64_t>();
    if (lo < 0 || hi >= o.vocab_size()) {
      fail("CaptionEncoder: token ids must lie in [0, {}), got range [{}, {}]", o.vocab_size(), lo, hi);
    }
  }
  CaptionEncoding out;
  out.mask = tokens.ne(0);
  torch::Tensor h =
      token_embedding->forward(tokens) + nn::to_compute_dtype(position_embedding.slice(0, 0, L).unsqueeze(0));
  for (size_t i = 0; i < layers->size(); ++i) {
    std::shared_ptr<CaptionEncoderLayerImpl> layer = layers->ptr<CaptionEncoderLayerImpl>(i);
    const at::Tensor mask = out.mask;
    h = nn::run_block(block_table_.get(), layer,
                      [layer, mask](const std::vector<at::Tensor>& in) {
                        return std::vector<at::Tensor>{layer->forward(in[0], mask)};
                      },
                      {h})[0];
  }
  out.hidden = final_norm->forward(h);
  return out;
}

}  // namespace shoestring::models
