"""The swap of a version into a running vLLM server, as the trainer-side
engine (weightsync._vllm_trainer) drives it: pause generation, the update
session, the prefix-cache reset, resume. Through the client's own methods
where it has them (`pause_generation`, `resume_generation`,
`reset_prefix_cache`), else over HTTP for a client with a `base_url`
(vLLM's HTTPVLLMWeightSyncClient: POST /pause, /resume and
/reset_prefix_cache, mounted with VLLM_SERVER_DEV_MODE=1). vLLM is not
imported here.

vLLM 0.32's engine core (vllm/v1/engine/core.py, v1/core/sched/scheduler.py):
- `pause_scheduler(mode="keep")` sets PAUSED_ALL: no request is scheduled
  (new ones queue), running ones keep their KV blocks; mode "abort" aborts
  every request first. Utility calls (the update session) still run.
- `reset_prefix_cache(reset_running_requests=True)` preempts every running
  request (its KV blocks freed; recomputed when it is scheduled again) and
  then drops every cached block hash; without it the reset is refused while
  any block is in use.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from ._errors import Error

logger = logging.getLogger("weightsync.vllm")

IN_FLIGHT = ("recompute", "abort", "keep")


def check_in_flight(mode: str) -> str:
    if mode not in IN_FLIGHT:
        raise Error("invalid_argument", f"in_flight {mode!r}: expected one of "
                    f"{', '.join(IN_FLIGHT)} (what a swap does to running requests)")
    return mode


class ServerSwap:
    """Pauses, resets and resumes one server around the update session."""

    def __init__(self, client: Any, in_flight: str, reset: bool):
        self.client = client
        self.in_flight = check_in_flight(in_flight)
        self.reset = reset
        self._warned: set = set()

    def _base(self) -> Optional[str]:
        base = getattr(self.client, "base_url", None)
        return base if isinstance(base, str) else None

    def _http(self, route: str, params: dict) -> Optional[Any]:
        """POST `route`; None when the server has no such route (404)."""
        import requests

        base = self._base()
        assert base is not None
        response = requests.post(f"{base}/{route}", params=params,
                                 timeout=getattr(self.client, "timeout", 300))
        if response.status_code == 404:
            return None
        response.raise_for_status()
        return response.json() if response.content else {}

    def _warn_once(self, key: str, message: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, *args)

    def pause(self) -> bool:
        """Stops the server from scheduling (requests queue); True when paused."""
        mode = "abort" if self.in_flight == "abort" else "keep"
        method = getattr(self.client, "pause_generation", None)
        if callable(method):
            method(mode=mode, clear_cache=False)
            return True
        if self._base() is None:
            return False
        if self._http("pause", {"mode": mode, "clear_cache": "false"}) is None:
            self._warn_once("pause", "weightsync: %s has no /pause (vLLM < 0.32, or "
                            "VLLM_SERVER_DEV_MODE unset): requests keep being scheduled "
                            "around the swap", self._base())
            return False
        return True

    def resume(self) -> None:
        method = getattr(self.client, "resume_generation", None)
        if callable(method):
            method()
        elif self._base() is not None:
            self._http("resume", {})

    def reset_prefix_cache(self) -> Optional[bool]:
        """Drops every cached KV block (their KV came from the old weights):
        True; False when the server refused (in_flight "keep": blocks held
        by running requests); None when not done (reset off, or the client
        cannot)."""
        if not self.reset:
            return None
        running = self.in_flight != "keep"
        method = getattr(self.client, "reset_prefix_cache", None)
        if callable(method):
            try:
                out = method(reset_running_requests=running)
            except TypeError:  # a client without the keyword
                out = method()
            return True if out is None else bool(out)
        if self._base() is None:
            return None
        out = self._http("reset_prefix_cache",
                         {"reset_running_requests": "true" if running else "false"})
        if out is None:
            self._warn_once("reset", "weightsync: %s has no /reset_prefix_cache (the server "
                            "needs VLLM_SERVER_DEV_MODE=1): its prefix cache keeps KV computed "
                            "with the old weights", self._base())
            return False
        if not out.get("success", False):
            logger.warning("weightsync: %s refused to reset its prefix cache (in_flight 'keep': "
                           "running requests hold blocks): new requests may hit KV computed "
                           "with the old weights unless they carry a per-version cache_salt",
                           self._base())
            return False
        return True

    def swap(self, session: Callable[[], None]) -> dict:
        """pause, session() (the update session: start, update, finish),
        the reset, resume; the reset and the resume run even when the
        session raises (the workers then keep their version). Returns
        {"prefix_cache_reset", "pause_seconds": from the pause request to
        the resume's answer (what the trainer saw; the server's own pause is
        within it)}."""
        start = time.monotonic()
        paused = self.pause()
        reset: Optional[bool] = None
        try:
            session()
        finally:
            try:
                reset = self.reset_prefix_cache()
            finally:
                if paused:
                    self.resume()
        return {"prefix_cache_reset": reset, "pause_seconds": time.monotonic() - start}
