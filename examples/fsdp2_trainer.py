"""A transformers model trained under FSDP2 (expert parallel x FSDP for a MoE
model) that publishes its weights to inference engines after every step.

    # a coordinator, then 4 trainer ranks (gloo on CPU; --device cuda: NCCL)
    .venv/bin/weightsync coordinator --listen 127.0.0.1:29600 &
    .venv/bin/torchrun --nproc-per-node 4 examples/fsdp2_trainer.py \\
        --model configs/models/tiny-qwen3-moe --ep 2 --coordinator 127.0.0.1:29600 \\
        --engine configs/examples/engine_tiny_qwen3_moe_vllm_tp4_ep.json --steps 3
    # and the engines: examples/engine_worker.py, one process per engine rank

What weightsync adds to the loop is five lines (marked "weightsync:").

Expert parallel here: each MoE layer's stacked experts (transformers >= 5
holds `mlp.experts.gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]) are
DTensors sharded over "ep", then FSDP2 shards them over "fsdp" (which makes
them _StridedShard). That is where an EP x FSDP trainer keeps its weights,
which is all weightsync reads. To stay short, this example computes the
experts by all-gathering them over "ep" in the forward; a real EP trainer
dispatches tokens to the experts' ranks instead.
"""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import weightsync as ws
import weightsync.torch as wst

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def _gathered_forward(module: torch.nn.Module) -> Callable[..., Any]:
    """The module's own forward with its EP-sharded parameters all-gathered
    (full_tensor() is differentiable: gradients flow back to the shards)."""
    forward = type(module).forward

    def run(*args: Any, **kwargs: Any) -> Any:
        params = dict(module._parameters)
        try:
            for name, p in params.items():
                del module._parameters[name]
                setattr(module, name, p.full_tensor() if isinstance(p, DTensor) else p)
            return forward(module, *args, **kwargs)
        finally:
            for name, p in params.items():
                delattr(module, name)
                module._parameters[name] = p

    return run


def build_model(model_dir: str, ep: int, device: str) -> PreTrainedModel:
    """The model from its config (seeded: every rank starts alike), its
    experts sharded over "ep", everything under FSDP2 over "fsdp"."""
    from transformers import AutoConfig, AutoModelForCausalLM

    world = dist.get_world_size()
    if world % ep != 0:
        raise SystemExit(f"--ep {ep} does not divide the world of {world} ranks")
    torch.manual_seed(0)
    model: PreTrainedModel = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(model_dir)).to(device)
    mesh = init_device_mesh(device, (world // ep, ep), mesh_dim_names=("fsdp", "ep"))
    fsdp = mesh["fsdp"]
    for name, module in model.named_modules():
        if ep > 1 and name.endswith(".experts") and hasattr(module, "gate_up_proj"):
            for pname, p in list(module.named_parameters(recurse=False)):
                sharded = distribute_tensor(p.detach(), mesh["ep"], [Shard(0)])
                module.register_parameter(pname, torch.nn.Parameter(sharded))
            module.forward = _gathered_forward(module)
            fully_shard(module, mesh=fsdp)
    for layer in model.model.layers:
        fully_shard(layer, mesh=fsdp)
    fully_shard(model, mesh=fsdp)
    return model


def train_step(model: PreTrainedModel, optimizer: torch.optim.Optimizer, step: int,
               device: str) -> float:
    """One real step on a batch every rank draws alike (from the step number)."""
    g = torch.Generator().manual_seed(1000 + step)
    batch = torch.randint(0, model.config.vocab_size, (2, 16), generator=g).to(device)
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.detach())


def train(rank: int, args: argparse.Namespace,
          on_step: Optional[Callable[[int, torch.nn.Module, dict[str, Any]], None]] = None
          ) -> list[tuple[int, list[int], list[tuple[int, str]], int]]:
    """The training loop; returns this rank's push results. `on_step(step,
    model, layout)` runs after each optimizer step, before the push."""
    model = build_model(args.model, args.ep, args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # weightsync: where this rank's shards sit in HF space, then one publisher per rank.
    layout = wst.trainer_layout(model)
    pub = ws.Publisher(coordinator=args.coordinator, rank=rank, layout=layout, engine=args.engine,
                       transport=args.transport, mode=args.mode)
    pub.register_module(model)
    results: list[tuple[int, list[int], list[tuple[int, str]], int]] = []
    for step in range(1, args.steps + 1):
        loss = train_step(model, optimizer, step, args.device)
        if on_step:
            on_step(step, model, layout)
        res = pub.push(step)  # weightsync: the engines serve `step` from here on
        results.append((res.step, list(res.committed), list(res.failed), res.bytes_sent))
        if rank == 0:
            print(f"step {step}: loss {loss:.4f}; engines committed {res.committed}, "
                  f"failed {res.failed}; {res.bytes_sent} bytes from rank 0 in {res.seconds:.3f} s",
                  flush=True)
    pub.close()
    return results


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="an HF model directory (config.json)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks (MoE models)")
    p.add_argument("--coordinator", required=True, help="HOST:PORT of the weightsync coordinator")
    p.add_argument("--engine", required=True, help="the engines' config (JSON file)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--mode", default="p2p", choices=["p2p", "broadcast"])
    p.add_argument("--transport", default="ucx")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def main() -> None:
    args = parse_args()
    rank = int(os.environ.get("RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        train(rank, args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
