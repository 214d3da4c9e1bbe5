"""Writes reference tensors for the C++ tests (tests/nn/reference_data.h reads them).

A case is two files in a folder: NAME.bin, the tensors' fp32 little-endian values
back to back, and NAME.json, {"case", "generator", "torch", "tensors": [{"name",
"shape", "offset"}]} where offset counts fp32 elements from the start of NAME.bin.
Shared by the gen_*_reference.py scripts.
"""
import json
import os

import torch


def write_case(out_dir, name, tensors, generator):
    """Writes tensors (a dict name -> torch.Tensor, any float dtype) as case NAME under out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    index, chunks, offset = [], [], 0
    for key, t in tensors.items():
        a = t.detach().to(torch.float32).contiguous().numpy().astype("<f4")
        index.append({"name": key, "shape": list(a.shape), "offset": offset})
        chunks.append(a.tobytes())
        offset += a.size
    with open(os.path.join(out_dir, name + ".bin"), "wb") as f:
        f.write(b"".join(chunks))
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump({"case": name, "generator": generator, "torch": torch.__version__, "tensors": index}, f, indent=1)
    return offset * 4
