"""SGLang integration (tested against SGLang 0.5.23). SGLang is never imported
by `import weightsync.sglang`; only the functions that talk to a running
engine import it.

The way in: SGLang's own RL weight-update protocol. SGLang runs every weight
update inside its scheduler, between batches, in a session: begin_weight_update()
(kernels' packed weights go back to their loading layout), one or more
update_weights_from_tensor(...) calls (the model's own `load_weights`), then
end_weight_update() (process_weights_after_loading per layer); each update
flushes the radix cache, whose KV the old weights computed. weightsync plugs in
as one of SGLang's custom weight loaders (`--custom-weight-loader`):

    import sglang, weightsync.sglang as wsg
    engine = sglang.Engine(model_path=..., tp_size=2, **wsg.engine_args())
    wsg.connect(engine, coordinator="10.0.0.1:29600", engine_config=E, replica=0)
    ...                                   # after (or while) the trainers push a step:
    out = wsg.update(engine, timeout=120) # {"step", "committed", "version", "ranks": [...]}

`update` opens the session, asks every tensor-parallel scheduler to run one
weightsync step (its weights arrive over weightsync's transport, whole HF
tensors, and go through the model's own `load_weights`, so every layout,
padding and fusing of the installed SGLang is the engine's own), closes the
session, lets SGLang flush its cache, and sets SGLang's weight version
(`engine.get_model_info()["weight_version"]`, and each request's
`meta_info["weight_version"]`) to the committed step. E is the engines'
weightsync config, with `"framework": "hf"` for this engine group (every rank
receives whole HF tensors). A step that fails after its first tensors were
loaded (a trainer died, a timeout) is undone on each rank from a snapshot of
the rank's parameters taken before its first write, and ranks that committed
a step the others did not go back to the version before it (the replica
serves the previous version, bit for bit); `update` then returns
committed=False. docs/engines.md says more.

LoRA adapters (docs/lora.md): `connect_lora(engine, coordinator, E)` with an
adapter job's config (weightsync.lora.engine_config, tp=1) returns a
LoraSync whose receive(step) takes each committed version into SGLang's
LoRA manager through SGLang's own load_lora_adapter_from_tensors; requests
name it with `lora_path=<adapter name>`.

`WorkerSync` is the per-worker object underneath, usable from any code that
runs inside an SGLang scheduler process (mode "load_weights" as above, or
"direct": SGLang's fused parameters written in place, with a framework
"sglang" engine config; writes outside SGLang's update session bypass its
cache flush and kernel repacking, so prefer the loader above).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import traceback
import uuid
from types import SimpleNamespace
from typing import Any, Optional

from ._engine import EngineSync, outcome_dict
from ._errors import Error
from ._sglang_control import _pause

__all__ = ["LOADER", "WorkerSync", "close", "connect", "connect_lora", "engine_args", "tp_rank",
           "update", "weight_loader"]

#: The import path SGLang calls as a custom weight loader (`load_format`).
LOADER = "weightsync.sglang.weight_loader"
#: The name of the one control tensor in the requests weightsync sends.
_CONTROL = "weightsync"

_log = logging.getLogger("weightsync.sglang")


def tp_rank(model_runner: Any = None) -> int:
    """This SGLang worker's tensor-parallel rank: `model_runner.tp_rank`
    where the runner has one, else SGLang's runtime context
    (`get_parallel().tp_rank`, SGLang 0.5.2x)."""
    rank = getattr(model_runner, "tp_rank", None)
    if isinstance(rank, int):
        return rank
    try:
        from sglang.srt.runtime_context import get_parallel
    except ImportError as e:
        raise Error("unsupported", "cannot tell this SGLang worker's tensor-parallel rank: the "
                    "model runner has no tp_rank and sglang.srt.runtime_context.get_parallel is "
                    f"not importable ({e}); pass rank=") from None
    return int(get_parallel().tp_rank)


class WorkerSync(EngineSync):
    """One SGLang tensor-parallel worker's model, in sync with the trainers.

    mode "load_weights" (an engine group of framework "hf"): whole HF tensors
    go to `model.load_weights(batch)` as buckets complete them. With
    `restore` (the default), the first write of each step snapshots the
    rank's parameters (on `snapshot_device`, default: where they are; "cpu"
    saves accelerator memory); a step that does not commit here copies them
    back and reruns the model's `post_load_weights()` (e.g. DeepSeek MLA's
    w_kc/w_vc), so the rank keeps the previous version. The snapshot of a
    committed step is held until the next step begins: `revert(step)` puts
    it back when the other tensor-parallel ranks did not commit that step
    (weightsync.sglang.update does), so that no replica serves two versions.
    `version` is the version the model holds. With `changed_only` (the
    default) a delta sync step (docs/delta.md) loads only the tensors that
    may have changed since that version; SGLang's update session keeps the
    others as they are.

    mode "direct" (framework "sglang"): SGLang's own parameters are
    registered and written in place; pass staging=True so that a failed step
    changes nothing.
    """

    def __init__(self, model_runner: Any, coordinator: Any, engine: Any, replica: int,
                 mode: str = "direct", rank: Optional[int] = None, restore: bool = True,
                 snapshot_device: Any = None, changed_only: bool = True, **options: Any):
        model = model_runner.model
        rank = tp_rank(model_runner) if rank is None else rank
        super().__init__(model, coordinator, engine, replica, rank, mode=mode, **options)
        self.rank = rank
        self._keep_snapshot = restore and mode == "load_weights"
        self._snapshot_device = snapshot_device
        self._snapshot: Optional[dict] = None
        # (step, the snapshot taken before it, the version before it) of the
        # last committed step, until the next begins.
        self._held: Optional[tuple] = None
        self._batches = 0
        self._served = -1  # load_weights mode: the version the model holds
        self._began: Optional[int] = None  # the step that began in this update()
        #: What the last step did to the model: {"step", "batches" (load_weights
        #: calls), "restored" (a failed step was undone)}.
        self.last_step: dict = {}
        #: Why the model holds a mix of versions (a failed step could not be
        #: undone), or None.
        self.mixed: Optional[str] = None
        if mode == "load_weights":
            self.sub.on_begin(self._on_begin)
            self.sub.on_weights(self._on_weights, changed_only=changed_only)
            self.sub.on_end(self._on_end)

    @property
    def version(self) -> int:
        """The version this rank's model holds (-1: the one it started with)."""
        return self._served if self.mode == "load_weights" else self.sub.version

    # Hooks: the weightsync step calls them on this rank.
    def _on_begin(self, step: int) -> None:
        self._held = None  # the previous step stands: its snapshot goes
        self._snapshot = None
        self._batches = 0
        self._began = step
        self.last_step = {"step": step, "batches": 0, "restored": False}

    def _on_weights(self, batch: list) -> None:
        import torch

        with torch.no_grad():  # hooks may run on a thread of weightsync's own
            if self._keep_snapshot and self._snapshot is None:
                self._snapshot = self._take_snapshot()
            self._batches += 1
            self.last_step["batches"] = self._batches
            self.model.load_weights(batch)

    def _on_end(self, step: int) -> None:
        committed = self.sub.version == step
        snapshot, self._snapshot = self._snapshot, None
        loaded, self._batches = self._batches, 0
        if committed:
            if snapshot is not None:
                self._held = (step, snapshot, self._served)
            self._served = step
            self.mixed = None
            return
        if loaded == 0:
            return  # nothing of the step reached the model
        if snapshot is None:
            self.mixed = (f"step {step} failed after the model loaded part of it, and "
                          f"restore=False: SGLang rank {self.rank} holds a mix of versions until "
                          "the next committed step")
            raise Error("cancelled", self.mixed)
        try:
            self._put_back(snapshot)
        except BaseException as e:
            self.mixed = (f"step {step} failed after the model loaded part of it, and restoring "
                          f"version {self._served} failed ({e}): SGLang rank {self.rank} holds "
                          "a mix of versions until the next committed step")
            raise
        self.last_step["restored"] = True
        _log.warning("weightsync: step %d did not commit on SGLang rank %d; restored the "
                     "parameters of version %d", step, self.rank, self._served)

    def revert(self, step: int) -> bool:
        """Puts back the parameters from before committed step `step` (the
        other ranks of the replica did not commit it). False when this rank
        did not commit `step` (nothing to do)."""
        if self._held is None or self._held[0] != step:
            if self._served == step:
                raise Error("cancelled", f"SGLang rank {self.rank} cannot revert step {step}: "
                            "no snapshot of the version before it is held (restore=False)")
            return False
        _, snapshot, previous = self._held
        self._held = None
        self._put_back(snapshot)
        self._served = previous
        _log.warning("weightsync: step %d committed on SGLang rank %d but not on every rank; "
                     "reverted to version %d", step, self.rank, previous)
        return True

    def _take_snapshot(self) -> dict:
        device = self._snapshot_device
        return {name: (p.detach().to(device, copy=True) if device is not None
                       else p.detach().clone())
                for name, p in self.model.named_parameters()}

    def _put_back(self, snapshot: dict) -> None:
        import torch

        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.data.copy_(snapshot[name])
            post = getattr(self.model, "post_load_weights", None)
            if callable(post):  # derived weights (SGLang's loaders call it the same way)
                post()

    def update(self, timeout: float = 60.0, step: Optional[int] = None) -> Optional[dict]:
        """Waits up to `timeout` s for the next step and runs it (None: none
        began; `step` is for staged engines, which SGLang's are not yet); in load_weights mode the outcome also says how many
        load_weights calls the step made ("batches"), whether a failed step
        was undone ("restored") and, if it could not be, why the model is
        mixed ("mixed"). A step that times out here after it began (waiting
        for data or for the coordinator's decision) is a failed step."""
        self._began = None
        try:
            out = super().update(timeout, step)
        except Error as e:
            if self.mode != "load_weights" or self._began is None:
                raise
            # The step began but never ended here (a timeout, or the
            # coordinator was lost): the model goes back to its version.
            if self._batches > 0 or self._snapshot is not None:
                self._on_end(-2)
            if e.code != "timeout":
                raise
            out = {"step": self._began, "committed": False, "reason": str(e), "bytes": 0,
                   "delta_buckets": 0, "weights_handed": 0, "seconds": 0.0}
        if out is not None and self.mode == "load_weights":
            if out["committed"] and self._served != out["step"]:
                out.update(committed=False, reason=out["reason"] or "the model did not take it")
            out.update(batches=self.last_step.get("batches", 0),
                       restored=self.last_step.get("restored", False), mixed=self.mixed)
        return out


# ---- inside SGLang's scheduler processes: the custom weight loader ----------

class _State:
    sync: Optional[WorkerSync] = None
    model: Any = None
    handled: set = set()


def weight_loader(model: Any, named_tensors: list) -> None:
    """SGLang's custom weight loader (`--custom-weight-loader
    weightsync.sglang.weight_loader`, then `load_format=` that name): called
    by every tensor-parallel scheduler inside update_weights_from_tensor,
    with the target model. The one tensor "weightsync" holds a JSON request
    from connect / update / close, whose result this rank writes as
    `<results>/rank<r>.json`. Never raises (an exception would end SGLang's
    scheduler): errors go into the result."""
    for name, tensor in named_tensors:
        if name != _CONTROL:
            _log.warning("weightsync.sglang.weight_loader: ignoring tensor %r (weightsync "
                         "moves the weights itself)", name)
            continue
        try:
            request = json.loads(bytes(tensor.cpu().numpy().tobytes()).decode())
        except Exception as e:  # noqa: BLE001 - never raise into the scheduler
            _log.error("weightsync.sglang.weight_loader: unreadable request: %s", e)
            continue
        if request.get("id") in _State.handled:
            continue  # the same request for a draft model (speculative decoding)
        _State.handled.add(request.get("id"))
        rank = -1
        try:
            rank = tp_rank()
            result = _serve(model, request, rank)
        except BaseException as e:  # noqa: BLE001 - reported to the caller of update()
            result = {"error": f"{type(e).__name__}: {e}",
                      "code": getattr(e, "code", "internal"),
                      "traceback": traceback.format_exc()}
        result["rank"] = rank
        _write_result(request.get("results"), rank, result)


def _serve(model: Any, request: dict, rank: int) -> dict:
    op = request.get("op")
    if op == "connect":
        _close()
        new = WorkerSync(SimpleNamespace(model=model), request["coordinator"], request["engine"],
                         int(request.get("replica", 0)), mode=request.get("mode", "load_weights"),
                         rank=rank, **request.get("options", {}))
        _State.sync, _State.model = new, model
        return {"op": op, "mode": new.mode, "global_rank": new.sub.global_rank,
                "version": new.version}
    if op == "close":
        _close()
        return {"op": op}
    sync: Optional[WorkerSync] = _State.sync
    if sync is None:
        raise Error("invalid_argument", "weightsync.sglang: this engine is not connected "
                    "(call weightsync.sglang.connect(engine, ...) first)")
    if op == "update":
        out = sync.update(timeout=float(request.get("timeout", 60.0)))
        return {"op": op, "version": sync.version, "outcome": out}
    if op == "revert":
        reverted = sync.revert(int(request["step"]))
        return {"op": op, "version": sync.version, "reverted": reverted}
    if op == "status":
        return {"op": op, "version": sync.version, "mode": sync.mode}
    raise Error("invalid_argument", f"weightsync.sglang: unknown request {op!r}")


def _close() -> None:
    sync, _State.sync, _State.model = _State.sync, None, None
    if sync is not None:
        sync.close()


def _write_result(directory: Optional[str], rank: int, result: dict) -> None:
    if not directory:
        return
    path = os.path.join(directory, f"rank{rank}.json")
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(path + ".tmp", path)
    except OSError as e:
        _log.error("weightsync.sglang: cannot write %s: %s", path, e)


# ---- where the sglang.Engine lives: the driver side --------------------------

def engine_args() -> dict:
    """The sglang.Engine / ServerArgs arguments weightsync needs:
    `sglang.Engine(..., **engine_args())` (on the command line:
    `--custom-weight-loader weightsync.sglang.weight_loader`)."""
    return {"custom_weight_loader": [LOADER]}


def connect(engine: Any, coordinator: Any, engine_config: Any, replica: int = 0,
            mode: str = "load_weights", **options: Any) -> list:
    """Connects every tensor-parallel rank of `engine` (an sglang.Engine
    started with engine_args()) to the weightsync job as replica `replica`
    of `engine_config` (a dict, JSON text, or a path readable by the engine's
    processes). `options`: WorkerSync's (restore, snapshot_device,
    changed_only) and Subscriber options (transport, token, job,
    connect_timeout, step_timeout, staging). Returns each rank's {"rank", "global_rank", "version", "mode"}."""
    address = getattr(coordinator, "address", coordinator)
    if not isinstance(engine_config, (dict, list)):
        text = os.fspath(engine_config)
        if not text.lstrip().startswith(("{", "[")):
            text = os.path.abspath(text)  # the schedulers may run elsewhere in the tree
        engine_config = text
    request = {"op": "connect", "coordinator": address, "engine": engine_config,
               "replica": replica, "mode": mode, "options": options}
    results, _ = _call(engine, request, flush_cache=False)
    return results


def update(engine: Any, timeout: float = 120.0, flush_cache: bool = True,
           set_weight_version: bool = True) -> dict:
    """Runs the next weightsync step inside `engine`'s schedulers, in
    SGLang's weight-update session (generation waits meanwhile): waits up to
    `timeout` s for the trainers to begin it, loads it through the model's
    load_weights, post-processes, flushes the radix cache (`flush_cache`),
    and, once every rank committed, sets SGLang's weight version to the
    step. Ranks that committed a step the others did not are reverted to
    the version before it ("reverted": their ranks). Returns {"step" (None:
    no step began), "committed", "version" (the version every rank serves
    now), "ranks": [each rank's outcome, with "batches" and "restored"],
    "message" (SGLang's)}. Raises weightsync.Error when a rank's model is
    left mixed (restore=False, or a restore failed), naming the step, the
    rank and why the step failed there: generation is then paused until a
    step commits on every rank."""
    results, message = _call(engine, {"op": "update", "timeout": timeout},
                             flush_cache=flush_cache)
    outcomes = [r.get("outcome") for r in results]
    steps = {o["step"] for o in outcomes if o is not None}
    if len(steps) > 1:
        raise Error("protocol", f"SGLang's ranks ran different steps: {sorted(steps)}")
    step = next(iter(steps)) if steps else None
    versions = {r["version"] for r in results}
    committed = step is not None and all(o is not None and o["committed"] for o in outcomes)
    out = {"step": step, "committed": committed, "version": min(versions), "ranks": results,
           "message": message}
    if not committed and any(o is not None and o["committed"] for o in outcomes):
        # Some ranks committed the step, others did not (weightsync commits
        # each engine rank on its own): those go back to the version before
        # it, so that the replica serves one version.
        try:
            reverted, message = _call(engine, {"op": "revert", "step": out["step"]},
                                      flush_cache=flush_cache)
        except Error:
            _pause(engine, True)
            raise
        out["reverted"] = [r["rank"] for r in reverted if r["reverted"]]
        versions = {r["version"] for r in reverted}
        out["version"] = min(versions)
    mixed = [(r["rank"], r["outcome"]) for r in results
             if r.get("outcome") is not None and r["outcome"].get("mixed")]
    if mixed:
        # No rank may serve what it holds: generation waits (SGLang's
        # pause_generation) until a step commits on every rank.
        _pause(engine, True)
        rank, outcome = mixed[0]
        more = f" ({len(mixed) - 1} more ranks too)" if len(mixed) > 1 else ""
        why = outcome.get("reason") or "no reason given"
        if outcome["mixed"] not in why:  # the on_end hook's failure says it already
            why += f"; {outcome['mixed']}"
        raise Error("cancelled", f"weightsync: step {outcome['step']} was not committed on SGLang "
                    f"rank {rank}: {why}{more}; generation is paused until then")
    if len(versions) > 1:
        raise Error("protocol", f"SGLang's ranks hold different versions after a step: {out}")
    if committed:
        if set_weight_version:
            _set_weight_version(engine, str(out["version"]))
        _pause(engine, False)
    return out


def connect_lora(engine: Any, coordinator: Any, engine_config: Any, replica: int = 0,
                 **options: Any) -> Any:
    """A LoraSync (weightsync._sglang_lora) of `engine` (an sglang.Engine
    started with enable_lora=True) for the adapter job of `engine_config`,
    as replica `replica`; refuses an adapter the engine cannot serve (rank,
    target modules, base model). `options`: Subscriber options."""
    from ._sglang_lora import LoraSync

    return LoraSync(engine, getattr(coordinator, "address", coordinator), engine_config,
                    replica, **options)


def close(engine: Any) -> None:
    """Disconnects every rank of `engine` from the weightsync job."""
    _call(engine, {"op": "close"}, flush_cache=False)


def _call(engine: Any, request: dict, flush_cache: bool) -> tuple:
    """One request to every rank, in one SGLang weight-update session."""
    import torch

    directory = tempfile.mkdtemp(prefix="weightsync-sglang-")
    try:
        request = {**request, "id": uuid.uuid4().hex, "results": directory}
        data = bytearray(json.dumps(request).encode())
        payload = torch.frombuffer(data, dtype=torch.uint8).clone()
        _ok(engine.begin_weight_update(), "begin_weight_update")
        try:
            success, message = _pair(engine.update_weights_from_tensor(
                named_tensors=[(_CONTROL, payload)], load_format=LOADER, flush_cache=flush_cache))
        except BaseException:
            # The session ends all the same; a failure to end it must not
            # hide why the update failed.
            try:
                engine.end_weight_update()
            except Exception as e:  # noqa: BLE001 - logged, the first failure is raised
                _log.warning("weightsync: SGLang's end_weight_update after a failed update "
                             "failed too: %s", e)
            raise
        ended = engine.end_weight_update()
        # The ranks' own errors (weightsync's, naming the rank and why) come
        # before SGLang's about the session.
        results = _read_results(engine, directory, request["op"])
        _ok(ended, "end_weight_update")
        if not success:
            if "custom" in message.lower() or "load_format" in message:
                message += " (was the engine started with **weightsync.sglang.engine_args()?)"
            raise Error("cancelled", f"SGLang's update_weights_from_tensor failed: {message}")
        return results, message
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _read_results(engine: Any, directory: str, op: str) -> list:
    tp = getattr(getattr(engine, "server_args", None), "tp_size", None)
    names = sorted(os.listdir(directory), key=lambda n: (len(n), n))
    results = []
    for name in names:
        if name.startswith("rank") and name.endswith(".json"):
            with open(os.path.join(directory, name)) as f:
                results.append(json.load(f))
    if tp is not None and len(results) != tp:
        raise Error("internal", f"weightsync.sglang {op}: {len(results)} of {tp} ranks answered "
                    "(was the engine started with **weightsync.sglang.engine_args(), and do "
                    "its schedulers run on this host?)")
    errors = [r for r in results if "error" in r]
    if errors:
        first = errors[0]
        raise Error(first.get("code") or "internal",
                    f"weightsync.sglang {op} failed on rank {first['rank']}: {first['error']}")
    return sorted(results, key=lambda r: r["rank"])


def _pair(value: Any) -> tuple:
    if isinstance(value, tuple) and len(value) >= 2:
        return bool(value[0]), str(value[1])
    return True, str(value)


def _ok(value: Any, what: str) -> None:
    success, message = _pair(value)
    if not success:
        raise Error("cancelled", f"SGLang's {what} failed: {message}")


def _set_weight_version(engine: Any, version: str) -> None:
    """SGLang's weight version (what get_server_info and every request's
    meta_info report), without aborting requests."""
    manager, loop = getattr(engine, "tokenizer_manager", None), getattr(engine, "loop", None)
    if manager is not None and loop is not None and hasattr(manager, "update_weight_version"):
        from sglang.srt.managers.io_struct import UpdateWeightVersionReqInput

        loop.run_until_complete(manager.update_weight_version(
            UpdateWeightVersionReqInput(new_version=version, abort_all_requests=False)))
        return
    request = getattr(engine, "_make_request", None)  # sglang's HttpServerEngineAdapter
    if callable(request):
        request("update_weight_version", {"new_version": version, "abort_all_requests": False})
