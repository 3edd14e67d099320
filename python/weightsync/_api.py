"""The Python API of DESIGN.md's contract: Coordinator, Publisher, Subscriber,
engine_params. Thin objects over the C++ library (weightsync._core); every
call that waits releases the GIL."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Iterable, Mapping, Optional

from . import _core
from ._errors import Error
from ._tensors import clean_name, local_tensor, view

PushResult = _core.PushResult
StepOutcome = _core.StepOutcome


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
            raise Error("io", f"cannot read {what} '{path}': {e.strerror}") from None
    raise Error("invalid_argument",
                f"{what}: expected a path, a dict or a JSON string, got {type(value).__name__}")


def _address(coordinator: Any) -> str:
    address = getattr(coordinator, "address", coordinator)
    if not isinstance(address, str) or ":" not in address:
        raise Error("invalid_argument",
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
    raise Error("invalid_argument", f"device {device!r}: expected None, 'cpu', 'cuda[:N]' or an int")


def _cuda_handle(obj: Any, attr: str, what: str) -> int:
    """The raw handle of a torch.cuda.Stream / Event (or an int), 0 for None."""
    if obj is None:
        return 0
    handle = getattr(obj, attr, obj)
    if not isinstance(handle, int):
        raise Error("invalid_argument", f"{what}: expected a torch.cuda object with .{attr} or an "
                    f"int handle, got {type(obj).__name__}")
    return handle


def engine_params(engine: Any, replica: int = 0, rank: int = 0) -> list[tuple[str, str, list]]:
    """[(name, dtype, shape)] of every parameter engine rank `rank` of replica
    `replica` holds (dtype: the safetensors name, e.g. "BF16"): allocate them,
    then register them with a Subscriber."""
    text, base = load_json(engine, "engine config")
    return [(n, d, list(s)) for n, d, s in _core.engine_params(text, base, replica, rank)]


class Coordinator:
    """The control-plane coordinator, in this process (a thread serving TCP).
    `port=0` binds any free port; `.address` is "HOST:PORT" as bound."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: Optional[str] = None):
        self._core = _core.Coordinator(host, port, token or "")

    @property
    def address(self) -> str:
        return self._core.address

    @property
    def port(self) -> int:
        return self._core.port

    def committed_version(self, engine_rank: int) -> int:
        """The last step engine rank `engine_rank` committed (-1: none)."""
        return self._core.committed_version(engine_rank)

    def close(self) -> None:
        self._core.close()

    def __enter__(self) -> "Coordinator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


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

    def add_module(self, module: Any, register: Callable[[str, Any], None], strict: bool) -> list:
        wanted = set(self._names)
        seen, unknown = set(), []
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
            raise Error("not_found", f"{self._side}: {len(missing)} params of the layout are not in "
                        f"the module: {_some(missing)}")
        if unknown and strict:
            raise Error("not_found", f"{self._side}: {len(unknown)} params of the module are not in "
                        f"the layout: {_some(unknown)} (strict=False ignores them)")
        return unknown


def _some(names: list, n: int = 8) -> str:
    head = ", ".join(repr(x) for x in names[:n])
    return head + (f", ... ({len(names) - n} more)" if len(names) > n else "")


@contextlib.contextmanager
def _config_file(config: Any):
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
    local tensors, then push(step) after each optimizer step."""

    def __init__(self, coordinator: Any, rank: int, layout: Any, engine: Any = None,
                 transport: str = "ucx", mode: str = "p2p", bucket_bytes: int = 256 << 20,
                 checksums: bool = False, token: Optional[str] = None, job: str = "weightsync",
                 connect_timeout: float = 60.0, step_timeout: float = 120.0,
                 producer_stream: Any = None, producer_event: Any = None,
                 fp8_site: str = "sender", elastic: bool = False, min_replicas: int = 1):
        """CUDA tensors: a push reads them once the work before `producer_event`
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
        say which."""
        layout_text, _ = load_json(layout, "trainer layout")
        engine_text, engine_base = load_json(engine, "engine config") if engine is not None \
            else (None, os.getcwd())
        self._core = _core.Publisher()
        self._core.open(_address(coordinator), rank, layout_text, engine_text, engine_base,
                        transport, mode, bucket_bytes, checksums, token or "", job,
                        connect_timeout, step_timeout,
                        _cuda_handle(producer_stream, "cuda_stream", "producer_stream"),
                        _cuda_handle(producer_event, "cuda_event", "producer_event"), fp8_site,
                        elastic, min_replicas)
        # The params this rank holds: pipeline stages repeat local layer names.
        names = _core.rank_param_names(layout_text, rank)
        self._registry = _Registry(f"trainer rank {rank}", names)
        self._executor: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()

    @property
    def rank(self) -> int:
        return self._core.rank

    def register(self, name: str, tensor: Any) -> None:
        """Registers this rank's local tensor of param `name` (a torch tensor on
        CPU or CUDA, or a DTensor: its local shard). Checked against the
        layout; the tensor is kept alive and must not move."""
        self._registry.add(name, tensor, self._core.register_tensor)

    def register_module(self, module: Any, strict: bool = True) -> None:
        """Registers every parameter of `module` under its name (DTensors by
        their local shards) and the buffers the layout names. Params of the
        layout missing from the module are an error; so are params of the
        module the layout lacks, unless strict=False."""
        self._registry.add_module(module, self.register, strict)

    def prepare(self) -> None:
        """Connects, plans and allocates now rather than in the first push."""
        self._core.prepare()

    def push(self, step: int) -> PushResult:
        """Sends this rank's part of version `step` and returns once the
        coordinator decided it (.committed, .failed, .bytes_sent, .seconds)."""
        with self._lock:
            return self._core.push(step)

    def push_async(self, step: int) -> Future:
        """push(step) on a background thread: a concurrent.futures.Future of its
        PushResult. The registered tensors must not change until it is done."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightsync-push")
        return self._executor.submit(self.push, step)

    def plan_summary(self) -> dict:
        """The plan of the first push (as `weightsync plan --json` prints it)."""
        return json.loads(self._core.plan_summary())

    def save_hf(self, dir: Any, config: Any = None, max_file_bytes: int = 5_000_000_000,
                bucket_bytes: int = 0, transport: Optional[str] = None,
                timeout: Optional[float] = None, sync: bool = True,
                direct_io: bool = True) -> Any:
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
        transfers. Returns a
        SaveHfResult (.files, .total_bytes, this rank's .files_written,
        .bytes_sent, ...)."""
        with self._lock, _config_file(config) as config_path:
            return self._core.save_hf(os.fspath(dir), config_path, max_file_bytes, bucket_bytes,
                                      transport or "", timeout or 0.0, sync, direct_io)

    def load_hf(self, dir: Any) -> Any:
        """Fills the registered tensors from the checkpoint `dir` (an HF
        directory or one .safetensors file), this rank alone, straight from the
        mapped files; padding zero. A LoadReport (.bytes, .pieces, .files)."""
        with self._lock:
            return self._core.load_hf(os.fspath(dir))

    @property
    def staging_bytes(self) -> int:
        return self._core.staging_bytes

    def close(self) -> None:
        """Waits for a pending push_async, then leaves the coordinator."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._core.close()

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Subscriber:
    """The engine side, one per engine rank (DESIGN.md): register the engine's
    parameters under its own names, then run_step() or serve()."""

    def __init__(self, coordinator: Any, engine: Any, replica: int = 0, rank: int = 0,
                 transport: str = "ucx", staging: bool = False, token: Optional[str] = None,
                 job: str = "weightsync", connect_timeout: float = 60.0,
                 step_timeout: float = 120.0, weights_device: Any = None):
        text, base = load_json(engine, "engine config")
        self._core = _core.Subscriber()
        self._core.open(_address(coordinator), text, base, replica, rank, transport, staging,
                        _cuda_ordinal(weights_device), token or "", job, connect_timeout,
                        step_timeout)
        names = [n for n, _, _ in self._core.params()]
        self._registry = _Registry(f"engine rank {self._core.global_rank}", names)
        self._stop = threading.Event()

    def params(self) -> list[tuple[str, str, list]]:
        """[(name, dtype, shape)] this rank must register."""
        return [(n, d, list(s)) for n, d, s in self._core.params()]

    def register(self, name: str, tensor: Any) -> None:
        """Registers engine parameter `name` (a torch tensor, CPU or CUDA);
        checked against the engine layout and kept alive."""
        self._registry.add(name, tensor, self._core.register_param)

    def register_module(self, module: Any, strict: bool = True) -> None:
        """Registers every parameter of `module` under its name (the engine's
        names), and the buffers the layout names."""
        self._registry.add_module(module, self.register, strict)

    def on_begin(self, fn: Optional[Callable[[int], Any]]) -> Optional[Callable]:
        """fn(step) before a step's data lands (pause generation). If it
        raises, that step fails on this rank, cleanly. Usable as a decorator."""
        self._core.on_begin(fn)
        return fn

    def on_end(self, fn: Optional[Callable[[int], Any]]) -> Optional[Callable]:
        """fn(step) once a step is decided (resume; post-load processing). If it
        raises, the outcome's reason says so. Usable as a decorator."""
        self._core.on_end(fn)
        return fn

    def on_weights(self, fn: Optional[Callable[[list], Any]]) -> Optional[Callable]:
        """load_weights mode, for a rank of an engine group of framework "hf"
        (every HF tensor whole): nothing is registered; fn(batch) gets the HF
        tensors as buckets complete them, batch = [(hf_key, tensor)], exactly
        what vLLM's and SGLang's `model.load_weights(batch)` take. The tensors
        (on the CPU, or on `weights_device`) are valid during the call only.
        If fn raises, the step fails on this rank. Usable as a decorator."""
        self._core.on_weights(fn)
        return fn

    def on_loaded(self, fn: Optional[Callable[[int], Any]]) -> Optional[Callable]:
        """load_weights mode: fn(step) after the step's last tensors went to
        on_weights and before the ack (e.g. process_weights_after_loading). If
        it raises, the step fails on this rank. Usable as a decorator."""
        self._core.on_loaded(fn)
        return fn

    def prepare(self) -> None:
        self._core.prepare()

    def run_step(self, timeout: float = 5.0) -> Optional[StepOutcome]:
        """Waits up to `timeout` s for a step to begin, then runs it to its
        decision: None when none began, else the outcome (.step, .committed,
        .reason, .bytes, .seconds)."""
        return self._core.run_step(timeout)

    def serve(self, poll: float = 0.2) -> None:
        """run_step until stop() (from a hook or another thread)."""
        self._stop.clear()
        while not self._stop.is_set():
            self._core.run_step(poll)

    def stop(self) -> None:
        self._stop.set()

    @property
    def version(self) -> int:
        """The last committed step, -1 before the first."""
        return self._core.version

    @property
    def global_rank(self) -> int:
        return self._core.global_rank

    def close(self) -> None:
        self._core.close()

    def __enter__(self) -> "Subscriber":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
