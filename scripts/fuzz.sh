#!/usr/bin/env bash
# Fuzzes the safetensors and sharded-index readers (tests/fuzz/fuzz_readers.cpp)
# with libFuzzer + ASan + UBSan for N seconds (default 60), from the seed corpus
# (tests/fuzz/corpus/) and past crashes (tests/fuzz/regressions/). Builds only
# the target and the io + core libraries, with clang, into ./build-fuzz.
# Prints executions per second; exits non-zero when an input crashed, hung
# (-timeout) or ran out of memory (-rss_limit_mb), naming the artifact to copy
# into tests/fuzz/regressions/.
# Usage: scripts/fuzz.sh [seconds]. Environment: SHOESTRING_FUZZ_BUILD_DIR
# (default ./build-fuzz), SHOESTRING_JOBS.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SHOESTRING_FUZZ_BUILD_DIR:-$root/build-fuzz}"
seconds="${1:-60}"

"$root/scripts/setup.sh"
SHOESTRING_BUILD_DIR="$build" \
  SHOESTRING_CMAKE_ARGS="-DCMAKE_CXX_COMPILER=clang++ -DSHOESTRING_FUZZ=ON -DSHOESTRING_BUILD_TESTS=OFF -DSHOESTRING_BUILD_BENCH=OFF -DSHOESTRING_CUDA_KERNELS=OFF" \
  "$root/scripts/build.sh" fuzz_readers

# New inputs go to build-fuzz/corpus (the first folder); the committed ones are read only.
mkdir -p "$build/corpus" "$build/artifacts"
export ASAN_OPTIONS="${ASAN_OPTIONS:-}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
log="$build/fuzz.log"
set +e
"$build/fuzz_readers" -max_total_time="$seconds" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
  -print_final_stats=1 -artifact_prefix="$build/artifacts/" \
  "$build/corpus" "$root/tests/fuzz/corpus" "$root/tests/fuzz/regressions" >"$log" 2>&1
rc=$?
set -e
runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
time=$(sed -n 's/^Done [0-9]* runs in \([0-9]*\) second.*/\1/p' "$log" | tail -1)
if [ -n "$runs" ] && [ -n "$time" ] && [ "$time" -gt 0 ]; then
  echo "fuzz: $runs executions in $time s: $((runs / time)) exec/s"
fi
if [ "$rc" -ne 0 ]; then
  tail -n 60 "$log"
  echo "fuzz: FAILED (exit $rc): fix the finding, then copy the artifact above from $build/artifacts/ into tests/fuzz/regressions/"
  exit "$rc"
fi
echo "fuzz: no crash, hang or out-of-memory in ${seconds} s (log: $log)"
