#!/usr/bin/env bash
# bench/fused_plan.sh: `shoestring plan --world-size N` against rank 0's
# measured peak for fused backward (and accumulation) on several ranks, the
# rows of docs/training.md's "Memory per rank" tables: the emoji example with
# gradient checkpointing, batch 4 per rank, no EMA, 8 steps, over loopback
# Gloo on this machine. Prints the CPU line, then per run rank 0's steady
# peak (steps 2-8) and step 1's, each beside the plan and its error.
#
#   bench/fused_plan.sh [BUILD_DIR]
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-$root/build}"
exe="$build/shoestring"
[ -x "$exe" ] || { echo "bench/fused_plan.sh: $exe not found (build it: scripts/build.sh shoestring)" >&2; exit 2; }
work="$(mktemp -d "${TMPDIR:-/tmp}/shoestring_fused_plan.XXXXXX")"
trap 'rm -rf "$work"' EXIT
printed_cpu=0

run() {
  local name="$1" n="$2"
  shift 2
  local out="$work/run"
  rm -rf "$out"
  if ! "$exe" launch --nproc "$n" -- train "$root/examples/emoji.toml" --set gradient_checkpointing=true \
    --set train_batch_size=4 --set ema_decay=0 --set max_train_minutes=0 --max-steps 8 --set save_every_n_steps=0 \
    --set sample_every_n_steps=0 --output-dir "$out" "$@" >"$work/log" 2>&1; then
    echo "$name: FAILED: $(tail -n 1 "$work/log")"
    return
  fi
  if [ "$printed_cpu" = 0 ]; then
    grep -m1 -o "CPU: .*" "$work/log" || true
    printed_cpu=1
  fi
  python3 - "$exe" "$out" "$n" "$name" <<'PY'
import json, subprocess, sys
exe, out, n, name = sys.argv[1:5]
recs = [json.loads(l) for l in open(out + "/metrics.jsonl") if l.strip()]
step1, steady = recs[0]["peak_bytes"], max(r["peak_bytes"] for r in recs[1:])
p = json.loads(subprocess.run([exe, "plan", out + "/config.toml", "--world-size", n, "--vocab-size", "239", "--json"],
                              capture_output=True, text=True, check=True).stdout)
pp, p1, M = p["predicted_peak_bytes"], p["first_step_peak_bytes"], 2.0 ** 20
print(f"{name:52s} steady {steady / M:6.1f} MiB planned {pp / M:6.1f} ({100 * (pp / steady - 1):+5.1f}%)"
      f"  step 1 {step1 / M:6.1f} planned {p1 / M:6.1f} ({100 * (p1 / step1 - 1):+5.1f}%)")
PY
}

fused=(--set fused_backward_pass=true)
fp32_accum=(--set gradient_accumulation_steps=2 --set full_bf16=false)
run "fused AdamW, accumulation 2, stage 0, 2 ranks" 2 "${fused[@]}" "${fp32_accum[@]}" --set zero_stage=0
run "fused AdamW, accumulation 2, stage 2, 2 ranks" 2 "${fused[@]}" "${fp32_accum[@]}" --set zero_stage=2
run "fused AdamW, accumulation 2, stage 3, 2 ranks" 2 "${fused[@]}" "${fp32_accum[@]}" --set zero_stage=3
run "fused Lion, no accumulation, stage 2, 2 ranks" 2 "${fused[@]}" --set zero_stage=2 --set optimizer_type=Lion \
  --set 'optimizer_args=[]'
run "fused AdamW, no accumulation, stage 3, 2 ranks" 2 "${fused[@]}" --set zero_stage=3
run "fused Adafactor, no accumulation, stage 3, 2 ranks" 2 "${fused[@]}" --set zero_stage=3 \
  --set optimizer_type=Adafactor --set 'optimizer_args=[]'
run "fused AdamW8bit, no accumulation, stage 3, 3 ranks" 3 "${fused[@]}" --set zero_stage=3 \
  --set optimizer_type=AdamW8bit
