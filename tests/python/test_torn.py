"""A failed step that wrote part of a rank's in-place tensors (register,
staging=False) leaves the rank torn, and everything says so until its next
commit: `sub.torn`, the outcome's `torn` and reason, and the coordinator's
status. The failure is the trainer's own send (issue 52): the push returns
long before the step timeout and names it."""
from __future__ import annotations

import json
import threading
import time

import torch

import weightsync as ws
import weightsync.torch as wst
from helpers import cli, model_config


def _layout_and_engine():
    layout = json.loads(cli("trainer-layout", "--hf-config",
                            model_config("tiny-llama") + "/config.json", "--mesh", "fsdp=1").stdout)
    engine = {"framework": "vllm", "hf_config": model_config("tiny-llama") + "/config.json",
              "tp": 1, "replicas": 1, "dtype": "BF16"}
    return layout, engine


def _push(coord, layout, engine, step: int, transport: str) -> tuple[ws.PushResult, float]:
    """A trainer process for one step: every tensor filled with `step`."""
    with ws.Publisher(coordinator=coord.address, rank=0, layout=layout, engine=engine,
                      transport=transport, bucket_bytes=4096, step_timeout=30.0) as pub:
        for p in layout["params"]:
            pub.register(p["name"], torch.full(p["global_shape"], float(step), dtype=torch.bfloat16))
        pub.prepare()
        start = time.monotonic()
        res = pub.push(step)
        return res, time.monotonic() - start


def _torn_in_status(coord) -> bool:
    status = json.loads(cli("status", "--coordinator", coord.address, "--json").stdout)
    return next(m for m in status["members"] if m["role"] == "engine")["torn"]


def test_a_failed_send_leaves_an_in_place_rank_torn_until_its_next_commit():
    layout, engine = _layout_and_engine()
    coord = ws.Coordinator()
    sub = ws.Subscriber(coordinator=coord.address, engine=engine, replica=0, rank=0,
                        step_timeout=30.0)
    params = wst.allocate_engine_params(engine)
    for name, t in params.items():
        sub.register(name, t)
    seen, errors = [], []

    def serve():
        try:
            while len(seen) < 3:
                out = sub.run_step(timeout=30.0)
                assert out is not None, "no step began within 30 s"
                seen.append((out, sub.version, sub.torn, _torn_in_status(coord)))
        except Exception as e:  # noqa: BLE001 - checked below
            errors.append(e)

    engine_thread = threading.Thread(target=serve)
    engine_thread.start()
    try:
        first, _ = _push(coord, layout, engine, 1, "ucx")
        assert first.committed == [0]
        second, seconds = _push(coord, layout, engine, 2, "fault:ucx?fail_after=3")
        print(f"push(2) with a failed send returned after {seconds:.3f} s")
        assert seconds < 5.0, "a failed send waits out the 30 s step timeout"
        assert second.committed == [] and second.failed[0][0] == 0
        assert "trainer rank 0" in second.failed[0][1], second.failed
        assert "injected failure" in second.failed[0][1], second.failed
        assert second.bytes_sent < first.bytes_sent
        third, _ = _push(coord, layout, engine, 3, "ucx")
        assert third.committed == [0]
    finally:
        engine_thread.join(timeout=120)
    assert not errors, errors
    (one, v1, torn1, _), (two, v2, torn2, status2), (three, v3, torn3, status3) = seen
    assert one.committed and v1 == 1 and not torn1 and not one.torn
    assert not two.committed and v2 == 1
    assert torn2 and two.torn and "torn" in two.reason, two
    # The sentence that says so, kept apart (a layer that restores drops it).
    assert two.torn_reason.startswith("engine rank 0 is torn: step 2 "), two
    assert two.reason.endswith(two.torn_reason) and two.reason != two.torn_reason, two
    assert one.torn_reason == "" and three.torn_reason == ""
    assert status2, "weightsync status lists the rank as torn"
    assert three.committed and v3 == 3 and not torn3 and not three.torn and not status3
    for name, t in params.items():  # version 3 whole (the vocab's padding rows stay zero)
        assert bool(((t == 3) | (t == 0)).all()) and bool((t == 3).any()), name
    sub.close()
    coord.close()
