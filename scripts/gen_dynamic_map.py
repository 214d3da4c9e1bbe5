#!/usr/bin/python3
"""Reference values of the 8-bit dynamic quantization maps used by 8-bit AdamW.

Dynamic tree quantization (Dettmers et al. 2021, "8-bit Optimizers via
Block-wise Quantization", arXiv 2110.02861; first described in Dettmers 2015,
arXiv 1511.04561) reads an 8-bit code as:
  [sign bit] [E zero bits: the decimal exponent, value scale 10^-E]
  [indicator bit = 1] [the remaining F bits: a linear fraction in [0.1, 1]].
The fraction of F bits is the midpoint of bin k of [0.1, 1] cut into 2^F equal
bins. The code with no indicator bit is 0, and the pattern that would be
"-0" is used for +1.0 (so the map holds 0 and the maximum 1.0).
The unsigned variant (for Adam's second moment, which is >= 0) spends the sign
bit as one more fraction bit; its two patterns without indicator are 0 and 1.0.
Both have at most 7 exponent values (10^0 .. 10^-6), as bitsandbytes'
create_dynamic_map(signed, max_exponent_bits=7, total_bits=8).

This script derives the map twice, independently:
  1. by decoding all 256 bit patterns as above (float64, then float32);
  2. by the per-exponent construction bitsandbytes' functional.py documents
     (float32 torch.linspace boundaries, bin means, scaled by 10^(i-6)),
and checks that they agree to 1e-6 relative. It writes the float32 values of
construction 2 (what bitsandbytes ships), sorted ascending, to
tests/data/optim/dynamic_map.json.
Run: /usr/bin/python3 scripts/gen_dynamic_map.py
"""
import json
import os

import numpy as np
import torch

MAX_EXPONENT = 7  # decimal exponents 10^0 .. 10^-6


def decode_patterns(signed):
    """Decodes every 8-bit pattern (derivation 1)."""
    value_bits = 7 if signed else 8
    values = []
    for code in range(256):
        sign = 1.0
        bits = code
        if signed:
            sign = -1.0 if code & 0x80 else 1.0
            bits = code & 0x7F
        # count leading zeros among value_bits before the indicator bit
        zeros = 0
        while zeros < value_bits and not (bits >> (value_bits - 1 - zeros)) & 1:
            zeros += 1
        if zeros >= MAX_EXPONENT or zeros == value_bits:
            # no indicator within the allowed exponents: the two special codes
            if signed:
                if bits != 0:
                    raise AssertionError("signed pattern with exponent beyond 10^-6")
                values.append(1.0 if sign < 0 else 0.0)
            else:
                # unsigned: 00000000 -> 0, 00000001 -> 1.0
                values.append(1.0 if bits else 0.0)
            continue
        fraction_bits = value_bits - 1 - zeros
        k = bits & ((1 << fraction_bits) - 1)
        bins = 1 << fraction_bits
        fraction = 0.1 + 0.9 * (k + 0.5) / bins
        values.append(sign * fraction * 10.0 ** (-zeros))
    return sorted(np.float32(v) for v in values)


def construct(signed):
    """Per-exponent construction as bitsandbytes documents it (derivation 2)."""
    data = []
    for i in range(MAX_EXPONENT):
        items = 2 ** i if signed else 2 ** (i + 1)
        bounds = torch.linspace(0.1, 1.0, items + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        scaled = means * (10.0 ** (i - (MAX_EXPONENT - 1)))
        data += scaled.tolist()
        if signed:
            data += (-scaled).tolist()
    data += [0.0, 1.0]
    assert len(data) == 256, len(data)
    return sorted(float(np.float32(v)) for v in data)


out = {"source": "dynamic tree quantization, arXiv 2110.02861 / bitsandbytes create_dynamic_map(max_exponent_bits=7, total_bits=8); torch " + torch.__version__}
for name, signed in (("signed", True), ("unsigned", False)):
    a = np.array(decode_patterns(signed), dtype=np.float64)
    b = np.array(construct(signed), dtype=np.float64)
    assert len(set(b.tolist())) == 256, "map values must be distinct"
    rel = np.abs(a - b) / np.maximum(np.abs(b), 1e-30)
    assert rel.max() < 1e-6, (name, rel.max())
    out[name] = b.tolist()

assert out["signed"][0] == float(np.float32(-0.99296875)) and out["signed"][-1] == 1.0
assert out["unsigned"][0] == 0.0 and out["unsigned"][-1] == 1.0
path = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "optim", "dynamic_map.json")
with open(path, "w") as f:
    json.dump(out, f)
print("wrote", path)
