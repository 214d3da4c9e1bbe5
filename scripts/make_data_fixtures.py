#!/usr/bin/env python3
"""Rebuilds the dataset fixtures under tests/data/ from the fetched Twemoji package.

Usage: scripts/make_data_fixtures.py [DATASET]   (DATASET defaults to the path that
scripts/fetch_twemoji.sh prints). Writes tests/data/twemoji/ (a mini copy of the real
layout: emoji.json with the chosen entries, unmodified, and their 64x64 PNGs) and
tests/data/folder/ (kohya layout: image + same-named .txt caption, a nested folder, one
image without a caption, one truncated PNG).
"""
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "tests", "data")
# A face, a heart, a hand with skin-tone variations, a flag, a symbol, a keycap.
SHORT_NAMES = ["grinning", "heart", "wave", "flag-fr", "100", "hash"]


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else subprocess.check_output(
        [os.path.join(HERE, "fetch_twemoji.sh")], text=True).strip().splitlines()[-1]
    entries = json.load(open(os.path.join(root, "emoji.json")))
    chosen = [e for e in entries if set(e["short_names"]) & set(SHORT_NAMES)]
    assert len(chosen) == len(SHORT_NAMES), [e["short_name"] for e in chosen]
    img_src = os.path.join(root, "img", "twitter", "64")

    tw = os.path.join(DATA, "twemoji")
    img_dst = os.path.join(tw, "img", "twitter", "64")
    shutil.rmtree(tw, ignore_errors=True)
    os.makedirs(img_dst)
    with open(os.path.join(tw, "emoji.json"), "w") as f:
        json.dump(chosen, f, indent=1)
        f.write("\n")
    for e in chosen:
        images = [e["image"]] + [v["image"] for v in e.get("skin_variations", {}).values()]
        for name in images:
            shutil.copyfile(os.path.join(img_src, name), os.path.join(img_dst, name))

    folder = os.path.join(DATA, "folder")
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(os.path.join(folder, "nested"))
    def copy(src, dst, caption):
        shutil.copyfile(os.path.join(img_src, src), os.path.join(folder, dst))
        if caption is not None:
            with open(os.path.join(folder, os.path.splitext(dst)[0] + ".txt"), "w") as f:
                f.write(caption + "\n")
    copy("1f600.png", "grinning.png", "a grinning face, yellow")
    copy("2764-fe0f.png", "heart.png", "a red heart")
    copy("1f44b-1f3fd.png", "nested/wave.png", "a waving hand, medium skin tone")
    copy("1f4af.png", "no_caption.png", None)
    data = open(os.path.join(img_src, "1f1eb-1f1f7.png"), "rb").read()
    with open(os.path.join(folder, "corrupt.png"), "wb") as f:
        f.write(data[:len(data) // 3])  # truncated in the middle of the IDAT chunk
    with open(os.path.join(folder, "corrupt.txt"), "w") as f:
        f.write("a flag that was cut short\n")


if __name__ == "__main__":
    main()
