#!/usr/bin/env bash
# A venv holding real SGLang (PyPI's sglang) for weightsync's engine tests
# (tests/real_engines/test_sglang.py) and docs/engines.md.
#
#   bash tools/engines/setup_sglang.sh [REPO_ROOT [BUILD_DIR]]
#
# REPO_ROOT: the weightsync checkout (default: this script's repository);
# BUILD_DIR: its build directory (default: REPO_ROOT/build, or $BUILD_DIR).
# The venv goes to ${WEIGHTSYNC_ENGINE_VENVS:-$HOME/.cache/weightsync/venvs}/sglang-0.5.23
# (outside the checkout, so fresh clones reuse it; about 11 GB: SGLang pins
# torch 2.14.1 with its CUDA libraries, which runs on a CPU too) and its path
# is printed on stdout as the last line. Idempotent: pip runs again only when
# the pinned requirements below (or the Python) change (stamp file in the
# venv). Python: $WEIGHTSYNC_ENGINE_PYTHON, else Debian's /usr/bin/python3
# (3.11; sglang 0.5.23 needs >= 3.11).
#
# Then weightsync is made importable there from the checkout itself, as
# tools/engines/link_checkout.sh says (a .pth file and an import hook for the
# built extension; nothing written into the checkout).
#
# SGLang's CPU engine mode needs sglang-kernel's CPU build, which PyPI does
# not have (its wheels are CUDA-only): the tests run SGLang's generic path on
# the CPU with test-only shims (tests/real_engines/sglang_shim/), never installed.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "${1:-$here/../..}" && pwd)
build_dir=${2:-${BUILD_DIR:-$repo/build}}
case "$build_dir" in /*) ;; *) build_dir="$repo/$build_dir" ;; esac
python=${WEIGHTSYNC_ENGINE_PYTHON:-/usr/bin/python3}
venvs=${WEIGHTSYNC_ENGINE_VENVS:-$HOME/.cache/weightsync/venvs}
venv="$venvs/sglang-0.5.23"

# SGLang resolves the rest itself (torch 2.14.1, transformers 5.19.0, ...);
# pytest runs the tests, PEFT makes the LoRA tests' adapters. Changing this
# list reinstalls.
requirements=$(cat <<'REQ'
sglang==0.5.23
pytest
peft==0.21.2
REQ
)

log() { echo "setup_sglang.sh: $*" >&2; }

[ -x "$venv/bin/python" ] || { log "creating $venv ($python)"; mkdir -p "$venvs"; "$python" -m venv "$venv"; }
stamp="$venv/.weightsync-setup"
key=$( { echo "$requirements"; "$venv/bin/python" -VV; } | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$key" ]; then
  log "installing $(echo "$requirements" | tr '\n' ' ')into $venv (about 11 GB, once)"
  req_file=$(mktemp)
  trap 'rm -f "$req_file"' EXIT
  echo "$requirements" > "$req_file"
  "$venv/bin/python" -m pip install -q -r "$req_file"
  "$venv/bin/python" -c "import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__)" >&2
  echo "$key" > "$stamp"
fi

# WEIGHTSYNC_ENGINE_INSTALL_ONLY=1: the venv only, no checkout needed
# (.ci/run installs it while the checkout builds).
if [ "${WEIGHTSYNC_ENGINE_INSTALL_ONLY:-0}" = 1 ]; then
  log "installed: $venv"
  echo "$venv"
  exit 0
fi

# weightsync from the checkout (tools/engines/link_checkout.sh).
. "$here/link_checkout.sh"
link_checkout "$venv" "$repo" "$build_dir"
"$venv/bin/python" -c "import weightsync._core, weightsync.sglang" ||
  { log "weightsync does not import in $venv"; exit 1; }
log "ready: $venv (weightsync from $repo/python, extension $core)"
echo "$venv"
