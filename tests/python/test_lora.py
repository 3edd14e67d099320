"""weightsync.lora, the trainer side of adapter-only syncs (docs/lora.md).

End to end with real processes: two FSDP2 trainer ranks (fully_shard over
gloo on the CPU) hold a PEFT LoRA over a tiny transformers Qwen3, its
lora_A / lora_B sharded as DTensors; after each of 3 real optimizer steps
they push the adapter into two engine replicas (plain Subscribers). After
every step each engine holds, bit for bit and under PEFT's save_pretrained
keys, the full adapter PEFT's get_peft_model_state_dict gives.

In-process: the API's refusals (error codes and what they name), and the
engine config's JSON as weightsync's C++ reader and a Subscriber take it."""

from __future__ import annotations

import json
import os

import pytest
import torch

import weightsync as ws
from helpers import collect, run_world, start_process

STEPS = 3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FIRST_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def _qwen3_config(**overrides):
    from transformers import Qwen3Config

    fields = dict(head_dim=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                  tie_word_embeddings=False)
    fields.update(overrides)
    return Qwen3Config(**fields)


def _base_model(seed: int = 0, **overrides):
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(_qwen3_config(**overrides))


def _peft_model(seed: int = 0, **lora):
    from peft import LoraConfig, get_peft_model

    base = _base_model(seed)
    fields = dict(r=8, lora_alpha=16, target_modules=list(TARGETS), lora_dropout=0.0)
    fields.update(lora)
    return get_peft_model(base, LoraConfig(**fields))


def _adapter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if ".lora_A." in n or ".lora_B." in n)


# ---------------------------------------------------------------- end to end


def _trainer(rank: int, world: int, coordinator: str) -> dict:
    import torch.distributed as dist
    from peft import get_peft_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import weightsync.lora as wsl

    torch.set_num_threads(1)
    model = _peft_model(seed=0)  # the same seed on every rank: the same model
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    for layer in model.base_model.model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    lora = [(n, p) for n, p in model.named_parameters() if ".lora_A." in n or ".lora_B." in n]
    assert [n for n, _ in trainable] == [n for n, _ in lora], "PEFT trains the adapter only"
    assert len(lora) == 2 * len(TARGETS) * 2, len(lora)
    not_sharded = [n for n, p in lora if not isinstance(p, DTensor)]
    assert not not_sharded, f"FSDP2 left these unsharded: {not_sharded}"
    # Every lora tensor is split over both ranks (dim 0 is 8 or >= 64).
    local = sum(p.to_local().numel() for _, p in lora)
    total = sum(p.numel() for _, p in lora)
    assert 0 < local < total, (local, total)

    engine = wsl.engine_config(model, "math", lora_id=1, tp=1, replicas=2)
    optim = torch.optim.AdamW([p for _, p in trainable], lr=1e-2)
    g = torch.Generator().manual_seed(1234)
    batch = torch.randint(0, 128, (2, 16), generator=g)  # the same batch on both ranks

    refs, pushes = [], []
    with wsl.publisher(model, coordinator=coordinator, rank=rank, engine=engine,
                       connect_timeout=60.0, step_timeout=60.0) as pub:
        for step in range(1, STEPS + 1):
            out = model(input_ids=batch, labels=batch)
            out.loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            # PEFT's own view of the adapter (what save_pretrained writes),
            # gathered whole (full_tensor is a collective: both ranks).
            state = get_peft_model_state_dict(model)
            full = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                    for k, v in state.items()}
            res = pub.push(step)
            pushes.append({"step": res.step, "committed": list(res.committed),
                           "failed": [tuple(f) for f in res.failed],
                           "bytes_sent": res.bytes_sent, "loss": float(out.loss)})
            refs.append(full if rank == 0 else None)
    dist.barrier()
    return {"engine": engine, "pushes": pushes, "refs": refs, "local_bytes": local * 4}


def _engine(coordinator: str, engine: dict, replica: int) -> dict:
    torch.set_num_threads(1)
    sub = ws.Subscriber(coordinator=coordinator, engine=engine, replica=replica, rank=0,
                        connect_timeout=120.0, step_timeout=60.0)
    params = sub.params()
    held = {}
    for info in params:
        assert info.dtype == "F32", info
        # NaN, so that a tensor the sync never writes cannot pass as equal.
        held[info.name] = torch.full(info.shape, float("nan"), dtype=torch.float32)
        sub.register(info.name, held[info.name])
    steps = []
    while len(steps) < STEPS:
        out = sub.run_step(timeout=5.0)
        if out is None:
            continue
        steps.append({"step": out.step, "committed": out.committed, "reason": out.reason,
                      "bytes": out.bytes, "tensors": {k: v.clone() for k, v in held.items()}})
    sub.close()
    return {"params": [tuple(p) for p in params], "steps": steps}


def test_fsdp2_peft_adapter_into_two_engine_replicas(tmp_path):
    import weightsync.lora as wsl

    # The engine config, as the trainers will compute it from their sharded
    # model, computed here from the same model unsharded (DTensors report
    # their global shapes); the trainers' own must equal it.
    model = _peft_model(seed=0)
    engine = wsl.engine_config(model, "math", lora_id=1, tp=1, replicas=2)
    adapter_bytes = _adapter_bytes(model)
    assert {p.dtype for n, p in model.named_parameters() if ".lora_" in n} == {torch.float32}
    model.save_pretrained(str(tmp_path / "peft"))
    from safetensors.torch import load_file

    saved_keys = sorted(load_file(str(tmp_path / "peft" / "adapter_model.safetensors")))
    assert FIRST_KEY in saved_keys

    with ws.Coordinator() as coord:
        engines = [start_process(_engine, coord.address, engine, replica) for replica in (0, 1)]
        trainers = run_world(_trainer, 2, coord.address, timeout=240)
        outcomes = [collect(p, q, timeout=120) for p, q in engines]

    for t in trainers:
        assert t["engine"] == engine
    assert 0 < trainers[0]["local_bytes"] < adapter_bytes
    assert trainers[0]["local_bytes"] + trainers[1]["local_bytes"] == adapter_bytes

    refs = trainers[0]["refs"]
    assert sorted(refs[0]) == saved_keys, "PEFT's state dict keys are save_pretrained's"
    for step in range(1, STEPS + 1):
        sent = [t["pushes"][step - 1] for t in trainers]
        for s in sent:
            assert s["step"] == step and s["committed"] == [0, 1] and not s["failed"], s
        assert sum(s["bytes_sent"] for s in sent) == adapter_bytes * 2, (step, sent)

    # Every step's adapter differs from every other's, in every tensor.
    for a in range(STEPS):
        for b in range(a + 1, STEPS):
            same = [k for k in refs[a] if torch.equal(refs[a][k], refs[b][k])]
            assert not same, f"steps {a + 1} and {b + 1} carry the same bytes: {same[:4]}"
    # The loss went down: the optimizer steps were real ones.
    losses = [p["loss"] for p in trainers[0]["pushes"]]
    assert losses[-1] < losses[0], losses

    for replica, out in enumerate(outcomes):
        names = sorted(n for n, _, _ in out["params"])
        assert names == saved_keys, replica
        assert [(s["step"], s["committed"]) for s in out["steps"]] == \
            [(s, True) for s in range(1, STEPS + 1)], [(s["step"], s["reason"]) for s in out["steps"]]
        for step, got in enumerate(out["steps"], start=1):
            assert got["bytes"] == adapter_bytes, (replica, step, got["bytes"])
            want = refs[step - 1]
            assert sorted(got["tensors"]) == sorted(want)
            for key in want:
                assert got["tensors"][key].shape == want[key].shape, (replica, step, key)
                assert torch.equal(got["tensors"][key], want[key]), (replica, step, key)


# ---------------------------------------------------------------- the API's refusals


@pytest.fixture(scope="module")
def peft_model():
    return _peft_model(seed=0)


def test_adapter_params_of_a_model_without_lora():
    import weightsync.lora as wsl

    with pytest.raises(ws.Error) as e:
        wsl.adapter_params(_base_model())
    assert e.value.code == "not_found"
    assert isinstance(e.value, ws.NotFound)
    assert "'default'" in str(e.value) and "its adapters: none" in str(e.value)


def test_adapter_params_of_an_adapter_the_model_lacks(peft_model):
    import weightsync.lora as wsl

    with pytest.raises(ws.Error) as e:
        wsl.adapter_params(peft_model, "other")
    assert e.value.code == "not_found"
    assert "'other'" in str(e.value) and "its adapters: default" in str(e.value)
    with pytest.raises(ws.Error) as e:
        wsl.engine_config(peft_model, "math", adapter="other")
    assert e.value.code == "not_found"


def test_adapter_params_are_peft_keys_in_model_order(peft_model):
    import weightsync.lora as wsl

    params = wsl.adapter_params(peft_model)
    names = [n for n, _ in peft_model.named_parameters() if ".lora_A." in n or ".lora_B." in n]
    assert [k for k, _ in params] == [n.replace(".default.", ".") for n in names]
    assert params[0][0] == FIRST_KEY
    by_name = dict(peft_model.named_parameters())
    assert all(p is by_name[n] for (_, p), n in zip(params, names))
    assert wsl.peft_key("base_model.model.model.layers.1.mlp.down_proj.lora_B.default.weight") \
        == "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    assert wsl.peft_key("base_model.model.model.layers.1.mlp.down_proj.lora_B.x.weight") is None
    assert wsl.peft_key("base_model.model.model.layers.1.mlp.down_proj.base_layer.weight") is None


@pytest.mark.parametrize("lora_id", [0, -1, True, "1"])
def test_engine_config_refuses_a_lora_id_that_is_not_positive(peft_model, lora_id):
    import weightsync.lora as wsl

    with pytest.raises(ws.Error) as e:
        wsl.engine_config(peft_model, "math", lora_id=lora_id)
    assert e.value.code == "invalid_argument"
    assert "lora_id" in str(e.value) and "'math'" in str(e.value)


def test_engine_config_refuses_an_empty_name(peft_model):
    import weightsync.lora as wsl

    with pytest.raises(ws.Error) as e:
        wsl.engine_config(peft_model, "", lora_id=1)
    assert e.value.code == "invalid_argument"
    assert "name" in str(e.value)


def test_adapter_of_a_full_model_config_is_none(peft_model):
    import weightsync.lora as wsl

    full = {"framework": "hf", "hf_config": {"model_type": "qwen3"}, "tp": 1}
    assert wsl.adapter_of(full) is None
    assert wsl.adapter_of(json.dumps(full)) is None
    adapter = wsl.adapter_of(wsl.engine_config(peft_model, "math", lora_id=3))
    assert adapter is not None and adapter["name"] == "math" and adapter["id"] == 3


@pytest.mark.parametrize("bad_id", ["1", True])
def test_adapter_of_refuses_an_id_that_is_not_an_integer(peft_model, bad_id):
    import weightsync.lora as wsl

    engine = wsl.engine_config(peft_model, "math", lora_id=1)
    engine["lora"]["id"] = bad_id
    with pytest.raises(ws.Error) as e:
        wsl.adapter_of(engine)
    assert e.value.code == "format"
    assert "'lora.id'" in str(e.value) and "an integer" in str(e.value)


@pytest.mark.parametrize("bad_base", ["x", [1, 2], 5])
def test_adapter_of_refuses_a_base_that_is_not_an_object(peft_model, bad_base):
    import weightsync.lora as wsl

    engine = wsl.engine_config(peft_model, "math", lora_id=1)
    engine["lora"]["base"] = bad_base
    with pytest.raises(ws.Error) as e:
        wsl.adapter_of(engine)
    assert e.value.code == "format" and "'lora.base'" in str(e.value)


def test_modules_to_save_are_unsupported():
    import weightsync.lora as wsl

    model = _peft_model(seed=0, modules_to_save=["lm_head"])
    with pytest.raises(ws.Error) as e:
        wsl.adapter_params(model)
    assert e.value.code == "unsupported"
    assert "modules_to_save" in str(e.value) and "lm_head" in str(e.value)
    with pytest.raises(ws.Error) as e:
        wsl.engine_config(model, "math")
    assert e.value.code == "unsupported"


def test_check_base_refuses_another_hidden_size(peft_model):
    import weightsync.lora as wsl

    adapter = wsl.adapter_of(wsl.engine_config(peft_model, "math", lora_id=1))
    assert adapter["base"]["hidden_size"] == 64
    same = json.loads(_qwen3_config().to_json_string())
    wsl.check_base(adapter, same, "engine 0")  # the same base: accepted
    other = json.loads(_qwen3_config(hidden_size=128).to_json_string())
    with pytest.raises(ws.Error) as e:
        wsl.check_base(adapter, other, "engine 0")
    assert e.value.code == "mismatch"
    msg = str(e.value)
    assert "hidden_size" in msg and "64" in msg and "128" in msg and "engine 0" in msg
    assert "num_hidden_layers" not in msg  # only the field that differs


def test_engine_config_json_round_trips_into_weightsync(peft_model):
    import weightsync.lora as wsl
    from weightsync import _core

    engine = wsl.engine_config(peft_model, "math", lora_id=1, tp=2, replicas=2)
    text = json.dumps(engine)  # PEFT's enums and sets became JSON values
    assert json.loads(text) == engine
    config = engine["lora"]["config"]
    # Plain str, not PEFT's str-subclass enums (json.dumps alone would hide that).
    assert type(config["peft_type"]) is str and config["peft_type"] == "LORA"
    assert config["task_type"] is None  # get_peft_model was given none
    assert type(config["target_modules"]) is list
    assert config["target_modules"] == sorted(TARGETS)
    assert config["r"] == 8 and config["lora_alpha"] == 16
    assert engine["lora"]["base"]["model_type"] == "qwen3"

    # A config given as PEFT's to_dict (enums, a set) is made JSON alike.
    from peft import LoraConfig, TaskType

    given = LoraConfig(r=8, lora_alpha=16, target_modules=set(TARGETS),
                       task_type=TaskType.CAUSAL_LM).to_dict()
    assert isinstance(given["task_type"], TaskType) and isinstance(given["target_modules"], set)
    from_params = wsl.engine_config(wsl.adapter_params(peft_model), "math", config=given, tp=2,
                                    replicas=2)["lora"]["config"]
    assert type(from_params["task_type"]) is str and from_params["task_type"] == "CAUSAL_LM"
    assert from_params["target_modules"] == sorted(TARGETS)

    # weightsync's C++ reader takes it: every rank of every replica holds
    # every adapter tensor whole, under PEFT's keys.
    normalized = json.loads(_core.engine_config_json(text, os.getcwd()))
    assert normalized
    want = [(k, "F32", list(p.shape)) for k, p in wsl.adapter_params(peft_model)]
    for replica in (0, 1):
        for rank in (0, 1):
            got = [tuple(p) for p in ws.engine_params(text, replica=replica, rank=rank)]
            assert sorted(got) == sorted(want), (replica, rank)

    # A Subscriber opens on it (a coordinator in this process, no trainers).
    with ws.Coordinator() as coord:
        sub = ws.Subscriber(coordinator=coord.address, engine=text, replica=1, rank=1,
                            connect_timeout=5.0)
        try:
            assert sorted((p.name, p.dtype, p.shape) for p in sub.params()) == sorted(want)
            assert sub.global_rank == 3
        finally:
            sub.close()

    # A broken adapter config is refused by weightsync's reader too.
    broken = json.loads(text)
    broken["derived"]["ranks"][0]["params"][0]["shape"] = [1, 1]
    with pytest.raises(ws.Error):
        ws.engine_params(json.dumps(broken), replica=0, rank=0)


def test_trainer_layout_names_every_adapter_tensor(peft_model):
    import weightsync.lora as wsl

    layout = wsl.trainer_layout(peft_model)
    names = [p["name"] for p in layout["params"]]
    assert names == [k for k, _ in wsl.adapter_params(peft_model)]
