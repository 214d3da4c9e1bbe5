#!/usr/bin/python3
"""The PyTorch eager peer of build/bench/model_step: one training step of the same denoiser, written
the way diffusers and kohya sd-scripts write it, for bench/peer_step.py to time side by side.

Architectures (random weights; the parameter counts equal shoestring's, printed as "parameters"):
  sd15, sdxl  the CompVis / Stability LDM UNet (ldm/modules/diffusionmodules/openaimodel.py UNetModel,
              ldm/modules/attention.py SpatialTransformer, BasicTransformerBlock with GEGLU), as in
              scripts/gen_ldm_reference.py but as an nn.Module tree at real width; --tiny gives the
              widths of shoestring's LdmUNetOptions::tiny() (32 channels, 2 heads, context 64).
  tiny-unet   the UNet of the emoji example (shoestring's models/tiny_unet.h layout) from the widths
              given on the command line; pixel input, caption states as cached input.

The step: inputs drawn once (latent/pixels x, timesteps, text states, SDXL's y), forward, MSE between
the fp32 output and x (the target bench/model_step uses), backward, optimizer update.
  * gradient checkpointing (default on): torch.utils.checkpoint around every ResBlock and every
    BasicTransformerBlock (tiny-unet: every ResBlock and SpatialTransformer), as kohya's
    sdxl_original_unet and Stability's generative-models do it;
  * Adafactor: transformers.optimization.Adafactor's update rule (factored second moment over the
    last two dimensions, beta2_t = 1 - step^-0.8, eps (1e-30, 1e-3), update clipping at RMS 1,
    the parameter RMS kept in the state), with relative_step=False, scale_parameter=False,
    warmup_init=False and a fixed lr, re-implemented here (transformers is not installed);
  * AdamW: torch.optim.AdamW (lr 1e-5, weight decay 0.01, betas (0.9, 0.999)); in bf16 the same
    update computed in fp32 per parameter;
  * bf16 (default; --fp32 for fp32): weights, activations and gradients bf16 (kohya's full_bf16),
    the optimizer computes in fp32 and writes the weight back with stochastic rounding
    (kohya's / torchastic's copy_stochastic_: add 16 random low bits, truncate);
  * fused (default; --no-fused for backward-then-step): the optimizer step of each parameter runs
    inside backward as soon as its gradient is accumulated, and the gradient is dropped (kohya's
    fused_backward_pass / Adafactor patch). torch 1.13 has no register_post_accumulate_grad_hook, so the
    hook goes on the parameter's AccumulateGrad node (the pre-2.1 idiom of DDP and Horovod).

Prints one JSON object: arch, parameters, step_seconds (every step), loss, threads, peak_rss_bytes.

Usage: /usr/bin/python3 bench/peer_torch.py --arch sd15 --resolution 256 --optimizer Adafactor --fp32
"""
import argparse
import json
import math
import os
import resource
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

LR = 1e-5


def norm_groups(channels, max_groups=32):
    """The largest group count <= max_groups that divides channels (shoestring nn::norm_groups)."""
    g = min(max_groups, channels)
    while channels % g:
        g -= 1
    return g


def timestep_embedding(t, dim):
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class Checkpointed(nn.Module):
    """Runs `forward` under torch.utils.checkpoint while training with checkpointing on."""

    checkpointing = False

    def __call__(self, *args):
        if Checkpointed.checkpointing and self.__dict__.get("ckpt", True) and self.training and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(super().__call__, *args)
        return super().__call__(*args)


class ResBlock(Checkpointed):
    """openaimodel.ResBlock (in_layers, emb_layers, out_layers, skip_connection); scale_shift as ADM."""

    def __init__(self, cin, cout, temb, groups=32, scale_shift=False):
        super().__init__()
        self.norm1 = nn.GroupNorm(norm_groups(cin, groups), cin, eps=1e-5)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.time_emb_proj = nn.Linear(temb, cout * (2 if scale_shift else 1))
        self.norm2 = nn.GroupNorm(norm_groups(cout, groups), cout, eps=1e-5)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else None
        self.scale_shift = scale_shift

    def forward(self, x, emb):
        h = self.conv1(F.silu(self.norm1(x)))
        e = self.time_emb_proj(F.silu(emb))[:, :, None, None]
        if self.scale_shift:
            scale, shift = e.chunk(2, dim=1)
            h = F.silu(self.norm2(h) * (1 + scale) + shift)
        else:
            h = F.silu(self.norm2(h + e))
        h = self.conv2(h)
        return (x if self.skip is None else self.skip(x)) + h


class CrossAttention(nn.Module):
    """ldm.modules.attention.CrossAttention; scores as diffusers' AttnProcessor (baddbmm, softmax, bmm)."""

    def __init__(self, qdim, cdim, heads, head_dim):
        super().__init__()
        inner = heads * head_dim
        self.heads, self.scale = heads, head_dim ** -0.5
        self.to_q = nn.Linear(qdim, inner, bias=False)
        self.to_k = nn.Linear(cdim, inner, bias=False)
        self.to_v = nn.Linear(cdim, inner, bias=False)
        self.to_out = nn.Linear(inner, qdim)

    def forward(self, x, ctx=None):
        ctx = x if ctx is None else ctx
        b, lq, _ = x.shape
        h = self.heads

        def split(t):
            return t.reshape(b, t.shape[1], h, -1).permute(0, 2, 1, 3).reshape(b * h, t.shape[1], -1)

        q, k, v = split(self.to_q(x)), split(self.to_k(ctx)), split(self.to_v(ctx))
        scores = torch.baddbmm(torch.empty(q.shape[0], lq, k.shape[1], dtype=q.dtype), q, k.transpose(-1, -2),
                               beta=0, alpha=self.scale)
        o = torch.bmm(scores.softmax(dim=-1), v)
        o = o.reshape(b, h, lq, -1).permute(0, 2, 1, 3).reshape(b, lq, -1)
        return self.to_out(o)


class GEGLUFeedForward(nn.Module):
    def __init__(self, dim, mult=4):
        super().__init__()
        self.proj = nn.Linear(dim, dim * mult * 2)
        self.out = nn.Linear(dim * mult, dim)

    def forward(self, x):
        a, gate = self.proj(x).chunk(2, dim=-1)
        return self.out(a * F.gelu(gate))


class BasicTransformerBlock(Checkpointed):
    def __init__(self, dim, heads, head_dim, cdim):
        super().__init__()
        self.norm1, self.attn1 = nn.LayerNorm(dim), CrossAttention(dim, dim, heads, head_dim)
        self.norm2, self.attn2 = nn.LayerNorm(dim), CrossAttention(dim, cdim, heads, head_dim)
        self.norm3, self.ff = nn.LayerNorm(dim), GEGLUFeedForward(dim)

    def forward(self, x, ctx):
        x = x + self.attn1(self.norm1(x))
        x = x + self.attn2(self.norm2(x), ctx)
        return x + self.ff(self.norm3(x))


class SpatialTransformer(nn.Module):
    def __init__(self, ch, heads, head_dim, cdim, depth=1, linear_proj=False, groups=32):
        super().__init__()
        self.norm = nn.GroupNorm(norm_groups(ch, groups), ch, eps=1e-6)
        self.linear_proj = linear_proj
        self.proj_in = nn.Linear(ch, ch) if linear_proj else nn.Conv2d(ch, ch, 1)
        self.blocks = nn.ModuleList([BasicTransformerBlock(ch, heads, head_dim, cdim) for _ in range(depth)])
        self.proj_out = nn.Linear(ch, ch) if linear_proj else nn.Conv2d(ch, ch, 1)

    def forward(self, x, ctx):
        b, c, hh, ww = x.shape
        h = self.norm(x)
        if self.linear_proj:
            h = self.proj_in(h.flatten(2).transpose(1, 2))
        else:
            h = self.proj_in(h).flatten(2).transpose(1, 2)
        for blk in self.blocks:
            h = blk(h, ctx)
        if self.linear_proj:
            h = self.proj_out(h).transpose(1, 2).reshape(b, c, hh, ww)
        else:
            h = self.proj_out(h.transpose(1, 2).reshape(b, c, hh, ww))
        return x + h


class CheckpointedSpatialTransformer(Checkpointed, SpatialTransformer):
    """tiny-unet: the whole SpatialTransformer is one checkpointed block (its layers are not)."""

    def __init__(self, *args):
        super().__init__(*args)
        for blk in self.blocks:
            blk.ckpt = False


class Downsample(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.op = nn.Conv2d(ch, ch, 3, stride=2, padding=1)

    def forward(self, x):
        return self.op(x)


class Upsample(nn.Module):
    def __init__(self, ch):
        super().__init__()
        self.conv = nn.Conv2d(ch, ch, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


LDM_PRESETS = {
    # CompVis v1-inference.yaml / Stability sd_xl_base.yaml, as shoestring's LdmUNetOptions::sd15 / sdxl.
    "sd15": dict(mc=320, mult=[1, 2, 4, 4], depth_in=[1, 1, 1, 1, 1, 1, 0, 0],
                 depth_out=[0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1], depth_mid=1, num_heads=8, head_ch=-1,
                 ctx=768, adm=0, linear=False, tokens=77),
    "sdxl": dict(mc=320, mult=[1, 2, 4], depth_in=[0, 0, 2, 2, 10, 10], depth_out=[10, 10, 10, 2, 2, 2, 0, 0, 0],
                 depth_mid=10, num_heads=-1, head_ch=64, ctx=2048, adm=2816, linear=True, tokens=77),
}


def ldm_preset(arch, tiny):
    p = dict(LDM_PRESETS[arch])
    if tiny:  # LdmUNetOptions::tiny()
        p.update(mc=32, num_heads=2, head_ch=-1, ctx=64, adm=64 if p["adm"] else 0)
    return p


class LdmUNet(nn.Module):
    """openaimodel.UNetModel with num_res_blocks 2 (input_blocks, middle_block, output_blocks, out)."""

    def __init__(self, mc, mult, depth_in, depth_out, depth_mid, num_heads, head_ch, ctx, adm, linear, tokens):
        super().__init__()
        self.mc, temb, nrb = mc, 4 * mc, 2

        def st(ch, depth):
            heads = num_heads if head_ch == -1 else ch // head_ch
            return SpatialTransformer(ch, heads, ch // heads, ctx, depth, linear)

        self.time_embed = nn.Sequential(nn.Linear(mc, temb), nn.SiLU(), nn.Linear(temb, temb))
        self.label_emb = nn.Sequential(nn.Linear(adm, temb), nn.SiLU(), nn.Linear(temb, temb)) if adm else None
        self.input_blocks = nn.ModuleList([nn.ModuleList([nn.Conv2d(4, mc, 3, padding=1)])])
        chans, ch, k = [mc], mc, 0
        for level, m in enumerate(mult):
            for _ in range(nrb):
                layers = [ResBlock(ch, mc * m, temb)]
                ch = mc * m
                if depth_in[k]:
                    layers.append(st(ch, depth_in[k]))
                k += 1
                self.input_blocks.append(nn.ModuleList(layers))
                chans.append(ch)
            if level != len(mult) - 1:
                self.input_blocks.append(nn.ModuleList([Downsample(ch)]))
                chans.append(ch)
        self.middle_block = nn.ModuleList([ResBlock(ch, ch, temb), st(ch, depth_mid), ResBlock(ch, ch, temb)])
        self.output_blocks = nn.ModuleList()
        k = 0
        for level in reversed(range(len(mult))):
            for i in range(nrb + 1):
                layers = [ResBlock(ch + chans.pop(), mc * mult[level], temb)]
                ch = mc * mult[level]
                if depth_out[k]:
                    layers.append(st(ch, depth_out[k]))
                if level and i == nrb:
                    layers.append(Upsample(ch))
                k += 1
                self.output_blocks.append(nn.ModuleList(layers))
        self.out = nn.Sequential(nn.GroupNorm(32, ch), nn.SiLU(), nn.Conv2d(ch, 4, 3, padding=1))

    @staticmethod
    def run(layers, h, emb, ctx):
        for layer in layers:
            if isinstance(layer, ResBlock):
                h = layer(h, emb)
            elif isinstance(layer, SpatialTransformer):
                h = layer(h, ctx)
            else:
                h = layer(h)
        return h

    def forward(self, x, t, ctx, y=None):
        emb = self.time_embed(timestep_embedding(t, self.mc).to(x.dtype))
        if self.label_emb is not None:
            emb = emb + self.label_emb(y)
        hs, h = [], x
        for layers in self.input_blocks:
            h = self.run(layers, h, emb, ctx)
            hs.append(h)
        h = self.run(self.middle_block, h, emb, ctx)
        for layers in self.output_blocks:
            h = self.run(layers, torch.cat([h, hs.pop()], dim=1), emb, ctx)
        return self.out(h)


class TinyUNet(nn.Module):
    """shoestring's models::TinyUNet (time_embed, text_embed, conv_in, down, mid, up, norm_out, conv_out)."""

    def __init__(self, base, mult, num_res_blocks, attention_levels, num_heads, context_dim, groups=32,
                 pooled_context=True, scale_shift_norm=True, in_channels=3):
        super().__init__()
        temb = 4 * base
        self.base, self.pooled = base, pooled_context

        def res(cin, cout):
            return ResBlock(cin, cout, temb, groups, scale_shift_norm)

        def st(ch):
            return CheckpointedSpatialTransformer(ch, num_heads, ch // num_heads, context_dim, 1, False, groups)

        self.time_embed = nn.Sequential(nn.Linear(base, temb), nn.SiLU(), nn.Linear(temb, temb))
        self.text_embed = nn.Linear(context_dim, temb) if pooled_context else None
        self.conv_in = nn.Conv2d(in_channels, base, 3, padding=1)
        skips, ch = [base], base
        self.down = nn.ModuleList()
        for level, m in enumerate(mult):
            lv = nn.Module()
            lv.res, lv.attn = nn.ModuleList(), nn.ModuleList()
            for _ in range(num_res_blocks):
                lv.res.append(res(ch, base * m))
                ch = base * m
                if level in attention_levels:
                    lv.attn.append(st(ch))
                skips.append(ch)
            lv.downsample = nn.Conv2d(ch, ch, 3, stride=2, padding=1) if level + 1 < len(mult) else None
            if lv.downsample is not None:
                skips.append(ch)
            self.down.append(lv)
        self.mid = nn.ModuleList([res(ch, ch), st(ch), res(ch, ch)])
        ups = [None] * len(mult)
        for level in reversed(range(len(mult))):
            lv = nn.Module()
            lv.res, lv.attn = nn.ModuleList(), nn.ModuleList()
            for _ in range(num_res_blocks + 1):
                lv.res.append(res(ch + skips.pop(), base * mult[level]))
                ch = base * mult[level]
                if level in attention_levels:
                    lv.attn.append(st(ch))
            lv.upsample = nn.Conv2d(ch, ch, 3, padding=1) if level > 0 else None
            ups[level] = lv
        self.up = nn.ModuleList(ups)
        self.norm_out = nn.GroupNorm(norm_groups(ch, groups), ch, eps=1e-5)
        self.conv_out = nn.Conv2d(ch, in_channels, 3, padding=1)

    def forward(self, x, t, ctx, y=None):
        emb = self.time_embed(timestep_embedding(t * 1000.0, self.base).to(x.dtype))
        if self.pooled:
            emb = emb + self.text_embed(ctx.mean(1))
        h = self.conv_in(x)
        skips = [h]
        for lv in self.down:
            for i, r in enumerate(lv.res):
                h = r(h, emb)
                if len(lv.attn):
                    h = lv.attn[i](h, ctx)
                skips.append(h)
            if lv.downsample is not None:
                h = lv.downsample(h)
                skips.append(h)
        h = self.mid[2](self.mid[1](self.mid[0](h, emb), ctx), emb)
        for level in reversed(range(len(self.up))):
            lv = self.up[level]
            for i, r in enumerate(lv.res):
                h = r(torch.cat([h, skips.pop()], dim=1), emb)
                if len(lv.attn):
                    h = lv.attn[i](h, ctx)
            if lv.upsample is not None:
                h = lv.upsample(F.interpolate(h, scale_factor=2.0, mode="nearest"))
        return self.conv_out(F.silu(self.norm_out(h)))


# ---- optimizers ---------------------------------------------------------------------------------

def copy_stochastic_(target, source):
    """kohya's / torchastic's stochastic rounding of fp32 `source` into bf16 `target`: add 16 random
    bits below the bf16 mantissa, then truncate."""
    bits = torch.randint_like(source, dtype=torch.int32, low=0, high=(1 << 16))
    bits.add_(source.view(dtype=torch.int32))
    bits.bitwise_and_(-65536)
    target.copy_(bits.view(dtype=torch.float32))


class Adafactor:
    """transformers' Adafactor with relative_step=False, scale_parameter=False, warmup_init=False,
    beta1=None, weight_decay=0 (kohya's recommended full fine-tune arguments), per parameter."""

    def __init__(self, params, lr, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8):
        self.params, self.lr, self.eps, self.clip, self.decay = list(params), lr, eps, clip_threshold, decay_rate
        self.state = {}

    @staticmethod
    def _rms(t):
        return t.norm(2) / (t.numel() ** 0.5)

    def step_param(self, p):
        grad = p.grad
        if grad.dtype in (torch.float16, torch.bfloat16):
            grad = grad.float()
        shape = grad.shape
        factored = len(shape) >= 2
        st = self.state.get(p)
        if st is None:
            st = {"step": 0}
            if factored:
                st["row"] = torch.zeros(shape[:-1], dtype=grad.dtype)
                st["col"] = torch.zeros(shape[:-2] + shape[-1:], dtype=grad.dtype)
            else:
                st["sq"] = torch.zeros_like(grad)
            self.state[p] = st
        p32 = p.float() if p.dtype in (torch.float16, torch.bfloat16) else p
        st["step"] += 1
        st["RMS"] = self._rms(p32)
        beta2t = 1.0 - math.pow(st["step"], self.decay)
        update = grad ** 2 + self.eps[0]
        if factored:
            row, col = st["row"], st["col"]
            row.mul_(beta2t).add_(update.mean(dim=-1), alpha=1.0 - beta2t)
            col.mul_(beta2t).add_(update.mean(dim=-2), alpha=1.0 - beta2t)
            r = (row / row.mean(dim=-1, keepdim=True)).rsqrt_().unsqueeze(-1)
            c = col.unsqueeze(-2).rsqrt()
            update = torch.mul(r, c).mul_(grad)
        else:
            sq = st["sq"]
            sq.mul_(beta2t).add_(update, alpha=1.0 - beta2t)
            update = sq.rsqrt().mul_(grad)
        update.div_((self._rms(update) / self.clip).clamp_(min=1.0))
        update.mul_(self.lr)
        p32.add_(-update)
        if p32 is not p:
            copy_stochastic_(p, p32)

    @torch.no_grad()
    def step(self):
        for p in self.params:
            if p.grad is not None:
                self.step_param(p)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


class AdamWStochastic:
    """torch.optim.AdamW's update (decoupled decay, bias correction) in fp32 for bf16 weights, written
    back with copy_stochastic_; moments kept in bf16 like torch.optim.AdamW keeps them for bf16 weights."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        self.params, self.lr, self.betas, self.eps, self.wd = list(params), lr, betas, eps, weight_decay
        self.state = {}

    def step_param(self, p):
        st = self.state.setdefault(p, {"step": 0, "m": torch.zeros_like(p), "v": torch.zeros_like(p)})
        st["step"] += 1
        b1, b2 = self.betas
        g = p.grad.float()
        m = st["m"].float().mul_(b1).add_(g, alpha=1 - b1)
        v = st["v"].float().mul_(b2).addcmul_(g, g, value=1 - b2)
        st["m"].copy_(m)
        st["v"].copy_(v)
        p32 = p.float().mul_(1 - self.lr * self.wd)
        denom = (v.sqrt() / math.sqrt(1 - b2 ** st["step"])).add_(self.eps)
        p32.addcdiv_(m, denom, value=-self.lr / (1 - b1 ** st["step"]))
        copy_stochastic_(p, p32)

    @torch.no_grad()
    def step(self):
        for p in self.params:
            if p.grad is not None:
                self.step_param(p)

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None


class TorchAdamW:
    """torch.optim.AdamW, one instance per parameter for the fused step."""

    def __init__(self, params, lr, fused):
        self.params = list(params)
        if fused:
            self.per_param = {p: torch.optim.AdamW([p], lr=lr) for p in self.params}
        else:
            self.opt = torch.optim.AdamW(self.params, lr=lr)

    def step_param(self, p):
        self.per_param[p].step()

    def step(self):
        self.opt.step()

    def zero_grad(self, set_to_none=True):
        self.opt.zero_grad(set_to_none=True)


def make_optimizer(name, params, bf16, fused):
    if name == "Adafactor":
        return Adafactor(params, LR)
    if name == "AdamW":
        return AdamWStochastic(params, LR) if bf16 else TorchAdamW(params, LR, fused)
    raise SystemExit(f"peer_torch: optimizer {name!r} not implemented (Adafactor, AdamW)")


def install_fused_step(params, optimizer):
    """After autograd accumulates p.grad: optimizer step of p, then p.grad = None (no gradient kept)."""
    nodes = []
    for p in params:
        node = p.expand_as(p).grad_fn.next_functions[0][0]  # p's AccumulateGrad

        def hook(grad_inputs, grad_outputs, p=p):
            with torch.no_grad():
                optimizer.step_param(p)
            p.grad = None

        node.register_hook(hook)
        nodes.append(node)  # the node lives as long as a reference to it
    return nodes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="sd15", choices=["sd15", "sdxl", "tiny-unet"])
    ap.add_argument("--tiny", action="store_true", help="LDM: the tiny widths of LdmUNetOptions::tiny()")
    ap.add_argument("--resolution", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--optimizer", default="Adafactor")
    ap.add_argument("--no-checkpointing", action="store_true")
    ap.add_argument("--no-fused", action="store_true")
    ap.add_argument("--fp32", action="store_true")
    ap.add_argument("--threads", type=int, default=0, help="0 = every CPU in the affinity mask")
    ap.add_argument("--tiny-unet", default="{}", help="tiny-unet widths as JSON (base_channels, channel_mult, "
                    "num_res_blocks, attention_levels, num_heads, context_dim, groups, pooled_context, "
                    "scale_shift_norm, context_tokens)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    threads = a.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    torch.manual_seed(a.seed)
    bf16 = not a.fp32
    dtype = torch.bfloat16 if bf16 else torch.float32
    Checkpointed.checkpointing = not a.no_checkpointing

    if a.arch == "tiny-unet":
        u = json.loads(a.tiny_unet)
        model = TinyUNet(u.get("base_channels", 64), u.get("channel_mult", [1, 2, 4]), u.get("num_res_blocks", 2),
                         u.get("attention_levels", [1, 2]), u.get("num_heads", 4), u.get("context_dim", 256),
                         u.get("groups", 32), u.get("pooled_context", True), u.get("scale_shift_norm", True))
        tokens, cdim, side, cin, adm = u.get("context_tokens", 16), u.get("context_dim", 256), a.resolution, 3, 0
    else:
        p = ldm_preset(a.arch, a.tiny)
        model = LdmUNet(**p)
        tokens, cdim, side, cin, adm = p["tokens"], p["ctx"], a.resolution // 8, 4, p["adm"]
    model = model.to(dtype).train()
    params = [q for q in model.parameters()]
    n_params = sum(q.numel() for q in params)

    x = torch.randn(a.batch, cin, side, side).to(dtype)
    t = torch.rand(a.batch) if a.arch == "tiny-unet" else torch.randint(0, 1000, (a.batch,)).float()
    ctx = torch.randn(a.batch, tokens, cdim).to(dtype)
    y = torch.randn(a.batch, adm).to(dtype) if adm else None

    optimizer = make_optimizer(a.optimizer, params, bf16, fused=not a.no_fused)
    hooks = install_fused_step(params, optimizer) if not a.no_fused else None

    step_seconds, loss_value = [], float("nan")
    for _ in range(a.steps):
        t0 = time.perf_counter()
        out = model(x, t, ctx, y)
        loss = F.mse_loss(out.float(), x.float())
        loss.backward()
        if hooks is None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        del out, loss
        step_seconds.append(time.perf_counter() - t0)
    print(json.dumps({
        "arch": a.arch + (" (tiny)" if a.tiny else ""), "resolution": a.resolution, "batch": a.batch,
        "parameters": n_params, "optimizer": a.optimizer, "checkpointing": not a.no_checkpointing,
        "fused": not a.no_fused, "bf16": bf16, "threads": threads, "torch": torch.__version__,
        "step_seconds": step_seconds, "loss": loss_value,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }), flush=True)


if __name__ == "__main__":
    main()
