#!/usr/bin/python3
"""Golden AdamW trajectory from torch.optim.AdamW (Debian's python3-torch).

Writes tests/data/optim/adamw_reference.json: initial parameters, the
gradient of every step, and the parameters after every 10th step, for a
matrix (decayed) and a vector (not decayed) over 100 steps. Values are float32
written with repr() of the float64 they convert to, so they round-trip exactly.
Run: /usr/bin/python3 scripts/gen_adamw_reference.py
"""
import json
import os

import torch

torch.manual_seed(1234)
w = torch.randn(6, 5)
b = torch.randn(5)
params = [torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())]
opt = torch.optim.AdamW(
    [{"params": [params[0]], "weight_decay": 0.1}, {"params": [params[1]], "weight_decay": 0.0}],
    lr=3e-3, betas=(0.9, 0.99), eps=1e-8)
steps = []
for step in range(1, 101):
    grads = [torch.randn(p.shape) * (0.1 if step % 7 else 10.0) for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    opt.step()
    rec = {"grads": [g.flatten().tolist() for g in grads]}
    if step % 10 == 0:
        rec["params"] = [p.detach().flatten().tolist() for p in params]
    steps.append(rec)

out = {
    "source": "torch.optim.AdamW, torch " + torch.__version__,
    "lr": 3e-3, "betas": [0.9, 0.99], "eps": 1e-8, "weight_decay": [0.1, 0.0],
    "shapes": [list(w.shape), list(b.shape)],
    "initial": [w.flatten().tolist(), b.flatten().tolist()],
    "steps": steps,
}
path = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "optim", "adamw_reference.json")
with open(path, "w") as f:
    json.dump(out, f)
print("wrote", path)
