#include "shoestring/nn/attention.h"
#include "shoestring/nn/chunked_attention.h"

#include <cmath>
#include <limits>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/units.h"
#include "shoestring/nn/block_precision.h"

namespace shoestring::nn {

AttentionImpl::AttentionImpl(const AttentionOptions& options) : options_(options) {
  if (options_.num_kv_heads() == 0) options_.num_kv_heads(options_.heads());
  if (options_.context_dim() == 0) options_.context_dim(options_.query_dim());
  const auto& o = options_;
  if (o.query_dim() <= 0 || o.context_dim() < 0 || o.heads() <= 0 || o.head_dim() <= 0 || o.num_kv_heads() < 0) {
    fail(
        "Attention: sizes must be positive (query_dim {}, context_dim {}, heads {}, head_dim {}, "
        "num_kv_heads {})",
        o.query_dim(), o.context_dim(), o.heads(), o.head_dim(), o.num_kv_heads());
  }
  if (o.heads() % o.num_kv_heads() != 0) {
    fail("Attention: num_kv_heads {} must divide heads {}", o.num_kv_heads(), o.heads());
  }
  const int64_t inner = o.heads() * o.head_dim();
  const int64_t kv_inner = o.num_kv_heads() * o.head_dim();
  const LayerInit& init = o.init();
  to_q = register_module("to_q", Linear(o.query_dim(), inner, /*bias=*/false, init));
  to_k = register_module("to_k", Linear(o.context_dim(), kv_inner, /*bias=*/false, init));
  to_v = register_module("to_v", Linear(o.context_dim(), kv_inner, /*bias=*/false, init));
  to_out = register_at(*this, o.layout() == KeyLayout::kShoestring ? "to_out" : "to_out.0",
                       Linear(inner, o.query_dim(), /*bias=*/true, init));
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& context,
                                     const torch::Tensor& key_mask) {
  const auto& o = options_;
  if (x.dim() != 3 || x.size(2) != o.query_dim()) {
    fail("Attention: input x must be [B, L, {}], got {}", o.query_dim(), format_shape(x.sizes()));
  }
  const torch::Tensor& kv_in = context.defined() ? context : x;
  const int64_t B = x.size(0), Lq = x.size(1), Lk = kv_in.size(1);
  if (kv_in.dim() != 3 || kv_in.size(0) != B || kv_in.size(2) != o.context_dim()) {
    fail("Attention: context must be [{}, Lk, {}], got {}", B, o.context_dim(), format_shape(kv_in.sizes()));
  }
  if (key_mask.defined() && (key_mask.dim() != 2 || key_mask.size(0) != B || key_mask.size(1) != Lk ||
                             key_mask.scalar_type() != torch::kBool)) {
    fail("Attention: key_mask must be bool [{}, {}], got {} {}", B, Lk, c10::toString(key_mask.scalar_type()),
         format_shape(key_mask.sizes()));
  }
  const int64_t H = o.heads(), Hkv = o.num_kv_heads(), G = H / Hkv, d = o.head_dim();

  // Query heads of one group are stacked along the sequence axis so that each
  // key/value head is used by one batched matmul without being repeated:
  // q [B, Lq, Hkv, G, d] -> [B, Hkv, G*Lq, d]; k, v [B, Lk, Hkv, d] -> [B, Hkv, Lk, d].
  // The 1/sqrt(d) scale is folded into the query weight, the smallest tensor
  // it can be applied to (gradients flow through the product as usual).
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  torch::Tensor q;
  if (to_q->weight_fp8) {
    // fp8 bytes (nn/fp8_storage.h): the scale goes into the decode, W / s * scale = W / (s / scale).
    Fp8Storage folded = *to_q->weight_fp8;
    folded.scale /= scale;
    q = fp8_linear(to_compute_dtype(x), to_q->weight, folded);
  } else {
    q = torch::linear(x, to_compute_dtype(to_q->weight) * scale);  // precision: nn/block_precision.h
  }
  if (to_q->adapter) q = q + to_q->adapter(x) * scale;  // LoRA (nn/lora.h): to_q's forward is bypassed here
  q = q.view({B, Lq, Hkv, G, d}).permute({0, 2, 3, 1, 4}).reshape({B, Hkv, G * Lq, d});
  torch::Tensor k = to_k->forward(kv_in).view({B, Lk, Hkv, d}).transpose(1, 2);
  torch::Tensor v = to_v->forward(kv_in).view({B, Lk, Hkv, d}).transpose(1, 2);

  // softmax(q k^T) v, in query blocks when the score matrix is larger than
  // attention_chunk_bytes() (nn/chunked_attention.h).
  torch::Tensor out = attention_core(q, k, v, key_mask);  // [B, Hkv, G*Lq, d]
  out = out.view({B, Hkv, G, Lq, d}).permute({0, 3, 1, 2, 4}).reshape({B, Lq, H * d});
  return to_out->forward(out);
}

}  // namespace shoestring::nn
