#!/usr/bin/env bash
# The main job (README): install dependencies, build, fetch the Twemoji set,
# train the emoji example, and write sample grids.
# Extra arguments go to `shoestring train`, e.g. --max-steps 200 or --set seed=1.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
"$root/scripts/build.sh" shoestring
"$root/scripts/fetch_twemoji.sh"
out="${SHOESTRING_RUN_DIR:-$root/runs/emoji-$(date +%Y%m%d-%H%M%S)}"
# This small model's matrix products are small: OpenBLAS's own threads, spinning
# beside libtorch's OpenMP threads, cost more than they give (0.53 vs 0.62 s/step
# at 16 px on 2 AVX2 cores). Large models keep the default (2 threads: 1.7x
# faster for a 4096x1280x1280 product there).
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
"$root/build/shoestring" train "$root/examples/emoji.toml" --output-dir "$out" "$@"
"$root/build/shoestring" sample "$out/model.safetensors" \
  --prompt "grinning face" --prompt "blue heart" --prompt "green heart" --prompt "pile of poo" \
  --count 6 --out "$out/final_samples.png"
echo "run folder: $out"
echo "sample grids: $out/samples/ and $out/final_samples.png"
echo "report: $out/report.html (plots, sample grids over time, config, machine)"
