"""`python tools/bench/python/bench.py serve-pause`: how long a real
`vllm serve` stops serving while weightsync syncs a new version into it
under streaming load, staged against blocking, with vLLM's own reload of the
same weights as the peer, in one run on one server (issue 50, item 4).

Two versions of a dense Qwen3-shaped bf16 model of about --size-gb are
written once under --work-dir (bench_engine.py's shapes). One `vllm serve`
(backend "weightsync", VLLM_SERVER_DEV_MODE=1; started as
tests/real_engines/vllm_support.Server does) serves --streams streaming
requests at all times. This process is a one-rank trainer holding the model
as a transformers module, driving the server through vLLM's trainer API
(weightsync._vllm_trainer). Per mode (staged, blocking, and vLLM's
`reload_weights` from the checkpoint through /collective_rpc, bracketed by
the same /pause, reset and /resume), a warm-up step and then --steps steps,
alternating the versions, each measured:

- the sync's seconds (send_weights(), or the reload's round trip);
- the serving pause: the longest gap between two streamed tokens of any
  request during the sync;
- the steady gap between tokens (median, outside syncs);
- tokens per second during the sync against steady state;
- the swap (pause to resume, as the trainer saw it).

Prints one line per step and the medians per mode; --json prints one JSON
object. Runs in a venv with vLLM (tools/engines/setup_vllm.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
# The server and the streaming load are the real-engine tests' (one way to
# start `vllm serve` in this tree).
sys.path.insert(0, os.path.join(REPO, "tests", "real_engines"))
sys.path.insert(0, HERE)


def _rate(load: Any, since: float, until: float) -> float:
    """Tokens per second that every stream together received in [since, until]."""
    n = sum(1 for _, times in load.requests for t in times if since <= t <= until)
    return n / max(until - since, 1e-9)


def _measure(load: Any, fn: Any) -> dict:
    steady_until = time.monotonic()
    time.sleep(1.0)  # a steady second before
    began = time.monotonic()
    out = fn()
    ended = time.monotonic()
    time.sleep(1.0)
    return {"out": out, "began": began, "ended": ended,
            "steady_rate": _rate(load, steady_until, began)}


def _step(server: Any, engine: Any, load: Any, model: Any, states: list, versions: list,
          i: int, mode: str) -> dict:
    """One sync of version (i + 1) % 2 through `engine` (None: vLLM's
    reload_weights), measured."""
    import requests
    import torch

    which = (i + 1) % 2
    if engine is None:
        def sync() -> dict:
            t = time.monotonic()
            requests.post(server.url + "/pause", params={"mode": "keep"},
                          timeout=600).raise_for_status()
            server.post("/collective_rpc", {"method": "reload_weights",
                                            "kwargs": {"weights_path": versions[which]}})
            requests.post(server.url + "/reset_prefix_cache",
                          params={"reset_running_requests": "true"},
                          timeout=600).raise_for_status()
            requests.post(server.url + "/resume", timeout=600).raise_for_status()
            s = time.monotonic() - t
            return {"seconds": s, "pause_seconds": s, "push_seconds": 0.0}
    else:
        with torch.no_grad():
            for name, p in model.state_dict().items():
                p.copy_(states[which][name])
        sync = engine.send_weights
    m = _measure(load, sync)
    longest, gap_start, gap_end = load.longest_gap(m["began"], m["ended"])
    steady = load.steady_gap(m["began"], m["ended"])
    row = {"step": i, "mode": mode, "seconds": m["out"]["seconds"],
           "push_seconds": m["out"]["push_seconds"], "swap_seconds": m["out"]["pause_seconds"],
           "serving_pause": longest, "steady_gap": steady,
           # where the longest gap lies, from the sync's start (its end: "seconds")
           "pause_from": gap_start - m["began"], "pause_to": gap_end - m["began"],
           "tokens_per_s_during": _rate(load, m["began"], m["ended"]),
           "tokens_per_s_steady": m["steady_rate"]}
    print(f"step {i} {mode:>11}: sync {row['seconds']:.2f} s (push {row['push_seconds']:.2f}), "
          f"serving pause {longest:.2f} s ({row['pause_from']:+.2f} to {row['pause_to']:+.2f} s "
          f"from the sync's start), swap {row['swap_seconds']:.2f} s, steady gap "
          f"{steady:.3f} s, tokens/s {row['tokens_per_s_during']:.1f} during vs "
          f"{row['tokens_per_s_steady']:.1f} steady", file=sys.stderr)
    return row


def run(args: argparse.Namespace) -> dict:
    import torch
    import vllm_support as vs
    from bench_engine import _config, make_checkpoint
    from transformers import AutoModelForCausalLM
    from vllm.distributed.weight_transfer import (HTTPVLLMWeightSyncClient, ModuleSource,
                                                  WeightTransferTrainerFactory)

    from weightsync._vllm_trainer import WeightsyncTrainerInitInfo

    os.makedirs(args.work_dir, exist_ok=True)
    vs.install_process_shims(args.work_dir)
    cfg = _config(args.size_gb)
    versions = [make_checkpoint(os.path.join(args.work_dir, f"pause-v{i}"), cfg, seed=300 + i)
                for i in range(2)]
    server = vs.Server(versions[0], args.work_dir, max_model_len=1024, max_num_seqs=args.streams,
                       kv_cache_memory_bytes=256 << 20)
    model = AutoModelForCausalLM.from_pretrained(versions[0], dtype=torch.bfloat16)
    states = [AutoModelForCausalLM.from_pretrained(p, dtype=torch.bfloat16).state_dict()
              for p in versions]
    rows: list = []
    try:
        started = server.wait_ready(timeout=900)
        client = HTTPVLLMWeightSyncClient(server.url)
        load = vs.StreamingLoad(server, streams=args.streams, max_tokens=args.max_tokens)
        try:
            # One trainer engine per mode for all its steps (as a training
            # loop has): its init and shutdown (which hold vLLM's loop while
            # the workers connect and leave) are outside the measured steps,
            # and so is one warm-up step (the plan, the connections).
            for mode in ("staged", "blocking", "vllm reload"):
                engine = None
                if mode != "vllm reload":
                    engine = WeightTransferTrainerFactory.trainer_init(
                        WeightsyncTrainerInitInfo(
                            rank=0, staged=mode == "staged", first_step=100 * len(rows) + 1,
                            publisher={"bucket_bytes": args.bucket_mb << 20}),
                        client=client, source=ModuleSource(model))
                try:
                    for i in range(args.steps + 1):
                        row = _step(server, engine, load, model, states, versions, i, mode)
                        if i > 0:
                            rows.append(row)
                finally:
                    if engine is not None:
                        engine.shutdown()
        finally:
            load.stop()
    finally:
        server.stop()
    summary = {}
    for mode in ("staged", "blocking", "vllm reload"):
        mine = [r for r in rows if r["mode"] == mode]
        summary[mode] = {k: statistics.median(r[k] for r in mine)
                         for k in ("seconds", "serving_pause", "swap_seconds", "steady_gap",
                                   "tokens_per_s_during", "tokens_per_s_steady")}
    model_bytes = sum(t.nbytes for t in states[0].values())
    return {"model_bytes": model_bytes, "server_start_seconds": started, "streams": args.streams,
            "steps": rows, "median": summary,
            "staged_over_blocking_pause": summary["staged"]["serving_pause"]
            / max(summary["blocking"]["serving_pause"], 1e-9),
            "staged_over_reload_pause": summary["staged"]["serving_pause"]
            / max(summary["vllm reload"]["serving_pause"], 1e-9)}


def main(argv: Any = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=0.5)
    ap.add_argument("--steps", type=int, default=2,
                    help="measured steps per mode (after one warm-up step)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--work-dir", default="/tmp/weightsync-bench-serve-pause")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = run(args)
    if args.json:
        print(json.dumps(out))
    else:
        for mode, m in out["median"].items():
            print(f"{mode:>11}: median sync {m['seconds']:.2f} s, serving pause "
                  f"{m['serving_pause']:.2f} s, swap {m['swap_seconds']:.2f} s, steady gap "
                  f"{m['steady_gap']:.3f} s, tokens/s {m['tokens_per_s_during']:.1f} during vs "
                  f"{m['tokens_per_s_steady']:.1f} steady")
        print(f"staged / blocking pause {out['staged_over_blocking_pause']:.2f}; staged / vLLM "
              f"reload pause {out['staged_over_reload_pause']:.2f} ({out['model_bytes'] / 1e9:.2f}"
              " GB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
