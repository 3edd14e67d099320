#!/usr/bin/env bash
# Sourced by the engine setup scripts (setup_vllm.sh, setup_sglang.sh): makes
# weightsync importable in an engine's venv from the checkout itself.
#
#   link_checkout VENV REPO BUILD_DIR
#
# A .pth file puts REPO/python on sys.path and installs an import hook that
# loads the compiled extension (_core*.so, built by `bash run.sh test` /
# `bash run.sh python`) from where the build left it (BUILD_DIR/python or
# REPO/.venv); a weightsync_checkout-0.dist-info carries pyproject.toml's entry
# points (vLLM's plugin). Nothing is written into the checkout (whose package
# directory `pip install .` would pack into the wheel). The extension is never
# built here: WEIGHTSYNC_WAIT_CORE=SECONDS waits that long for it to appear
# (polling once a minute); without it a missing extension is an error. Rerun
# after a rebuild moves the extension. Needs a `log` function.

link_checkout() {
  local venv=$1 repo=$2 build_dir=$3
  local site suffix cli waited  # core (the extension found) stays set for the caller
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$repo/python" > "$site/weightsync-checkout.pth"  # completed below, once the extension is found
  # ... with the entry points of pyproject.toml (vLLM finds its plugins,
  # vllm.general_plugins, through installed distributions' metadata).
  "$venv/bin/python" - "$repo/pyproject.toml" "$site" <<'PY'
import os, shutil, sys, tomllib
pyproject, site = sys.argv[1:]
with open(pyproject, "rb") as f:
    project = tomllib.load(f)["project"]
info = os.path.join(site, "weightsync_checkout-0.dist-info")
shutil.rmtree(info, ignore_errors=True)
os.makedirs(info)
with open(os.path.join(info, "METADATA"), "w") as f:
    f.write("Metadata-Version: 2.1\nName: weightsync-checkout\nVersion: 0\n"
            "Summary: weightsync from a source checkout (tools/engines/link_checkout.sh)\n")
with open(os.path.join(info, "entry_points.txt"), "w") as f:
    for group, entries in project.get("entry-points", {}).items():
        f.write(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in entries.items()) + "\n")
PY

  suffix=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
  find_core() {  # the newest built extension for this Python, if any
    local dirs=("$build_dir/python" "$build_dir")
    local d
    for d in "$repo"/.venv/lib/python3*/site-packages/weightsync; do [ -d "$d" ] && dirs+=("$d"); done
    find "${dirs[@]}" -maxdepth 3 -name "_core$suffix" -type f -printf '%T@ %p\n' 2>/dev/null |
      sort -rn | head -n1 | cut -d' ' -f2-
  }
  core=$(find_core)
  waited=0
  while [ -z "$core" ] && [ "$waited" -lt "${WEIGHTSYNC_WAIT_CORE:-0}" ]; do
    log "waiting for weightsync's extension _core$suffix under $build_dir or .venv (bash run.sh test builds it)"
    sleep 60; waited=$((waited + 60)); core=$(find_core)
  done
  if [ -z "$core" ]; then
    log "weightsync's extension _core$suffix is not built under $build_dir or $repo/.venv: run 'bash run.sh test' (or 'bash run.sh python -c 1') first"
    exit 1
  fi
  cli="$build_dir/bin/weightsync"
  [ -x "$cli" ] || cli=$(ls "$repo"/.venv/lib/python3*/site-packages/weightsync/bin/weightsync 2>/dev/null | head -n1 || true)
  # The extension is found where the build left it, by an import hook that the
  # .pth file installs (nothing is added to the checkout's package directory,
  # which `pip install .` would pack into the wheel); the `weightsync` command
  # through WEIGHTSYNC_CLI (weightsync.cli_path()).
  cat > "$site/weightsync_checkout_core.py" <<PY
"""weightsync._core from a build directory (tools/engines/link_checkout.sh)."""
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

# WEIGHTSYNC_CORE and WEIGHTSYNC_CLI name another build's extension and
# command (a second checkout or worktree testing against this venv, with its
# python/ first on PYTHONPATH).
CORE = os.environ.get("WEIGHTSYNC_CORE") or "$core"
CLI = os.environ.get("WEIGHTSYNC_CLI") or "$cli"


class _CoreFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "weightsync._core":
            return None
        loader = importlib.machinery.ExtensionFileLoader(name, CORE)
        return importlib.util.spec_from_file_location(name, CORE, loader=loader)


if os.path.exists(CORE) and not any(isinstance(f, _CoreFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _CoreFinder())
if CLI and os.access(CLI, os.X_OK):
    os.environ.setdefault("WEIGHTSYNC_CLI", CLI)
PY
  printf '%s\nimport weightsync_checkout_core\n' "$repo/python" > "$site/weightsync-checkout.pth"
}
