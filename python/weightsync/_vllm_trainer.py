"""weightsync as vLLM's TRAINER-side weight-transfer engine (vLLM >= 0.32:
`vllm.distributed.weight_transfer`), registered as "weightsync" in
`WeightTransferTrainerFactory` by the same `vllm.general_plugins` entry point
as the worker side (weightsync.vllm:register_plugin), and by importing this
module. docs/integrations/vllm.md is the guide.

    from vllm.distributed.weight_transfer import (HTTPVLLMWeightSyncClient, ModuleSource,
                                                  WeightTransferTrainerFactory)
    from weightsync._vllm_trainer import WeightsyncTrainerInitInfo

    engine = WeightTransferTrainerFactory.trainer_init(
        WeightsyncTrainerInitInfo(rank=dist.get_rank()),          # on every trainer rank
        client=HTTPVLLMWeightSyncClient("http://inference:8000"), source=ModuleSource(model))
    for step in ...:
        ...  # optimizer step
        engine.send_weights()                                     # on every trainer rank

The server runs `vllm serve MODEL --weight-transfer-config '{"backend":
"weightsync"}'` with VLLM_SERVER_DEV_MODE=1 (vLLM mounts its weight-transfer
routes only then).

What it does. `trainer_init`, on every rank: the trainer layout from the
source's live tensors (`weightsync.torch.trainer_layout`: DTensors become
LoadSpec shards, so FSDP2 ranks each send their own shard and nothing is
all-gathered), a `weightsync.Publisher` per rank registered on those tensors,
connected to the coordinator of `init_info.coordinator`, or to one this
engine starts on rank 0 (shared with the other ranks through
torch.distributed); then, on rank 0 only, the client's
`init_weight_transfer_engine` with the worker-side init_info
(`weightsync._vllm_transfer.WeightsyncInitInfo`: the coordinator, the engine
config, the replica, ...). `send_weights()`, on every rank: each rank pushes
step k (`Publisher.push(k)`); rank 0 drives the server meanwhile:
the swap below. A step that does not commit raises weightsync's error on
every rank (rank 0: the error the vLLM worker raised, read back from vLLM's
text by weightsync.vllm.worker_error, where the server took part); the
server keeps its previous version.

Staged (`staged=True`, the default): the server's workers receive step k on
a background thread while the server serves k-1 (the worker engine's
`staged`); once every rank's push returned committed, rank 0 swaps it in:
POST /pause (mode "keep": nothing steps, requests stay), the session
`start_weight_update`, `update_weights({"step": k})` (the workers apply the
staged copy through vLLM's layerwise reload), `finish_weight_update(
weight_version=str(k))`, the prefix-cache reset, POST /resume. Serving stops
for the swap only; a step that fails before it changes nothing the server
serves. Blocking (`staged=False`): the same pause, then `update_weights`
runs concurrently with the push (vLLM's loop is held for the whole
transfer), then the reset and the resume.

In-flight requests at the swap (`in_flight`): "recompute" (default): the
reset is `reset_prefix_cache(reset_running_requests=True)`: vLLM preempts
the running requests, drops every cached block, and recomputes their KV
with the new weights at resume (their tokens before the swap stay: version
k-1 made them); "abort": POST /pause?mode=abort: they end at once
(finish_reason "abort"), the cache is dropped; "keep": they continue on the
new weights over the KV the old weights computed, and vLLM 0.32 refuses to
reset a prefix cache whose blocks running requests hold
(`prefix_cache_reset: False`): new requests may then hit cached KV of the
old weights unless the client salts them per version (`cache_salt`). In
every mode requests that arrive during the swap wait for the resume, and
with a reset no KV computed by the old weights serves a request that starts
after it.

Sources that are not modules (`WeightSource` without `module`, e.g. an
export that materialises full tensors): rank 0 is then a one-rank trainer:
every rank iterates the source each step (vLLM's contract: iterating is a
collective), rank 0 copies what it yields into tensors it registered once,
and pushes those.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

from vllm.distributed.weight_transfer.base import (ModuleSource, TrainerInitInfo,
                                                   TrainerWeightTransferEngine, WeightSource)

from ._errors import Error
from ._vllm_common import ENGINE_NAME, worker_error
from ._vllm_server import ServerSwap, check_in_flight
from .vllm import register_weight_transfer_engine

__all__ = ["WeightsyncTrainerEngine", "WeightsyncTrainerInitInfo"]

logger = logging.getLogger("weightsync.vllm")


@dataclass
class WeightsyncTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init_info of backend "weightsync" (every trainer rank
    passes its own `rank`: its rank in the default torch.distributed group,
    whose rank 0 is the sender). What vLLM's trainer API does not carry rides
    here:

    - `engine`: the engines' config (weightsync's JSON: path, dict or text;
      docs/usage.md). None: `{"framework": "hf", "hf_config": the source
      module's `config` (transformers), "tp": tp, "replicas": 1}`: every HF
      tensor goes whole to vLLM's own `load_weights` on each of the server's
      `tp` workers. `tp` must then be the server's tensor-parallel size.
      Sent to the server inline (hf_config paths are read here).
    - `replica`: which replica of `engine` the client's server is.
    - `coordinator`: "HOST:PORT" of a running weightsync coordinator; None:
      rank 0 starts one in this process on `coordinator_host`:
      `coordinator_port` (0: any free port; "0.0.0.0": every interface,
      advertised as this host's address) for as long as the engine lives.
    - `layout`: the trainer layout (None: from the source's tensors).
    - `transport`, `token`, `job`, `connect_timeout`, `step_timeout`: both
      sides' (the workers get `transport` without a `fault:` wrapper).
    - `publisher`: more Publisher keywords (bucket_bytes, mode, delta, ...).
    - `worker`: more fields of the workers' init_info (mode, keep_previous,
      adapters, transport, ...; weightsync._vllm_transfer.WeightsyncInitInfo).
    - `update_timeout`: how long the workers wait for a step to begin.
    - `first_step`: the step of the first send_weights() (then +1 each).
    - `reset_prefix_cache`: reset the server's prefix cache at each swap
      (where the client can: a `reset_prefix_cache()` method, or an HTTP
      client's server, POST /reset_prefix_cache).
    - `staged`: the workers receive each step while the server serves and
      the swap only applies it (module docstring); False: the workers
      receive inside update_weights (the server stops for the transfer).
      Sets the workers' `staged` (not to be overridden in `worker`).
    - `in_flight`: what the swap does to running requests: "recompute",
      "abort" or "keep" (module docstring).
    - `staging_device`: non-module sources: where rank 0 keeps the copy it
      pushes.
    """

    backend: ClassVar[str] = ENGINE_NAME

    engine: Any = None
    tp: int = 1
    replica: int = 0
    coordinator: Optional[str] = None
    coordinator_host: str = "127.0.0.1"
    coordinator_port: int = 0
    layout: Any = None
    transport: str = "ucx"
    token: Optional[str] = None
    job: str = "weightsync"
    connect_timeout: float = 60.0
    step_timeout: float = 120.0
    update_timeout: float = 120.0
    first_step: int = 1
    reset_prefix_cache: bool = True
    staged: bool = True
    in_flight: str = "recompute"
    staging_device: str = "cpu"
    publisher: dict = field(default_factory=dict)
    worker: dict = field(default_factory=dict)


def _module_of(source: Any) -> Any:
    """The torch module behind a source (vLLM's ModuleSource, or a module
    itself), or None."""
    if isinstance(source, ModuleSource):
        return source._module
    if hasattr(source, "named_parameters") and hasattr(source, "state_dict"):
        return source
    return getattr(source, "module", None)


def _inner_transport(transport: str) -> str:
    """`transport` without a fault-injecting wrapper (the workers' default)."""
    while transport.startswith("fault:"):
        transport = transport[len("fault:"):].split("?", 1)[0]
    return transport


def _inline_engine(engine: Any) -> Any:
    """The engine config as JSON-ready data with every hf_config inline (the
    server does not see this machine's files)."""
    from ._common import load_json

    text, base = load_json(engine, "engine config")
    config = json.loads(text)
    for group in config if isinstance(config, list) else [config]:
        hf = group.get("hf_config") if isinstance(group, dict) else None
        if isinstance(hf, str):
            path = hf if os.path.isabs(hf) else os.path.join(base, hf)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            try:
                with open(path, encoding="utf-8") as f:
                    group["hf_config"] = json.load(f)
            except OSError as e:
                raise Error("io", f"engine config: cannot read hf_config '{path}': "
                            f"{e.strerror}") from None
    return config


def _default_engine(module: Any, info: WeightsyncTrainerInitInfo) -> dict:
    config = getattr(module, "config", None) if module is not None else None
    if config is None or not hasattr(config, "to_json_string"):
        raise Error("invalid_argument", "weightsync trainer engine: init_info 'engine' (the "
                    "engines' config) is needed: the source has no transformers config to "
                    "build the default {'framework': 'hf', ...} from")
    if info.replica != 0:
        raise Error("invalid_argument", f"weightsync trainer engine: replica {info.replica} "
                    "needs init_info 'engine' (the default config has one replica)")
    return {"framework": "hf", "hf_config": json.loads(config.to_json_string()),
            "tp": int(info.tp), "replicas": 1}


def _is_derived(engine: Any) -> bool:
    return isinstance(engine, dict) and engine.get("framework") == "derived"


def _server_error(error: BaseException) -> BaseException:
    """An exception whose text is what the server said: an HTTP client's
    exception carries only the status; vLLM's message is in the body."""
    response = getattr(error, "response", None)
    if response is None:
        return error
    try:
        body = response.json()
    except ValueError:
        body = None
    message = None
    if isinstance(body, dict):
        info = body.get("error")
        message = (info.get("message") if isinstance(info, dict) else info) or body.get("detail")
    message = message or response.text
    return RuntimeError(f"HTTP {response.status_code}: {message}")


def _dist() -> Any:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


class WeightsyncTrainerEngine(TrainerWeightTransferEngine[WeightsyncTrainerInitInfo]):
    """The trainer's end of weightsync behind vLLM's trainer API (the module
    docstring says what each call does). `send_weights()` returns a dict:
    {"step", "seconds" (the whole round trip), "push_seconds", "bytes_sent"
    (this rank's), "committed", "prefix_cache_reset" (rank 0: True, False
    when the server refused, None when not done); rank 0 also "staged",
    "in_flight", "pause_seconds" (from the pause request to the resume's
    answer: the server stopped serving within it) and "requests" (each
    request running at the swap, by the engine's request id -> the index of
    its first output token made by this step; None when the workers did not
    report)}."""

    init_info_cls = WeightsyncTrainerInitInfo

    def __init__(self, *, client: Any, source: Any, is_sender: bool,
                 init_info: WeightsyncTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.init_info = init_info
        self.publisher: Any = None
        self.coordinator: Any = None  # the one this engine started
        self.address: Optional[str] = None
        self.engine_config: Any = None
        self.next_step = int(init_info.first_step)
        self.last: Optional[dict] = None
        self._module: Any = None
        self._staged: Optional[dict] = None  # non-module sources: rank 0's copy
        self._server_engine = False
        self._swap = ServerSwap(client, check_in_flight(init_info.in_flight),
                                init_info.reset_prefix_cache)

    @classmethod
    def trainer_init(cls, init_info: WeightsyncTrainerInitInfo, *, client: Any,
                     source: Optional[WeightSource] = None) -> WeightsyncTrainerEngine:
        if source is None:
            raise Error("invalid_argument", "weightsync trainer engine: a WeightSource is needed "
                        "(vLLM's ModuleSource(model), FSDP2 or not)")
        if not isinstance(init_info, WeightsyncTrainerInitInfo):
            raise Error("invalid_argument", "weightsync trainer engine: init_info must be a "
                        f"WeightsyncTrainerInitInfo, got {type(init_info).__name__}")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender,
                     init_info=init_info)
        try:
            engine._init()
        except BaseException:
            engine.shutdown()
            raise
        return engine

    # -- trainer_init ---------------------------------------------------------

    def _init(self) -> None:
        info = self.init_info
        self._module = _module_of(self.source)
        dist = _dist()
        if self._module is not None and dist is not None and dist.get_rank() != info.rank:
            raise Error("invalid_argument", f"weightsync trainer engine: init_info rank is "
                        f"{info.rank}, but this process is rank {dist.get_rank()} of "
                        "torch.distributed's default group (the layout's mesh is read from "
                        "it): pass rank=dist.get_rank()")
        # Which ranks publish: every rank of a module source (each its own
        # shards), rank 0 alone for other sources (full tensors).
        publishes = self._module is not None or self.is_sender
        self.address = self._coordinator_address(share=self._module is not None)
        if publishes:
            self.engine_config = (_inline_engine(info.engine) if info.engine is not None
                                  else _default_engine(self._module, info))
        if publishes:
            self._open_publisher()
        if self.is_sender:
            self._init_server()

    def _coordinator_address(self, share: bool) -> Optional[str]:
        info = self.init_info
        if info.coordinator:
            return info.coordinator
        address = None
        if self.is_sender:
            from ._coordinator import Coordinator

            self.coordinator = Coordinator(host=info.coordinator_host,
                                           port=info.coordinator_port, token=info.token)
            host = info.coordinator_host
            if host in ("0.0.0.0", "::", ""):
                host = socket.gethostbyname(socket.gethostname())
            address = f"{host}:{self.coordinator.port}"
        if not share:
            return address
        dist = _dist()
        if dist is None or dist.get_world_size() == 1:
            if not self.is_sender:
                raise Error("invalid_argument", "weightsync trainer engine: rank "
                            f"{info.rank} needs init_info 'coordinator' (rank 0 starts one only "
                            "where torch.distributed can share its address)")
            return address
        box = [address]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _open_publisher(self) -> None:
        import weightsync.torch as wst

        from ._publisher import Publisher

        info = self.init_info
        staged: dict = {}
        if self._module is not None:
            layout = info.layout if info.layout is not None else wst.trainer_layout(self._module)
            rank = info.rank
        else:
            staged, own_layout = self._staging_layout()
            layout = info.layout if info.layout is not None else own_layout
            rank = 0
        assert self.address is not None  # a publishing rank knows the coordinator
        engine = None if _is_derived(self.engine_config) else self.engine_config
        self.publisher = Publisher(coordinator=self.address, rank=rank, layout=layout,
                                   engine=engine, transport=info.transport, token=info.token,
                                   job=info.job, connect_timeout=info.connect_timeout,
                                   step_timeout=info.step_timeout, **info.publisher)
        if self._module is not None:
            self.publisher.register_module(self._module)
        else:
            for name, tensor in staged.items():
                self.publisher.register(name, tensor)
            self._staged = staged

    def _staging_layout(self) -> tuple:
        """Rank 0 of a non-module source: ({name: tensor}: one per metadata
        entry, registered once and refilled each step, a one-rank layout of
        them)."""
        import torch

        import weightsync.torch as wst

        if self.source.held_names() is not None:
            raise Error("unsupported", "weightsync trainer engine: a WeightSource whose ranks "
                        "hold parts of the model (held_names) and is not a module: give "
                        "ModuleSource(model) (each rank pushes its own shards) or init_info "
                        "'layout'")
        device = self.init_info.staging_device
        staged = {m.name: torch.empty(tuple(m.shape), dtype=m.dtype, device=device)
                  for m in self.source.metadata()}
        return staged, wst.trainer_layout(list(staged.items()), world_size=1)

    def _worker_init_info(self) -> dict:
        info = self.init_info
        out = {"coordinator": self.address, "engine": self.engine_config,
               "replica": info.replica, "transport": _inner_transport(info.transport),
               "token": info.token, "job": info.job, "connect_timeout": info.connect_timeout,
               "step_timeout": info.step_timeout}
        out.update(info.worker)
        out["staged"] = bool(info.staged)  # the order of send_weights depends on it
        return out

    def _init_server(self) -> None:
        try:
            self.client.init_weight_transfer_engine(self._worker_init_info())
        except Exception as e:  # noqa: BLE001 - turned into weightsync's own error
            raise worker_error(_server_error(e), "init_weight_transfer_engine") from e
        self._server_engine = True

    # -- send_weights ---------------------------------------------------------

    def send_weights(self, step: Optional[int] = None) -> dict:
        """One step on every trainer rank: step `step` (None: the next one,
        init_info.first_step first). Raises weightsync's error when it did
        not commit; the server then keeps its version."""
        k = self.next_step if step is None else int(step)
        self.next_step = k + 1
        start = time.monotonic()
        if self._staged is not None or (self._module is None and not self.is_sender):
            self._fill_staged()
        if self.publisher is None:  # a non-sender rank of a non-module source
            return {"step": k, "seconds": time.monotonic() - start}
        if not self.is_sender:
            res, error = self._push(k)
            if error is not None:
                raise error
            self._check(k, res)
            return self._result(k, start, res, None)

        if self.init_info.staged:
            # The workers stage the step while the server serves; the swap
            # only applies it, once committed everywhere.
            res, push_error = self._push(k)
            if push_error is not None:
                raise push_error
            self._check(k, res)
            swapped = self._swap.swap(lambda: self._session(k, None))
            return self._result(k, start, res, swapped)
        box: dict = {}
        swapped = self._swap.swap(lambda: self._session(k, box))
        res, push_error = box["push"]
        if push_error is not None:
            raise push_error
        self._check(k, res)
        return self._result(k, start, res, swapped)

    def _session(self, k: int, box: Optional[dict]) -> None:
        """vLLM's update session for step k: start, update_weights (with
        `box`: concurrently with this rank's push, whose (result, error) it
        receives; the workers then receive inside the call), finish."""
        try:
            self.client.start_weight_update()
        except Exception as e:  # noqa: BLE001 - turned into weightsync's own error
            raise worker_error(_server_error(e), "start_weight_update") from e
        update = {"step": k, "timeout": float(self.init_info.update_timeout)}
        server_error = None
        if box is None:
            try:
                self.client.update_weights(update)
            except Exception as e:  # noqa: BLE001 - turned into weightsync's own error
                server_error = e
        else:
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weightsync-update")
            try:
                server = pool.submit(self.client.update_weights, update)
                box["push"] = self._push(k)
                try:
                    server.result()
                except Exception as e:  # noqa: BLE001 - turned into weightsync's own error
                    server_error = e
            finally:
                pool.shutdown(wait=False)
        if server_error is not None:
            # vLLM ended the session of every worker whose update_weights
            # raised (weightsync fails a step on all ranks of a replica).
            push_error = box["push"][1] if box is not None else None
            error = worker_error(_server_error(server_error), "update_weights")
            raise error from (push_error or server_error)
        try:
            self.client.finish_weight_update(weight_version=str(k))
        except Exception as e:  # noqa: BLE001 - turned into weightsync's own error
            raise worker_error(_server_error(e), "finish_weight_update") from e

    def _fill_staged(self) -> None:
        """Iterates the source (a collective on every rank); rank 0 copies it
        into its registered tensors, checked against metadata()."""
        if self._staged is None:
            for _ in self.source:
                pass
            return
        names = list(self._staged)
        seen = 0
        for name, tensor in self.source:
            if seen >= len(names) or name != names[seen]:
                raise Error("mismatch", f"weightsync trainer engine: the WeightSource yielded "
                            f"{name!r} at {seen}, metadata() declared "
                            f"{names[seen] if seen < len(names) else 'nothing more'}")
            dst = self._staged[name]
            if tuple(tensor.shape) != tuple(dst.shape) or tensor.dtype != dst.dtype:
                raise Error("mismatch", f"weightsync trainer engine: {name!r}: the source yielded "
                            f"{tensor.dtype} {tuple(tensor.shape)}, metadata() declared "
                            f"{dst.dtype} {tuple(dst.shape)}")
            dst.copy_(tensor)
            seen += 1
        if seen != len(names):
            raise Error("mismatch", f"weightsync trainer engine: the WeightSource yielded {seen} "
                        f"tensors, metadata() declared {len(names)}")

    def _push(self, k: int) -> tuple:
        try:
            return self.publisher.push(k), None
        except Error as e:
            return None, e

    def _check(self, k: int, res: Any) -> None:
        if res.failed:
            rank, reason = res.failed[0]
            raise Error("peer_failure", f"weightsync: step {k} was not committed on engine rank "
                        f"{rank}: {reason} ({len(res.failed)} engine ranks failed, committed: "
                        f"{list(res.committed)})")

    def _result(self, k: int, start: float, res: Any, swapped: Optional[dict]) -> dict:
        self.last = {"step": k, "seconds": time.monotonic() - start,
                     "push_seconds": res.seconds, "bytes_sent": res.bytes_sent,
                     "committed": list(res.committed), "prefix_cache_reset": None}
        if swapped is not None:
            self.last.update(swapped, staged=bool(self.init_info.staged),
                             in_flight=self.init_info.in_flight,
                             requests=self._applied_requests(k))
        return self.last

    def _applied_requests(self, k: int) -> Optional[dict]:
        """What the server's workers reported when they applied step k: each
        request running at the swap (the engine's request id) -> the index
        of its first token made by k; from the lowest engine rank of this
        server's replica that reported k (its ranks run the same requests;
        other servers may share the coordinator). None when none did (a
        server without weightsync's workers, or the coordinator could not
        be asked)."""
        from ._coordinator import status

        if self.address is None:
            return None
        try:
            members = status(self.address, token=self.init_info.token)["members"]
        except Error as e:
            logger.warning("weightsync: step %d: the coordinator could not say which requests "
                           "ran across the swap: %s", k, e)
            return None
        for m in sorted(members, key=lambda m: m.get("rank", 0)):
            applied = m.get("applied")
            if (m.get("role") == "engine" and m.get("replica") == self.init_info.replica
                    and applied and applied.get("step") == k):
                return dict(applied["requests"])
        return None

    # -- shutdown -------------------------------------------------------------

    def shutdown(self) -> None:
        """Ends the server's weightsync engine (rank 0, where the client can),
        this rank's Publisher, and the coordinator this engine started."""
        if self._server_engine:
            self._server_engine = False
            stop = getattr(self.client, "shutdown_weight_transfer_engine", None)
            if callable(stop):
                try:
                    stop()
                except Exception as e:  # noqa: BLE001 - best effort at teardown
                    logger.warning("weightsync: shutdown_weight_transfer_engine failed: %s",
                                   _server_error(e))
        if self.publisher is not None:
            self.publisher.close()
            self.publisher = None
        if self.coordinator is not None:
            self.coordinator.close()
            self.coordinator = None


# Importing this module (for WeightsyncTrainerInitInfo) makes the backend
# known in processes where vLLM did not load its plugins (a trainer).
register_weight_transfer_engine()
