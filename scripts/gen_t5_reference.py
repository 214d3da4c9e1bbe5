#!/usr/bin/env python3
"""Reference data for shoestring's T5 v1.1 text encoder (src/shoestring/models/t5_encoder.h).

Writes:
  tests/data/models/t5_micro.safetensors    random fp32 weights of a micro T5 encoder under the Hugging Face
                                            T5EncoderModel key names (shared.weight, encoder.block.<i>...,
                                            encoder.final_layer_norm.weight): d_model 32, 4 heads of d_kv 6
                                            (inner width 24 != d_model, as in t5-v1_1-small), d_ff 40,
                                            3 layers, the released bucket settings (32 buckets, max_distance 128)
  tests/data/models/t5_micro.{json,bin}     ids [2, 140] (long enough that relative distances reach the
                                            clamp to the last bucket, |key - query| >= 128), an attention mask
                                            (row 0 all tokens, row 1 51 tokens then padding), the outputs
                                            without and with the mask, and bucket tables
  tests/data/models/t5_micro_b.{safetensors,json,bin}  a second micro encoder with other bucket settings
                                            (16 buckets, max_distance 24; 1 layer, d_model 16, 2 heads of 8,
                                            d_ff 24) and ids [1, 40], so a hard-coded 32 / 128 shows

The encoder is written here in functional PyTorch from the published definitions (Raffel et al. 2020,
"Exploring the Limits of Transfer Learning with a Unified Text-to-Text Transformer", Sec. 2.1; the T5 v1.1
changes: gated-GELU feed-forward, no parameter sharing between embedding and classifier; and the formulas
of Hugging Face's T5 docs), independently of the C++ code:
  x = shared[ids]
  per block: x += o(softmax(q k^T + bias) v) of RMSNorm(x)         (no 1/sqrt(d_kv) scaling)
             x += wo(gelu_tanh(wi_0 h) * wi_1 h), h = RMSNorm(x)
  out = RMSNorm(x)  (final_layer_norm)
  RMSNorm(x) = weight * x / sqrt(mean(x^2) + 1e-6)
  bias[h, q, k] = relative_attention_bias[bucket(k - q), h] (+ -inf at masked keys), block 0's table for all
  bucket(r): half = num_buckets / 2, exact = half / 2; (r > 0) * half + (|r| < exact ? |r| :
             min(half - 1, exact + floor(log(|r| / exact) / log(max_distance / exact) * (half - exact))))
The reference runs in float64 on the fp32 weights; the bucket tables are computed with Python's math in
float64 and checked here against the same formula in float32 tensor arithmetic (as Hugging Face computes
it), so the boundaries are unambiguous.

Usage: /usr/bin/python3 scripts/gen_t5_reference.py   (from the repository root)
"""
import math
import os

import torch

import reference_data  # scripts/reference_data.py
from gen_clip_reference import write_safetensors  # scripts/gen_clip_reference.py

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "models")
GENERATOR = "scripts/gen_t5_reference.py"
EPS = 1e-6
PAD, EOS = 0, 1


def bucket_exact(r, num_buckets, max_distance):
    """One relative position (key - query) -> bucket, in Python float64 arithmetic."""
    half = num_buckets // 2
    exact = half // 2
    out = half if r > 0 else 0
    n = abs(r)
    if n < exact:
        return out + n
    return out + min(half - 1, exact + int(math.log(n / exact) / math.log(max_distance / exact) * (half - exact)))


def bucket_float32(r, num_buckets, max_distance):
    """The same formula in float32 tensor arithmetic (r: int64 tensor)."""
    half = num_buckets // 2
    exact = half // 2
    out = (r > 0).long() * half
    n = r.abs()
    large = exact + (torch.log(n.float() / exact) / math.log(max_distance / exact) * (half - exact)).long()
    return out + torch.where(n < exact, n, large.clamp(max=half - 1))


def bucket_table(num_buckets, max_distance, span):
    r = torch.arange(-span, span + 1)
    table = torch.tensor([bucket_exact(int(v), num_buckets, max_distance) for v in r])
    assert torch.equal(table, bucket_float32(r, num_buckets, max_distance)), (num_buckets, max_distance)
    return table


def make_params(vocab, d_model, heads, d_kv, d_ff, layers, num_buckets):
    g = torch.Generator().manual_seed(1234 + d_model)

    def randn(*shape, scale):
        return torch.randn(*shape, generator=g) * scale

    inner = heads * d_kv
    p = {"shared.weight": randn(vocab, d_model, scale=1.0)}
    for i in range(layers):
        k = f"encoder.block.{i}.layer."
        p[k + "0.layer_norm.weight"] = 1 + randn(d_model, scale=0.1)
        for name in ("q", "k", "v"):
            p[k + f"0.SelfAttention.{name}.weight"] = randn(inner, d_model, scale=d_model ** -0.5)
        p[k + "0.SelfAttention.o.weight"] = randn(d_model, inner, scale=inner ** -0.5)
        if i == 0:
            p[k + "0.SelfAttention.relative_attention_bias.weight"] = randn(num_buckets, heads, scale=1.0)
        p[k + "1.layer_norm.weight"] = 1 + randn(d_model, scale=0.1)
        p[k + "1.DenseReluDense.wi_0.weight"] = randn(d_ff, d_model, scale=d_model ** -0.5)
        p[k + "1.DenseReluDense.wi_1.weight"] = randn(d_ff, d_model, scale=d_model ** -0.5)
        p[k + "1.DenseReluDense.wo.weight"] = randn(d_model, d_ff, scale=d_ff ** -0.5)
    p["encoder.final_layer_norm.weight"] = 1 + randn(d_model, scale=0.1)
    return p


def rms_norm(x, weight):
    return weight * (x / torch.sqrt(x.pow(2).mean(dim=-1, keepdim=True) + EPS))


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def forward(p, ids, heads, d_kv, layers, num_buckets, max_distance, mask=None):
    p = {k: v.double() for k, v in p.items()}
    B, L = ids.shape
    x = p["shared.weight"][ids]  # [B, L, d_model]
    positions = torch.arange(L)
    relative = positions.view(1, L) - positions.view(L, 1)  # [query, key] = key - query
    buckets = torch.tensor([[bucket_exact(int(r), num_buckets, max_distance) for r in row] for row in relative])
    table = p["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]  # [num_buckets, heads]
    bias = table[buckets].permute(2, 0, 1).unsqueeze(0).expand(B, heads, L, L)  # [B, H, Lq, Lk]
    if mask is not None:
        bias = bias.masked_fill((mask == 0).view(B, 1, 1, L), float("-inf"))
    for i in range(layers):
        k = f"encoder.block.{i}.layer."
        h = rms_norm(x, p[k + "0.layer_norm.weight"])

        def split(t):
            return t.view(B, L, heads, d_kv).transpose(1, 2)  # [B, H, L, d_kv]

        q = split(h @ p[k + "0.SelfAttention.q.weight"].T)
        kk = split(h @ p[k + "0.SelfAttention.k.weight"].T)
        v = split(h @ p[k + "0.SelfAttention.v.weight"].T)
        attn = torch.softmax(q @ kk.transpose(-1, -2) + bias, dim=-1) @ v
        x = x + attn.transpose(1, 2).reshape(B, L, heads * d_kv) @ p[k + "0.SelfAttention.o.weight"].T
        h = rms_norm(x, p[k + "1.layer_norm.weight"])
        gated = gelu_tanh(h @ p[k + "1.DenseReluDense.wi_0.weight"].T) * (h @ p[k + "1.DenseReluDense.wi_1.weight"].T)
        x = x + gated @ p[k + "1.DenseReluDense.wo.weight"].T
    return rms_norm(x, p["encoder.final_layer_norm.weight"])


def token_rows(lengths, L, vocab, seed):
    """Rows of random ordinary ids (3..vocab-1), EOS, then padding to L (a tokenizer's output)."""
    g = torch.Generator().manual_seed(seed)
    rows, masks = [], []
    for n in lengths:
        body = torch.randint(3, vocab, (n,), generator=g)
        row = torch.cat([body, torch.tensor([EOS])])
        rows.append(torch.cat([row, torch.full((L - row.numel(),), PAD)]))
        masks.append(torch.cat([torch.ones(row.numel()), torch.zeros(L - row.numel())]))
    return torch.stack(rows).long(), torch.stack(masks)


def main():
    # Micro encoder with the released bucket settings; L = 140 > 128 reaches the clamp to the last bucket.
    cfg = dict(vocab=64, d_model=32, heads=4, d_kv=6, d_ff=40, layers=3, num_buckets=32, max_distance=128)
    p = make_params(cfg["vocab"], cfg["d_model"], cfg["heads"], cfg["d_kv"], cfg["d_ff"], cfg["layers"],
                    cfg["num_buckets"])
    write_safetensors(os.path.join(OUT_DIR, "t5_micro.safetensors"), p, {"generator": GENERATOR})
    L = 140
    ids, mask = token_rows([L - 1, 50], L, cfg["vocab"], seed=5)
    run = dict(heads=cfg["heads"], d_kv=cfg["d_kv"], layers=cfg["layers"], num_buckets=cfg["num_buckets"],
               max_distance=cfg["max_distance"])
    plain = forward(p, ids, **run)
    masked = forward(p, ids, **run, mask=mask)
    assert (plain[1] - masked[1]).abs().max() > 1e-2  # the mask matters for the padded row
    case = {"input.ids": ids.float(), "input.attention_mask": mask, "last_hidden": plain, "last_hidden_masked": masked,
            # key - query from -300 to 300, bucket of each (index = r + 300)
            "buckets.32.128": bucket_table(32, 128, 300).float(),
            "buckets.16.24": bucket_table(16, 24, 300).float(),
            "buckets.8.20": bucket_table(8, 20, 300).float()}
    reference_data.write_case(OUT_DIR, "t5_micro", case, GENERATOR)

    # Other bucket settings, one layer.
    p = make_params(64, 16, 2, 8, 24, 1, 16)
    write_safetensors(os.path.join(OUT_DIR, "t5_micro_b.safetensors"), p, {"generator": GENERATOR})
    ids, mask = token_rows([39], 40, 64, seed=6)
    out = forward(p, ids, heads=2, d_kv=8, layers=1, num_buckets=16, max_distance=24)
    reference_data.write_case(OUT_DIR, "t5_micro_b", {"input.ids": ids.float(), "last_hidden": out}, GENERATOR)


if __name__ == "__main__":
    main()
