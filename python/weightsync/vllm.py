"""vLLM integration (tested against vLLM 0.32: docs/engines.md). vLLM is
imported only when a method needs it: `import weightsync` and
`import weightsync.vllm` work without it.

Every way in writes vLLM's weights through vLLM's own update protocol, the
layerwise reload (vllm/model_executor/model_loader/reload/), except where
vLLM's parameters are verified to be what its kernels read (then mode
"direct" writes them in place). A step that fails after the engine took part
of it is undone: the worker loads its last committed version again (kept in
host memory; before the first commit, the engine's own checkpoint), so no
worker serves a mix of versions; where even that fails the worker refuses to
generate (vLLM's forward raises) until the next committed step.

Two ways in:

1. vLLM's weight-transfer API. Installing weightsync registers the engine
   "weightsync" in every vLLM process (entry point `vllm.general_plugins`:
   `register_plugin`):

       llm = LLM(model=..., weight_transfer_config={"backend": "weightsync"})
       llm.init_weight_transfer_engine({"init_info": dict(
           coordinator="10.0.0.1:29600", engine="engine.json", replica=0)})
       ...  # each step k, while the trainers push it:
       llm.start_weight_update()
       llm.update_weights({"update_info": {"step": k, "timeout": 120.0}})
       llm.finish_weight_update(weight_version=str(k))
       llm.reset_prefix_cache()   # the KV cache holds what the old weights computed

   `update_weights` raises when the step did not commit (the engine is then
   on its previous version, and vLLM has ended the session on the worker
   that raised: do not call finish_weight_update there). `receive(llm,
   step)` does these four calls, and on a failed step raises weightsync's
   own error (vLLM passes on only its text) after ending every session.

   The trainer side of the same API (vLLM's TrainerWeightTransferEngine,
   registered as "weightsync" in WeightTransferTrainerFactory by the same
   entry point; WeightsyncTrainerInitInfo is in weightsync._vllm_trainer,
   docs/integrations/vllm.md) drives a server from the training loop, each
   rank pushing its own (FSDP2) shards with a weightsync.Publisher:

       engine = WeightTransferTrainerFactory.trainer_init(
           WeightsyncTrainerInitInfo(rank=rank), source=ModuleSource(model),
           client=HTTPVLLMWeightSyncClient("http://host:8000"))
       engine.send_weights()   # each step, on every trainer rank

   The trainer side stages by default: the workers receive each step on a
   background thread while the server serves (init_info "staged"), and the
   server stops only to apply it, with its prefix cache reset at the swap
   even under load (weightsync._vllm_server, docs/integrations/vllm.md).

2. A worker extension (vLLM's `worker_extension_cls`), driven with
   `collective_rpc`:

       llm = LLM(model=..., worker_extension_cls="weightsync.vllm.WorkerExtension")
       llm.collective_rpc("weightsync_connect", kwargs=dict(
           coordinator="10.0.0.1:29600", engine="engine.json", replica=0))
       ...  # each step, while the trainers push it:
       update(llm, timeout=120.0)   # collective_rpc("weightsync_update") + cache reset

The engine config's group for this replica says what travels: framework
"hf" (every HF tensor whole, handed to the model's `load_weights`: mode
"load_weights", any model vLLM supports), or "vllm" (vLLM's own fused and
sliced layout: mode "direct"; on vLLM's CPU backend and wherever kernels
repack, received into private tensors and reloaded through the protocol,
with a warning). `mode` may force either.
"""

from __future__ import annotations

from typing import Any, Optional

from ._errors import Error
from ._vllm_common import (ENGINE_NAME, _live_requests, _lora_close, _lora_connect,
                           _lora_sync, _tp_rank, marked, worker_error)

__all__ = ["WorkerExtension", "connect_lora", "lora_request", "receive", "receive_lora",
           "register_plugin", "register_weight_transfer_engine", "update",
           "weight_transfer_engine_class", "worker_error"]

class WorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`): the worker's
    `model_runner.model` stays in sync with the trainers. Methods are called
    on every worker with `llm.collective_rpc(name, kwargs=...)`."""

    def weightsync_tp_rank(self) -> int:
        """This worker's rank inside its replica (vLLM's tensor-parallel rank)."""
        return _tp_rank()

    def weightsync_connect(self, coordinator: str, engine: Any, replica: int,
                           mode: Optional[str] = None, keep_previous: bool = True,
                           **options: Any) -> dict:
        """Joins the weightsync job as rank (replica, tp rank). `engine`: the
        engines' config (path, dict or JSON); `mode`: "load_weights" or
        "direct" (None: from the replica's framework, "hf" -> load_weights);
        `keep_previous`: keep the last committed version in host memory to
        undo a failed step; `staged=True` (in options): receive each step on
        a background thread while vLLM serves, weightsync_update applies it;
        `options`: Subscriber options (transport, token,
        job, timeouts, weights_device). Returns {"global_rank", "mode",
        "protocol" (vLLM's layerwise reload is used), "fallback" (why direct
        mode does, or None)}."""
        from ._vllm_reload import connect

        self.weightsync_close()
        runner = self.model_runner
        self._weightsync = connect(runner.model, getattr(runner, "model_config", None),
                                   getattr(self, "vllm_config", None), coordinator, engine,
                                   replica, self.weightsync_tp_rank(), mode,
                                   keep_previous=keep_previous, **options)
        sync = self._weightsync
        # At each apply: the requests this worker runs, for "requests".
        sync.live_requests = lambda: _live_requests(self)
        return {"global_rank": sync.sub.global_rank, "mode": sync.mode,
                "protocol": sync.protocol is not None, "fallback": sync.fallback_reason}

    def _weightsync_sync(self):
        sync = getattr(self, "_weightsync", None)
        if sync is None:
            raise Error("invalid_argument", "weightsync_connect was not called on this worker")
        return sync

    def weightsync_update(self, timeout: float = 120.0,
                          step: Optional[int] = None) -> Optional[dict]:
        """Runs the next weight update (waits up to `timeout` s for it to
        begin): {"step", "committed", "reason", "bytes", "delta_buckets", "weights_handed",
        "seconds", "version" (and "restored" / "poisoned" after a failed step)}, or None.
        Connected with staged=True: waits for the next step (with `step`: that
        one) to be received on the background thread and applies it
        ("staged": True, "apply_seconds")."""
        try:
            return self._weightsync_sync().update(timeout, step=step)
        except Error as e:
            raise marked(e) from e  # vLLM passes on only the text: update() reads it back

    def weightsync_start(self) -> None:
        """Serves weight updates on a background thread until weightsync_stop.
        Only for in-place direct mode: vLLM runs forward passes meanwhile, and
        its update protocol must not run beside them."""
        sync = self._weightsync_sync()
        if sync.protocol is not None:
            raise Error("unsupported", "weightsync_start: this worker updates through vLLM's "
                        "layerwise reload, which must not run beside forward passes; call "
                        "weightsync_update through collective_rpc (it runs between engine steps)")
        sync.start()

    def weightsync_stop(self) -> list:
        return self._weightsync_sync().stop()

    def weightsync_version(self) -> int:
        """The last committed step this worker holds whole, -1 before the
        first (also for the "weightsync" weight-transfer engine)."""
        sync = getattr(self, "_weightsync", None)
        if sync is None:
            engine = getattr(self, "weight_transfer_engine", None)
            if engine is not None and hasattr(engine, "version"):
                return engine.version
            raise Error("invalid_argument", "weightsync_connect was not called on this worker")
        return sync.version

    def weightsync_close(self) -> None:
        sync = getattr(self, "_weightsync", None)
        if sync is not None:
            sync.close()
            self._weightsync = None

    # LoRA adapters (docs/lora.md) ------------------------------------------

    def weightsync_lora_connect(self, coordinator: str, engine: Any, replica: int = 0,
                                **options: Any) -> dict:
        """Joins the adapter job of `engine` (weightsync.lora.engine_config:
        its field "lora" names the adapter) as rank (replica, tp rank);
        reconnecting an adapter replaces its connection. Checks the adapter
        against this engine's LoRA config and base model first. Returns
        {"name", "id", "global_rank"}."""
        try:
            adapters = self.__dict__.setdefault("_weightsync_loras", {})
            _, sync = _lora_connect(adapters, self.model_runner.model,
                                    getattr(self, "vllm_config", None), coordinator, engine,
                                    replica, self.weightsync_tp_rank(), options)
            return {"name": sync.protocol.name, "id": sync.protocol.id,
                    "global_rank": sync.sub.global_rank}
        except Error as e:
            raise marked(e) from e

    def weightsync_lora_update(self, name: str, timeout: float = 120.0) -> Optional[dict]:
        """Runs adapter `name`'s next step (waits up to `timeout` s for it to
        begin): weightsync_update's outcome, or None."""
        try:
            return _lora_sync(self.__dict__.get("_weightsync_loras", {}), name).update(timeout)
        except Error as e:
            raise marked(e) from e

    def weightsync_lora_version(self, name: str) -> int:
        """The last step of adapter `name` this worker serves, -1 before the first."""
        return _lora_sync(self.__dict__.get("_weightsync_loras", {}), name).version

    def weightsync_lora_close(self, name: Optional[str] = None) -> None:
        """Leaves adapter `name`'s job (None: every adapter's). The worker
        keeps serving the adapter's last version."""
        _lora_close(self.__dict__.get("_weightsync_loras", {}), name)


def connect_lora(llm: Any, coordinator: str, engine: Any, replica: int = 0,
                 **options: Any) -> list:
    """Connects every worker of `llm` (started with enable_lora=True and
    worker_extension_cls="weightsync.vllm.WorkerExtension") to the adapter
    job of `engine` (weightsync.lora.engine_config). Raises weightsync's
    error when the adapter does not fit the engine (rank, target modules,
    base model, no slot). Returns each worker's {"name", "id", "global_rank"}."""
    try:
        return llm.collective_rpc("weightsync_lora_connect", kwargs=dict(
            coordinator=coordinator, engine=engine, replica=replica, **options))
    except Exception as e:  # noqa: BLE001 - turned into weightsync's own error
        raise worker_error(e, "weightsync_lora_connect") from e


def receive_lora(llm: Any, name: str, step: Optional[int] = None, timeout: float = 120.0,
                 reset_prefix_cache: bool = True) -> dict:
    """Adapter `name`'s next step in every worker of `llm` (connected with
    connect_lora): once committed, requests naming the adapter
    (lora_request(engine)) see the new version; requests without it and
    other adapters are untouched. The prefix cache is reset (vLLM keys it
    by the adapter's name and path, not its weights). Returns {"name",
    "step", "version", "bytes", "seconds", "workers"}; a step that did not
    commit raises weightsync.Error and the engine serves the version before."""
    try:
        outs = llm.collective_rpc("weightsync_lora_update", kwargs={"name": name,
                                                                     "timeout": timeout})
    except Exception as e:  # noqa: BLE001 - turned into weightsync's own error
        if reset_prefix_cache:
            llm.reset_prefix_cache()
        raise worker_error(e, "weightsync_lora_update") from e
    if reset_prefix_cache:
        llm.reset_prefix_cache()
    if any(o is None for o in outs):
        raise Error("timeout", f"adapter {name!r}: no step began within {timeout} s on "
                    f"{sum(o is None for o in outs)} of {len(outs)} workers")
    failed = [(r, o) for r, o in enumerate(outs) if not o["committed"]]
    steps = sorted({o["step"] for o in outs})
    if failed or len(steps) != 1:
        r, o = failed[0] if failed else (0, outs[0])
        raise Error("peer_failure", f"adapter {name!r}: step {o['step']} was not committed on "
                    f"tensor-parallel rank {r}: {o.get('reason') or 'steps ' + str(steps)} (it "
                    f"serves version {o.get('version')})")
    if step is not None and steps[0] != step:
        raise Error("mismatch", f"adapter {name!r}: expected step {step}, the trainers pushed "
                    f"step {steps[0]} (now the adapter's version)")
    return {"name": name, "step": steps[0], "version": outs[0]["version"],
            "bytes": sum(o["bytes"] for o in outs), "seconds": max(o["seconds"] for o in outs),
            "workers": outs}


def lora_request(engine_or_adapter: Any, path: Optional[str] = None) -> Any:
    """vLLM's LoRARequest for a synced adapter (the adapter job's engine
    config, or its "lora" field): its name and id."""
    from ._vllm_lora import lora_request as make

    return make(engine_or_adapter, path)


def update(llm: Any, timeout: float = 120.0, reset_prefix_cache: bool = True) -> dict:
    """The worker extension's step, from the process that owns `llm`: every
    worker runs the next weightsync step; when all committed it, the prefix
    cache is reset (its KV came from the old weights) and vLLM's weight
    version set to the step. Returns {"step", "committed", "workers": [each
    worker's outcome], "requests"}; raises weightsync.Error when no step
    began. "requests": each request the engine ran at the apply (vLLM's
    request id) -> the index of its first output token made by the step
    (the first worker's; docs/integrations/vllm.md)."""
    try:
        outs = llm.collective_rpc("weightsync_update", kwargs={"timeout": timeout})
    except Exception as e:  # noqa: BLE001 - turned into weightsync's own error
        raise worker_error(e, "weightsync_update") from e
    if any(o is None for o in outs):
        raise Error("timeout", f"no weight update began within {timeout} s on "
                    f"{sum(o is None for o in outs)} of {len(outs)} workers")
    steps = {o["step"] for o in outs}
    committed = all(o["committed"] for o in outs) and len(steps) == 1
    if reset_prefix_cache:
        llm.reset_prefix_cache()
    if committed:
        _set_version(llm, outs[0]["step"])
    return {"step": outs[0]["step"], "committed": committed, "workers": outs,
            "requests": outs[0].get("requests")}


def receive(llm: Any, step: Optional[int] = None, timeout: float = 120.0,
            reset_prefix_cache: bool = True, adapter: Optional[str] = None) -> None:
    """One step through vLLM's weight-transfer API (backend "weightsync"):
    start_weight_update, update_weights, finish_weight_update with the step as
    weight version, then the prefix-cache reset.

    A step that did not commit raises the weightsync.Error of the worker that
    failed it, with its code, naming the step, its engine rank and the
    reason (vLLM passes on only the text, inside its own message). The
    engine keeps its version; its update session is over (vLLM >= 0.32 ends
    it on every worker whose update_weights raised, and weightsync fails a
    step on every rank of a replica), and the prefix cache is reset all the
    same. With `adapter`, the step is that LoRA adapter's (init_info
    "adapters", docs/lora.md): vLLM's weight version stays the model's."""
    llm.start_weight_update()
    info: dict = {"timeout": timeout}
    if step is not None:
        info["step"] = step
    if adapter is not None:
        info["adapter"] = adapter
    try:
        llm.update_weights({"update_info": info})
    except Exception as e:  # noqa: BLE001 - turned into weightsync's own error
        error = worker_error(e, "update_weights")
        if reset_prefix_cache:
            llm.reset_prefix_cache()
        raise error from e
    llm.finish_weight_update(weight_version=None if step is None or adapter is not None
                             else str(step))
    if reset_prefix_cache:
        llm.reset_prefix_cache()


def _set_version(llm: Any, step: int) -> None:
    setter = getattr(llm, "update_weight_version", None)
    if setter is not None:
        setter(str(step))


def weight_transfer_engine_class() -> type:
    """weightsync's vLLM WeightTransferEngine (needs vLLM >= 0.32)."""
    try:
        from ._vllm_transfer import WeightsyncTransferEngine
    except ImportError as e:
        raise Error("unsupported", "the installed vLLM has no weight-transfer engine interface "
                    f"(vllm.distributed.weight_transfer.base, vLLM >= 0.32): {e}") from None
    return WeightsyncTransferEngine


def register_weight_transfer_engine(name: str = ENGINE_NAME) -> None:
    """Registers weightsync with vLLM's WeightTransferEngineFactory (the
    workers' side) and, where vLLM has it, WeightTransferTrainerFactory (the
    trainer's side: weightsync._vllm_trainer, docs/integrations/vllm.md)
    under `name` in this process (lazily: the engine module is imported when
    vLLM creates the engine). Idempotent. vLLM creates engines inside its
    worker processes: installing weightsync does this in every vLLM process
    (the `vllm.general_plugins` entry point); a trainer process, where vLLM
    loads no plugins, gets it by importing weightsync._vllm_trainer (or by
    calling this); call it yourself only where the package is not installed
    (e.g. a source checkout on sys.path)."""
    try:
        from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    except ImportError as e:
        raise Error("unsupported", "the installed vLLM has no weight-transfer engine registry "
                    f"(vllm.distributed.weight_transfer, vLLM >= 0.32): {e}") from None
    if name not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(name, "weightsync._vllm_transfer",
                                                    "WeightsyncTransferEngine")
    try:
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
    except ImportError:  # a vLLM with the workers' API only
        return
    if name not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(name, "weightsync._vllm_trainer",
                                                     "WeightsyncTrainerEngine")


def register_plugin() -> None:
    """The `vllm.general_plugins` entry point: vLLM calls it in every process
    it starts (front end, engine core, workers). Registers both sides of
    backend "weightsync": the workers' engine and the trainer's."""
    try:
        register_weight_transfer_engine()
    except Error:
        pass  # a vLLM without the weight-transfer API: nothing to register
