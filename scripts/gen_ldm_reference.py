#!/usr/bin/env python3
"""Reference vectors for shoestring's LDM UNet and VAE (models/unet_ldm.h, models/vae.h).

Writes tests/data/nn/ldm_unet_micro.{bin,json}, tests/data/nn/ldm_vae_micro.{bin,json} and
tests/data/nn/ldm_vae_sd3_micro.{bin,json} (the SD3 / SD3.5 VAE: z 16, no quant convs) in the
format of scripts/gen_nn_reference.py ("param.<LDM key>", "input.<name>", "output").

The networks are written here in functional form with torch.nn.functional, following the public
CompVis / Stability definitions (ldm/modules/diffusionmodules/openaimodel.py UNetModel, ResBlock,
Downsample, Upsample; ldm/modules/attention.py SpatialTransformer with use_linear, GEGLU FeedForward;
ldm/modules/diffusionmodules/model.py Encoder, Decoder, ResnetBlock, AttnBlock, Downsample with
asymmetric padding; ldm/models/autoencoder.py quant_conv / post_quant_conv), independently of the
C++ code. Micro sizes keep the files small; the structure is SDXL's (label_emb, linear projections,
transformer depth 2) and the SD / SD3 VAEs'.

Usage: /usr/bin/python3 scripts/gen_ldm_reference.py   (from the repository root)
"""
import json
import math
import os

import torch
import torch.nn.functional as F

import reference_data  # scripts/reference_data.py

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "nn")
GROUPS = 4


def write_case(name, tensors):
    reference_data.write_case(OUT_DIR, name, tensors, "scripts/gen_ldm_reference.py")


class Params(dict):
    """Creates parameters on first use (random), so the forward code defines the key set."""

    def w(self, key, *shape, scale=None):
        if key not in self:
            fan_in = math.prod(shape[1:]) if len(shape) > 1 else shape[0]
            self[key] = torch.randn(*shape) * (scale if scale is not None else 0.6 / math.sqrt(fan_in))
        return self[key]

    def norm(self, key, c):
        if key + ".weight" not in self:
            self[key + ".weight"] = 1 + 0.1 * torch.randn(c)
            self[key + ".bias"] = 0.1 * torch.randn(c)
        return self[key + ".weight"], self[key + ".bias"]


def linear(p, key, x, cin, cout, bias=True):
    return F.linear(x, p.w(key + ".weight", cout, cin), p.w(key + ".bias", cout, scale=0.1) if bias else None)


def conv(p, key, x, cin, cout, k, stride=1, padding=0):
    return F.conv2d(x, p.w(key + ".weight", cout, cin, k, k), p.w(key + ".bias", cout, scale=0.1), stride, padding)


def gn(p, key, x, eps):
    c = x.shape[1]
    w, b = p.norm(key, c)
    return F.group_norm(x, GROUPS, w, b, eps)


def ln(p, key, x):
    w, b = p.norm(key, x.shape[-1])
    return F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)


# ---- UNet (openaimodel.py) ----------------------------------------------------

def resblock(p, key, x, emb, cout):
    cin, temb = x.shape[1], emb.shape[1]
    h = conv(p, key + ".in_layers.2", F.silu(gn(p, key + ".in_layers.0", x, 1e-5)), cin, cout, 3, 1, 1)
    h = h + linear(p, key + ".emb_layers.1", F.silu(emb), temb, cout)[:, :, None, None]
    h = conv(p, key + ".out_layers.3", F.silu(gn(p, key + ".out_layers.0", h, 1e-5)), cout, cout, 3, 1, 1)
    skip = x if cin == cout else conv(p, key + ".skip_connection", x, cin, cout, 1)
    return skip + h


def attention(p, key, x, ctx, heads, d):
    b, lq, c = x.shape
    ctx = x if ctx is None else ctx
    lk, cc = ctx.shape[1], ctx.shape[2]
    q = linear(p, key + ".to_q", x, c, heads * d, bias=False).view(b, lq, heads, d).transpose(1, 2)
    k = linear(p, key + ".to_k", ctx, cc, heads * d, bias=False).view(b, lk, heads, d).transpose(1, 2)
    v = linear(p, key + ".to_v", ctx, cc, heads * d, bias=False).view(b, lk, heads, d).transpose(1, 2)
    w = (q @ k.transpose(-1, -2) / math.sqrt(d)).softmax(-1)
    o = (w @ v).transpose(1, 2).reshape(b, lq, heads * d)
    return linear(p, key + ".to_out.0", o, heads * d, c)


def spatial_transformer(p, key, x, ctx, heads, d, depth):
    b, c, hh, ww = x.shape
    h = gn(p, key + ".norm", x, 1e-6).flatten(2).transpose(1, 2)
    h = linear(p, key + ".proj_in", h, c, c)
    for i in range(depth):
        bk = f"{key}.transformer_blocks.{i}"
        h = h + attention(p, bk + ".attn1", ln(p, bk + ".norm1", h), None, heads, d)
        h = h + attention(p, bk + ".attn2", ln(p, bk + ".norm2", h), ctx, heads, d)
        a, gate = linear(p, bk + ".ff.net.0.proj", ln(p, bk + ".norm3", h), c, 8 * c).chunk(2, dim=-1)
        h = h + linear(p, bk + ".ff.net.2", a * F.gelu(gate), 4 * c, c)
    h = linear(p, key + ".proj_out", h, c, c)
    return x + h.transpose(1, 2).reshape(b, c, hh, ww)


def timestep_embedding(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def unet(p, x, t, ctx, y, mc, mult, depth_in, depth_out, depth_mid, head_ch):
    temb = 4 * mc
    emb = linear(p, "time_embed.2", F.silu(linear(p, "time_embed.0", timestep_embedding(t, mc), mc, temb)), temb, temb)
    lab = linear(p, "label_emb.0.0", y, y.shape[1], temb)
    emb = emb + linear(p, "label_emb.0.2", F.silu(lab), temb, temb)
    h = conv(p, "input_blocks.0.0", x, x.shape[1], mc, 3, 1, 1)
    hs, n = [h], 1
    for level, m in enumerate(mult):
        h = resblock(p, f"input_blocks.{n}.0", h, emb, mc * m)
        if depth_in[level]:
            c = mc * m
            h = spatial_transformer(p, f"input_blocks.{n}.1", h, ctx, c // head_ch, head_ch, depth_in[level])
        hs.append(h)
        n += 1
        if level != len(mult) - 1:
            h = conv(p, f"input_blocks.{n}.0.op", h, h.shape[1], h.shape[1], 3, 2, 1)
            hs.append(h)
            n += 1
    c = h.shape[1]
    h = resblock(p, "middle_block.0", h, emb, c)
    h = spatial_transformer(p, "middle_block.1", h, ctx, c // head_ch, head_ch, depth_mid)
    h = resblock(p, "middle_block.2", h, emb, c)
    n = 0
    for level in reversed(range(len(mult))):
        for i in range(2):  # num_res_blocks 1 -> two output blocks per level
            h = resblock(p, f"output_blocks.{n}.0", torch.cat([h, hs.pop()], 1), emb, mc * mult[level])
            j = 1
            if depth_out[n]:
                c = h.shape[1]
                h = spatial_transformer(p, f"output_blocks.{n}.1", h, ctx, c // head_ch, head_ch, depth_out[n])
                j = 2
            if level and i == 1:
                h = F.interpolate(h, scale_factor=2.0, mode="nearest")
                h = conv(p, f"output_blocks.{n}.{j}.conv", h, h.shape[1], h.shape[1], 3, 1, 1)
            n += 1
    return conv(p, "out.2", F.silu(gn(p, "out.0", h, 1e-5)), h.shape[1], x.shape[1], 3, 1, 1)


def unet_case():
    torch.manual_seed(11)
    p = Params()
    x = torch.randn(2, 4, 8, 8)
    t = torch.tensor([3.0, 741.0])
    ctx = torch.randn(2, 5, 6)
    y = torch.randn(2, 5)
    out = unet(p, x, t, ctx, y, mc=8, mult=[1, 2], depth_in=[0, 2], depth_out=[2, 2, 0, 0], depth_mid=1, head_ch=8)
    write_case("ldm_unet_micro", {**{"param." + k: v for k, v in p.items()},
                                  "input.x": x, "input.t": t, "input.context": ctx, "input.y": y, "output": out})


# ---- VAE (model.py, autoencoder.py) ---------------------------------------------

def vae_resblock(p, key, x, cout):
    cin = x.shape[1]
    h = conv(p, key + ".conv1", F.silu(gn(p, key + ".norm1", x, 1e-6)), cin, cout, 3, 1, 1)
    h = conv(p, key + ".conv2", F.silu(gn(p, key + ".norm2", h, 1e-6)), cout, cout, 3, 1, 1)
    skip = x if cin == cout else conv(p, key + ".nin_shortcut", x, cin, cout, 1)
    return skip + h


def vae_attn(p, key, x):
    b, c, hh, ww = x.shape
    h = gn(p, key + ".norm", x, 1e-6)
    q = conv(p, key + ".q", h, c, c, 1).reshape(b, c, hh * ww).permute(0, 2, 1)
    k = conv(p, key + ".k", h, c, c, 1).reshape(b, c, hh * ww)
    v = conv(p, key + ".v", h, c, c, 1).reshape(b, c, hh * ww)
    w = (torch.bmm(q, k) * c ** -0.5).softmax(dim=2)
    o = torch.bmm(v, w.permute(0, 2, 1)).reshape(b, c, hh, ww)
    return x + conv(p, key + ".proj_out", o, c, c, 1)


def vae_mid(p, key, h):
    c = h.shape[1]
    return vae_resblock(p, key + ".block_2", vae_attn(p, key + ".attn_1", vae_resblock(p, key + ".block_1", h, c)), c)


def vae_encode(p, img, ch, mult, num_res_blocks, z, quant):
    """Encoder (+ quant_conv when quant) -> (mean, logvar clamped as DiagonalGaussianDistribution)."""
    h = conv(p, "encoder.conv_in", img, 3, ch, 3, 1, 1)
    for level, m in enumerate(mult):
        for i in range(num_res_blocks):
            h = vae_resblock(p, f"encoder.down.{level}.block.{i}", h, ch * m)
        if level != len(mult) - 1:
            h = conv(p, f"encoder.down.{level}.downsample.conv", F.pad(h, (0, 1, 0, 1)), h.shape[1], h.shape[1], 3, 2, 0)
    h = vae_mid(p, "encoder.mid", h)
    h = conv(p, "encoder.conv_out", F.silu(gn(p, "encoder.norm_out", h, 1e-6)), h.shape[1], 2 * z, 3, 1, 1)
    if quant:
        h = conv(p, "quant_conv", h, 2 * z, 2 * z, 1)
    mean, logvar = h.chunk(2, dim=1)
    return mean, logvar.clamp(-30.0, 20.0)


def vae_decode(p, z_in, ch, mult, num_res_blocks, quant):
    """(post_quant_conv when quant +) decoder: unscaled latent -> image."""
    z = z_in.shape[1]
    h = conv(p, "post_quant_conv", z_in, z, z, 1) if quant else z_in
    h = conv(p, "decoder.conv_in", h, z, ch * mult[-1], 3, 1, 1)
    h = vae_mid(p, "decoder.mid", h)
    for level in reversed(range(len(mult))):
        for i in range(num_res_blocks + 1):
            h = vae_resblock(p, f"decoder.up.{level}.block.{i}", h, ch * mult[level])
        if level != 0:
            h = F.interpolate(h, scale_factor=2.0, mode="nearest")
            h = conv(p, f"decoder.up.{level}.upsample.conv", h, h.shape[1], h.shape[1], 3, 1, 1)
    return conv(p, "decoder.conv_out", F.silu(gn(p, "decoder.norm_out", h, 1e-6)), h.shape[1], 3, 3, 1, 1)


def vae_case():
    torch.manual_seed(12)
    p = Params()
    ch, mult, z = 8, [1, 2], 4
    img = torch.rand(2, 3, 8, 8) * 2 - 1
    mean, logvar = vae_encode(p, img, ch, mult, 1, z, quant=True)
    rec = vae_decode(p, mean, ch, mult, 1, quant=True)
    write_case("ldm_vae_micro", {**{"param." + k: v for k, v in p.items()}, "input.image": img,
                                 "output.mean": mean, "output.logvar": logvar, "output.decoded": rec})


# SD3 / SD3.5 VAE (Stability-AI/sd3.5 sd3_impls.py SDVAE, SD3LatentFormat; diffusers vae/config.json
# of stable-diffusion-3.5-medium): the same encoder/decoder with 16 latent channels, no quant_conv /
# post_quant_conv, and latents (z - shift) * scale for the MMDiT, z / scale + shift for the decoder.
SD3_SCALE, SD3_SHIFT = 1.5305, 0.0609


def vae_sd3_case():
    torch.manual_seed(13)
    p = Params()
    ch, mult, nrb, z = 8, [1, 2, 2], 2, 16
    img = torch.rand(2, 3, 16, 12) * 2 - 1
    mean, logvar = vae_encode(p, img, ch, mult, nrb, z, quant=False)
    rec = vae_decode(p, mean, ch, mult, nrb, quant=False)
    latent = (mean - SD3_SHIFT) * SD3_SCALE                   # SD3LatentFormat.process_in
    noisy = latent + 0.5 * torch.randn(latent.shape)          # a latent the MMDiT could produce
    rec_noisy = vae_decode(p, noisy / SD3_SCALE + SD3_SHIFT, ch, mult, nrb, quant=False)  # process_out
    write_case("ldm_vae_sd3_micro", {**{"param." + k: v for k, v in p.items()}, "input.image": img,
                                     "input.latent": noisy, "output.mean": mean, "output.logvar": logvar,
                                     "output.decoded": rec, "output.latent": latent,
                                     "output.latent_decoded": rec_noisy})


if __name__ == "__main__":
    unet_case()
    vae_case()
    vae_sd3_case()
