"""HF checkpoints from sharded trainers, with real processes: FSDP2 trainers
(a transformers model; EP x FSDP for Qwen3-MoE, uneven FSDP for Llama) save
with pub.save_hf, and transformers' from_pretrained loads the directory to
the very weights they hold; ranks fill their shards from a transformers
checkpoint with pub.load_hf (each equal to `weightsync shard`) and save it
again, byte for byte; mismatches are clear errors naming key and rank."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import weightsync as ws
from helpers import REPO, cli, hf_checkpoint, load_safetensors, model_config, run_world

sys.path.insert(0, os.path.join(REPO, "examples"))
import fsdp2_trainer  # noqa: E402

transformers = pytest.importorskip("transformers")


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _read_dir(path: str) -> dict:
    """Every tensor of an HF directory, through its index."""
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    out = {}
    for name in sorted(set(index["weight_map"].values())):
        out.update(load_safetensors(os.path.join(path, name)))
    assert sorted(out) == sorted(index["weight_map"]), "index and files disagree"
    return out


def _save_rank(rank: int, world: int, model_dir: str, ep: int, coordinator: str, out: str,
               max_file_bytes: int) -> tuple:
    from torch.distributed.tensor import DTensor

    import weightsync.torch as wst

    model = fsdp2_trainer.build_model(model_dir, ep, "cpu")
    layout = wst.trainer_layout(model)
    state = model.state_dict()
    full = {p["name"]: (state[p["name"]].full_tensor() if isinstance(state[p["name"]], DTensor)
                        else state[p["name"]]).detach().clone() for p in layout["params"]}
    with ws.Publisher(coordinator=coordinator, rank=rank, layout=layout) as pub:
        pub.register_module(model)
        res = pub.save_hf(out, config=model.config, max_file_bytes=max_file_bytes)
        # Every rank returns only once the checkpoint is complete.
        assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
        summary = (res.files, res.total_bytes, list(res.files_written), res.bytes_sent)
    return (full, layout, summary) if rank == 0 else (None, None, summary)


SAVES = {
    # model, trainer ranks, ep, max_file_bytes
    "qwen3_moe-ep2xfsdp2": ("tiny-qwen3-moe", 4, 2, 60_000),
    "llama-fsdp3-uneven": ("tiny-llama", 3, 1, 5_000_000_000),
}


@pytest.mark.parametrize("case", list(SAVES))
def test_fsdp2_save_hf_loads_with_from_pretrained(tmp_path, case):
    model, world, ep, max_file_bytes = SAVES[case]
    out = str(tmp_path / "saved")
    with ws.Coordinator() as coord:
        results = run_world(_save_rank, world, model_config(model), ep, coord.address, out,
                            max_file_bytes, timeout=600)
    full, layout, _ = results[0]
    files, total, _, _ = results[0][2]
    written = sorted(f for r in results for f in r[2][2])
    assert [os.path.basename(f) for f in written] == \
        [f"model-{i:05d}-of-{files:05d}.safetensors" for i in range(1, files + 1)]
    if max_file_bytes < total:
        assert files > 1
    assert sum(r[2][3] for r in results) > 0, "no bytes moved between the ranks"
    # The files hold exactly the HF tensors of the trainer's weights.
    saved = _read_dir(out)
    reference = hf_checkpoint(layout, full)
    assert sorted(saved) == sorted(reference)
    for key, t in reference.items():
        assert _same_bits(saved[key], t), key
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        assert json.load(f)["metadata"]["total_size"] == total
    # transformers loads it, nothing missing or unexpected, to the same weights.
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, torch_dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    state = loaded.state_dict()
    assert sorted(n for n, _ in loaded.named_parameters()) == sorted(full)
    for name, t in full.items():
        assert _same_bits(state[name], t), name
    assert loaded.config.model_type == json.load(open(model_config(model) + "/config.json"))[
        "model_type"]


def _load_save_rank(rank: int, world: int, src: str, trainer: str, coordinator: str,
                    out: str, shards_dir: str, device: str, transport: str) -> dict:
    from helpers import load_safetensors as load

    if device == "cuda":
        # NCCL: a GPU per rank; else every rank on GPU 0 (of a one-GPU machine).
        torch.cuda.set_device(rank if transport == "nccl" else 0)
    with open(trainer) as f:
        layout = json.load(f)
    dtypes = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}
    reference = load(os.path.join(shards_dir, f"rank{rank}.safetensors"))
    with ws.Publisher(coordinator=coordinator, rank=rank, layout=layout) as pub:
        tensors = {}
        for p in layout["params"]:
            # Garbage first: load_hf must write every element.
            t = torch.full(tuple(reference[p["name"]].shape), 7, dtype=dtypes[p["dtype"]],
                           device=device)
            tensors[p["name"]] = t
            pub.register(p["name"], t)
        report = pub.load_hf(src)
        assert report.bytes > 0 and report.files >= 1
        for name, t in tensors.items():
            assert _same_bits(t.cpu(), reference[name]), (rank, name)
        res = pub.save_hf(out, max_file_bytes=40_000, bucket_bytes=4096, transport=transport)
    return {"files": res.files, "written": list(res.files_written)}


@pytest.mark.parametrize("device,transport",
                         [("cpu", "ucx"), ("cuda", "ucx"), ("cuda", "cuda_ipc"),
                          ("cuda", "nccl")])
def test_load_hf_then_save_hf_round_trips(tmp_path, device, transport):
    # CUDA shards: loaded through host staging, packed on the GPU and
    # assembled in pinned memory for the save; over UCX through pinned slots,
    # over cuda_ipc and NCCL through device slots (cuda_ipc: every rank on
    # GPU 0; NCCL: a GPU per rank).
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA shards need a GPU; torch sees none here")
    if transport == "nccl" and torch.cuda.device_count() < 4:
        pytest.skip("NCCL refuses two ranks of one communicator on one GPU (\"Duplicate GPU "
                    f"detected\"): 4 ranks need 4 GPUs, this machine has "
                    f"{torch.cuda.device_count()}")
    src = str(tmp_path / "src")
    torch.manual_seed(1)
    config = transformers.AutoConfig.from_pretrained(model_config("tiny-qwen3-moe"))
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(src, max_shard_size="50KB")
    assert len([f for f in os.listdir(src) if f.endswith(".safetensors")]) > 1
    trainer = str(tmp_path / "trainer.json")
    cli("trainer-layout", "--hf-config", model_config("tiny-qwen3-moe") + "/config.json", "--mesh",
        "ep=2,fsdp=2", "--out", trainer)
    shards = tmp_path / "shards"
    shards.mkdir()
    for r in range(4):
        cli("shard", "--checkpoint", src, "--trainer", trainer, "--rank", str(r), "--out",
            str(shards / f"rank{r}.safetensors"))
    out = str(tmp_path / "out")
    with ws.Coordinator() as coord:
        results = run_world(_load_save_rank, 4, src, trainer, coord.address, out, str(shards),
                            device, transport, timeout=600)
    assert sum(len(r["written"]) for r in results) == results[0]["files"]
    before, after = _read_dir(src), _read_dir(out)
    assert sorted(before) == sorted(after)
    for key, t in before.items():
        assert _same_bits(after[key], t), key


def test_load_hf_names_the_missing_key_and_the_rank(tmp_path):
    layout = {"mesh": {"axes": ["fsdp"], "shape": [1]},
              "params": [{"name": "w", "hf_keys": ["w"], "global_shape": [4, 2], "dtype": "F32",
                          "shards": []}]}
    from safetensors.torch import save_file
    save_file({"v": torch.zeros(4, 2)}, str(tmp_path / "model.safetensors"))
    with ws.Coordinator() as coord, \
            ws.Publisher(coordinator=coord.address, rank=0, layout=layout) as pub:
        pub.register("w", torch.zeros(4, 2))
        with pytest.raises(ws.Error) as err:
            pub.load_hf(str(tmp_path))
        assert err.value.code == "not_found"
        assert "'w'" in str(err.value) and "trainer rank 0" in str(err.value)
        save_file({"w": torch.zeros(4, 3)}, str(tmp_path / "model.safetensors"))
        with pytest.raises(ws.Error) as err:
            pub.load_hf(str(tmp_path))
        assert err.value.code == "mismatch"
        assert "[4, 3]" in str(err.value) and "[4, 2]" in str(err.value)


def test_save_hf_alone_writes_config_and_index(tmp_path):
    layout = {"mesh": {"axes": ["fsdp"], "shape": [1]},
              "params": [{"name": "a", "hf_keys": ["a"], "global_shape": [3, 2], "dtype": "F32",
                          "shards": []},
                         {"name": "b", "hf_keys": ["b"], "global_shape": [5], "dtype": "BF16",
                          "shards": []}]}
    a, b = torch.randn(3, 2), torch.randn(5).to(torch.bfloat16)
    out = str(tmp_path / "ckpt")
    with ws.Coordinator() as coord, \
            ws.Publisher(coordinator=coord.address, rank=0, layout=layout) as pub:
        pub.register("a", a)
        pub.register("b", b)
        res = pub.save_hf(out, config={"model_type": "toy", "hidden_size": 2}, max_file_bytes=1)
        assert res.files == 2 and res.bytes_sent == 0 and res.bytes_local == res.total_bytes
        with open(os.path.join(out, "config.json")) as f:
            assert json.load(f) == {"hidden_size": 2, "model_type": "toy"}
        saved = _read_dir(out)
        assert _same_bits(saved["a"], a) and _same_bits(saved["b"], b)
        # Again into the same directory, one file, no fsync, through the page
        # cache: the first save's files go.
        again = pub.save_hf(out, sync=False, direct_io=False)
    assert again.files == 1
    assert sorted(f for f in os.listdir(out) if f.endswith(".safetensors")) == \
        ["model-00001-of-00001.safetensors"]
    saved = _read_dir(out)
    assert _same_bits(saved["a"], a) and _same_bits(saved["b"], b)
