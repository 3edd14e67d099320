"""One inference-engine rank that serves weight updates from weightsync.

    .venv/bin/python examples/engine_worker.py --coordinator 127.0.0.1:29600 \\
        --engine configs/examples/engine_tiny_qwen3_moe_vllm_tp4_ep.json --replica 0 --rank 1

Two ways an engine takes weights (DESIGN.md):
- direct (vLLM / SGLang layouts): the rank's parameters, under the engine's own
  names and fused shapes, are registered once; every step lands in them in
  place. Here a stand-in module holds them (in vLLM: the worker's
  `model_runner.model`).
- load_weights (--load-weights, for an engine group of framework "hf"): every
  HF tensor arrives whole, batch by batch, for the engine's own
  `model.load_weights(batch)`; then `process_weights_after_loading`. Here a
  stand-in keeps what it was given.

What weightsync adds to an engine's loop is five lines (marked "weightsync:").
"""

from __future__ import annotations

import argparse
import os
from typing import Optional

import torch

import weightsync as ws
import weightsync.torch as wst


class EngineModel(torch.nn.Module):
    """A stand-in for the engine's model: its parameters under the engine's
    names (dots become nested modules, as in the real model)."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in params.items():
            module = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(module, part):
                    module.add_module(part, torch.nn.Module())
                module = getattr(module, part)
            module.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))


class HfLoader:
    """A stand-in for `model.load_weights`: keeps a copy of every HF tensor."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.loaded_steps: list[int] = []

    def load_weights(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        for key, tensor in batch:
            self.tensors[key] = tensor.clone()  # the views are valid during the call only

    def process_weights_after_loading(self, step: int) -> None:
        self.loaded_steps.append(step)


def serve(args: argparse.Namespace,
          steps: Optional[int] = None) -> list[tuple[int, bool, str, int]]:
    """Serves `steps` steps (None: until stopped); returns the outcomes."""
    # weightsync: this rank of the engines, under its replica and rank.
    sub = ws.Subscriber(coordinator=args.coordinator, engine=args.engine, replica=args.replica,
                        rank=args.rank, transport=args.transport, staging=args.staging,
                        weights_device=args.device if args.load_weights else None)
    loader: Optional[HfLoader] = None
    model: Optional[EngineModel] = None
    if args.load_weights:
        loader = HfLoader()
        sub.on_weights(loader.load_weights)  # weightsync: HF tensors to the engine's loader
        sub.on_loaded(loader.process_weights_after_loading)
    else:
        model = EngineModel(wst.allocate_engine_params(args.engine, args.replica, args.rank,
                                                       device=args.device))
        sub.register_module(model)  # weightsync: the engine's own parameters
    sub.on_begin(lambda step: None)  # weightsync: pause generation here ...
    sub.on_end(lambda step: None)  # ... and resume it here
    outcomes: list[tuple[int, bool, str, int]] = []
    while steps is None or len(outcomes) < steps:
        out = sub.run_step(timeout=args.timeout)  # weightsync: or sub.serve() on a thread
        if out is None:
            continue
        outcomes.append((out.step, out.committed, out.reason, out.bytes))
        print(f"engine replica {args.replica} rank {args.rank}: step {out.step} "
              f"{'committed' if out.committed else 'failed: ' + out.reason} ({out.bytes} bytes, "
              f"{out.seconds:.3f} s)", flush=True)
        if args.dump and out.committed:
            dump(args, out.step, model, loader)
    sub.close()
    return outcomes


def dump(args: argparse.Namespace, step: int, model: Optional[torch.nn.Module],
         loader: Optional[HfLoader]) -> None:
    """What the engine holds now, as DIR/engine<replica>-rank<rank>-step<step>.safetensors."""
    from safetensors.torch import save_file

    if loader:
        tensors = loader.tensors
    else:
        assert model is not None  # one of the two holds the weights
        tensors = {n: p.detach() for n, p in model.named_parameters()}
    path = os.path.join(args.dump, f"engine{args.replica}-rank{args.rank}-step{step}.safetensors")
    save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, path)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--coordinator", required=True)
    p.add_argument("--engine", required=True, help="the engines' config (JSON file)")
    p.add_argument("--replica", type=int, default=0)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--load-weights", action="store_true",
                   help="take HF tensors through a load_weights callback (framework \"hf\")")
    p.add_argument("--staging", action="store_true")
    p.add_argument("--transport", default="ucx")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps")
    p.add_argument("--timeout", type=float, default=5.0)
    p.add_argument("--dump", default="", help="write the weights after every committed step here")
    return p.parse_args(argv)


if __name__ == "__main__":
    a = parse_args()
    serve(a, a.steps)
