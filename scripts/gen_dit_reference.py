#!/usr/bin/env python3
"""Reference data for shoestring's Stable Cascade stage C and MMDiT(-X) models.

Writes into tests/data/models/:

* <arch>.keys.txt for cascade-c, cascade-c-lite and sd35m: every tensor of the
  released single-file checkpoint as "name d0,d1,..." (parameters, plus the
  pos_embed buffer for sd35m, which the file stores), from modules built here
  on the meta device. Key names come from PyTorch's own layers
  (nn.Sequential indices, nn.MultiheadAttention's in_proj_weight / out_proj),
  arranged as Stability's reference code arranges them:
    - Stable Cascade: github.com/Stability-AI/StableCascade modules/stage_c.py,
      modules/common.py; 3.6B defaults, 1B per train/train_c.py (c_cond 1536,
      c_hidden [1536, 1536], nhead [24, 24], blocks [[4, 12], [12, 4]]).
    - SD3.5 Medium: github.com/Stability-AI/sd3.5 mmditx.py (MMDiTX), depth 24,
      pos_embed_max_size 384, adm 2048, context 4096, qk_norm rms,
      x_block_self_attn_layers 0..12.
* <case>.json / <case>.bin for small configurations: random parameters,
  inputs and the forward output, computed here (same format as
  scripts/gen_nn_reference.py: float32 tensors back to back, "param.<key>",
  "buffer.<key>", "input.<name>", "output"). The forward passes are written
  here from the reference semantics, independently of the C++ code; stage C
  attention is torch.nn.MultiheadAttention itself, and grouped-query attention
  repeats each key/value head over its group of query heads
  (repeat_interleave, as Llama's repeat_kv).

Usage: /usr/bin/python3 scripts/gen_dit_reference.py   (from the repository root)
"""
import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import reference_data  # scripts/reference_data.py

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "models")


# --------------------------------------------------------------------------- #
# Stable Cascade stage C
# --------------------------------------------------------------------------- #

def ln2d(x):
    return F.layer_norm(x.permute(0, 2, 3, 1), (x.shape[1],), eps=1e-6).permute(0, 3, 1, 2)


class GRN(nn.Module):
    def __init__(self, d, device):
        super().__init__()
        self.gamma = nn.Parameter(torch.zeros(1, 1, 1, d, device=device))
        self.beta = nn.Parameter(torch.zeros(1, 1, 1, d, device=device))

    def forward(self, x):
        g = torch.norm(x, p=2, dim=(1, 2), keepdim=True)
        n = g / (g.mean(dim=-1, keepdim=True) + 1e-6)
        return self.gamma * (x * n) + self.beta + x


def channelwise(c_in, c, device):
    return nn.Sequential(nn.Linear(c_in, 4 * c, device=device), nn.GELU(), GRN(4 * c, device), nn.Dropout(0.0),
                         nn.Linear(4 * c, c, device=device))


class CResBlock(nn.Module):
    def __init__(self, c, c_skip, k, device):
        super().__init__()
        self.depthwise = nn.Conv2d(c, c, k, padding=k // 2, groups=c, device=device)
        self.channelwise = channelwise(c + c_skip, c, device)

    def forward(self, x, skip=None):
        h = ln2d(self.depthwise(x))
        if skip is not None:
            h = torch.cat([h, skip], 1)
        return self.channelwise(h.permute(0, 2, 3, 1)).permute(0, 3, 1, 2) + x


class CAttention(nn.Module):
    def __init__(self, c, nhead, device):
        super().__init__()
        self.attn = nn.MultiheadAttention(c, nhead, bias=True, batch_first=True, device=device)


class CAttnBlock(nn.Module):
    def __init__(self, c, c_cond, nhead, device):
        super().__init__()
        self.attention = CAttention(c, nhead, device)
        self.kv_mapper = nn.Sequential(nn.SiLU(), nn.Linear(c_cond, c, device=device))

    def forward(self, x, cond):
        kv = self.kv_mapper(cond)
        b, c, h, w = x.shape
        q = ln2d(x).reshape(b, c, h * w).permute(0, 2, 1)
        kv = torch.cat([q, kv], 1)
        out = self.attention.attn(q, kv, kv, need_weights=False)[0]
        return x + out.permute(0, 2, 1).reshape(b, c, h, w)


class CTimestepBlock(nn.Module):
    def __init__(self, c, c_r, conds, device):
        super().__init__()
        self.mapper = nn.Linear(c_r, 2 * c, device=device)
        self.conds = conds
        for name in conds:
            setattr(self, "mapper_" + name, nn.Linear(c_r, 2 * c, device=device))

    def forward(self, x, t):
        parts = t.chunk(len(self.conds) + 1, dim=1)
        ab = self.mapper(parts[0])
        for i, name in enumerate(self.conds):
            ab = ab + getattr(self, "mapper_" + name)(parts[i + 1])
        a, b = ab[:, :, None, None].chunk(2, dim=1)
        return x * (1 + a) + b


class UpDown(nn.Module):
    def __init__(self, c_in, c_out, mode, device):
        super().__init__()
        conv = nn.Conv2d(c_in, c_out, 1, device=device)
        self.blocks = nn.ModuleList([nn.Identity(), conv] if mode == "up" else [conv, nn.Identity()])

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


class StageCRef(nn.Module):
    """Stage C with the reference's module layout; switch_level False, patch 1, block_repeat 1."""

    def __init__(self, c_in=16, c_out=16, c_r=64, c_cond=2048, c_hidden=(2048, 2048), nhead=(32, 32),
                 blocks=((8, 24), (24, 8)), c_clip_text=1280, c_clip_text_pooled=1280, c_clip_img=768, c_clip_seq=4,
                 t_conds=("sca", "crp"), device="cpu"):
        super().__init__()
        self.c_r, self.c_clip_seq, self.t_conds = c_r, c_clip_seq, list(t_conds)
        self.clip_txt_mapper = nn.Linear(c_clip_text, c_cond, device=device)
        self.clip_txt_pooled_mapper = nn.Linear(c_clip_text_pooled, c_cond * c_clip_seq, device=device)
        self.clip_img_mapper = nn.Linear(c_clip_img, c_cond * c_clip_seq, device=device)
        self.c_cond = c_cond
        self.embedding = nn.Sequential(nn.PixelUnshuffle(1), nn.Conv2d(c_in, c_hidden[0], 1, device=device))
        n = len(c_hidden)

        def level(i, count, skip_first):
            mods = nn.ModuleList()
            for j in range(count):
                mods.append(CResBlock(c_hidden[i], c_hidden[i] if (skip_first and j == 0) else 0, 3, device))
                mods.append(CTimestepBlock(c_hidden[i], c_r, self.t_conds, device))
                mods.append(CAttnBlock(c_hidden[i], c_cond, nhead[i], device))
            return mods

        self.down_blocks, self.down_downscalers, self.down_repeat_mappers = nn.ModuleList(), nn.ModuleList(), nn.ModuleList()
        for i in range(n):
            self.down_downscalers.append(
                nn.Sequential(nn.Identity(), UpDown(c_hidden[i - 1], c_hidden[i], "down", device)) if i > 0
                else nn.Identity())
            self.down_blocks.append(level(i, blocks[0][i], False))
            self.down_repeat_mappers.append(nn.ModuleList())
        self.up_blocks, self.up_upscalers, self.up_repeat_mappers = nn.ModuleList(), nn.ModuleList(), nn.ModuleList()
        for i in reversed(range(n)):
            self.up_upscalers.append(
                nn.Sequential(nn.Identity(), UpDown(c_hidden[i], c_hidden[i - 1], "up", device)) if i > 0
                else nn.Identity())
            self.up_blocks.append(level(i, blocks[1][::-1][i], i < n - 1))
            self.up_repeat_mappers.append(nn.ModuleList())
        self.clf = nn.Sequential(nn.Identity(), nn.Conv2d(c_hidden[0], c_out, 1, device=device))

    def r_embed(self, r):
        r = r * 10000
        half = self.c_r // 2
        step = math.log(10000) / (half - 1)
        e = torch.arange(half).float().mul(-step).exp()
        e = r[:, None] * e[None, :]
        return torch.cat([e.sin(), e.cos()], dim=1)

    def forward(self, x, r, clip_text, clip_text_pooled, clip_img, t_cond_values=()):
        embeds = [self.r_embed(r)]
        for i in range(len(self.t_conds)):
            v = t_cond_values[i] if i < len(t_cond_values) else torch.zeros_like(r)
            embeds.append(self.r_embed(v))
        r_emb = torch.cat(embeds, 1)
        b = clip_text.shape[0]
        clip = torch.cat([self.clip_txt_mapper(clip_text),
                          self.clip_txt_pooled_mapper(clip_text_pooled).view(b, -1, self.c_cond),
                          self.clip_img_mapper(clip_img).view(b, -1, self.c_cond)], 1)
        clip = F.layer_norm(clip, (self.c_cond,), eps=1e-6)

        def run(blocks, x, skip):
            for k, blk in enumerate(blocks):
                if isinstance(blk, CResBlock):
                    x = blk(x, skip if (k == 0 and skip is not None) else None)
                elif isinstance(blk, CAttnBlock):
                    x = blk(x, clip)
                else:
                    x = blk(x, r_emb)
            return x

        x = ln2d(self.embedding(x))
        outs = []
        for i, (blocks, down) in enumerate(zip(self.down_blocks, self.down_downscalers)):
            if i > 0:
                x = down[1](ln2d(x))
            x = run(blocks, x, None)
            outs.insert(0, x)
        x = outs[0]
        for k, (blocks, up) in enumerate(zip(self.up_blocks, self.up_upscalers)):
            x = run(blocks, x, outs[k] if k > 0 else None)
            if k + 1 < len(self.up_blocks):
                x = up[1](ln2d(x))
        return self.clf[1](ln2d(x))


# --------------------------------------------------------------------------- #
# MMDiT-X
# --------------------------------------------------------------------------- #

class RMS(nn.Module):
    def __init__(self, d, device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d, device=device))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class MAttn(nn.Module):
    def __init__(self, dim, heads, kv_heads, pre_only, device):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * self.hd, device=device)
        if not pre_only:
            self.proj = nn.Linear(dim, dim, device=device)
        self.ln_q = RMS(self.hd, device)
        self.ln_k = RMS(self.hd, device)

    def pre(self, x):
        b, l, _ = x.shape
        y = self.qkv(x).view(b, l, self.heads + 2 * self.kv_heads, self.hd)
        q, k, v = y.split([self.heads, self.kv_heads, self.kv_heads], dim=2)
        return self.ln_q(q), self.ln_k(k), v


def attention(q, k, v):
    """q [B, L, H, D], k/v [B, S, G, D]: repeat kv heads, then softmax(q k^T / sqrt(D)) v."""
    rep = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(rep, dim=2)
    v = v.repeat_interleave(rep, dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    w = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1)
    o = (w @ v).transpose(1, 2)
    return o.reshape(o.shape[0], o.shape[1], -1)


class Mlp(nn.Module):
    def __init__(self, d, h, device):
        super().__init__()
        self.fc1 = nn.Linear(d, h, device=device)
        self.fc2 = nn.Linear(h, d, device=device)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Stream(nn.Module):
    def __init__(self, dim, heads, kv_heads, pre_only, attn2, device):
        super().__init__()
        self.pre_only, self.has_attn2 = pre_only, attn2
        self.attn = MAttn(dim, heads, kv_heads, pre_only, device)
        if attn2:
            self.attn2 = MAttn(dim, heads, kv_heads, False, device)
        if not pre_only:
            self.mlp = Mlp(dim, 4 * dim, device)
        n = 9 if attn2 else (2 if pre_only else 6)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, n * dim, device=device))


class Joint(nn.Module):
    def __init__(self, dim, heads, kv_heads, last, attn2, device):
        super().__init__()
        self.context_block = Stream(dim, heads, kv_heads, last, False, device)
        self.x_block = Stream(dim, heads, kv_heads, False, attn2, device)


def mod(x, shift, scale):
    return x * (1 + scale[:, None]) + shift[:, None]


def lnorm(x):
    return F.layer_norm(x, (x.shape[-1],), eps=1e-6)


class MMDiTRef(nn.Module):
    def __init__(self, depth=24, hidden=None, heads=None, kv_heads=None, in_ch=16, patch=2, adm=2048, ctx=4096,
                 max_size=384, attn2_layers=tuple(range(13)), device="cpu"):
        super().__init__()
        hidden = hidden or 64 * depth
        heads = heads or depth
        kv_heads = kv_heads or heads
        self.p, self.c, self.max_size, self.hidden = patch, in_ch, max_size, hidden
        self.x_embedder = nn.Module()
        self.x_embedder.proj = nn.Conv2d(in_ch, hidden, patch, stride=patch, device=device)
        self.t_embedder = nn.Module()
        self.t_embedder.mlp = nn.Sequential(nn.Linear(256, hidden, device=device), nn.SiLU(),
                                            nn.Linear(hidden, hidden, device=device))
        self.y_embedder = nn.Module()
        self.y_embedder.mlp = nn.Sequential(nn.Linear(adm, hidden, device=device), nn.SiLU(),
                                            nn.Linear(hidden, hidden, device=device))
        self.context_embedder = nn.Linear(ctx, hidden, device=device)
        self.register_buffer("pos_embed", torch.zeros(1, max_size * max_size, hidden, device=device))
        self.joint_blocks = nn.ModuleList(
            [Joint(hidden, heads, kv_heads, i == depth - 1, i in attn2_layers, device) for i in range(depth)])
        self.final_layer = nn.Module()
        self.final_layer.linear = nn.Linear(hidden, patch * patch * in_ch, device=device)
        self.final_layer.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 2 * hidden, device=device))

    def forward(self, x, t, context, y):
        b, _, H, W = x.shape
        h, w = H // self.p, W // self.p
        top, left = (self.max_size - h) // 2, (self.max_size - w) // 2
        pe = self.pos_embed.view(1, self.max_size, self.max_size, -1)[:, top:top + h, left:left + w].reshape(1, h * w, -1)
        x = self.x_embedder.proj(x).flatten(2).transpose(1, 2) + pe
        half = 128
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32) / half)
        args = (t * 1000)[:, None] * freqs[None]
        c = self.t_embedder.mlp(torch.cat([args.cos(), args.sin()], -1)) + self.y_embedder.mlp(y)
        ctx = self.context_embedder(context)
        for blk in self.joint_blocks:
            cb, xb = blk.context_block, blk.x_block
            cm = cb.adaLN_modulation(c).chunk(2 if cb.pre_only else 6, 1)
            xm = xb.adaLN_modulation(c).chunk(9 if xb.has_attn2 else 6, 1)
            cq, ck, cv = cb.attn.pre(mod(lnorm(ctx), cm[0], cm[1]))
            xn = lnorm(x)
            xq, xk, xv = xb.attn.pre(mod(xn, xm[0], xm[1]))
            a = attention(torch.cat([cq, xq], 1), torch.cat([ck, xk], 1), torch.cat([cv, xv], 1))
            lc = ctx.shape[1]
            if not cb.pre_only:
                ctx = ctx + cm[2][:, None] * cb.attn.proj(a[:, :lc])
                ctx = ctx + cm[5][:, None] * cb.mlp(mod(lnorm(ctx), cm[3], cm[4]))
            x = x + xm[2][:, None] * xb.attn.proj(a[:, lc:])
            if xb.has_attn2:
                q2, k2, v2 = xb.attn2.pre(mod(xn, xm[6], xm[7]))
                x = x + xm[8][:, None] * xb.attn2.proj(attention(q2, k2, v2))
            x = x + xm[5][:, None] * xb.mlp(mod(lnorm(x), xm[3], xm[4]))
        shift, scale = self.final_layer.adaLN_modulation(c).chunk(2, 1)
        x = self.final_layer.linear(mod(lnorm(x), shift, scale))
        p, C = self.p, self.c
        x = x.reshape(b, h, w, p, p, C)
        return torch.einsum("nhwpqc->nchpwq", x).reshape(b, C, h * p, w * p)


# --------------------------------------------------------------------------- #
# Output
# --------------------------------------------------------------------------- #

def write_keys(name, module):
    os.makedirs(OUT_DIR, exist_ok=True)
    lines = [f"{k} {','.join(str(d) for d in v.shape)}" for k, v in module.state_dict().items()]
    total = sum(v.numel() for v in module.state_dict().values())
    params = sum(p.numel() for p in module.parameters())
    with open(os.path.join(OUT_DIR, name + ".keys.txt"), "w") as f:
        f.write(f"# {name}: {len(lines)} tensors, {total} elements, {params} in parameters; "
                f"generated by scripts/gen_dit_reference.py\n")
        f.write("\n".join(lines) + "\n")
    print(name, len(lines), "tensors", total, "elements", params, "parameters")


def write_case(name, tensors):
    nbytes = reference_data.write_case(OUT_DIR, name, tensors, "scripts/gen_dit_reference.py")
    print(name, nbytes, "bytes")


def randomize(module):
    with torch.no_grad():
        for k, p in module.named_parameters():
            if k.endswith("ln_q.weight") or k.endswith("ln_k.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif k.endswith("gamma") or k.endswith("beta"):
                p.copy_(0.3 * torch.randn_like(p))
            elif p.dim() >= 2:
                p.copy_(torch.randn_like(p) / math.sqrt(p[0].numel()))
            else:
                p.copy_(0.1 * torch.randn_like(p))


def sincos_2d(dim, grid):
    def one(d, pos):
        omega = torch.arange(d // 2, dtype=torch.float64) / (d / 2.0)
        omega = 1.0 / 10000 ** omega
        out = pos.reshape(-1).double()[:, None] * omega[None]
        return torch.cat([out.sin(), out.cos()], 1)
    rows, cols = torch.meshgrid(torch.arange(grid), torch.arange(grid), indexing="ij")
    return torch.cat([one(dim // 2, cols), one(dim // 2, rows)], 1).float()


def main():
    torch.manual_seed(0)
    write_keys("cascade-c", StageCRef(device="meta"))
    write_keys("cascade-c-lite", StageCRef(c_cond=1536, c_hidden=(1536, 1536), nhead=(24, 24),
                                           blocks=((4, 12), (12, 4)), device="meta"))
    write_keys("sd35m", MMDiTRef(device="meta"))

    # Small stage C: StageCOptions in tests/models/test_cascade.cpp must match.
    torch.manual_seed(1)
    m = StageCRef(c_in=16, c_out=16, c_r=16, c_cond=24, c_hidden=(16, 24), nhead=(2, 3), blocks=((1, 2), (2, 1)),
                  c_clip_text=20, c_clip_text_pooled=12, c_clip_img=10, c_clip_seq=2).eval()
    randomize(m)
    inputs = {"x": torch.randn(2, 16, 6, 5), "r": torch.rand(2), "clip_text": torch.randn(2, 7, 20),
              "clip_text_pooled": torch.randn(2, 1, 12), "clip_img": torch.randn(2, 1, 10), "sca": torch.rand(2)}
    with torch.no_grad():
        out = m(inputs["x"], inputs["r"], inputs["clip_text"], inputs["clip_text_pooled"], inputs["clip_img"],
                (inputs["sca"],))
    case = {"param." + k: v for k, v in m.named_parameters()}
    case.update({"input." + k: v for k, v in inputs.items()})
    case["output"] = out
    write_case("cascade_small", case)

    # Small MMDiT-X, plain MHA and grouped-query (4 query heads, 2 kv heads);
    # MMDiTOptions in tests/models/test_mmdit.cpp must match.
    for name, kv in (("mmdit_small", None), ("mmdit_small_gqa", 2)):
        torch.manual_seed(2)
        m = MMDiTRef(depth=3, hidden=32, heads=4, kv_heads=kv, in_ch=4, patch=2, adm=10, ctx=12, max_size=6,
                     attn2_layers=(0, 2)).eval()
        randomize(m)
        with torch.no_grad():
            m.pos_embed.copy_(sincos_2d(32, 6)[None])
        inputs = {"x": torch.randn(2, 4, 8, 6), "t": torch.rand(2), "context": torch.randn(2, 5, 12),
                  "y": torch.randn(2, 10)}
        with torch.no_grad():
            out = m(inputs["x"], inputs["t"], inputs["context"], inputs["y"])
        case = {"param." + k: v for k, v in m.named_parameters()}
        case["buffer.pos_embed"] = m.pos_embed
        case.update({"input." + k: v for k, v in inputs.items()})
        case["output"] = out
        write_case(name, case)


if __name__ == "__main__":
    main()
