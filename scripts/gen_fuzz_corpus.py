#!/usr/bin/env python3
"""Writes the seed corpus of the reader fuzz target to tests/fuzz/corpus/.

Each file is one fuzz input in the layout of tests/fuzz/fuzz_input.h: byte 0
even -> the rest is a .safetensors file; byte 0 odd -> u32 little-endian
length L, L bytes of sharded-checkpoint index JSON, then the shard file
"s.safetensors". Valid files and files that break one rule each, all small.
The regression test (tests/io/test_fuzz_regressions.cpp) replays them too.

    python3 scripts/gen_fuzz_corpus.py
"""
import json
import os
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fuzz", "corpus")


def st(header, data=b"", pad=True):
    """A safetensors file from a header (dict or raw str) and a data buffer."""
    text = header if isinstance(header, str) else json.dumps(header, separators=(",", ":"))
    raw = text.encode()
    if pad:
        raw += b" " * ((8 - (8 + len(raw)) % 8) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def index(index_obj, shard):
    text = (index_obj if isinstance(index_obj, str) else json.dumps(index_obj)).encode()
    return b"\x01" + struct.pack("<I", len(text)) + text + shard


def main():
    os.makedirs(OUT, exist_ok=True)
    f32x2 = struct.pack("<2f", 1.5, -2.0)
    good = st({"__metadata__": {"format": "pt"}, "w": entry("F32", [2], 0, 8)}, f32x2)
    every = st(
        {
            "a": entry("F64", [1], 0, 8),
            "b": entry("I32", [1, 1], 8, 12),
            "c": entry("BF16", [2], 12, 16),
            "d": entry("BOOL", [2], 16, 18),
            "e": entry("F8_E4M3", [1], 18, 19),
            "z": entry("U8", [0, 3], 19, 19),
        },
        struct.pack("<d", 3.0) + struct.pack("<i", 7) + b"\x80\x3f\x00\x40" + b"\x01\x00" + b"\x38",
    )
    seeds = {
        "st_valid_f32": b"\x00" + good,
        "st_valid_empty": b"\x00" + st({}),
        "st_valid_every_dtype": b"\x00" + every,
        "st_valid_unpadded_misaligned": b"\x00" + st({"h": entry("F16", [1], 0, 2), "f": entry("F32", [1], 2, 6)},
                                                     b"\x00\x3c" + f32x2[:4], pad=False),
        "st_bad_json": b"\x00" + st('{"w":', pad=False),
        "st_bad_duplicate": b"\x00" + st('{"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                                          '"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\x00"),
        "st_bad_overlap": b"\x00" + st({"a": entry("F32", [2], 0, 8), "b": entry("F32", [1], 4, 8)}, f32x2),
        "st_bad_bool_byte": b"\x00" + st({"m": entry("BOOL", [2], 0, 2)}, b"\x01\x05"),
        "st_bad_nested": b"\x00" + st('{"a":' + "[" * 12 + "]" * 12 + "}"),
        "st_bad_header_length": b"\x00" + struct.pack("<Q", 1 << 40) + b"{}",
        "ix_valid": index({"metadata": {"total_size": 8}, "weight_map": {"w": "s.safetensors"}}, good),
        "ix_bad_missing_tensor": index({"weight_map": {"w": "s.safetensors", "v": "s.safetensors"}}, good),
        "ix_bad_unlisted_tensor": index({"weight_map": {"w": "s.safetensors"}},
                                        st({"w": entry("F32", [2], 0, 8), "v": entry("U8", [1], 8, 9)}, f32x2 + b"\x00")),
        "ix_bad_escape": index({"weight_map": {"w": "../s.safetensors"}}, good),
        "ix_bad_missing_shard": index({"weight_map": {"w": "t.safetensors"}}, good),
        "ix_bad_json": index('{"weight_map": {"w": ', good),
    }
    for name, data in seeds.items():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)
    print(f"wrote {len(seeds)} seeds to {os.path.normpath(OUT)}")


if __name__ == "__main__":
    main()
