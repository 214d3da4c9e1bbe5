#!/usr/bin/env python3
"""Reference vectors for shoestring's LoRA (src/shoestring/nn/lora.h), computed with PyTorch.

Writes tests/data/nn/lora_merge.{bin,json} in the format of scripts/gen_nn_reference.py
(raw little-endian float32 tensors back to back + a JSON index of {name, shape, offset}).

For three layers (Linear 5->6; Conv2d 1x1 4->3; Conv2d 3x3 4->3, stride 2, padding 1) it stores
the base weight and bias, lora_down / lora_up, alpha, rank and multiplier, an input x, and:
  <case>.merged  : W + multiplier * alpha / rank * (up @ down), computed as kohya sd-scripts'
                   LoRAInfModule.merge_to does (Linear: up @ down; 1x1 conv: squeeze, matmul,
                   unsqueeze; 3x3 conv: conv2d(down.permute(1, 0, 2, 3), up).permute(1, 0, 2, 3)),
  <case>.adapted : base(x) + multiplier * alpha / rank * up(down(x))   (kohya LoRAModule.forward),
  <case>.merged_out : the base layer with the merged weight applied to x.
All math in float64 from float32 inputs.

Usage: /usr/bin/python3 scripts/gen_lora_reference.py   (from the repository root)
"""
import json
import os

import torch
import torch.nn.functional as F

import reference_data  # scripts/reference_data.py

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "nn")


def write_case(name, tensors):
    reference_data.write_case(OUT_DIR, name, tensors, "scripts/gen_lora_reference.py")


def f32(*shape, scale=0.5):
    return (torch.randn(*shape) * scale).to(torch.float32)


def main():
    torch.manual_seed(1234)
    out = {}

    def put(case, **kw):
        for k, v in kw.items():
            out[f"{case}.{k}"] = v if torch.is_tensor(v) else torch.tensor([float(v)])

    # Linear 5 -> 6, rank 2, alpha 1.5, multiplier 0.7
    W, b, down, up, x = f32(6, 5), f32(6), f32(2, 5), f32(6, 2), f32(3, 5)
    alpha, rank, mult = 1.5, 2, 0.7
    d = lambda t: t.double()
    scale = alpha / rank
    merged = d(W) + mult * (d(up) @ d(down)) * scale
    adapted = F.linear(d(x), d(W), d(b)) + F.linear(F.linear(d(x), d(down)), d(up)) * mult * scale
    put("linear", weight=W, bias=b, down=down, up=up, x=x, alpha=alpha, rank=rank, multiplier=mult,
        merged=merged, adapted=adapted, merged_out=F.linear(d(x), merged, d(b)))

    # Conv2d 1x1 4 -> 3, rank 2, alpha 4 (scale 2), multiplier 1
    W, b, down, up, x = f32(3, 4, 1, 1), f32(3), f32(2, 4, 1, 1), f32(3, 2, 1, 1), f32(2, 4, 5, 5)
    alpha, rank, mult = 4.0, 2, 1.0
    scale = alpha / rank
    merged = d(W) + mult * (d(up).squeeze(3).squeeze(2) @ d(down).squeeze(3).squeeze(2)).unsqueeze(2).unsqueeze(3) * scale
    adapted = F.conv2d(d(x), d(W), d(b)) + F.conv2d(F.conv2d(d(x), d(down)), d(up)) * mult * scale
    put("conv1x1", weight=W, bias=b, down=down, up=up, x=x, alpha=alpha, rank=rank, multiplier=mult,
        merged=merged, adapted=adapted, merged_out=F.conv2d(d(x), merged, d(b)))

    # Conv2d 3x3 4 -> 3, stride 2, padding 1, rank 3, alpha 1, multiplier -0.5
    W, b, down, up, x = f32(3, 4, 3, 3), f32(3), f32(3, 4, 3, 3), f32(3, 3, 1, 1), f32(2, 4, 7, 6)
    alpha, rank, mult = 1.0, 3, -0.5
    scale = alpha / rank
    conved = F.conv2d(d(down).permute(1, 0, 2, 3), d(up)).permute(1, 0, 2, 3)
    merged = d(W) + mult * conved * scale
    adapted = (F.conv2d(d(x), d(W), d(b), stride=2, padding=1)
               + F.conv2d(F.conv2d(d(x), d(down), stride=2, padding=1), d(up)) * mult * scale)
    put("conv3x3", weight=W, bias=b, down=down, up=up, x=x, alpha=alpha, rank=rank, multiplier=mult,
        merged=merged, adapted=adapted, merged_out=F.conv2d(d(x), merged, d(b), stride=2, padding=1))

    write_case("lora_merge", out)


if __name__ == "__main__":
    main()
