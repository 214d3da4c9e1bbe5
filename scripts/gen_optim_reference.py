#!/usr/bin/python3
"""Golden trajectories for Lion and Compass, written step by step in PyTorch.

Lion (Chen et al. 2023, arXiv 2302.06675, Algorithm 2 with decoupled weight
decay):
    p <- p (1 - lr wd); p <- p - lr sign(b1 m + (1-b1) g); m <- b2 m + (1-b2) g
Compass (lodestone-rock/compass_optimizer, compass.py):
    g <- g - c mean(g, dims >= 1)      (0-d / 1-d tensors: overall mean)
    m <- b1 m + (1-b1) g; gh = g + amp_fac m; v <- b2 v + (1-b2) gh^2
    s = lr / (1 - b1^t); denom = sqrt(v) / sqrt(1 - b2^t) + eps
    p <- p (1 - s wd); p <- p - s gh / denom
Both run 50 steps on three float32 tensors (a matrix and a 4-d "conv" weight
with weight decay, a vector without) from given gradients (every 7th step ten
times larger). Written to tests/data/optim/lion_compass_reference.json: for each
optimizer its hyper-parameters, the initial values, every step's gradients and
the parameters after every 5th step (float32 values as exact float64 repr).
Run: /usr/bin/python3 scripts/gen_optim_reference.py
"""
import json
import math
import os

import torch

SHAPES = [(6, 5), (5,), (4, 3, 2, 2)]
WEIGHT_DECAY = [0.1, 0.0, 0.1]
STEPS = 50


def lion_step(p, g, m, lr, b1, b2, wd):
    p.mul_(1.0 - lr * wd)
    direction = (m * b1).add_(g, alpha=1.0 - b1).sign_()
    p.add_(direction, alpha=-lr)
    m.mul_(b2).add_(g, alpha=1.0 - b2)


def compass_step(p, g, m, v, t, lr, b1, b2, amp_fac, eps, wd, centralization):
    g = g.clone()
    if centralization != 0:
        if g.dim() >= 2:
            mean = g.mean(dim=tuple(range(1, g.dim())), keepdim=True)
        else:
            mean = g.mean()
        g.sub_(mean * centralization)
    step_size = lr / (1.0 - b1 ** t)
    bc2_sqrt = math.sqrt(1.0 - b2 ** t)
    m.mul_(b1).add_(g, alpha=1.0 - b1)
    g.add_(m, alpha=amp_fac)
    v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
    denom = (v.sqrt() / bc2_sqrt).add_(eps)
    if wd != 0:
        p.mul_(1.0 - step_size * wd)
    p.addcdiv_(g, denom, value=-step_size)


def run(name, hyper, seed):
    torch.manual_seed(seed)
    params = [torch.randn(s) for s in SHAPES]
    initial = [p.flatten().tolist() for p in params]
    m = [torch.zeros(s) for s in SHAPES]
    v = [torch.zeros(s) for s in SHAPES]
    steps = []
    for t in range(1, STEPS + 1):
        grads = [torch.randn(s) * (0.1 if t % 7 else 10.0) for s in SHAPES]
        for i in range(len(SHAPES)):
            if name == "lion":
                lion_step(params[i], grads[i], m[i], hyper["lr"], *hyper["betas"], WEIGHT_DECAY[i])
            else:
                compass_step(params[i], grads[i], m[i], v[i], t, hyper["lr"], *hyper["betas"], hyper["amp_fac"],
                             hyper["eps"], WEIGHT_DECAY[i], hyper["centralization"])
        rec = {"grads": [g.flatten().tolist() for g in grads]}
        if t % 5 == 0:
            rec["params"] = [p.flatten().tolist() for p in params]
        steps.append(rec)
    return dict(hyper, initial=initial, steps=steps)


out = {
    "source": "step-by-step Lion (arXiv 2302.06675) and Compass (compass.py), torch " + torch.__version__,
    "shapes": [list(s) for s in SHAPES],
    "weight_decay": WEIGHT_DECAY,
    "lion": run("lion", {"lr": 1e-2, "betas": [0.9, 0.99]}, 7),
    "compass": run("compass", {"lr": 3e-3, "betas": [0.9, 0.999], "amp_fac": 2.0, "eps": 1e-8,
                               "centralization": 0.5}, 11),
    "compass_default": run("compass", {"lr": 3e-3, "betas": [0.9, 0.999], "amp_fac": 2.0, "eps": 1e-8,
                                       "centralization": 0.0}, 13),
}
path = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "optim", "lion_compass_reference.json")
with open(path, "w") as f:
    json.dump(out, f)
print("wrote", path)
