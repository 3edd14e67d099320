"""vLLM integration. vLLM is imported only when a method needs it: `import
weightsync` and `import weightsync.vllm` work without it.

Two ways in:

1. A worker extension (vLLM's `worker_extension_cls`), driven with
   `collective_rpc` from the process that owns the LLM:

       llm = LLM(model=..., tensor_parallel_size=2,
                 worker_extension_cls="weightsync.vllm.WorkerExtension")
       llm.collective_rpc("weightsync_connect",
                          kwargs=dict(coordinator="10.0.0.1:29600", engine="engine.json",
                                      replica=0, mode="direct"))
       ...  # after each trainer push (or: "weightsync_start" to serve in the background)
       llm.collective_rpc("weightsync_update", kwargs=dict(timeout=120.0))

   Each worker registers its model's parameters (mode "direct": vLLM's names
   and fused layouts, written in place) or hands whole HF tensors to its
   model's `load_weights` and then runs vLLM's process_weights_after_loading
   (mode "load_weights", for an engine group of framework "hf").

2. vLLM's weight-transfer engine interface (`init_transfer_engine`,
   `start_weight_update`, `receive_weights`, `finish_weight_update`), where
   the installed vLLM has it: `register_weight_transfer_engine()` registers
   weightsync under the name "weightsync"; its init info is
   {"coordinator", "engine", "replica", "mode", "transport", ...} and its
   update info {"timeout"}.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ._engine import EngineSync
from ._errors import Error

__all__ = ["WorkerExtension", "register_weight_transfer_engine", "weight_transfer_engine_class"]


def _tp_rank() -> int:
    from vllm.distributed import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def _post_load(model: Any, model_config: Any, device: Any):
    """vLLM's post-load processing (repacking, quantization scales) of a model
    whose weights were just reloaded."""

    def run(step: int) -> None:
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        process_weights_after_loading(model, model_config, device)

    return run


class WorkerExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`): the worker's
    `model_runner.model` stays in sync with the trainers. Methods are called
    on every worker with `llm.collective_rpc(name, kwargs=...)`."""

    def weightsync_tp_rank(self) -> int:
        """This worker's rank inside its replica (vLLM's tensor-parallel rank)."""
        return _tp_rank()

    def weightsync_connect(self, coordinator: str, engine: Any, replica: int,
                           mode: str = "direct", **options: Any) -> dict:
        """Joins the weightsync job as rank (replica, tp rank). `engine`: the
        engines' config (path, dict or JSON); `options`: Subscriber options
        (transport, staging, token, job, timeouts, weights_device)."""
        runner = self.model_runner
        model = runner.model
        post_load = None
        if mode == "load_weights":
            post_load = _post_load(model, getattr(runner, "model_config", None),
                                   getattr(runner, "device", None))
        self._weightsync = EngineSync(model, coordinator, engine, replica, self.weightsync_tp_rank(),
                                      mode=mode, post_load=post_load, **options)
        return {"global_rank": self._weightsync.sub.global_rank, "mode": mode}

    def _weightsync_sync(self) -> EngineSync:
        sync = getattr(self, "_weightsync", None)
        if sync is None:
            raise Error("invalid_argument", "weightsync_connect was not called on this worker")
        return sync

    def weightsync_update(self, timeout: float = 120.0) -> Optional[dict]:
        """Runs the next weight update (waits up to `timeout` s for it to
        begin): {"step", "committed", "reason", "bytes", "seconds"}, or None."""
        return self._weightsync_sync().update(timeout)

    def weightsync_start(self) -> None:
        """Serves weight updates on a background thread until weightsync_stop."""
        self._weightsync_sync().start()

    def weightsync_stop(self) -> list:
        return self._weightsync_sync().stop()

    def weightsync_version(self) -> int:
        """The last committed step on this worker, -1 before the first."""
        return self._weightsync_sync().version

    def weightsync_close(self) -> None:
        sync = getattr(self, "_weightsync", None)
        if sync is not None:
            sync.close()
            self._weightsync = None


def weight_transfer_engine_class() -> type:
    """weightsync as a vLLM WeightTransferEngine (needs a vLLM that has
    vllm.distributed.weight_transfer)."""
    try:
        from vllm.distributed.weight_transfer.base import (WeightTransferEngine,
                                                           WeightTransferInitInfo,
                                                           WeightTransferUpdateInfo)
    except ImportError as e:
        raise Error("unsupported", "the installed vLLM has no weight-transfer engine interface "
                    f"(vllm.distributed.weight_transfer.base): {e}") from None

    @dataclass
    class InitInfo(WeightTransferInitInfo):
        coordinator: str
        engine: Any
        replica: int
        mode: str = "direct"
        transport: str = "ucx"
        token: Optional[str] = None
        job: str = "weightsync"
        staging: bool = False

    @dataclass
    class UpdateInfo(WeightTransferUpdateInfo):
        timeout: float = 120.0

    class WeightsyncTransferEngine(WeightTransferEngine):
        init_info_cls = InitInfo
        update_info_cls = UpdateInfo

        def init_transfer_engine(self, init_info: InitInfo) -> None:
            post_load = None
            if init_info.mode == "load_weights":
                post_load = _post_load(self.model, self.model_config, self.device)
            self._sync = EngineSync(self.model, init_info.coordinator, init_info.engine,
                                    init_info.replica, _tp_rank(), mode=init_info.mode,
                                    post_load=post_load, transport=init_info.transport,
                                    token=init_info.token, job=init_info.job,
                                    staging=init_info.staging)

        def start_weight_update(self) -> None:
            pass  # the trainers' push begins the step

        def receive_weights(self, update_info: UpdateInfo) -> None:
            out = self._sync.update(update_info.timeout)
            if out is None:
                raise Error("timeout", f"no weight update began within {update_info.timeout} s")
            if not out["committed"]:
                raise Error("peer_failure", f"weight update of step {out['step']} was not "
                            f"committed on this worker: {out['reason']}")

        def finish_weight_update(self) -> None:
            pass  # load_weights mode post-processes before its ack (on_loaded)

        def shutdown(self) -> None:
            sync = getattr(self, "_sync", None)
            if sync is not None:
                sync.close()

        @staticmethod
        def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
            raise Error("unsupported", "weightsync trainers push with weightsync.Publisher "
                        "(every rank its own shards), not through vLLM's trainer_send_weights")

    return WeightsyncTransferEngine


def register_weight_transfer_engine(name: str = "weightsync") -> type:
    """Registers weightsync with vLLM's weight-transfer engine registry."""
    cls = weight_transfer_engine_class()
    from vllm.distributed.weight_transfer import register_weight_transfer_engine as register

    register(name, cls)
    return cls
