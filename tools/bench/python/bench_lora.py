"""`python tools/bench/python/bench.py lora`: adapter-only sync of a PEFT LoRA
against a merged full sync of the same model, in one run.

A randomly initialized Qwen3-shaped bf16 model (default: Qwen3-0.6B's shape,
--layers to shrink it) gets a PEFT LoRA (r=--rank, lora_alpha 2r, on q, k, v,
o, gate, up and down projections). Two jobs then run in turn, each a trainer
(this process) behind a weightsync.Publisher and one engine rank (a spawned
process) behind a weightsync.Subscriber holding host tensors, over the real
transport, on a coordinator of its own:

- adapter: weightsync.lora.engine_config / weightsync.lora.publisher: only
  the lora_A / lora_B tensors travel, under PEFT's keys;
- merged: what a user does without it: every step the adapter is merged
  into a copy of the base weights (PEFT's merge: base + get_delta_weight,
  B @ A * scaling) and the whole model is pushed (every HF tensor whole).

Both jobs sync the same versions: before every push the adapter takes a
small random step (noise on every lora_A / lora_B, the same noise in both
jobs), so every step carries different bytes. One warm-up push, then --steps
timed ones. Reported per job: the bytes a push sends (PushResult.bytes_sent;
the engine's received bytes must match), the median push seconds
(PushResult.seconds; the wall time around push() beside it) and, for merged,
the median merge time; then bytes_ratio and time_ratio (adapter / merged).
At the end the engine sends a digest of every tensor it holds; each must
equal the trainer's last version bit for bit, else the bench fails.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import multiprocessing as mp
import queue as queue_mod
import statistics
import sys
import time
from typing import Any, Callable

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

# Qwen3-0.6B's shape (its config.json), but for num_hidden_layers (--layers).
QWEN3_0_6B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                  num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                  vocab_size=151936, tie_word_embeddings=True)

ENGINE_IDLE_S = 900.0  # an engine that sees no step this long gives up


def _digest(t: Any) -> str:
    """blake2b of a tensor's bytes (bit for bit)."""
    import torch

    raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(raw, digest_size=20).hexdigest()


def _engine(engine_json: str, address: str, transport: str, steps: int, queue: Any) -> None:
    """One engine rank: host tensors for every param sub.params() names,
    `steps` steps, then the digest of every tensor it holds."""
    try:
        import weightsync as ws
        import weightsync.torch as wst

        sub = ws.Subscriber(coordinator=address, engine=engine_json, replica=0, rank=0,
                            transport=transport)
        tensors = wst.allocate_engine_params(engine_json, 0, 0)
        names = [p.name for p in sub.params()]
        if sorted(names) != sorted(tensors):
            raise RuntimeError(f"sub.params() ({len(names)}) and the engine config's params "
                               f"({len(tensors)}) differ")
        for p in sub.params():
            t = tensors[p.name]
            if list(t.shape) != list(p.shape):
                raise RuntimeError(f"{p.name}: shape {list(t.shape)} vs sub.params() {p.shape}")
            sub.register(p.name, t)
        sub.prepare()
        got: list[dict] = []
        idle_since = time.monotonic()
        while len(got) < steps:
            out = sub.run_step(timeout=5.0)
            if out is None:
                if time.monotonic() - idle_since > ENGINE_IDLE_S:
                    raise TimeoutError(f"no step for {ENGINE_IDLE_S:.0f} s after {len(got)} steps")
                continue
            idle_since = time.monotonic()
            if not out.committed:
                raise RuntimeError(f"step {out.step} did not commit: {out.reason}")
            got.append({"step": out.step, "bytes": out.bytes, "seconds": out.seconds})
        digests = {name: _digest(t) for name, t in tensors.items()}
        sub.close()
        queue.put(("engine", {"steps": got, "digests": digests}))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put(("error", repr(e)))


def full_engine_config(layout: dict, hf_config: dict) -> dict:
    """The engine config of a full-model job whose one engine rank holds every
    HF tensor of a plain (unsharded, unfused) trainer `layout` whole: the
    shape of weightsync.lora.engine_config's, without its "lora" field."""
    tensors, params = [], []
    for spec in layout["params"]:
        if spec["hf_keys"] != [spec["name"]] or spec["shards"]:
            raise RuntimeError(f"{spec['name']}: HF keys {spec['hf_keys']}, shards "
                               f"{spec['shards']} (expected its own name, whole)")
        key, shape, dtype = spec["name"], list(spec["global_shape"]), spec["dtype"]
        tensors.append({"key": key, "shape": shape, "dtype": dtype})
        box = {"offsets": [0] * len(shape), "lengths": shape}
        params.append({"name": key, "dtype": dtype, "shape": shape, "segments": [
            {"hf_key": key, "hf_box": box, "param_box": box, "transpose": False}]})
    return {"framework": "derived", "hf_config": dict(hf_config), "tp": 1, "replicas": 1,
            "dtype": tensors[0]["dtype"], "derived": {"tensors": tensors,
                                                      "ranks": [{"rank": 0, "params": params}]}}


def build(args: argparse.Namespace) -> tuple[Any, Any, dict]:
    """(PEFT model, a copy of its base model for the merged weights, shape)."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    shape = dict(QWEN3_0_6B, num_hidden_layers=args.layers)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**shape), dtype=torch.bfloat16)
    model.requires_grad_(False)
    merged = copy.deepcopy(model)  # before PEFT wraps model's linears
    lora = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS,
                           lora_dropout=0.0)
    peft_model = peft.get_peft_model(model, lora,
                                     autocast_adapter_dtype=args.adapter_dtype == "fp32")
    shape["params"] = sum(p.numel() for p in merged.parameters())
    shape["dtype"] = "bf16"
    return peft_model, merged, shape


def _lora_layers(peft_model: Any) -> list:
    """[(name in the base model, PEFT LoRA layer)]."""
    from peft.tuners.lora import LoraLayer

    return [(n, m) for n, m in peft_model.base_model.model.named_modules()
            if isinstance(m, LoraLayer)]


def merge_into(merged: Any, layers: list) -> None:
    """PEFT's merge (LoraLayer.merge, safe_merge=False) into the copy: each
    target's weight = the base weight + get_delta_weight (B @ A * scaling)."""
    import torch

    with torch.no_grad():
        for name, layer in layers:
            w = merged.get_submodule(name).weight
            w.copy_(layer.get_base_layer().weight)
            w += layer.get_delta_weight("default")


def run_job(label: str, engine: dict, make_pub: Callable[[str, dict], Any],
            update: Callable[[int], dict], trainer_tensors: list, steps: int,
            opts: dict) -> dict:
    """One job: an engine process, this process's publisher, a warm-up push
    and `steps` timed ones (update(step) before each), then the bit-for-bit
    check of the engine's last version against `trainer_tensors`."""
    import weightsync as ws

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    engine_json = json.dumps(engine)
    rows = []
    with ws.Coordinator() as coord:
        proc = ctx.Process(target=_engine, args=(engine_json, coord.address, opts["transport"],
                                                 steps + 1, queue), daemon=True)
        proc.start()
        try:
            pub = make_pub(coord.address, opts)
            try:
                pub.prepare()
                for step in range(1, steps + 2):
                    extra = update(step)
                    t0 = time.perf_counter()
                    res = pub.push(step)
                    wall = time.perf_counter() - t0
                    if res.failed or res.committed != [0]:
                        raise RuntimeError(f"{label} step {step}: committed {res.committed}, "
                                           f"failed {res.failed}")
                    rows.append({"step": step, "bytes_sent": res.bytes_sent,
                                 "seconds": res.seconds, "wall_s": wall, **extra})
            finally:
                pub.close()
            try:
                kind, value = queue.get(timeout=600)
            except queue_mod.Empty:
                raise RuntimeError(f"{label}: the engine process sent nothing "
                                   f"(exit code {proc.exitcode})") from None
            if kind == "error":
                raise RuntimeError(f"{label}: the engine process failed: {value}")
            proc.join(timeout=60)
        finally:
            if proc.is_alive():
                proc.kill()
                proc.join()
    want = {key: _digest(t) for key, t in trainer_tensors}
    got = value["digests"]
    wrong = sorted(k for k in want if got.get(k) != want[k])
    extra_keys = sorted(set(got) - set(want))
    if wrong or extra_keys:
        raise RuntimeError(f"{label}: the engine's last version differs from the trainer's: "
                           f"{len(wrong)} of {len(want)} tensors wrong ({wrong[:3]}), "
                           f"{len(extra_keys)} unexpected ({extra_keys[:3]})")
    for row, e in zip(rows, value["steps"]):
        if e["step"] != row["step"] or e["bytes"] != row["bytes_sent"]:
            raise RuntimeError(f"{label} step {row['step']}: the trainer sent "
                               f"{row['bytes_sent']} B, engine step {e['step']} got {e['bytes']} B")
        row["engine_s"] = e["seconds"]
    timed = rows[1:]  # without the warm-up push
    out = {"bytes_per_step": int(statistics.median(r["bytes_sent"] for r in timed)),
           "seconds_median": statistics.median(r["seconds"] for r in timed),
           "wall_seconds_median": statistics.median(r["wall_s"] for r in timed),
           "engine_seconds_median": statistics.median(r["engine_s"] for r in timed),
           "tensors": len(want), "verified": True, "steps": timed}
    if "merge_s" in timed[0]:
        out["merge_seconds_median"] = statistics.median(r["merge_s"] for r in timed)
    return out


def main(argv: list) -> int:
    p = argparse.ArgumentParser(prog="python tools/bench/python/bench.py lora",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    p.add_argument("--rank", type=int, default=16, help="LoRA r (lora_alpha is 2r)")
    p.add_argument("--layers", type=int, default=QWEN3_0_6B["num_hidden_layers"],
                   help="decoder layers (default 28: Qwen3-0.6B)")
    p.add_argument("--adapter-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="fp32: PEFT's default on a bf16 base (autocast_adapter_dtype); "
                   "bf16: the base's")
    p.add_argument("--noise", type=float, default=1e-3,
                   help="std of the per-step noise on every lora_A / lora_B")
    p.add_argument("--transport", default="ucx")
    p.add_argument("--bucket-bytes", type=int, default=256 << 20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout, last")
    args = p.parse_args(argv)
    if args.steps < 1 or args.rank < 1 or args.layers < 1:
        p.error("--steps, --rank and --layers must be positive")

    import torch

    import weightsync as ws
    import weightsync.lora as wsl
    import weightsync.torch as wst

    opts = {"transport": args.transport, "bucket_bytes": args.bucket_bytes}
    peft_model, merged, shape = build(args)
    adapter = wsl.adapter_params(peft_model)
    start = [t.detach().clone() for _, t in adapter]
    layers = _lora_layers(peft_model)

    def perturb(gen: Any) -> None:
        with torch.no_grad():
            for _, t in adapter:
                t.add_(torch.randn(t.shape, generator=gen, dtype=torch.float32)
                       .mul_(args.noise).to(t.dtype))

    def versions() -> Any:
        """The adapter back at its start and a fresh noise generator: both
        jobs sync the same versions."""
        with torch.no_grad():
            for (_, t), s in zip(adapter, start):
                t.copy_(s)
        return torch.Generator().manual_seed(args.seed + 1)

    # adapter-only
    gen = versions()
    lora_engine = wsl.engine_config(peft_model, "bench", lora_id=1, tp=1)

    def adapter_update(step: int) -> dict:
        t0 = time.perf_counter()
        perturb(gen)
        return {"update_s": time.perf_counter() - t0}

    def adapter_pub(addr: str, o: dict) -> Any:
        return wsl.publisher(peft_model, coordinator=addr, rank=0, engine=lora_engine, **o)

    adapter_res = run_job("adapter", lora_engine, adapter_pub, adapter_update, adapter,
                          args.steps, opts)
    if not args.json:
        print(f"adapter: {adapter_res['bytes_per_step'] / 1e6:.2f} MB/step, push p50 "
              f"{adapter_res['seconds_median']:.4f} s", flush=True)

    # merged full model
    gen = versions()
    layout = wst.trainer_layout(merged)
    full_engine = full_engine_config(layout, lora_engine["hf_config"])
    tensors = dict(merged.named_parameters())
    full = [(spec["name"], tensors[spec["name"]]) for spec in layout["params"]]

    def merged_update(step: int) -> dict:
        t0 = time.perf_counter()
        perturb(gen)
        t1 = time.perf_counter()
        merge_into(merged, layers)
        return {"update_s": t1 - t0, "merge_s": time.perf_counter() - t1}

    def merged_pub(addr: str, o: dict) -> Any:
        pub = ws.Publisher(coordinator=addr, rank=0, layout=layout, engine=full_engine, **o)
        pub.register_module(merged)
        return pub

    merged_res = run_job("merged", full_engine, merged_pub, merged_update, full, args.steps, opts)

    result = {"model": shape, "rank": args.rank, "lora_alpha": 2 * args.rank,
              "target_modules": TARGETS, "adapter_dtype": args.adapter_dtype,
              "steps": args.steps, "transport": args.transport,
              "bucket_bytes": args.bucket_bytes, "adapter": adapter_res, "merged": merged_res,
              "bytes_ratio": adapter_res["bytes_per_step"] / merged_res["bytes_per_step"],
              "time_ratio": adapter_res["seconds_median"] / merged_res["seconds_median"]}
    result["time_ratio_with_merge"] = adapter_res["seconds_median"] / (
        merged_res["seconds_median"] + merged_res["merge_seconds_median"])
    print_table(result)
    if args.json:
        print(json.dumps(result))
    return 0


def print_table(r: dict) -> None:
    m, a, f = r["model"], r["adapter"], r["merged"]
    print(f"model: Qwen3 shape, {m['num_hidden_layers']} layers, hidden {m['hidden_size']}, "
          f"{m['params'] / 1e6:.1f} M params bf16; LoRA r={r['rank']} alpha={r['lora_alpha']} "
          f"({r['adapter_dtype']}) on {','.join(t.split('_')[0] for t in r['target_modules'])}; "
          f"{r['steps']} timed steps (+1 warm-up), transport {r['transport']}")
    print(f"{'sync':<9}{'tensors':>8}{'MB/step':>12}{'push p50 s':>12}{'wall p50 s':>12}"
          f"{'engine p50 s':>14}{'merge p50 s':>13}")
    for label, x in (("adapter", a), ("merged", f)):
        merge = f"{x['merge_seconds_median']:.4f}" if "merge_seconds_median" in x else "-"
        print(f"{label:<9}{x['tensors']:>8}{x['bytes_per_step'] / 1e6:>12.2f}"
              f"{x['seconds_median']:>12.4f}{x['wall_seconds_median']:>12.4f}"
              f"{x['engine_seconds_median']:>14.4f}{merge:>13}")
    print(f"bytes_ratio (adapter/merged) {r['bytes_ratio']:.5f} "
          f"({1 / r['bytes_ratio']:.1f}x fewer); "
          f"time_ratio {r['time_ratio']:.4f} ({1 / r['time_ratio']:.1f}x faster; "
          f"{1 / r['time_ratio_with_merge']:.1f}x counting the merge); "
          f"engine tensors verified bit for bit", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
