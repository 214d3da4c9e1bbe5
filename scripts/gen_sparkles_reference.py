#!/usr/bin/python3
"""Golden trajectories for SPARKLES, written step by step in PyTorch.

An independent re-implementation of the step of the public SPARKLES optimizer
(rakki194/SPARKLES, sparkles.py), with the defects that shoestring fixes fixed
the same way (docs/optimizers/sparkles.md lists them). With g the gradient of
one tensor, t the 1-based step:

    centralization (tensors with >= 2 dims only):
        g <- g - c * mean(g over dims >= 1, keepdim)
    normalization (alpha = normalization, 0 = off), s = std (unbiased) + 1e-8:
        per channel (normalize_channels, >= 2 dims, >= 2 elements per slice of dim 0):
            s over dims >= 1, keepdim
        else, when the tensor has more than 2 elements: s over the whole tensor
        g <- lerp(g, g / s, alpha)              (sparkles.py's lerp after an in-place
                                                 divide ignores alpha; here it is used)
    coupled weight decay (decouple_weight_decay False): g <- g + wd * p
                                                (sparkles.py adds it after the second
                                                 moment, so it never enters the denominator)
    m <- b1 m + (1 - b1) g;  gh = g + amp_fac * m;  v <- b2 v + (1 - b2) gh^2
    step_size = lr / (1 - b1^t);  denom = sqrt(v) / sqrt(1 - b2^t) + eps
    decoupled weight decay: p <- p * (1 - step_size * wd)     (as sparkles.py)
    update = gh / denom * step_size
    t > 1 and ||gh - prev_grad||_2 < stochastic_threshold: permute update along dim 0
        (in these trajectories only on all-zero updates; the script checks it)
    clip_gradients: update <- clamp(update, -t^0.25, t^0.25)
    p <- p - update;  prev_grad <- gh

All tensors are float32 (no rounding is involved). Five tensors: a matrix, a
bias, a 3x3-style conv weight, a 1x1 conv weight and an [N, 1] matrix (which
normalises globally), weight decay on the 2-D+ ones except the last. Each run:
hyper-parameters, the initial values, every step's gradients (every 7th step ten
times larger), the parameters after every 4th step, and the final ema,
ema_squared and prev_grad. Written to tests/data/optim/sparkles_reference.json
(float32 values as exact float64 repr).
Run: /usr/bin/python3 scripts/gen_sparkles_reference.py
"""
import json
import math
import os

import torch

SHAPES = [(6, 5), (5,), (4, 3, 2, 2), (3, 4, 1, 1), (4, 1)]
WEIGHT_DECAY = [0.1, 0.0, 0.1, 0.1, 0.0]
STEPS = 20


def normalize(g, channels, alpha):
    """Returns g interpolated towards g / (std + 1e-8) with weight alpha."""
    if channels and g.dim() >= 2 and g.numel() // g.shape[0] >= 2:
        s = torch.std(g, dim=list(range(1, g.dim())), unbiased=True, keepdim=True) + 1e-8
    elif g.numel() > 2:
        s = torch.std(g, unbiased=True) + 1e-8
    else:
        return g
    return torch.lerp(g, g / s, alpha)


def sparkles_step(p, grad, st, t, h, wd):
    """One step on tensor p (updated in place); st holds ema, ema_squared, prev_grad.
    Returns (number of clipped elements, ||gh - prev_grad|| or None at t = 1)."""
    # The operations of sparkles.py's step, in its order (in-place ops, fp32).
    g = grad.clone()
    if h["centralization"] != 0 and g.dim() >= 2:
        g.sub_(g.mean(dim=list(range(1, g.dim())), keepdim=True).mul_(h["centralization"]))
    if h["normalization"] != 0:
        g = normalize(g, h["normalize_channels"], h["normalization"])
    if wd != 0 and not h["decouple_weight_decay"]:
        g.add_(p, alpha=wd)
    b1, b2 = h["betas"]
    step_size = h["lr"] / (1.0 - b1 ** t)
    bc2_sqrt = math.sqrt(1.0 - b2 ** t)
    st["ema"].mul_(b1).add_(g, alpha=1.0 - b1)
    gh = g.add_(st["ema"], alpha=h["amp_fac"])
    st["ema_squared"].mul_(b2).addcmul_(gh, gh, value=1.0 - b2)
    denom = st["ema_squared"].sqrt().div_(bc2_sqrt).add_(h["eps"])
    if wd != 0 and h["decouple_weight_decay"]:
        p.mul_(1.0 - step_size * wd)
    update = gh.div(denom).mul_(step_size)
    diff = None
    if t > 1:
        diff = torch.norm(gh - st["prev_grad"]).item()
        if diff < h["stochastic_threshold"]:
            # Only where a permutation is the identity on the values (an all-zero
            # update: an [N, 1] tensor centralised with strength 1 has g = 0).
            if update.abs().max().item() != 0:
                raise RuntimeError("the permutation would fire on a nonzero update: choose other gradients")
    clipped = 0
    if h["clip_gradients"]:
        c = t ** 0.25
        clipped = int((update.abs() > c).sum())
        update = update.clamp(-c, c)
    p.sub_(update)
    st["prev_grad"] = gh.clone()
    return clipped, diff


def run(hyper, seed):
    torch.manual_seed(seed)
    params = [torch.randn(s) for s in SHAPES]
    initial = [p.flatten().tolist() for p in params]
    states = [{k: torch.zeros(s) for k in ("ema", "ema_squared", "prev_grad")} for s in SHAPES]
    steps, clipped, min_diff = [], 0, math.inf
    for t in range(1, STEPS + 1):
        grads = [torch.randn(s) * (0.1 if t % 7 else 10.0) for s in SHAPES]
        for i in range(len(SHAPES)):
            c, d = sparkles_step(params[i], grads[i], states[i], t, hyper, WEIGHT_DECAY[i])
            clipped += c
            if d is not None:
                min_diff = min(min_diff, d)
        rec = {"grads": [g.flatten().tolist() for g in grads]}
        if t % 4 == 0:
            rec["params"] = [p.flatten().tolist() for p in params]
        steps.append(rec)
    final_state = {k: [st[k].flatten().tolist() for st in states] for k in ("ema", "ema_squared", "prev_grad")}
    if hyper["clip_gradients"] and clipped == 0:
        raise RuntimeError("clip_gradients run never clips: raise lr")
    return dict(hyper, initial=initial, steps=steps, final_state=final_state, clipped_elements=clipped,
                min_grad_diff_norm=min_diff)


BASE = {"lr": 3e-3, "betas": [0.9, 0.999], "eps": 1e-8, "centralization": 0.5, "normalization": 0.5,
        "normalize_channels": True, "amp_fac": 2.0, "decouple_weight_decay": False, "clip_gradients": False,
        "stochastic_threshold": 1e-6}
out = {
    "source": "step-by-step SPARKLES (rakki194/SPARKLES sparkles.py, defects fixed as in "
              "docs/optimizers/sparkles.md), torch " + torch.__version__,
    "shapes": [list(s) for s in SHAPES],
    "weight_decay": WEIGHT_DECAY,
    # the guide's arguments: centralization=0.5, normalization=0.5, amp_fac=2, per-channel, coupled decay
    "guide": run(dict(BASE), 21),
    # global normalisation, full-strength centralization and normalization, decoupled decay
    "global_full": run(dict(BASE, normalize_channels=False, centralization=1.0, normalization=1.0,
                            decouple_weight_decay=True, betas=[0.8, 0.99]), 22),
    # no centralization / normalization, clipping active (large lr), other amp_fac and eps
    "clip_plain": run(dict(BASE, lr=0.5, centralization=0.0, normalization=0.0, clip_gradients=True,
                           amp_fac=3.0, eps=1e-6), 23),
}
path = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "optim", "sparkles_reference.json")
with open(path, "w") as f:
    json.dump(out, f)
print("wrote", path, "clipped elements in clip_plain:", out["clip_plain"]["clipped_elements"],
      "min ||gh - prev||:", min(out[k]["min_grad_diff_norm"] for k in ("guide", "global_full", "clip_plain")))
