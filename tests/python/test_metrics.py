"""The coordinator's Prometheus metrics during a real multi-process sync: a
trainer process and an engine process of tiny-llama over UCX, the
coordinator in this process with metrics on. /metrics is scraped over HTTP
between steps, while both processes are alive, and parsed with
prometheus_client's text-format parser; `weightsync status --json` is read
at the same moments."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request

import pytest

import weightsync as ws
from helpers import cli, model_config, run_world

prometheus_parser = pytest.importorskip("prometheus_client.parser")

STEPS = 3  # steps 1 and 2 commit; the engine fails step 3 (its hook raises)


def _wait_for(path: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.02)


def _job(rank: int, world: int, address: str, layout: dict, engine: dict, flags: str) -> list:
    """Rank 0 trains, rank 1 serves. After each step the trainer writes
    done-<step> and waits for go-<step> (the test scrapes in between)."""
    import torch
    import weightsync.torch as wst

    if rank == 1:
        sub = ws.Subscriber(coordinator=address, engine=engine, replica=0, rank=0)
        params = wst.allocate_engine_params(engine)
        for name, t in params.items():
            sub.register(name, t)

        def fail_last(step: int) -> None:
            if step == STEPS:
                raise RuntimeError("engine refuses step 3 (test)")

        sub.on_begin(fail_last)
        outcomes = []
        while len(outcomes) < STEPS:
            out = sub.run_step(timeout=60.0)
            assert out is not None, "no step began within 60 s"
            outcomes.append((out.step, out.committed))
            if out.committed:  # the engine serves it (as a staged one would after its apply)
                assert sub.applied(out.step, {f"req-{out.step}": 10 * out.step}) is True
                open(os.path.join(flags, f"applied-{out.step}"), "w").close()
        _wait_for(os.path.join(flags, f"go-{STEPS}"))  # a member until the last scrape
        sub.close()
        return outcomes
    g = torch.Generator().manual_seed(1)
    tensors = {p["name"]: torch.randn(p["global_shape"], generator=g).to(torch.bfloat16)
               for p in layout["params"]}
    results = []
    with ws.Publisher(coordinator=address, rank=0, layout=layout, engine=engine,
                      bucket_bytes=64 << 10) as pub:
        for name, t in tensors.items():
            pub.register(name, t)
        for step in range(1, STEPS + 1):
            for t in tensors.values():
                t.add_(0.25 * step)  # every step carries other bytes
            res = pub.push(step)
            results.append((res.step, list(res.committed), [r for r, _ in res.failed]))
            open(os.path.join(flags, f"done-{step}"), "w").close()
            _wait_for(os.path.join(flags, f"go-{step}"))
    return results


def _scrape(port: int) -> dict:
    """{(name, frozenset(labels)): value} of every sample /metrics serves."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for family in prometheus_parser.text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def _value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_metrics_follow_a_real_sync(tmp_path):
    layout = json.loads(cli("trainer-layout", "--hf-config",
                            model_config("tiny-llama") + "/config.json", "--mesh", "fsdp=1").stdout)
    engine = {"framework": "vllm", "hf_config": model_config("tiny-llama") + "/config.json",
              "tp": 1, "replicas": 1, "dtype": "BF16"}
    coord = ws.Coordinator(metrics_port=0)
    port = coord.metrics_port
    assert port > 0
    flags = str(tmp_path)
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["results"] = run_world(_job, 2, coord.address, layout, engine, flags,
                                           timeout=300)
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome["error"] = e

    job = threading.Thread(target=run)
    job.start()
    try:
        seen = []
        for step in range(1, STEPS + 1):
            _wait_for(os.path.join(flags, f"done-{step}"))
            _wait_for(os.path.join(flags, f"applied-{min(step, 2)}"))  # the engine reported
            seen.append(_scrape(port))
            status = json.loads(cli("status", "--coordinator", coord.address, "--json").stdout)
            engines = [m for m in status["members"] if m["role"] == "engine"]
            assert [m["rank"] for m in engines] == [0], status
            assert engines[0]["version"] == min(step, 2), status
            applied = engines[0]["applied"]
            v = min(step, 2)
            assert applied["step"] == v and applied["requests"] == {f"req-{v}": 10 * v}, status
            assert status["steps"][-1]["step"] == step
            if step == 2:
                # The person's view (--watch on a terminal refreshes in place;
                # here the views follow each other): two views, each with the
                # engine rank's row and both steps.
                text = cli("status", "--coordinator", coord.address, "--watch", "--count", "2",
                           "--interval", "0.1").stdout
                views = text.split("coordinator " + coord.address)[1:]
                assert len(views) == 2, text
                for view in views:
                    assert "1 trainers, 1 engine ranks" in view, view
                    assert "newest committed version 2" in view, view
                    rows = [line.split() for line in view.splitlines()]
                    assert ["0", "0", "2", "0"] in rows, view  # rank, replica, version, lag
                    assert any(r[:1] == ["1"] and r[-2:] == ["0", "-"] for r in rows), view
                    assert any(r[:1] == ["2"] and r[-2:] == ["0", "-"] for r in rows), view
            open(os.path.join(flags, f"go-{step}"), "w").close()
    finally:
        for step in range(1, STEPS + 1):
            open(os.path.join(flags, f"go-{step}"), "a").close()
        job.join(timeout=300)
    assert "error" not in outcome, outcome.get("error")
    trainer, engine_out = outcome["results"]
    assert trainer == [(1, [0], []), (2, [0], []), (3, [], [0])]
    assert engine_out == [(1, True), (2, True), (3, False)]

    # The counters move with the steps.
    for step, m in enumerate(seen, start=1):
        assert _value(m, "weightsync_steps_begun_total") == step
        assert _value(m, "weightsync_steps_committed_total") == min(step, 2)
        assert _value(m, "weightsync_step_seconds_count") == step
        assert _value(m, "weightsync_members", role="trainer") == 1
        assert _value(m, "weightsync_members", role="engine") == 1
        assert _value(m, "weightsync_replicas_active") == 1
        # The engine's committed version and lag, per engine rank.
        assert _value(m, "weightsync_engine_version", engine_rank="0") == min(step, 2)
        assert _value(m, "weightsync_engine_version_lag", engine_rank="0") == 0
        # What it serves since when (its "applied" reports).
        assert _value(m, "weightsync_engine_applied_step", engine_rank="0") == min(step, 2)
        assert abs(_value(m, "weightsync_engine_applied_timestamp_seconds", engine_rank="0")
                   - time.time()) < 600
        # The ranks' own reports, with rank labels.
        assert _value(m, "weightsync_rank_bytes_total", role="trainer", rank="0") > 0
        assert _value(m, "weightsync_rank_phase_seconds", role="trainer", rank="0",
                      phase="pack") > 0
        assert ("weightsync_rank_phase_seconds",
                frozenset({"role": "engine", "rank": "0", "phase": "receive"}.items())) in m
    # Bytes: every committed step adds the engine rank's bytes.
    first, second = (_value(m, "weightsync_bytes_total") for m in seen[:2])
    assert first > 0 and second == 2 * first
    # Step 3 was aborted (no engine committed), counted with its reason, and
    # the engine rank's failure with its own.
    last = seen[-1]
    assert _value(last, "weightsync_steps_aborted_total", reason="no_engine_committed") == 1
    assert _value(last, "weightsync_engine_step_failures_total", engine_rank="0",
                  reason="failed") == 1
    assert _value(last, "weightsync_plan_changes_total") == 0
    coord.close()


def test_status_is_a_python_call_too():
    """ws.status(): what `weightsync status --json` prints, from Python (a
    trainer, a router): every engine rank's version, lag, torn flag and
    parity line; a coordinator nobody serves, a malformed address and a
    missing token fail at once, naming what is wrong."""
    engine = {"framework": "vllm", "hf_config": model_config("tiny-llama") + "/config.json",
              "tp": 1, "replicas": 2, "dtype": "BF16"}
    with ws.Coordinator(token="s3cret") as coord:
        subs = [ws.Subscriber(coordinator=coord, engine=engine, replica=r, rank=0,
                              token="s3cret", parity=f"line {r}") for r in range(2)]
        try:
            got = ws.status(coord, token="s3cret")
            engines = sorted((m for m in got["members"] if m["role"] == "engine"),
                             key=lambda m: m["rank"])
            assert [(m["rank"], m["replica"], m["version"], m["lag"], m["torn"], m["parity"])
                    for m in engines] == [(0, 0, -1, 0, False, "line 0"),
                                          (1, 1, -1, 0, False, "line 1")], got
            assert got["newest"] == -1 and got["open_step"] is None and got["steps"] == []
            token_file = os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                      f"ws-status-token-{os.getpid()}")
            with open(token_file, "w") as f:
                f.write("s3cret")
            try:
                text = cli("status", "--coordinator", coord.address, "--token-file", token_file,
                           "--json").stdout
            finally:
                os.unlink(token_file)
            by_cli = json.loads(text)
            strip = [{k: v for k, v in m.items() if k != "id"}
                     for m in by_cli["members"] if m["role"] == "engine"]
            assert strip == [{k: v for k, v in m.items() if k != "id"} for m in engines], (
                by_cli, got)
            with pytest.raises(ws.Error, match="token"):
                ws.status(coord, timeout=5.0)
        finally:
            for s in subs:
                s.close()
    with pytest.raises(ws.InvalidArgument, match="HOST:PORT"):
        ws.status("nowhere")
    with pytest.raises(ws.InvalidArgument, match="timeout"):
        ws.status("127.0.0.1:1", timeout=0)
    started = time.monotonic()
    with pytest.raises(ws.Error):
        ws.status("127.0.0.1:1", timeout=1.0)
    assert time.monotonic() - started < 5.0
