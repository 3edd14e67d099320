"""Support for the Python suites: real processes (spawned, torch.distributed
over gloo with a file store: no ports to race for), real transformers
checkpoints, and the `weightsync` command as the reference."""

from __future__ import annotations

import json
import multiprocessing as mp
import pickle
import os
import queue as queue_mod
import subprocess
import tempfile
import time
import traceback
from typing import Any, Callable

import weightsync as ws

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(REPO, "configs")


def model_config(name: str) -> str:
    return os.path.join(CONFIGS, "models", name)


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Runs the `weightsync` command the package ships."""
    return subprocess.run([ws.cli_path(), *args], capture_output=True, text=True, check=check)


def _child(fn: Callable, rank: int, world: int, store: str, queue: Any, args: tuple) -> None:
    import torch.distributed as dist

    try:
        if world > 0:
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                    world_size=world)
        # Pickled here (plainly: tensors by value, no shared memory that dies with
        # this process), so that a value that cannot cross is reported too.
        queue.put((rank, True, pickle.dumps(fn(rank, world, *args))))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if world > 0 and dist.is_initialized():
            dist.destroy_process_group()


def run_world(fn: Callable, world: int, *args: Any, timeout: float = 300) -> list:
    """Runs fn(rank, world, *args) in `world` spawned processes joined by a
    gloo process group; returns each rank's result (a failure in any rank
    fails the caller with that rank's traceback)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_child, args=(fn, r, world, store, queue, args))
                 for r in range(world)]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        try:
            deadline = time.monotonic() + timeout
            while len(results) < world:
                rank, ok, value = _next_result(queue, procs, deadline)
                if not ok:
                    raise AssertionError(f"rank {rank} failed:\n{value}")
                results[rank] = value
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    return [results[r] for r in range(world)]


def _next_result(queue: Any, procs: list, deadline: float) -> tuple:
    """The next (rank, ok, value) from the queue; fails at once when a process
    died without reporting (e.g. killed, or crashed while starting)."""
    while True:
        try:
            rank, ok, value = queue.get(timeout=0.5)
            return rank, ok, pickle.loads(value) if ok else value
        except queue_mod.Empty:
            pass
        dead = [p for p in procs if p.exitcode not in (None, 0)]
        if dead or all(p.exitcode is not None for p in procs):
            try:  # its report may have raced its exit
                rank, ok, value = queue.get(timeout=2)
                return rank, ok, pickle.loads(value) if ok else value
            except queue_mod.Empty:
                codes = [p.exitcode for p in procs]
                raise AssertionError(f"processes exited (codes {codes}) without reporting") \
                    from None
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the processes")


def start_process(fn: Callable, *args: Any) -> tuple[Any, Any]:
    """One spawned process running fn(*args) (its result or traceback comes
    back through the returned queue); returns (process, queue)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(_call, 0, 0, "", queue, (fn, args)))
    proc.start()
    return proc, queue


def _call(rank: int, world: int, fn: Callable, args: tuple) -> Any:
    return fn(*args)


def collect(proc: Any, queue: Any, timeout: float = 300) -> Any:
    try:
        _, ok, value = _next_result(queue, [proc], time.monotonic() + timeout)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
    if not ok:
        raise AssertionError(f"process failed:\n{value}")
    return value


def write_json(path: str, obj: Any) -> str:
    with open(path, "w") as f:
        json.dump(obj, f)
    return path


def save_safetensors(tensors: dict, path: str) -> str:
    """Writes {key: tensor} as one .safetensors file (contiguous CPU copies)."""
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, path)
    return path


def load_safetensors(path: str) -> dict:
    from safetensors.torch import load_file

    return load_file(path)


def hf_checkpoint(layout: dict, full: dict) -> dict:
    """{hf_key: tensor} of full (unsharded) params as the trainer layout maps
    them: padding cut, fused keys split along fused_dim, stacked keys along
    dim 0. Written independently of the C++ LoadSpec code (a reference)."""
    out = {}
    for spec in layout["params"]:
        t = full[spec["name"]]
        origin = spec.get("origin_shape") or spec["global_shape"]
        t = t[tuple(slice(0, n) for n in origin)]
        stacked = spec.get("stack_dim") == 0
        entries = [t[e] for e in range(t.shape[0])] if stacked else [t]
        keys = iter(spec["hf_keys"])
        per_entry = len(spec["hf_keys"]) // len(entries)
        for entry in entries:
            fd = spec["fused_dim"]
            parts = [entry] if fd is None else entry.chunk(per_entry, dim=fd - (1 if stacked else 0))
            for part in parts:
                out[next(keys)] = part.contiguous()
    return out


def module_of(tensors: dict) -> Any:
    """A torch module whose parameters are `tensors` under their dotted names
    (nested submodules), as an engine's or a trainer's model holds them."""
    import torch

    root = torch.nn.Module()
    for name, t in tensors.items():
        mod = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
    return root
