"""The trainer side: Publisher."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator, Optional, Union

from . import _core
from ._common import EngineLike, LayoutLike, _Registry, load_json
from ._coordinator import CoordinatorLike
from ._options import PublisherOptions, _address, _merge_options, core_publisher_options
from ._progress import DirProgress, layout_bytes
from ._results import LoadReport, PushResult, SaveHfResult, _result


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
                 checksums: bool = True, token: Optional[str] = None, job: str = "weightsync",
                 connect_timeout: float = 60.0, step_timeout: float = 120.0,
                 producer_stream: Any = None, producer_event: Any = None,
                 fp8_site: str = "sender", elastic: bool = False, min_replicas: int = 1,
                 delta: str = "off", delta_verify: bool = True,
                 coordinator_reconnect: float = 300.0):
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
            elastic=elastic, min_replicas=min_replicas, delta=delta, delta_verify=delta_verify,
            coordinator_reconnect=coordinator_reconnect))
        layout_text, _ = load_json(layout, "trainer layout")
        engine_text: Optional[str] = None
        engine_base = os.getcwd()
        if engine is not None:
            engine_text, engine_base = load_json(engine, "engine config")
        self._options = o
        self._layout_text = layout_text
        self._rank = rank
        self._core = _core.Publisher()
        self._core.open(core_publisher_options(o, coordinator, rank, layout_text, engine_text,
                                               engine_base))
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

    @property
    def coordinator(self) -> str:
        """The coordinator's address ("HOST:PORT") this rank connects to."""
        return self._core.coordinator

    def set_coordinator(self, address: Any) -> None:
        """The coordinator moved (restarted on another address, or a
        Coordinator object): this rank reconnects there, as the same member
        (docs/usage.md, "The coordinator dies")."""
        self._core.set_coordinator(_address(address))

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
