#!/usr/bin/python3
"""Golden Adafactor trajectories for tests/optim/test_adafactor.cpp.

An independent Python implementation of the algorithm of the widely used
Hugging Face transformers Adafactor (Shazeer & Stern 2018, arXiv 1804.04235;
eps (1e-30, 1e-3), clip_threshold, decay_rate -0.8, relative_step,
scale_parameter, warmup_init, optional beta1, weight decay scaled by the step
size), written here from the formulas, with shoestring's one deviation: a
tensor with >= 2 dims is factored as the matrix [shape[0], numel / shape[0]]
(a conv kernel [out, in, kh, kw] as out x in*kh*kw) instead of over its last
two dims.

Writes tests/data/optim/adafactor_reference.json: for each configuration, the
initial parameters (a 4x3 matrix, a 5-vector, a [3, 2, 3, 3] conv kernel), the
gradients of every step, the parameters after every 5th step and the final
optimizer state. Values are float32, written via repr of the float64 they
convert to, so they round-trip exactly.
Run: /usr/bin/python3 scripts/gen_adafactor_reference.py
"""
import json
import math
import os

import torch


def rms(t):
    return t.norm(2).item() / math.sqrt(t.numel())


class ReferenceAdafactor:
    def __init__(self, params, lr=None, eps=(1e-30, 1e-3), clip_threshold=1.0, decay_rate=-0.8,
                 beta1=None, weight_decay=0.0, scale_parameter=True, relative_step=True,
                 warmup_init=False):
        self.params = params
        self.lr = lr
        self.eps1, self.eps2 = eps
        self.clip_threshold = clip_threshold
        self.decay_rate = decay_rate
        self.beta1 = beta1
        self.weight_decay = weight_decay
        self.scale_parameter = scale_parameter
        self.relative_step = relative_step
        self.warmup_init = warmup_init
        self.t = 0
        self.state = [dict() for _ in params]

    @staticmethod
    def matrix_shape(shape):
        if len(shape) < 2:
            return None
        return (shape[0], math.prod(shape) // shape[0])

    def step_size(self, p):
        rho = self.lr
        if self.relative_step:
            floor = 1e-6 * self.t if self.warmup_init else 1e-2
            rho = min(floor, 1.0 / math.sqrt(self.t))
        scale = max(self.eps2, rms(p)) if self.scale_parameter else 1.0
        return scale * rho

    @torch.no_grad()
    def step(self):
        self.t += 1
        beta2t = 1.0 - self.t ** self.decay_rate
        for p, st in zip(self.params, self.state):
            g = p.grad.float()
            a_t = self.step_size(p)
            g2 = g * g + self.eps1
            ms = self.matrix_shape(p.shape)
            if ms is not None:
                if "exp_avg_sq_row" not in st:
                    st["exp_avg_sq_row"] = torch.zeros(ms[0])
                    st["exp_avg_sq_col"] = torch.zeros(ms[1])
                r, c = st["exp_avg_sq_row"], st["exp_avg_sq_col"]
                g2m = g2.reshape(ms)
                r.mul_(beta2t).add_(g2m.mean(dim=1), alpha=1.0 - beta2t)
                c.mul_(beta2t).add_(g2m.mean(dim=0), alpha=1.0 - beta2t)
                # Vhat = r c^T / mean(r)
                vhat = torch.outer(r, c) / r.mean()
                u = (g.reshape(ms) / vhat.sqrt()).reshape(p.shape)
            else:
                if "exp_avg_sq" not in st:
                    st["exp_avg_sq"] = torch.zeros_like(g)
                v = st["exp_avg_sq"]
                v.mul_(beta2t).add_(g2, alpha=1.0 - beta2t)
                u = g / v.sqrt()
            u = u / max(1.0, rms(u) / self.clip_threshold)
            u = u * a_t
            if self.beta1 is not None:
                if "exp_avg" not in st:
                    st["exp_avg"] = torch.zeros_like(g)
                m = st["exp_avg"]
                m.mul_(self.beta1).add_(u, alpha=1.0 - self.beta1)
                u = m
            if self.weight_decay != 0:
                p.add_(p, alpha=-self.weight_decay * a_t)
            p.sub_(u)


CONFIGS = [
    # kohya's usual arguments: scale_parameter=False relative_step=False warmup_init=False
    {"name": "kohya_fixed_lr", "lr": 1e-3, "scale_parameter": False, "relative_step": False,
     "warmup_init": False, "beta1": None, "weight_decay": 0.0, "clip_threshold": 1.0,
     "decay_rate": -0.8},
    # transformers defaults: relative step, parameter scaling (lr ignored)
    {"name": "defaults_relative_step", "lr": 123.0, "scale_parameter": True, "relative_step": True,
     "warmup_init": False, "beta1": None, "weight_decay": 0.0, "clip_threshold": 1.0,
     "decay_rate": -0.8},
    # first moment, weight decay, warmup_init, a tighter clip and another decay rate
    {"name": "beta1_wd_warmup", "lr": 0.0, "scale_parameter": True, "relative_step": True,
     "warmup_init": True, "beta1": 0.9, "weight_decay": 0.1, "clip_threshold": 0.5,
     "decay_rate": -0.7},
]
STEPS = 20
SHAPES = [[4, 3], [5], [3, 2, 3, 3]]


def run(cfg, seed):
    torch.manual_seed(seed)
    init = [torch.randn(s) for s in SHAPES]
    params = [t.clone() for t in init]
    opt = ReferenceAdafactor(params, lr=cfg["lr"], clip_threshold=cfg["clip_threshold"],
                             decay_rate=cfg["decay_rate"], beta1=cfg["beta1"],
                             weight_decay=cfg["weight_decay"], scale_parameter=cfg["scale_parameter"],
                             relative_step=cfg["relative_step"], warmup_init=cfg["warmup_init"])
    steps = []
    for step in range(1, STEPS + 1):
        # occasional 30x spikes exercise update clipping
        grads = [torch.randn(s) * (30.0 if step % 6 == 0 else 0.5) for s in SHAPES]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        rec = {"grads": [g.flatten().tolist() for g in grads]}
        if step % 5 == 0:
            rec["params"] = [p.flatten().tolist() for p in params]
        steps.append(rec)
    state = [{k: v.flatten().tolist() for k, v in st.items()} for st in opt.state]
    out = dict(cfg)
    out.update({"shapes": SHAPES, "initial": [t.flatten().tolist() for t in init], "steps": steps,
                "final_state": state})
    return out


def main():
    result = {
        "source": "scripts/gen_adafactor_reference.py (transformers Adafactor semantics, conv kernels "
                  "factored as out x in*kh*kw), torch " + torch.__version__,
        "configs": [run(cfg, 100 + i) for i, cfg in enumerate(CONFIGS)],
    }
    path = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "optim", "adafactor_reference.json")
    with open(path, "w") as f:
        json.dump(result, f)
    print("wrote", os.path.normpath(path))


if __name__ == "__main__":
    main()
