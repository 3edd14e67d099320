"""weightsync: moves an RL trainer's sharded weights into running inference
engines, every step.

    import weightsync as ws
    coord = ws.Coordinator()                        # or a standalone `weightsync coordinator`
    pub = ws.Publisher(coordinator=coord.address, rank=r, layout=L, engine=E)
    pub.register_module(model)                      # local shards (DTensor.to_local())
    res = pub.push(step)                            # after each optimizer step

    sub = ws.Subscriber(coordinator=addr, engine=E, replica=i, rank=j)
    sub.register_module(engine_model)               # the engine's own parameter names
    out = sub.run_step(timeout=5.0)

`weightsync.torch` builds trainer layouts from live (DTensor) parameters;
`weightsync.vllm` and `weightsync.sglang` plug into the engines (imported
lazily: `import weightsync` needs neither, nor torch).
"""

from ._errors import Error
from ._api import (
    Coordinator,
    Publisher,
    PushResult,
    StepOutcome,
    Subscriber,
    engine_params,
)
from ._cli import cli_path

__version__ = "0.1.0"

__all__ = [
    "Coordinator",
    "Error",
    "Publisher",
    "PushResult",
    "StepOutcome",
    "Subscriber",
    "cli_path",
    "engine_params",
]
