#!/usr/bin/python3
"""Reference values for SD3's rectified-flow pieces (src/shoestring/train/flow_matching.h).

Written from the formulas of the public sources in plain PyTorch, independently of the C++ code:

  - shift (Stability-AI/sd3.5 sd3_impls.py ModelSamplingDiscreteFlow.sigma; kohya sd3_train_utils
    --training_shift):                    sigma(t) = shift t / (1 + (shift - 1) t)
  - "mode" time density (Esser et al. 2024, arXiv 2403.03206, eq. 20; diffusers training_utils
    compute_density_for_timestep_sampling): t = 1 - u - s (cos(pi u / 2)^2 - 1 + u), u ~ U(0, 1)
  - loss weights (diffusers compute_loss_weighting_for_sd3, kohya --weighting_scheme):
    sigma_sqrt = sigma^-2, cosmap = 2 / (pi (1 - 2 sigma + 2 sigma^2)), otherwise 1
  - the sampling schedule, replayed the way sd3_infer.py get_sigmas does it in float32:
    ModelSamplingDiscreteFlow's table sigma(arange(1, 1001) / 1000), sigma_max = table[-1],
    sigma_min = table[0]; linspace(1000 sigma_max, 1000 sigma_min, steps), each through sigma(),
    then a final 0. Also the same schedule in float64 from the closed form.
  - an Euler run (sd3_impls.py sample_euler: denoised = x - v sigma, d = (x - denoised) / sigma,
    x += d (sigma_next - sigma)) of a fixed linear "model", and a guided run replaying
    SkipLayerCFGDenoiser (CFG on the denoised outputs, plus (pos - skip) * slg for
    start * steps < step < end * steps), in float64.

Writes tests/data/train/flow_reference.json. Run: /usr/bin/python3 scripts/gen_flow_reference.py
"""
import json
import math
import os

import torch


class ModelSamplingDiscreteFlow:
    """float32, as the reference's registered buffer."""

    def __init__(self, shift):
        self.shift = shift
        self.sigmas = self.sigma(torch.arange(1, 1001, 1))

    def sigma(self, timestep):
        timestep = timestep / 1000.0
        if self.shift == 1.0:
            return timestep
        return self.shift * timestep / (1 + (self.shift - 1) * timestep)


def reference_sigmas(shift, steps):
    s = ModelSamplingDiscreteFlow(shift)
    start = s.sigmas[-1] * 1000  # timestep(sigma_max)
    end = s.sigmas[0] * 1000  # timestep(sigma_min)
    ts = torch.linspace(start, end, steps)
    sigs = [s.sigma(ts[i]) for i in range(len(ts))]
    sigs += [0.0]
    return torch.FloatTensor(sigs)


def shift_f64(t, shift):
    t = torch.as_tensor(t, dtype=torch.float64)
    return shift * t / (1 + (shift - 1) * t)


def sigmas_f64(shift, steps):
    sigma_min = shift_f64(0.001, shift).item()
    ts = torch.linspace(1.0, sigma_min, steps, dtype=torch.float64)
    return torch.cat([shift_f64(ts, shift), torch.zeros(1, dtype=torch.float64)])


def mode_map(u, s):
    u = torch.as_tensor(u, dtype=torch.float64)
    return 1 - u - s * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)


def loss_weight(sigma, scheme):
    sigma = torch.as_tensor(sigma, dtype=torch.float64)
    if scheme == "sigma_sqrt":
        return sigma ** -2.0
    if scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigma + 2 * sigma ** 2))
    return torch.ones_like(sigma)


out = {"source": "formulas of Stability-AI/sd3.5 sd3_impls.py / sd3_infer.py, diffusers training_utils, "
                 "kohya sd3_train_utils; torch " + torch.__version__}

S = [0.0, 0.001, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.999, 1.0]
out["shift"] = {"sigma": S, "values": {str(k): shift_f64(S, k).tolist() for k in (1.0, 3.0, 0.5, 6.0)}}

U = [0.0, 0.05, 0.2, 0.5, 0.7, 0.95, 1.0]
out["mode"] = {"u": U, "values": {str(k): mode_map(U, k).tolist() for k in (1.29, 0.0, -1.0, 1.75)}}

W = [0.02, 0.1, 0.3, 0.5, 0.8, 1.0]
out["loss_weight"] = {"sigma": W, "values": {k: loss_weight(W, k).tolist() for k in ("none", "sigma_sqrt", "cosmap")}}

out["sd3_sigmas"] = []
for shift, steps in ((3.0, 1), (3.0, 4), (3.0, 8), (3.0, 50), (1.0, 4), (2.0, 10)):
    out["sd3_sigmas"].append({"shift": shift, "steps": steps, "reference_f32": reference_sigmas(shift, steps).tolist(),
                              "f64": sigmas_f64(shift, steps).tolist()})

# Euler over the shift-3, 8-step schedule with v = 0.3 x + 0.2 sigma (sd3_impls.sample_euler in float64).
g = torch.Generator().manual_seed(11)
noise = torch.randn(2, 3, 2, 2, generator=g, dtype=torch.float64)
sig = sigmas_f64(3.0, 8)
x = noise.clone()
for i in range(len(sig) - 1):
    v = 0.3 * x + 0.2 * sig[i]
    denoised = x - v * sig[i]
    d = (x - denoised) / sig[i]
    x = x + d * (sig[i + 1] - sig[i])
out["euler_linear"] = {"shift": 3.0, "steps": 8, "shape": list(noise.shape), "noise": noise.flatten().tolist(),
                       "out": x.flatten().tolist()}

# Guided run: SkipLayerCFGDenoiser on a fixed linear cond / uncond / skip model, 20 steps, shift 3,
# cfg 5, slg 2.5, start 0.01, end 0.2 (active steps 1, 2, 3).
steps, cfg, slg, start, end = 20, 5.0, 2.5, 0.01, 0.20
sig = sigmas_f64(3.0, steps)
x = noise.clone()
active = []
for i in range(steps):
    s = sig[i]
    pos = x - (0.3 * x + 0.1 * s) * s
    neg = x - (0.2 * x - 0.4) * s
    scaled = neg + (pos - neg) * cfg
    if slg > 0 and i > start * steps and i < end * steps:
        skip = x - (0.25 * x - 0.05 * s) * s
        scaled = scaled + (pos - skip) * slg
        active.append(i)
    d = (x - scaled) / s
    x = x + d * (sig[i + 1] - s)
out["euler_guided"] = {"shift": 3.0, "steps": steps, "cfg": cfg, "slg": slg, "start": start, "end": end,
                       "active_steps": active, "shape": list(noise.shape), "noise": noise.flatten().tolist(),
                       "out": x.flatten().tolist()}

path = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "train", "flow_reference.json")
os.makedirs(os.path.dirname(path), exist_ok=True)
with open(path, "w") as f:
    json.dump(out, f, indent=1)
for c in out["sd3_sigmas"]:
    if c["steps"] in (4, 8):
        print("shift", c["shift"], "steps", c["steps"], [round(v, 6) for v in c["reference_f32"]])
print("active slg steps", active, "wrote", path)
