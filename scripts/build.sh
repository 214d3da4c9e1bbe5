#!/usr/bin/env bash
# Configures and builds shoestring into ./build (Release). Extra arguments go
# to the build tool, e.g. `scripts/build.sh shoestring` builds only the CLI.
# Environment: SHOESTRING_BUILD_DIR (default ./build), SHOESTRING_JOBS
# (default: all cores), SHOESTRING_WERROR=ON (warnings are errors; CI sets it),
# SHOESTRING_CMAKE_ARGS (more -D options, e.g. for the sanitizer build).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${SHOESTRING_BUILD_DIR:-$root/build}"
jobs="${SHOESTRING_JOBS:-$(nproc)}"
# shellcheck disable=SC2206  # word splitting of SHOESTRING_CMAKE_ARGS is intended
options=(${SHOESTRING_WERROR:+-DSHOESTRING_WERROR="$SHOESTRING_WERROR"} ${SHOESTRING_CMAKE_ARGS:-})
# Configure on the first build, and again when options are given (they are
# kept in the build folder's cache).
if [ ! -f "$build/build.ninja" ] || [ ${#options[@]} -gt 0 ]; then
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release ${TORCH_DIR:+-DTorch_DIR="$TORCH_DIR"} \
    ${options[@]+"${options[@]}"}
fi
cmake --build "$build" -j "$jobs" ${1:+--target "$@"}
