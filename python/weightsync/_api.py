"""The Python API of DESIGN.md's contract: Coordinator, Publisher, Subscriber,
engine_params, and the typed results they return. Thin objects over the C++
library (weightsync._core); every call that waits releases the GIL.

Options are keyword-only (the identity of an endpoint, such as its
coordinator, rank and layout, may also be given by position), or bound in a
PublisherOptions / SubscriberOptions object passed as `options=`.

One module a class: _coordinator.py, _publisher.py, _subscriber.py, the
options (_options.py), the results (_results.py) and what both sides share
(_common.py); this one names them together."""

from __future__ import annotations

from ._common import EngineLike, LayoutLike, engine_params, load_json
from ._coordinator import Coordinator, CoordinatorLike, status
from ._options import PublisherOptions, SubscriberOptions
from ._publisher import Publisher
from ._results import LoadReport, ParamInfo, PushResult, SaveHfResult, StepOutcome
from ._subscriber import Subscriber

__all__ = [
    "Coordinator",
    "CoordinatorLike",
    "EngineLike",
    "LayoutLike",
    "LoadReport",
    "ParamInfo",
    "Publisher",
    "PublisherOptions",
    "PushResult",
    "SaveHfResult",
    "StepOutcome",
    "Subscriber",
    "SubscriberOptions",
    "engine_params",
    "load_json",
    "status",
]
