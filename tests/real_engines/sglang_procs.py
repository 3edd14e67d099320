"""The processes of tests/real_engines/test_sglang.py, each driven over a
multiprocessing pipe: a real sglang.Engine (in a process of its own: SGLang
kills the process that created an Engine when one of its schedulers fails,
which must not be pytest), and a trainer rank (a transformers model
registered with a weightsync Publisher) that pushes versions."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional

SHIM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_shim")


def _serve(conn: Any, setup: Callable[[], Any], handle: Callable[[Any, str, dict], Any]) -> None:
    try:
        state = setup()
    except BaseException:  # noqa: BLE001 - reported to the test
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", None))
    while True:
        op, args = conn.recv()
        try:
            result = handle(state, op, args)
        except BaseException:  # noqa: BLE001 - reported to the test
            conn.send(("error", traceback.format_exc()))
            continue
        conn.send(("ok", result))
        if op == "shutdown":
            return


# ---- the engine --------------------------------------------------------------

def _engine_main(conn: Any, engine_kwargs: dict, env: dict) -> None:
    # Inherited by SGLang's schedulers: the environment (sitecustomize runs at
    # their start) and, as multiprocessing's spawn passes it on, sys.path.
    os.environ.update(env)
    for entry in reversed(env["PYTHONPATH"].split(os.pathsep)):
        if entry not in sys.path:
            sys.path.insert(0, entry)

    def setup() -> Any:
        import sglang

        import weightsync.sglang as wsg

        t = time.monotonic()
        engine = sglang.Engine(**engine_kwargs, **wsg.engine_args())
        engine.started_in = time.monotonic() - t
        return engine

    _serve(conn, setup, _engine_op)


def _engine_op(engine: Any, op: str, args: dict) -> Any:
    import weightsync.sglang as wsg

    if op == "started_in":
        return engine.started_in
    if op == "generate":
        outs = engine.generate(input_ids=args["prompts"],
                               sampling_params={"max_new_tokens": args["max_new_tokens"],
                                                "temperature": 0.0})
        return [{"tokens": o["output_ids"], "weight_version": o["meta_info"]["weight_version"],
                 "cached_tokens": o["meta_info"].get("cached_tokens")} for o in outs]
    if op == "dump":  # every rank's parameters, as SGLang itself saves them
        os.makedirs(args["path"], exist_ok=True)
        engine.save_sharded_model(path=args["path"], pattern=None, max_size=1 << 40)
        return sorted(os.listdir(args["path"]))
    if op == "weight_version":
        return engine.get_model_info()["weight_version"]
    if op == "connect":
        return wsg.connect(engine, **args)
    if op == "update":
        return wsg.update(engine, **args)
    if op == "update_raising":  # what update() raised, as the caller sees it
        import weightsync as ws

        try:
            return {"out": wsg.update(engine, **args)}
        except Exception as e:  # noqa: BLE001 - reported to the test
            return {"raised": {"type": type(e).__name__, "weightsync": isinstance(e, ws.Error),
                               "code": getattr(e, "code", None), "message": str(e)}}
    if op == "close":
        return wsg.close(engine)
    if op.startswith("lora_"):
        return _lora_op(engine, op, args)
    if op == "shutdown":
        engine.shutdown()
        return None
    raise ValueError(f"unknown op {op!r}")


def _lora_op(engine: Any, op: str, args: dict) -> Any:
    """LoRA adapters (test_sglang_lora.py): weightsync's LoraSync objects live
    in this process, by adapter name."""
    import weightsync as ws
    import weightsync.sglang as wsg

    syncs = engine.__dict__.setdefault("_test_lora_syncs", {})
    if op == "lora_generate":  # lora: an adapter name or None
        outs = engine.generate(input_ids=args["prompts"], lora_path=[args["lora"]] *
                               len(args["prompts"]) if args["lora"] else None,
                               sampling_params={"max_new_tokens": args["max_new_tokens"],
                                                "temperature": 0.0})
        return [o["output_ids"] for o in outs]
    if op == "lora_from_disk":  # SGLang's own loader: the reference
        out = engine.load_lora_adapter(args["name"], args["path"])
        assert out.success, out
        return None
    try:
        if op == "lora_connect":
            sync = wsg.connect_lora(engine, **args)
            syncs[sync.name] = sync
            return {"name": sync.name, "version": sync.version}
        if op == "lora_receive":
            out = syncs[args.pop("name")].receive(**args)
            return {"out": out}
        if op == "lora_close":
            for sync in syncs.values():
                sync.close()
            syncs.clear()
            return None
    except ws.Error as e:
        return {"raised": {"code": e.code, "message": str(e)}}
    raise ValueError(f"unknown op {op!r}")


class Proc:
    """A process served over a pipe: call(op, **args) returns its result or
    raises with its traceback; fails at once if the process died."""

    def __init__(self, target: Callable, args: tuple, what: str, start_timeout: float):
        ctx = mp.get_context("spawn")
        self.what = what
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=False)
        self.proc.start()
        child.close()
        self._lock = threading.Lock()
        self._wait(start_timeout, "start")

    def _wait(self, timeout: float, op: str) -> Any:
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.5):
            if not self.proc.is_alive():
                raise AssertionError(f"{self.what} died (exit code {self.proc.exitcode}) "
                                     f"during {op}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.what}: {op} took over {timeout} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise AssertionError(f"{self.what}: {op} failed:\n{value}")
        return value

    def send(self, op: str, **args: Any) -> None:
        self.conn.send((op, args))

    def result(self, op: str = "call", timeout: float = 600) -> Any:
        with self._lock:
            return self._wait(timeout, op)

    def call(self, op: str, timeout: float = 600, **args: Any) -> Any:
        self.send(op, **args)
        return self.result(op, timeout)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(30)

    def close(self, timeout: float = 120) -> None:
        try:
            if self.proc.is_alive():
                while self.conn.poll(0):  # an answer nobody collected
                    self.conn.recv()
                self.call("shutdown", timeout=timeout)
        except AssertionError as e:  # shut down anyway
            print(f"{self.what}: shutdown: {e}", file=sys.stderr)
        finally:
            self.proc.join(timeout)
            self.kill()


def start_engine(model_path: str, tp: int, started_timeout: float = 900,
                 **engine_args: Any) -> Proc:
    """An sglang.Engine on the CPU (SGLang's generic path, with the test-only
    shims of sglang_shim/), weightsync's loader enabled, token ids only;
    `engine_args`: more of sglang.Engine's."""
    import weightsync

    package_root = os.path.dirname(os.path.dirname(os.path.abspath(weightsync.__file__)))
    path = [SHIM, package_root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                                   if p]
    env = {"PYTHONPATH": os.pathsep.join(path),
           # one core per rank (this machine's two); SGLang asks for it past one
           # rank per NUMA node
           "SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(r % max(1, os.cpu_count() or 1))
                                                   for r in range(tp))}
    kwargs = dict(model_path=model_path, device="cpu", tp_size=tp, dtype="bfloat16",
                  skip_tokenizer_init=True, context_length=128, max_total_tokens=2048,
                  max_running_requests=16, random_seed=0, log_level="error", **engine_args)
    return Proc(_engine_main, (kwargs, env), f"SGLang engine ({model_path}, tp={tp})",
                started_timeout)


# ---- the trainer -------------------------------------------------------------

def trainer_model(checkpoint: str) -> Any:
    """The trainer's model: transformers', loaded from `checkpoint`, all BF16
    (transformers keeps some buffers in FP32, DeepSeek's score bias; the
    engine config says BF16 for every tensor, and the checkpoints hold
    BF16-exact values there)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
    for module in model.modules():
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_floating_point() and b.dtype != torch.bfloat16:
                module._buffers[name] = b.to(torch.bfloat16)
    return model


def _trainer_main(conn: Any, coordinator: str, engine_config: Any, checkpoints: list,
                  options: dict) -> None:
    def setup() -> Any:
        import weightsync as ws
        import weightsync.torch as wst

        model = trainer_model(checkpoints[0])
        layout = wst.trainer_layout(model)
        pub = ws.Publisher(coordinator=coordinator, rank=0, layout=layout, engine=engine_config,
                           **options)
        pub.register_module(model)
        return {"model": model, "pub": pub}

    _serve(conn, setup, _trainer_op(checkpoints))


def _trainer_op(checkpoints: list) -> Callable[[Any, str, dict], Any]:
    def handle(state: Any, op: str, args: dict) -> Any:
        import torch
        import transformers

        if op == "push":  # the weights of checkpoints[c] as version `step`
            new = transformers.AutoModelForCausalLM.from_pretrained(
                checkpoints[args["checkpoint"]], dtype=torch.bfloat16)
            with torch.no_grad():  # parameters and persistent buffers, in place
                tensors = new.state_dict()
                for name, t in state["model"].state_dict(keep_vars=True).items():
                    t.copy_(tensors[name])
            res = state["pub"].push(args["step"])
            return {"step": res.step, "committed": list(res.committed),
                    "failed": [(int(r), str(why)) for r, why in res.failed],
                    "bytes_sent": res.bytes_sent, "delta_buckets": res.delta_buckets}
        if op == "shutdown":
            state["pub"].close()
            return None
        raise ValueError(f"unknown op {op!r}")

    return handle


def start_trainer(coordinator: str, engine_config: Any, checkpoints: list,
                  **options: Any) -> Proc:
    """Trainer rank 0 holding every tensor of a transformers model, loaded
    from checkpoints[0]; `push` loads checkpoints[c] into it and pushes."""
    return Proc(_trainer_main, (coordinator, engine_config, checkpoints, options),
                "trainer", 300)


def run_in_thread(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Starts fn() on a thread; the returned function joins it and returns
    its result (or raises its exception)."""
    box: dict = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by the joiner
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def join(timeout: Optional[float] = 900) -> Any:
        thread.join(timeout)
        if thread.is_alive():
            raise AssertionError("timed out")
        if "error" in box:
            raise box["error"]
        return box["value"]

    return join
