#include "shoestring/nn/chunked_attention.h"

#include <algorithm>
#include <atomic>
#include <limits>

#include <torch/torch.h>

#include "shoestring/core/error.h"
#include "shoestring/core/torch_compat.h"
#include "shoestring/core/units.h"

namespace shoestring::nn {
namespace {

std::atomic<int64_t> g_chunk_bytes{int64_t{64} << 20};

// Lowest finite value of a floating dtype: the fill for masked scores.
double lowest_finite(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return -65504.0;
    case at::kBFloat16: return -3.3895313892515355e38;
    case at::kDouble: return std::numeric_limits<double>::lowest();
    default: return std::numeric_limits<float>::lowest();
  }
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& key_mask) {
  if (!q.defined() || !k.defined() || !v.defined() || q.dim() != 4 || k.dim() != 4 || v.dim() != 4) {
    fail("attention: q, k, v must be 4-d [B, Hkv, rows, d] tensors");
  }
  if (k.sizes() != v.sizes() || q.size(0) != k.size(0) || q.size(1) != k.size(1) || q.size(3) != k.size(3)) {
    fail("attention: q {} does not match k {} / v {} (expected q [B, Hkv, R, d], k = v [B, Hkv, Lk, d])",
         format_shape(q.sizes()), format_shape(k.sizes()), format_shape(v.sizes()));
  }
  if (q.scalar_type() != k.scalar_type() || q.scalar_type() != v.scalar_type()) {
    fail("attention: q, k, v must share a dtype (got {}, {}, {})", c10::toString(q.scalar_type()),
         c10::toString(k.scalar_type()), c10::toString(v.scalar_type()));
  }
  if (key_mask.defined() && (key_mask.dim() != 2 || key_mask.size(0) != k.size(0) || key_mask.size(1) != k.size(2) ||
                             key_mask.scalar_type() != at::kBool)) {
    fail("attention: key_mask must be bool [{}, {}], got {} {}", k.size(0), k.size(2),
         c10::toString(key_mask.scalar_type()), format_shape(key_mask.sizes()));
  }
}

// [B, 1, 1, Lk] bool, true = masked out; undefined without a mask.
at::Tensor masked_keys(const at::Tensor& key_mask) {
  if (!key_mask.defined()) return {};
  return key_mask.logical_not().view({key_mask.size(0), 1, 1, key_mask.size(1)});
}

// softmax(q_b k^T) with masked keys at the lowest finite value: [B, Hkv, n, Lk].
at::Tensor block_probs(const at::Tensor& q_b, const at::Tensor& k, const at::Tensor& masked) {
  at::Tensor s = torch::matmul(q_b, k.transpose(-1, -2));
  if (masked.defined()) s.masked_fill_(masked, lowest_finite(s.scalar_type()));
  return s.softmax(-1);
}

struct ChunkedAttentionFn : public torch::autograd::Function<ChunkedAttentionFn> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& key_mask, int64_t block_rows) {
    const int64_t R = q.size(2);
    // An empty mask stands for "no mask" (autograd functions take no undefined tensors).
    const at::Tensor masked = key_mask.numel() > 0 ? masked_keys(key_mask) : at::Tensor();
    at::Tensor out = torch::empty({q.size(0), q.size(1), R, v.size(3)}, q.options());
    for (int64_t r0 = 0; r0 < R; r0 += block_rows) {
      const int64_t n = std::min(block_rows, R - r0);
      at::Tensor p = block_probs(q.narrow(2, r0, n), k, masked);
      out.narrow(2, r0, n).copy_(torch::matmul(p, v));
    }
    ctx->save_for_backward({q, k, v, out});
    ctx->saved_data["has_mask"] = masked.defined();
    if (masked.defined()) ctx->saved_data["masked"] = masked;
    ctx->saved_data["block_rows"] = block_rows;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3];
    const at::Tensor masked =
        ctx->saved_data["has_mask"].toBool() ? ctx->saved_data["masked"].toTensor() : at::Tensor();
    const int64_t block_rows = ctx->saved_data["block_rows"].toInt();
    const int64_t R = q.size(2);
    at::Tensor dout = grads[0];
    if (!dout.defined()) return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
    dout = dout.to(q.scalar_type());
    const bool low = q.scalar_type() != at::kFloat && q.scalar_type() != at::kDouble;
    const auto acc_type = low ? at::kFloat : q.scalar_type();
    // D = rowsum(dO o O): the softmax Jacobian's row term, [B, Hkv, R, 1].
    const at::Tensor D = (dout.to(acc_type) * out.to(acc_type)).sum(-1, true).to(q.scalar_type());
    at::Tensor dq = torch::empty_like(q, at::MemoryFormat::Contiguous);
    at::Tensor dk = torch::zeros(k.sizes(), k.options().dtype(acc_type));
    at::Tensor dv = torch::zeros(v.sizes(), v.options().dtype(acc_type));
    for (int64_t r0 = 0; r0 < R; r0 += block_rows) {
      const int64_t n = std::min(block_rows, R - r0);
      const at::Tensor q_b = q.narrow(2, r0, n);
      const at::Tensor do_b = dout.narrow(2, r0, n);
      at::Tensor p = block_probs(q_b, k, masked);                // [B, Hkv, n, Lk]
      dv.add_(torch::matmul(p.transpose(-1, -2), do_b));         // [B, Hkv, Lk, d]
      at::Tensor ds = torch::matmul(do_b, v.transpose(-1, -2));  // dP
      ds.sub_(D.narrow(2, r0, n)).mul_(p);                       // dS = P o (dP - D)
      p = at::Tensor();
      if (masked.defined()) ds.masked_fill_(masked, 0.0);  // masked scores get no gradient
      dq.narrow(2, r0, n).copy_(torch::matmul(ds, k));
      dk.add_(torch::matmul(ds.transpose(-1, -2), q_b));
    }
    return {dq, dk.to(k.scalar_type()), dv.to(v.scalar_type()), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor plain_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& key_mask) {
  check_inputs(q, k, v, key_mask);
  at::Tensor scores = torch::matmul(q, k.transpose(-1, -2));  // [B, Hkv, R, Lk]
  if (key_mask.defined()) {
    scores = scores.masked_fill(masked_keys(key_mask), lowest_finite(scores.scalar_type()));
  }
  return torch::matmul(scores.softmax(-1), v);  // [B, Hkv, R, d]
}

at::Tensor chunked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& key_mask,
                             int64_t block_rows) {
  check_inputs(q, k, v, key_mask);
  if (block_rows < 1) fail("chunked_attention: block_rows must be >= 1 (got {})", block_rows);
  const at::Tensor mask = key_mask.defined() ? key_mask : torch::empty({0}, torch::kBool);
  return apply_autograd_function<ChunkedAttentionFn>(q, k, v, mask, block_rows);
}

void set_attention_chunk_bytes(int64_t bytes) {
  if (bytes < 0) fail("attention chunk threshold must be >= 0 bytes (got {})", bytes);
  g_chunk_bytes.store(bytes);
}

int64_t attention_chunk_bytes() { return g_chunk_bytes.load(); }

int64_t attention_block_rows(int64_t batch, int64_t kv_heads, int64_t rows, int64_t keys, int64_t element_size,
                             int64_t chunk_bytes) {
  if (chunk_bytes <= 0) return 0;
  const int64_t per_row = batch * kv_heads * keys * element_size;  // bytes of one score row over the batch
  if (per_row <= 0 || per_row * rows <= chunk_bytes) return 0;
  return std::max<int64_t>(1, chunk_bytes / per_row);
}

at::Tensor attention_core(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& key_mask) {
  check_inputs(q, k, v, key_mask);
  const int64_t block = attention_block_rows(q.size(0), q.size(1), q.size(2), k.size(2),
                                             static_cast<int64_t>(q.element_size()), attention_chunk_bytes());
#if SHOESTRING_HAS_SDPA
  // On GPUs, libtorch's fused kernels (flash / memory-efficient attention:
  // no score matrix in memory, forward or backward). Masked keys get the
  // dtype's lowest finite score, as in plain_attention (a fully masked row
  // attends uniformly instead of giving NaN). Key/value heads are used by
  // G stacked query heads each (the layout above), so no repeat is needed.
  if (!q.device().is_cpu()) {
    c10::optional<at::Tensor> mask;
    if (key_mask.defined()) {
      mask = at::zeros({key_mask.size(0), 1, 1, key_mask.size(1)}, q.options())
                 .masked_fill_(masked_keys(key_mask), lowest_finite(q.scalar_type()));
    }
    return at::scaled_dot_product_attention(q, k, v, mask, /*dropout_p=*/0.0, /*is_causal=*/false, /*scale=*/1.0);
  }
#endif
  if (block == 0) return plain_attention(q, k, v, key_mask);
  return chunked_attention(q, k, v, key_mask, block);
}

}  // namespace shoestring::nn
