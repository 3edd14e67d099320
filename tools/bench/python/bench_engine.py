"""`python tools/bench/python/bench.py engine`: weightsync pushing a model into
a live real vLLM engine, against that engine's own ways to take new weights, in one
run on the same bytes.

Two versions of a dense Qwen3-shaped bf16 model of about --size-gb (random
values, every tensor different between them) are written once under
--work-dir. A vLLM `LLM` starts from version 0 with weightsync's worker
extension; a trainer process holds both versions as a transformers model
behind a weightsync Publisher. Then, alternating the versions, per step:

- weightsync: the trainer pushes, the engine takes it through
  `weightsync.vllm.update` (from the push's start to the engine's commit);
- vLLM's reload: `collective_rpc("reload_weights", weights_path=...)` from
  the same version's checkpoint, already in the page cache;
- a restart (once): the engine shut down and a new one started from the
  checkpoint (until it is ready to serve).

After the last weightsync step and the reload of the same version, the
engine's greedy tokens are compared (they must be equal). Prints medians and
the ratios reload / weightsync and restart / weightsync (above 1: weightsync
is faster). Runs in a venv with vLLM (tools/engines/setup_vllm.sh).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

PROMPTS = [[(7 * i + 3) % 1000 for i in range(64)], [1, 2, 3, 4, 5, 6, 7, 8]]


def _config(size_gb: float) -> dict:
    """A Qwen3 config of about size_gb GB in bf16 (layers scale with it)."""
    hidden, inter, vocab = 1024, 3072, 32000
    per_layer = 2 * (hidden * hidden * 2 + 2 * hidden * 512 + 3 * hidden * inter)
    fixed = 2 * 2 * vocab * hidden
    layers = max(1, round((size_gb * 1e9 - fixed) / per_layer))
    return dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=hidden,
                intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=16,
                num_key_value_heads=8, head_dim=64, vocab_size=vocab, tie_word_embeddings=False,
                max_position_embeddings=1024, rms_norm_eps=1e-6)


def make_checkpoint(out: str, cfg: dict, seed: int) -> str:
    """A random bf16 checkpoint (config.json + model.safetensors), once."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    if os.path.exists(os.path.join(out, "model.safetensors")):
        return out
    os.makedirs(out, exist_ok=True)
    cfg = dict(cfg)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.dtype = torch.bfloat16
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    tensors = {name: (torch.randn(p.shape, generator=g) * 0.02).to(torch.bfloat16)
               for name, p in sorted(model.state_dict().items())}
    tmp = os.path.join(out, "model.safetensors.part")
    save_file(tensors, tmp, metadata={"format": "pt"})
    config.save_pretrained(out)
    os.replace(tmp, os.path.join(out, "model.safetensors"))
    return out


def _page_in(path: str) -> int:
    """Reads every file of a checkpoint once (into the page cache)."""
    total = 0
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            while chunk := f.read(64 << 20):
                total += len(chunk)
    return total


def _trainer_main(address: str, engine: dict, versions: list, transport: str,
                  bucket_bytes: int, commands: Any, results: Any) -> None:
    try:
        import torch
        import weightsync as ws
        import weightsync.torch as wst
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(versions[0], dtype=torch.bfloat16)
        states = [load_file(os.path.join(v, "model.safetensors")) for v in versions]
        with ws.Publisher(coordinator=address, rank=0, layout=wst.trainer_layout(model),
                          engine=engine, transport=transport, bucket_bytes=bucket_bytes,
                          step_timeout=600.0) as pub:
            pub.register_module(model)
            results.put(("ready", None))
            while True:
                cmd = commands.get()
                if cmd[0] == "stop":
                    break
                _, step, which = cmd
                with torch.no_grad():
                    for name, p in model.state_dict().items():
                        p.copy_(states[which][name])
                results.put(("loaded", step))
                commands.get()  # "go"
                t = time.monotonic()
                res = pub.push(step)
                results.put(("pushed", (step, res.ok, time.monotonic() - t, str(res.failed))))
    except BaseException as e:  # noqa: BLE001 - reported to the bench
        import traceback

        results.put(("error", f"{e}\n{traceback.format_exc()}"))


def _expect(results: Any, kind: str, proc: Any, timeout: float = 900) -> Any:
    import queue

    deadline = time.monotonic() + timeout
    while True:
        try:
            got, value = results.get(timeout=1)
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"the trainer exited ({proc.exitcode})") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"the trainer did not answer {kind!r} in time") from None
            continue
        if got == "error":
            raise RuntimeError(f"the trainer failed: {value}")
        if got != kind:
            raise RuntimeError(f"the trainer answered {got!r}, expected {kind!r}")
        return value


def _start(path: str, tp: int) -> tuple:
    from vllm import LLM

    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
    t = time.monotonic()
    llm = LLM(model=path, tensor_parallel_size=tp, skip_tokenizer_init=True, max_model_len=256,
              dtype="bfloat16", enforce_eager=True, max_num_seqs=4, kv_cache_memory_bytes=64 << 20,
              worker_extension_cls="weightsync.vllm.WorkerExtension")
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], _sampling(), use_tqdm=False)
    return llm, time.monotonic() - t


def _sampling() -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _tokens(llm: Any) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _sampling(), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _stop(llm: Any) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort
        pass


def run(args: argparse.Namespace) -> dict:
    import weightsync as ws
    import weightsync.vllm as wsv

    cfg = _config(args.size_gb)
    work = os.path.abspath(args.work_dir)
    tag = f"qwen3-{cfg['num_hidden_layers']}l"
    versions = [make_checkpoint(os.path.join(work, f"{tag}-v{i}"), cfg, seed=1 + i)
                for i in range(2)]
    nbytes = os.path.getsize(os.path.join(versions[0], "model.safetensors"))
    for v in versions:
        _page_in(v)
    framework = {"load_weights": "hf", "direct": "vllm", "derived": "derived"}[args.mode]
    engine = {"framework": framework, "hf_config": os.path.join(versions[0], "config.json"),
              "tp": args.tp, "replicas": 1}
    llm, first_start = _start(versions[0], args.tp)
    coord = ws.Coordinator()
    ctx = mp.get_context("spawn")
    commands, results = ctx.Queue(), ctx.Queue()
    trainer = ctx.Process(target=_trainer_main, daemon=True, args=(
        coord.address, None if framework == "derived" else engine, versions, args.transport,
        args.bucket_bytes, commands, results))
    trainer.start()
    sync_s: list = []
    reload_s: list = []
    try:
        info = llm.collective_rpc("weightsync_connect", kwargs=dict(
            coordinator=coord.address, engine=engine, replica=0, step_timeout=600.0))
        _expect(results, "ready", trainer)
        for step in range(1, args.steps + 2):  # step 1: warm-up
            which = step % 2
            commands.put(("load", step, which))
            _expect(results, "loaded", trainer)
            t = time.monotonic()
            commands.put(("go",))
            out = wsv.update(llm, timeout=600)
            took = time.monotonic() - t
            pushed = _expect(results, "pushed", trainer)
            if not out["committed"] or not pushed[1]:
                raise RuntimeError(f"step {step} did not commit: {out} {pushed}")
            if step > 1:
                sync_s.append(took)
            if not args.json:
                print(f"weightsync step {step}{' (warm-up)' if step == 1 else ''}: {took:.3f} s "
                      f"(trainer push {pushed[2]:.3f} s)", flush=True)
        after_sync = _tokens(llm)
        last = (args.steps + 1) % 2
        llm.collective_rpc("weightsync_close")
        for i in range(args.steps + 1):
            which = (last + 1 + i) % 2  # ends on the version weightsync ended on
            t = time.monotonic()
            llm.collective_rpc("reload_weights", kwargs={"weights_path": versions[which]})
            llm.reset_prefix_cache()
            took = time.monotonic() - t
            if i > 0:
                reload_s.append(took)
            if not args.json:
                print(f"vLLM reload_weights v{which}{' (warm-up)' if i == 0 else ''}: {took:.3f} s",
                      flush=True)
        after_reload = _tokens(llm)
    finally:
        commands.put(("stop",))
        trainer.join(timeout=60)
        if trainer.is_alive():
            trainer.kill()
        coord.close()
        _stop(llm)
    llm, restart_s = _start(versions[last], args.tp)
    after_restart = _tokens(llm)
    _stop(llm)
    if not args.json:
        print(f"restart from v{last}: {restart_s:.3f} s (first start {first_start:.3f} s)",
              flush=True)
    sync = statistics.median(sync_s)
    reload = statistics.median(reload_s)
    return {"model_bytes": nbytes, "tp": args.tp, "mode": args.mode, "fallback": info[0].get("fallback"),
            "transport": args.transport, "steps": args.steps, "sync_s": sync_s,
            "sync_s_p50": sync, "reload_s": reload_s, "reload_s_p50": reload,
            "restart_s": restart_s, "reload_over_sync": reload / sync,
            "restart_over_sync": restart_s / sync,
            "tokens_equal": after_sync == after_reload == after_restart}


def main(argv: Any = None) -> int:
    p = argparse.ArgumentParser(prog="python tools/bench/python/bench.py engine",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=1.0)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="timed steps of each (after a warm-up)")
    p.add_argument("--mode", default="load_weights", choices=["load_weights", "direct", "derived"])
    p.add_argument("--transport", default="ucx")
    p.add_argument("--bucket-bytes", type=int, default=256 << 20)
    p.add_argument("--work-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                      "weightsync-bench-engine"))
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = p.parse_args(argv)
    res = run(args)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"{res['model_bytes'] / 1e9:.2f} GB into vLLM (tp={res['tp']}, mode {res['mode']}): "
              f"weightsync {res['sync_s_p50']:.3f} s, vLLM reload_weights {res['reload_s_p50']:.3f} s "
              f"({res['reload_over_sync']:.2f}x), restart {res['restart_s']:.3f} s "
              f"({res['restart_over_sync']:.2f}x); tokens equal: {res['tokens_equal']}")
    return 0 if res["tokens_equal"] else 1
