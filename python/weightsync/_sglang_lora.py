"""LoRA adapters into a running SGLang engine (docs/lora.md), from the
process that owns its `sglang.Engine`: SGLang's own adapter API
(`load_lora_adapter_from_tensors`, `unload_lora_adapter`, SGLang >= 0.5.2x)
builds each committed version from the received tensors; SGLang's scheduler
hands every tensor-parallel rank the whole adapter and each slices it.
SGLang is not imported here; only the engine's methods are called.

SGLang replaces an adapter by unloading and loading it again: weightsync
pauses generation around the two (requests wait, none sees the adapter
missing) and flushes the radix cache. A version SGLang refuses leaves the
previous one loaded again before the error is raised.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from ._engine import outcome_dict
from ._errors import Error
from ._sglang_control import _pause
from .lora import adapter_of, check_base


def _server_args(engine: Any) -> Any:
    args = getattr(engine, "server_args", None)
    if args is None:
        raise Error("unsupported", f"{type(engine).__name__} has no server_args: weightsync's "
                    "LoRA sync drives an sglang.Engine")
    return args


def check_engine(engine: Any, adapter: dict, keys: list) -> None:
    """Refuses an adapter the engine cannot serve, before a byte moves."""
    name = adapter["name"]
    args = _server_args(engine)
    if not getattr(args, "enable_lora", False):
        raise Error("unsupported", f"adapter {name!r}: the SGLang engine serves no LoRA "
                    "adapters (start it with enable_lora=True, max_lora_rank and "
                    "lora_target_modules)")
    rank = int(adapter["config"].get("r", 0))
    max_rank = getattr(args, "max_lora_rank", None)
    if max_rank is not None and rank > int(max_rank):
        raise Error("invalid_argument", f"adapter {name!r} has rank {rank}, the SGLang engine's "
                    f"max_lora_rank is {max_rank}")
    targets = getattr(args, "lora_target_modules", None)
    if targets and "all" not in set(targets):
        modules = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in keys}
        missing = sorted(modules - set(targets))
        if missing:
            raise Error("invalid_argument", f"adapter {name!r} targets {', '.join(missing)}, "
                        "which the SGLang engine's lora_target_modules "
                        f"({', '.join(sorted(targets))}) leave out")
    model_path = getattr(args, "model_path", None)
    if model_path:
        import os

        path = os.path.join(model_path, "config.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                check_base(adapter, json.load(f), "the SGLang engine")


class LoraSync:
    """One adapter job in one SGLang engine (one engine rank of the job's
    config: the engine takes the whole adapter, whatever its tp_size)."""

    def __init__(self, engine: Any, coordinator: Any, engine_config: Any, replica: int = 0,
                 **options: Any):
        from ._api import engine_params
        from ._subscriber import Subscriber
        from ._tensors import torch_dtype

        adapter = adapter_of(engine_config)
        if adapter is None:
            raise Error("invalid_argument", "this engine config names no LoRA adapter (field "
                        "'lora': made by weightsync.lora.engine_config)")
        params = engine_params(engine_config, replica, 0)
        parsed = json.loads(_config_text(engine_config))
        tp = (parsed[0] if isinstance(parsed, list) else parsed).get("tp", 1)
        if tp != 1:
            raise Error("invalid_argument", f"adapter {adapter['name']!r}: an SGLang engine is "
                        f"one rank of the adapter job (its scheduler hands every tensor-parallel "
                        f"rank the whole adapter): make its config with tp=1, not {tp}")
        check_engine(engine, adapter, [p.name for p in params])
        import torch

        self.engine, self.adapter, self.name = engine, adapter, adapter["name"]
        self.sub = Subscriber(coordinator=coordinator, engine=engine_config, replica=replica,
                              rank=0, **options)
        self._staged = {}
        for p in params:
            t = torch.zeros(list(p.shape), dtype=torch_dtype(p.dtype))
            self.sub.register(p.name, t)
            self._staged[p.name] = t
        self._committed: Optional[dict] = None
        self.version = -1
        # Until its first step the adapter is what PEFT initializes (lora_B
        # zero: the base model's outputs).
        self._apply({n: t.clone() for n, t in self._staged.items()})

    def _loaded(self) -> bool:
        loaded = getattr(self.engine, "_weightsync_loras", None)
        return loaded is not None and self.name in loaded

    def _load(self, tensors: dict) -> None:
        out = self.engine.load_lora_adapter_from_tensors(self.name, tensors, self.adapter["config"])
        if not getattr(out, "success", True):
            raise Error("invalid_argument", f"adapter {self.name!r}: SGLang refused it: "
                        f"{getattr(out, 'error_message', out)}")
        self.engine.__dict__.setdefault("_weightsync_loras", set()).add(self.name)

    def _apply(self, tensors: dict) -> None:
        engine = self.engine
        paused = bool(getattr(engine, "_weightsync_paused", False))
        _pause(engine, True)
        try:
            if self._loaded():
                out = engine.unload_lora_adapter(self.name)
                if not getattr(out, "success", True):
                    raise Error("internal", f"adapter {self.name!r}: SGLang could not unload "
                                f"its previous version: {getattr(out, 'error_message', out)}")
                engine._weightsync_loras.discard(self.name)
            try:
                self._load(tensors)
            except BaseException:
                if self._committed is not None:
                    self._load({n: t.clone() for n, t in self._committed.items()})
                raise
            self._committed = tensors
            flush = getattr(engine, "flush_cache", None)
            if callable(flush):
                flush()
        finally:
            if not paused:
                _pause(engine, False)

    def update(self, timeout: float = 120.0) -> Optional[dict]:
        """Runs the adapter's next step (waits up to `timeout` s for it to
        begin); once committed, SGLang serves it under the adapter's name.
        Returns {"step", "committed", "reason", "bytes", ..., "version"}, or
        None when no step began."""
        out = self.sub.run_step(timeout=timeout)
        if out is None:
            return None
        result: dict = outcome_dict(out) or {}
        if out.committed and self.sub.version == out.step:
            try:
                self._apply({n: t.clone() for n, t in self._staged.items()})
                self.version = out.step
            except Error as e:
                result["committed"] = False
                result["reason"] = str(e)
        elif result["committed"]:
            result["committed"] = False
        result["version"] = self.version
        return result

    def receive(self, step: Optional[int] = None, timeout: float = 120.0) -> dict:
        """update(), raising weightsync.Error when no step began, the step
        did not commit (the engine serves the version before), or it was not
        step `step`."""
        out = self.update(timeout)
        if out is None:
            raise Error("timeout", f"adapter {self.name!r}: no step began within {timeout} s")
        if not out["committed"]:
            raise Error("peer_failure", f"adapter {self.name!r}: step {out['step']} was not "
                        f"committed: {out['reason']} (SGLang serves version {self.version})")
        if step is not None and out["step"] != step:
            raise Error("mismatch", f"adapter {self.name!r}: expected step {step}, the trainers "
                        f"pushed step {out['step']} (now the adapter's version)")
        return out

    def close(self) -> None:
        """Leaves the job; SGLang keeps serving the adapter's last version."""
        self.sub.close()


def _config_text(engine_config: Any) -> str:
    from ._api import load_json

    return load_json(engine_config, "engine config")[0]
