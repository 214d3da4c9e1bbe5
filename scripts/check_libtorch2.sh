#!/usr/bin/env bash
# shellcheck disable=SC2016  # dpkg-query -f formats are literal
# Builds shoestring against libtorch 2.x and runs the test suite, inside a
# Debian 13 (trixie) root (libtorch-dev 2.6, gcc 14) made with debootstrap.
#
#   scripts/check_libtorch2.sh              # everything, then the whole suite (ctest)
#   scripts/check_libtorch2.sh test_core test_io   # these targets in turn, each
#                                           # test executable's tests as soon as it is built
#   SHOESTRING_CUDA_LINK=1 scripts/check_libtorch2.sh   # then also compile and link
#                                           # against trixie's CUDA libtorch (no tests)
#   SHOESTRING_CUDA_LINK=only ...           # only that
#
# The root lives in the cache folder and is reused:
# ${SHOESTRING_CACHE:-~/.cache/shoestring}/trixie-root (SHOESTRING_TRIXIE_ROOT
# overrides). The working tree is bind-mounted at /src inside it and built into
# ./build-libtorch2; ccache keeps its own cache in the cache folder
# (trixie-ccache), so a rerun only compiles what changed. The mirror is the one
# the host's apt uses (/etc/apt/sources.list*), or SHOESTRING_DEBIAN_MIRROR.
#
# The CUDA check uses a second root, trixie-cuda-root: libtorch-cuda-dev
# (contrib) conflicts with libtorch-dev, and its CUDA libraries and nvcc are in
# non-free. It builds SHOESTRING_CUDA_TARGETS (default: shoestring, the whole
# engine) into ./build-libtorch2-cuda.
#
# Environment: SHOESTRING_JOBS (default 2), SHOESTRING_TEST_JOBS (default 2),
# SHOESTRING_WERROR (default ON, as CI), SHOESTRING_CTEST_ARGS (more ctest
# arguments). Needs root (debootstrap, mount, chroot); uses sudo when not
# root, as setup.sh does. Nothing stays mounted when it ends, however it ends.
set -euo pipefail

src="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${SHOESTRING_CACHE:-$HOME/.cache/shoestring}"
cpu_root="${SHOESTRING_TRIXIE_ROOT:-$cache/trixie-root}"
cuda_root="${cpu_root%-root}-cuda-root"
ccache_dir="$cache/trixie-ccache"
jobs="${SHOESTRING_JOBS:-2}"
test_jobs="${SHOESTRING_TEST_JOBS:-2}"
werror="${SHOESTRING_WERROR:-ON}"
cuda_link="${SHOESTRING_CUDA_LINK:-0}"
start=$(date +%s)

# Arguments are checked before anything is downloaded, mounted or built.
for arg in "$@"; do
  case "$arg" in
    -h | --help)
      sed -n '3,/^$/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    -*)
      echo "check_libtorch2: unknown option '$arg' (arguments are build targets, e.g. test_core; --help)" >&2
      exit 2
      ;;
  esac
  if ! [[ "$arg" =~ ^[A-Za-z0-9_]+$ ]]; then
    echo "check_libtorch2: '$arg' is not a build target name (letters, digits, _)" >&2
    exit 2
  fi
done
case "$cuda_link" in
  0 | 1 | only) ;;
  *)
    echo "check_libtorch2: SHOESTRING_CUDA_LINK='$cuda_link': expected 0, 1 or only" >&2
    exit 2
    ;;
esac

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
log() { echo "check_libtorch2: $*"; }

# --- The mirror the host's apt uses (deb822 "URIs:" or one-line "deb URL") ---
host_mirror() {
  local f line u
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list; do
    [ -r "$f" ] || continue
    while read -r line; do
      case "$line" in
        URIs:*) line="${line#URIs:}" ;;
        deb\ *) line="$(echo "$line" | sed -E 's/^deb +(\[[^]]*\] +)?//')" ;;
        *) continue ;;
      esac
      for u in $line; do
        # The main archive, not debian-security, debian-ports or another vendor.
        case "$u" in */debian | */debian/) echo "${u%/}"; return 0 ;; esac
      done
    done <"$f"
  done
  echo "http://deb.debian.org/debian"
}
mirror="${SHOESTRING_DEBIAN_MIRROR:-$(host_mirror)}"
security="${mirror%/debian}/debian-security"

# --- Mounts, undone on any exit ---
mounted=()
unmount_all() {
  local i
  for ((i = ${#mounted[@]} - 1; i >= 0; i--)); do
    $SUDO umount "${mounted[$i]}" 2>/dev/null || $SUDO umount -l "${mounted[$i]}" || true
  done
  mounted=()
}
trap unmount_all EXIT
trap 'exit 130' INT TERM
bind() {  # bind SRC DEST [remount options]
  $SUDO mkdir -p "$2"
  $SUDO mount --bind "$1" "$2"
  mounted+=("$2")
  if [ -n "${3:-}" ]; then $SUDO mount -o "remount,bind,$3" "$2"; fi
}
mounts_under() { awk -v r="$1" '$2 == r || index($2, r "/") == 1 { print $2 }' /proc/mounts; }

R=""  # the root in_root runs in
in_root() {
  $SUDO chroot "$R" /usr/bin/env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    LANG=C.UTF-8 DEBIAN_FRONTEND=noninteractive CCACHE_DIR=/ccache CCACHE_BASEDIR=/src CCACHE_MAXSIZE=5G \
    CCACHE_SLOPPINESS=include_file_ctime,include_file_mtime,pch_defines,time_macros \
    "$@"
}

# enter_root DIR COMPONENTS: debootstraps DIR once, points its apt at the
# mirror and mounts /proc, /sys, /dev, the ccache folder and the working tree.
enter_root() {
  local dir="$1" components="$2"
  if ! command -v debootstrap >/dev/null 2>&1; then
    log "installing debootstrap"
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap
  fi
  if [ -n "$(mounts_under "$dir")" ]; then
    echo "check_libtorch2: $dir has mounts left from elsewhere; unmount them first:" >&2
    mounts_under "$dir" >&2
    exit 1
  fi
  if [ ! -f "$dir/.shoestring-root-ok" ]; then
    if [ -e "$dir" ]; then
      log "removing the unfinished root at $dir"
      $SUDO rm -rf --one-file-system "$dir"
    fi
    log "debootstrap trixie ($components) from $mirror into $dir (a few minutes)"
    $SUDO mkdir -p "$dir"
    $SUDO debootstrap --variant=minbase --components="$components" trixie "$dir" "$mirror" \
      >"${TMPDIR:-/tmp}/shoestring-debootstrap.log" 2>&1 || {
      tail -n 20 "${TMPDIR:-/tmp}/shoestring-debootstrap.log" >&2
      exit 1
    }
    $SUDO touch "$dir/.shoestring-root-ok"
  fi
  local c="${components//,/ }"
  $SUDO tee "$dir/etc/apt/sources.list" >/dev/null <<EOF
deb $mirror trixie $c
deb $mirror trixie-updates $c
deb $security trixie-security $c
EOF
  $SUDO cp /etc/resolv.conf "$dir/etc/resolv.conf" 2>/dev/null || true
  bind /proc "$dir/proc"
  bind /sys "$dir/sys" ro
  bind /dev "$dir/dev"
  bind /dev/pts "$dir/dev/pts"
  $SUDO mkdir -p "$ccache_dir"
  bind "$ccache_dir" "$dir/ccache"
  bind "$src" "$dir/src"
  R="$dir"
}

# install_in_root PACKAGE...: apt-get installs the missing ones; apt's chatter
# goes to $apt_log. Returns apt's status.
apt_log="${TMPDIR:-/tmp}/shoestring-trixie-apt.log"
install_in_root() {
  local p missing=()
  for p in "$@"; do
    if ! in_root dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then missing+=("$p"); fi
  done
  [ ${#missing[@]} -gt 0 ] || return 0
  log "installing in $R: ${missing[*]}"
  { in_root apt-get update -qq && in_root apt-get install -y -qq --no-install-recommends "${missing[@]}"; } \
    >"$apt_log" 2>&1
}

# Dependencies: scripts/setup.sh's list, less what only fuzzing, fetching data
# and regenerating reference vectors need (clang, npm, python3-torch).
COMMON_PKGS=(
  build-essential cmake ninja-build ccache pkg-config libopenblas0-pthread
  libtomlplusplus-dev libcli11-dev nlohmann-json3-dev libstb-dev
  libfmt-dev libspdlog-dev libgtest-dev libgmock-dev libbenchmark-dev
)

build_s=0
build_in_root() {  # build_in_root BUILD_DIR [target]; -k 0: every file that fails is reported
  local t0
  t0=$(date +%s)
  in_root cmake --build "$1" -j "$jobs" ${2:+--target "$2"} -- -k 0
  build_s=$((build_s + $(date +%s) - t0))
}

# --- libtorch-dev 2.6 (CPU): build and test ---
test_rc=0
summary=""
torch_pkg=""
gcc_ver=""
if [ "$cuda_link" != only ]; then
  enter_root "$cpu_root" main,contrib
  if ! install_in_root "${COMMON_PKGS[@]}" libtorch-dev libgloo-dev; then
    tail -n 30 "$apt_log" >&2
    echo "check_libtorch2: installing the dependencies in $R failed (log: $apt_log)" >&2
    exit 1
  fi
  torch_pkg="$(in_root dpkg-query -W -f='${Version}' libtorch-dev)"
  gcc_ver="$(in_root gcc -dumpfullversion)"
  log "trixie root: libtorch-dev $torch_pkg, gcc $gcc_ver"

  build=/src/build-libtorch2
  out="$src/build-libtorch2/ctest-output.txt"
  log "building into $src/build-libtorch2 (-j$jobs, SHOESTRING_WERROR=$werror)"
  in_root cmake -S /src -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSHOESTRING_WERROR="$werror" \
    -DSHOESTRING_CUDA_KERNELS=OFF >/dev/null
  $SUDO rm -f "$out"
  run_ctest() {  # run_ctest [ctest arguments]
    local rc
    set +e
    in_root sh -c "cd '$build' && ctest --output-on-failure -j '$test_jobs' --timeout 900 $* ${SHOESTRING_CTEST_ARGS:-}" \
      2>&1 | $SUDO tee -a "$out"
    rc=${PIPESTATUS[0]}
    set -e
    if [ "$rc" -ne 0 ]; then test_rc=$rc; fi
  }
  if [ $# -eq 0 ]; then
    build_in_root "$build"
    log "running the tests"
    run_ctest
  else
    for t in "$@"; do
      build_in_root "$build" "$t"
      # The names registered for this executable: one per suite (cmake/gtest_suites.cmake), or
      # one per test for test_cli and test_dist (gtest_discover_tests).
      tests_file="$src/build-libtorch2/${t}_suites.cmake"
      [ -f "$tests_file" ] || tests_file="$src/build-libtorch2/${t}[1]_tests.cmake"
      if [ -f "$tests_file" ]; then
        sed -n 's/^add_test(\[=*\[\([^]]*\)\]=*\] .*/\1/p' "$tests_file" | $SUDO tee "$src/build-libtorch2/$t.tests" >/dev/null
        log "running the tests of $t ($(wc -l <"$src/build-libtorch2/$t.tests"))"
        run_ctest --tests-from-file "'$build/$t.tests'"
      fi
    done
  fi
  summary="$(grep -E 'tests passed|tests failed' "$out" 2>/dev/null | tr '\n' ';' || true)"
  unmount_all
fi

# --- libtorch-cuda-dev 2.6 (contrib): compile and link only ---
cuda_result="not tried (SHOESTRING_CUDA_LINK=1 tries it)"
if [ "$cuda_link" != 0 ]; then
  enter_root "$cuda_root" main,contrib,non-free
  # nvidia-cuda-toolkit (nvcc): Caffe2's CMake config needs it to find CUDA.
  # libgloo-cuda-dev: libgloo-dev's library conflicts with the CUDA one.
  if ! install_in_root "${COMMON_PKGS[@]}" libtorch-cuda-dev libgloo-cuda-dev nvidia-cuda-toolkit; then
    # nvidia-cudnn (contrib) is an installer that downloads cuDNN from NVIDIA
    # when it is configured; where that host cannot be reached it fails, and
    # the packages that depend on it stay unpacked but unconfigured. Their
    # files are all there, which is enough to compile and link.
    grep -oE "^(E:|dpkg: error).*|curl: \([0-9]+\).*|/usr/sbin/update-nvidia-cudnn.*" "$apt_log" | sort -u | sed 's/^/  apt: /'
  fi
  state="$(in_root dpkg-query -W -f='${db:Status-Abbrev}' libtorch-cuda-dev 2>/dev/null || true)"
  if [ "${state:1:1}" != i ] && [ "${state:1:1}" != U ]; then
    cuda_result="libtorch-cuda-dev could not be installed (state '${state}'; log: $apt_log)"
  else
    cuda_pkg="$(in_root dpkg-query -W -f='${Version}' libtorch-cuda-dev)"
    link_flags=""
    if in_root sh -c 'ldd /usr/lib/x86_64-linux-gnu/libtorch_cuda.so | grep -q "not found"'; then
      # libtorch_cuda.so needs libcudnn.so.9, which only the failed installer
      # provides. Our objects must still resolve every symbol they use; only
      # the missing library's own references are let through.
      link_flags="-Wl,--unresolved-symbols=ignore-in-shared-libs"
      log "missing at link time: $(in_root sh -c 'ldd /usr/lib/x86_64-linux-gnu/libtorch_cuda.so | grep "not found" | tr -s " \t" " "')"
    fi
    cbuild=/src/build-libtorch2-cuda
    log "CUDA libtorch $cuda_pkg: building ${SHOESTRING_CUDA_TARGETS:-shoestring} into $src/build-libtorch2-cuda"
    in_root cmake -S /src -B "$cbuild" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSHOESTRING_WERROR="$werror" \
      -DSHOESTRING_CUDA_KERNELS=OFF -DCMAKE_EXE_LINKER_FLAGS="$link_flags" -Wno-dev >/dev/null
    cuda_rc=0
    for t in ${SHOESTRING_CUDA_TARGETS:-shoestring}; do
      build_in_root "$cbuild" "$t" || cuda_rc=$?
    done
    if [ "$cuda_rc" -eq 0 ]; then
      cuda_result="libtorch-cuda-dev $cuda_pkg: ${SHOESTRING_CUDA_TARGETS:-shoestring} compiled and linked${link_flags:+ ($link_flags)}"
      if [ -x "$src/build-libtorch2-cuda/shoestring" ]; then
        cuda_result+="; shoestring links $(in_root sh -c "ldd $cbuild/shoestring | grep -oE 'lib(torch_cuda|c10_cuda)[^ ]*' | sort -u | tr '\n' ' '")"
      fi
    else
      cuda_result="libtorch-cuda-dev $cuda_pkg: build failed (exit $cuda_rc)"
      if [ "$test_rc" -eq 0 ]; then test_rc=$cuda_rc; fi
    fi
  fi
  unmount_all
fi

end=$(date +%s)
if [ "$cuda_link" != only ]; then
  log "libtorch-dev $torch_pkg, gcc $gcc_ver, SHOESTRING_WERROR=$werror"
  log "ctest: ${summary:-no summary (see $src/build-libtorch2/ctest-output.txt)}"
fi
log "CUDA: $cuda_result"
log "build ${build_s} s; total $((end - start)) s (root, dependencies, build and tests)"
exit "$test_rc"
