"""LoRA adapters synced into a real SGLang engine (PyPI's sglang 0.5.23, on the
CPU) from real PEFT models (docs/lora.md).

SGLang 0.5.23 serves LoRA on the CPU with its torch_native LoRA backend,
once its LoRA layers' pinned host buffers are allowed without a CUDA driver
(the test shim makes pinning a no-op there: sglang_shim/sitecustomize.py).
A trainer process pushes only the adapter (weightsync.lora); the process
that owns the sglang.Engine takes each committed version through
weightsync.sglang.connect_lora (SGLang's own load_lora_adapter_from_tensors).
After every step, requests naming the adapter answer the tokens the same
version gives when SGLang's own loader reads it from disk (PEFT's
save_pretrained of the trainer's adapter), requests without it the base
model's; a trainer killed mid-step leaves the previous version serving; an
adapter the engine cannot serve is refused.

Run with the SGLang venv's python (tools/engines/setup_sglang.sh), like test_sglang.py.
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("sglang", reason="SGLang is not importable in this Python: run these tests "
                    "with the venv of tools/engines/setup_sglang.sh (sglang 0.5.23)")
pytest.importorskip("peft", reason="PEFT is not importable in this Python: "
                    "tools/engines/setup_sglang.sh installs it")
try:
    import weightsync as ws
    import weightsync._core  # noqa: F401
    import weightsync.lora as wsl
except ImportError as e:  # pragma: no cover - depends on the environment
    pytest.skip(f"weightsync (with its compiled extension) is not importable: {e}",
                allow_module_level=True)

import lora_support as ls  # noqa: E402
import sglang_procs as sp  # noqa: E402
import vllm_support as vs  # noqa: E402  (the tiny checkpoints)

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
NEW_TOKENS = 8
RANK = 8


@pytest.fixture(scope="module")
def sglang_lora(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("sglang-lora"))
    base = vs.make_checkpoint("qwen3", os.path.join(root, "base"), seed=100)
    os.environ["WEIGHTSYNC_TEST_SGLANG_LORA"] = "1"  # the shim's unpinned host memory
    try:
        engine = sp.start_engine(base, 1, enable_lora=True, max_lora_rank=RANK,
                                 lora_target_modules=ls.TARGETS, lora_backend="torch_native",
                                 max_loras_per_batch=4)
    finally:
        del os.environ["WEIGHTSYNC_TEST_SGLANG_LORA"]
    yield base, engine
    engine.close()


def _gen(engine, lora=None):
    return engine.call("lora_generate", prompts=PROMPTS, max_new_tokens=NEW_TOKENS, lora=lora)


def test_adapter_steps_a_killed_trainer_and_refusals(sglang_lora, tmp_path):
    base, engine = sglang_lora
    coord = ws.Coordinator()
    math = wsl.engine_config(ls.peft_model(base), "math", lora_id=1)
    size = sum(4 * t["shape"][0] * t["shape"][1] for t in math["derived"]["tensors"])
    trainer = ls.LoraTrainer(base, {"math": (coord.address, math)}, str(tmp_path),
                             transport="fault:ucx?delay_ms=300", bucket_bytes=8 << 10)
    try:
        base_tokens = _gen(engine)
        assert engine.call("lora_connect", coordinator=coord.address, engine_config=math,
                           step_timeout=30.0) == {"name": "math", "version": -1}
        # Before its first step the adapter is PEFT's initialization (lora_B
        # zero): the base model's tokens.
        assert _gen(engine, "math") == base_tokens
        answers = []
        for step, seed in [(1, 11), (2, 12)]:
            _gen(engine, "math")  # served with the previous version first
            trainer.push("math", step, seed)
            res = engine.call("lora_receive", name="math", step=step, timeout=90)
            assert "out" in res, res
            assert res["out"]["version"] == step and res["out"]["bytes"] == size, res
            pushed = trainer.pushed()
            assert pushed["committed"] == [0] and pushed["bytes_sent"] == size, pushed
            engine.call("lora_from_disk", name=f"disk-{step}", path=pushed["saved"])
            want = _gen(engine, f"disk-{step}")
            got = _gen(engine, "math")
            assert got == want, f"step {step}: tokens differ from SGLang loading it from disk"
            assert got != base_tokens
            assert _gen(engine) == base_tokens, f"step {step}: the base changed"
            answers.append(got)
        assert answers[0] != answers[1]

        # The trainer dies in step 3: SGLang keeps serving version 2.
        trainer.push_and_die("math", 3, 13, seconds=1.0)
        res = engine.call("lora_receive", name="math", step=3, timeout=90)
        print(f"\nlora_receive raised: {res.get('raised')}")
        assert res.get("raised", {}).get("code") == "peer_failure", res
        assert "step 3" in res["raised"]["message"]
        assert "serves version 2" in res["raised"]["message"]
        assert _gen(engine, "math") == answers[1]

        # Adapters the engine cannot serve, refused before anything moves.
        big = wsl.engine_config(ls.peft_model(base, rank=16), "big", lora_id=2)
        res = engine.call("lora_connect", coordinator=coord.address, engine_config=big)
        assert res["raised"]["code"] == "invalid_argument", res
        assert "'big'" in res["raised"]["message"] and "max_lora_rank is 8" in \
            res["raised"]["message"], res
        other = wsl.engine_config(ls.peft_model(base), "other", lora_id=3,
                                  base={"model_type": "qwen3", "hidden_size": 128})
        res = engine.call("lora_connect", coordinator=coord.address, engine_config=other)
        assert res["raised"]["code"] == "mismatch" and "hidden_size" in \
            res["raised"]["message"], res
        engine.call("lora_close")
    finally:
        trainer.close()
        coord.close()
