"""One inference-engine rank's model, connected to weightsync: what the vLLM
and SGLang integrations share. The engine is never imported here."""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Optional

from . import _parity
from ._api import Subscriber
from ._errors import Error
from ._staged import StagedSteps, require_staged_protocol

logger = logging.getLogger("weightsync")

MODES = ("direct", "load_weights")

# model -> (load kind, [(name, tensor)]) of the last version weightsync
# committed into it: what a failed step restores, also after a reconnect (a
# new job, another way in) on the same engine.
_LAST_COMMITTED: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def engine_framework(engine: Any, replica: int) -> str:
    """The framework ("vllm", "sglang", "hf") of the engine group that replica
    `replica` belongs to (replicas are numbered over every group, in order)."""
    import json

    from ._api import load_json

    text, _ = load_json(engine, "engine config")
    groups = json.loads(text)
    if isinstance(groups, dict):
        groups = [groups]
    first = 0
    for group in groups:
        count = int(group.get("replicas", 1))
        if replica < first + count:
            return str(group.get("framework", "vllm"))
        first += count
    raise Error("invalid_argument", f"replica {replica}: the engine config has {first} replicas")


def outcome_dict(out: Any) -> Optional[dict]:
    """A StepOutcome as a plain dict (it crosses RPC boundaries, e.g. vLLM's
    collective_rpc or Ray)."""
    if out is None:
        return None
    result = {"step": out.step, "committed": out.committed, "reason": out.reason,
              "bytes": out.bytes, "delta_buckets": out.delta_buckets,
              "weights_handed": out.weights_handed, "seconds": out.seconds,
              "torn": bool(out.torn)}
    if out.torn_reason:
        # The sentence `reason` ends with that says the rank is torn.
        result["torn_reason"] = out.torn_reason
    return result


def settle_restored(result: dict, restored: Optional[str], poisoned: Optional[str]) -> None:
    """An outcome of an engine whose own update protocol put its previous
    version back after a failed step (`restored`: what it put back): the
    rank is whole again, so it is not torn and its reason says what was
    restored instead of "is torn". Poisoned (nothing could be put back): torn."""
    if poisoned is not None:
        result["torn"] = True
        return
    if restored is None:
        return
    result["torn"] = False
    reason = result.get("reason") or ""
    note = result.pop("torn_reason", "")
    if note and reason.endswith(note):
        reason = reason[: -len(note)].removesuffix("; ")
    result["reason"] = (f"{reason}; " if reason else "") + f"the engine was restored to {restored}"


class UpdateProtocol:
    """An engine's own way to take new weights, which weightsync runs for a
    step (vLLM: layerwise reload; SGLang: a begin/end session). Subclasses
    implement what the engine offers; EngineSync drives it:

        begin()            before the step's first tensor
        load(batch)        [(name, tensor)]: HF tensors (mode load_weights), or
                           tensors under the engine's own names and shapes
                           (load_kind "engine": direct mode's fallback); the
                           tensors stay valid after the call
        finish()           after the last tensor: the engine processes and
                           serves them (a protocol with `atomic = True`
                           changes the engine whole or, raising, not at all)
        abort()            the step failed between begin() and finish(): leave
                           the engine able to begin() again (its weights may
                           be mixed: EngineSync restores a version next)
        initial_weights()  HF (name, tensor) pairs of the version the engine
                           started from (its checkpoint), or None
        poison(reason)     the engine must refuse to generate (its weights are
                           mixed and no version could be restored)
        unpoison()         a version was committed whole
    """

    #: "hf": load() takes HF tensors; "engine": the engine's own names and
    #: shapes (before any repacking), as the engine config's layout has them.
    load_kind = "hf"

    def begin(self) -> None:
        raise NotImplementedError

    def load(self, batch: list) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        pass

    def initial_weights(self) -> Optional[Iterable]:
        return None

    def poison(self, reason: str) -> None:
        pass

    def unpoison(self) -> None:
        pass


class EngineSync:
    """Keeps one engine rank's model in sync.

    mode "direct": the model's parameters, under the engine's own names and
    fused shapes (vLLM / SGLang layouts), are registered and written in place.
    With `protocol` (an UpdateProtocol with load_kind "engine"), they are
    received into private tensors instead and handed to the engine's update
    protocol once the step is committed (for engines whose parameters are not
    what their kernels read).

    mode "load_weights" (the rank's engine group has framework "hf"): whole HF
    tensors go to the engine as buckets complete them: through `protocol`
    (an UpdateProtocol with load_kind "hf") when given, else to
    `model.load_weights(batch)` and then `post_load(step)`.

    With a protocol, no step leaves the engine on a mix of versions: a step
    that fails after the engine took some of its tensors (a trainer died, a
    peer failed after this rank acked, a hook raised) is undone by loading
    the last committed version again (kept in host memory when
    `keep_previous`, else, before the first commit, the engine's own
    checkpoint); if that is impossible the engine is poisoned (refuses to
    generate) until the next committed step. `version` is the last version
    the engine holds whole.

    Direct mode checks parity first, before the Subscriber connects
    (_parity.check): the rank's layout against `held` ({name: (dtype,
    shape)}, the params as the engine loads them; default: the model's
    parameters and buffers, where no protocol stages them), names through
    `aliases`; any difference raises MismatchError with a table of the params
    that differ. `parity` is then the summary line ("N of M linear weights
    FP8, scales fp32; matches the engine", "" without FP8), also in each step
    result ("fp8") of update() and, per engine rank, in `weightsync status`.

    `staged` (with a protocol): each step is received on a background
    thread into copies this object owns while the engine serves (weightsync.
    _staged), and update() applies the newest committed one through the
    protocol: the engine stops only for the apply. A step that fails before
    the apply changes nothing the engine serves; an apply that fails
    restores the previous version, as a blocking step does. The commit came
    before the apply, so the ranks of a replica agree on it afterwards:
    `agree(ok)` is called on every rank after its apply and returns whether
    every rank's succeeded (vLLM: a gather over the tensor-parallel group);
    where one failed, the others go back to the previous version too.
    """

    def __init__(self, model: Any, coordinator: Any, engine: Any, replica: int, rank: int,
                 mode: str = "direct", post_load: Optional[Callable[[int], Any]] = None,
                 strict: bool = True, protocol: Optional[UpdateProtocol] = None,
                 keep_previous: bool = True, aliases: Optional[dict] = None,
                 held: Optional[dict] = None, staged: bool = False,
                 agree: Optional[Callable[[bool], bool]] = None, **subscriber_options: Any):
        if mode not in MODES:
            raise Error("invalid_argument", f"mode {mode!r}: expected one of {', '.join(MODES)}")
        #: The parity check's summary line (direct mode), "" when not checked
        #: or without FP8.
        self.parity = ""
        if mode == "direct" and held is None and protocol is None:
            held = _parity.engine_holds(model)
        if mode == "direct" and held is not None:
            self.parity = _parity.check(engine, replica, rank, held, aliases)
        self.model = model
        self.mode = mode
        self.protocol = protocol
        self.keep_previous = keep_previous
        if staged:
            require_staged_protocol(protocol, mode)
        if self.parity:
            # Registered with the coordinator: `weightsync status` shows it.
            subscriber_options.setdefault("parity", self.parity)
        self.sub = Subscriber(coordinator=coordinator, engine=engine, replica=replica, rank=rank,
                              **subscriber_options)
        self._version = -1          # protocol modes: the version the engine holds whole
        self._poisoned: Optional[str] = None
        self._previous: Optional[list] = None   # the last committed version's tensors
        if protocol is not None:
            kept = _LAST_COMMITTED.get(model)
            if kept is not None and kept[0] == protocol.load_kind:
                self._previous = kept[1]
        #: Why direct mode goes through the engine's protocol (set by the
        #: engine integration), or None.
        self.fallback_reason: Optional[str] = None
        self._pending: Optional[list] = None    # this step's, as received
        self._staged: Optional[list] = None     # direct + protocol: [(name, tensor)] received into
        self._active = False        # the protocol is between begin() and finish()/abort()
        self._touched = False       # the engine took tensors of this step
        self._failed = False        # this step already failed on this rank
        self._restored: Optional[tuple] = None  # (failed step, what was restored), last one
        self._stager: Optional[StagedSteps] = None
        self._agree = agree
        #: Set by the engine integration: {request id: output tokens so far}
        #: of the requests the engine runs, read at the swap (vLLM: inside
        #: update_weights, between two engine steps). Each committed step's
        #: result then has "requests", the index of each one's first token
        #: made by the step, and the coordinator is told (`weightsync
        #: status`: "applied").
        self.live_requests: Optional[Callable[[], dict]] = None
        if mode == "direct":
            if protocol is None and aliases:
                # Layout names the engine holds under other names (aliases:
                # {layout name: the model's name}), registered one by one.
                for name, _, _ in self.sub.params():
                    self.sub.register(name, model.get_parameter(aliases.get(name, name)))
            elif protocol is None:
                self.sub.register_module(model, strict=strict)
            else:
                self._stage_engine_params()
                if not staged:
                    self.sub.on_end(self._direct_end)
        elif staged:
            pass  # hooks below, once the stager exists
        elif protocol is not None:
            self.sub.on_begin(self._begin)
            self.sub.on_weights(self._weights)
            self.sub.on_loaded(self._loaded)
            self.sub.on_end(self._end)
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
        if staged:
            snapshot = None
            if mode == "direct":
                snapshot = lambda: [(n, t.clone()) for n, t in self._staged]  # noqa: E731
            self._stager = StagedSteps(self.sub, outcome_dict, snapshot)
            if mode == "load_weights":
                self.sub.on_begin(self._stager.begin)
                self.sub.on_weights(self._stager.weights)
            self._stager.start()

    @property
    def staged(self) -> bool:
        """True when steps are received on a background thread and applied by update()."""
        return self._stager is not None

    @property
    def staged_version(self) -> Optional[int]:
        """Staged mode: the newest committed step received and not yet
        applied (what the next update() applies), or None."""
        return None if self._stager is None else self._stager.ready_step

    @property
    def version(self) -> int:
        """The last committed step this engine rank holds, -1 before the first."""
        return self.sub.version if self.protocol is None else self._version

    @property
    def poisoned(self) -> Optional[str]:
        """Why the engine refuses to generate, or None."""
        return self._poisoned

    # load_weights mode through the engine's protocol -------------------------

    def _begin(self, step: int) -> None:
        self._pending = []
        self._touched = False
        self._failed = False
        try:
            self.protocol.begin()
            self._active = True
        except BaseException:
            self._failed = True
            raise

    def _weights(self, batch: list) -> None:
        if self._failed or not self._active:
            return  # the step already failed here: its data is drained, not loaded
        # The views are valid during this call only, and the engine may keep
        # them past it (vLLM buffers a layer's tensors until it has all of
        # them): it gets copies, which are also what a failed next step
        # restores.
        owned = [(name, t.clone()) for name, t in batch]
        self._pending.extend(owned)
        self._touched = True
        try:
            self.protocol.load(owned)
        except BaseException:
            self._failed = True
            raise

    def _loaded(self, step: int) -> None:
        if self._failed or not self._active:
            return
        try:
            self.protocol.finish()
        except BaseException:
            self._failed = True
            raise
        finally:
            self._active = False

    def _end(self, step: int) -> None:
        pending, self._pending = self._pending, None
        if self.sub.version == step and not self._failed and not self._active:
            self._commit(step, pending)
            return
        self._recover(step)

    def _keep(self, tensors: Optional[list]) -> None:
        self._previous = tensors if self.keep_previous else None
        if self._previous is not None:
            _LAST_COMMITTED[self.model] = (self.protocol.load_kind, self._previous)
        else:
            _LAST_COMMITTED.pop(self.model, None)

    def _commit(self, step: int, tensors: Optional[list]) -> None:
        self._version = step
        self._keep(tensors)
        if self._poisoned is not None:
            self._poisoned = None
            self.protocol.unpoison()

    def _recover(self, step: int) -> None:
        """Step `step` failed on this rank or elsewhere: the engine goes back to
        the last version it held whole."""
        was_active, self._active = self._active, False
        if was_active:
            try:
                self.protocol.abort()
            except BaseException as e:  # noqa: BLE001 - poisoned below
                self._poison(step, f"cleaning up the engine's update failed: {e}")
                raise
        if not self._touched:
            return  # the engine took nothing of this step: it still holds its version
        self._touched = False
        self._restore(step)

    def _restore(self, step: int) -> None:
        source: Optional[Iterable] = None
        what = ""
        if self._previous is not None:
            label = (f"version {self._version}" if self._version >= 0
                     else "the version committed before this connection")
            source, what = self._previous, f"{label} (kept in host memory)"
        elif self.protocol.load_kind == "hf" and self.model not in _LAST_COMMITTED:
            # Nothing was committed into this engine yet: it holds what it
            # started from.
            source = self.protocol.initial_weights()
            what = "the engine's own checkpoint"
        if source is None:
            why = ("no copy of the previous version is kept (keep_previous=False)"
                   if not self.keep_previous else
                   "the previous version was committed through another way in (a "
                   f"{_LAST_COMMITTED.get(self.model, ('?',))[0]!r} copy, this one loads "
                   f"{self.protocol.load_kind!r} tensors)")
            self._poison(step, why)
            raise Error("cancelled", f"weightsync: step {step} failed after the engine took part of "
                        f"it and version {self._version} cannot be restored: the engine refuses "
                        "to generate until the next committed step")
        try:
            self.protocol.begin()
            self._active = True
            batch: list = []
            for item in source:
                batch.append(item)
                if len(batch) >= 64:
                    self.protocol.load(batch)
                    batch = []
            if batch:
                self.protocol.load(batch)
            self.protocol.finish()
            self._active = False
        except BaseException as e:
            if self._active:
                self._active = False
                try:
                    self.protocol.abort()
                except BaseException:  # noqa: BLE001 - the engine is poisoned anyway
                    pass
            self._poison(step, f"restoring {what} failed: {e}")
            raise
        self._restored = (step, what)
        if self.sub.torn:
            # The C++ rank says torn (the step wrote part of what the engine
            # holds); the engine is whole again: it and the coordinator are
            # told.
            try:
                self.sub.restored(step)
            except Error:
                pass  # no coordinator now: its status says torn until the next commit

    def _poison(self, step: int, why: str) -> None:
        self._poisoned = (f"weightsync: step {step} failed after the engine took part of it, "
                          f"and {why}; the engine holds a mix of versions and refuses to "
                          "generate until the next committed step")
        self.protocol.poison(self._poisoned)

    # direct mode through the engine's protocol -------------------------------

    def _stage_engine_params(self) -> None:
        """Private tensors of this rank's layout (engine names and loading
        shapes) that the data lands in, handed to the protocol on commit."""
        from ._tensors import torch_dtype
        import torch

        self._staged = []
        for name, dtype, shape in self.sub.params():
            t = torch.zeros(shape, dtype=torch_dtype(dtype))
            self.sub.register(name, t)
            self._staged.append((name, t))

    def _direct_end(self, step: int) -> None:
        if self.sub.version != step:
            return  # aborted: the data went to private tensors only
        try:
            self.protocol.begin()
            self._active = True
            self.protocol.load(self._staged)
            self.protocol.finish()
            self._active = False
        except BaseException as e:
            if self._active:
                self._active = False
                try:
                    self.protocol.abort()
                except BaseException:  # noqa: BLE001 - handled below
                    pass
            if getattr(self.protocol, "atomic", False):
                # The protocol changed nothing (or put everything back).
                self._restored = (step, f"version {self._version} (never left)")
                raise
            if self._previous is None:
                self._poison(step, f"applying it failed ({e}) and no previous version is kept")
                raise
            try:
                self.protocol.begin()
                self._active = True
                self.protocol.load(self._previous)
                self.protocol.finish()
                self._active = False
            except BaseException as e2:
                self._active = False
                self._poison(step, f"applying it failed ({e}), and so did restoring version "
                             f"{self._version} ({e2})")
                raise
            self._restored = (step, f"version {self._version} (kept in host memory)")
            raise
        self._version = step
        self._keep([(n, t.clone()) for n, t in self._staged] if self.keep_previous else None)
        if self._poisoned is not None:
            self._poisoned = None
            self.protocol.unpoison()

    # serving ------------------------------------------------------------------

    def update(self, timeout: float = 60.0, step: Optional[int] = None) -> Optional[dict]:
        """Waits up to `timeout` s for the next step and runs it (None: none began).

        Staged: waits up to `timeout` s for a step (with `step`: that step or
        a later one) to be decided on the background thread, and applies the
        newest committed version staged (None: none was decided)."""
        if self._stager is not None:
            return self._apply_staged(timeout, step)
        try:
            out = self.sub.run_step(timeout=timeout)
        except BaseException:
            # The coordinator was lost mid-step: on_end never ran.
            if self.protocol is not None and (self._active or self._touched):
                self._pending = None
                self._recover(-1)
            raise
        result = outcome_dict(out)
        if result is not None and self.parity:
            result["fp8"] = self.parity
        if result is not None and self.protocol is not None:
            self._report(result)
            if result["committed"] and self._version != result["step"]:
                result["committed"] = False
                result["reason"] = result["reason"] or "the engine did not take the step"
        if result is not None and result["committed"]:
            self._applied(result)
        return result

    def _applied(self, result: dict) -> None:
        """The engine serves the committed step of `result` from now on:
        "requests" (with live_requests: each request running at the swap ->
        the index of its first token made by the step), and the coordinator
        is told, so that `weightsync status` says since when (waiting at most
        2 s for it: the engine may be paused). A coordinator that cannot be
        told is logged, and the step stands."""
        requests: dict = {}
        if self.live_requests is not None:
            try:
                requests = {str(k): int(v) for k, v in self.live_requests().items()}
            except Exception as e:  # noqa: BLE001 - the step stands without them
                logger.warning("weightsync: the engine's running requests could not be read "
                               "at step %d: %s", result["step"], e)
            result["requests"] = requests
        try:
            self.sub.applied(result["step"], requests)
        except Exception as e:  # noqa: BLE001 - the step stands; status shows the last report
            logger.warning("weightsync: could not tell the coordinator that engine rank %d "
                           "serves step %d: %s", self.sub.global_rank, result["step"], e)

    def _apply_staged(self, timeout: float, step: Optional[int]) -> Optional[dict]:
        assert self._stager is not None
        result, tensors = self._stager.take(timeout, step)
        if result is None:
            return None
        result["staged"] = True
        if tensors is not None:
            start = time.monotonic()
            self._apply_version(result, tensors)
            result["apply_seconds"] = time.monotonic() - start
        self._report(result)
        if tensors is not None and result["committed"]:
            self._applied(result)
        return result

    def _report(self, result: dict) -> None:
        """What the engine holds after the step, in its outcome dict: its
        version, why it is poisoned, what a failed step's restore put back,
        and whether it is torn."""
        result["version"] = self._version
        if self._poisoned is not None:
            result["poisoned"] = self._poisoned
        if self._restored is not None and self._restored[0] == result["step"]:
            result["restored"] = self._restored[1]
        if not result["committed"]:
            settle_restored(result, result.get("restored"), self._poisoned)

    def _apply_version(self, result: dict, tensors: list) -> None:
        """Applies a staged version, agreed by every rank of the replica;
        else back to the version before (`result` says which and why)."""
        k = result["step"]
        error: Optional[BaseException] = None
        try:
            self._load_whole(tensors)
        except BaseException as e:  # noqa: BLE001 - reported in the outcome
            error = e
        why = None if error is None else f"applying step {k} failed: {error}"
        if self._agree is not None:
            try:
                if not self._agree(error is None) and why is None:
                    why = f"another rank of the replica failed to apply step {k}"
            except BaseException as e:  # noqa: BLE001 - reported in the outcome
                why = why or f"the ranks of the replica could not agree on step {k}: {e}"
        if why is None:
            self._commit(k, tensors)
            return
        # The engine took (part of) it: back to the version it held.
        self._touched = True
        try:
            self._recover(k)
        except BaseException as e2:  # noqa: BLE001 - poisoned by _recover
            why = f"{why}; restoring failed: {e2}"
        result["committed"] = False
        result["reason"] = why

    def _load_whole(self, tensors: list) -> None:
        """Hands one whole version to the protocol (begin, load, finish)."""
        self.protocol.begin()
        self._active = True
        for i in range(0, len(tensors), 64):
            self.protocol.load(tensors[i:i + 64])
        self.protocol.finish()
        self._active = False

    def start(self) -> None:
        """Serves steps on a background thread until stop()."""
        if self._stager is not None:
            return  # staged: the background thread runs from the start
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._serve, name="weightsync-engine", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while not self._stopping:
                out = self.update(timeout=0.2)
                if out is not None:
                    self._outcomes.append(out)
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
        if self._stager is not None:
            self._stager.close()
        self.sub.close()
