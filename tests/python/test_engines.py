"""The engine integrations (weightsync.vllm, weightsync.sglang) against real
syncs: vLLM's and SGLang's workers are stood in for by the objects they hand
to an extension (a worker with `model_runner.model`, a model runner with
`tp_rank`); vLLM's weight-transfer base class by a minimal one written from
its documented interface. vLLM and SGLang are not installed here."""

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


class HfModel(torch.nn.Module):
    """Has load_weights(weights), as vLLM's and SGLang's models do."""

    def __init__(self):
        super().__init__()
        self.got = {}
        self.post_loaded = 0

    def load_weights(self, weights):
        for key, t in weights:
            self.got[key] = t.clone()

    def post_load_weights(self):
        self.post_loaded += 1


def test_vllm_load_weights_mode_and_sglang_worker(job, monkeypatch):
    coord, layout, vllm, tensors, tmp = job
    hf = {**vllm, "framework": "hf"}
    groups = [hf, {**vllm, "framework": "sglang"}]
    post = []
    monkeypatch.setattr(wsv, "_post_load", lambda model, config, device: post.append)
    loader = FakeVllmWorker(HfModel(), 0)
    loader.weightsync_connect(coord.address, groups, replica=0, mode="load_weights")
    loader2 = FakeVllmWorker(HfModel(), 1)
    loader2.weightsync_connect(coord.address, groups, replica=0, mode="load_weights")
    runners = [SimpleNamespace(model=module_of(wst.allocate_engine_params(groups, 1, r)), tp_rank=r)
               for r in range(2)]
    sglang = [wsg.WorkerSync(runner, coord.address, groups, replica=1) for runner in runners]
    for s in sglang:
        s.start()
    threads, outs, errors = in_threads([lambda: loader.weightsync_update(timeout=60),
                                        lambda: loader2.weightsync_update(timeout=60)])
    results = push(coord, layout, groups, tensors)
    for t in threads:
        t.join()
    assert not errors, errors
    assert results[0].committed == [0, 1, 2, 3]
    assert post == [1, 1], "process_weights_after_loading once per step on each worker"
    for w in (loader, loader2):
        got = w.model_runner.model.got
        assert sorted(got) == sorted(tensors)
        assert all(torch.equal(got[k], v) for k, v in tensors.items())
        w.weightsync_close()
    for r, s in enumerate(sglang):
        assert [o["committed"] for o in s.stop()] == [True]
        want = materialized(tmp, {**vllm, "framework": "sglang"}, tensors, r)
        for name, p in runners[r].model.named_parameters():
            assert torch.equal(p, want[name]), (r, name)
        s.close()


def fake_vllm_transfer_base(monkeypatch, registry):
    """vLLM's weight-transfer interface as documented (base.py): engines are
    built with (config, vllm_config, device, model); update_weights() parses
    a dict into update_info_cls and calls receive_weights."""
    base = types.ModuleType("vllm.distributed.weight_transfer.base")

    class WeightTransferInitInfo:
        pass

    class WeightTransferUpdateInfo:
        pass

    class WeightTransferEngine:
        def __init__(self, config, vllm_config, device, model):
            self.config, self.vllm_config, self.device, self.model = config, vllm_config, device, model
            self.model_config = getattr(vllm_config, "model_config", None)

        def parse_init_info(self, d):
            return self.init_info_cls(**d)

        def update_weights(self, d):
            self.receive_weights(self.update_info_cls(**d))

    base.WeightTransferInitInfo = WeightTransferInitInfo
    base.WeightTransferUpdateInfo = WeightTransferUpdateInfo
    base.WeightTransferEngine = WeightTransferEngine
    wt = types.ModuleType("vllm.distributed.weight_transfer")
    wt.register_weight_transfer_engine = lambda name, cls: registry.setdefault(name, cls)
    dist = types.ModuleType("vllm.distributed")
    dist.get_tensor_model_parallel_rank = lambda: registry["tp_rank"]
    for name, mod in [("vllm", types.ModuleType("vllm")), ("vllm.distributed", dist),
                      ("vllm.distributed.weight_transfer", wt),
                      ("vllm.distributed.weight_transfer.base", base)]:
        monkeypatch.setitem(sys.modules, name, mod)


def test_vllm_weight_transfer_engine_adapter(job, monkeypatch):
    coord, layout, engine, tensors, tmp = job
    one = {**engine, "tp": 1}
    registry = {"tp_rank": 0}
    fake_vllm_transfer_base(monkeypatch, registry)
    cls = wsv.register_weight_transfer_engine()
    assert registry["weightsync"] is cls
    model = module_of(wst.allocate_engine_params(one, 0, 0))
    eng = cls(config=None, vllm_config=SimpleNamespace(model_config=None), device="cpu", model=model)
    eng.init_transfer_engine(eng.parse_init_info(
        {"coordinator": coord.address, "engine": one, "replica": 0}))
    eng.start_weight_update()
    threads, _, errors = in_threads([lambda: eng.update_weights({"timeout": 60.0})])
    push(coord, layout, one, tensors)
    threads[0].join()
    eng.finish_weight_update()
    assert not errors, errors
    want = materialized(tmp, one, tensors, 0)
    for name, p in model.named_parameters():
        assert torch.equal(p, want[name]), name
    with pytest.raises(ws.Error) as e:
        eng.update_weights({"timeout": 0.5})
    assert e.value.code == "timeout"
    with pytest.raises(ws.Error) as e:
        cls.trainer_send_weights(iter(()), {})
    assert e.value.code == "unsupported"
    eng.shutdown()
