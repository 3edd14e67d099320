"""The endpoints' options: PublisherOptions and SubscriberOptions (what
users bind, or give as keywords), merged with the keywords and turned into
the extension's option structs (_core.PublisherOptions, field by field)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, TypeVar

from . import _core
from ._errors import InvalidArgument


@dataclass(frozen=True)
class PublisherOptions:
    """A Publisher's options, bound in one object (`ws.Publisher(...,
    options=o)`); each is also a keyword of the constructor.

    Attributes:
        transport: how data moves: "ucx", "cuda_ipc", "nccl" (docs/transports.md).
        mode: "p2p" (each engine rank fetched from its sources) or "broadcast".
        bucket_bytes: the size of one bucket (a staging slot).
        checksums: a checksum per bucket, verified by the engine ranks (on
            by default; summed inside the pack and apply copies, docs/usage.md).
            Buckets whose bytes stay in device memory (CUDA tensors over
            cuda_ipc or nccl, device slots, lent params) go unchecked.
        token: the coordinator's shared secret (None: none).
        job: the job name the coordinator groups endpoints by.
        connect_timeout: seconds to connect and register.
        step_timeout: seconds a step may take before its stragglers are dropped.
        producer_stream: CUDA tensors: a torch.cuda.Stream (or its handle)
            whose queued work a push waits for.
        producer_event: CUDA tensors: a torch.cuda.Event (or its handle)
            recorded after the optimizer step, which a push waits for.
        fp8_site: FP8 engines: "sender" (trainer ranks quantize where they
            hold whole blocks) or "engine".
        elastic: replicas join and leave between steps (docs/elastic.md).
        min_replicas: elastic: the replicas a push waits for.
        delta: "off" or "auto": a bucket whose engine rank committed what
            this rank last sent it goes as the elements that changed since
            (docs/delta.md; host memory; rank 0's holds).
        delta_verify: delta buckets carry the digest of the bytes the engine
            must hold after applying them, checked before they are written.
        coordinator_reconnect: seconds a lost coordinator is reached again
            (a restarted one takes the job back; docs/usage.md); 0: never.
        parity: the summary line of a parity check run before connecting
            (EngineSync sets it, docs/fp8.md); the coordinator shows it per
            engine rank in `weightsync status`. "" when none was run.
    """

    transport: str = "ucx"
    mode: str = "p2p"
    bucket_bytes: int = 256 << 20
    checksums: bool = True
    token: Optional[str] = None
    job: str = "weightsync"
    connect_timeout: float = 60.0
    step_timeout: float = 120.0
    producer_stream: Any = None
    producer_event: Any = None
    fp8_site: str = "sender"
    elastic: bool = False
    min_replicas: int = 1
    delta: str = "off"
    delta_verify: bool = True
    coordinator_reconnect: float = 300.0


@dataclass(frozen=True)
class SubscriberOptions:
    """A Subscriber's options, bound in one object (`ws.Subscriber(...,
    options=o)`); each is also a keyword of the constructor.

    Attributes:
        transport: how data moves: "ucx", "cuda_ipc", "nccl".
        staging: receive into a private copy, made visible at commit (no
            half-applied weights even while a step is in flight).
        token: the coordinator's shared secret (None: none).
        job: the job name the coordinator groups endpoints by.
        connect_timeout: seconds to connect and register.
        step_timeout: seconds a step may take.
        weights_device: load_weights mode: where the tensors handed to
            on_weights live (None or "cpu": host memory; "cuda[:N]" or an int).
        coordinator_reconnect: seconds a lost coordinator is reached again
            (a restarted one takes the job back; docs/usage.md); 0: never.
    """

    transport: str = "ucx"
    staging: bool = False
    token: Optional[str] = None
    job: str = "weightsync"
    connect_timeout: float = 60.0
    step_timeout: float = 120.0
    weights_device: Any = None
    coordinator_reconnect: float = 300.0
    parity: str = ""


_O = TypeVar("_O", PublisherOptions, SubscriberOptions)


def _merge_options(cls: type[_O], options: Optional[_O], keywords: dict[str, Any]) -> _O:
    """`options` (or the defaults) with every keyword that differs from its
    default applied over it."""
    if options is not None and not isinstance(options, cls):
        raise InvalidArgument(f"options: expected a {cls.__name__}, got {type(options).__name__}")
    base = options if options is not None else cls()
    changes = {}
    for f in dataclasses.fields(cls):
        value = keywords[f.name]
        if not (value is f.default or (type(value) is type(f.default) and value == f.default)):
            changes[f.name] = value
    return dataclasses.replace(base, **changes) if changes else base


def _address(coordinator: Any) -> str:
    address = getattr(coordinator, "address", coordinator)
    if not isinstance(address, str) or ":" not in address:
        raise InvalidArgument(
            f"coordinator: expected 'HOST:PORT' or a Coordinator, got {coordinator!r}")
    return address


def _cuda_ordinal(device: Any) -> int:
    """-1 for host memory (None, "cpu"), else the CUDA ordinal of `device`
    (an int, "cuda", "cuda:1", or a torch.device)."""
    if device is None:
        return -1
    if isinstance(device, int):
        return device
    kind, _, index = str(device).partition(":")
    if kind == "cpu":
        return -1
    if kind == "cuda":
        return int(index) if index else 0
    raise InvalidArgument(f"device {device!r}: expected None, 'cpu', 'cuda[:N]' or an int")


def _cuda_handle(obj: Any, attr: str, what: str) -> int:
    """The raw handle of a torch.cuda.Stream / Event (or an int), 0 for None."""
    if obj is None:
        return 0
    handle = getattr(obj, attr, obj)
    if not isinstance(handle, int):
        raise InvalidArgument(f"{what}: expected a torch.cuda object with .{attr} or an "
                              f"int handle, got {type(obj).__name__}")
    return handle



def core_publisher_options(o: PublisherOptions, coordinator: Any, rank: int, layout_text: str,
                           engine_text: Optional[str], engine_base: str) -> _core.PublisherOptions:
    """The C++ PublisherOptions of `o` for trainer rank `rank` of the layout
    (JSON text) and, when given, the engine config (JSON text, relative paths
    against `engine_base`). Each value is checked as it is set (an unknown
    mode, delta or fp8_site, a timeout that is not positive)."""
    c = _core.PublisherOptions()
    c.delta = o.delta
    c.delta_verify = o.delta_verify
    c.elastic = o.elastic
    c.min_replicas = o.min_replicas
    c.plan.fp8_site = o.fp8_site
    c.producer_stream = _cuda_handle(o.producer_stream, "cuda_stream", "producer_stream")
    c.producer_event = _cuda_handle(o.producer_event, "cuda_event", "producer_event")
    c.coordinator = _address(coordinator)
    c.rank = rank
    c.set_layout(layout_text)
    if engine_text is not None:
        c.set_engine(engine_text, engine_base)
    c.transport = o.transport
    c.plan.mode = o.mode
    c.plan.bucket_bytes = o.bucket_bytes
    c.wire.checksums = o.checksums
    c.token = o.token or ""
    c.job = o.job
    c.connect_timeout = o.connect_timeout
    c.step_timeout = o.step_timeout
    c.coordinator_reconnect = o.coordinator_reconnect
    return c


def core_subscriber_options(o: SubscriberOptions, coordinator: Any, engine_text: str,
                            engine_base: str, replica: int,
                            rank: int) -> _core.SubscriberOptions:
    """The C++ SubscriberOptions of `o` for rank `rank` of replica `replica`
    of the engine config (JSON text, relative paths against `engine_base`)."""
    c = _core.SubscriberOptions()
    c.coordinator = _address(coordinator)
    c.set_engine(engine_text, engine_base)
    c.replica = replica
    c.rank = rank
    c.transport = o.transport
    c.staging = o.staging
    c.weights_device = _cuda_ordinal(o.weights_device)
    c.token = o.token or ""
    c.job = o.job
    c.connect_timeout = o.connect_timeout
    c.step_timeout = o.step_timeout
    c.coordinator_reconnect = o.coordinator_reconnect
    c.parity = o.parity
    return c
