#!/usr/bin/env bash
# weightsync quick start. Installs what it needs (Debian 12, as root), builds,
# then runs one job:
#   bash run.sh demo [demo options]   the default job: `weightsync demo`
#   bash run.sh test                  the test suite (CTest)
#   bash run.sh bench [bench options] the sync-latency benchmark
#   bash run.sh build                 only install and build
# Idempotent: packages already there are not reinstalled and an unchanged tree
# is not rebuilt. BUILD_DIR (default: build) and CMAKE_ARGS may be set.
set -euo pipefail
cd "$(dirname "$0")"
job="${1:-demo}"
[ $# -gt 0 ] && shift

packages=(build-essential cmake ninja-build pkg-config git libucx-dev ucx-utils libboost-dev
  nlohmann-json3-dev libgtest-dev libgmock-dev clang)
if [ "$job" = bench ] || [ "$job" = test ]; then
  packages+=(python3 python3-torch python3-numpy)
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "run.sh: installing ${missing[*]}" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

build_dir="${BUILD_DIR:-build}"
if [ ! -f "$build_dir/build.ninja" ]; then
  # shellcheck disable=SC2086
  cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo ${CMAKE_ARGS:-} >/dev/null
fi
# demo and bench need only the command; test builds everything.
targets=()
case "$job" in demo | bench) targets=(--target weightsync_cli) ;; esac
cmake --build "$build_dir" -j"$(nproc)" "${targets[@]}"

case "$job" in
  demo) exec "$build_dir/bin/weightsync" demo "$@" ;;
  bench) exec "$build_dir/bin/weightsync" bench "$@" ;;
  test) cd "$build_dir" && exec ctest --output-on-failure -j"$(nproc)" "$@" ;;
  build) ;;
  *) echo "usage: bash run.sh demo|test|bench|build [options]" >&2; exit 2 ;;
esac
