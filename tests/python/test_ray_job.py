"""examples/ray/sync_job.py as a user runs it: a real local Ray cluster of two
nodes (trainer node, engine node), two FSDP2 trainer actors (gloo on CPU) in
one placement group, two engine actors (weightsync Subscribers) in another, the
coordinator in a named actor, a real AdamW step before every push, over UCX.
The job checks every committed engine's tensors against the trainer's full
parameters by sha256 and reports per step; these tests read its JSON. One run
with every engine committing every step across a coordinator restart (Ray
restarts the coordinator actor before step 3); one where engine rank 1's process
dies inside step 2, Ray restarts it and it rejoins (elastic replicas) while
rank 0 commits every step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import REPO

pytest.importorskip("ray", reason="ray is not installed (python/requirements-dev.txt pins it)")

JOB = os.path.join(REPO, "examples", "ray", "sync_job.py")
TIMEOUT = 150


def _session_pids(sid: int) -> list[int]:
    """The processes of session `sid` (the job and everything Ray started for it)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # field 6 of stat: the session id
            pids.append(int(entry))
    return pids


def _kill_session(sid: int) -> None:
    for pid in _session_pids(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_job(*args: str) -> dict:
    """Runs the job in its own session (so that whatever it leaves can be found
    and ended); returns its JSON, checked to be stdout's only content."""
    proc = subprocess.Popen([sys.executable, JOB, "--json", *args], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the job shuts its cluster down on SIGTERM
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            _kill_session(proc.pid)
            out, err = proc.communicate()
        _kill_session(proc.pid)
        pytest.fail(f"sync_job.py {' '.join(args)} ran past {TIMEOUT} s; stderr ends:\n"
                    f"{err[-4000:]}")
    deadline = time.monotonic() + 15
    while _session_pids(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    left = _session_pids(proc.pid)
    _kill_session(proc.pid)
    assert not left, f"the job left processes behind: {left}"
    assert out.count("\n") == 1, f"stdout must hold one JSON line:\n{out[-2000:]}\n{err[-3000:]}"
    report = json.loads(out)
    assert proc.returncode == (0 if report["ok"] else 1), (proc.returncode, report["errors"])
    assert report["ok"], f"{report['errors']}\nstderr ends:\n{err[-4000:]}"
    return report


def check_layout(r: dict) -> None:
    """Two Ray nodes at least; trainers together on one, engines on another,
    the coordinator with the trainers; FSDP2 over gloo."""
    assert r["nodes"] >= 2 and r["cluster_nodes"] >= 2
    trainer_nodes = {t["node_id"] for t in r["trainers"]}
    engine_nodes = {e["node_id"] for e in r["engines"]}
    assert len(trainer_nodes) == 1 and not trainer_nodes & engine_nodes, r
    assert r["coordinator"]["node_id"] in trainer_nodes
    assert r["backend"] in ("gloo", "nccl") and len(r["trainers"]) == 2
    assert r["placement_groups"]["trainers"]["strategy"] == "STRICT_PACK"


def check_step(s: dict, prev: dict | None) -> None:
    assert s["bytes"] > 0 and s["seconds"] > 0 and s["tensors"] == 25, s
    assert sorted(s["verified"]) == sorted(s["committed"]), s
    if prev is not None:  # a real optimizer step changed every tensor
        assert s["unchanged_tensors"] == [], s


def check_every_engine_every_step(r: dict) -> list:
    """A run of steps 1-4 on the two-node layout in which both engine ranks
    commit every step, bit for bit; returns the steps."""
    check_layout(r)
    assert [s["step"] for s in r["steps"]] == [1, 2, 3, 4]
    prev = None
    for s in r["steps"]:
        check_step(s, prev)
        assert s["committed"] == [0, 1] and s["verified"] == [0, 1], s
        prev = s
    return r["steps"]


def test_a_killed_engine_is_restarted_by_ray_and_rejoins():
    kill_step = 2
    r = run_job("--steps", "4", "--kill-engine", f"1:{kill_step}")
    check_layout(r)
    steps = r["steps"]
    assert [s["step"] for s in steps] == list(range(1, len(steps) + 1)) and len(steps) >= 4
    prev = None
    for s in steps:  # the surviving replica commits, bit for bit, every step
        check_step(s, prev)
        assert 0 in s["committed"] and 0 in s["verified"], s
        prev = s
    assert 1 in steps[0]["verified"]
    killed = steps[kill_step - 1]
    assert 1 not in killed["committed"] and [f[0] for f in killed["failed"]] == [1], killed
    back = [s["step"] for s in steps if s["step"] > kill_step and 1 in s["verified"]]
    assert back, "engine rank 1 never came back"
    assert back == list(range(back[0], steps[-1]["step"] + 1)), back
    for s in steps[kill_step:back[0] - 1]:  # until then the survivor serves alone
        assert s["replicas"] == [0] and s["committed"] == [0], s
    k = r["kill"]
    assert k["restarted"] is True and k["pid_before"] != k["pid_after"], k
    assert k["rejoined_step"] == back[0]
    assert r["versions"] == {"0": steps[-1]["step"], "1": steps[-1]["step"]}


def test_every_engine_commits_every_step_across_a_coordinator_restart():
    """Every engine rank commits every step, bit for bit, with all of each
    step's bytes; and the coordinator actor is ray.kill()ed before step 3:
    Ray restarts it on its port, every trainer and engine rank registers
    again as the same member with what it holds, and steps 3 and 4 commit on
    every engine like 1 and 2. (One Ray job for both: a cluster start is
    most of a run's time.)"""
    r = run_job("--steps", "4", "--kill-coordinator", "3")
    for s in check_every_engine_every_step(r):
        assert s["replicas"] == [0, 1] and s["failed"] == [], s
        assert s["bytes"] == 2 * s["engine_bytes"]["0"] == 2 * s["engine_bytes"]["1"], s
    (restart,) = r["coordinator_restarts"]
    assert restart["step"] == 3 and restart["old_pid"] != restart["new_pid"], restart
    assert restart["address"] == r["coordinator"]["address"], restart
    assert restart["members"] == {"trainer": 2, "engine": 2}, restart
    assert r["versions"] == {"0": 4, "1": 4}
