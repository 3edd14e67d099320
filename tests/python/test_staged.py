"""Staged steps (EngineSync(staged=True), weightsync._staged): an engine rank
receives each version on a background thread while the engine serves, and
update() only applies it through the engine's protocol. Over real syncs
(a tiny-llama trainer of one rank, an engine of framework "hf", UCX on
localhost), with the engine stood in for by a protocol that records what it
was handed and what it serves. The real engine (vLLM behind `vllm serve`,
under streaming load) is tests/real_engines/test_vllm_trainer_api.py."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

import weightsync as ws
from weightsync._engine import EngineSync, UpdateProtocol
from helpers import cli, model_config, module_of


class Served:
    """The engine's model: what its kernels read (a weakref-able object)."""

    def __init__(self):
        self.tensors: dict = {}


class RecordingProtocol(UpdateProtocol):
    """begin/load/finish into `model.tensors` at finish (whole or not at
    all); `fail_finish`: the next finish raises (an engine that refuses the
    version while applying it); `fail_load`: the next load raises, after
    taking its batch."""

    load_kind = "hf"

    def __init__(self, model: Served):
        self.model = model
        self.calls: list = []
        self.fail_finish = False
        self.fail_load = False
        self._loading: dict = {}

    def begin(self):
        self.calls.append("begin")
        self._loading = {}

    def load(self, batch):
        self.calls.append("load")
        self._loading.update((n, t.clone()) for n, t in batch)
        if self.fail_load:
            self.fail_load = False
            raise RuntimeError("the engine refused a batch of weights")

    def finish(self):
        self.calls.append("finish")
        if self.fail_finish:
            self.fail_finish = False
            raise RuntimeError("the engine refused the weights")
        self.model.tensors = self._loading

    def abort(self):
        self.calls.append("abort")


def tiny_llama() -> tuple[dict, dict]:
    """tiny-llama's trainer layout (one rank) and an engine of framework "hf"."""
    layout = json.loads(cli("trainer-layout", "--hf-config",
                            model_config("tiny-llama") + "/config.json", "--mesh", "fsdp=1").stdout)
    engine = {"framework": "hf", "hf_config": model_config("tiny-llama") + "/config.json", "tp": 1}
    return layout, engine


@pytest.fixture()
def job():
    layout, engine = tiny_llama()
    with ws.Coordinator() as coord:
        model = Served()
        protocol = RecordingProtocol(model)
        sync = EngineSync(model, coord.address, engine, 0, 0, mode="load_weights",
                          protocol=protocol, staged=True)
        try:
            yield coord, layout, engine, sync, protocol, model
        finally:
            sync.close()


def version(layout, seed):
    g = torch.Generator().manual_seed(seed)
    return {p["name"]: torch.randn(p["global_shape"], generator=g).to(torch.bfloat16)
            for p in layout["params"]}


def push(coord, layout, engine, tensors, step, **options):
    with ws.Publisher(coordinator=coord.address, rank=0, layout=layout, engine=engine,
                      **options) as pub:
        pub.register_module(module_of(tensors))
        return pub.push(step)


def assert_serves(model, tensors):
    assert sorted(model.tensors) == sorted(tensors)
    for name, t in tensors.items():
        assert torch.equal(model.tensors[name], t), name


def test_staged_steps_apply_only_in_update(job):
    coord, layout, engine, sync, protocol, model = job
    v1, v2, v3 = (version(layout, s) for s in (1, 2, 3))

    # The push commits with nobody calling update(): the background thread
    # received the step; the engine was not touched.
    res = push(coord, layout, engine, v1, 1)
    assert res.committed == [0] and not res.failed, res
    assert protocol.calls == [] and model.tensors == {}
    assert sync.version == -1
    out = sync.update(timeout=30, step=1)
    assert out["committed"] and out["step"] == 1 and out["staged"], out
    assert out["version"] == 1 and sync.version == 1 and sync.staged_version is None
    assert protocol.calls[0] == "begin" and protocol.calls[-1] == "finish"
    assert_serves(model, v1)

    # A step that fails before the apply (a bucket corrupted on the wire,
    # caught by its checksum) changes nothing the engine serves.
    protocol.calls.clear()
    try:
        res = push(coord, layout, engine, v2, 2,
                   transport="fault:ucx?corrupt_send=1&after=1&count=1",
                   bucket_bytes=64 << 10, checksums=True)
        assert res.failed and not res.committed, res
    except ws.Error:
        pass  # the trainer may see the failure as its own
    out = sync.update(timeout=30, step=2)
    assert out["step"] == 2 and not out["committed"], out
    assert out["version"] == 1 and protocol.calls == [], (out, protocol.calls)
    assert_serves(model, v1)

    # An apply the engine refuses goes back to the version before (kept in
    # host memory), and says so.
    res = push(coord, layout, engine, v3, 3)
    assert res.committed == [0], res
    protocol.fail_finish = True
    out = sync.update(timeout=30, step=3)
    assert not out["committed"] and "applying step 3 failed" in out["reason"], out
    assert out["version"] == 1 and "kept in host memory" in out["restored"], out
    assert_serves(model, v1)


def test_staged_update_applies_the_newest_committed_version(job):
    coord, layout, engine, sync, protocol, model = job
    v = {s: version(layout, 10 + s) for s in (1, 2)}
    for s in (1, 2):
        assert push(coord, layout, engine, v[s], s).committed == [0]
    assert sync.update(timeout=1, step=3) is None  # none decided yet
    out = sync.update(timeout=30)
    assert out["committed"] and out["step"] == 2 and sync.version == 2, out
    assert protocol.calls.count("begin") == 1  # one apply: version 1 was superseded
    assert_serves(model, v[2])
    assert sync.update(timeout=0.5) is None


def engine_member(coord) -> dict:
    return next(m for m in ws.status(coord)["members"] if m["role"] == "engine")


def test_each_apply_reports_the_requests_across_it_and_since_when(job):
    """The engine says, at each apply, which requests it runs and how many
    tokens each made before it (live_requests); the step's result has the
    index of each one's first token of the new version ("requests"), and
    the coordinator's status shows the rank's last apply and since when. A
    step that failed reports nothing; an engine without live_requests
    reports the apply with no requests."""
    coord, layout, engine, sync, protocol, model = job
    v = {s: version(layout, 20 + s) for s in (1, 2, 3)}
    running = {"cmpl-a-0-1f2e3d4c": 117, "cmpl-b-0-99aa88bb": 0}
    sync.live_requests = lambda: dict(running)
    assert engine_member(coord)["applied"] is None
    assert push(coord, layout, engine, v[1], 1).committed == [0]
    # Committed, not applied: the rank still serves what it served.
    assert engine_member(coord)["applied"] is None
    before = time.time()
    out = sync.update(timeout=30, step=1)
    assert out["committed"] and out["requests"] == running, out
    applied = engine_member(coord)["applied"]
    assert applied["step"] == 1 and applied["requests"] == running, applied
    assert before - 1 <= applied["at"] <= time.time() + 1, (before, applied)

    # A step that fails before the apply: the rank serves step 1 still.
    try:
        res = push(coord, layout, engine, v[2], 2,
                   transport="fault:ucx?corrupt_send=1&after=1&count=1",
                   bucket_bytes=64 << 10, checksums=True)
        assert res.failed and not res.committed, res
    except ws.Error:
        pass
    running["cmpl-c-0-00000000"] = 5
    out = sync.update(timeout=30, step=2)
    assert not out["committed"] and "requests" not in out, out
    assert engine_member(coord)["applied"] == applied

    # Without live_requests: the apply is reported, with no requests.
    sync.live_requests = None
    assert push(coord, layout, engine, v[3], 3).committed == [0]
    out = sync.update(timeout=30, step=3)
    assert out["committed"] and "requests" not in out, out
    now = engine_member(coord)["applied"]
    assert now["step"] == 3 and now["requests"] == {} and now["at"] >= applied["at"], now


def test_staged_needs_a_protocol():
    engine = {"framework": "hf", "hf_config": model_config("tiny-llama") + "/config.json", "tp": 1}
    with ws.Coordinator() as coord:
        with pytest.raises(ws.Error, match="staged=True in load_weights mode needs"):
            EngineSync(Served(), coord.address, engine, 0, 0, mode="load_weights", staged=True)


def test_staged_ranks_of_a_replica_agree_on_the_apply():
    """The commit comes before the apply: when one rank of a replica (tp=2)
    fails to apply, the other goes back to the version before too, so the
    replica never serves two versions."""
    layout = json.loads(cli("trainer-layout", "--hf-config",
                            model_config("tiny-llama") + "/config.json", "--mesh", "fsdp=1").stdout)
    engine = {"framework": "hf", "hf_config": model_config("tiny-llama") + "/config.json", "tp": 2}
    votes: list = []
    barrier = threading.Barrier(2)

    def agree(ok):
        votes.append(ok)
        barrier.wait(timeout=60)
        return all(votes[-2:])

    with ws.Coordinator() as coord:
        models = [Served(), Served()]
        protocols = [RecordingProtocol(m) for m in models]
        syncs = [EngineSync(m, coord.address, engine, 0, r, mode="load_weights", protocol=p,
                            staged=True, agree=agree)
                 for r, (m, p) in enumerate(zip(models, protocols))]
        try:
            v = {s: version(layout, 20 + s) for s in (1, 2)}
            outs: list = [None, None]

            def update(r, step):
                outs[r] = syncs[r].update(timeout=30, step=step)

            for step in (1, 2):
                assert push(coord, layout, engine, v[step], step).committed == [0, 1]
                protocols[1].fail_finish = step == 2
                threads = [threading.Thread(target=update, args=(r, step)) for r in range(2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(timeout=60)
                if step == 1:
                    assert [o["committed"] for o in outs] == [True, True], outs
            assert [o["committed"] for o in outs] == [False, False], outs
            assert "another rank of the replica failed to apply step 2" in outs[0]["reason"]
            assert "applying step 2 failed" in outs[1]["reason"]
            for r in range(2):
                assert outs[r]["version"] == 1 and syncs[r].version == 1, outs[r]
                assert_serves(models[r], v[1])
        finally:
            for s in syncs:
                s.close()


def torn_in_status(coord) -> bool:
    status = json.loads(cli("status", "--coordinator", coord.address, "--json").stdout)
    return next(m for m in status["members"] if m["role"] == "engine")["torn"]


def test_a_failed_step_the_engine_put_back_is_not_reported_torn():
    """Without staging (load_weights mode hands the engine each tensor as it
    completes), a step that fails after the engine took part of it (here the
    engine refuses a batch it was handed) leaves the C++ rank torn; the
    engine's protocol then loads the previous version back (kept in host
    memory), so the outcome says the rank is
    whole: "torn" False and a reason that names what was restored, not "is
    torn"; `sub.torn` and the coordinator's status say so too."""
    layout, engine = tiny_llama()
    with ws.Coordinator() as coord:
        model = Served()
        protocol = RecordingProtocol(model)
        sync = EngineSync(model, coord.address, engine, 0, 0, mode="load_weights",
                          protocol=protocol)
        outs: list = []
        try:
            for step in (1, 2):
                protocol.fail_load = step == 2
                receiver = threading.Thread(target=lambda: outs.append(
                    (sync.update(timeout=60), sync.sub.torn, torn_in_status(coord))))
                receiver.start()
                res = push(coord, layout, engine, version(layout, step), step)
                receiver.join()
                assert res.committed == ([0] if step == 1 else []), res
        finally:
            sync.close()
    (first, _, _), (second, sub_torn, status_torn) = outs
    assert first["committed"] and first["torn"] is False, first
    assert not sub_torn and not status_torn, "restored, the rank still says it is torn"
    assert not second["committed"] and second["step"] == 2, second
    assert second["weights_handed"] > 0, f"the engine took nothing of step 2: {second}"
    assert "kept in host memory" in second["restored"], second
    assert second["torn"] is False, second
    assert "is torn" not in second["reason"], second["reason"]
    assert "restored to version 1" in second["reason"], second["reason"]
    assert second["version"] == 1
    assert_serves(model, version(layout, 1))


def test_a_trainer_killed_while_the_engine_stages_changes_nothing_it_serves():
    """A trainer process SIGKILLed one second into step 2 (its sends
    delayed) while the engine rank stages that step on its background
    thread: update() applies nothing of step 2 and the engine serves
    version 1 whole; a new trainer process takes the rank, and its step 3
    is staged, applied and served. (The issue's check in a real `vllm serve`
    under load, with the serving gaps, is not this test.)"""
    import multiprocessing as mp
    import signal

    from test_trainer_rejoin import _tensors, _trainer

    layout, engine = tiny_llama()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = []
    with ws.Coordinator() as coord:
        model = Served()
        protocol = RecordingProtocol(model)
        sync = EngineSync(model, coord.address, engine, 0, 0, mode="load_weights",
                          protocol=protocol, staged=True)
        try:
            a = ctx.Process(target=_trainer, args=(coord.address, layout, [1, 2], True,
                                                   "fault:ucx?delay_ms=300", 16 << 10, results,
                                                   engine))
            procs.append(a)
            a.start()
            out = sync.update(timeout=60, step=1)
            assert out is not None and out["committed"] and out["step"] == 1, out
            assert_serves(model, _tensors(layout, 1))
            protocol.calls.clear()
            out = sync.update(timeout=60, step=2)
            assert out is not None and out["step"] == 2 and not out["committed"], out
            a.join(timeout=30)
            assert a.exitcode == -signal.SIGKILL, a.exitcode
            assert protocol.calls == [], f"the engine was handed part of step 2: {protocol.calls}"
            assert out["version"] == 1 and sync.version == 1, out
            assert_serves(model, _tensors(layout, 1))
            b = ctx.Process(target=_trainer, args=(coord.address, layout, [3], False, "ucx",
                                                   1 << 20, results, engine))
            procs.append(b)
            b.start()
            out = sync.update(timeout=60, step=3)
            assert out is not None and out["committed"] and out["step"] == 3, out
            assert sync.version == 3
            assert_serves(model, _tensors(layout, 3))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(timeout=10)
            sync.close()
