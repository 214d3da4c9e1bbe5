#!/usr/bin/python3
"""Writes an independent safetensors reference file for tests/io/test_safetensors.cpp.

The file is built by hand from the format description at
https://github.com/huggingface/safetensors (u64 little-endian header length N,
N bytes of JSON header, then the data buffer), with struct + json, so it shares
no code with shoestring's writer. Tensor values come from torch (arange and
seeded randn); the expected values go to a JSON sidecar.

Deliberately unlike shoestring's writer, to exercise the reader:
  * compact JSON without padding, so 8 + N is not a multiple of 8;
  * tensors laid out in an order that puts some data at offsets that are not
    aligned to its element size (the reader must copy those);
  * a 0-d scalar, a zero-element tensor, F8 data given as raw bytes, metadata.

Outputs (small, committed):
  tests/data/safetensors/reference.safetensors
  tests/data/safetensors/reference.json

Run: /usr/bin/python3 scripts/gen_safetensors_fixture.py
"""
import json
import os
import struct

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "tests", "data", "safetensors")

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def raw_bytes(t):
    """Little-endian bytes of a contiguous tensor (numpy does not know bfloat16,
    so go through an integer view of the same width)."""
    t = t.contiguous()
    width = t.element_size()
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
    if t.dtype == torch.bool:
        ints = t.to(torch.uint8)
    else:
        ints = t.view(as_int)
    fmt = {1: "B", 2: "h", 4: "i", 8: "q"}[width]
    flat = ints.reshape(-1).tolist()
    return struct.pack("<%d%s" % (len(flat), fmt), *flat)


def f8_decode(byte, exp_bits, man_bits, bias):
    """Value of an 8-bit float pattern (finite patterns only), from the OCP FP8
    definition of E4M3 (bias 7) and E5M2 (bias 15)."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp = (byte >> man_bits) & ((1 << exp_bits) - 1)
    man = byte & ((1 << man_bits) - 1)
    if exp == 0:
        return sign * man / (1 << man_bits) * 2.0 ** (1 - bias)
    return sign * (1 + man / (1 << man_bits)) * 2.0 ** (exp - bias)


def main():
    torch.manual_seed(1234)
    # (name, dtype name, tensor or raw F8 bytes + shape). Order = data order.
    entries = [
        ("u8.odd", "U8", torch.arange(3, dtype=torch.uint8) + 250),  # 3 bytes: misaligns what follows
        ("f32.randn", "F32", torch.randn(3, 4)),
        ("bf16.randn", "BF16", torch.randn(2, 3).to(torch.bfloat16)),
        ("f64.scalar", "F64", torch.tensor(-2.5e-300, dtype=torch.float64)),  # 0-d
        ("f16.arange", "F16", torch.arange(-4, 6, dtype=torch.float32).div(8).to(torch.float16).reshape(2, 5)),
        ("i64.big", "I64", torch.tensor([-(2**62) - 7, 2**62 + 11, 0, -1], dtype=torch.int64)),
        ("bool.mask", "BOOL", torch.tensor([[True, False, True], [False, False, True]])),
        ("i32.arange", "I32", torch.arange(-6, 6, dtype=torch.int32).reshape(3, 2, 2)),
        ("empty.f32", "F32", torch.zeros(0, 5, dtype=torch.float32)),  # zero elements
        ("i16.mixed", "I16", torch.tensor([-32768, -1, 0, 1, 32767], dtype=torch.int16)),
        ("i8.neg", "I8", torch.arange(-128, 128, 37, dtype=torch.int8)),
        ("f8e4m3.raw", "F8_E4M3", (bytes([0x00, 0x38, 0xB8, 0x7E, 0x01, 0x80]), [2, 3])),
        ("f8e5m2.raw", "F8_E5M2", (bytes([0x3C, 0xBC, 0x7B, 0x04]), [4])),
    ]

    header = {"__metadata__": {"format": "pt", "source": "gen_safetensors_fixture.py", "note": "üñí ✓"}}
    expected = {"metadata": header["__metadata__"], "tensors": {}}
    data = b""
    for name, dt, value in entries:
        if dt.startswith("F8"):
            blob, shape = value
            values = list(blob)  # raw 8-bit patterns
            e, m, bias = (4, 3, 7) if dt == "F8_E4M3" else (5, 2, 15)
            decoded = [f8_decode(b, e, m, bias) for b in blob]
        else:
            assert value.dtype == DTYPES[dt], name
            blob = raw_bytes(value)
            shape = list(value.shape)
            values = value.reshape(-1).tolist()
        begin = len(data)
        data += blob
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [begin, len(data)]}
        expected["tensors"][name] = {"dtype": dt, "shape": shape, "begin": begin, "end": len(data),
                                     "values": values}
        if dt.startswith("F8"):
            expected["tensors"][name]["decoded"] = decoded

    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    if (8 + len(text)) % 8 == 0:
        text += b" "  # keep the header unpadded-looking: 8 + N not a multiple of 8
    os.makedirs(OUT_DIR, exist_ok=True)
    with open(os.path.join(OUT_DIR, "reference.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        f.write(data)
    with open(os.path.join(OUT_DIR, "reference.json"), "w", encoding="utf-8") as f:
        json.dump(expected, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
