"""WEIGHTSYNC_UCX: which UCX library weightsync._core runs with (docs/transports.md,
"UCX with CUDA"). Each case is a fresh interpreter, since the choice is made
when weightsync is first imported.

The libucx-cu13 wheel (UCX 1.22, built with CUDA) is installed by `bash run.sh
test` outside .venv's site-packages (at .venv/opt/libucx-cu13), so that the
other suites keep the system's UCX; these children put it on their path."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WHEEL = Path(os.environ.get("WEIGHTSYNC_TEST_LIBUCX", ROOT / ".venv" / "opt" / "libucx-cu13"))
SYSTEM_DIRS = ("/usr/lib/", "/lib/")

# test_api's three steps of changing weights (trainer and engine in threads
# of one process, over UCX, checked against `weightsync materialize`); then
# the libucp files mapped into the process.
SYNC = """
import json, sys, tempfile
from pathlib import Path
sys.path.insert(0, {here!r})
import weightsync as ws
from helpers import cli, model_config
from test_api import test_three_steps_of_changing_weights_land_bit_exact as three_steps

layout = json.loads(cli("trainer-layout", "--hf-config",
                        model_config("tiny-llama") + "/config.json", "--mesh", "fsdp=1").stdout)
engine = {{"framework": "vllm", "hf_config": model_config("tiny-llama") + "/config.json",
          "tp": 1, "replicas": 1, "dtype": "BF16"}}
coord = ws.Coordinator()
three_steps((coord, layout, engine, Path(tempfile.mkdtemp())))
coord.close()
print("MAPPED", ws.ucx_library())
"""

IMPORT_ONLY = """
import weightsync as ws
print("MAPPED", ws.ucx_library())
"""


def run_child(code: str, tmp_path, **env: str) -> subprocess.CompletedProcess:
    full = dict(os.environ)
    full.pop("WEIGHTSYNC_UCX", None)
    full.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, env=full, timeout=600)


def mapped(proc: subprocess.CompletedProcess) -> list[str]:
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stderr[-4000:]}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("MAPPED")]
    assert len(lines) == 1, proc.stdout
    return ast.literal_eval(lines[0][len("MAPPED"):].strip())


def need_wheel() -> Path:
    lib = WHEEL / "libucx" / "lib"
    if not (lib / "libucp.so.0").exists():
        pytest.skip(f"no libucx-cu13 at {WHEEL} (bash run.sh test installs it)")
    return lib.resolve()


def with_wheel(**env: str) -> dict:
    paths = [str(WHEEL)] + [p for p in os.environ.get("PYTHONPATH", "").split(":") if p]
    return {"PYTHONPATH": ":".join(paths), **env}


@pytest.mark.parametrize("choice", ["auto", "libucx", "dir"])
def test_the_wheels_ucx_is_loaded_and_syncs_bit_exact(tmp_path, choice):
    lib = need_wheel()
    if choice == "dir":
        env = {"WEIGHTSYNC_UCX": str(lib)}  # the directory, without the package on the path
    else:
        env = with_wheel(WEIGHTSYNC_UCX=choice)
    files = mapped(run_child(SYNC.format(here=str(HERE)), tmp_path, **env))
    assert files == [str(lib / "libucp.so.0.0.0")] or (
        len(files) == 1 and Path(files[0]).parent == lib), files


def test_system_keeps_the_loaders_choice_with_the_wheel_installed(tmp_path):
    lib = need_wheel()
    files = mapped(run_child(IMPORT_ONLY, tmp_path, **with_wheel(WEIGHTSYNC_UCX="system")))
    assert len(files) == 1 and files[0].startswith(SYSTEM_DIRS), files
    assert Path(files[0]).parent != lib


def test_auto_without_the_wheel_is_the_systems_ucx(tmp_path):
    files = mapped(run_child(IMPORT_ONLY, tmp_path))
    assert len(files) == 1 and files[0].startswith(SYSTEM_DIRS), files


@pytest.mark.parametrize("value, says", [
    ("libucx", "pip install libucx-cu13"),
    ("/nonexistent-ucx", "expected auto, libucx, system or a directory"),
    ("/tmp", "no libucm.so.0, libucs.so.0, libuct.so.0, libucp.so.0"),
])
def test_a_choice_that_cannot_be_met_fails_the_import_clearly(tmp_path, value, says):
    proc = run_child(IMPORT_ONLY, tmp_path, WEIGHTSYNC_UCX=value)
    assert proc.returncode != 0
    assert "ImportError" in proc.stderr and says in proc.stderr, proc.stderr[-2000:]
