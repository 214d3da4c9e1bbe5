#!/usr/bin/python3
"""Reference values for Stable Cascade's GDF objective (src/shoestring/train/gdf.h).

Written from the formulas of Stability-AI/StableCascade gdf/ (CosineSchedule with
clamp_range [1e-4, 0.9999] and s = 0.008, its limits, the shift, VPScaler,
CosineTNoiseCond, P2LossWeight, AdaptiveLossWeight, GDF.sample with the DDPM
sampler) in plain PyTorch float64, independently of the C++ code:

    min_var   = cos(s / (1 + s) * pi / 2)^2
    var(t)    = clamp(clamp(cos((s + t) / (1 + s) * pi / 2), 0, 1)^2 / min_var, 1e-4, 0.9999)
    logSNR    = log(var / (1 - var)) + 2 log(1 / shift), clamped to [logSNR(1), logSNR(0)] (shift 1)
    a, b      = sqrt(sigmoid(logSNR)), sqrt(1 - sigmoid(logSNR))
    r         = clamp(acos(sqrt(sigmoid(logSNR) * min_var)) / (pi / 2) * (1 + s) - s, 0, 1)
    P2        = 1 / (1 + exp(logSNR))
    adaptive  = clamp(1 / L[searchsorted(linspace(-10, 10, 299), logSNR)], 1e-7, 1e7),
                L <- 0.99 L + 0.01 loss per sample (last write wins within a batch)
    DDPM step = x0 = (x - b eps) / a; x' = a' x0 + sqrt(b'^2 - sig^2) eps + sig z,
                sig = eta sqrt(b'^2 / b^2) sqrt(1 - a^2 / a'^2)   (eta 0 here: no z)

Writes tests/data/train/gdf_reference.json. Run: /usr/bin/python3 scripts/gen_gdf_reference.py
"""
import json
import math
import os

import torch

S = 0.008
MIN_VAR = math.cos(S / (1 + S) * math.pi / 2) ** 2


def log_snr(t, shift=1.0):
    t = torch.as_tensor(t, dtype=torch.float64).clamp(0, 1)
    var = torch.cos((S + t) / (1 + S) * math.pi / 2).clamp(0, 1) ** 2 / MIN_VAR
    var = var.clamp(1e-4, 0.9999)
    out = torch.log(var / (1 - var))
    if shift != 1:
        out = out + 2 * math.log(1 / shift)
    lo = math.log(1e-4 / (1 - 1e-4))
    return out.clamp(lo, -lo)


def noise_cond(lsnr):
    var = torch.sigmoid(lsnr).clamp(0, 1)
    return (torch.acos(torch.sqrt(var * MIN_VAR)) / (math.pi / 2) * (1 + S) - S).clamp(0, 1)


def scalers(lsnr):
    a2 = torch.sigmoid(lsnr)
    return a2.sqrt(), (1 - a2).sqrt()


T = [0.0, 0.0005, 0.001, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 0.999, 1.0]
out = {"source": "formulas of Stability-AI/StableCascade gdf/, float64, torch " + torch.__version__, "t": T,
       "schedule": {}}
for shift in (1.0, 2.0, 0.5):
    ls = log_snr(T, shift)
    a, b = scalers(ls)
    out["schedule"][str(shift)] = {"log_snr": ls.tolist(), "noise_cond": noise_cond(ls).tolist(), "a": a.tolist(),
                                   "b": b.tolist(), "p2": (1 / (1 + ls.exp())).tolist()}

# Adaptive loss weight: three updates (duplicates in one bucket, values beyond the edges).
edges = torch.linspace(-10, 10, 299, dtype=torch.float64)
losses = torch.ones(300, dtype=torch.float64)
updates = [
    ([-12.0, -9.99, 0.0, 0.0, 0.05, 3.3, 10.0, 11.0], [0.5, 2.0, 0.1, 0.3, 0.7, 1.5, 0.25, 4.0]),
    ([0.0, 0.01, -0.06, 7.77], [0.2, 0.9, 0.05, 1e-3]),
    ([-12.0, 3.3, 3.31, 9.2], [0.5, 0.6, 0.7, 0.8]),
]
for ls, loss in updates:
    ls, loss = torch.tensor(ls, dtype=torch.float64), torch.tensor(loss, dtype=torch.float64)
    idx = torch.searchsorted(edges, ls)
    old = losses.clone()
    for i in range(len(idx)):  # sequential: the last sample of a bucket wins, each from the old value
        losses[idx[i]] = old[idx[i]] * 0.99 + loss[i] * 0.01
probe = torch.tensor([-20.0, -10.0, -9.99, -0.06, 0.0, 0.01, 0.05, 3.3, 3.31, 7.77, 9.2, 10.0, 10.5], dtype=torch.float64)
out["adaptive"] = {"updates": [{"log_snr": u[0], "loss": u[1]} for u in updates],
                   "probe_log_snr": probe.tolist(),
                   "probe_bucket": torch.searchsorted(edges, probe).tolist(),
                   "probe_weight": (1 / losses[torch.searchsorted(edges, probe)]).clamp(1e-7, 1e7).tolist(),
                   "changed": {str(i): losses[i].item() for i in range(300) if losses[i].item() != 1.0}}

# The sampler's grid (shift 2, 20 steps: the stage C preview defaults) and a
# deterministic (eta 0) run with a fixed linear "model" eps = 0.3 x + 0.2 r.
grid = log_snr(torch.linspace(1, 0, 21, dtype=torch.float64), 2.0)
out["grid_shift2_20"] = {"log_snr": grid.tolist(), "noise_cond": noise_cond(grid).tolist()}
g = torch.Generator().manual_seed(5)
noise = torch.randn(2, 3, 4, 4, generator=g, dtype=torch.float64)
grid = log_snr(torch.linspace(1, 0, 9, dtype=torch.float64), 2.0)
x = noise.clone()
for i in range(8):
    r = noise_cond(grid[i])
    eps = 0.3 * x + 0.2 * r
    a, b = scalers(grid[i])
    a2, b2 = scalers(grid[i + 1])
    x0 = (x - b * eps) / a
    x = a2 * x0 + b2 * eps
out["ddim_linear_model"] = {"steps": 8, "shift": 2.0, "noise": noise.flatten().tolist(), "shape": list(noise.shape),
                            "x0": x0.flatten().tolist()}

path = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "train", "gdf_reference.json")
os.makedirs(os.path.dirname(path), exist_ok=True)
with open(path, "w") as f:
    json.dump(out, f, indent=1)
print("wrote", path, "limits", log_snr([1.0, 0.0]).tolist(), "r at t=1, 0.001:",
      noise_cond(log_snr([1.0, 0.001])).tolist(), "grid r[:3]", out["grid_shift2_20"]["noise_cond"][:3])
