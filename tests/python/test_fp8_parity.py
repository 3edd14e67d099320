"""The parity check at connect (issue 54, docs/fp8.md "Parity at connect"):
weightsync's layout for an engine rank against the parameters the engine
holds, refused with a table before the Subscriber connects; the summary line
when they match. The engine here is a module of the layout's own tensors
(wst.allocate_engine_params), changed the way a real engine would differ."""
from __future__ import annotations

import json

import pytest
import torch

import weightsync as ws
import weightsync.torch as wst
from weightsync import _parity
from weightsync._engine import EngineSync
from helpers import cli, model_config
from test_engines import module_of

QWEN3_FP8 = {"framework": "vllm", "hf_config": model_config("tiny-qwen3-fp8") + "/config.json",
             "tp": 1, "replicas": 1, "dtype": "BF16"}
DOWN0 = "model.layers.0.mlp.down_proj.weight"
DOWN1 = "model.layers.1.mlp.down_proj.weight"


def held_of(tensors: dict) -> dict:
    return {n: (_parity.dtype_name(t), list(t.shape)) for n, t in tensors.items()}


def test_layout_matches_and_says_so():
    tensors = wst.allocate_engine_params(QWEN3_FP8, 0, 0)
    # The checkpoint leaves layer 0's down_proj BF16; the rest of the linears FP8.
    assert tensors[DOWN0].dtype == torch.bfloat16
    assert tensors[DOWN1].dtype == torch.float8_e4m3fn
    assert DOWN0 + "_scale_inv" not in tensors and DOWN1 + "_scale_inv" in tensors
    line = _parity.check(QWEN3_FP8, 0, 0, held_of(tensors))
    assert line == "7 of 8 linear weights FP8, scales fp32; matches the engine"
    with ws.Coordinator() as coord:
        sync = EngineSync(module_of(tensors), coord.address, QWEN3_FP8, 0, 0)
        assert sync.parity == line
        # The coordinator shows it per engine rank: `weightsync status`.
        status = json.loads(cli("status", "--coordinator", coord.address, "--json").stdout)
        engines = [m for m in status["members"] if m["role"] == "engine"]
        assert [(m["rank"], m["parity"]) for m in engines] == [(0, line)], status
        text = cli("status", "--coordinator", coord.address).stdout
        assert f"parity (engine rank 0): {line}" in text, text
        sync.close()


def test_module_the_checkpoint_leaves_bf16_but_the_engine_config_quantizes_is_refused():
    # An engine built from the checkpoint (down_proj of layer 0 in BF16),
    # synced with an engine config that quantizes every linear weight: the
    # model's config is given without its quantization_config, so the
    # engine config's "quantization" alone says (as before issue 54).
    import json

    hf = json.load(open(QWEN3_FP8["hf_config"]))
    live = wst.allocate_engine_params(QWEN3_FP8, 0, 0)
    del hf["quantization_config"]
    wrong = {**QWEN3_FP8, "hf_config": hf, "quantization": {"method": "fp8"}}
    with pytest.raises(ws.MismatchError) as e:
        _parity.check(wrong, 0, 0, held_of(live))
    text = str(e.value)
    assert "differ in 2 params; refused before any byte moves" in text, text
    assert "8 of 8 linear weights FP8" in text, text
    rows = [line.split() for line in text.splitlines()[1:]]
    assert rows[0][:2] == ["param", "weightsync"], text
    assert [DOWN0, "F8_E4M3", "[256,", "512]", "BF16", "[256,", "512]", "dtype"] in rows, text
    assert [DOWN0 + "_scale_inv", "F32", "[2,", "4]", "-", "not", "in", "the", "engine"] in rows
    # EngineSync refuses before its Subscriber opens: no coordinator needed.
    with pytest.raises(ws.MismatchError):
        EngineSync(module_of(live), "127.0.0.1:1", wrong, 0, 0)


def test_scale_format_the_engine_does_not_use_is_refused():
    # The engine holds per-tensor scales ("weight_scale", one F32) where the
    # layout has block scales; and one weight's UE8M0 scales packed four to
    # an int32, as DeepGEMM's layout on Blackwell has them.
    live = wst.allocate_engine_params(QWEN3_FP8, 0, 0)
    o1 = "model.layers.1.self_attn.o_proj.weight"
    scale = live.pop(DOWN1 + "_scale_inv")
    live[DOWN1 + "_scale"] = torch.zeros(1, dtype=torch.float32)
    live[o1 + "_scale_inv"] = torch.zeros([2, 1], dtype=torch.int32)
    rows = _parity.differences(_parity_layout(QWEN3_FP8), held_of(live))
    assert (DOWN1 + "_scale_inv", f"F32 {list(scale.shape)}", "-", "not in the engine") in rows
    assert (DOWN1 + "_scale", "-", "F32 [1]", "an FP8 scale the layout lacks") in rows
    assert (o1 + "_scale_inv", "F32 [2, 2]", "I32 [2, 1]", "dtype and shape") in rows
    assert len(rows) == 3, rows
    with pytest.raises(ws.MismatchError, match="differ in 3 params"):
        _parity.check(QWEN3_FP8, 0, 0, held_of(live))


def test_aliases_name_the_engine_side():
    live = wst.allocate_engine_params(QWEN3_FP8, 0, 0)
    renamed = {("model.inner." + n[len("model."):] if n.startswith("model.") else n): t
               for n, t in live.items()}
    aliases = {n: ("model.inner." + n[len("model."):] if n.startswith("model.") else n)
               for n in live}
    assert _parity.check(QWEN3_FP8, 0, 0, held_of(renamed), aliases).endswith("matches the engine")
    with pytest.raises(ws.MismatchError, match="not in the engine"):
        _parity.check(QWEN3_FP8, 0, 0, held_of(renamed))


def _parity_layout(engine):
    return [(p.name, p.dtype, p.shape) for p in ws.engine_params(engine, 0, 0)]
