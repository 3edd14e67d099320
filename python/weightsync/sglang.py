"""SGLang integration. SGLang is never imported by weightsync itself: `import
weightsync.sglang` works without it.

An SGLang tensor-parallel worker holds its model in `model_runner.model`
(SGLang's names and fused layouts, `framework: "sglang"` in the engine
config; with `"moe_order": "w31"` for kernels that keep up before gate) and
its rank in `model_runner.tp_rank`. Keep it in sync from inside the worker
process (e.g. a custom entry point, or a hook of your RL framework that runs
on every scheduler process):

    from weightsync.sglang import WorkerSync
    sync = WorkerSync(model_runner, coordinator="10.0.0.1:29600",
                      engine="engine.json", replica=0, mode="direct")
    sync.start()      # serve updates in the background; or sync.update(timeout) per step

Mode "load_weights" (an engine group of framework "hf") hands whole HF tensors
to `model_runner.model.load_weights(batch)`, as SGLang's
update_weights_from_tensor does, then calls the model's `post_load_weights()`
where it has one.
"""

from __future__ import annotations

from typing import Any, Optional

from ._engine import EngineSync

__all__ = ["WorkerSync"]


def _post_load(model: Any):
    hook = getattr(model, "post_load_weights", None)
    if hook is None:
        return None
    return lambda step: hook()


class WorkerSync(EngineSync):
    """One SGLang tensor-parallel worker's model, in sync with the trainers."""

    def __init__(self, model_runner: Any, coordinator: Any, engine: Any, replica: int,
                 mode: str = "direct", rank: Optional[int] = None, **options: Any):
        model = model_runner.model
        rank = model_runner.tp_rank if rank is None else rank
        super().__init__(model, coordinator, engine, replica, rank, mode=mode,
                         post_load=_post_load(model) if mode == "load_weights" else None,
                         **options)
