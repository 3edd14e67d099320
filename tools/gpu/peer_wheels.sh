#!/usr/bin/env bash
# Downloads what the checkpoint-engine peer of `weightsync bench --device cuda`
# (tools/bench/peer_checkpoint_engine.py) needs on the lent GPU machine, which
# has Python 3.12, PyTorch and numpy but reaches no registry: the
# checkpoint-engine wheel and its other dependencies (pyzmq, loguru,
# pydantic, fastapi, httpx, safetensors and theirs), about 6 MB, into
# .gpu-carry/wheels. tools/gpu/device_checks.sh installs them there (no
# index, no dependency resolution: these wheels are the set) before its sync
# section. Run here, in the repository root, after ../shared/tools/gpu-carry.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
dir="$top/.gpu-carry/wheels"
py=${PYTHON:-$top/.venv/bin/python}
mkdir -p "$dir"
target=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
  --platform manylinux2014_x86_64 -d "$dir")
# Its own wheel without torch and numpy (the machine has them), then the
# rest with their dependencies resolved.
"$py" -m pip download -q --no-deps "${target[@]}" checkpoint-engine
"$py" -m pip download -q "${target[@]}" pyzmq loguru pydantic fastapi httpx safetensors
du -sh "$dir"
