"""The checkpoint-engine peer of `weightsync bench --device cuda`
(tools/bench/peer_checkpoint_engine.py), on the CPU: its receiver puts every
byte of a real 1 -> 1 bench job where the engine's layout says (against
`weightsync materialize`), it refuses the shapes checkpoint-engine cannot run
colocated, and it says what is missing when checkpoint-engine or a GPU is. The
update itself needs a GPU: tools/gpu/device_checks.sh runs it there."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import REPO, cli, load_safetensors

SCRIPT = os.path.join(REPO, "tools", "bench", "peer_checkpoint_engine.py")


def harness():
    spec = importlib.util.spec_from_file_location("peer_checkpoint_engine", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory):
    """A 1 -> 1 bench job (Qwen3-MoE-shaped: fused qkv, gate_up and experts)."""
    work = str(tmp_path_factory.mktemp("bench"))
    out = cli("bench", "sync", "--mesh", "fsdp=1", "--tp", "1", "--replicas", "1", "--size-gb",
              "0.02", "--steps", "1", "--work-dir", work, "--json")
    result = json.loads(out.stdout)
    assert result["ok"], out.stdout
    # The CPU job's peers: the gloo one alone, named.
    assert [p["name"] for p in result["peer"]["peers"]] == ["gloo"]
    assert result["peer_name"] == "gloo"
    return work


def test_receiver_puts_every_byte_where_the_engine_layout_says(job_dir):
    h = harness()
    job = json.load(open(os.path.join(job_dir, "peer_job.json")))
    assert h.shape_error(job) is None
    ckpt = h.open_checkpoint(job["checkpoint"])
    weights = list(h.trainer_tensors(job, ckpt, torch.device("cpu")).items())
    params, by_key = h.engine_params(job, 0, torch.device("cpu"))
    for t in params.values():
        t.view(torch.uint8).fill_(0xA5)  # nothing may stay as it was
    h.load(params, by_key, weights)
    truth = os.path.join(job_dir, "engine-rank0.safetensors")
    cli("materialize", "--checkpoint", job["checkpoint"], "--engine",
        os.path.join(job_dir, "engine.json"), "--rank", "0", "--out", truth)
    expected = load_safetensors(truth)
    assert sorted(expected) == sorted(params)
    fused = [n for n in params if len(job_param(job, n)["segments"]) > 1]
    assert fused, "the job has fused params (several HF tensors in one)"
    for name, t in params.items():
        want = expected[name].contiguous().view(-1).view(torch.uint8)
        assert torch.equal(t.contiguous().view(-1).view(torch.uint8), want), name
    # A receiver that skipped a segment would leave the fill behind.
    first = fused[0]
    params[first].view(torch.uint8).fill_(0xA5)
    h.load(params, by_key, [w for w in weights if w[0] != by_key_first(by_key, first)])
    assert not torch.equal(params[first].contiguous().view(-1).view(torch.uint8),
                           expected[first].contiguous().view(-1).view(torch.uint8))


def job_param(job, name):
    return next(p for p in job["engine_ranks"][0] if p["name"] == name)


def by_key_first(by_key, param):
    return next(k for k, uses in by_key.items() if any(n == param for n, _ in uses))


def run_script(job_path):
    return subprocess.run([sys.executable, SCRIPT, "--job", job_path], capture_output=True,
                          text=True, timeout=120)


def test_shapes_other_than_one_to_one_are_refused_by_name(job_dir, tmp_path):
    job = json.load(open(os.path.join(job_dir, "peer_job.json")))
    job["trainer_world"] = 4
    job["engine_world"] = 2
    path = str(tmp_path / "job.json")
    json.dump(job, open(path, "w"))
    r = run_script(path)
    assert r.returncode != 0
    assert "1 -> 1 shape only, not 4 trainer and 2 engine ranks" in r.stderr, r.stderr


def test_a_missing_checkpoint_engine_or_gpu_is_named(job_dir):
    try:
        import checkpoint_engine  # noqa: F401
        installed = True
    except ImportError:
        installed = False
    if installed and torch.cuda.is_available():
        pytest.skip("checkpoint-engine and a GPU are here: the GPU bench runs the update itself")
    r = run_script(os.path.join(job_dir, "peer_job.json"))
    assert r.returncode != 0
    if not installed:
        assert "checkpoint-engine is not importable" in r.stderr, r.stderr
        assert "pip install checkpoint-engine" in r.stderr, r.stderr
    else:
        assert "torch sees no CUDA device" in r.stderr, r.stderr
