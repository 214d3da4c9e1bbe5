#!/usr/bin/env python3
"""Reference buckets for shoestring's aspect-ratio bucketing (src/shoestring/data/buckets.h).

An independent re-implementation, in plain Python, of the rules of kohya-ss/sd-scripts
(library/model_util.py make_bucket_resolutions; library/train_util.py BucketManager:
make_buckets, select_bucket with its bucket_no_upscale path, round_to_steps, get_crop_ltrb,
and BaseDataset.make_buckets, which sorts the buckets in use), written from their description:
  - predefined buckets: the square of side floor(sqrt(area) / step) * step, and for each width w
    from min to max in steps, h = min(max, (area // w) // step * step) when h >= min, both (w, h)
    and (h, w); sorted, unique.
  - upscaling allowed: the image's own size if predefined, else the predefined bucket of least
    |aspect error| (first of ties); scale so the image covers the bucket; sides int(x + 0.5).
  - no upscale: images above the area shrink to it with the width or height rounded to steps
    (whichever keeps the ratio closer); the bucket is the size rounded down to steps.
  - crop box: the image fitted inside the bucket, left / top = floor(half the margin).
Python floats are IEEE float64, as the C++ doubles.

Writes tests/data/buckets/reference.json: a list of cases {name, settings, buckets (predefined),
images: [{size, bucket, resized, ar_error, crop_ltrb}], used (the sorted buckets in use)}.

Usage: /usr/bin/python3 scripts/gen_bucket_reference.py   (from the repository root)
"""
import json
import math
import os

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data", "buckets", "reference.json")


def predefined(max_w, max_h, lo, hi, step):
    area = max_w * max_h
    out = {(int(math.sqrt(area) / step) * step,) * 2}
    w = lo
    while w <= hi:
        h = min(hi, (area // w) // step * step)
        if h >= lo:
            out.add((w, h))
            out.add((h, w))
        w += step
    return sorted(out)


def to_step(x, step):
    v = int(x + 0.5)
    return v - v % step


def choose(image, settings, buckets):
    w, h = image
    ar = w / h
    if settings["enable_bucket"] and settings["bucket_no_upscale"]:
        step = settings["bucket_reso_steps"]
        area = settings["resolution"][0] * settings["resolution"][1]
        if w * h > area:
            rw = math.sqrt(area * ar)
            rh = area / rw
            bw = to_step(rw, step)
            bh_w = to_step(bw / ar, step)
            bh = to_step(rh, step)
            bw_h = to_step(bh * ar, step)
            if abs(bw / bh_w - ar) < abs(bw_h / bh - ar):
                resized = (bw, int(bw / ar + 0.5))
            else:
                resized = (int(bh * ar + 0.5), bh)
        else:
            resized = (w, h)
        bucket = (resized[0] - resized[0] % step, resized[1] - resized[1] % step)
    else:
        if (w, h) in buckets:
            bucket = (w, h)
        else:
            errors = [abs(bw / bh - ar) for bw, bh in buckets]
            bucket = buckets[errors.index(min(errors))]
        if ar > bucket[0] / bucket[1]:
            s = bucket[1] / h
        else:
            s = bucket[0] / w
        resized = (int(w * s + 0.5), int(h * s + 0.5))
    return bucket, resized, bucket[0] / bucket[1] - ar


def crop_box(bucket, image):
    bar = bucket[0] / bucket[1]
    iar = image[0] / image[1]
    if bar > iar:
        fw, fh = bucket[1] * iar, bucket[1]
    else:
        fw, fh = bucket[0], bucket[0] / iar
    left = math.floor((bucket[0] - fw) / 2)
    top = math.floor((bucket[1] - fh) / 2)
    return [float(left), float(top), float(left + fw), float(top + fh)]


IMAGES = [
    (512, 512), (768, 512), (512, 768), (1024, 683), (683, 1024), (1920, 1080), (1080, 1920), (4000, 3000),
    (3000, 4000), (640, 480), (300, 900), (900, 300), (2000, 500), (500, 2000), (333, 777), (1234, 567),
    (1023, 1025), (64, 64), (100, 60), (60, 100), (48, 32), (32, 48), (40, 24), (24, 40), (16, 16), (2560, 1440),
    (832, 1216), (1216, 832), (257, 255), (7, 5), (1, 1),
]

SETTINGS = [
    ("sd15_default", dict(resolution=[512, 512], enable_bucket=True, min_bucket_reso=256, max_bucket_reso=1024,
                          bucket_reso_steps=64, bucket_no_upscale=False)),
    ("sdxl_1024", dict(resolution=[1024, 1024], enable_bucket=True, min_bucket_reso=512, max_bucket_reso=2048,
                       bucket_reso_steps=64, bucket_no_upscale=False)),
    ("rect_512x768_steps32", dict(resolution=[512, 768], enable_bucket=True, min_bucket_reso=320,
                                  max_bucket_reso=960, bucket_reso_steps=32, bucket_no_upscale=False)),
    ("no_upscale_512", dict(resolution=[512, 512], enable_bucket=True, min_bucket_reso=256, max_bucket_reso=1024,
                            bucket_reso_steps=64, bucket_no_upscale=True)),
    ("no_upscale_1024_steps32", dict(resolution=[1024, 1024], enable_bucket=True, min_bucket_reso=256,
                                     max_bucket_reso=2048, bucket_reso_steps=32, bucket_no_upscale=True)),
    ("tiny_32_steps16", dict(resolution=[32, 32], enable_bucket=True, min_bucket_reso=16, max_bucket_reso=64,
                             bucket_reso_steps=16, bucket_no_upscale=False)),
    ("tiny_32_steps8", dict(resolution=[32, 32], enable_bucket=True, min_bucket_reso=16, max_bucket_reso=48,
                            bucket_reso_steps=8, bucket_no_upscale=False)),
    ("no_bucket_512x768", dict(resolution=[512, 768], enable_bucket=False, min_bucket_reso=256,
                               max_bucket_reso=1024, bucket_reso_steps=64, bucket_no_upscale=False)),
]


def main():
    cases = []
    for name, s in SETTINGS:
        if s["enable_bucket"]:
            buckets = [] if s["bucket_no_upscale"] else predefined(
                s["resolution"][0], s["resolution"][1], s["min_bucket_reso"], s["max_bucket_reso"],
                s["bucket_reso_steps"])
        else:
            buckets = [tuple(s["resolution"])]
        images, used = [], set()
        for img in IMAGES:
            step = s["bucket_reso_steps"]
            if s["enable_bucket"] and s["bucket_no_upscale"] and (img[0] < step or img[1] < step):
                continue  # no bucket for it (kohya fails on it)
            bucket, resized, err = choose(img, s, buckets)
            used.add(bucket)
            images.append({"size": list(img), "bucket": list(bucket), "resized": list(resized), "ar_error": err,
                           "crop_ltrb": crop_box(bucket, img)})
        cases.append({"name": name, "settings": s, "buckets": [list(b) for b in buckets], "images": images,
                      "used": [list(b) for b in sorted(used)]})
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump({"generator": "scripts/gen_bucket_reference.py", "cases": cases}, f, indent=1)
        f.write("\n")
    print(f"wrote {OUT}: {len(cases)} cases")


if __name__ == "__main__":
    main()
