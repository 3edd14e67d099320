"""weightsync: moves an RL trainer's sharded weights into running inference
engines, every step.

    import weightsync as ws
    coord = ws.Coordinator()                        # or a standalone `weightsync coordinator`
    pub = ws.Publisher(coordinator=coord.address, rank=r, layout=L, engine=E)
    pub.register_module(model)                      # local shards (DTensor.to_local())
    res = pub.push(step)                            # a ws.PushResult, after each optimizer step

    sub = ws.Subscriber(coordinator=addr, engine=E, replica=i, rank=j)
    sub.register_module(engine_model)               # the engine's own parameter names
    out = sub.run_step(timeout=5.0)                 # None, or a ws.StepOutcome
    # asyncio servers: out = await sub.run_step_async(timeout=5.0)
    #                  async for out in sub.steps(): ...

Errors are `ws.Error` (`.code`), raised as the subclass of their code
(`ws.TimeoutError`, `ws.MismatchError`, `ws.PeerFailure`, ...). The package is
typed (PEP 561); docs/python.md is its reference.

`weightsync.torch` builds trainer layouts from live (DTensor) parameters;
`weightsync.vllm` and `weightsync.sglang` plug into the engines (imported
lazily: `import weightsync` needs neither, nor torch).
"""

# Before anything loads the extension: it picks the UCX library (_ucx.py).
from . import _ucx  # noqa: F401
from ._errors import (
    Cancelled,
    Error,
    FormatError,
    InternalError,
    InvalidArgument,
    InvalidLayout,
    IoError,
    MismatchError,
    NotFound,
    PeerFailure,
    ProtocolError,
    TransportError,
    Unsupported,
    error_class,
)
# Not in __all__: `from weightsync import *` must not shadow the builtin.
from ._errors import TimeoutError as TimeoutError
from ._api import (
    Coordinator,
    CoordinatorLike,
    EngineLike,
    LayoutLike,
    LoadReport,
    ParamInfo,
    Publisher,
    PublisherOptions,
    PushResult,
    SaveHfResult,
    StepOutcome,
    Subscriber,
    SubscriberOptions,
    engine_params,
    status,
)
from ._cli import cli_path
from ._ucx import ucx_library

__version__ = "0.1.0"

__all__ = [
    "Cancelled",
    "Coordinator",
    "CoordinatorLike",
    "EngineLike",
    "Error",
    "FormatError",
    "InternalError",
    "InvalidArgument",
    "InvalidLayout",
    "IoError",
    "LayoutLike",
    "LoadReport",
    "MismatchError",
    "NotFound",
    "ParamInfo",
    "PeerFailure",
    "ProtocolError",
    "Publisher",
    "PublisherOptions",
    "PushResult",
    "SaveHfResult",
    "StepOutcome",
    "Subscriber",
    "SubscriberOptions",
    "TransportError",
    "Unsupported",
    "cli_path",
    "engine_params",
    "error_class",
    "status",
    "ucx_library",
]
