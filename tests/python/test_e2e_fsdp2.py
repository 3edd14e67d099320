"""End to end with real processes: the examples' FSDP2 trainer (a transformers
model; EP x FSDP for Qwen3-MoE, uneven FSDP shards for Llama) pushes 3 steps,
each after a real optimizer step, into two engine replicas of tp=2 at once:
one in direct mode (vLLM layout, in place), one in load_weights mode
(framework "hf", whole HF tensors to a callback). After every step every
engine rank holds exactly `weightsync materialize` of the trainer's weights."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import weightsync as ws
from helpers import (REPO, cli, collect, hf_checkpoint, load_safetensors, model_config, run_world,
                     save_safetensors, start_process, write_json)

sys.path.insert(0, os.path.join(REPO, "examples"))
import engine_worker  # noqa: E402
import fsdp2_trainer  # noqa: E402

STEPS = 3


def _trainer(rank: int, world: int, argv: list, ref_dir: str) -> list:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    args = fsdp2_trainer.parse_args(argv)
    if args.device == "cuda":
        torch.cuda.set_device(0)

    def reference(step, model, layout):
        # The full weights after this step's optimizer step (a collective).
        state = model.state_dict()
        full = {p["name"]: (state[p["name"]].full_tensor() if isinstance(state[p["name"]], DTensor)
                            else state[p["name"]]).detach().cpu() for p in layout["params"]}
        if rank == 0:
            save_safetensors(hf_checkpoint(layout, full), os.path.join(ref_dir, f"step{step}.safetensors"))
            write_json(os.path.join(ref_dir, "layout.json"), layout)
        dist.barrier()

    return fsdp2_trainer.train(rank, args, on_step=reference)


def _engine(argv: list) -> list:
    args = engine_worker.parse_args(argv)
    return engine_worker.serve(args, STEPS)


CASES = {
    # model, trainer ranks, ep, plan mode, device, transport
    "qwen3_moe-ep2xfsdp2-p2p": ("tiny-qwen3-moe", 4, 2, "p2p", "cpu", "ucx"),
    "llama-fsdp3-uneven-broadcast": ("tiny-llama", 3, 1, "broadcast", "cpu", "ucx"),
    "qwen3_moe-cuda-cuda_ipc": ("tiny-qwen3-moe", 1, 1, "p2p", "cuda", "cuda_ipc"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fsdp2_trainer_into_direct_and_load_weights_replicas(tmp_path, case):
    model, world, ep, mode, device, transport = CASES[case]
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA tensors on both sides need a GPU; torch sees none here")
    config = model_config(model) + "/config.json"
    vllm = {"framework": "vllm", "hf_config": config, "tp": 2, "replicas": 1}
    engine = write_json(str(tmp_path / "engine.json"), [vllm, {**vllm, "framework": "hf"}])
    dumps, refs = tmp_path / "dumps", tmp_path / "refs"
    dumps.mkdir()
    refs.mkdir()
    with ws.Coordinator() as coord:
        engines = []
        for replica, load_weights in ((0, False), (1, True)):
            for rank in range(2):
                argv = ["--coordinator", coord.address, "--engine", engine, "--replica", str(replica),
                        "--rank", str(rank), "--dump", str(dumps), "--transport", transport,
                        "--device", device] + (["--load-weights"] if load_weights else [])
                engines.append(start_process(_engine, argv))
        argv = ["--model", model_config(model), "--ep", str(ep), "--coordinator", coord.address,
                "--engine", engine, "--steps", str(STEPS), "--mode", mode, "--device", device,
                "--transport", transport]
        pushes = run_world(_trainer, world, argv, str(refs), timeout=900)
        outcomes = [collect(p, q, timeout=300) for p, q in engines]
    for rank_pushes in pushes:
        assert [p[1] for p in rank_pushes] == [[0, 1, 2, 3]] * STEPS, rank_pushes
    for out in outcomes:
        assert [(o[0], o[1]) for o in out] == [(s, True) for s in range(1, STEPS + 1)], out
    layout = json.loads((refs / "layout.json").read_text())
    if ep > 1:
        gate_up = next(p for p in layout["params"] if p["name"].endswith("experts.gate_up_proj"))
        assert [s["axis"] for s in gate_up["shards"]] == ["ep", "fsdp"] and gate_up["stack_dim"] == 0
    previous = None
    for step in range(1, STEPS + 1):
        ref_ckpt = str(refs / f"step{step}.safetensors")
        hf = load_safetensors(ref_ckpt)
        if previous is not None:  # a real optimizer step changed every tensor
            same = [k for k in hf if torch.equal(hf[k], previous[k])]
            assert not same, f"step {step} carries the bytes of step {step - 1}: {same[:5]}"
        previous = hf
        for g, (replica, rank) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
            out = str(tmp_path / f"ref-{g}.safetensors")
            cli("materialize", "--checkpoint", ref_ckpt, "--engine", engine, "--rank", str(g),
                "--out", out)
            want = load_safetensors(out)
            got = load_safetensors(str(dumps / f"engine{replica}-rank{rank}-step{step}.safetensors"))
            assert sorted(got) == sorted(want), (step, g)
            for name in want:
                assert torch.equal(got[name], want[name]), (step, g, name)
