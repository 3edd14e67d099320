#!/usr/bin/env bash
# The GPU checks of a lent device machine, in one run (see docs/gpu.md):
#
#   ../shared/tools/gpu-carry        # here, once: packs .gpu-carry/
#   device run, carry [".gpu-carry"]:
#     CMAKE_ARGS="-DWEIGHTSYNC_BUILD_PYTHON=ON -DPython_EXECUTABLE=$(command -v python3)" \
#       bash .gpu-carry/run-on-gpu.sh bash ../tools/gpu/device_checks.sh [SECTION ...]
#
# run-on-gpu.sh builds the project (CUDA, NCCL, UCX, the Python extension) in
# build-gpu and runs this there. Sections, in this order by default: fp8
# (bench fp8 --device cuda), ctest (every test labelled gpu), pytest (the
# Python suites' CUDA cases, from the package assembled out of this build;
# pydiag, on request: the extension imported alone and after PyTorch), copy
# (bench copy --device cuda), delta (bench delta --device cuda: the delta
# patch and hash kernels against a D2D copy; a delta sync into CUDA params),
# sync (bench --device cuda, with FP8 engines and plain; its peers are
# PyTorch's packed IPC way and, 1 -> 1, checkpoint-engine's colocated update,
# from the wheels tools/gpu/peer_wheels.sh puts in .gpu-carry/wheels, about
# 5 MB), ucxcuda (UCX built
# with CUDA: PyPI's libucx-cu13 wheel, carried as .gpu-carry/libucx_cu13-*.whl
# (`pip download --no-deps -d .gpu-carry libucx-cu13`, 43 MB), found first in
# LD_LIBRARY_PATH: the UCX suites, the GPU syncs over ucx, bench transport
# --device cuda (ucx with CUDA memory and cuda_ipc against D2D), a 2 GB sync
# over ucx with CUDA memory, over ucx through pinned host slots, and over
# cuda_ipc). Each section's output goes to $OUT/<section>.log (OUT: the device
# tool's folder; else ./gpu-out) and its tail to stdout. GPU_DEADLINE (epoch
# seconds) bounds the whole: a section that cannot start 30 s before it is
# skipped, and each one is cut at it.
set -uo pipefail
out=${OUT:-$PWD/gpu-out}
mkdir -p "$out"
build=$PWD
root=$(cd .. && pwd)
deadline=${GPU_DEADLINE:-$(($(date +%s) + 3600))}
export PYTHONUNBUFFERED=1

section() {  # name cap_seconds command...
  local name=$1 cap=$2
  shift 2
  local left=$((deadline - $(date +%s)))
  if [ "$left" -lt 30 ]; then
    echo "== $name: skipped, ${left} s left before the deadline"
    return
  fi
  [ "$cap" -gt "$left" ] && cap=$left
  echo "== $name (at most $cap s): $*"
  local t0=$SECONDS rc=0
  timeout "$cap" "$@" >> "$out/$name.log" 2>&1 || rc=$?
  echo "== $name: exit $rc after $((SECONDS - t0)) s"
}

ctest_section() {
  section ctest 300 ctest -L gpu --output-on-failure -j4 --timeout 240
  grep -E "tests passed|Failed|\*\*\*|Not Run|SKIPPED|Skipped" "$out/ctest.log" | head -40
}

fp8_section() {
  section fp8 90 ./bin/weightsync bench fp8 --device cuda
  section fp8 60 ./bin/weightsync bench fp8 --device cuda --scale ue8m0 --mib 512
  tail -n 8 "$out/fp8.log"
}

# The package as pip would install it, in $1: its Python sources, the
# extension built here and the command beside them.
package() {
  local pkg=$1
  rm -rf "$pkg" && mkdir -p "$pkg/weightsync/bin"
  cp -r "$root/python/weightsync/." "$pkg/weightsync/"
  cp "$build"/python/weightsync/_core*.so "$pkg/weightsync/" 2>/dev/null ||
    { echo "== no Python extension in $build (configure with WEIGHTSYNC_BUILD_PYTHON=ON)"; return 1; }
  cp "$build/bin/weightsync" "$pkg/weightsync/bin/"
}

pytest_section() {
  local pkg=/tmp/ws-gpu-pkg
  package "$pkg" || return
  (cd "$root/tests/python" && export PYTHONPATH="$pkg" && section pytest 300 python3 -m pytest -q -ra \
    test_checkpoint.py test_e2e_fsdp2.py test_import_order.py -k "cuda or import or nccl")
  tail -n 25 "$out/pytest.log"
}

# The extension alone, then after PyTorch and transformers (which load CUDA
# libraries with RTLD_GLOBAL); a crash is shown with cuda-gdb's backtrace.
pydiag_section() {
  local pkg=/tmp/ws-gpu-pkg
  package "$pkg" || return
  local code
  for code in "import weightsync as ws; c = ws.Coordinator(); print('alone:', c.address)" \
    "import torch, transformers, weightsync as ws; c = ws.Coordinator(); print('after torch:', c.address, torch.cuda.device_count(), 'GPUs')"; do
    echo "python3 -c \"$code\"" >> "$out/pydiag.log"
    if ! PYTHONPATH="$pkg" timeout 60 python3 -c "$code" >> "$out/pydiag.log" 2>&1; then
      PYTHONPATH="$pkg" timeout 120 cuda-gdb -q -batch -ex run -ex bt -ex "info sharedlibrary" \
        --args python3 -c "$code" >> "$out/pydiag.log" 2>&1
    fi
  done
  grep -vE "^\[New Thread|^\[Thread .* exited" "$out/pydiag.log" | head -n 60
}

copy_section() {
  section copy 90 ./bin/weightsync bench copy --device cuda
  tail -n 8 "$out/copy.log"
}

delta_section() {
  section delta 60 ./bin/weightsync bench delta --device cuda --mib 1024
  section delta 60 ./bin/weightsync bench delta --device cuda --mib 1024 --update random:1.0
  section delta 60 ./bin/weightsync bench delta --device cuda --mib 1024 --dtype fp8
  section delta 150 ./bin/weightsync bench --device cuda --transport ucx --delta \
    --update random:0.02 --size-gb 2 --steps 3 --no-peer
  grep -vE "^\s*$" "$out/delta.log" | tail -n 30
}

# checkpoint-engine for the 1 -> 1 peer (tools/bench/peer_checkpoint_engine.py):
# the wheels tools/gpu/peer_wheels.sh put in .gpu-carry/wheels, installed as
# they are (no index, no resolution) where the peer's python finds them.
peer_site() {
  local wheels=$root/.gpu-carry/wheels site=/tmp/ws-peer-site
  if ! ls "$wheels"/checkpoint_engine-*.whl > /dev/null 2>&1; then
    echo "== sync: no .gpu-carry/wheels (tools/gpu/peer_wheels.sh): the checkpoint-engine peer will say so"
    return
  fi
  rm -rf "$site"
  if python3 -m pip install -q --no-index --no-deps --target "$site" "$wheels"/*.whl >> "$out/sync.log" 2>&1; then
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    echo "== sync: checkpoint-engine $(python3 -c 'import checkpoint_engine as c; print(c.__version__)' 2>&1 | tail -n 1)"
  else
    echo "== sync: installing .gpu-carry/wheels failed (see sync.log)"
  fi
}

sync_section() {
  peer_site
  section sync 120 ./bin/weightsync bench --device cuda --fp8 --size-gb 2 --steps 3 --no-peer
  # The hybrid engine's shapes first: 1 trainer rank -> 1 engine rank (tp=1),
  # the headline, and 2 -> 1; then 4 trainers + 4 engine ranks on the GPU.
  section sync 300 ./bin/weightsync bench --device cuda --mesh fsdp=1 --tp 1 --replicas 1 \
    --size-gb 8 --steps 3
  # The same job with its buckets as fragments (no lent params): what the
  # one-copy path gains, on the same bytes and the same GPU.
  section sync 150 ./bin/weightsync bench --device cuda --mesh fsdp=1 --tp 1 --replicas 1 \
    --size-gb 8 --steps 3 --no-lend --no-peer
  section sync 200 ./bin/weightsync bench --device cuda --mesh fsdp=2 --tp 1 --replicas 1 \
    --size-gb 8 --steps 3
  section sync 200 ./bin/weightsync bench --device cuda --size-gb 8 --steps 3
  grep -vE "^\s*$" "$out/sync.log" | tail -n 70
}

ucxcuda_section() {
  local wheel lib=/tmp/ws-libucx/libucx/lib
  wheel=$(ls "$root"/.gpu-carry/libucx_cu13-*.whl 2>/dev/null | head -n 1)
  if [ -z "$wheel" ]; then
    echo "== ucxcuda: skipped, no .gpu-carry/libucx_cu13-*.whl (pip download --no-deps -d .gpu-carry libucx-cu13)"
    return
  fi
  rm -rf /tmp/ws-libucx && python3 -m zipfile -e "$wheel" /tmp/ws-libucx &&
    chmod +x /tmp/ws-libucx/libucx/bin/*  # zipfile keeps no modes
  section ucxcuda 60 env LD_LIBRARY_PATH="$lib" "$lib/../bin/ucx_info" -v
  section ucxcuda 120 env LD_LIBRARY_PATH="$lib" WEIGHTSYNC_TEST_UCX_DIR="$lib" \
    ./tests/ws_transport_tests --gtest_filter='*ucx*:*Ucx*'
  section ucxcuda 200 env LD_LIBRARY_PATH="$lib" ctest -L gpu -R ucx --output-on-failure
  section ucxcuda 150 env LD_LIBRARY_PATH="$lib" ./bin/weightsync bench transport --device cuda
  local t
  for t in 'ucx?cuda=require' 'ucx?cuda=off' cuda_ipc; do
    section ucxcuda 150 env LD_LIBRARY_PATH="$lib" ./bin/weightsync bench --device cuda \
      --transport "$t" --size-gb 2 --steps 3 --no-peer
  done
  grep -E "Library version|PASSED|FAILED|SKIPPED|tests passed|bench sync|^sync:|transport |ratio_to|error|^ +[0-9]+ |GPU buffers" \
    "$out/ucxcuda.log" | head -n 60
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
sections=("$@")
[ ${#sections[@]} -gt 0 ] || sections=(fp8 ctest pytest copy delta sync ucxcuda)
for s in "${sections[@]}"; do
  case "$s" in
    ctest | fp8 | pydiag | pytest | copy | delta | sync | ucxcuda) "${s}_section" ;;
    *) echo "unknown section '$s'" >&2 ;;
  esac
done
