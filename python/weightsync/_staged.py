"""Staged steps: an engine rank receives each version on a background
thread, into weightsync-owned copies, while the engine serves the version
before; the engine applies the newest committed one where it can (vLLM:
inside its busy loop, between two engine steps), so that serving stops only
for the apply. Used by EngineSync (staged=True); the engine is never
imported here.

What a staged version costs: one copy of what the rank receives (load_weights
mode: every HF tensor the rank takes, whole; direct mode through the
engine's protocol: the rank's parameters in loading form), in host memory or
on `weights_device`. A version whose step fails before the apply is dropped:
nothing the engine serves changes.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Optional

from ._errors import Error


class StagedSteps:
    """The background receive of one engine rank.

    `sub`: its Subscriber (hooks set by the owner: begin(), weights() and
    the loop's outcomes); `snapshot()`: direct mode through a protocol, the
    committed step's tensors (copies of the private tensors the data landed
    in), else None.

    take(timeout, step) returns the next decided step, newest first (see its
    docstring) and, when it committed, the tensors to apply.
    """

    def __init__(self, sub: Any, outcome: Callable[[Any], Optional[dict]],
                 snapshot: Optional[Callable[[], list]] = None):
        self.sub = sub
        self._outcome = outcome
        self._snapshot = snapshot
        self._cond = threading.Condition()
        self._receiving: Optional[tuple] = None   # (step, [(name, tensor)]) as it lands
        self._ready: Optional[tuple] = None       # (step, tensors): newest committed, not applied
        self._decided: collections.deque = collections.deque()  # outcome dicts, in order
        self._error: Optional[BaseException] = None
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="weightsync-staged", daemon=True)

    def start(self) -> None:
        """Starts the background receive (once the Subscriber's hooks are set)."""
        self._thread.start()

    # hooks, on the background thread -------------------------------------------

    def begin(self, step: int) -> None:
        self._receiving = (step, [])

    def weights(self, batch: list) -> None:
        # The views are valid during the call only: the staged copy is ours.
        assert self._receiving is not None
        self._receiving[1].extend((name, t.clone()) for name, t in batch)

    def _loop(self) -> None:
        while not self._stopping:
            try:
                out = self.sub.run_step(timeout=0.2)
            except BaseException as e:  # noqa: BLE001 - raised by take()
                with self._cond:
                    self._error = e
                    self._cond.notify_all()
                return
            if out is None:
                continue
            result = self._outcome(out)
            receiving, self._receiving = self._receiving, None
            tensors = None
            if out.committed:
                if self._snapshot is not None:
                    tensors = self._snapshot()
                elif receiving is not None and receiving[0] == out.step:
                    tensors = receiving[1]
            with self._cond:
                if tensors is not None:
                    self._ready = (out.step, tensors)
                elif result is not None and result["committed"]:
                    result["committed"] = False
                    result["reason"] = "the rank staged nothing of the step"
                self._decided.append(result)
                self._cond.notify_all()

    # the engine's side -----------------------------------------------------------

    def take(self, timeout: float, step: Optional[int] = None) -> tuple:
        """Waits up to `timeout` s for a decided step (with `step`: that step
        or a later one) and returns (outcome dict, tensors to apply or None),
        or (None, None) when none was decided in time. Steps decided before
        the one returned are dropped (their outcomes were never asked for;
        the newest committed version supersedes older ones). When the step
        returned committed, the tensors are the newest committed version's
        (the step's own, or a later one's if the trainers pushed on: the
        outcome then names it)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self._error is not None:
                    error, self._error = self._error, None
                    raise error
                wanted = [o for o in self._decided if step is None or o["step"] >= step]
                if wanted:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return None, None
                self._cond.wait(left)
            # The newest decided step at or after `step` (without `step`: the
            # newest one): every staged step before it is superseded.
            out = wanted[-1]
            self._decided.clear()
            ready, tensors = self._ready, None
            if out["committed"] and ready is not None:
                if ready[0] != out["step"]:
                    out = dict(out, step=ready[0])
                tensors = ready[1]
                self._ready = None
            return out, tensors

    @property
    def ready_step(self) -> Optional[int]:
        """The newest committed step staged and not yet applied, or None."""
        with self._cond:
            return None if self._ready is None else self._ready[0]

    def close(self) -> None:
        self._stopping = True
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()


def require_staged_protocol(protocol: Any, mode: str) -> None:
    if protocol is None:
        raise Error("unsupported", f"staged=True in {mode} mode needs the engine's update "
                    "protocol (an engine whose kernels read the registered parameters in "
                    "place takes each version at commit already: use staging=True)")
