"""Support for tests/real_engines/test_vllm_lora.py: a trainer process holding
real PEFT adapters over a tiny base model, each behind weightsync.lora's
Publisher, pushing versions on command (and writing each version with PEFT's
save_pretrained, what a fresh engine loads from disk for the reference)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from typing import Any

from vllm_support import Trainer, Trainers

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def peft_model(base: str, rank: int = 8, alpha: int = 16, targets: Any = None) -> Any:
    """A PEFT LoRA model over the checkpoint at `base` (bf16; PEFT keeps the
    adapter in float32)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets or TARGETS),
                        lora_dropout=0.0)
    return get_peft_model(model, config)


def set_version(model: Any, seed: int) -> None:
    """Every lora_A / lora_B of the model drawn from `seed` (two seeds differ
    in every tensor): what an optimizer step would leave."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if ".lora_A." in name or ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _lora_trainer_main(base: str, adapters: dict, out_dir: str, commands: Any, results: Any,
                       options: dict, rank: int = 0, world: int = 1) -> None:
    """One trainer process, rank `rank` of `world` (each holding the whole
    adapters): `adapters` {name: (its job's coordinator address, its engine
    config)}, each adapter a job of its own; commands ("push", name, step,
    seed) set that adapter's version, save it (rank 0: out_dir/<name>-<step>)
    and push it; ("push_and_die", name, step, seed, seconds) dies `seconds`
    into the push; ("stop",)."""
    try:
        import weightsync.lora as wsl

        models, pubs = {}, {}
        for name, (coordinator, engine) in adapters.items():
            models[name] = peft_model(base)
            pubs[name] = wsl.publisher(models[name], coordinator=coordinator, rank=rank,
                                       engine=engine, world_size=world, step_timeout=60.0,
                                       **options)
        results.put(("ready", None))
        while True:
            cmd = commands.get()
            if cmd[0] == "stop":
                break
            name, step, seed = cmd[1], cmd[2], cmd[3]
            set_version(models[name], seed)
            saved = os.path.join(out_dir, f"{name}-{step}")
            if rank == 0:
                models[name].save_pretrained(saved)
            if cmd[0] == "push_and_die":
                pubs[name].push_async(step)
                time.sleep(cmd[4])
                os.kill(os.getpid(), signal.SIGKILL)
            res = pubs[name].push(step)
            results.put(("pushed", {"step": res.step, "committed": list(res.committed),
                                    "failed": [tuple(f) for f in res.failed],
                                    "bytes_sent": res.bytes_sent, "saved": saved}))
        for pub in pubs.values():
            pub.close()
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put(("error", traceback.format_exc()))


class LoraTrainer(Trainer):
    """The trainer process of adapter jobs, driven from the test."""

    def __init__(self, base: str, adapters: dict, out_dir: str, rank: int = 0, world: int = 1,
                 wait: bool = True, **options: Any):
        ctx = mp.get_context("spawn")
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_lora_trainer_main,
                                args=(base, adapters, out_dir, self.commands, self.results,
                                      options, rank, world), daemon=True)
        self.proc.start()
        if wait:
            self.ready()

    def ready(self) -> None:
        kind, value = self._next(180)
        assert kind == "ready", value

    def push(self, name: str, step: int, seed: int) -> None:  # type: ignore[override]
        self.commands.put(("push", name, step, seed))

    def push_and_die(self, name: str, step: int, seed: int,  # type: ignore[override]
                     seconds: float) -> None:
        self.commands.put(("push_and_die", name, step, seed, seconds))


class LoraTrainers(Trainers):
    """Trainer ranks 0..world-1 of adapter jobs, each its own process
    (LoraTrainer), driven together: a push is every rank's."""

    def __init__(self, base: str, adapters: dict, out_dir: str, world: int, **options: Any):
        self._start([LoraTrainer(base, adapters, out_dir, rank=r, world=world, wait=False,
                                 **options) for r in range(world)])

    def pushed(self, timeout: float = 120) -> dict:
        """Rank 0's result, with bytes_sent summed over the ranks."""
        results = [t.pushed(timeout) for t in self.ranks]
        return {**results[0], "bytes_sent": sum(r["bytes_sent"] for r in results)}
