#!/usr/bin/env python3
"""Reference vectors for shoestring's nn building blocks, computed with PyTorch.

Each case is written as tests/data/nn/<case>.bin (raw little-endian float32,
tensors back to back) plus tests/data/nn/<case>.json, which lists every tensor
as {"name", "shape", "offset"} (offset in float32 elements). Parameters are
named "param.<path>" with <path> the C++ module's named_parameters() key;
inputs "input.<name>" (bool masks stored as 0/1); results "output".

The blocks are written here in functional form straight from torch.nn.functional,
following the public LDM / Stable Diffusion definitions (CompVis
ldm/modules/diffusionmodules/openaimodel.py ResBlock, ldm/modules/attention.py
CrossAttention / BasicTransformerBlock / SpatialTransformer, util.timestep_embedding),
independently of the C++ code. Grouped-query attention repeats each key/value
head over its group of query heads (repeat_interleave), as Llama's `repeat_kv`.

Usage: /usr/bin/python3 scripts/gen_nn_reference.py   (from the repository root)
"""
import json
import math
import os

import numpy as np
import torch
import torch.nn.functional as F

import reference_data  # scripts/reference_data.py

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "nn")


def write_case(name, tensors):
    reference_data.write_case(OUT_DIR, name, tensors, "scripts/gen_nn_reference.py")


def rand(*shape, scale=0.3):
    return torch.randn(*shape) * scale


def norm_params(p, prefix, c):
    p[prefix + ".weight"] = 1.0 + 0.1 * torch.randn(c)
    p[prefix + ".bias"] = 0.1 * torch.randn(c)


def attention(p, prefix, x, context, mask, heads, kv_heads, head_dim):
    """softmax(Q K^T / sqrt(d)) V per head; key padding mask true = keep."""
    b, lq, _ = x.shape
    ctx = x if context is None else context
    lk = ctx.shape[1]
    q = F.linear(x, p[prefix + ".to_q.weight"]).view(b, lq, heads, head_dim).transpose(1, 2)
    k = F.linear(ctx, p[prefix + ".to_k.weight"]).view(b, lk, kv_heads, head_dim).transpose(1, 2)
    v = F.linear(ctx, p[prefix + ".to_v.weight"]).view(b, lk, kv_heads, head_dim).transpose(1, 2)
    group = heads // kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    out = scores.softmax(-1) @ v
    out = out.transpose(1, 2).reshape(b, lq, heads * head_dim)
    return F.linear(out, p[prefix + ".to_out.weight"], p[prefix + ".to_out.bias"])


def attention_params(p, prefix, qdim, cdim, heads, kv_heads, head_dim):
    p[prefix + ".to_q.weight"] = rand(heads * head_dim, qdim)
    p[prefix + ".to_k.weight"] = rand(kv_heads * head_dim, cdim)
    p[prefix + ".to_v.weight"] = rand(kv_heads * head_dim, cdim)
    p[prefix + ".to_out.weight"] = rand(qdim, heads * head_dim)
    p[prefix + ".to_out.bias"] = rand(qdim, scale=0.1)


def case_attention():
    torch.manual_seed(1)
    qdim, cdim, heads, kv_heads, hd = 16, 12, 4, 2, 4
    p = {}
    attention_params(p, "", qdim, cdim, heads, kv_heads, hd)
    p = {k[1:]: v for k, v in p.items()}  # drop the leading '.'
    x = torch.randn(2, 7, qdim)
    context = torch.randn(2, 5, cdim)
    mask = torch.tensor([[True, True, True, False, False], [True, False, True, True, True]])
    pp = {"." + k: v for k, v in p.items()}
    out = attention(pp, "", x, context, mask, heads, kv_heads, hd)
    tensors = {"param." + k: v for k, v in p.items()}
    tensors.update({"input.x": x, "input.context": context, "input.mask": mask.float(), "output": out})
    write_case("attention_gqa", tensors)


def resblock_case(name, seed, scale_shift):
    # nn::ResBlock. With scale_shift: adaptive group normalization as
    # guided-diffusion's ResBlock with use_scale_shift_norm (emb -> [scale,
    # shift]; out_norm(h) * (1 + scale) + shift); otherwise emb is added.
    torch.manual_seed(seed)
    cin, cout, temb_dim, groups, eps = 8, 16, 12, 4, 1e-5
    emb_out = 2 * cout if scale_shift else cout
    p = {}
    norm_params(p, "norm1", cin)
    p["conv1.weight"] = rand(cout, cin, 3, 3, scale=0.2)
    p["conv1.bias"] = rand(cout, scale=0.1)
    p["time_emb_proj.weight"] = rand(emb_out, temb_dim, scale=0.3) if scale_shift else rand(cout, temb_dim)
    p["time_emb_proj.bias"] = rand(emb_out, scale=0.1)
    norm_params(p, "norm2", cout)
    p["conv2.weight"] = rand(cout, cout, 3, 3, scale=0.2)
    p["conv2.bias"] = rand(cout, scale=0.1)
    p["conv_shortcut.weight"] = rand(cout, cin, 1, 1)
    p["conv_shortcut.bias"] = rand(cout, scale=0.1)
    x = torch.randn(2, cin, 6, 6)
    temb = torch.randn(2, temb_dim)
    h = F.conv2d(F.silu(F.group_norm(x, groups, p["norm1.weight"], p["norm1.bias"], eps)),
                 p["conv1.weight"], p["conv1.bias"], padding=1)
    emb = F.linear(F.silu(temb), p["time_emb_proj.weight"], p["time_emb_proj.bias"])[:, :, None, None]
    if scale_shift:
        scale, shift = torch.chunk(emb, 2, dim=1)
        h = F.group_norm(h, groups, p["norm2.weight"], p["norm2.bias"], eps) * (1 + scale) + shift
    else:
        h = F.group_norm(h + emb, groups, p["norm2.weight"], p["norm2.bias"], eps)
    h = F.conv2d(F.silu(h), p["conv2.weight"], p["conv2.bias"], padding=1)
    out = F.conv2d(x, p["conv_shortcut.weight"], p["conv_shortcut.bias"]) + h
    tensors = {"param." + k: v for k, v in p.items()}
    tensors.update({"input.x": x, "input.temb": temb, "output": out})
    write_case(name, tensors)


def case_spatial_transformer():
    torch.manual_seed(3)
    dim, heads, hd, cdim, groups = 16, 2, 8, 12, 4
    p = {}
    norm_params(p, "norm", dim)
    p["proj_in.weight"] = rand(dim, dim, 1, 1)
    p["proj_in.bias"] = rand(dim, scale=0.1)
    b = "blocks.0"
    norm_params(p, b + ".norm1", dim)
    attention_params(p, b + ".attn1", dim, dim, heads, heads, hd)
    norm_params(p, b + ".norm2", dim)
    attention_params(p, b + ".attn2", dim, cdim, heads, heads, hd)
    norm_params(p, b + ".norm3", dim)
    p[b + ".ff.proj.weight"] = rand(2 * 4 * dim, dim)
    p[b + ".ff.proj.bias"] = rand(2 * 4 * dim, scale=0.1)
    p[b + ".ff.out.weight"] = rand(dim, 4 * dim, scale=0.15)
    p[b + ".ff.out.bias"] = rand(dim, scale=0.1)
    p["proj_out.weight"] = rand(dim, dim, 1, 1)
    p["proj_out.bias"] = rand(dim, scale=0.1)

    x = torch.randn(2, dim, 3, 4)
    context = torch.randn(2, 5, cdim)
    mask = torch.tensor([[True, True, False, False, False], [True, True, True, True, True]])
    B, C, H, W = x.shape
    h = F.group_norm(x, groups, p["norm.weight"], p["norm.bias"], 1e-6)
    h = F.conv2d(h, p["proj_in.weight"], p["proj_in.bias"])
    h = h.permute(0, 2, 3, 1).reshape(B, H * W, C)

    def ln(t, prefix):
        return F.layer_norm(t, (dim,), p[prefix + ".weight"], p[prefix + ".bias"], 1e-5)

    h = h + attention(p, b + ".attn1", ln(h, b + ".norm1"), None, None, heads, heads, hd)
    h = h + attention(p, b + ".attn2", ln(h, b + ".norm2"), context, mask, heads, heads, hd)
    a, gate = F.linear(ln(h, b + ".norm3"), p[b + ".ff.proj.weight"], p[b + ".ff.proj.bias"]).chunk(2, -1)
    h = h + F.linear(a * F.gelu(gate), p[b + ".ff.out.weight"], p[b + ".ff.out.bias"])
    h = h.reshape(B, H, W, C).permute(0, 3, 1, 2)
    out = x + F.conv2d(h, p["proj_out.weight"], p["proj_out.bias"])
    tensors = {"param." + k: v for k, v in p.items()}
    tensors.update({"input.x": x, "input.context": context, "input.mask": mask.float(), "output": out})
    write_case("spatial_transformer", tensors)


def timestep_embedding(t, dim, max_period=10000):
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(0, half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


def case_timestep():
    t = torch.tensor([0.0, 1.0, 37.5, 500.0, 999.0])
    write_case("timestep_embedding", {"input.t": t, "output.dim8": timestep_embedding(t, 8),
                                      "output.dim7": timestep_embedding(t, 7)})


if __name__ == "__main__":
    torch.set_num_threads(1)
    case_attention()
    resblock_case("resblock", 2, scale_shift=False)
    resblock_case("resblock_scale_shift", 5, scale_shift=True)
    case_spatial_transformer()
    case_timestep()
    print("wrote", sorted(os.listdir(OUT_DIR)))
