#!/usr/bin/env python3
"""Fixture for shoestring's T5 tokenizer (src/shoestring/data/t5_tokenizer.h).

Writes into tests/data/text/:
  t5_corpus.txt               a small made-up caption corpus (generated below from word lists, so it carries no
                              third-party text), with accented Latin words
  t5_micro_spiece.model       a SentencePiece unigram model trained on it with T5's special ids: pad 0 "<pad>",
                              eos 1 "</s>", unk 2 "<unk>", no bos (as google/t5-v1_1-xxl's spiece.model), the
                              default nmt_nfkc normaliser (T5's), 256 pieces
  t5_tokenizer_reference.json for a few prompts (plain ASCII, empty, extra whitespace, composed / decomposed
                              accents, full-width letters and a ligature that NFKC rewrites, characters outside
                              the corpus -> unk, a long text for truncation): Python SentencePiece's
                              EncodeAsIds (no EOS; the C++ tokenizer appends EOS 1), EncodeAsPieces and
                              DecodeIds; and 150 random byte strings (hex: mixed words, whitespace of several
                              kinds, accents, CJK, emoji, literal special-token text, malformed UTF-8) with
                              their EncodeAsIds
  spm_user_identity.model     a second unigram model for the other normaliser settings: no character map
  spm_user_identity_reference.json  (identity), no dummy prefix, extra whitespace kept, two user-defined
                              pieces ("<sks>", "ohwx"), 150 pieces; the same prompts and random strings

Usage: /usr/bin/python3 scripts/gen_t5_tokenizer_fixture.py   (from the repository root; Debian's
python3-sentencepiece)
"""
import io
import itertools
import json
import os
import random

import sentencepiece as spm

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "text")

SUBJECTS = ["a cat", "a dog", "an old man", "a young woman", "two children", "a red car", "a small boat",
            "a wooden house", "a bowl of soup", "a cup of coffee", "a mountain lake", "a city street",
            "a bright garden", "a white horse", "a tall tree", "a sleeping fox", "a blue bird", "an astronaut",
            "a robot", "a lighthouse"]
ACTIONS = ["sitting on", "standing near", "walking along", "looking at", "flying over", "resting under",
           "running across", "painted beside", "floating above", "hiding behind"]
PLACES = ["a quiet beach", "the forest", "a busy market", "the river", "a snowy field", "a small café in Zürich",
          "the old town of São Paulo", "a garden façade", "a bakery with crème brûlée", "the harbour at night",
          "a desert road", "the library", "a rooftop", "a train station", "the kitchen table"]
STYLES = ["photo", "oil painting", "watercolor", "pencil sketch", "digital art", "anime drawing",
          "3d render", "film still", "portrait", "landscape photograph"]
DETAILS = ["soft light", "golden hour", "high detail", "sharp focus", "warm colors", "cold colors", "35mm",
           "wide angle", "bokeh", "dramatic shadows", "naïve style", "by an unknown artist", "8k", "minimal",
           "fine texture", "vintage", "studio lighting", "morning fog"]


def corpus_lines():
    rng = random.Random(20251205)
    lines = []
    for subject, action in itertools.product(SUBJECTS, ACTIONS):
        place = rng.choice(PLACES)
        style = rng.choice(STYLES)
        details = ", ".join(rng.sample(DETAILS, rng.randint(1, 3)))
        lines.append(f"A {style} of {subject} {action} {place}, {details}.")
    for place in PLACES:
        lines.append(f"{place.capitalize()} at {rng.randint(1, 12)} o'clock; numbers 0123456789 and (brackets)!")
    return lines


CASES = [
    ("plain", "a photo of a cat"),
    ("empty", ""),
    ("whitespace", "  A   photo\tof a   dog.  "),
    ("accents", "a café in Zürich, crème brûlée"),
    ("decomposed", "a cafe\u0301 in Zu\u0308rich, cre\u0300me bru\u0302le\u0301e"),
    ("fullwidth_ligature", "ＡＢＣ photo, ﬁne texture"),
    ("unknown", "a 猫 and a 🐱 on a ¥ note"),
    ("long", " ".join(["A watercolor of a small boat floating above the river, soft light, golden hour."] * 12)),
]


RANDOM_WORDS = [w for phrase in SUBJECTS + ACTIONS + PLACES + STYLES + DETAILS for w in phrase.split()] + [
    "<sks>", "ohwx", "</s>", "<pad>", "<unk>", "<s>", "ohwxohwx", "sks"]
RANDOM_CHARS = ["é", "e\u0301", "ü", "u\u0308", "ß", "Ω", "ﬁ", "ﬀ", "Ａ", "ｚ", "１", "①", "™", "½", "猫", "日本", "한",
                "🐱", "👍🏽", "\u200b", "\u00ad", "\ufeff", "\ufffd", "…", "—", "“", "”", "'", "\"", "\\", "ʼ", "x²"]
SEPARATORS = [" ", " ", " ", "  ", "\t", "\n", "\u3000", "\u00a0", "\u2009", "", " \r\n "]
MALFORMED = [b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"\xe0\x80\xaf", b"\x80\x80",
             b"\xf0\x9f\x90"]


def random_texts(n, seed):
    """Random byte strings: words, odd characters and malformed UTF-8 joined by whitespace of several kinds."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = []
        for _ in range(rng.randint(0, 10)):
            r = rng.random()
            if r < 0.55:
                part = rng.choice(RANDOM_WORDS).encode()
            elif r < 0.9:
                part = rng.choice(RANDOM_CHARS).encode()
            else:
                part = rng.choice(MALFORMED)
            if rng.random() < 0.2:
                part = part + rng.choice(RANDOM_CHARS).encode()
            parts.append(part)
            parts.append(rng.choice(SEPARATORS).encode())
        text = b"".join(parts)
        if rng.random() < 0.3:
            text = rng.choice(SEPARATORS).encode() + text
        out.append(text)
    return out


def write_reference(model_file, reference_file, sp, check):
    cases = []
    for name, text in CASES:
        ids = sp.EncodeAsIds(text)
        cases.append({"name": name, "text": text, "ids": ids, "pieces": sp.EncodeAsPieces(text),
                      "decoded": sp.DecodeIds(ids)})
    check(cases)
    rand = [{"hex": t.hex(), "ids": sp.EncodeAsIds(t)} for t in random_texts(150, seed=len(model_file))]
    out = {"generator": "scripts/gen_t5_tokenizer_fixture.py", "sentencepiece": spm.__version__,
           "model": model_file, "piece_size": sp.GetPieceSize(), "pad_id": sp.pad_id(), "eos_id": sp.eos_id(),
           "unk_id": sp.unk_id(), "cases": cases, "random": rand}
    with open(os.path.join(OUT_DIR, reference_file), "w", encoding="utf-8") as f:
        json.dump(out, f, indent=1, ensure_ascii=False)
        f.write("\n")


def train(corpus, model_file, **options):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        input=corpus, model_writer=model, model_type="unigram", character_coverage=1.0, pad_id=0, eos_id=1,
        unk_id=2, bos_id=-1, pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>", num_threads=1, minloglevel=2,
        **options)
    path = os.path.join(OUT_DIR, model_file)
    with open(path, "wb") as f:
        f.write(model.getvalue())
    sp = spm.SentencePieceProcessor(model_file=path)
    assert (sp.pad_id(), sp.eos_id(), sp.unk_id(), sp.bos_id()) == (0, 1, 2, -1)
    return sp


def main():
    os.makedirs(OUT_DIR, exist_ok=True)
    corpus = os.path.join(OUT_DIR, "t5_corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        f.write("\n".join(corpus_lines()) + "\n")

    def check_t5(cases):
        assert len(cases[-1]["ids"]) > 300  # longer than kohya's default max length 256
        assert 2 in cases[6]["ids"]  # unknown characters map to <unk>

    sp = train(corpus, "t5_micro_spiece.model", vocab_size=200, normalization_rule_name="nmt_nfkc")
    write_reference("t5_micro_spiece.model", "t5_tokenizer_reference.json", sp, check_t5)

    sp = train(corpus, "spm_user_identity.model", vocab_size=150, normalization_rule_name="identity",
               add_dummy_prefix=False, remove_extra_whitespaces=False, user_defined_symbols=["<sks>", "ohwx"])
    write_reference("spm_user_identity.model", "spm_user_identity_reference.json", sp, lambda cases: None)


if __name__ == "__main__":
    main()
