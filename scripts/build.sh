#!/usr/bin/env bash
# Configures and builds shoestring into ./build (Release). Extra arguments go
# to the build tool, e.g. `scripts/build.sh shoestring` builds only the CLI.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SHOESTRING_BUILD_DIR:-$root/build}"
jobs="${SHOESTRING_JOBS:-$(nproc)}"
if [ ! -f "$build/build.ninja" ]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release ${TORCH_DIR:+-DTorch_DIR="$TORCH_DIR"}
fi
cmake --build "$build" -j "$jobs" ${1:+--target "$@"}
