// Memory-efficient attention: softmax(Q K^T) V computed in blocks of query
// rows, so that attention memory is O(Lq x block) instead of O(Lq x Lk), in
// the forward AND the backward pass.
//
// Forward per block of query rows: S = Q_b K^T, masked keys filled with the
// dtype's lowest finite value, P = softmax(S), O_b = P V. Only Q, K, V and O
// are kept for backward (a custom autograd function, not torch's checkpoint).
// Backward recomputes P per block and uses the identity of FlashAttention
// (Dao et al. 2022, "FlashAttention", arXiv 2205.14135, algorithm 4; the
// row-sum trick D = rowsum(dO o O) goes back to the softmax Jacobian):
//   dV += P^T dO_b;  dP = dO_b V^T;  dS = P o (dP - D_b);  dQ_b = dS K;  dK += dS^T Q_b.
// Unlike FlashAttention the forward keeps a full softmax per block (no online
// softmax across key blocks): keys are never split, only queries, which is
// what bounds memory for the image-token self-attention of a UNet (Lq = Lk =
// H*W) and keeps the forward bit-for-bit the plain formula's row by row.
//
// The layout is nn/attention.cpp's: grouped-query attention (Ainslie et al.
// 2023) stacks the G = heads / kv_heads query heads of one key/value head
// along the row axis, so q is [B, Hkv, G*Lq, d] and k, v are [B, Hkv, Lk, d].
// Plain multi-head attention is G = 1.
#pragma once
#include <cstdint>

#include <ATen/core/Tensor.h>

namespace shoestring::nn {

/// The plain formula, keeping the full score matrix (and, under autograd,
/// the probabilities [B, Hkv, R, Lk] for backward).
/// q: [B, Hkv, R, d] (R = G*Lq; any scale already folded in), k, v:
/// [B, Hkv, Lk, d], same float dtype; key_mask: [B, Lk] bool, true = the key
/// takes part, or undefined. Masked scores become the dtype's lowest finite
/// value, so a row with every key masked attends uniformly (no NaN).
/// Returns [B, Hkv, R, d] in q's dtype.
at::Tensor plain_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& key_mask = {});

/// Same result as plain_attention (forward equal row block by row block;
/// gradients equal within floating-point rounding), computed `block_rows`
/// query rows at a time: peak extra memory is ~3 x B*Hkv*block_rows*Lk
/// elements (scores, probabilities and their gradient of one block) instead
/// of the full matrices. Differentiable in q, k and v through a custom
/// autograd function that saves q, k, v and the output only and recomputes
/// each block's probabilities in backward. bf16/fp16 inputs: dK and dV are
/// accumulated across blocks in fp32 and cast once.
/// Throws shoestring::Error on shape/dtype mismatch or block_rows < 1.
at::Tensor chunked_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& key_mask,
                             int64_t block_rows);

/// Process-wide threshold of attention_core(): the largest score matrix, in
/// bytes (B*Hkv*R*Lk*element size), that is computed in one piece. Set from
/// the config key `attention_chunk_mib` by the trainer; 0 disables chunking.
/// Default 64 MiB.
void set_attention_chunk_bytes(int64_t bytes);
int64_t attention_chunk_bytes();

/// Query rows per block that attention_core() uses for these sizes under a
/// threshold of `chunk_bytes`, or 0 when the plain path is taken (scores fit,
/// or chunk_bytes == 0). Used by the memory planner as well.
int64_t attention_block_rows(int64_t batch, int64_t kv_heads, int64_t rows, int64_t keys, int64_t element_size,
                             int64_t chunk_bytes);

/// plain_attention when the score matrix fits under attention_chunk_bytes(),
/// chunked_attention with attention_block_rows() otherwise. On a non-CPU
/// device with libtorch >= 2.1 (SHOESTRING_HAS_SDPA, core/torch_compat.h):
/// at::scaled_dot_product_attention with scale 1 (the same formula, fused
/// kernels; results equal to rounding).
at::Tensor attention_core(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& key_mask = {});

}  // namespace shoestring::nn
