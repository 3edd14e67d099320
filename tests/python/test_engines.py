"""weightsync.vllm's worker extension in direct mode over real syncs, with
vLLM's worker stood in for by the object it hands an extension (a worker
with `model_runner.model`), and the import rule (no engine, no torch on
`import weightsync`). The integrations against the real engines, every mode
and way in, are tests/real_engines/ (`bash run.sh test-engines`)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import types
from types import SimpleNamespace

import pytest
import torch

import weightsync as ws
import weightsync.sglang as wsg
import weightsync.torch as wst
import weightsync.vllm as wsv
from helpers import cli, load_safetensors, model_config, module_of, save_safetensors


def test_importing_weightsync_imports_no_engine_and_no_torch():
    code = ("import sys, weightsync, weightsync.vllm, weightsync.sglang; "
            "print(sorted(m for m in ('vllm', 'sglang', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.fixture()
def job(tmp_path):
    """tiny-llama: a trainer of one rank holding everything, engines of tp=2."""
    layout = json.loads(cli("trainer-layout", "--hf-config",
                            model_config("tiny-llama") + "/config.json", "--mesh", "fsdp=1").stdout)
    vllm = {"framework": "vllm", "hf_config": model_config("tiny-llama") + "/config.json", "tp": 2}
    g = torch.Generator().manual_seed(7)
    tensors = {p["name"]: torch.randn(p["global_shape"], generator=g).to(torch.bfloat16)
               for p in layout["params"]}
    with ws.Coordinator() as coord:
        yield coord, layout, vllm, tensors, tmp_path


def push(coord, layout, engine, tensors, steps=1):
    with ws.Publisher(coordinator=coord.address, rank=0, layout=layout, engine=engine) as pub:
        pub.register_module(module_of(tensors))
        return [pub.push(s) for s in range(1, steps + 1)]


def materialized(tmp, engine, tensors, rank):
    ckpt = save_safetensors(tensors, str(tmp / "ckpt.safetensors"))
    (tmp / "e.json").write_text(json.dumps(engine))
    cli("materialize", "--checkpoint", ckpt, "--engine", str(tmp / "e.json"), "--rank", str(rank),
        "--out", str(tmp / f"m{rank}.safetensors"))
    return load_safetensors(str(tmp / f"m{rank}.safetensors"))


class FakeVllmWorker(wsv.WorkerExtension):
    """What vLLM's worker gives an extension: model_runner.model (parameters
    under vLLM's names) and a tensor-parallel rank."""

    def __init__(self, model, tp_rank):
        self.model_runner = SimpleNamespace(model=model, model_config=None, device="cpu")
        self._tp = tp_rank

    def weightsync_tp_rank(self):
        return self._tp


def in_threads(fns):
    results, errors = [None] * len(fns), []

    def run(i, fn):
        try:
            results[i] = fn()
        except Exception as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    return threads, results, errors


def test_vllm_worker_extension_direct_mode(job):
    coord, layout, engine, tensors, tmp = job
    workers = [FakeVllmWorker(module_of(wst.allocate_engine_params(engine, 0, r)), r)
               for r in range(2)]
    for w in workers:
        assert w.weightsync_connect(coord.address, engine, replica=0)["mode"] == "direct"
    threads, outs, errors = in_threads([lambda w=w: w.weightsync_update(timeout=60) for w in workers])
    push(coord, layout, engine, tensors)
    for t in threads:
        t.join()
    assert not errors, errors
    assert [o["committed"] for o in outs] == [True, True]
    for r, w in enumerate(workers):
        assert w.weightsync_version() == 1
        want = materialized(tmp, engine, tensors, r)
        for name, p in w.model_runner.model.named_parameters():
            assert torch.equal(p, want[name]), (r, name)
        w.weightsync_close()
    with pytest.raises(ws.Error) as e:
        workers[0].weightsync_update()
    assert "weightsync_connect was not called" in str(e.value)
