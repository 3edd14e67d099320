"""`python tools/bench/python/bench.py`: the sync benchmark from Python,
beside the C++ one on the same bytes in the same run.

Each round runs `weightsync bench --json --no-peer` (the C++ job: 4 trainer
processes, ep=2 x fsdp=2, into 2 vLLM-layout replicas of tp=2, one warm-up
step then K timed ones), then the same job from Python on the very files
that run wrote (its checkpoint, trainer layout and engine config): trainer
processes holding their shards as torch tensors behind ws.Publisher, engine
processes holding their params as torch tensors behind ws.Subscriber. Both
report GB/s per engine rank the same way: the busiest engine rank's bytes
over the median step time (a step: the slowest trainer's push). The ratio
says what the Python layer costs (goal: >= 0.95).

`python tools/bench/python/bench.py engine`: a model pushed into a live real
vLLM against vLLM's own reload and a restart (bench_engine.py, beside this
script).

`python tools/bench/python/bench.py delta --update adamw[:lr=X]` (also `weightsync
bench sync --delta --update adamw[:lr=X]`): delta sync (docs/delta.md) of
the versions real torch.optim.AdamW steps make of the C++ job's bf16 shards,
against a full sync of the same versions in the same run: what fraction of
the elements changed, the bytes on the wire and the step time of each.

`python tools/bench/python/bench.py serve-pause [--size-gb G]`: how long a
real `vllm serve` under streaming load stops serving while a version is
synced, staged against blocking against vLLM's own reload
(bench_serve_pause.py, beside this script).

`python tools/bench/python/bench.py lora [--steps K] [--rank R] [--layers N]`:
adapter-only sync of a PEFT LoRA (weightsync.lora) against a merged full
sync of the same Qwen3-0.6B-shaped model in the same run: bytes and seconds
per step of each and their ratios, the engine's tensors checked bit for bit
(bench_lora.py, beside this script).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from weightsync import cli_path


def _trainer(rank: int, work: str, address: str, opts: dict, steps: int, queue: Any) -> None:
    try:
        from safetensors.torch import load_file

        import weightsync as ws

        shard = os.path.join(work, f"py-shard{rank}.safetensors")
        subprocess.run([cli_path(), "shard", "--checkpoint", os.path.join(work, "model.safetensors"),
                        "--trainer", os.path.join(work, "trainer.json"), "--rank", str(rank),
                        "--out", shard], check=True, capture_output=True)
        tensors = load_file(shard)
        pub = ws.Publisher(coordinator=address, rank=rank, layout=os.path.join(work, "trainer.json"),
                           engine=os.path.join(work, "engine.json"), **opts)
        for name, t in tensors.items():
            pub.register(name, t)
        pub.prepare()
        seconds = []
        for step in range(1, steps + 1):
            res = pub.push(step)
            if len(res.committed) != 4:
                raise RuntimeError(f"step {step}: engines failed: {res.failed}")
            seconds.append(res.seconds)
        pub.close()
        queue.put(("trainer", rank, seconds))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put(("error", rank, repr(e)))


def _engine(g: int, work: str, address: str, transport: str, steps: int, queue: Any) -> None:
    try:
        import weightsync as ws
        import weightsync.torch as wst

        engine = os.path.join(work, "engine.json")
        sub = ws.Subscriber(coordinator=address, engine=engine, replica=g // 2, rank=g % 2,
                            transport=transport)
        params = wst.allocate_engine_params(engine, g // 2, g % 2)
        for name, t in params.items():
            sub.register(name, t)
        got: list[Any] = []
        while len(got) < steps:
            out = sub.run_step(timeout=600.0)
            if out is not None:
                got.append(out.bytes)
        sub.close()
        queue.put(("engine", g, got))
    except BaseException as e:  # noqa: BLE001
        queue.put(("error", g, repr(e)))


def _run_job(ctx: Any, work: str, opts: dict, steps: int, trainer: Any,
             extra: Any) -> tuple[dict, dict]:
    """4 engine processes (_engine) and 4 trainer processes (`trainer`, called
    with rank, work, address, opts, steps, *extra(rank), queue) on a new
    coordinator: what each reported, by rank."""
    import weightsync as ws

    queue = ctx.Queue()
    with ws.Coordinator() as coord:
        procs = [ctx.Process(target=_engine, args=(g, work, coord.address, opts["transport"],
                                                   steps, queue)) for g in range(4)]
        procs += [ctx.Process(target=trainer,
                              args=(r, work, coord.address, opts, steps, *extra(r), queue))
                  for r in range(4)]
        for p in procs:
            p.start()
        trainers: dict[int, Any] = {}
        engines: dict[int, Any] = {}
        for _ in procs:
            kind, who, value = queue.get(timeout=3600)
            if kind == "error":
                raise RuntimeError(f"a python bench process ({who}) failed: {value}")
            (trainers if kind == "trainer" else engines)[who] = value
        for p in procs:
            p.join()
    return trainers, engines


def _adamw_trainer(rank: int, work: str, address: str, opts: dict, steps: int, lr: float,
                   barrier: Any, queue: Any) -> None:
    """A trainer rank whose bf16 shards take a real AdamW step (towards fixed
    random targets) before every push after the first."""
    try:
        import torch
        from safetensors.torch import load_file

        import weightsync as ws

        shard = os.path.join(work, f"py-shard{rank}.safetensors")
        if not os.path.exists(shard):
            subprocess.run([cli_path(), "shard", "--checkpoint",
                            os.path.join(work, "model.safetensors"), "--trainer",
                            os.path.join(work, "trainer.json"), "--rank", str(rank), "--out",
                            shard], check=True, capture_output=True)
        tensors = load_file(shard)
        params = [t.requires_grad_() for t in tensors.values()]
        optimizer = torch.optim.AdamW(params, lr=lr)
        g = torch.Generator().manual_seed(1000 + rank)  # the same versions in every run
        targets = [torch.randn(p.shape, generator=g).to(p.dtype) for p in params]
        pub = ws.Publisher(coordinator=address, rank=rank, layout=os.path.join(work, "trainer.json"),
                           engine=os.path.join(work, "engine.json"), **opts)
        for name, t in tensors.items():
            pub.register(name, t.detach())
        pub.prepare()
        rows = []
        total = sum(p.numel() for p in params)
        for step in range(1, steps + 1):
            changed = 0
            if step > 1:
                before = [p.detach().clone() for p in params]
                optimizer.zero_grad()
                for p, y in zip(params, targets):
                    ((p.float() - y.float()) ** 2).mean().backward()
                optimizer.step()
                changed = sum(int((p.detach() != b).sum()) for p, b in zip(params, before))
                del before
            barrier.wait()  # the ranks push together, as after a synchronous optimizer step
            res = pub.push(step)
            if len(res.committed) != 4:
                raise RuntimeError(f"step {step}: engines failed: {res.failed}")
            rows.append({"seconds": res.seconds, "bytes_sent": res.bytes_sent,
                         "delta_buckets": res.delta_buckets, "changed": changed,
                         "elements": total})
        pub.close()
        queue.put(("trainer", rank, rows))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        queue.put(("error", rank, repr(e)))


def adamw_sync(work: str, steps: int, opts: dict, lr: float) -> dict:
    """The C++ job's files, their bf16 shards stepped by AdamW, synced from
    Python processes: per step, the slowest trainer's push, the changed
    fraction and every engine rank's bytes."""
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(4)
    trainers, engines = _run_job(ctx, work, opts, steps, _adamw_trainer,
                                 lambda r: (lr, barrier))
    timed = range(1, steps)  # without the warm-up (whole) step
    seconds = [max(trainers[r][s]["seconds"] for r in trainers) for s in timed]
    changed = sum(trainers[r][s]["changed"] for r in trainers for s in timed)
    elements = sum(trainers[r][s]["elements"] for r in trainers for s in timed)
    return {"sync_s": seconds, "sync_s_p50": statistics.median(seconds),
            "wire_bytes": sum(engines[g][s] for g in engines for s in timed),
            "delta_buckets": sum(trainers[r][s]["delta_buckets"] for r in trainers for s in timed),
            "changed_fraction": changed / elements if elements else 0.0}


def delta_main(argv: list) -> int:
    p = argparse.ArgumentParser(prog="python tools/bench/python/bench.py delta",
                                description="delta sync of real AdamW steps against a full sync")
    p.add_argument("--update", default="adamw", help="adamw[:lr=X] (default lr 1e-5)")
    p.add_argument("--size-gb", type=float, default=0.25)
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    p.add_argument("--transport", default="ucx")
    p.add_argument("--bucket-bytes", type=int, default=64 << 20)
    p.add_argument("--no-delta-verify", action="store_true")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = p.parse_args(argv)
    kind, _, rest = args.update.partition(":")
    lr = 1e-5
    if kind != "adamw" or (rest and not rest.startswith("lr=")):
        p.error(f"--update: expected adamw or adamw:lr=X, got {args.update!r}")
    if rest:
        lr = float(rest[3:])
    base = {"transport": args.transport, "bucket_bytes": args.bucket_bytes, "mode": "p2p"}
    with tempfile.TemporaryDirectory(prefix="weightsync-deltabench-") as tmp:
        work = os.path.join(tmp, "job")
        cpp_sync(work, argparse.Namespace(steps=1, size_gb=args.size_gb, transport=args.transport,
                                          bucket_bytes=args.bucket_bytes, mode="p2p"))
        full = adamw_sync(work, args.steps + 1, dict(base, delta="off"), lr)
        delta = adamw_sync(work, args.steps + 1,
                           dict(base, delta="auto", delta_verify=not args.no_delta_verify), lr)
    result = {"update": "adamw", "lr": lr, "size_gb": args.size_gb, "steps": args.steps,
              "transport": args.transport, "changed_fraction": delta["changed_fraction"],
              "full": full, "delta": delta,
              "bytes_ratio_to_full": delta["wire_bytes"] / full["wire_bytes"],
              "time_ratio_to_full": delta["sync_s_p50"] / full["sync_s_p50"]}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"AdamW (lr {lr:g}) on bf16 shards changed {result['changed_fraction']:.4f} of the "
              f"elements a step; delta sync: {delta['wire_bytes'] / 1e6:.2f} MB on the wire vs "
              f"{full['wire_bytes'] / 1e6:.2f} MB full -> bytes_ratio_to_full "
              f"{result['bytes_ratio_to_full']:.4f}; sync p50 {delta['sync_s_p50']:.4f} s vs "
              f"{full['sync_s_p50']:.4f} s full -> time_ratio_to_full "
              f"{result['time_ratio_to_full']:.3f}")
    return 0


def python_sync(work: str, steps: int, opts: dict) -> dict:
    """The C++ job's files, synced from Python processes: per-step times and bytes."""
    trainers, engines = _run_job(mp.get_context("spawn"), work, opts, steps, _trainer,
                                 lambda r: ())
    timed = [max(trainers[r][s] for r in trainers) for s in range(1, steps)]  # without warm-up
    rank_bytes = max(max(v[1:]) for v in engines.values())
    p50 = statistics.median(timed)
    return {"sync_s": timed, "sync_s_p50": p50, "engine_rank_bytes": rank_bytes,
            "engine_rank_gbps": rank_bytes / p50 / 1e9}


def cpp_sync(work: str, args: argparse.Namespace) -> dict:
    cmd = [cli_path(), "bench", "--json", "--no-peer", "--work-dir", work, "--steps",
           str(args.steps), "--size-gb", str(args.size_gb), "--transport", args.transport,
           "--bucket-bytes", str(args.bucket_bytes), "--mode", args.mode]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr[-2000:]}")
    return json.loads(out.stdout)


def main(argv: Any = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["delta"]:  # delta sync of real AdamW steps
        return delta_main(argv[1:])
    if argv[:1] == ["engine"]:  # into a live vLLM (bench_engine.py, beside this script)
        import bench_engine  # beside this script, on sys.path[0]

        return bench_engine.main(argv[1:])
    if argv[:1] == ["serve-pause"]:  # the serving pause of a `vllm serve` (bench_serve_pause.py)
        import bench_serve_pause  # beside this script, on sys.path[0]

        return bench_serve_pause.main(argv[1:])
    if argv[:1] == ["lora"]:  # adapter-only against merged sync (bench_lora.py, beside this script)
        import bench_lora  # beside this script, on sys.path[0]

        return bench_lora.main(argv[1:])
    p = argparse.ArgumentParser(prog="python tools/bench/python/bench.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up)")
    p.add_argument("--rounds", type=int, default=2, help="C++ then Python, this many times")
    p.add_argument("--transport", default="ucx")
    p.add_argument("--bucket-bytes", type=int, default=64 << 20)
    p.add_argument("--mode", default="p2p", choices=["p2p", "broadcast"])
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = p.parse_args(argv)
    opts = {"transport": args.transport, "bucket_bytes": args.bucket_bytes, "mode": args.mode}
    rounds = []
    with tempfile.TemporaryDirectory(prefix="weightsync-pybench-") as tmp:
        for r in range(args.rounds):
            work = os.path.join(tmp, f"round{r}")
            cpp = cpp_sync(work, args)
            py = python_sync(work, args.steps + 1, opts)
            rounds.append({"cpp_gbps": cpp["engine_rank_gbps"], "cpp_sync_s_p50": cpp["sync_s_p50"],
                           "python_gbps": py["engine_rank_gbps"], "python_sync_s_p50": py["sync_s_p50"],
                           "engine_rank_bytes": py["engine_rank_bytes"],
                           "cpp_engine_rank_bytes": cpp["engine_rank_bytes"]})
            if not args.json:
                print(f"round {r + 1}: C++ {cpp['engine_rank_gbps']:.3f} GB/s per engine rank "
                      f"(p50 {cpp['sync_s_p50']:.3f} s), Python {py['engine_rank_gbps']:.3f} GB/s "
                      f"(p50 {py['sync_s_p50']:.3f} s) on {py['engine_rank_bytes'] / 1e6:.1f} MB",
                      flush=True)
    cpp_gbps = statistics.median(x["cpp_gbps"] for x in rounds)
    py_gbps = statistics.median(x["python_gbps"] for x in rounds)
    result = {"rounds": rounds, "cpp_gbps": cpp_gbps, "python_gbps": py_gbps,
              "ratio_python_to_cpp": py_gbps / cpp_gbps if cpp_gbps else 0.0,
              "size_gb": args.size_gb, "steps": args.steps, "transport": args.transport,
              "mode": args.mode, "bucket_bytes": args.bucket_bytes}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"python / C++: {result['ratio_python_to_cpp']:.3f} ({py_gbps:.3f} vs {cpp_gbps:.3f} GB/s "
              f"per engine rank, medians over {args.rounds} rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
