"""weightsync.torch.trainer_layout from live parameters: real DTensors and
FSDP2 on CPU gloo (4 spawned ranks), checked against `weightsync shard` of
the same full tensors, byte for byte, on every rank."""

from __future__ import annotations

import json
import os

import pytest
import torch

import weightsync as ws
import weightsync.torch as wst
from helpers import (cli, hf_checkpoint, load_safetensors, model_config, run_world,
                     save_safetensors, write_json)


def check_against_shard(tmp_path, layout: dict, full: dict, local: list[dict]) -> None:
    """Every rank's local tensors equal `weightsync shard` of the full tensors."""
    ckpt = save_safetensors(hf_checkpoint(layout, full), str(tmp_path / "ckpt.safetensors"))
    layout_path = write_json(str(tmp_path / "layout.json"), layout)
    for rank, tensors in enumerate(local):
        out = str(tmp_path / f"ref{rank}.safetensors")
        cli("shard", "--checkpoint", ckpt, "--trainer", layout_path, "--rank", str(rank),
            "--out", out)
        ref = load_safetensors(out)
        assert sorted(ref) == sorted(tensors)
        for name, t in tensors.items():
            assert ref[name].shape == t.shape, (rank, name)
            assert torch.equal(ref[name], t), (rank, name)


def _fsdp_rank(rank: int, world: int, case: str) -> tuple:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    m = torch.nn.Module()
    if case == "fsdp_uneven":
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))
        m.a = torch.nn.Parameter(torch.randn(10, 3))   # 3, 3, 3, 1 rows
        m.b = torch.nn.Parameter(torch.randn(2, 5))    # 1, 1, 0, 0 rows
        m.c = torch.nn.Parameter(torch.randn(7, dtype=torch.bfloat16))
        fully_shard(m, mesh=mesh)
    elif case == "dp_tp_2d":
        # A 2-D (dp, tp) mesh without FSDP2: tensor-parallel column and row
        # shards, uneven on both dims, a dim sharded over both axes at once,
        # and a param replicated over the whole mesh.
        from torch.distributed.tensor import Replicate

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        m.col = torch.nn.Parameter(distribute_tensor(torch.randn(9, 5), mesh,
                                                     [Replicate(), Shard(0)]))  # 5 + 4 rows
        m.row = torch.nn.Parameter(distribute_tensor(torch.randn(4, 7), mesh,
                                                     [Replicate(), Shard(1)]))  # 4 + 3 cols
        m.both = torch.nn.Parameter(distribute_tensor(torch.randn(7, 6), mesh,
                                                      [Shard(1), Shard(0)]))
        m.deep = torch.nn.Parameter(distribute_tensor(torch.randn(11, 2), mesh,
                                                      [Shard(0), Shard(0)]))  # 6 | 5, then halves
        m.norm = torch.nn.Parameter(distribute_tensor(torch.randn(5), mesh,
                                                      [Replicate(), Replicate()]))
    else:
        # Experts sharded over "ep", then FSDP2 over "fsdp": _StridedShard. The
        # root mesh is (fsdp, ep) or (ep, fsdp): FSDP2 builds a (fsdp, ep) mesh
        # either way, row-major in name order or not.
        names = ("fsdp", "ep") if case == "ep_fsdp" else ("ep", "fsdp")
        root = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        experts = torch.nn.Module()
        full = torch.randn(6, 8, 4)  # 3 experts per ep rank, then 2 + 1 per fsdp rank
        experts.gate_up_proj = torch.nn.Parameter(distribute_tensor(full, root["ep"], [Shard(0)]))
        full_down = torch.randn(6, 4, 4)
        experts.down_proj = torch.nn.Parameter(distribute_tensor(full_down, root["ep"], [Shard(0)]))
        m.experts = experts
        m.norm = torch.nn.Parameter(torch.randn(5, 4))
        fully_shard(m.experts, mesh=root["fsdp"])
        fully_shard(m, mesh=root["fsdp"])
    layout = wst.trainer_layout(m.named_parameters())
    full = {n: p.full_tensor().detach() for n, p in m.named_parameters()}
    local = {n: p.to_local().detach().clone() for n, p in m.named_parameters()}
    placements = {n: [str(x) for x in p.placements] for n, p in m.named_parameters()}
    return layout, full, local, placements


@pytest.mark.parametrize("case", ["fsdp_uneven", "ep_fsdp", "ep_fsdp_not_row_major", "dp_tp_2d"])
def test_fsdp2_layouts_match_shard(tmp_path, case):
    results = run_world(_fsdp_rank, 4, case)
    layouts = [r[0] for r in results]
    assert all(lay == layouts[0] for lay in layouts), "every rank computes the same layout"
    layout = layouts[0]
    if case == "dp_tp_2d":
        specs = {p["name"]: p for p in layout["params"]}
        assert layout["mesh"] == {"axes": ["dp", "tp"], "shape": [2, 2]}
        # Cuts of different dims commute; of one dim, the mesh order decides.
        assert sorted((s["dim"], s["axis"]) for s in specs["both"]["shards"]) == [(0, "tp"),
                                                                                 (1, "dp")]
        assert [(s["dim"], s["axis"]) for s in specs["deep"]["shards"]] == [(0, "dp"), (0, "tp")]
        assert specs["norm"]["shards"] == []
    elif case != "fsdp_uneven":
        placements = results[0][3]["experts.gate_up_proj"]
        assert any("_StridedShard" in p or "_S(" in p for p in placements), placements
        spec = next(p for p in layout["params"] if p["name"] == "experts.gate_up_proj")
        assert [s["axis"] for s in spec["shards"]] == ["ep", "fsdp"]  # EP first, then FSDP
        assert layout["mesh"]["axes"][-1] == ("ep" if case == "ep_fsdp" else "fsdp")
    check_against_shard(tmp_path, layout, results[0][1], [r[2] for r in results])


def test_plain_tensors_replicate_and_hf_keys_override():
    params = [("model.w", torch.zeros(4, 3)), ("model.fused", torch.zeros(6, 2))]
    layout = wst.trainer_layout(
        params, hf_keys={"model.fused": {"hf_keys": ["k.a", "k.b"], "fused_dim": 0}})
    assert layout["mesh"] == {"axes": [], "shape": []}  # a world of one rank
    w, fused = layout["params"]
    assert w["hf_keys"] == ["model.w"] and w["shards"] == [] and w["dtype"] == "F32"
    assert fused["hf_keys"] == ["k.a", "k.b"] and fused["fused_dim"] == 0
    with pytest.raises(ws.Error) as e:
        wst.trainer_layout(params, hf_keys={"model.fused": ["k.a", "k.b"]})
    assert e.value.code == "invalid_argument" and "need a fused_dim" in str(e.value)
    with pytest.raises(ws.Error) as e:
        wst.trainer_layout([("x", torch.zeros(2, dtype=torch.complex64))])
    assert "has no safetensors name" in str(e.value)


@pytest.mark.parametrize("model", ["tiny-qwen3-moe", "tiny-mixtral", "tiny-deepseek-v3"])
def test_transformers_fused_experts_map_to_checkpoint_keys(tmp_path, model):
    """transformers >= 5 holds experts stacked in memory and saves per-expert
    keys: the layout of the live model reads the saved checkpoint back into
    exactly the in-memory tensors (`weightsync shard`)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(model_config(model))
    torch.manual_seed(1)
    net = transformers.AutoModelForCausalLM.from_config(config)
    net.save_pretrained(str(tmp_path / "hf"))
    layout = wst.trainer_layout(net)
    stacked = [p for p in layout["params"] if p.get("stack_dim") == 0]
    assert stacked, "the model holds stacked experts"
    layout_path = write_json(str(tmp_path / "layout.json"), layout)
    cli("shard", "--checkpoint", str(tmp_path / "hf"), "--trainer", layout_path, "--rank", "0",
        "--out", str(tmp_path / "r0.safetensors"))
    ref = load_safetensors(str(tmp_path / "r0.safetensors"))
    for name, p in net.named_parameters():
        assert torch.equal(ref[name], p.detach()), name
    keys = sorted(k for spec in layout["params"] for k in spec["hf_keys"])
    index = json.load(open(tmp_path / "hf" / "model.safetensors.index.json")) \
        if os.path.exists(tmp_path / "hf" / "model.safetensors.index.json") else None
    saved = sorted(index["weight_map"]) if index else \
        sorted(load_safetensors(str(tmp_path / "hf" / "model.safetensors")))
    assert keys == saved
