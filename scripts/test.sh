#!/usr/bin/env bash
# The test command (README, CI): install dependencies, build, run every test.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
"$root/scripts/build.sh"
cd "${SHOESTRING_BUILD_DIR:-$root/build}"
ctest --output-on-failure -j "${SHOESTRING_TEST_JOBS:-2}" --timeout 600
