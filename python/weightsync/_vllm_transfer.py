"""weightsync as a vLLM weight-transfer engine (vLLM >= 0.32), registered as
"weightsync" in every vLLM process by the `vllm.general_plugins` entry point
(weightsync.vllm:register_plugin). Imports vLLM: vLLM's factory imports this
module, by name, when an engine is created with
`weight_transfer_config={"backend": "weightsync"}`.

    llm = LLM(model=..., weight_transfer_config={"backend": "weightsync"})
    llm.init_weight_transfer_engine({"init_info": {"coordinator": "10.0.0.1:29600",
                                                   "engine": engine_json, "replica": 0}})
    # each RL step, while the trainers push step k:
    llm.start_weight_update()
    llm.update_weights({"update_info": {"step": k, "timeout": 120.0}})
    llm.finish_weight_update(weight_version=str(k))
    llm.reset_prefix_cache()   # KV computed with the old weights
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Optional

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from ._errors import Error
from ._vllm_common import _live_requests, _lora_close, _lora_connect, _lora_sync, marked


@dataclass
class WeightsyncInitInfo(WeightTransferInitInfo):
    """init_info of `llm.init_weight_transfer_engine`: where the weightsync job
    is and which replica this engine is. `mode`: None picks from the engine
    config (framework "hf": "load_weights", else "direct"); `staged`: each
    step is received on a background thread while vLLM serves, and
    update_weights only applies the newest committed one (the pause is the
    apply; costs one more copy of the rank's weights, docs/integrations/
    vllm.md); False: update_weights receives and applies (vLLM stops for the
    whole transfer). The other fields are Subscriber options."""

    coordinator: str = ""
    engine: Any = None
    replica: int = 0
    mode: Optional[str] = None
    transport: str = "ucx"
    token: Optional[str] = None
    job: str = "weightsync"
    keep_previous: bool = True
    staged: bool = False
    connect_timeout: float = 60.0
    step_timeout: float = 120.0
    #: LoRA adapter jobs (docs/lora.md), each {"engine": its engine config
    #: (weightsync.lora.engine_config), and optionally "coordinator",
    #: "replica", "job", "transport", "token"}: the others default to this
    #: init_info's. `engine` may then be omitted (adapters only); an `engine`
    #: with a "lora" field is an adapter job too.
    adapters: list = field(default_factory=list)


@dataclass
class WeightsyncUpdateInfo(WeightTransferUpdateInfo):
    """update_info of `llm.update_weights`: waits up to `timeout` s for the
    trainers' next push; with `step`, that push must be step `step` (staged:
    waits for step `step` to be staged, and applies it). With
    `adapter`, the step is that LoRA adapter's (not the base model's)."""

    timeout: float = 120.0
    step: Optional[int] = None
    adapter: Optional[str] = None


class WeightsyncTransferEngine(WeightTransferEngine[WeightsyncInitInfo, WeightsyncUpdateInfo]):
    """One vLLM worker's end of weightsync: `update_weights` runs one weightsync
    step (received and loaded through vLLM's layerwise reload; a failed step
    leaves the worker on its previous version and raises)."""

    init_info_cls = WeightsyncInitInfo
    update_info_cls = WeightsyncUpdateInfo
    supports_draft_weight_update = False

    _sync: Any = None
    _replica: int = 0
    _tp_rank: int = 0

    @property
    def _loras(self) -> dict:
        """{adapter name: EngineSync} of the LoRA adapter jobs (docs/lora.md)."""
        return self.__dict__.setdefault("_weightsync_loras", {})

    def init_transfer_engine(self, init_info: WeightsyncInitInfo) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank

        from ._vllm_reload import connect
        from .lora import adapter_of

        adapters = [dict(a) for a in init_info.adapters]
        if init_info.engine is not None and adapter_of(init_info.engine) is not None:
            adapters.insert(0, {"engine": init_info.engine})
            init_info.engine = None
        if not init_info.coordinator or (init_info.engine is None and not adapters):
            raise Error("invalid_argument", "weightsync init_info needs 'coordinator' "
                        "(HOST:PORT) and 'engine' (the engine config: path, dict or JSON) "
                        "or 'adapters' (LoRA adapter jobs)")
        if any("engine" not in a for a in adapters):
            raise Error("invalid_argument", "weightsync init_info 'adapters': each is "
                        "{'engine': the adapter job's engine config, ...}")
        accepted = ("engine", "coordinator", "replica", "job", "transport", "token")
        for a in adapters:
            unknown = sorted(set(a) - set(accepted))
            if unknown:
                raise Error("invalid_argument", f"weightsync init_info 'adapters': unknown key "
                            f"{unknown[0]!r} (accepted: {', '.join(accepted)})")
        self.shutdown()
        self._replica, self._tp_rank = init_info.replica, get_tensor_model_parallel_rank()
        if init_info.engine is not None:
            self._sync = connect(self.model, self.model_config, self.vllm_config,
                                 init_info.coordinator, init_info.engine, init_info.replica,
                                 self._tp_rank, init_info.mode,
                                 keep_previous=init_info.keep_previous,
                                 staged=init_info.staged, transport=init_info.transport, token=init_info.token,
                                 job=init_info.job, connect_timeout=init_info.connect_timeout,
                                 step_timeout=init_info.step_timeout)
        for a in adapters:
            options = dict(transport=a.get("transport", init_info.transport),
                           token=a.get("token", init_info.token), job=a.get("job", init_info.job),
                           connect_timeout=init_info.connect_timeout,
                           step_timeout=init_info.step_timeout)
            _lora_connect(self._loras, self.model, self.vllm_config,
                          a.get("coordinator", init_info.coordinator), a["engine"],
                          int(a.get("replica", init_info.replica)), self._tp_rank, options)

    def _connected(self):
        if self._sync is None and self._loras:
            raise Error("invalid_argument", "weightsync: this engine syncs LoRA adapters only "
                        f"({', '.join(sorted(self._loras))}): update_info must name one "
                        "('adapter')")
        if self._sync is None:
            raise Error("invalid_argument", "weightsync: init_weight_transfer_engine was not "
                        "called (its init_info names the coordinator and the engine config)")
        return self._sync

    def start_weight_update(self) -> None:
        # weightsync runs vLLM's layerwise reload inside each step, so that a
        # step that fails is undone before update_weights returns.
        if not self._loras:
            self._connected()

    def update_weights(self, update_info: dict) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():  # vLLM's base class syncs unconditionally
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: WeightsyncUpdateInfo) -> None:
        error: Optional[Error] = None
        cause: Optional[Exception] = None
        try:
            self._receive(update_info)
        except Error as e:
            error = cause = e
        except Exception as e:  # noqa: BLE001 - every worker must reach the agreement below
            error, cause = Error("internal", f"weightsync: {type(e).__name__}: {e}"), e
        error = self._the_one_to_raise(error)
        if error is not None:
            # vLLM passes on only the text: weightsync.vllm.receive reads the
            # code and the message back from it.
            raise marked(error) from cause

    def _the_one_to_raise(self, error: Optional[Error]) -> Optional[Error]:
        """The error this worker raises into vLLM, if any.

        vLLM's executor reads its workers' replies in rank order and raises at
        the first failed one, leaving the later workers' replies queued: the
        next call of any kind on the engine would read them (another worker's
        stale error, then every reply one call late). So the workers of a
        tensor-parallel group agree on the outcome, and only the last one
        raises: its own error, else the first failed worker's. The others end
        their update session as vLLM does for a worker that raised, and
        return. Without a group, or where the session cannot be ended so
        (another vLLM), every worker raises its own error."""
        group = _executor_group()
        if group is None:
            return error
        import torch.distributed as dist

        errors: list = [None] * group.world_size
        mine = None if error is None else (error.code, error.message)
        dist.all_gather_object(errors, mine, group=group.cpu_group)
        failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
        if not failed:
            return None
        if group.rank_in_group == group.world_size - 1:
            if error is not None:
                return error
            rank, (code, message) = failed[0]
            return Error(code, message)
        return None if _end_worker_session(self) else error

    def _receive(self, update_info: WeightsyncUpdateInfo) -> None:
        if update_info.adapter is not None:
            sync = _lora_sync(self._loras, update_info.adapter)
            who = f"adapter {update_info.adapter!r} on {self._who(sync)}"
        else:
            sync = self._connected()
            who = self._who(sync)
        worker = _worker_of(self)
        if worker is not None and update_info.adapter is None:
            sync.live_requests = lambda: _live_requests(worker)
        out = sync.update(update_info.timeout, step=update_info.step)
        if out is None:
            raise Error("timeout", f"weightsync: {who}: no weight update began within "
                        f"{update_info.timeout} s (the engine keeps version {sync.version})")
        if not out["committed"]:
            extra = f"; restored {out['restored']}" if out.get("restored") else ""
            raise Error("peer_failure", f"weightsync: {who}: step {out['step']} was not committed: "
                        f"{out['reason']} (the engine keeps version {sync.version}{extra})")
        if update_info.step is not None and out["step"] != update_info.step:
            raise Error("mismatch", f"weightsync: {who}: expected step {update_info.step}, the "
                        f"trainers pushed step {out['step']} (now the engine's version)")

    def _who(self, sync: Any) -> str:
        return (f"engine rank {sync.sub.global_rank} (replica {self._replica}, "
                f"tensor-parallel rank {self._tp_rank})")

    def finish_weight_update(self) -> None:
        if not self._loras:
            self._connected()

    @property
    def version(self) -> int:
        """The last committed step this worker holds, -1 before the first."""
        return -1 if self._sync is None else self._sync.version

    def shutdown(self) -> None:
        if self._sync is not None:
            self._sync.close()
            self._sync = None
        _lora_close(self._loras, None)

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        raise Error("unsupported", "weightsync trainers push with weightsync.Publisher "
                    "(every rank its own shards), not through vLLM's trainer_send_weights")


def _executor_group() -> Any:
    """vLLM's tensor-parallel group when it is every worker of the executor
    (pipeline parallel size 1) and has more than one rank; else None."""
    try:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp, pp = get_tp_group(), get_pp_group()
    except (ImportError, AssertionError):
        return None
    return tp if pp.world_size == 1 and tp.world_size > 1 else None


def _worker_of(engine: Any) -> Any:
    """The vLLM worker whose update_weights is running `engine`: the caller
    up the stack holding it (vLLM 0.32's Worker), or None."""
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        owner: Any = frame.f_locals.get("self")
        if (owner is not engine and getattr(owner, "weight_transfer_engine", None) is engine
                and hasattr(owner, "_weight_update_active")):
            return owner
        frame = frame.f_back
    return None


def _end_worker_session(engine: Any) -> bool:
    """Ends the update session of the vLLM worker whose update_weights is
    running `engine`, as vLLM 0.32's Worker.update_weights does when the
    engine raises. False when no such worker is found."""
    owner = _worker_of(engine)
    if owner is None:
        return False
    owner._weight_update_active = False
    owner.weight_transfer_engine.reset_weight_update_target()
    return True
