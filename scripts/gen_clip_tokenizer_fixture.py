#!/usr/bin/env python3
"""A small CLIP tokenizer folder for tests/data/test_clip_tokenizer.cpp.

Writes tests/data/clip_tokenizer/vocab.json and merges.txt in the Hugging Face format, built the way
OpenAI CLIP's simple_tokenizer.py builds its vocabulary from a merge list:
  ids 0..255    the 256 byte characters of bytes_to_unicode(), in its order (printable bytes
                '!'..'~', 0xA1..0xAC, 0xAE..0xFF first, then the other 68 bytes)
  ids 256..511  the same characters followed by "</w>"
  ids 512..     one token per merge, in merge (rank) order
  then          <|startoftext|>, <|endoftext|>
with the 13 hand-written merges of MERGES below instead of CLIP's 48894. The expected ids in the C++
test are derived by hand from this layout; check() re-derives them with an independent Python
implementation of CLIP's encode (bytes_to_unicode, the pre-tokenizer regex approximated with `re`,
BPE by rank) and fails if the two disagree.

Usage: /usr/bin/python3 scripts/gen_clip_tokenizer_fixture.py   (from the repository root)
"""
import html
import json
import os
import re

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "clip_tokenizer")

MERGES = [
    ("h", "o"), ("ho", "t"), ("p", "hot"), ("phot", "o</w>"), ("o", "t</w>"), ("t", "o"), ("c", "a"),
    ("ca", "t</w>"), ("o", "f</w>"), ("'", "s</w>"), ("Ã", "©</w>"), ("d", "o"), ("do", "g</w>"),
]

# text -> ids, as asserted in tests/data/test_clip_tokenizer.cpp
EXPECTED = {
    "a photo of a cat": [320, 515, 520, 320, 519],
    "tot": [83, 516],
    "hohoh": [512, 512, 327],
    "zz": [89, 345],
    "42": [275, 273],
    "cat's": [519, 521],
    "cat!!": [519, 0, 256],
    "café": [518, 69, 522],
    "CAFÉ": [518, 69, 522],
    "cat &amp; dog": [519, 261, 524],
    "\U0001F431": [172, 253, 238, 365],
    "<|startoftext|>a cat<|endoftext|>": [525, 320, 519, 526],
    " \t a \n\n cat ": [320, 519],
    "a1b": [320, 272, 321],
}


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def build_vocab():
    chars = list(bytes_to_unicode().values())
    vocab = chars + [c + "</w>" for c in chars] + ["".join(m) for m in MERGES] + ["<|startoftext|>", "<|endoftext|>"]
    return {tok: i for i, tok in enumerate(vocab)}


def encode(text, vocab):
    enc = bytes_to_unicode()
    ranks = {m: i for i, m in enumerate(MERGES)}
    text = re.sub(r"\s+", " ", html.unescape(html.unescape(text)).strip()).strip().lower()
    pat = re.compile(r"<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[^\W\d_]+|\d|[^\s\w]+|_+",
                     re.IGNORECASE)
    ids = []
    for w in pat.findall(text):
        if w in ("<|startoftext|>", "<|endoftext|>"):
            ids.append(vocab[w])
            continue
        word = [enc[b] for b in w.encode("utf-8")]
        word[-1] += "</w>"
        while len(word) > 1:
            pairs = [(ranks.get((a, b), 1 << 30), i) for i, (a, b) in enumerate(zip(word, word[1:]))]
            best, _ = min(pairs)
            if best == 1 << 30:
                break
            first, second = MERGES[best]
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == first and word[i + 1] == second:
                    out.append(first + second)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            word = out
        ids.extend(vocab[t] for t in word)
    return ids


def check(vocab):
    for text, ids in EXPECTED.items():
        got = encode(text, vocab)
        assert got == ids, f"{text!r}: {got} != {ids}"


def main():
    vocab = build_vocab()
    check(vocab)
    os.makedirs(OUT_DIR, exist_ok=True)
    with open(os.path.join(OUT_DIR, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(OUT_DIR, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for a, b in MERGES:
            f.write(f"{a} {b}\n")
    print(f"wrote {len(vocab)} tokens, {len(MERGES)} merges; {len(EXPECTED)} expected encodings agree")


if __name__ == "__main__":
    main()
