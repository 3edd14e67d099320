"""One inference-engine rank's model, connected to weightsync: what the vLLM
and SGLang integrations share. The engine is never imported here."""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from ._api import Subscriber
from ._errors import Error

MODES = ("direct", "load_weights")


def outcome_dict(out: Any) -> Optional[dict]:
    """A StepOutcome as a plain dict (it crosses RPC boundaries, e.g. vLLM's
    collective_rpc or Ray)."""
    if out is None:
        return None
    return {"step": out.step, "committed": out.committed, "reason": out.reason,
            "bytes": out.bytes, "seconds": out.seconds}


class EngineSync:
    """Keeps one engine rank's model in sync.

    mode "direct": the model's parameters, under the engine's own names and
    fused shapes (vLLM / SGLang layouts), are registered and written in place.
    mode "load_weights" (the rank's engine group has framework "hf"): whole HF
    tensors go to `model.load_weights(batch)` as buckets complete them, then
    `post_load(step)` (the engine's process_weights_after_loading).
    """

    def __init__(self, model: Any, coordinator: Any, engine: Any, replica: int, rank: int,
                 mode: str = "direct", post_load: Optional[Callable[[int], Any]] = None,
                 strict: bool = True, **subscriber_options: Any):
        if mode not in MODES:
            raise Error("invalid_argument", f"mode {mode!r}: expected one of {', '.join(MODES)}")
        self.model = model
        self.mode = mode
        self.sub = Subscriber(coordinator=coordinator, engine=engine, replica=replica, rank=rank,
                              **subscriber_options)
        if mode == "direct":
            self.sub.register_module(model, strict=strict)
        else:
            if not hasattr(model, "load_weights"):
                raise Error("invalid_argument", f"load_weights mode: {type(model).__name__} has no "
                            "load_weights(weights) method")
            self.sub.on_weights(model.load_weights)
            if post_load is not None:
                self.sub.on_loaded(post_load)
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        self._outcomes: list = []
        self._error: Optional[BaseException] = None

    @property
    def version(self) -> int:
        return self.sub.version

    def update(self, timeout: float = 60.0) -> Optional[dict]:
        """Waits up to `timeout` s for the next step and runs it (None: none began)."""
        return outcome_dict(self.sub.run_step(timeout=timeout))

    def start(self) -> None:
        """Serves steps on a background thread until stop()."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._serve, name="weightsync-engine", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while not self._stopping:
                out = self.sub.run_step(timeout=0.2)
                if out is not None:
                    self._outcomes.append(outcome_dict(out))
        except BaseException as e:  # noqa: BLE001 - surfaced by stop()
            self._error = e

    def stop(self) -> list:
        """Stops serving; returns the outcomes served (raises what stopped it, if anything)."""
        self._stopping = True
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._stopping = False
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        served, self._outcomes = self._outcomes, []
        return served

    def close(self) -> None:
        if self._thread is not None:
            self.stop()
        self.sub.close()
