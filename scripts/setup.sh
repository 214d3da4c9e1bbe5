#!/usr/bin/env bash
# Installs shoestring's build dependencies from Debian's packages.
# Idempotent: only packages that are missing are installed.
set -euo pipefail

PKGS=(
  build-essential cmake ninja-build ccache pkg-config
  libtorch-dev libgloo-dev          # tensors, autograd, kernels; c10d's Gloo headers
  libopenblas0-pthread              # fast fp32 BLAS for libtorch (Debian's default is the reference BLAS)
  python3-torch                     # reference vectors for tests (scripts/gen_*.py)
  python3-sentencepiece             # T5 tokenizer fixtures (scripts/gen_t5_tokenizer_fixture.py); the C++ side
                                    # reads SentencePiece models itself (data/sentencepiece.h says why)
  libtomlplusplus-dev               # config
  libcli11-dev                      # command line
  nlohmann-json3-dev                # JSON (safetensors header, metrics)
  libstb-dev                        # image read/write/resize
  libfmt-dev libspdlog-dev          # logs
  libgtest-dev libgmock-dev libbenchmark-dev
  clang libclang-rt-14-dev          # libFuzzer + sanitizer runtimes (scripts/fuzz.sh; a Recommends of clang)
  chromium                          # headless render test of report.html (tests/train/test_run_report.cpp; ~25 s, 122 MB)
)

missing=()
# npm fetches the Twemoji dataset tarball; a machine may already have it from nodejs.
if ! command -v npm >/dev/null 2>&1; then PKGS+=(npm); fi
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all dependencies present"
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
