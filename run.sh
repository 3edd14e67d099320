#!/usr/bin/env bash
# weightsync quick start. Installs what it needs (Debian 12, as root), builds,
# then runs one job:
#   bash run.sh demo [demo options]   the default job: `weightsync demo`
#   bash run.sh test [ctest options]  the tests: C++ (CTest), then Python (pytest in .venv)
#   bash run.sh bench [bench options] the sync-latency benchmark
#   bash run.sh python [args]         .venv's python with the package installed
#   bash run.sh test-engines [pytest options]  the tests against real vLLM and SGLang,
#                                     each in its own venv outside the tree (docs/engines.md)
#   bash run.sh build                 only install and build
# Idempotent: packages already there are not reinstalled, .venv is not
# refreshed while python/requirements-dev.txt is unchanged, an unchanged tree
# is not rebuilt and the package not reinstalled. BUILD_DIR (default: build)
# and CMAKE_ARGS may be set.
set -euo pipefail
cd "$(dirname "$0")"
root=$PWD
job="${1:-demo}"
[ $# -gt 0 ] && shift

packages=(build-essential cmake ninja-build pkg-config git libucx-dev ucx-utils libboost-dev
  nlohmann-json3-dev libgtest-dev libgmock-dev clang python3 python3-venv python3-dev
  iproute2 iptables prometheus-cpp-dev)

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

# .venv at the repository root: Debian's python3 (a fresh Debian 12 has no
# other), the requirements refreshed only when their file changes.
venv="$root/.venv"
ensure_venv() {
  [ -x "$venv/bin/python" ] || /usr/bin/python3 -m venv "$venv"
  local req="$root/python/requirements-dev.txt" stamp="$venv/.weightsync-requirements"
  if ! cmp -s "$req" "$stamp"; then
    echo "run.sh: installing python/requirements-dev.txt into .venv" >&2
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q -r "$req"
    cp "$req" "$stamp"
  fi
}

# PyPI's UCX built with CUDA (1.22), for the tests that run weightsync with a
# UCX other than the system's (UcxWheel.*, tests/python/test_ucx_library.py).
# It goes beside site-packages, not into it: with it importable, `import
# weightsync` would pick it for every suite (WEIGHTSYNC_UCX=auto).
ensure_libucx() {
  local target="$venv/opt/libucx-cu13"
  [ -e "$target/libucx/lib/libucp.so.0" ] && return
  echo "run.sh: installing libucx-cu13 into .venv/opt" >&2
  rm -rf "$target"
  "$venv/bin/python" -m pip install -q --no-deps --target "$target" "libucx-cu13>=1.22,<1.23"
}

build_dir="${BUILD_DIR:-build}"
cmake_args=(-G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo)
command -v ccache >/dev/null && cmake_args+=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
# `build` makes .venv too: it builds what `test` builds (the Python module
# needs .venv's nanobind), configured the same way, so a test after it
# builds nothing again.
case "$job" in test | bench | python | test-engines | build) ensure_venv ;; esac
[ "$job" = test ] && ensure_libucx
# Whenever .venv exists the build uses its Python (the pycheck tests need
# numpy and torch), so that switching jobs never reconfigures the build.
[ -x "$venv/bin/python" ] && cmake_args+=("-DPython_EXECUTABLE=$venv/bin/python")
# shellcheck disable=SC2206
cmake_args+=(${CMAKE_ARGS:-})
# Configure when there is no build yet or the arguments changed.
if [ ! -f "$build_dir/build.ninja" ] || ! echo "${cmake_args[*]}" | cmp -s - "$build_dir/.run-sh-args"; then
  cmake -S . -B "$build_dir" "${cmake_args[@]}" >/dev/null
  mkdir -p "$build_dir" && echo "${cmake_args[*]}" > "$build_dir/.run-sh-args"
fi
# demo and bench need only the command; test builds everything.
targets=()
case "$job" in
  demo | bench) targets=(--target weightsync_cli) ;;
  python | test-engines) targets=(--target weightsync_python weightsync_cli) ;;
esac
cmake --build "$build_dir" -j"$(nproc)" "${targets[@]}"

# The package goes into .venv with pip (scikit-build-core drives this same
# build directory, so nothing compiles twice); again only when the built
# extension, the command or the package's Python files are newer than the
# last install.
install_package() {
  local stamp="$venv/.weightsync-installed"
  if [ -f "$stamp" ] && [ -z "$(find "$build_dir/python" "$build_dir/bin/weightsync" python pyproject.toml \
    -newer "$stamp" -print -quit 2>/dev/null)" ]; then
    return
  fi
  echo "run.sh: installing the weightsync package into .venv" >&2
  "$venv/bin/python" -m pip install -q --no-build-isolation --no-deps \
    --config-settings=build-dir="$build_dir" \
    --config-settings=cmake.build-type=RelWithDebInfo \
    --config-settings=cmake.define.WEIGHTSYNC_BUILD_TESTS=ON \
    --config-settings=cmake.define.Python_EXECUTABLE="$venv/bin/python" .
  touch "$stamp"
}

case "$job" in
  demo) exec "$build_dir/bin/weightsync" demo "$@" ;;
  bench) install_package && WEIGHTSYNC_PYTHON="$venv/bin/python" exec "$build_dir/bin/weightsync" bench "$@" ;;
  python) install_package && exec "$venv/bin/python" "$@" ;;
  test)
    install_package
    status=0
    (cd "$build_dir" && ctest --output-on-failure -j"$(nproc)" "$@") || status=$?
    (cd tests/python && "$venv/bin/python" -m pytest -q --durations=15) || status=$?
    exit $status
    ;;
  test-engines)
    # Real engines from PyPI, each in a venv of its own (their pins fight
    # with .venv's and each other's), made once under ~/.cache and shared by
    # every checkout; weightsync is imported there from this checkout.
    install_package
    status=0
    # WEIGHTSYNC_ENGINES picks them (default: all three; verl's venv sits on
    # vLLM's).
    for engine in ${WEIGHTSYNC_ENGINES:-vllm verl sglang}; do
      if [ ! -f "tools/engines/setup_$engine.sh" ] || [ ! -f "tests/real_engines/test_$engine.py" ]; then
        echo "run.sh: no engine suite '$engine' (tools/engines/setup_$engine.sh, tests/real_engines/test_$engine.py)" >&2
        status=2
        continue
      fi
      engine_start=$SECONDS
      engine_python=$(bash "tools/engines/setup_$engine.sh" "$root" "$build_dir" | tail -n 1)/bin/python
      # test_<engine>.py and its companions (test_<engine>_lora.py, ...), in one run.
      (cd tests/real_engines && "$engine_python" -m pytest -q --durations=15 -p no:cacheprovider \
        "test_$engine.py" $(ls "test_${engine}"_*.py 2>/dev/null) "$@") || status=$?
      echo "run.sh: the $engine suites took $((SECONDS - engine_start)) s" >&2
    done
    exit $status
    ;;
  build) ;;
  *) echo "usage: bash run.sh demo|test|test-engines|bench|python|build [options]" >&2; exit 2 ;;
esac
