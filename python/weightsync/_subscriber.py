"""The engine side: Subscriber."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, AsyncIterator, Callable, Optional, TypeVar

from . import _core
from ._common import EngineLike, _Registry, load_json
from ._coordinator import CoordinatorLike
from ._options import SubscriberOptions, _address, _merge_options, core_subscriber_options
from ._results import ParamInfo, StepOutcome, _result

_StepHook = TypeVar("_StepHook", bound=Optional[Callable[[int], object]])
_WeightsHook = TypeVar("_WeightsHook", bound=Optional[Callable[[list[tuple[str, Any]]], object]])


class Subscriber:
    """The engine side, one per engine rank (DESIGN.md): register the engine's
    parameters under its own names, then run_step() or serve() (or, from
    asyncio, `await run_step_async()`, `async for out in steps()`).

        sub = ws.Subscriber(coordinator=addr, engine=E, replica=i, rank=j)
        sub.register_module(model)
        out = sub.run_step(timeout=5.0)   # None, or a StepOutcome
    """

    def __init__(self, coordinator: CoordinatorLike, engine: EngineLike, replica: int = 0,
                 rank: int = 0, *, options: Optional[SubscriberOptions] = None,
                 transport: str = "ucx", staging: bool = False, token: Optional[str] = None,
                 job: str = "weightsync", connect_timeout: float = 60.0,
                 step_timeout: float = 120.0, weights_device: Any = None,
                 coordinator_reconnect: float = 300.0, parity: str = ""):
        """Connects rank `rank` of replica `replica` of `engine` (an engine
        config: path, dict, JSON text, or a list of them: engine groups) to the
        coordinator ("HOST:PORT" or a Coordinator). The options
        (SubscriberOptions says what each does) are keywords, or bound in
        `options`; a keyword that differs from its default overrides
        `options`' value."""
        o = _merge_options(SubscriberOptions, options, dict(
            transport=transport, staging=staging, token=token, job=job,
            connect_timeout=connect_timeout, step_timeout=step_timeout,
            weights_device=weights_device, coordinator_reconnect=coordinator_reconnect,
            parity=parity))
        text, base = load_json(engine, "engine config")
        self._options = o
        self._core = _core.Subscriber()
        self._core.open(core_subscriber_options(o, coordinator, text, base, replica, rank))
        names = [n for n, _, _ in self._core.params()]
        self._registry = _Registry(f"engine rank {self._core.global_rank}", names)
        self._stop = threading.Event()
        # One run_step at a time, whichever thread or event loop calls it.
        self._step_lock = threading.RLock()
        # asyncio: run_step on this thread; a step still running when its
        # awaiting task was cancelled (its outcome goes to the next call).
        self._executor: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Future[Optional[StepOutcome]]] = None
        self._async_lock: Optional[asyncio.Lock] = None

    @property
    def options(self) -> SubscriberOptions:
        """The options this subscriber was opened with."""
        return self._options

    def params(self) -> list[ParamInfo]:
        """[(name, dtype, shape)] this rank must register."""
        return [ParamInfo(n, d, list(s)) for n, d, s in self._core.params()]

    def register(self, name: str, tensor: Any) -> None:
        """Registers engine parameter `name` (a torch tensor, CPU or CUDA);
        checked against the engine layout (MismatchError, NotFound) and kept
        alive."""
        self._registry.add(name, tensor, self._core.register_param)

    def register_module(self, module: Any, *, strict: bool = True) -> None:
        """Registers every parameter of `module` under its name (the engine's
        names), and the buffers the layout names."""
        self._registry.add_module(module, self.register, strict)

    def on_begin(self, fn: _StepHook) -> _StepHook:
        """fn(step) before a step's data lands (pause generation). If it
        raises, that step fails on this rank, cleanly. None removes the hook.
        Usable as a decorator."""
        self._core.on_begin(fn)
        return fn

    def on_end(self, fn: _StepHook) -> _StepHook:
        """fn(step) once a step is decided (resume; post-load processing). If it
        raises, the outcome's reason says so. None removes the hook. Usable as
        a decorator."""
        self._core.on_end(fn)
        return fn

    def on_weights(self, fn: _WeightsHook, changed_only: bool = False) -> _WeightsHook:
        """load_weights mode, for a rank of an engine group of framework "hf"
        (every HF tensor whole): nothing is registered; fn(batch) gets the HF
        tensors as buckets complete them, batch = [(hf_key, tensor)], exactly
        what vLLM's and SGLang's `model.load_weights(batch)` take. The tensors
        (on the CPU, or on `weights_device`) are valid during the call only.
        If fn raises, the step fails on this rank. Usable as a decorator.

        `changed_only`: a delta sync step (docs/delta.md) hands only the
        tensors that may have changed since the version this rank holds; the
        engine keeps the others as it took them. For engines that take a
        subset (SGLang's weight-update session, a plain load_weights), not
        vLLM's layerwise reload (it rebuilds a layer from what it is
        handed)."""
        self._core.on_weights(fn, changed_only)
        return fn

    def on_loaded(self, fn: _StepHook) -> _StepHook:
        """load_weights mode: fn(step) after the step's last tensors went to
        on_weights and before the ack (e.g. process_weights_after_loading). If
        it raises, the step fails on this rank. Usable as a decorator."""
        self._core.on_loaded(fn)
        return fn

    def prepare(self) -> None:
        """Connects the transport and waits for the plan now rather than in
        the first step."""
        self._core.prepare()

    def run_step(self, timeout: float = 5.0) -> Optional[StepOutcome]:
        """Waits up to `timeout` s for a step to begin, then runs it to its
        decision: None when none began, else the outcome (.step, .committed,
        .reason, .bytes, .seconds). Raises TimeoutError when the trainers
        never set up (connect_timeout)."""
        with self._step_lock:
            out = self._core.run_step(timeout)
        return None if out is None else _result(StepOutcome, out)

    def serve(self, poll: float = 0.2) -> None:
        """run_step until stop() (from a hook or another thread)."""
        self._stop.clear()
        while not self._stop.is_set():
            self.run_step(poll)

    def stop(self) -> None:
        """Makes serve(), serve_async() and steps() return after the step in
        progress (within their `poll`)."""
        self._stop.set()

    # -- asyncio ------------------------------------------------------------

    async def run_step_async(self, timeout: float = 5.0) -> Optional[StepOutcome]:
        """run_step(timeout) for an asyncio server: runs on a worker thread of
        this subscriber (the event loop keeps running; the call releases the
        GIL) and returns the same (None, or a StepOutcome).

        Cancellation-safe: cancelling the awaiting task does not cancel a step
        in progress (weightsync never exposes half a step); it runs to its
        decision on the worker thread, and the next run_step_async returns its
        outcome. Calls from several tasks take turns."""
        if self._async_lock is None:
            self._async_lock = asyncio.Lock()
        async with self._async_lock:
            while True:
                fresh = self._pending is None
                if self._pending is None:
                    if self._executor is None:
                        self._executor = ThreadPoolExecutor(
                            max_workers=1, thread_name_prefix="weightsync-step")
                    self._pending = self._executor.submit(self.run_step, timeout)
                pending = self._pending
                try:
                    out = await asyncio.shield(asyncio.wrap_future(pending))
                except asyncio.CancelledError:
                    raise  # the step runs on; the next call gets its outcome
                except BaseException:
                    self._pending = None
                    raise
                self._pending = None
                # A cancelled call's run_step that saw no step: wait our own.
                if out is not None or fresh:
                    return out

    async def steps(self, *, poll: float = 0.5, idle_timeout: Optional[float] = None,
                    limit: Optional[int] = None) -> AsyncIterator[StepOutcome]:
        """The outcomes of the steps this rank serves, as they are decided:

            async for out in sub.steps():
                log(out.step, out.committed)

        Ends on stop(), after `limit` outcomes, or when no step began for
        `idle_timeout` seconds (None: never). Each wait is run_step_async
        (poll), so stop() takes effect within `poll` seconds."""
        self._stop.clear()
        served = 0
        idle_since = time.monotonic()
        while not self._stop.is_set() and (limit is None or served < limit):
            wait = poll
            if idle_timeout is not None:
                left = idle_timeout - (time.monotonic() - idle_since)
                if left <= 0:
                    return
                wait = max(min(poll, left), 0.001)
            out = await self.run_step_async(wait)
            if out is None:
                continue
            served += 1
            idle_since = time.monotonic()
            yield out

    async def serve_async(self, poll: float = 0.5) -> None:
        """serve() for an asyncio server: serves steps until stop()."""
        async for _ in self.steps(poll=poll):
            pass

    async def aclose(self) -> None:
        """close() without blocking the event loop: waits for a step in
        progress on the worker thread, then leaves the coordinator."""
        pending = self._pending
        if pending is not None:
            with contextlib.suppress(Exception):  # the cancelled call's error
                await asyncio.wrap_future(pending)
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    async def __aenter__(self) -> Subscriber:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The last committed step, -1 before the first."""
        return self._core.version

    @property
    def torn(self) -> bool:
        """True while the registered tensors hold a mix: a step that did not
        commit wrote part of them (no staging), so they are not `version`
        whole. Cleared by the next commit; never set with staging=True."""
        return self._core.torn

    def restored(self, step: int) -> None:
        """The engine put this rank's last committed version back whole by
        its own means after failed step `step` wrote part of the registered
        tensors (or of what the engine was handed): `torn` is False again and
        the coordinator's status stops listing the rank torn. Call it
        between steps, on the thread that runs `run_step`."""
        self._core.restored(step)

    def applied(self, step: int, requests: Optional[dict[str, int]] = None) -> bool:
        """The engine serves committed step `step` from now on: a staged
        version's apply ended (engines that take each version at commit need
        not call it). `weightsync status` then shows the step and since when
        ("applied": {"step", "at", "requests"}), with `requests`: each
        request running at the swap, by the engine's request id -> the index
        of its first output token made by `step` (docs/integrations/vllm.md). Call it
        between steps. Waits at most 2 s for the coordinator (the engine may
        be paused): TimeoutError, PeerFailure when it cannot be told; False,
        telling nothing, where the coordinator is older than the report."""
        return self._core.applied(step, dict(requests or {}))

    @property
    def coordinator(self) -> str:
        """The coordinator's address ("HOST:PORT") this rank connects to."""
        return self._core.coordinator

    def set_coordinator(self, address: Any) -> None:
        """The coordinator moved (restarted on another address, or a
        Coordinator object): this rank reconnects there, as the same member,
        with its version (docs/usage.md, "The coordinator dies")."""
        self._core.set_coordinator(_address(address))

    @property
    def global_rank(self) -> int:
        """This rank among every engine rank (replica * tp + rank with one
        engine group)."""
        return self._core.global_rank

    def close(self) -> None:
        """Stops serving, waits for a step in progress, then leaves the
        coordinator."""
        self._stop.set()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._pending = None
        with self._step_lock:
            self._core.close()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
