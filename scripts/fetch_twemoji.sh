#!/usr/bin/env bash
# Fetches the Twemoji dataset used by shoestring's emoji example: the npm
# package emoji-datasource-twitter@16.0.0 (emoji.json by iamcal/emoji-data, MIT;
# 64x64 PNGs from Twemoji, (c) Twitter, Inc. and other contributors, CC-BY 4.0).
#
# Usage: scripts/fetch_twemoji.sh
# Result: ${SHOESTRING_CACHE:-$HOME/.cache/shoestring}/emoji-datasource-twitter-16.0.0/
#         holding emoji.json and img/twitter/64/*.png. The path is printed on
#         the last line of stdout.
#
# - The tarball is checked against a pinned sha512 (npm's dist.integrity);
#   a mismatch is an error and leaves nothing behind.
# - Idempotent: if the dataset is already complete (marker file present) the
#   script only prints its path.
# - Atomic: the package is unpacked into a temporary folder beside the target,
#   the marker is written last, then the folder is renamed into place.
set -euo pipefail

readonly PACKAGE="emoji-datasource-twitter"
readonly VERSION="16.0.0"
# From `npm view emoji-datasource-twitter@16.0.0 dist.integrity`.
readonly INTEGRITY="sha512-7F+uCuHH+7Qnrc15P5tnbvKkg9E6tlzi4MnT2uW1RlN4pLYTza6cP/dstIfSDMtpjFLWuZewWg8jBbuL2eyELQ=="
readonly MARKER=".shoestring-complete"

cache_dir="${SHOESTRING_CACHE:-$HOME/.cache/shoestring}"
target="${cache_dir}/${PACKAGE}-${VERSION}"

die() {
  echo "fetch_twemoji.sh: error: $*" >&2
  exit 1
}

if [[ -f "${target}/${MARKER}" ]]; then
  echo "${target}"
  exit 0
fi
if [[ -e "${target}" ]]; then
  die "${target} exists but is incomplete (no ${MARKER}); remove it and rerun"
fi

command -v npm >/dev/null 2>&1 || die "npm not found (install Node.js/npm, e.g. apt-get install npm)"
command -v tar >/dev/null 2>&1 || die "tar not found"
command -v sha512sum >/dev/null 2>&1 || die "sha512sum not found (coreutils)"
command -v base64 >/dev/null 2>&1 || die "base64 not found (coreutils)"

download_dir=""
staging=""
cleanup() {
  [[ -n "${download_dir}" ]] && rm -rf -- "${download_dir}"
  [[ -n "${staging}" ]] && rm -rf -- "${staging}"
  return 0
}
trap cleanup EXIT
trap 'exit 130' INT TERM

download_dir="$(mktemp -d "${TMPDIR:-/tmp}/shoestring-twemoji.XXXXXX")"
echo "downloading ${PACKAGE}@${VERSION} with npm pack ..." >&2
# npm pack prints the tarball's file name on stdout; notices go to stderr.
(cd "${download_dir}" && npm pack --silent "${PACKAGE}@${VERSION}" >/dev/null) \
  || die "npm pack ${PACKAGE}@${VERSION} failed (is the npm registry reachable?)"
tarball="${download_dir}/${PACKAGE}-${VERSION}.tgz"
[[ -f "${tarball}" ]] || die "npm pack did not produce ${tarball}"

# npm's integrity string is "sha512-" + base64 of the raw 64-byte digest.
actual="sha512-$(sha512sum "${tarball}" | cut -d' ' -f1 | xxd -r -p | base64 -w0)"
if [[ "${actual}" != "${INTEGRITY}" ]]; then
  die "checksum mismatch for ${PACKAGE}-${VERSION}.tgz: expected ${INTEGRITY}, got ${actual}"
fi

mkdir -p "${cache_dir}"
staging="$(mktemp -d "${cache_dir}/.${PACKAGE}-${VERSION}.tmp.XXXXXX")"
tar -xzf "${tarball}" -C "${staging}" || die "cannot unpack ${tarball}"
[[ -f "${staging}/package/emoji.json" ]] || die "package has no emoji.json"
[[ -d "${staging}/package/img/twitter/64" ]] || die "package has no img/twitter/64/"
count="$(find "${staging}/package/img/twitter/64" -maxdepth 1 -name '*.png' | wc -l)"
echo "${PACKAGE}@${VERSION}: ${count} images" >"${staging}/package/${MARKER}"
sync -f "${staging}/package/${MARKER}" 2>/dev/null || true
mv -T "${staging}/package" "${target}" || die "cannot move the dataset to ${target}"
echo "unpacked ${count} images" >&2
echo "${target}"
