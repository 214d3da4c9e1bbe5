#!/usr/bin/env bash
# The GPU check: on a machine with a CUDA GPU and a PyTorch installation with
# CUDA, but no network and none of our Debian packages, build shoestring
# against that PyTorch's libtorch and run, within 10 minutes in all:
#   - tests/cuda (GPU == CPU bits for SR, the optimizer steps, SR gradient
#     accumulation and 8-bit quantization; a short training run; the CUDA
#     memory ledger's categories),
#   - `shoestring train examples/emoji.toml --device cuda --max-steps 20`,
#   - `bench/model_step --arch sdxl --resolution 1024 --device cuda`, and
#     with --offload-params --no-fused when 2 minutes are left,
# and print one table (check, result, numbers).
#
# Two steps:
#   scripts/gpu_check.sh --pack   on a machine with the Debian packages
#                                 (scripts/setup.sh): copies the header-only
#                                 dependencies (toml++, CLI11, nlohmann-json,
#                                 fmt, spdlog, stb) and googletest's source
#                                 into build-gpu-deps/ (git-ignored, ~8 MiB),
#                                 which travels with the working tree (the
#                                 device tool: carry ["build-gpu-deps"]).
#   scripts/gpu_check.sh          on the GPU machine.
#   scripts/gpu_check.sh --dry-run  the build logic without a GPU: a CPU
#                                 build against the same variables (no GPU
#                                 probe, no CUDA required), then the table.
#
# Environment (all optional):
#   SHOESTRING_TORCH_PREFIX  libtorch's CMake prefix (default: python3's
#                            torch.utils.cmake_prefix_path)
#   SHOESTRING_TORCH_ABI     0 or 1, libtorch's _GLIBCXX_USE_CXX11_ABI (default:
#                            torch._C._GLIBCXX_USE_CXX11_ABI; the build must match)
#   SHOESTRING_DEPS_DIR      the --pack folder (default build-gpu-deps)
#   SHOESTRING_GPU_BUILD_DIR build folder (default build-gpu)
#   CUDACXX                  nvcc (default: PATH, then /usr/local/cuda/bin/nvcc)
#   SHOESTRING_JOBS          build jobs (default: all cores)
#   SHOESTRING_GPU_CHECK_BUDGET  seconds for the whole run (default 570)
#   SHOESTRING_GPU_CHECK_TARGETS  build targets instead of "shoestring model_step"
#                            (+ test_cuda), e.g. for a quick --dry-run
# Exit status: 0 when every check passed (skips allowed), 1 otherwise, 2 for
# a missing prerequisite (no GPU, no PyTorch, no nvcc, no --pack folder).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
deps="${SHOESTRING_DEPS_DIR:-$root/build-gpu-deps}"
build="${SHOESTRING_GPU_BUILD_DIR:-$root/build-gpu}"
jobs="${SHOESTRING_JOBS:-$(nproc)}"
start=$(date +%s)
budget="${SHOESTRING_GPU_CHECK_BUDGET:-570}"  # seconds for the whole run, under the 10 minutes

die() {
  echo "gpu_check: $*" >&2
  exit 2
}

# ---- --pack ------------------------------------------------------------------
pack() {
  local inc=/usr/include
  for d in toml++ CLI nlohmann fmt spdlog stb; do
    [ -d "$inc/$d" ] || die "--pack: $inc/$d is missing (install the Debian packages: scripts/setup.sh)"
  done
  [ -f /usr/src/googletest/CMakeLists.txt ] || die "--pack: /usr/src/googletest is missing (Debian package googletest)"
  rm -rf "$deps"
  mkdir -p "$deps/include"
  for d in toml++ CLI nlohmann fmt spdlog; do cp -r "$inc/$d" "$deps/include/"; done
  cp "$inc"/stb/*.h "$deps/include/"
  cp -r /usr/src/googletest "$deps/googletest"
  # stb's implementations (Debian compiles them into libstb; here one file).
  cat >"$deps/stb_impl.c" <<'EOF'
/* Written by scripts/gpu_check.sh --pack: the implementations of the stb
   headers shoestring uses (Debian ships them compiled as libstb). */
#define STB_IMAGE_IMPLEMENTATION
#include "stb_image.h"
#define STB_IMAGE_WRITE_IMPLEMENTATION
#include "stb_image_write.h"
#define STB_IMAGE_RESIZE_IMPLEMENTATION
#include "stb_image_resize.h"
EOF
  echo "gpu_check: packed $(du -sh "$deps" | cut -f1) into $deps ($(find "$deps" -type f | wc -l) files)"
  echo "gpu_check: on the GPU machine run scripts/gpu_check.sh with build-gpu-deps carried along"
}

# ---- the table ---------------------------------------------------------------
rows=()
failed=0
row() {  # check, result, numbers
  rows+=("$1"$'\t'"$2"$'\t'"$3")
  case "$2" in FAIL*) failed=1 ;; esac
}
print_table() {
  echo
  printf '%-28s | %-6s | %s\n' check result numbers
  printf '%s\n' "-----------------------------+--------+------------------------------------------------------------"
  local r
  for r in "${rows[@]}"; do
    IFS=$'\t' read -r c res num <<<"$r"
    printf '%-28s | %-6s | %s\n' "$c" "$res" "$num"
  done
}
left() { echo $((budget - ($(date +%s) - start))); }

# ---- the check -----------------------------------------------------------------
check() {
  local dry="$1"
  [ -f "$deps/include/toml++/toml.h" ] ||
    die "$deps is missing or incomplete: run scripts/gpu_check.sh --pack on a machine with the Debian packages, and carry the folder along"
  local prefix="${SHOESTRING_TORCH_PREFIX:-}" abi="${SHOESTRING_TORCH_ABI:-}"
  if [ -z "$prefix" ] || [ -z "$abi" ]; then
    command -v python3 >/dev/null || die "python3 not found: set SHOESTRING_TORCH_PREFIX and SHOESTRING_TORCH_ABI"
    local info
    info="$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path); print(int(torch._C._GLIBCXX_USE_CXX11_ABI)); print(torch.__version__)' 2>/dev/null)" ||
      die "python3 cannot import torch: install PyTorch (with CUDA), or set SHOESTRING_TORCH_PREFIX and SHOESTRING_TORCH_ABI"
    prefix="${prefix:-$(sed -n 1p <<<"$info")}"
    abi="${abi:-$(sed -n 2p <<<"$info")}"
  fi
  [ "$abi" = 0 ] || [ "$abi" = 1 ] || die "SHOESTRING_TORCH_ABI must be 0 or 1, got '$abi'"
  [ -d "$prefix" ] || die "libtorch's CMake prefix $prefix does not exist"

  local gpu="none (dry run)" cuda_args=(-DSHOESTRING_CUDA=AUTO)
  if [ "$dry" = 0 ]; then
    if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
      gpu="$(nvidia-smi --query-gpu=name,memory.total,compute_cap --format=csv,noheader | head -1)"
    else
      die "no CUDA GPU visible (nvidia-smi missing or lists no device): this check needs one; --dry-run checks the build logic without"
    fi
    local nvcc="${CUDACXX:-$(command -v nvcc || true)}"
    [ -n "$nvcc" ] || [ ! -x /usr/local/cuda/bin/nvcc ] || nvcc=/usr/local/cuda/bin/nvcc
    [ -n "$nvcc" ] || die "nvcc not found (PATH, CUDACXX, /usr/local/cuda/bin/nvcc): libtorch's CMake config and kernels/cuda need the CUDA toolkit"
    export CUDACXX="$nvcc"
    local cap
    cap="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d '. ')"
    cuda_args=(-DSHOESTRING_CUDA=ON ${cap:+-DCMAKE_CUDA_ARCHITECTURES="$cap"})
    gpu="$gpu; $(nvidia-smi -L | wc -l) GPU(s) (two or more: tests/cuda also runs NCCL with two ranks)"
    # nccl.h for c10d's NCCL group (dist/nccl_collectives_cuda.cpp): pip's
    # PyTorch ships it in the nvidia-nccl package, not in its own headers.
    local nccl_include
    nccl_include="$(python3 -c 'import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], "include"))' 2>/dev/null || true)"
    [ -n "$nccl_include" ] && [ -f "$nccl_include/nccl.h" ] && cuda_args+=(-DSHOESTRING_NCCL_INCLUDE_DIR="$nccl_include")
  fi
  row "machine" "info" "gpu: $gpu; libtorch: $prefix (C++11 ABI $abi); $(nproc) cores"

  # Build: the CUDA tests, the CLI and the model-step bench.
  local gen=() log="$build/gpu_check_build.log"
  command -v ninja >/dev/null && gen=(-G Ninja)
  mkdir -p "$build"
  local t0 targets
  # shellcheck disable=SC2206  # a word list is intended
  targets=(${SHOESTRING_GPU_CHECK_TARGETS:-shoestring model_step})
  t0=$(date +%s)
  [ "$dry" = 0 ] && targets+=(test_cuda)
  if cmake -S "$root" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
    -DSHOESTRING_DEPS_DIR="$deps" -DCMAKE_CXX_FLAGS="-D_GLIBCXX_USE_CXX11_ABI=$abi" "${cuda_args[@]}" >"$log" 2>&1 &&
    timeout "$(left)" cmake --build "$build" -j "$jobs" --target "${targets[@]}" >>"$log" 2>&1; then
    local mode
    mode="$(grep -o 'shoestring: CUDA build\|CUDA sources compile-checked only\|nvcc not found' "$log" | head -1 || true)"
    row "build" "ok" "$(($(date +%s) - t0)) s (${targets[*]}; ${mode:-no CUDA})"
  else
    row "build" "FAIL" "$(($(date +%s) - t0)) s, see $log: $(grep -m1 -i 'error' "$log" | cut -c1-100)"
    print_table
    exit 1
  fi

  # tests/cuda
  if [ "$dry" = 1 ]; then
    row "tests/cuda" "skip" "dry run (test_cuda is built only against a CUDA libtorch)"
  else
    local json="$build/test_cuda.json" out
    out="$(timeout "$(left)" "$build/test_cuda" --gtest_output=json:"$json" 2>&1 | tail -40)" || true
    if [ -f "$json" ]; then
      local summary
      summary="$(python3 - "$json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
failed, skipped, passed = [], 0, 0
for s in r["testsuites"]:
    for t in s["testsuite"]:
        if t.get("failures"): failed.append(s["name"] + "." + t["name"])
        elif t.get("result") == "SKIPPED": skipped += 1
        else: passed += 1
print(("FAIL" if failed else "ok") + "\t" + f"{passed} passed, {len(failed)} failed, {skipped} skipped"
      + (": " + ", ".join(failed) if failed else ""))
EOF
      )"
      row "tests/cuda" "${summary%%$'\t'*}" "${summary#*$'\t'}"
    else
      row "tests/cuda" "FAIL" "no result (crashed or timed out): $(tail -1 <<<"$out")"
    fi
  fi

  # A short training run of the emoji example; the fixture emoji when the
  # example's data set (fetched from the network) is absent.
  local run_dir="$build/gpu_check_run" data=() tlog="$build/gpu_check_train.log"
  rm -rf "$run_dir"
  if [ ! -d "${SHOESTRING_CACHE:-$HOME/.cache/shoestring}/emoji-datasource-twitter-16.0.0" ]; then
    data=(--set "train_data_dir=\"$root/tests/data/twemoji\"")
  fi
  local device=(--device cuda)
  [ "$dry" = 1 ] && device=(--device cpu)
  if ! "$build/shoestring" train --help 2>/dev/null | grep -q -- '--device'; then
    if [ "$dry" = 0 ]; then
      row "train emoji --device cuda" "FAIL" "this build's \`shoestring train\` has no --device flag"
      device=()
    else
      device=()  # the dry run trains on the CPU either way
    fi
  fi
  t0=$(date +%s)
  if [ "$dry" = 0 ] && [ ${#device[@]} -eq 0 ]; then
    :  # reported above
  elif timeout "$(left)" "$build/shoestring" train "$root/examples/emoji.toml" ${device[@]+"${device[@]}"} --max-steps 20 \
    --output-dir "$run_dir" ${data[@]+"${data[@]}"} >"$tlog" 2>&1; then
    row "train emoji ${device[*]:-(cpu)}" "ok" "20 steps in $(($(date +%s) - t0)) s${data:+ (fixture data)}; $(grep -o 'loss [0-9.e+-]*' "$tlog" | tail -1)"
  else
    row "train emoji ${device[*]:-(cpu)}" "FAIL" "$(($(date +%s) - t0)) s: $(grep -v '^\s*$' "$tlog" | tail -1 | cut -c1-110)"
  fi

  # bench/model_step, SDXL at 1024 px: as planned, then with offload_params
  # (the weights of the checkpointed blocks streamed from pinned host memory;
  # its device peak is the number a small card cares about), when 2 minutes
  # of the budget are left for it.
  local bench="$build/bench/model_step" label args
  for label in "model_step sdxl 1024" "model_step sdxl 1024 offload_params"; do
    args=(--arch sdxl --resolution 1024 --device cuda --json)
    [[ "$label" == *offload_params ]] && args+=(--offload-params --no-fused)
    if ! "$bench" --help 2>/dev/null | grep -q -- '--device'; then
      row "$label" "skip" "this build's bench/model_step has no --device flag"
    elif [ "$dry" = 1 ]; then
      row "$label" "skip" "dry run (SDXL at 1024 px needs the GPU)"
    elif [[ "$label" == *offload_params ]] && [ "$(left)" -lt 120 ]; then
      row "$label" "skip" "$(left) s of the budget left"
    else
      local bj
      t0=$(date +%s)
      if bj="$(timeout "$(left)" "$bench" "${args[@]}" 2>&1 | tail -1)" &&
        python3 -c 'import json,sys; json.loads(sys.argv[1])' "$bj" 2>/dev/null; then
        row "$label" "ok" "$(python3 - "$bj" <<'EOF'
import json, sys
j = json.loads(sys.argv[1]); g = 2.0 ** 30
print(f"{j['seconds_per_step']:.2f} s/step, peak {j['peak_bytes'] / g:.2f} GiB, "
      f"planned {j['predicted_peak_bytes'] / g:.2f} GiB ({100 * j['prediction_error']:+.1f}%)")
EOF
        )"
      else
        row "$label" "FAIL" "$(($(date +%s) - t0)) s: $(cut -c1-110 <<<"$bj")"
      fi
    fi
  done
  row "total" "info" "$(($(date +%s) - start)) s of the ${budget} s budget"
  print_table
  exit "$failed"
}

case "${1:-}" in
  --pack) pack ;;
  --dry-run) check 1 ;;
  "") check 0 ;;
  -h | --help) sed -n '2,36p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' ;;
  *) die "unknown argument '$1' (expected --pack, --dry-run or nothing)" ;;
esac
