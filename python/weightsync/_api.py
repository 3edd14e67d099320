"""The Python API of DESIGN.md's contract: Coordinator, Publisher, Subscriber,
engine_params, and the typed results they return. Thin objects over the C++
library (weightsync._core); every call that waits releases the GIL.

Options are keyword-only (the identity of an endpoint, such as its
coordinator, rank and layout, may also be given by position), or bound in a
PublisherOptions / SubscriberOptions object passed as `options=`."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import (Any, AsyncIterator, Callable, Iterable, Iterator, Mapping, NamedTuple,
                    Optional, Sequence, TypeVar, Union)

from . import _core
from ._progress import DirProgress, layout_bytes
from ._errors import Error, InvalidArgument, IoError, NotFound
from ._tensors import clean_name, local_tensor, view

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
]

#: A trainer layout: a path to its JSON file, its JSON text, or the dict.
LayoutLike = Union[str, "os.PathLike[str]", Mapping[str, Any]]
#: An engine config: a path to its JSON file, its JSON text, the dict, or a
#: list of them (engine groups).
EngineLike = Union[str, "os.PathLike[str]", Mapping[str, Any], Sequence[Mapping[str, Any]]]
#: Where the coordinator is: "HOST:PORT", or a Coordinator of this process.
CoordinatorLike = Union[str, "Coordinator"]

_R = TypeVar("_R")
_StepHook = TypeVar("_StepHook", bound=Optional[Callable[[int], object]])
_WeightsHook = TypeVar("_WeightsHook", bound=Optional[Callable[[list[tuple[str, Any]]], object]])


# ---------------------------------------------------------------------------
# Typed results


@dataclass(frozen=True)
class PushResult:
    """What `Publisher.push(step)` returns on this trainer rank, once the
    coordinator decided the step.

    Attributes:
        step: the version pushed.
        committed: the engine ranks (global) that committed it, ascending.
        failed: (engine rank, reason) of every engine rank that did not.
        bytes_sent: payload bytes this rank put on the wire.
        bytes_direct: of those, sent straight from the registered tensors
            (zero copy).
        buckets_lent: buckets written straight into the engine's lent params
            (one copy, over cuda_ipc: docs/transports.md).
        delta_buckets: delta sync: buckets sent as the elements that changed.
        delta_bytes_whole: the bytes those buckets hold whole.
        delta_base_bytes: delta sync: host memory this rank keeps as its
            buckets' bases (what their engine ranks hold; buckets that go
            alike to several replicas share one).
        seconds: the push, call to return.
        plan_id: the plan of the step.
        replicas: elastic publishers: the replicas the step served (else []).
        phases: seconds per phase: "begin", "pack", "gather", "wire", "commit".
    """

    step: int
    committed: list[int]
    failed: list[tuple[int, str]]
    bytes_sent: int
    bytes_direct: int
    buckets_lent: int
    delta_buckets: int
    delta_bytes_whole: int
    delta_base_bytes: int
    seconds: float
    plan_id: str
    replicas: list[int]
    phases: dict[str, float]

    @property
    def ok(self) -> bool:
        """True when no engine rank failed the step."""
        return not self.failed


@dataclass(frozen=True)
class StepOutcome:
    """What `Subscriber.run_step()` returns for a step that began on this
    engine rank.

    Attributes:
        step: the version.
        committed: whether it committed (the weights are that version now).
        reason: why not, when not committed; or why the on_end hook failed.
        bytes: payload bytes received.
        bytes_direct: of those, landed straight in the params (or staging).
        buckets_lent: buckets its trainers wrote into its lent params.
        delta_buckets: delta sync: buckets that came as deltas.
        weights_handed: load_weights mode: HF tensors handed to on_weights.
        checksum: the checksum this rank acked.
        seconds: from the step's begin to its decision.
        phases: seconds per phase: "receive", "verify", "apply", "commit".
    """

    step: int
    committed: bool
    reason: str
    bytes: int
    bytes_direct: int
    buckets_lent: int
    delta_buckets: int
    weights_handed: int
    checksum: int
    seconds: float
    phases: dict[str, float]


@dataclass(frozen=True)
class SaveHfResult:
    """What `Publisher.save_hf()` returns on each trainer rank
    (docs/checkpoints.md).

    Attributes:
        dir: the checkpoint directory.
        files: the number of .safetensors files of the checkpoint.
        total_bytes: its payload (the index's metadata.total_size).
        files_written: the files this rank wrote (full paths).
        bytes_written: their payload.
        bytes_local: of those, from this rank's own shards (nothing moved).
        bytes_sent: sent to the other writers.
        bytes_received: received from the other ranks.
        arena_bytes: memory where this rank assembled its keys.
        staging_bytes: this rank's bucket slots.
        disk_wait_s: transfers waiting for this rank's disk writes.
        disk_s: this rank's disk thread writing (and flushing).
        seconds: the call, end to end (setup_s + data_s + finish_s).
        setup_s: options agreed, writer layout, plan, transport connected.
        data_s: this rank's transfers and files written.
        finish_s: waiting for the other ranks' files and the index.
    """

    dir: str
    files: int
    total_bytes: int
    files_written: list[str]
    bytes_written: int
    bytes_local: int
    bytes_sent: int
    bytes_received: int
    arena_bytes: int
    staging_bytes: int
    disk_wait_s: float
    disk_s: float
    seconds: float
    setup_s: float
    data_s: float
    finish_s: float


@dataclass(frozen=True)
class LoadReport:
    """What `Publisher.load_hf()` returns.

    Attributes:
        bytes: bytes copied out of the checkpoint's files.
        pieces: pieces read.
        files: files touched.
        seconds: the call.
    """

    bytes: int
    pieces: int
    files: int
    seconds: float


class ParamInfo(NamedTuple):
    """A parameter an engine rank holds (engine_params, Subscriber.params):
    a (name, dtype, shape) tuple."""

    name: str
    dtype: str  #: the safetensors dtype name ("BF16")
    shape: list[int]


def _result(cls: type[_R], core: object) -> _R:
    """The dataclass `cls` holding the fields of the extension's result."""
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    return cls(**{name: getattr(core, name) for name in names})


# ---------------------------------------------------------------------------
# Options


@dataclass(frozen=True)
class PublisherOptions:
    """A Publisher's options, bound in one object (`ws.Publisher(...,
    options=o)`); each is also a keyword of the constructor.

    Attributes:
        transport: how data moves: "ucx", "cuda_ipc", "nccl" (docs/transports.md).
        mode: "p2p" (each engine rank fetched from its sources) or "broadcast".
        bucket_bytes: the size of one bucket (a staging slot).
        checksums: a checksum per bucket, verified by the engine ranks.
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
    """

    transport: str = "ucx"
    mode: str = "p2p"
    bucket_bytes: int = 256 << 20
    checksums: bool = False
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
    """

    transport: str = "ucx"
    staging: bool = False
    token: Optional[str] = None
    job: str = "weightsync"
    connect_timeout: float = 60.0
    step_timeout: float = 120.0
    weights_device: Any = None


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


# ---------------------------------------------------------------------------
# Helpers


def load_json(value: Any, what: str) -> tuple[str, str]:
    """(JSON text, base directory) of a layout or engine config given as a
    path, a dict (a list of them: engine groups) or a JSON string; relative
    paths inside resolve against the file's directory (or the working
    directory for a dict or a string)."""
    if isinstance(value, (Mapping, list, tuple)):  # a list: engine groups
        return json.dumps(value), os.getcwd()
    if isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        if text.lstrip().startswith(("{", "[")):
            return text, os.getcwd()
        path = os.path.abspath(text)
        try:
            with open(path, encoding="utf-8") as f:
                return f.read(), os.path.dirname(path)
        except OSError as e:
            raise IoError(f"cannot read {what} '{path}': {e.strerror}") from None
    raise InvalidArgument(
        f"{what}: expected a path, a dict or a JSON string, got {type(value).__name__}")


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


def engine_params(engine: EngineLike, replica: int = 0, rank: int = 0) -> list[ParamInfo]:
    """[(name, dtype, shape)] of every parameter engine rank `rank` of replica
    `replica` holds (dtype: the safetensors name, e.g. "BF16"): allocate them,
    then register them with a Subscriber."""
    text, base = load_json(engine, "engine config")
    return [ParamInfo(n, d, list(s)) for n, d, s in _core.engine_params(text, base, replica, rank)]


# ---------------------------------------------------------------------------
# Coordinator


class Coordinator:
    """The control-plane coordinator, in this process (a thread serving TCP).
    `port=0` binds any free port; `.address` is "HOST:PORT" as bound. A
    standalone one is the `weightsync coordinator` command."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, token: Optional[str] = None,
                 metrics_port: Optional[int] = None):
        """Binds `host:port` and serves until close(). `token`: a shared
        secret every endpoint must present (None: none). `metrics_port`:
        serve Prometheus metrics on http://host:metrics_port/metrics (0: any
        free port, read back from `.metrics_port`; None: no metrics;
        docs/metrics.md)."""
        self._core = _core.Coordinator(host, port, token or "",
                                       -1 if metrics_port is None else metrics_port)

    @property
    def address(self) -> str:
        """"HOST:PORT" as bound: what Publishers and Subscribers connect to."""
        return self._core.address

    @property
    def port(self) -> int:
        """The port as bound."""
        return self._core.port

    @property
    def metrics_port(self) -> int:
        """The bound port of the Prometheus metrics (0: metrics are off)."""
        return self._core.metrics_port

    @property
    def closed(self) -> bool:
        """Whether close() was called."""
        return self._core.closed

    def committed_version(self, engine_rank: int) -> int:
        """The last step engine rank `engine_rank` committed (-1: none)."""
        return self._core.committed_version(engine_rank)

    def close(self) -> None:
        """Stops serving (endpoints still connected see it go)."""
        self._core.close()

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------
# Registration, shared by both sides


class _Registry:
    """Shared by both sides: keeps every registered tensor alive (the C++ side
    holds raw pointers into them) and registers modules by name."""

    def __init__(self, side: str, names: Iterable[str]):
        self._side = side
        self._names = list(names)
        self._refs: dict[str, Any] = {}

    def add(self, name: str, tensor: Any, register: Callable[..., None]) -> None:
        local = local_tensor(tensor)
        register(name, *view(local, f"{self._side} param '{name}'"))
        self._refs[name] = (tensor, local)

    def add_module(self, module: Any, register: Callable[[str, Any], None],
                   strict: bool) -> list[str]:
        wanted = set(self._names)
        seen: set[str] = set()
        unknown: list[str] = []
        for name, tensor in module.named_parameters():
            name = clean_name(name)
            if name in wanted:
                register(name, tensor)
                seen.add(name)
            else:
                unknown.append(name)
        for name, tensor in module.named_buffers():
            name = clean_name(name)  # only the buffers the layout names
            if name in wanted and name not in seen:
                register(name, tensor)
                seen.add(name)
        missing = [n for n in self._names if n not in seen]
        if missing:
            raise NotFound(f"{self._side}: {len(missing)} params of the layout are not in "
                           f"the module: {_some(missing)}")
        if unknown and strict:
            raise NotFound(f"{self._side}: {len(unknown)} params of the module are not in "
                           f"the layout: {_some(unknown)} (strict=False ignores them)")
        return unknown


def _some(names: list[str], n: int = 8) -> str:
    head = ", ".join(repr(x) for x in names[:n])
    return head + (f", ... ({len(names) - n} more)" if len(names) > n else "")


@contextlib.contextmanager
def _config_file(config: Any) -> Iterator[str]:
    """The path of a config.json for save_hf: `config` itself when it is a
    path, else a temporary file holding it (a dict, or anything with
    to_json_string() or to_dict(), as transformers configs have)."""
    if config is None or isinstance(config, (str, os.PathLike)):
        yield "" if config is None else os.fspath(config)
        return
    if hasattr(config, "to_json_string"):
        text = config.to_json_string()
    else:
        text = json.dumps(config.to_dict() if hasattr(config, "to_dict") else dict(config),
                          indent=2, sort_keys=True) + "\n"
    with tempfile.TemporaryDirectory(prefix="weightsync-config-") as tmp:
        path = os.path.join(tmp, "config.json")
        with open(path, "w") as f:
            f.write(text)
        yield path


# ---------------------------------------------------------------------------
# Publisher


class Publisher:
    """The trainer side, one per trainer rank (DESIGN.md): register this rank's
    local tensors, then push(step) after each optimizer step.

        pub = ws.Publisher(coordinator=addr, rank=r, layout=L, engine=E, bucket_bytes=64 << 20)
        pub.register_module(model)
        res = pub.push(step)          # a PushResult
    """

    def __init__(self, coordinator: CoordinatorLike, rank: int, layout: LayoutLike,
                 engine: Optional[EngineLike] = None, *,
                 options: Optional[PublisherOptions] = None,
                 transport: str = "ucx", mode: str = "p2p", bucket_bytes: int = 256 << 20,
                 checksums: bool = False, token: Optional[str] = None, job: str = "weightsync",
                 connect_timeout: float = 60.0, step_timeout: float = 120.0,
                 producer_stream: Any = None, producer_event: Any = None,
                 fp8_site: str = "sender", elastic: bool = False, min_replicas: int = 1,
                 delta: str = "off", delta_verify: bool = True):
        """Connects trainer rank `rank` of `layout` (a trainer layout: path,
        dict or JSON text) to the coordinator (`coordinator`: "HOST:PORT" or a
        Coordinator). `engine` (an engine config) may be omitted when only
        save_hf / load_hf are used. The options (PublisherOptions says what
        each does) are keywords, or bound in `options`; a keyword that differs
        from its default overrides `options`' value.

        CUDA tensors: a push reads them once the work before `producer_event`
        (a torch.cuda.Event recorded after the optimizer step) is done, else
        all work queued on `producer_stream` (a torch.cuda.Stream), else the
        whole device's (a synchronize at the start of every push).

        FP8 engine configs: `fp8_site="sender"` quantizes on the trainer ranks
        where they hold whole 128 x 128 blocks (FP8 on the wire, p2p mode),
        "engine" always on the engine ranks; both give the same bytes.

        `elastic=True` (docs/elastic.md; rank 0's holds): the engine config's
        replicas are slots that replicas join and leave between steps; each
        push serves the replicas ready when it begins (at least `min_replicas`,
        waited for), with the plan for them. PushResult.replicas and .plan_id
        say which.

        `delta="auto"` (docs/delta.md): a bucket whose engine rank committed
        the version this rank last sent it travels as the elements that
        changed since; PushResult.delta_buckets counts them."""
        o = _merge_options(PublisherOptions, options, dict(
            transport=transport, mode=mode, bucket_bytes=bucket_bytes, checksums=checksums,
            token=token, job=job, connect_timeout=connect_timeout, step_timeout=step_timeout,
            producer_stream=producer_stream, producer_event=producer_event, fp8_site=fp8_site,
            elastic=elastic, min_replicas=min_replicas, delta=delta, delta_verify=delta_verify))
        layout_text, _ = load_json(layout, "trainer layout")
        engine_text: Optional[str] = None
        engine_base = os.getcwd()
        if engine is not None:
            engine_text, engine_base = load_json(engine, "engine config")
        self._options = o
        self._layout_text = layout_text
        self._rank = rank
        self._core = _core.Publisher()
        self._core.open(_address(coordinator), rank, layout_text, engine_text, engine_base,
                        o.transport, o.mode, o.bucket_bytes, o.checksums, o.token or "", o.job,
                        o.connect_timeout, o.step_timeout,
                        _cuda_handle(o.producer_stream, "cuda_stream", "producer_stream"),
                        _cuda_handle(o.producer_event, "cuda_event", "producer_event"),
                        o.fp8_site, o.elastic, o.min_replicas, o.delta, o.delta_verify)
        # The params this rank holds: pipeline stages repeat local layer names.
        names = _core.rank_param_names(layout_text, rank)
        self._registry = _Registry(f"trainer rank {rank}", names)
        self._executor: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()

    @property
    def options(self) -> PublisherOptions:
        """The options this publisher was opened with."""
        return self._options

    @property
    def rank(self) -> int:
        """This publisher's trainer rank."""
        return self._core.rank

    def register(self, name: str, tensor: Any) -> None:
        """Registers this rank's local tensor of param `name` (a torch tensor on
        CPU or CUDA, or a DTensor: its local shard). Checked against the
        layout (MismatchError, NotFound); the tensor is kept alive and must
        not move."""
        self._registry.add(name, tensor, self._core.register_tensor)

    def register_module(self, module: Any, *, strict: bool = True) -> None:
        """Registers every parameter of `module` under its name (DTensors by
        their local shards) and the buffers the layout names. Params of the
        layout missing from the module are an error (NotFound); so are params
        of the module the layout lacks, unless strict=False."""
        self._registry.add_module(module, self.register, strict)

    def prepare(self) -> None:
        """Connects, plans and allocates now rather than in the first push."""
        self._core.prepare()

    def push(self, step: int) -> PushResult:
        """Sends this rank's part of version `step` and returns once the
        coordinator decided it (.committed, .failed, .bytes_sent, .seconds)."""
        with self._lock:
            return _result(PushResult, self._core.push(step))

    def push_async(self, step: int) -> Future[PushResult]:
        """push(step) on a background thread: a concurrent.futures.Future of its
        PushResult. The registered tensors must not change until it is done.
        From asyncio: `await asyncio.wrap_future(pub.push_async(step))`."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightsync-push")
        return self._executor.submit(self.push, step)

    def plan_summary(self) -> dict[str, Any]:
        """The plan of the first push (as `weightsync plan --json` prints it)."""
        summary: dict[str, Any] = json.loads(self._core.plan_summary())
        return summary

    def save_hf(self, dir: Union[str, os.PathLike[str]], config: Any = None, *,
                max_file_bytes: int = 5_000_000_000, bucket_bytes: int = 0,
                transport: Optional[str] = None, timeout: Optional[float] = None,
                sync: bool = True, direct_io: bool = True,
                progress: Optional[bool] = None) -> SaveHfResult:
        """Writes the registered shards as a Hugging Face checkpoint directory
        (docs/checkpoints.md): a collective, every trainer rank calls it with the
        same arguments. Keys in the layout's order, in files of at most
        `max_file_bytes` (model-0000i-of-0000N.safetensors), each written by one
        rank; rank 0 writes model.safetensors.index.json last, and every rank
        returns once it exists. `config`: a config.json path, a dict, or a
        transformers config, copied to dir/config.json. `bucket_bytes` (0: about
        1/32 of a writer's share, 1 MiB to the publisher's bucket_bytes / 4),
        `transport` (None: the publisher's) and `timeout` (seconds; None:
        step_timeout) tune the transfer. With `sync` every file
        is flushed to the device (fsync) before the index is written, and
        with `direct_io` (and `sync`) whole aligned blocks bypass the page cache
        (O_DIRECT, where the filesystem allows), leaving the CPU to the
        transfers. Returns a SaveHfResult (.files, .total_bytes, this rank's
        .files_written, .bytes_sent, ...). `progress`: show the bytes on disk,
        the rate and the time left on stderr while it runs (None: on rank 0
        when stderr is a terminal)."""
        # None: rank 0 shows it where stderr is a terminal; True: shown anyway.
        show: Optional[bool] = progress if progress is not None else (
            None if self._rank == 0 else False)
        with self._lock, _config_file(config) as config_path, DirProgress(
                "save_hf", os.fspath(dir), layout_bytes(self._layout_text), show):
            return _result(SaveHfResult, self._core.save_hf(
                os.fspath(dir), config_path, max_file_bytes, bucket_bytes, transport or "",
                timeout or 0.0, sync, direct_io))

    def load_hf(self, dir: Union[str, os.PathLike[str]]) -> LoadReport:
        """Fills the registered tensors from the checkpoint `dir` (an HF
        directory or one .safetensors file), this rank alone, straight from the
        mapped files; padding zero. A LoadReport (.bytes, .pieces, .files)."""
        with self._lock:
            return _result(LoadReport, self._core.load_hf(os.fspath(dir)))

    @property
    def staging_bytes(self) -> int:
        """Bytes of this rank's staging slots (0 before the plan is made)."""
        return self._core.staging_bytes

    def close(self) -> None:
        """Waits for a pending push_async, then leaves the coordinator."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._core.close()

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------
# Subscriber


class Subscriber:
    """The engine side, one per engine rank (DESIGN.md): register the engine's
    parameters under its own names, then run_step() or serve() (or, from
    asyncio, `await run_step_async()`, `async for out in steps()`).

        sub = ws.Subscriber(coordinator=addr, engine=E, replica=i, rank=j)
        sub.register_module(model)
        out = sub.run_step(timeout=5.0)   # None, or a StepOutcome
    """

    def __init__(self, coordinator: CoordinatorLike, engine: EngineLike, replica: int = 0,
                 rank: int = 0, *, options: Optional[SubscriberOptions] = None,
                 transport: str = "ucx", staging: bool = False, token: Optional[str] = None,
                 job: str = "weightsync", connect_timeout: float = 60.0,
                 step_timeout: float = 120.0, weights_device: Any = None):
        """Connects rank `rank` of replica `replica` of `engine` (an engine
        config: path, dict, JSON text, or a list of them: engine groups) to the
        coordinator ("HOST:PORT" or a Coordinator). The options
        (SubscriberOptions says what each does) are keywords, or bound in
        `options`; a keyword that differs from its default overrides
        `options`' value."""
        o = _merge_options(SubscriberOptions, options, dict(
            transport=transport, staging=staging, token=token, job=job,
            connect_timeout=connect_timeout, step_timeout=step_timeout,
            weights_device=weights_device))
        text, base = load_json(engine, "engine config")
        self._options = o
        self._core = _core.Subscriber()
        self._core.open(_address(coordinator), text, base, replica, rank, o.transport, o.staging,
                        _cuda_ordinal(o.weights_device), o.token or "", o.job,
                        o.connect_timeout, o.step_timeout)
        names = [n for n, _, _ in self._core.params()]
        self._registry = _Registry(f"engine rank {self._core.global_rank}", names)
        self._stop = threading.Event()
        # One run_step at a time, whichever thread or event loop calls it.
        self._step_lock = threading.RLock()
        # asyncio: run_step on this thread; a step still running when its
        # awaiting task was cancelled (its outcome goes to the next call).
        self._executor: Optional[ThreadPoolExecutor] = None
        self._pending: Optional[Future[Optional[StepOutcome]]] = None
        self._async_lock: Optional[asyncio.Lock] = None

    @property
    def options(self) -> SubscriberOptions:
        """The options this subscriber was opened with."""
        return self._options

    def params(self) -> list[ParamInfo]:
        """[(name, dtype, shape)] this rank must register."""
        return [ParamInfo(n, d, list(s)) for n, d, s in self._core.params()]

    def register(self, name: str, tensor: Any) -> None:
        """Registers engine parameter `name` (a torch tensor, CPU or CUDA);
        checked against the engine layout (MismatchError, NotFound) and kept
        alive."""
        self._registry.add(name, tensor, self._core.register_param)

    def register_module(self, module: Any, *, strict: bool = True) -> None:
        """Registers every parameter of `module` under its name (the engine's
        names), and the buffers the layout names."""
        self._registry.add_module(module, self.register, strict)

    def on_begin(self, fn: _StepHook) -> _StepHook:
        """fn(step) before a step's data lands (pause generation). If it
        raises, that step fails on this rank, cleanly. None removes the hook.
        Usable as a decorator."""
        self._core.on_begin(fn)
        return fn

    def on_end(self, fn: _StepHook) -> _StepHook:
        """fn(step) once a step is decided (resume; post-load processing). If it
        raises, the outcome's reason says so. None removes the hook. Usable as
        a decorator."""
        self._core.on_end(fn)
        return fn

    def on_weights(self, fn: _WeightsHook, changed_only: bool = False) -> _WeightsHook:
        """load_weights mode, for a rank of an engine group of framework "hf"
        (every HF tensor whole): nothing is registered; fn(batch) gets the HF
        tensors as buckets complete them, batch = [(hf_key, tensor)], exactly
        what vLLM's and SGLang's `model.load_weights(batch)` take. The tensors
        (on the CPU, or on `weights_device`) are valid during the call only.
        If fn raises, the step fails on this rank. Usable as a decorator.

        `changed_only`: a delta sync step (docs/delta.md) hands only the
        tensors that may have changed since the version this rank holds; the
        engine keeps the others as it took them. For engines that take a
        subset (SGLang's weight-update session, a plain load_weights), not
        vLLM's layerwise reload (it rebuilds a layer from what it is
        handed)."""
        self._core.on_weights(fn, changed_only)
        return fn

    def on_loaded(self, fn: _StepHook) -> _StepHook:
        """load_weights mode: fn(step) after the step's last tensors went to
        on_weights and before the ack (e.g. process_weights_after_loading). If
        it raises, the step fails on this rank. Usable as a decorator."""
        self._core.on_loaded(fn)
        return fn

    def prepare(self) -> None:
        """Connects the transport and waits for the plan now rather than in
        the first step."""
        self._core.prepare()

    def run_step(self, timeout: float = 5.0) -> Optional[StepOutcome]:
        """Waits up to `timeout` s for a step to begin, then runs it to its
        decision: None when none began, else the outcome (.step, .committed,
        .reason, .bytes, .seconds). Raises TimeoutError when the trainers
        never set up (connect_timeout)."""
        with self._step_lock:
            out = self._core.run_step(timeout)
        return None if out is None else _result(StepOutcome, out)

    def serve(self, poll: float = 0.2) -> None:
        """run_step until stop() (from a hook or another thread)."""
        self._stop.clear()
        while not self._stop.is_set():
            self.run_step(poll)

    def stop(self) -> None:
        """Makes serve(), serve_async() and steps() return after the step in
        progress (within their `poll`)."""
        self._stop.set()

    # -- asyncio ------------------------------------------------------------

    async def run_step_async(self, timeout: float = 5.0) -> Optional[StepOutcome]:
        """run_step(timeout) for an asyncio server: runs on a worker thread of
        this subscriber (the event loop keeps running; the call releases the
        GIL) and returns the same (None, or a StepOutcome).

        Cancellation-safe: cancelling the awaiting task does not cancel a step
        in progress (weightsync never exposes half a step); it runs to its
        decision on the worker thread, and the next run_step_async returns its
        outcome. Calls from several tasks take turns."""
        if self._async_lock is None:
            self._async_lock = asyncio.Lock()
        async with self._async_lock:
            while True:
                fresh = self._pending is None
                if self._pending is None:
                    if self._executor is None:
                        self._executor = ThreadPoolExecutor(
                            max_workers=1, thread_name_prefix="weightsync-step")
                    self._pending = self._executor.submit(self.run_step, timeout)
                pending = self._pending
                try:
                    out = await asyncio.shield(asyncio.wrap_future(pending))
                except asyncio.CancelledError:
                    raise  # the step runs on; the next call gets its outcome
                except BaseException:
                    self._pending = None
                    raise
                self._pending = None
                # A cancelled call's run_step that saw no step: wait our own.
                if out is not None or fresh:
                    return out

    async def steps(self, *, poll: float = 0.5, idle_timeout: Optional[float] = None,
                    limit: Optional[int] = None) -> AsyncIterator[StepOutcome]:
        """The outcomes of the steps this rank serves, as they are decided:

            async for out in sub.steps():
                log(out.step, out.committed)

        Ends on stop(), after `limit` outcomes, or when no step began for
        `idle_timeout` seconds (None: never). Each wait is run_step_async
        (poll), so stop() takes effect within `poll` seconds."""
        self._stop.clear()
        served = 0
        idle_since = time.monotonic()
        while not self._stop.is_set() and (limit is None or served < limit):
            wait = poll
            if idle_timeout is not None:
                left = idle_timeout - (time.monotonic() - idle_since)
                if left <= 0:
                    return
                wait = max(min(poll, left), 0.001)
            out = await self.run_step_async(wait)
            if out is None:
                continue
            served += 1
            idle_since = time.monotonic()
            yield out

    async def serve_async(self, poll: float = 0.5) -> None:
        """serve() for an asyncio server: serves steps until stop()."""
        async for _ in self.steps(poll=poll):
            pass

    async def aclose(self) -> None:
        """close() without blocking the event loop: waits for a step in
        progress on the worker thread, then leaves the coordinator."""
        pending = self._pending
        if pending is not None:
            with contextlib.suppress(Exception):  # the cancelled call's error
                await asyncio.wrap_future(pending)
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    async def __aenter__(self) -> Subscriber:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """The last committed step, -1 before the first."""
        return self._core.version

    @property
    def global_rank(self) -> int:
        """This rank among every engine rank (replica * tp + rank with one
        engine group)."""
        return self._core.global_rank

    def close(self) -> None:
        """Stops serving, waits for a step in progress, then leaves the
        coordinator."""
        self._stop.set()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._pending = None
        with self._step_lock:
            self._core.close()

    def __enter__(self) -> Subscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
