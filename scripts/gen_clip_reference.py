#!/usr/bin/env python3
"""Reference data for shoestring's CLIP text encoders (src/shoestring/models/clip_text.h).

Writes, for a micro-sized encoder in each released key layout:
  tests/data/models/clip_hf_micro.safetensors      random fp32 weights under SD 1.5's prefix
                                                   "cond_stage_model.transformer." (Hugging Face
                                                   CLIPTextModel names, int64 position_ids buffer)
                                                   plus one unrelated tensor outside the prefix
  tests/data/models/clip_openclip_micro.safetensors random fp32 weights under SDXL's prefix
                                                   "conditioner.embedders.1.model." (OpenCLIP text
                                                   tower names, scalar logit_scale)
  tests/data/models/clip_{hf,openclip}_micro.{json,bin}  input ids and expected outputs in the
                                                   format of scripts/reference_data.py

The encoders are written here in functional PyTorch, independently of the C++ code, from the public
definitions: transformers' modeling_clip.py (CLIPTextEmbeddings, CLIPAttention with separate
q/k/v/out projections and the causal mask, CLIPMLP with quick_gelu, CLIPTextTransformer pooling at
input_ids.argmax(-1)) and open_clip's model.py / transformer.py (token_embedding + positional_embedding,
ResidualAttentionBlock with torch.nn.MultiheadAttention -- here its functional form
F.multi_head_attention_forward on the packed in_proj -- ln_final, text_projection applied as
x @ text_projection, pooled at text.argmax(-1)). The reference runs in float64 on the fp32 weights.

Expected outputs ("hidden.<s>" = HF hidden_states[-s] without the final LayerNorm; "hidden_normed.<s>"
= final_layer_norm of it; "last_hidden"; "pooled"), the ids as float ("input.ids").

Usage: /usr/bin/python3 scripts/gen_clip_reference.py   (from the repository root)
"""
import json
import os
import struct

import torch
import torch.nn.functional as F

import reference_data  # scripts/reference_data.py

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "models")
VOCAB, POSITIONS = 100, 77
BOS, EOS = VOCAB - 2, VOCAB - 1  # EOS is the largest id, as 49407 is in CLIP's vocabulary

ST_DTYPES = {torch.float32: "F32", torch.int64: "I64"}


def write_safetensors(path, tensors, metadata):
    """Minimal safetensors writer (format: github.com/huggingface/safetensors README): u64 LE header
    length, JSON header {name: {dtype, shape, data_offsets}}, then the raw little-endian data."""
    header, chunks, offset = {"__metadata__": metadata}, [], 0
    for name, t in tensors.items():
        data = t.contiguous().numpy().tobytes()
        header[name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        f.write(b"".join(chunks))


def rand(*shape, scale):
    return torch.randn(*shape) * scale


def norm_params(p, key, w):
    p[key + ".weight"] = 1 + 0.1 * torch.randn(w)
    p[key + ".bias"] = 0.1 * torch.randn(w)


def linear_params(p, key, cin, cout):
    p[key + ".weight"] = rand(cout, cin, scale=cin ** -0.5)
    p[key + ".bias"] = rand(cout, scale=0.1)


def make_ids(pad):
    """Three rows as CLIP tokenizers produce them: BOS, tokens, EOS, then padding (`pad`); the last
    row is full length (truncated: EOS at position 76)."""
    g = torch.Generator().manual_seed(7)
    rows = []
    for n in (3, 20, POSITIONS - 2):
        body = torch.randint(0, VOCAB - 2, (n,), generator=g)
        row = torch.cat([torch.tensor([BOS]), body, torch.tensor([EOS])])
        rows.append(torch.cat([row, torch.full((POSITIONS - row.numel(),), pad)]))
    return torch.stack(rows).long()


def ln(p, key, x):
    return F.layer_norm(x, (x.shape[-1],), p[key + ".weight"], p[key + ".bias"], 1e-5)


def causal_mask(L):
    return torch.full((L, L), float("-inf"), dtype=torch.float64).triu(1)


# ---- Hugging Face CLIPTextModel -------------------------------------------------

def hf_params(width, layers, mlp):
    p = {"text_model.embeddings.token_embedding.weight": rand(VOCAB, width, scale=1.0),
         "text_model.embeddings.position_embedding.weight": rand(POSITIONS, width, scale=0.5)}
    for i in range(layers):
        k = f"text_model.encoder.layers.{i}."
        norm_params(p, k + "layer_norm1", width)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            linear_params(p, k + "self_attn." + proj, width, width)
        norm_params(p, k + "layer_norm2", width)
        linear_params(p, k + "mlp.fc1", width, mlp)
        linear_params(p, k + "mlp.fc2", mlp, width)
    norm_params(p, "text_model.final_layer_norm", width)
    return p


def hf_forward(p, ids, layers, heads):
    p = {k: v.double() for k, v in p.items()}
    B, L = ids.shape
    x = p["text_model.embeddings.token_embedding.weight"][ids] + p["text_model.embeddings.position_embedding.weight"][:L]
    W = x.shape[-1]
    D = W // heads
    hidden_states = [x]
    for i in range(layers):
        k = f"text_model.encoder.layers.{i}."
        h = ln(p, k + "layer_norm1", x)

        def proj(name, t):
            return F.linear(t, p[k + f"self_attn.{name}.weight"], p[k + f"self_attn.{name}.bias"])

        q = (proj("q_proj", h) * D ** -0.5).view(B, L, heads, D).transpose(1, 2)
        kk = proj("k_proj", h).view(B, L, heads, D).transpose(1, 2)
        v = proj("v_proj", h).view(B, L, heads, D).transpose(1, 2)
        a = torch.softmax(q @ kk.transpose(-1, -2) + causal_mask(L), dim=-1) @ v
        x = x + proj("out_proj", a.transpose(1, 2).reshape(B, L, W))
        h = F.linear(ln(p, k + "layer_norm2", x), p[k + "mlp.fc1.weight"], p[k + "mlp.fc1.bias"])
        h = h * torch.sigmoid(1.702 * h)  # quick_gelu
        x = x + F.linear(h, p[k + "mlp.fc2.weight"], p[k + "mlp.fc2.bias"])
        hidden_states.append(x)
    last = ln(p, "text_model.final_layer_norm", x)
    pooled = last[torch.arange(B), ids.argmax(dim=-1)]
    norm = lambda t: ln(p, "text_model.final_layer_norm", t)
    return hidden_states, last, pooled, norm


# ---- OpenCLIP text tower ---------------------------------------------------------

def openclip_params(width, layers, mlp, projection):
    p = {"token_embedding.weight": rand(VOCAB, width, scale=1.0),
         "positional_embedding": rand(POSITIONS, width, scale=0.5)}
    for i in range(layers):
        k = f"transformer.resblocks.{i}."
        norm_params(p, k + "ln_1", width)
        p[k + "attn.in_proj_weight"] = rand(3 * width, width, scale=width ** -0.5)
        p[k + "attn.in_proj_bias"] = rand(3 * width, scale=0.1)
        linear_params(p, k + "attn.out_proj", width, width)
        norm_params(p, k + "ln_2", width)
        linear_params(p, k + "mlp.c_fc", width, mlp)
        linear_params(p, k + "mlp.c_proj", mlp, width)
    norm_params(p, "ln_final", width)
    p["text_projection"] = rand(width, projection, scale=width ** -0.5)
    p["logit_scale"] = torch.tensor(4.6052)  # log(100), as trained CLIP models end up
    return p


def openclip_forward(p, ids, layers, heads, attention_mask=None):
    """attention_mask: [B, L], 1 = token, 0 = padding (Hugging Face's convention, as Stable Cascade passes it
    to CLIPTextModelWithProjection); padding keys are then excluded through torch's key_padding_mask."""
    p = {k: v.double() for k, v in p.items()}
    B, L = ids.shape
    x = p["token_embedding.weight"][ids] + p["positional_embedding"][:L]
    W = x.shape[-1]
    x = x.permute(1, 0, 2)  # NLD -> LND, as open_clip's TextTransformer
    hidden_states = [x.permute(1, 0, 2)]
    for i in range(layers):
        k = f"transformer.resblocks.{i}."
        h = ln(p, k + "ln_1", x)
        a, _ = F.multi_head_attention_forward(
            h, h, h, W, heads, p[k + "attn.in_proj_weight"], p[k + "attn.in_proj_bias"], None, None, False, 0.0,
            p[k + "attn.out_proj.weight"], p[k + "attn.out_proj.bias"], training=False, need_weights=False,
            attn_mask=causal_mask(L), key_padding_mask=None if attention_mask is None else attention_mask == 0)
        x = x + a
        h = F.gelu(F.linear(ln(p, k + "ln_2", x), p[k + "mlp.c_fc.weight"], p[k + "mlp.c_fc.bias"]))
        x = x + F.linear(h, p[k + "mlp.c_proj.weight"], p[k + "mlp.c_proj.bias"])
        hidden_states.append(x.permute(1, 0, 2))
    x = x.permute(1, 0, 2)
    last = ln(p, "ln_final", x)
    pooled = last[torch.arange(B), ids.argmax(dim=-1)] @ p["text_projection"]
    norm = lambda t: ln(p, "ln_final", t)
    return hidden_states, last, pooled, norm


def write(name, prefix, params, extra, ids, result, layers):
    hidden_states, last, pooled, norm = result
    tensors = {prefix + k: v for k, v in params.items()}
    tensors.update(extra)
    write_safetensors(os.path.join(OUT_DIR, name + ".safetensors"), tensors,
                      {"generator": "scripts/gen_clip_reference.py"})
    case = {"input.ids": ids.float(), "last_hidden": last, "pooled": pooled}
    for s in range(1, layers + 1):
        case[f"hidden.{s}"] = hidden_states[-s]
        case[f"hidden_normed.{s}"] = norm(hidden_states[-s])
    reference_data.write_case(OUT_DIR, name, case, "scripts/gen_clip_reference.py")


def main():
    torch.manual_seed(0)
    # HF layout: width 32, 3 layers, 4 heads, MLP 48 (not 4x, to catch a hard-coded ratio).
    layers = 3
    p = hf_params(32, layers, 48)
    ids = make_ids(pad=EOS)  # HF CLIP-L tokenizer pads with <|endoftext|>
    extra = {"cond_stage_model.transformer.text_model.embeddings.position_ids": torch.arange(POSITIONS).unsqueeze(0),
             "model.diffusion_model.unrelated.weight": torch.zeros(2, 2)}
    write("clip_hf_micro", "cond_stage_model.transformer.", p, extra, ids, hf_forward(p, ids, layers, 4), layers)

    # OpenCLIP layout: width 40, 3 layers, 5 heads, MLP 80, projection 24 (non-square: x @ P orientation).
    p = openclip_params(40, layers, 80, 24)
    ids = make_ids(pad=0)  # open_clip.tokenize pads with 0
    extra = {"conditioner.embedders.0.transformer.unrelated.weight": torch.zeros(3)}
    write("clip_openclip_micro", "conditioner.embedders.1.model.", p, extra, ids,
          openclip_forward(p, ids, layers, 5), layers)

    # The same tower as Stable Cascade runs bigG: padded with <|endoftext|> and an attention mask that is 1
    # through the first EOS (a tokenizer's padding="max_length" mask), so padding positions see only the
    # caption. Outputs only (the weights are clip_openclip_micro.safetensors').
    ids = make_ids(pad=EOS)
    first_eos = (ids == EOS).int().argmax(dim=-1, keepdim=True)
    mask = (torch.arange(POSITIONS).unsqueeze(0) <= first_eos).long()
    hidden_states, last, pooled, _ = openclip_forward(p, ids, layers, 5, attention_mask=mask)
    reference_data.write_case(OUT_DIR, "clip_openclip_micro_masked",
                              {"input.ids": ids.float(), "input.attention_mask": mask.float(),
                               "hidden.1": hidden_states[-1], "pooled": pooled}, "scripts/gen_clip_reference.py")


if __name__ == "__main__":
    main()
