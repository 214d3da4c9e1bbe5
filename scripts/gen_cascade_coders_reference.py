#!/usr/bin/env python3
"""Reference vectors for Stable Cascade's two small "coder" networks.

Writes to tests/data/models/ (format of scripts/reference_data.py: "param.<key>", "input.<name>", "output"):
  effnet_micro.{bin,json}      EfficientNetEncoder (stage C latent encoder), micro configuration,
                               params + input.x [2,3,32,96] + output [2,16,1,3]
  effnet_micro_odd.{bin,json}  the same network and params on input.x [1,3,70,50] -> output [1,16,3,2];
                               it holds NO params (they are in effnet_micro, to keep the files small)
  previewer_micro.{bin,json}   Previewer with c_hidden 32: params + input.x [2,16,3,4] + output [2,3,24,32]

The networks are written here in functional form with torch.nn.functional, following the public sources
(read for facts, not copied): Stability-AI/StableCascade modules/effnet.py (EfficientNetEncoder =
torchvision efficientnet_v2_s().features in eval mode, then mapper = Conv2d(1280, 16, 1, bias=False),
BatchNorm2d(16, affine=False)) and modules/previewer.py (Previewer); pytorch/vision
torchvision/models/efficientnet.py (MBConv, FusedMBConv, EfficientNet.features, _efficientnet_conf
"efficientnet_v2_s", norm_layer BatchNorm2d(eps=1e-3)) and torchvision/ops/misc.py (Conv2dNormActivation:
conv without bias, padding (k-1)//2, BN, activation; SqueezeExcitation: avgpool, fc1, SiLU, fc2, sigmoid,
scale * input). Everything runs in eval mode: BatchNorm uses running statistics, stochastic depth is the
identity. Key names follow the torchvision / StableCascade module trees (state_dict names); the BN
`num_batches_tracked` counters are not written (the C++ side ignores them).

It also prints, for the real configurations, the parameter and tensor counts computed from this file's key set.

Usage: /usr/bin/python3 scripts/gen_cascade_coders_reference.py   (from the repository root)
"""
import math
import os

import torch
import torch.nn.functional as F

import reference_data  # scripts/reference_data.py

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "models")
GENERATOR = "scripts/gen_cascade_coders_reference.py"

# EfficientNetV2-S as in torchvision _efficientnet_conf("efficientnet_v2_s"):
# stages (kind, expand, kernel, stride, in, out, layers); stem 3 -> stages[0].in; head -> 1280; mapper -> 16.
REAL_EFFNET = {
    "stem": 24,
    "stages": [("fused", 1, 3, 1, 24, 24, 2), ("fused", 4, 3, 2, 24, 48, 4), ("fused", 4, 3, 2, 48, 64, 4),
               ("mb", 4, 3, 2, 64, 128, 6), ("mb", 6, 3, 1, 128, 160, 9), ("mb", 6, 3, 2, 160, 256, 15)],
    "head": 1280,
    "latent": 16,
}
MICRO_EFFNET = {
    "stem": 8,
    "stages": [("fused", 1, 3, 1, 8, 8, 2), ("fused", 2, 3, 2, 8, 16, 2), ("fused", 2, 3, 2, 16, 24, 1),
               ("mb", 4, 3, 2, 24, 32, 2), ("mb", 4, 3, 1, 32, 40, 2), ("mb", 4, 3, 2, 40, 48, 1)],
    "head": 64,
    "latent": 16,
}
BACKBONE_BN_EPS = 1e-3  # efficientnet_v2_s: norm_layer=partial(nn.BatchNorm2d, eps=1e-03)
MAPPER_BN_EPS = 1e-5    # nn.BatchNorm2d default
PREVIEWER_BN_EPS = 1e-5


def write_case(name, tensors, note=""):
    nbytes = reference_data.write_case(OUT_DIR, name, tensors, GENERATOR + note)
    print(f"wrote {name}: {nbytes} bytes")
    return nbytes


class Params(dict):
    """Creates parameters on first use (random), so the forward code defines the key set.

    `bn_modules` lists the BatchNorm module prefixes: each also owns a `num_batches_tracked` buffer
    in the real state dict, which is counted but never written."""

    def __init__(self):
        super().__init__()
        self.bn_modules = []

    def w(self, key, *shape, fan_in=None, gain=1.0):
        if key not in self:
            fan_in = fan_in if fan_in is not None else (math.prod(shape[1:]) if len(shape) > 1 else shape[0])
            self[key] = torch.randn(*shape) * (gain / math.sqrt(fan_in))
        return self[key]

    def b(self, key, n, scale=0.1):
        if key not in self:
            self[key] = torch.randn(n) * scale
        return self[key]

    def bn(self, key, c, affine=True):
        if key + ".running_mean" not in self:
            if affine:
                self[key + ".weight"] = 1 + 0.1 * torch.randn(c)
                self[key + ".bias"] = 0.1 * torch.randn(c)
            self[key + ".running_mean"] = 0.1 * torch.randn(c)
            self[key + ".running_var"] = 0.5 + torch.rand(c)  # uniform(0.5, 1.5)
            self.bn_modules.append(key)
        return (self.get(key + ".weight"), self.get(key + ".bias"),
                self[key + ".running_mean"], self[key + ".running_var"])


def batch_norm(p, key, x, eps, affine=True):
    w, b, rm, rv = p.bn(key, x.shape[1], affine)
    return F.batch_norm(x, rm, rv, w, b, training=False, eps=eps)


# ---- EfficientNetEncoder (StableCascade modules/effnet.py; torchvision efficientnet.py) ------------

def make_divisible(v, divisor=8):
    """torchvision models/_utils.py _make_divisible (min_value = divisor)."""
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return new_v


def rms(x):
    return x.pow(2).mean().sqrt().item()


def cna(p, key, x, cout, k, stride=1, groups=1, act=True):
    """Conv2dNormActivation: keys KEY.0.weight (conv, no bias), KEY.1.* (BN eps 1e-3), then SiLU.

    A new weight is scaled by 1/(sqrt(fan_in) * rms(input)) so that the conv output has about unit
    variance whatever the depth (random BN running stats do not renormalise); this keeps the
    activations O(1) through the net."""
    cin = x.shape[1]
    wgt = p.w(key + ".0.weight", cout, cin // groups, k, k, gain=1.0 / rms(x))
    h = F.conv2d(x, wgt, None, stride, (k - 1) // 2, 1, groups)
    h = batch_norm(p, key + ".1", h, BACKBONE_BN_EPS)
    return F.silu(h) if act else h


def squeeze_excitation(p, key, x, squeeze):
    c = x.shape[1]
    s = F.adaptive_avg_pool2d(x, 1)
    s = F.conv2d(s, p.w(key + ".fc1.weight", squeeze, c, 1, 1), p.b(key + ".fc1.bias", squeeze))
    s = F.silu(s)
    s = F.conv2d(s, p.w(key + ".fc2.weight", c, squeeze, 1, 1), p.b(key + ".fc2.bias", c))
    return torch.sigmoid(s) * x


def fused_mbconv(p, key, x, expand, k, stride, cout):
    cin = x.shape[1]
    exp = make_divisible(cin * expand)
    if exp != cin:
        h = cna(p, key + ".block.0", x, exp, k, stride)
        h = cna(p, key + ".block.1", h, cout, 1, act=False)
    else:
        h = cna(p, key + ".block.0", x, cout, k, stride)
    if stride == 1 and cin == cout:
        h = h + x  # stochastic depth is the identity in eval
    return h


def mbconv(p, key, x, expand, k, stride, cout):
    cin = x.shape[1]
    exp = make_divisible(cin * expand)
    h, i = x, 0
    if exp != cin:
        h = cna(p, f"{key}.block.{i}", h, exp, 1)
        i += 1
    h = cna(p, f"{key}.block.{i}", h, exp, k, stride, groups=exp)
    h = squeeze_excitation(p, f"{key}.block.{i + 1}", h, max(1, cin // 4))
    h = cna(p, f"{key}.block.{i + 2}", h, cout, 1, act=False)
    if stride == 1 and cin == cout:
        h = h + x
    return h


def effnet_encoder(p, x, cfg, trace=None):
    """mapper(backbone(x)); backbone = efficientnet_v2_s().features (indices 0 stem, 1..6 stages, 7 head)."""
    h = cna(p, "backbone.0", x, cfg["stem"], 3, 2)
    if trace is not None:
        trace.append(("backbone.0", h))
    for s, (kind, expand, k, stride, cin, cout, layers) in enumerate(cfg["stages"]):
        assert h.shape[1] == cin, (s, h.shape, cin)
        for j in range(layers):
            block = fused_mbconv if kind == "fused" else mbconv
            h = block(p, f"backbone.{s + 1}.{j}", h, expand, k, stride if j == 0 else 1, cout)
        if trace is not None:
            trace.append((f"backbone.{s + 1}", h))
    h = cna(p, f"backbone.{len(cfg['stages']) + 1}", h, cfg["head"], 1)
    if trace is not None:
        trace.append((f"backbone.{len(cfg['stages']) + 1}", h))
    h = F.conv2d(h, p.w("mapper.0.weight", cfg["latent"], cfg["head"], 1, 1, gain=1.0 / rms(h)))
    return batch_norm(p, "mapper.1", h, MAPPER_BN_EPS, affine=False)


# ---- Previewer (StableCascade modules/previewer.py) ----------------------------------------------

def previewer(p, x, c_hidden, c_out=3):
    """blocks = Sequential(conv1x1, GELU, BN, conv3x3, GELU, BN, convT k2s2, GELU, BN, conv3x3, GELU, BN,
    convT, GELU, BN, conv3x3, GELU, BN, convT, GELU, BN, conv3x3, GELU, BN, conv1x1); all convs with bias."""
    h, i = x, 0

    def conv(h, cout, k):
        nonlocal i
        cin = h.shape[1]
        h = F.conv2d(h, p.w(f"blocks.{i}.weight", cout, cin, k, k, gain=1.4), p.b(f"blocks.{i}.bias", cout),
                     padding=(k - 1) // 2)
        i += 1
        return h

    def conv_t(h, cout):
        nonlocal i
        cin = h.shape[1]
        # ConvTranspose2d weight is [in, out, k, k]; with k = stride = 2 each output pixel sees cin inputs.
        h = F.conv_transpose2d(h, p.w(f"blocks.{i}.weight", cin, cout, 2, 2, fan_in=cin, gain=1.4),
                               p.b(f"blocks.{i}.bias", cout), stride=2)
        i += 1
        return h

    def gelu_bn(h):
        nonlocal i
        h = F.gelu(h)  # exact (erf) GELU, nn.GELU() default
        i += 1
        h = batch_norm(p, f"blocks.{i}", h, PREVIEWER_BN_EPS)
        i += 1
        return h

    ch = c_hidden
    h = gelu_bn(conv(h, ch, 1))            # 0, 1, 2
    h = gelu_bn(conv(h, ch, 3))            # 3, 4, 5
    h = gelu_bn(conv_t(h, ch // 2))        # 6, 7, 8
    h = gelu_bn(conv(h, ch // 2, 3))       # 9, 10, 11
    h = gelu_bn(conv_t(h, ch // 4))        # 12, 13, 14
    h = gelu_bn(conv(h, ch // 4, 3))       # 15, 16, 17
    h = gelu_bn(conv_t(h, ch // 4))        # 18, 19, 20
    h = gelu_bn(conv(h, ch // 4, 3))       # 21, 22, 23
    h = conv(h, c_out, 1)                  # 24
    assert i == 25
    return h


# ---- counting ------------------------------------------------------------------------------------

def counts(p):
    """(parameters = weights + biases excluding BN running stats, tensors incl. buffers and num_batches_tracked)."""
    n_params = sum(t.numel() for k, t in p.items() if not k.endswith((".running_mean", ".running_var")))
    return n_params, len(p) + len(p.bn_modules)


def effnet_cases():
    torch.manual_seed(20240215)
    p = Params()
    x = torch.randn(2, 3, 32, 96)  # an ImageNet-normalised image is roughly zero-mean, unit-variance
    trace = []
    out = effnet_encoder(p, x, MICRO_EFFNET, trace)
    assert list(out.shape) == [2, 16, 1, 3], out.shape
    for name, t in trace:
        print(f"  effnet_micro {name:12s} {list(t.shape)} std {t.std().item():.4f}")
    print(f"effnet_micro output {list(out.shape)} std {out.std().item():.4f} mean {out.mean().item():.4f}")
    n_params, n_tensors = counts(p)
    print(f"effnet micro: {n_params} parameters, {n_tensors} tensors incl. buffers and num_batches_tracked "
          f"({len(p)} written)")
    total = write_case("effnet_micro", {**{"param." + k: v for k, v in p.items()}, "input.x": x, "output": out})

    x_odd = torch.randn(1, 3, 70, 50)
    n_before = len(p)
    out_odd = effnet_encoder(p, x_odd, MICRO_EFFNET)
    assert len(p) == n_before  # same params
    print(f"effnet_micro_odd input {list(x_odd.shape)} output {list(out_odd.shape)} std {out_odd.std().item():.4f}")
    total += write_case("effnet_micro_odd", {"input.x": x_odd, "output": out_odd},
                        " (no params here: the network and params of effnet_micro)")
    return total


def previewer_case():
    torch.manual_seed(20240216)
    p = Params()
    x = torch.randn(2, 16, 3, 4)
    out = previewer(p, x, 32)
    assert list(out.shape) == [2, 3, 24, 32], out.shape
    print(f"previewer_micro output {list(out.shape)} std {out.std().item():.4f} mean {out.mean().item():.4f}")
    return write_case("previewer_micro", {**{"param." + k: v for k, v in p.items()}, "input.x": x, "output": out})


def real_counts():
    """Builds the real configurations' key sets (random weights, small inputs) and prints their counts."""
    torch.manual_seed(0)
    p = Params()
    with torch.no_grad():
        out = effnet_encoder(p, torch.randn(1, 3, 64, 64), REAL_EFFNET)
    n_params, n_tensors = counts(p)
    n_backbone = sum(t.numel() for k, t in p.items()
                     if k.startswith("backbone.") and not k.endswith((".running_mean", ".running_var")))
    keys = list(p.keys())
    print(f"REAL EfficientNetEncoder (c_latent 16): {n_params:,} parameters (backbone {n_backbone:,}, "
          f"mapper {n_params - n_backbone:,}); {n_tensors} tensors incl. BN buffers and num_batches_tracked "
          f"({len(p)} without num_batches_tracked, {len(p.bn_modules)} BatchNorms); output {list(out.shape)} for 64x64")
    print(f"  first keys {keys[0]} {list(p[keys[0]].shape)}, {keys[1]}; "
          f"backbone.1.0.block.0.0.weight {list(p['backbone.1.0.block.0.0.weight'].shape)}; "
          f"last backbone key {[k for k in keys if k.startswith('backbone.')][-1]}")

    p = Params()
    with torch.no_grad():
        previewer(p, torch.randn(1, 16, 2, 2), 512)
    n_params, n_tensors = counts(p)
    print(f"REAL Previewer (c_hidden 512): {n_params:,} parameters; {n_tensors} tensors incl. BN buffers "
          f"and num_batches_tracked ({len(p)} without)")


if __name__ == "__main__":
    torch.set_num_threads(1)  # bit-identical reruns regardless of the machine's core count
    total = effnet_cases() + previewer_case()
    print(f"total {total} bytes of tensor data")
    real_counts()
