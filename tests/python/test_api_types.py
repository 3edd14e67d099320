"""The typed Python API (issue 25, point 4), for real: typed results of real
pushes, steps, saves and loads; keyword-only options and options objects;
Error subclasses raised by real failures; a Subscriber served from asyncio,
cancellation included. One trainer rank and one engine rank of tiny-llama in
this process, over UCX, as test_api.py does."""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import dataclasses
import inspect
import json
import pickle
import os
import threading

import pytest
import torch

import weightsync as ws
import weightsync.torch as wst
from helpers import cli, model_config, module_of


@pytest.fixture()
def setup():
    """A coordinator, a trainer layout (fsdp=1) and an engine config (vLLM,
    tp=1) of tiny-llama."""
    layout = json.loads(cli("trainer-layout", "--hf-config",
                            model_config("tiny-llama") + "/config.json", "--mesh", "fsdp=1").stdout)
    engine = {"framework": "vllm", "hf_config": model_config("tiny-llama") + "/config.json",
              "tp": 1, "replicas": 1, "dtype": "BF16"}
    with ws.Coordinator() as coord:
        yield coord, layout, engine


def trainer_module(layout: dict, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    return module_of({p["name"]: torch.randn(p["global_shape"], generator=g).to(torch.bfloat16)
                      for p in layout["params"]})


def subscriber(coord, engine, **kw) -> ws.Subscriber:
    sub = ws.Subscriber(coordinator=coord, engine=engine, **kw)
    for name, t in wst.allocate_engine_params(engine).items():
        sub.register(name, t)
    return sub


def roundtrip(obj):
    return pickle.loads(pickle.dumps(obj))


def test_push_and_step_results_are_typed(setup):
    coord, layout, engine = setup
    sub = subscriber(coord, engine)
    outcomes: list = []
    served = threading.Thread(target=lambda: outcomes.extend(
        sub.run_step(timeout=30.0) for _ in range(2)))
    served.start()
    with ws.Publisher(coord, 0, layout, engine, bucket_bytes=64 << 10) as pub:
        pub.register_module(trainer_module(layout, 1))
        res = pub.push(1)
        fut = pub.push_async(2)
        assert isinstance(fut, concurrent.futures.Future)
        res2 = fut.result(timeout=60)
    served.join(timeout=60)
    sub.close()

    for r, step in ((res, 1), (res2, 2)):
        assert isinstance(r, ws.PushResult) and dataclasses.is_dataclass(r)
        assert (r.step, r.committed, r.failed, r.ok) == (step, [0], [], True)
        assert isinstance(r.bytes_sent, int) and r.bytes_sent > 0
        assert isinstance(r.bytes_direct, int) and isinstance(r.seconds, float)
        assert isinstance(r.plan_id, str) and r.plan_id and r.replicas == []
        assert set(r.phases) >= {"begin", "pack", "gather", "wire", "commit"}
        assert all(isinstance(v, float) for v in r.phases.values())
        assert roundtrip(r) == r  # results cross processes (futures, pools)
        with pytest.raises(dataclasses.FrozenInstanceError):
            r.step = 7  # type: ignore[misc]
    assert "PushResult(step=1" in repr(res)

    assert [o.step for o in outcomes] == [1, 2]
    for out in outcomes:
        assert isinstance(out, ws.StepOutcome)
        assert out.committed is True and out.reason == ""
        assert out.bytes > 0 and isinstance(out.checksum, int)
        assert isinstance(out.bytes_direct, int) and out.seconds > 0
        assert set(out.phases) >= {"receive", "verify", "apply", "commit"}
        assert roundtrip(out) == out

    params = ws.engine_params(engine)
    assert all(isinstance(p, ws.ParamInfo) for p in params)
    first = params[0]
    assert (first.name, first.dtype, first.shape) == tuple(first)
    assert first.dtype == "BF16" and isinstance(first.shape, list)


def test_save_hf_and_load_hf_results_are_typed(tmp_path):
    layout = {"mesh": {"axes": ["fsdp"], "shape": [1]},
              "params": [{"name": "a", "hf_keys": ["a"], "global_shape": [3, 2], "dtype": "F32",
                          "shards": []},
                         {"name": "b", "hf_keys": ["b"], "global_shape": [5], "dtype": "BF16",
                          "shards": []}]}
    a, b = torch.randn(3, 2), torch.randn(5).to(torch.bfloat16)
    out = tmp_path / "ckpt"
    with ws.Coordinator() as coord, ws.Publisher(coord, 0, layout) as pub:
        pub.register("a", a)
        pub.register("b", b)
        saved = pub.save_hf(out, config={"model_type": "toy"}, max_file_bytes=1)
        assert isinstance(saved, ws.SaveHfResult)
        assert os.path.abspath(saved.dir) == str(out)
        assert (saved.files, saved.total_bytes) == (2, 3 * 2 * 4 + 5 * 2)
        assert len(saved.files_written) == 2 and all(isinstance(f, str)
                                                     for f in saved.files_written)
        assert saved.bytes_written == saved.bytes_local == saved.total_bytes
        assert saved.bytes_sent == saved.bytes_received == 0
        assert saved.seconds >= 0 and isinstance(saved.setup_s, float)
        assert roundtrip(saved) == saved
        a.zero_()
        b.zero_()
        report = pub.load_hf(out)
        assert isinstance(report, ws.LoadReport)
        assert (report.bytes, report.files) == (saved.total_bytes, 2) and report.pieces >= 2
        assert roundtrip(report) == report
    assert not torch.equal(a, torch.zeros_like(a)), "load_hf filled the registered tensor"


def test_options_are_keyword_only_or_bound(setup):
    coord, layout, engine = setup
    with pytest.raises(TypeError):  # options never by position
        ws.Publisher(coord.address, 0, layout, engine, "ucx")  # type: ignore[call-arg, arg-type]
    with pytest.raises(TypeError):
        ws.Coordinator("127.0.0.1", 0, "secret")  # type: ignore[call-arg]

    opts = ws.PublisherOptions(bucket_bytes=32 << 10, connect_timeout=20.0)
    # DESIGN.md's keyword form, an options object, and both (keywords win).
    with ws.Publisher(coordinator=coord.address, rank=0, layout=layout, engine=engine,
                      transport="ucx", mode="p2p", bucket_bytes=32 << 10, checksums=False,
                      token=None) as pub:
        assert pub.options.bucket_bytes == 32 << 10 and pub.options.mode == "p2p"
    assert opts.checksums, "checksums are on by default"
    pub = ws.Publisher(coord, 0, layout, engine, options=opts, checksums=False)
    assert pub.options == dataclasses.replace(opts, checksums=False)
    sopts = ws.SubscriberOptions(staging=True, connect_timeout=20.0)
    sub = subscriber(coord, engine, options=sopts)
    assert sub.options.staging and sub.options.transport == "ucx"
    out: list = []
    t = threading.Thread(target=lambda: out.append(sub.run_step(timeout=30.0)))
    t.start()
    pub.register_module(trainer_module(layout, 2))
    res = pub.push(1)
    t.join(timeout=60)
    pub.close()
    sub.close()
    assert res.committed == [0] and out[0].committed

    with pytest.raises(ws.InvalidArgument):
        ws.Publisher(coord, 0, layout, engine, options=sopts)  # type: ignore[arg-type]


def test_error_subclasses_from_real_failures(setup, tmp_path):
    coord, layout, engine = setup
    # A subscriber with no trainer: run_step times out setting up.
    sub = subscriber(coord, engine, connect_timeout=1.0)
    with pytest.raises(ws.TimeoutError) as timeout:
        sub.run_step(timeout=0.5)
    e = timeout.value
    assert isinstance(e, ws.Error) and isinstance(e, builtins.TimeoutError)
    assert type(e) is ws.TimeoutError and e.code == "timeout" and str(e) == e.message
    again = roundtrip(e)
    assert type(again) is ws.TimeoutError and (again.code, str(again)) == (e.code, str(e))
    sub.close()

    sub = ws.Subscriber(coordinator=coord, engine=engine)
    name, dtype, shape = sub.params()[0]
    with pytest.raises(ws.MismatchError) as mismatch:
        sub.register(name, torch.zeros([shape[0] + 1] + shape[1:], dtype=torch.bfloat16))
    assert mismatch.value.code == "mismatch" and name in str(mismatch.value)
    with pytest.raises(ws.NotFound) as missing:
        sub.register("model.nope", torch.zeros(2))
    assert isinstance(missing.value, LookupError) and missing.value.code == "not_found"
    with pytest.raises(ws.Unsupported):
        sub.register(name, torch.zeros(shape, dtype=torch.bfloat16, device="meta"))
    sub.close()

    cases = [
        (dict(layout=layout, bucket_bytes=10), ws.InvalidArgument, ValueError),
        (dict(layout="{not json"), ws.FormatError, ValueError),
        (dict(layout=str(tmp_path / "missing.json")), ws.IoError, OSError),
    ]
    for kw, cls, builtin in cases:
        with pytest.raises(cls) as err:
            ws.Publisher(coordinator=coord.address, rank=0, engine=engine, connect_timeout=5.0,
                         **kw)
        assert isinstance(err.value, builtin) and isinstance(err.value, ws.Error)
        assert err.value.code == ws.error_class(err.value.code).code
        assert type(roundtrip(err.value)) is cls
    with pytest.raises(ws.InvalidLayout):
        ws.engine_params({**engine, "tp": 3})

    # Every code has its class; Error(code, message) builds it; unknown codes stay Error.
    codes = {"invalid_argument": ws.InvalidArgument, "invalid_layout": ws.InvalidLayout,
             "format": ws.FormatError, "io": ws.IoError, "mismatch": ws.MismatchError,
             "not_found": ws.NotFound, "timeout": ws.TimeoutError,
             "peer_failure": ws.PeerFailure, "transport": ws.TransportError,
             "protocol": ws.ProtocolError, "unsupported": ws.Unsupported,
             "cancelled": ws.Cancelled, "internal": ws.InternalError}
    for code, cls in codes.items():
        made = ws.Error(code, "why")
        assert type(made) is cls and ws.error_class(code) is cls and cls.code == code
        assert type(cls("why")) is cls and cls("why").code == code
        assert repr(made) == f"weightsync.{cls.__name__}(code={code!r}, message='why')"
    assert type(ws.Error("new_code", "m")) is ws.Error


def test_asyncio_subscriber_serves_real_steps(setup):
    """An asyncio engine server: `async for` over the steps while the event
    loop keeps running; a step whose awaiting task is cancelled runs on and
    the next run_step_async returns its outcome."""
    coord, layout, engine = setup
    pub = ws.Publisher(coord, 0, layout, engine, bucket_bytes=64 << 10)
    pub.register_module(trainer_module(layout, 3))
    began = threading.Event()
    release = threading.Event()  # cleared: a step waits in its on_begin hook
    release.set()

    def on_begin(step: int) -> None:
        began.set()
        release.wait(30.0)

    async def main() -> tuple:
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.005)

        tick_task = asyncio.create_task(ticker())
        async with subscriber(coord, engine) as sub:
            sub.on_begin(on_begin)
            # Two steps through `async for`, pushed from another thread.
            pushes = [asyncio.wrap_future(pub.push_async(s)) for s in (1, 2)]
            served = [out async for out in sub.steps(limit=2, poll=0.2)]
            results = await asyncio.gather(*pushes)
            # No step for 0.5 s: the iteration ends.
            idle = [out async for out in sub.steps(idle_timeout=0.5, poll=0.2)]
            # A cancelled run_step_async: the step runs to its decision anyway.
            began.clear()
            release.clear()
            task = asyncio.create_task(sub.run_step_async(timeout=30.0))
            push3 = asyncio.wrap_future(pub.push_async(3))
            assert await asyncio.to_thread(began.wait, 30.0)
            # Cancelled while the step waits in its hook: it cannot have
            # finished before the cancel (on a busy machine it could).
            task.cancel()
            release.set()
            with pytest.raises(asyncio.CancelledError):
                await task
            third = await push3
            late = await sub.run_step_async(timeout=30.0)
            version = sub.version
        done.set()
        await tick_task
        return served, results, idle, third, late, version, ticks

    try:
        served, results, idle, third, late, version, ticks = asyncio.run(main())
    finally:
        pub.close()
    assert [o.step for o in served] == [1, 2] and all(o.committed for o in served)
    assert all(isinstance(o, ws.StepOutcome) for o in served)
    assert [r.committed for r in results] == [[0], [0]]
    assert idle == []
    assert third.committed == [0]
    assert isinstance(late, ws.StepOutcome) and (late.step, late.committed) == (3, True)
    assert version == 3
    assert ticks > 20, "the event loop ran while steps were served"


def test_result_dataclasses_carry_every_field_of_the_extension():
    """A field added to a C++ result reaches Python only through its dataclass."""
    from weightsync import _core

    for cls in (ws.PushResult, ws.StepOutcome, ws.SaveHfResult, ws.LoadReport):
        core = getattr(_core, cls.__name__)
        bound = {n for n in dir(core) if not n.startswith("_")}
        assert {f.name for f in dataclasses.fields(cls)} == bound, cls.__name__


def test_public_api_has_docstrings():
    missing = []
    for name in ws.__all__ + ["TimeoutError"]:
        obj = getattr(ws, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue  # type aliases
        if not (obj.__doc__ or "").strip():
            missing.append(name)
        if not inspect.isclass(obj):
            continue
        for attr, member in vars(obj).items():
            if attr.startswith("_"):
                continue
            doc = None
            if isinstance(member, property):
                doc = member.fget.__doc__ if member.fget else None
            elif inspect.isfunction(member):
                doc = member.__doc__
            else:
                continue
            if not (doc or "").strip():
                missing.append(f"{name}.{attr}")
    assert not missing, missing
    for cls in (ws.Publisher, ws.Subscriber, ws.Coordinator):
        assert (cls.__init__.__doc__ or "").strip(), cls
    # The signatures callers see: options keyword-only.
    params = inspect.signature(ws.Publisher).parameters
    assert [p for p, v in params.items() if v.kind != v.KEYWORD_ONLY] == \
        ["coordinator", "rank", "layout", "engine"]
    params = inspect.signature(ws.Subscriber).parameters
    assert [p for p, v in params.items() if v.kind != v.KEYWORD_ONLY] == \
        ["coordinator", "engine", "replica", "rank"]


def test_a_failed_push_names_its_step_rank_and_what_it_waited_for(setup):
    coord, layout, engine = setup
    # The engine never releases the trainer's sends within the step (the fault
    # wrapper's release_ms: a receiver releases its senders only that long
    # after a receive), so push(1) fails at its step timeout.
    transport = "fault:ucx?release_ms=600000"
    sub = subscriber(coord, engine, transport=transport)
    outcomes: list = []
    served = threading.Thread(target=lambda: outcomes.append(sub.run_step(timeout=60.0)))
    served.start()
    pub = ws.Publisher(coordinator=coord, rank=0, layout=layout, engine=engine,
                       transport=transport, step_timeout=3.0)
    pub.register_module(trainer_module(layout, 3))
    with pytest.raises(ws.Error) as failed:
        pub.push(1)
    served.join(timeout=60)
    pub.close()
    sub.close()
    msg = str(failed.value)
    assert msg.startswith("trainer rank 0: step 1: "), msg
    assert "send to rank 1" in msg and "before the step timeout" in msg and "waited" in msg, msg
    assert outcomes and not outcomes[0].committed, outcomes
