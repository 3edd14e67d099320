"""`weightsync shard` of Megatron-Core layouts equals an independent reference
(megatron_reference.py, written from the facts, not from the C++) for every
rank of random meshes (pp 1-3, tp 1-4, ep/etp for MoE), on real transformers
checkpoints of every covered family; the Python generator equals the CLI's;
what Megatron refuses is refused."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

import weightsync as ws
import weightsync.megatron as wsm
from helpers import cli, load_safetensors, model_config
from megatron_reference import rank_params

transformers = pytest.importorskip("transformers")

FAMILIES = {  # family -> tiny config directory
    "llama": "tiny-llama", "qwen2": "tiny-qwen2", "qwen3": "tiny-qwen3",
    "qwen3_moe": "tiny-qwen3-moe", "mixtral": "tiny-mixtral", "deepseek_v3": "tiny-deepseek-v3",
}
MOE = {"qwen3_moe", "mixtral", "deepseek_v3"}


def _config(family: str, tp: int, layers: int, tie: bool, groups: int | None = None) -> dict:
    """A tiny config of `family` whose heads, groups and FFN rows split over tp
    (`groups` query groups, default tp; fewer than tp: each split in blocks)."""
    with open(os.path.join(model_config(FAMILIES[family]), "config.json")) as f:
        c = json.load(f)
    c["num_hidden_layers"] = layers
    c["tie_word_embeddings"] = tie
    c["vocab_size"] = 100  # padded to 128 x tp by Megatron-LM's default
    c["intermediate_size"] = 48
    if family == "deepseek_v3":
        c["num_attention_heads"] = c["num_key_value_heads"] = 2 * tp
        c["n_routed_experts"] = 8
        c["moe_intermediate_size"] = 16
        c["first_k_dense_replace"] = 1
    else:
        c["num_attention_heads"], c["num_key_value_heads"] = 2 * tp, groups or tp
        c["hidden_size"] = 48
        c.pop("head_dim", None)  # hidden / heads
        if family in ("qwen3", "qwen3_moe"):
            c["head_dim"] = 8
        if family == "qwen3_moe":
            c["num_experts"], c["moe_intermediate_size"] = 8, 16
            c["mlp_only_layers"] = [1] if layers > 1 else []
        if family == "mixtral":
            c["num_local_experts"] = 8
    return c


def _checkpoint(config: dict, path: str) -> dict:
    """A real transformers checkpoint of `config` (random weights, BF16)."""
    torch.manual_seed(len(path))
    cfg = transformers.AutoConfig.for_model(**config)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    hf = {}
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            hf.update(load_safetensors(os.path.join(path, name)))
    return hf


def _random_case(rng: random.Random) -> dict:
    family = rng.choice(sorted(FAMILIES))
    moe = family in MOE
    pp = rng.randint(1, 3)
    tp = rng.choice([1, 2, 4] if moe else [1, 2, 3, 4])
    dp = rng.choice([1, 2])
    sizes = {"pp": pp, "tp": tp, "dp": dp}
    if moe:  # ep x etp must divide a stage's tp x dp ranks (Megatron's rule)
        ep = rng.choice([e for e in (1, 2, 4) if e <= tp * dp])
        etp = rng.choice([e for e in (1, 2, tp) if (tp * dp) % (e * ep) == 0])
        sizes.update(ep=ep, etp=etp)
    opts = {}
    layers = pp * rng.randint(1, 2)
    if pp >= 2 and rng.random() < 0.3:  # uneven stages, as Megatron allows them
        opts = {"first": 1, "last": 2}
        layers = 3 + (pp - 2) * 2
    if family == "deepseek_v3":
        layers = max(layers, 2) if not opts else layers
    if tp in (1, 2, 4) and rng.random() < 0.2:
        opts["vocab_divisible_by"] = 0  # Megatron-Bridge's default: no padding
    tie = family in ("llama", "qwen2", "qwen3") and rng.random() < 0.4
    return {"family": family, "sizes": sizes, "opts": opts, "layers": layers, "tie": tie}


def _layout(config_path: str, case: dict) -> dict:
    opts = case["opts"]
    spec = ",".join(f"{k}={v}" for k, v in case["sizes"].items())
    args = ["trainer-layout", "--style", "megatron", "--hf-config", config_path, "--mesh", spec]
    if "first" in opts:
        args += ["--pp-first-layers", str(opts["first"]), "--pp-last-layers", str(opts["last"])]
    if "vocab_divisible_by" in opts:
        args += ["--vocab-divisible-by", str(opts["vocab_divisible_by"])]
    from_cli = json.loads(cli(*args).stdout)
    from_python = wsm.trainer_layout(config_path, spec, first_stage_layers=opts.get("first"),
                                     last_stage_layers=opts.get("last"),
                                     vocab_divisible_by=opts.get("vocab_divisible_by", 128))
    assert from_python == from_cli
    return from_cli


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


SEEDS = list(range(24))


@pytest.mark.parametrize("seed", SEEDS)
def test_shard_equals_the_reference_on_every_rank(tmp_path, seed):
    _check_every_rank(tmp_path, _random_case(random.Random(1500 + seed)))


# Expert parallel beside pipeline stages for every MoE family (the random
# cases draw few of these), and middle stages that hold no layer at all.
FIXED_CASES = {
    "mixtral-pp2-tp2-dp2-ep4": {"family": "mixtral", "layers": 2, "tie": False, "opts": {},
                                "sizes": {"pp": 2, "tp": 2, "dp": 2, "ep": 4, "etp": 1}},
    "qwen3_moe-pp3-tp2-dp2-ep2-etp2": {"family": "qwen3_moe", "layers": 3, "tie": False,
                                       "opts": {},
                                       "sizes": {"pp": 3, "tp": 2, "dp": 2, "ep": 2, "etp": 2}},
    "deepseek_v3-pp2-dp2-ep2": {"family": "deepseek_v3", "layers": 2, "tie": False, "opts": {},
                                "sizes": {"pp": 2, "tp": 1, "dp": 2, "ep": 2, "etp": 1}},
    "mixtral-pp2-tp1-dp4-ep2-etp2": {"family": "mixtral", "layers": 4, "tie": False, "opts": {},
                                     "sizes": {"pp": 2, "tp": 1, "dp": 4, "ep": 2, "etp": 2}},
    "llama-pp3-empty-middle-stage": {"family": "llama", "layers": 4, "tie": True,
                                     "opts": {"first": 2, "last": 2},
                                     "sizes": {"pp": 3, "tp": 2, "dp": 1}},
    # More tp ranks than query groups (Megatron-Core >= 0.16): each group's
    # grouped QKV rows (and bias) in tp/groups blocks; blocks cut heads.
    "llama-tp4-1-group": {"family": "llama", "layers": 2, "tie": False, "opts": {}, "groups": 1,
                          "sizes": {"pp": 1, "tp": 4, "dp": 1}},
    "qwen2-tp2-dp2-1-group": {"family": "qwen2", "layers": 2, "tie": True, "opts": {},
                              "groups": 1, "sizes": {"pp": 1, "tp": 2, "dp": 2}},
    "qwen3-pp2-tp4-2-groups": {"family": "qwen3", "layers": 2, "tie": False, "opts": {},
                               "groups": 2, "sizes": {"pp": 2, "tp": 4, "dp": 1}},
    "qwen3_moe-tp4-ep2-2-groups": {"family": "qwen3_moe", "layers": 2, "tie": False, "opts": {},
                                   "groups": 2,
                                   "sizes": {"pp": 1, "tp": 4, "dp": 1, "ep": 2, "etp": 1}},
}


@pytest.mark.parametrize("name", list(FIXED_CASES))
def test_shard_equals_the_reference_on_fixed_meshes(tmp_path, name):
    _check_every_rank(tmp_path, FIXED_CASES[name])


def _check_every_rank(tmp_path, case: dict) -> None:
    config = _config(case["family"], case["sizes"]["tp"], case["layers"], case["tie"],
                     case.get("groups"))
    config_path = str(tmp_path / "config.json")
    with open(config_path, "w") as f:
        json.dump(config, f)
    hf = _checkpoint(config, str(tmp_path / "ckpt"))
    layout = _layout(config_path, case)
    layout_path = str(tmp_path / "layout.json")
    with open(layout_path, "w") as f:
        json.dump(layout, f)
    sizes = case["sizes"]
    world = sizes["pp"] * sizes["tp"] * sizes["dp"]
    assert layout["mesh"]["axes"][0] == "pp"
    assert torch.tensor(layout["mesh"]["shape"]).prod().item() == world
    opts = {k: v for k, v in case["opts"].items()}
    for rank in range(world):
        out = str(tmp_path / f"rank{rank}.safetensors")
        cli("shard", "--checkpoint", str(tmp_path / "ckpt"), "--trainer", layout_path, "--rank",
            str(rank), "--out", out)
        got = load_safetensors(out)
        want = rank_params(config, sizes, hf, rank, **opts)
        assert sorted(got) == sorted(want), (case, rank)
        for name, tensor in want.items():
            assert _same_bits(got[name], tensor), (case, rank, name)


def test_random_cases_cover_every_family_and_the_features():
    cases = [_random_case(random.Random(1500 + s)) for s in SEEDS]
    assert {c["family"] for c in cases} == set(FAMILIES)
    assert {c["sizes"]["pp"] for c in cases} == {1, 2, 3}
    assert {c["sizes"]["tp"] for c in cases} == {1, 2, 3, 4}
    moe = [c["sizes"] for c in cases if c["family"] in MOE]
    assert any(s["ep"] > 1 for s in moe)
    assert any(s["etp"] > 1 for s in moe) and any(s["etp"] != s["tp"] for s in moe)
    assert any("first" in c["opts"] for c in cases)
    assert any(c["tie"] and c["sizes"]["pp"] > 1 for c in cases)


@pytest.mark.parametrize("layers, pp, first, last, why", [
    (5, 2, None, None, "Megatron-Core"), (7, 3, None, None, "Megatron-Core"),
    (8, 3, 1, None, "Megatron-Core"),
    # Megatron-Core's check passes these, but layers would sit on no stage.
    (4, 2, 1, 1, "on no stage"), (4, 3, 3, 2, "take more than")])
def test_uneven_stages_are_refused(tmp_path, layers, pp, first, last, why):
    config = _config("llama", 1, layers, False)
    path = str(tmp_path / "config.json")
    with open(path, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError):  # the reference refuses it too
        rank_params(config, {"pp": pp, "tp": 1}, {}, 0, first=first, last=last)
    with pytest.raises(ws.Error) as err:
        wsm.trainer_layout(path, pp=pp, first_stage_layers=first, last_stage_layers=last)
    assert err.value.code == "invalid_layout"
    assert why in str(err.value) and "stage" in str(err.value), str(err.value)
    args = ["trainer-layout", "--style", "megatron", "--hf-config", path, "--mesh", f"pp={pp}"]
    if first is not None:
        args += ["--pp-first-layers", str(first)]
    if last is not None:
        args += ["--pp-last-layers", str(last)]
    res = cli(*args, check=False)
    assert res.returncode != 0 and why in res.stderr, res.stderr


def test_python_layout_takes_a_dict_a_directory_and_a_transformers_config():
    path = model_config("tiny-qwen3-moe")
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    a = wsm.trainer_layout(path, pp=1, tp=2, ep=2, etp=1)
    b = wsm.trainer_layout(config, "pp=1,tp=2,ep=2,etp=1")
    c = wsm.trainer_layout(transformers.AutoConfig.for_model(**config), pp=1, tp=2, ep=2, etp=1)
    assert a == b
    assert [p["name"] for p in c["params"]] == [p["name"] for p in a["params"]]
    with pytest.raises(ws.Error, match="unknown name 'fsdp'"):
        wsm.trainer_layout(path, "pp=1,fsdp=2")


def test_wrapped_megatron_names_are_registered_under_their_layout_names():
    # Megatron wraps its model in DDP(Float16Module(GPTModel)): named_parameters()
    # then starts with module.module.; register_module drops those components.
    from weightsync._tensors import clean_name

    assert clean_name("module.module.decoder.layers.0.mlp.linear_fc1.weight") == \
        "decoder.layers.0.mlp.linear_fc1.weight"
    assert clean_name("module.embedding.word_embeddings.weight") == \
        "embedding.word_embeddings.weight"
    assert clean_name("module") == "module"
