"""A trainer process killed in the middle of a step, and a new process that
takes its rank in the same job: the engine keeps its version through the
killed step, reconnects to the new process (over UCX, shared memory or TCP:
a new endpoint to the new worker address), takes the plan the new process
publishes (its buckets differ) and commits the next step bit for bit."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import signal
import time

import pytest
import torch

import weightsync as ws
import weightsync.torch as wst
from helpers import cli, model_config

MODEL = model_config("tiny-llama") + "/config.json"
ENGINE = {"framework": "vllm", "hf_config": MODEL, "tp": 1, "replicas": 1, "dtype": "BF16"}


def _layout() -> dict:
    return json.loads(cli("trainer-layout", "--hf-config", MODEL, "--mesh", "fsdp=1").stdout)


def _tensors(layout: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {p["name"]: torch.randn(p["global_shape"], generator=g).to(torch.bfloat16)
            for p in layout["params"]}


def _trainer(address: str, layout: dict, steps: list, die_in_last: bool, transport: str,
             bucket_bytes: int, results, engine: dict = ENGINE) -> None:
    """Pushes `steps` (step k carries the tensors of seed k) to `engine`;
    with `die_in_last`, SIGKILLs itself one second into the last push."""
    with ws.Publisher(coordinator=address, rank=0, layout=layout, engine=engine,
                      transport=transport, bucket_bytes=bucket_bytes, step_timeout=20.0) as pub:
        held = _tensors(layout, 0)
        for name, t in held.items():
            pub.register(name, t)
        for step in steps:
            for name, t in _tensors(layout, step).items():
                held[name].copy_(t)
            if die_in_last and step == steps[-1]:
                pub.push_async(step)
                time.sleep(1.0)
                os.kill(os.getpid(), signal.SIGKILL)
            res = pub.push(step)
            results.put((step, list(res.committed), [tuple(f) for f in res.failed]))


def _materialized(tmp_path, tensors: dict, tag: str) -> dict:
    """Engine rank 0's params for HF `tensors`, as `weightsync materialize`
    lays them out."""
    from safetensors.torch import load_file, save_file

    ckpt, out = str(tmp_path / f"{tag}.safetensors"), str(tmp_path / f"ref-{tag}.safetensors")
    save_file(tensors, ckpt)
    (tmp_path / "engine.json").write_text(json.dumps(ENGINE))
    cli("materialize", "--checkpoint", ckpt, "--engine", str(tmp_path / "engine.json"),
        "--rank", "0", "--out", out)
    return load_file(out)


def _close(procs: list, sub, coord) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=10)
    sub.close()
    coord.close()


@pytest.mark.parametrize("tls", ["shm,self", "tcp,self"])
def test_a_new_trainer_process_takes_the_rank_of_a_killed_one(tmp_path, monkeypatch, tls):
    monkeypatch.setenv("UCX_TLS", tls)  # this process's transport and the trainers'
    transport = "ucx"
    layout = _layout()
    coord = ws.Coordinator()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    # staging: a failed step never shows in the registered tensors.
    sub = ws.Subscriber(coordinator=coord.address, engine=ENGINE, replica=0, rank=0,
                        step_timeout=10.0, staging=True)
    params = wst.allocate_engine_params(ENGINE)
    for name, t in params.items():
        sub.register(name, t)
    procs = []
    try:
        # Trainer A: step 1 commits; step 2 is slow (delayed sends) and A dies in it.
        a = ctx.Process(target=_trainer, args=(coord.address, layout, [1, 2], True,
                                               f"fault:{transport}?delay_ms=300", 16 << 10,
                                               results))
        procs.append(a)
        a.start()
        out = sub.run_step(timeout=60.0)
        assert out is not None and out.step == 1 and out.committed, out
        v1 = {name: t.clone() for name, t in params.items()}
        out = sub.run_step(timeout=60.0)
        assert out is not None and out.step == 2 and not out.committed, out
        a.join(timeout=30)
        assert a.exitcode == -signal.SIGKILL
        assert sub.version == 1
        for name, t in params.items():  # the killed step left the version whole
            assert torch.equal(t.view(torch.int16), v1[name].view(torch.int16)), name
        # Trainer B: a new process as rank 0 of the same job, with other
        # buckets (another plan: the engine takes the one B publishes).
        b = ctx.Process(target=_trainer, args=(coord.address, layout, [3], False, transport,
                                               1 << 20, results))
        procs.append(b)
        b.start()
        out = sub.run_step(timeout=60.0)
        assert out is not None and out.step == 3 and out.committed, out
        got = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(got) < 2:
            try:
                got.append(results.get(timeout=1))
            except queue.Empty:
                pass
        assert (3, [0], []) in got, got
        # Bit for bit the tensors of step 3, as `weightsync materialize` lays them out.
        ref = _materialized(tmp_path, _tensors(layout, 3), "v3")
        assert sorted(ref) == sorted(params)
        for name, t in params.items():
            assert torch.equal(t.view(torch.int16), ref[name].view(torch.int16)), name
            assert not torch.equal(t.view(torch.int16), v1[name].view(torch.int16)), name
    finally:
        _close(procs, sub, coord)


def _near(layout: dict, k: int) -> dict:
    """The tensors of seed 0 with the lowest bit of every 61st element from
    offset k flipped: versions k and k+1 differ in about 3 % of elements."""
    out = _tensors(layout, 0)
    for t in out.values():
        bits = t.view(-1).view(torch.int16)
        bits[k % 61::61] ^= 1
    return out


def _push_near(address: str, layout: dict, steps: list, options: dict, results) -> None:
    """Trainer rank 0 pushing version _near(k) as step k for each k in
    `steps`, with Publisher `options`; then it leaves the job."""
    with ws.Publisher(coordinator=address, rank=0, layout=layout, engine=ENGINE,
                      bucket_bytes=1 << 20, step_timeout=30.0, **options) as pub:
        held = _near(layout, 0)
        for name, t in held.items():
            pub.register(name, t)
        for step in steps:
            for name, t in _near(layout, step).items():
                held[name].copy_(t)
            res = pub.push(step)
            results.put((step, list(res.committed), res.delta_buckets, res.bytes_sent))


@pytest.mark.parametrize("elastic", [False, True], ids=["static", "elastic"])
def test_a_new_trainer_process_with_other_wire_options_is_followed(tmp_path, elastic):
    """Trainer rank 0 replaced by a process with delta sync on, then by one
    with delta off and checksums off, in the same job (the plan stays the
    same; the wire options change), static or elastic: the engine follows
    each one's options. The first step of the delta trainer goes whole, its
    second as a delta; every step is bit for bit the version pushed."""
    layout = _layout()
    coord = ws.Coordinator()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    sub = ws.Subscriber(coordinator=coord.address, engine=ENGINE, replica=0, rank=0,
                        step_timeout=30.0)
    params = wst.allocate_engine_params(ENGINE)
    for name, t in params.items():
        sub.register(name, t)

    def check(step):
        ref = _materialized(tmp_path, _near(layout, step), f"v{step}")
        for name, t in params.items():
            assert torch.equal(t.view(torch.int16), ref[name].view(torch.int16)), (step, name)

    procs = []
    outcomes = {}
    try:
        for steps, options in (([1], {}), ([2, 3], {"delta": "auto"}), ([4], {"checksums": False})):
            if elastic:
                options = dict(options, elastic=True)
            p = ctx.Process(target=_push_near,
                            args=(coord.address, layout, steps, options, results))
            procs.append(p)
            p.start()
            for step in steps:
                out = sub.run_step(timeout=60.0)
                assert out is not None and out.step == step and out.committed, out
                outcomes[step] = out
                check(step)
            p.join(timeout=60)
            assert p.exitcode == 0, f"trainer of steps {steps} ended with {p.exitcode}"
        pushed = {}
        while len(pushed) < 4:
            step, committed, delta_buckets, sent = results.get(timeout=10)
            assert committed == [0], (step, committed)
            pushed[step] = (delta_buckets, sent)
    finally:
        _close(procs, sub, coord)
    assert [outcomes[s].delta_buckets for s in (1, 2, 4)] == [0, 0, 0], outcomes
    assert outcomes[3].delta_buckets > 0 and pushed[3][0] == outcomes[3].delta_buckets, pushed
    assert pushed[3][1] * 4 < pushed[2][1], pushed
