#!/usr/bin/env bash
# bench/scale.sh: data parallel and ZeRO stages over loopback Gloo on this
# machine. For each world size W (default 1 2 4) and zero_stage (0 1 2 3), it
# trains the emoji example for a few steps with `shoestring launch --nproc W`
# and prints rank 0's step time (median of the steps after the first), its
# peak bytes by ledger category at the last step, and `shoestring plan
# --world-size W`'s prediction of that peak beside it. All W processes share
# this machine's cores (threads divided), so step times grow with W here; the
# memory columns are what one rank of a real multi-GPU run holds. Stage 3
# shards the weights of checkpointed blocks, so the rows marked "c" (0c, 2c,
# 3c) run with gradient_checkpointing = true: compare 3c with 0c and 2c, not
# with the other rows. The EMA (the example's ema_decay) is sharded with
# its tensors from stage 1 on.
#
#   bench/scale.sh [BUILD_DIR] [--worlds "1 2 4"] [--stages "0 1 2 0c 2c 3c"] [--steps 4] [--config examples/emoji.toml]
#
# Prints the CPU line of the first run (core/cpu_features.h) and one table.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$root/build"
worlds="1 2 4"
steps=4
stages="0 1 2 0c 2c 3c"
config="$root/examples/emoji.toml"
while [ $# -gt 0 ]; do
  case "$1" in
    --worlds) worlds="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --stages) stages="$2"; shift 2 ;;
    --config) config="$2"; shift 2 ;;
    -h|--help) sed -n 2,17p "$0"; exit 0 ;;
    -*) echo "bench/scale.sh: unknown option $1" >&2; exit 2 ;;
    *) build="$1"; shift ;;
  esac
done
exe="$build/shoestring"
[ -x "$exe" ] || { echo "bench/scale.sh: $exe not found (build it: scripts/build.sh shoestring)" >&2; exit 2; }
[ "$steps" -ge 2 ] 2>/dev/null || { echo "bench/scale.sh: --steps must be >= 2" >&2; exit 2; }
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
work="$(mktemp -d "${TMPDIR:-/tmp}/shoestring_scale.XXXXXX")"
trap 'rm -rf "$work"' EXIT
printed_cpu=0
printf '%-3s %-5s %9s %10s %10s %8s %9s %9s %9s %9s\n' W stage "s/step" "peak" "planned" "diff" weights grads state temps
for w in $worlds; do
  for label in $stages; do
    stage="${label%c}"
    extra=()
    if [ "$label" != "$stage" ]; then extra=(--set gradient_checkpointing=true); fi
    if [ "$w" = 1 ] && [ "$stage" != 0 ]; then continue; fi
    run="$work/w${w}_s${label}"
    if ! "$exe" launch --nproc "$w" -- train "$config" --max-steps "$steps" --output-dir "$run" \
        --set max_train_minutes=0 --set zero_stage="$stage" --set sample_prompts='["ghost"]' \
        --set sample_seeds=1 --set sample_steps=1 "${extra[@]}" > "$work/log" 2>&1; then
      echo "bench/scale.sh: W=$w zero_stage=$stage failed; its log:" >&2
      tail -20 "$work/log" >&2
      exit 1
    fi
    if [ "$printed_cpu" = 0 ]; then
      grep -m1 -o "CPU: .*" "$work/log" || true
      printed_cpu=1
    fi
    planned=$("$exe" plan "$config" --world-size "$w" --set zero_stage="$stage" "${extra[@]}" --json 2>/dev/null)
    /usr/bin/python3 - "$run/metrics.jsonl" "$w" "$label" "$planned" <<'EOF'
import json, statistics, sys
path, w, stage, planned = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
rows = [json.loads(l) for l in open(path) if l.strip()]
last = rows[-1]
mib = lambda b: b / 2**20
seconds = statistics.median(r["seconds"] for r in rows[1:])
peak, pred = last["peak_bytes"], planned["predicted_peak_bytes"]
print("%-3s %-5s %9.3f %7.1f MiB %6.1f MiB %+7.1f%% %5.1f MiB %5.1f MiB %5.1f MiB %5.1f MiB" % (
    w, stage, seconds, mib(peak), mib(pred), 100.0 * (pred - peak) / peak, mib(last["peak_weights_bytes"]),
    mib(last["peak_gradients_bytes"]), mib(last["peak_optimizer_state_bytes"]), mib(last["peak_temporaries_bytes"])))
EOF
  done
done
echo "rank 0's last-step peaks (ledger); planned: shoestring plan --world-size W (the rank owning the most state)"
