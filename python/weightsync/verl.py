"""weightsync as a verl checkpoint-engine backend (verl >= 0.9).

verl imports this module on every Ray worker that builds a checkpoint engine
(`rollout.checkpoint_engine.custom_backend_module`), which registers the
backend "weightsync" in verl's `CheckpointEngineRegistry`. Select it in
verl's config (docs/integrations/verl.md):

    actor_rollout_ref.rollout.checkpoint_engine.backend: weightsync
    actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module: weightsync.verl
    actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.weightsync.hf_config: ${actor_rollout_ref.model.path}

What runs where (verl's CheckpointEngineManager drives it, every step):

- Trainer ranks (verl builds them with `is_master`): `prepare()` on rank 0
  starts a weightsync coordinator in its process (once; or uses
  `coordinator`) and reads the model's HF config; `init_process_group()`
  records the coordinator and the engine config; `send_weights(weights)`
  pushes *this rank's own shards* through a `weightsync.Publisher`: the
  FSDP2 state dict (DTensors) that verl's weights generator iterates over,
  in HF names, found in the generator without running it (or given with
  `set_trainer_params`). By default the generator is first drained as verl
  requires (on every rank: FSDP's `full_tensor()` is a collective, and a
  generator may merge LoRA or raise); the bytes that move are the shards.
  A failure before the push (the generator raised) tears this job's
  weightsync connections down, so that the rollouts stop waiting at once
  and keep their weights; the next `prepare()` builds them anew.
- Rollout ranks (verl's CheckpointEngineWorker, without `is_master`):
  `init_process_group()` connects a `weightsync.Subscriber` (engine
  framework "hf": every HF tensor whole, replica = rank // tp) once and
  keeps it; `receive_weights()` stages the step's tensors and yields
  `(name, tensor)` only after the step committed: a step is delivered whole
  or not at all (nothing is yielded, and it raises, when it did not commit).
- `init_process_group()` is idempotent (verl calls it every step): the same
  topology keeps the connections; a changed one (a new coordinator after a
  failure) replaces them. `finalize()` keeps them for the next step;
  `close()` ends them.

Engine kwargs (`engine_kwargs.weightsync`; trainer and rollout get the same):
`hf_config` (the model: a directory, its config.json, or a dict; required),
`tp` (the rollout's tensor-parallel size: the ranks of a replica commit
together), `coordinator` ("HOST:PORT" of a running coordinator; default: one
in trainer rank 0's process on `coordinator_host`:`coordinator_port`),
`transport`, `token`, `job`, `mode` ("p2p" / "broadcast"), `drain` (False:
close verl's generator unrun, no full tensors at all: only for generators
without side effects), `connect_timeout`, `step_timeout`, `update_timeout`
(how long a rollout waits for a step to begin), `weights_device` (where a
rollout stages the step: "cpu" or "cuda:N"), `dtype` (the trainer's
parameter dtype when it is not the model's, e.g. "F32" for fp32 master
weights: weightsync does not cast; the rollout's load_weights does),
`publisher` / `subscriber`
(more keywords for them). verl's `update_weights_bucket_megabytes` is the
bucket size.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import json
import logging
import os
import socket
import time
from collections.abc import Mapping
from typing import Any, Optional

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from ._errors import Error

__all__ = ["BACKEND", "WeightsyncCheckpointEngine", "set_trainer_params"]

logger = logging.getLogger("weightsync.verl")

#: The name verl's config selects (rollout.checkpoint_engine.backend).
BACKEND = "weightsync"

_TRAINER_PARAMS: Optional[Any] = None

# engine_kwargs.weightsync.dtype: torch's names for safetensors' (the engine config's).
_DTYPES = {"float32": "F32", "fp32": "F32", "bfloat16": "BF16", "bf16": "BF16",
           "float16": "F16", "fp16": "F16", "torch.float32": "F32", "torch.bfloat16": "BF16",
           "torch.float16": "F16"}


def set_trainer_params(named_params: Any) -> None:
    """The tensors this trainer rank pushes, in HF names: a module, a mapping
    or (name, tensor) pairs (FSDP2's DTensors: each rank its local shard).
    Only needed where the weights generator verl passes does not iterate over
    a state dict (verl's FSDP engine does; Megatron's does not). None: find
    them in the generator again."""
    global _TRAINER_PARAMS
    if named_params is not None and hasattr(named_params, "named_parameters"):
        named_params = dict(named_params.state_dict())
    _TRAINER_PARAMS = named_params


def _is_tensor(x: Any) -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - verl needs torch
        return False
    return isinstance(x, torch.Tensor)


def _state_dict_in(weights: Any) -> Optional[dict]:
    """The {name: tensor} mapping a weights generator iterates over, found
    without running it: verl's FSDP engine returns a generator expression over
    `state_dict().items()` (wrapped by `unfuse_moe_params`, another generator);
    each generator's frame holds what it will iterate. None when there is no
    such mapping holding at least one DTensor."""
    from ._tensors import is_dtensor

    seen: set = set()
    todo = [weights]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, Mapping):
            if obj and all(isinstance(k, str) and _is_tensor(v) for k, v in obj.items()) \
                    and any(is_dtensor(v) for v in obj.values()):
                return dict(obj)
            continue
        frame = getattr(obj, "gi_frame", None) or getattr(obj, "ag_frame", None)
        if frame is not None:
            todo.extend(frame.f_locals.values())
        elif type(obj).__name__.endswith("iterator"):
            # The (ordered) dict an items() / values() iterator walks.
            todo.extend(r for r in gc.get_referents(obj) if isinstance(r, Mapping))
    return None


async def _drain(weights: Any) -> int:
    """Runs verl's weights generator to its end (sync or async), dropping the
    tensors; returns how many it yielded."""
    n = 0
    if hasattr(weights, "__aiter__"):
        async for _ in weights:
            n += 1
    else:
        for _ in weights:
            n += 1
            if n % 64 == 0:
                await asyncio.sleep(0)
    return n


def _close(weights: Any) -> int:
    """Closes verl's weights generator unrun; returns the tensors it yielded (0)."""
    close = getattr(weights, "close", None)
    if callable(close) and not inspect.iscoroutinefunction(close):
        close()
    return 0


def _hf_config_dict(hf_config: Any) -> dict:
    """The model's HF config as a dict: a dict, a config.json, a directory
    holding one, or a name transformers resolves (its cache)."""
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    if not isinstance(hf_config, (str, os.PathLike)):
        raise Error("invalid_argument", "weightsync verl backend: engine_kwargs.weightsync.hf_config "
                    "(the model: a directory, its config.json or a dict) is needed")
    path = os.fspath(hf_config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(os.fspath(hf_config)).to_dict()
    except Exception as e:  # noqa: BLE001 - reported with the path
        raise Error("io", f"weightsync verl backend: cannot read the HF config of "
                    f"'{hf_config}': {e}") from None


def _node_ip() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - not in Ray: this host's address
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _dist_rank() -> tuple:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise Error("invalid_argument", "weightsync verl backend: a trainer rank needs "
                    "torch.distributed initialized (verl's actor workers do that)")
    return dist.get_rank(), dist.get_world_size()


@CheckpointEngineRegistry.register(BACKEND)
class WeightsyncCheckpointEngine(CheckpointEngine):
    """verl's checkpoint engine "weightsync" (module docstring). verl builds
    trainer ranks with `is_master` and rollout ranks without it: that is how
    an instance knows its side."""

    def __init__(self, bucket_size: int = 256 << 20, is_master: Optional[bool] = None, *,
                 hf_config: Any = None, tp: int = 1, coordinator: Optional[str] = None,
                 coordinator_host: Optional[str] = None, coordinator_port: int = 0,
                 transport: str = "ucx", token: Optional[str] = None, job: str = "verl",
                 mode: str = "p2p", drain: bool = True, connect_timeout: float = 60.0,
                 step_timeout: float = 120.0, update_timeout: float = 300.0,
                 weights_device: Any = None, dtype: Optional[str] = None,
                 publisher: Optional[dict] = None,
                 subscriber: Optional[dict] = None, **unknown: Any) -> None:
        if unknown:
            raise Error("invalid_argument", "weightsync verl backend: unknown engine_kwargs "
                        f"{sorted(unknown)}")
        if int(tp) < 1:
            raise Error("invalid_argument", f"weightsync verl backend: tp must be >= 1, not {tp}")
        self.role = "rollout" if is_master is None else "trainer"
        self.is_master = bool(is_master)
        self.bucket_size = int(bucket_size)
        self.hf_config, self.tp = hf_config, int(tp)
        self.coordinator_address = coordinator
        self.coordinator_host, self.coordinator_port = coordinator_host, int(coordinator_port)
        self.transport, self.token, self.job, self.mode = transport, token, job, mode
        self.drain = bool(drain)
        self.connect_timeout, self.step_timeout = float(connect_timeout), float(step_timeout)
        self.update_timeout = float(update_timeout)
        self.weights_device = weights_device
        self.dtype = _DTYPES.get(str(dtype), str(dtype)) if dtype is not None else None
        self.publisher_kwargs, self.subscriber_kwargs = dict(publisher or {}), dict(subscriber or {})
        # Trainer rank 0: the coordinator it runs (None: `coordinator` given).
        self._coordinator: Any = None
        self._hf_dict: Optional[dict] = None
        # What init_process_group set up, and for which topology.
        self._topology: Optional[tuple] = None
        self._pub: Any = None
        self._pub_key: Optional[tuple] = None
        self._sub: Any = None
        self._staged: dict = {}
        self._step = 0
        self.last_metrics: dict = {}

    # ---- verl's protocol ---------------------------------------------------------

    def prepare(self) -> dict:
        """Metadata for build_topology: the trainer ranks' torch ranks; rank 0
        adds the coordinator's address (started here once) and the model's
        HF config."""
        if self.role == "rollout":
            return {"role": "rollout"}
        rank, world = _dist_rank()
        meta: dict = {"role": "trainer", "rank": rank, "world": world}
        if self.is_master:
            if self.coordinator_address is None or (self._coordinator is not None
                                                    and self._coordinator.closed):
                self._start_coordinator()
            if self._hf_dict is None:
                self._hf_dict = _hf_config_dict(self.hf_config)
            meta.update(coordinator=self.coordinator_address, hf_config=self._hf_dict, tp=self.tp,
                        dtype=self.dtype)
        return meta

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list) -> tuple:
        """Every rank's arguments to init_process_group: the coordinator, the
        engine config (framework "hf": one replica per `tp` rollout ranks, in
        the manager's order) and each rank's place in it."""
        trainers, rollouts = metadata[:actor_wg_world_size], metadata[actor_wg_world_size:]
        if len(rollouts) != rollout_world_size or any(m.get("role") != "trainer" for m in trainers) \
                or any(m.get("role") != "rollout" for m in rollouts):
            raise Error("invalid_argument", "weightsync verl backend: build_topology expects the "
                        f"{actor_wg_world_size} trainer ranks' metadata, then the "
                        f"{rollout_world_size} rollout ranks'; got roles "
                        f"{[m.get('role') for m in metadata]}")
        master = next((m for m in trainers if "coordinator" in m), None)
        if master is None:
            raise Error("invalid_argument", "weightsync verl backend: no trainer rank is the master "
                        "(verl builds trainer rank 0 with is_master=True)")
        tp = int(master["tp"])
        if rollout_world_size % tp:
            raise Error("invalid_argument", f"weightsync verl backend: {rollout_world_size} rollout "
                        f"ranks are not whole replicas of tp={tp}")
        engine = {"framework": "hf", "hf_config": master["hf_config"], "tp": tp,
                  "replicas": rollout_world_size // tp}
        if master.get("dtype"):
            engine["dtype"] = master["dtype"]
        coordinator = master["coordinator"]
        actor = {"coordinator": [coordinator] * actor_wg_world_size,
                 "engine": [engine] * actor_wg_world_size,
                 "rank": [int(m["rank"]) for m in trainers]}
        rollout = {"coordinator": [coordinator] * rollout_world_size,
                   "engine": [engine] * rollout_world_size,
                   "replica": [i // tp for i in range(rollout_world_size)],
                   "rank": [i % tp for i in range(rollout_world_size)]}
        return actor, rollout

    def init_process_group(self, coordinator: str, engine: dict, rank: int,
                           replica: Optional[int] = None) -> None:
        """Idempotent: the same topology as the last call keeps everything; a
        new one (another coordinator, engine or place) replaces it."""
        key = (coordinator, json.dumps(engine, sort_keys=True), int(rank),
               None if replica is None else int(replica))
        if key == self._topology and (self.role == "trainer" or self._sub is not None):
            return
        self._close_connections()
        self._topology = key
        self.coordinator_address = coordinator
        self._engine = engine
        self._rank, self._replica = int(rank), replica
        if self.role == "rollout":
            self._connect_subscriber()
        # Trainer: the Publisher is made at the first send (it registers the
        # shards that the weights generator iterates over).

    async def send_weights(self, weights: Any, global_steps: Optional[int] = None) -> dict:
        """Trainer rank: drains verl's generator (unless drain=False), then
        pushes this rank's shards as step `global_steps`; returns verl's sync
        metrics. Raises when the step did not commit on every rollout rank."""
        if self.role != "trainer":
            raise Error("invalid_argument", "weightsync verl backend: send_weights on a rollout rank")
        if self._topology is None:
            raise Error("invalid_argument", "weightsync verl backend: send_weights before "
                        "init_process_group")
        step = self._next_step(global_steps)
        t0 = time.perf_counter()
        params = _TRAINER_PARAMS if _TRAINER_PARAMS is not None else _state_dict_in(weights)
        try:
            if params is None:
                raise Error("unsupported", "weightsync verl backend: the weights generator verl "
                            "passed iterates over no state dict of DTensors (FSDP2's); call "
                            "weightsync.verl.set_trainer_params(module or named tensors) on each "
                            "trainer rank")
            yielded = await _drain(weights) if self.drain else _close(weights)
            t_drain = time.perf_counter()
            pub = self._publisher(params)
            t_setup = time.perf_counter()
            res = await asyncio.to_thread(pub.push, step)
        except BaseException as e:
            reason = f"trainer rank {self._rank}: step {step} failed before it was sent: {e!r}"
            logger.warning("weightsync verl backend: %s; tearing the job's connections down "
                           "(the rollouts keep their weights)", reason)
            self._teardown()
            if isinstance(e, Error) and "but the trainer holds" in str(e):
                raise Error(e.code, f"{e} (weightsync does not cast: set engine_kwargs."
                            "weightsync.dtype to the trainer's parameter dtype, e.g. F32 for "
                            "fp32 master weights; the rollout's load_weights casts)") from e
            raise
        t_end = time.perf_counter()
        metrics = {"weightsync/step": step, "weightsync/seconds": t_end - t0,
                   "weightsync/push_seconds": res.seconds, "weightsync/drain_seconds": t_drain - t0,
                   "weightsync/setup_seconds": t_setup - t_drain,
                   "weightsync/bytes_sent": res.bytes_sent,
                   "weightsync/committed_ranks": len(res.committed),
                   "weightsync/drained_tensors": yielded or 0}
        self.last_metrics = metrics
        if res.failed:
            raise Error("peer_failure", f"weightsync verl backend: step {step} did not commit on "
                        f"rollout ranks {[r for r, _ in res.failed]}: {res.failed[0][1]} (they "
                        "keep their previous weights)")
        out = metrics if self._rank == 0 else {"weightsync/step": step}
        out[f"weightsync/bytes_sent/rank{self._rank}"] = res.bytes_sent
        return out

    async def receive_weights(self, global_steps: Optional[int] = None):
        """Rollout rank: waits for the step, stages its tensors, and yields
        (name, tensor) only once it committed, then all of them; raises,
        having yielded nothing, when it did not commit."""
        if self.role != "rollout":
            raise Error("invalid_argument", "weightsync verl backend: receive_weights on a "
                        "trainer rank")
        if self._sub is None:
            raise Error("invalid_argument", "weightsync verl backend: receive_weights before "
                        "init_process_group")
        step = self._next_step(global_steps)
        self._staged = {}
        deadline = time.monotonic() + self.update_timeout
        out = None
        while out is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Error("timeout", f"weightsync verl backend: rollout rank {self._rank} of "
                            f"replica {self._replica}: step {step} did not begin in "
                            f"{self.update_timeout:.0f} s (update_timeout)")
            try:
                out = await self._sub.run_step_async(timeout=min(1.0, left))
            except Error as e:
                self._staged = {}
                self._close_connections()  # the next init_process_group reconnects
                raise type(e)(e.code, f"weightsync verl backend: rollout rank {self._rank} of "
                              f"replica {self._replica}: step {step} was not received: {e} "
                              "(a trainer gave the step up, or the job's coordinator went away; "
                              "nothing was handed to the rollout: it keeps its weights)") from e
            except BaseException:
                self._staged = {}
                self._close_connections()
                raise
        staged, self._staged = self._staged, {}
        if not out.committed:
            raise Error("peer_failure", f"weightsync verl backend: rollout rank {self._rank} of "
                        f"replica {self._replica}: step {out.step} was not committed: "
                        f"{out.reason} (nothing was handed to the rollout: it keeps its weights)")
        self.last_metrics = {"weightsync/step": out.step, "weightsync/seconds": out.seconds,
                             "weightsync/bytes": out.bytes, "weightsync/tensors": len(staged)}
        for name in list(staged):
            yield name, staged.pop(name)

    def finalize(self) -> None:
        """Keeps the connections for the next step (verl calls it every
        step); drops a rollout's staged tensors."""
        self._staged = {}

    def close(self) -> None:
        """Ends this rank's connections (and trainer rank 0's coordinator)."""
        self._close_connections()
        self._topology = None
        if self._coordinator is not None:
            self._coordinator.close()
            self._coordinator = None

    def __del__(self) -> None:  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    # ---- internals -----------------------------------------------------------------

    def _next_step(self, global_steps: Optional[int]) -> int:
        self._step = int(global_steps) if global_steps is not None else self._step + 1
        return self._step

    def _start_coordinator(self) -> None:
        import weightsync as ws

        if self._coordinator is not None:
            self._coordinator.close()
        host = self.coordinator_host or _node_ip()
        self._coordinator = ws.Coordinator(host=host, port=self.coordinator_port, token=self.token)
        self.coordinator_address = self._coordinator.address
        logger.info("weightsync verl backend: coordinator at %s", self.coordinator_address)

    def _publisher(self, params: Any) -> Any:
        """This rank's Publisher, made (or remade, when the tensors moved:
        an offload reallocates them) for `params`."""
        import weightsync as ws
        import weightsync.torch as wst

        from ._tensors import local_tensor

        items = list(params.items()) if isinstance(params, Mapping) else list(params)
        key = tuple((n, local_tensor(t).data_ptr()) for n, t in items)
        if self._pub is not None and key == self._pub_key:
            return self._pub
        if self._pub is not None:
            self._pub.close()
            self._pub = None
        model_type = (self._engine.get("hf_config") or {}).get("model_type")
        layout = wst.trainer_layout(items, model_type=model_type)
        kwargs: dict[str, Any] = dict(
            transport=self.transport, mode=self.mode, bucket_bytes=self.bucket_size,
            token=self.token, job=self.job, connect_timeout=self.connect_timeout,
            step_timeout=self.step_timeout, coordinator_reconnect=0.0)
        kwargs.update(self.publisher_kwargs)
        pub = ws.Publisher(coordinator=str(self.coordinator_address), rank=self._rank,
                           layout=layout, engine=self._engine, **kwargs)
        try:
            for name, tensor in items:
                pub.register(name, tensor)
        except BaseException:
            pub.close()
            raise
        self._pub, self._pub_key = pub, key
        return pub

    def _connect_subscriber(self) -> None:
        import weightsync as ws

        kwargs: dict[str, Any] = dict(
            transport=self.transport, token=self.token, job=self.job,
            connect_timeout=self.connect_timeout, step_timeout=self.step_timeout,
            weights_device=self.weights_device,
            # This backend closes its coordinator when a step fails before it
            # was sent (_teardown) and builds a new job at the next sync: its
            # ranks must see the loss at once, not wait for that coordinator
            # to come back (docs/usage.md, "The coordinator dies").
            coordinator_reconnect=0.0)
        kwargs.update(self.subscriber_kwargs)
        sub = ws.Subscriber(coordinator=str(self.coordinator_address), engine=self._engine,
                            replica=int(self._replica or 0), rank=self._rank, **kwargs)

        @sub.on_weights
        def stage(batch: list) -> None:  # views valid during the call only
            for name, tensor in batch:
                self._staged[name] = tensor.clone()

        self._sub = sub

    def _close_connections(self) -> None:
        for attr in ("_pub", "_sub"):
            obj = getattr(self, attr)
            setattr(self, attr, None)
            if obj is not None:
                try:
                    obj.close()
                except Exception as e:  # noqa: BLE001 - closing what already failed
                    logger.debug("weightsync verl backend: closing %s: %s", attr, e)
        self._pub_key = None

    def _teardown(self) -> None:
        """A failed send: this rank's Publisher goes (a step it began aborts
        on every rollout); rank 0 also closes the coordinator it runs, so the
        rollouts waiting for this step stop now. prepare() builds anew."""
        self._close_connections()
        self._topology = None
        if self._coordinator is not None:
            self._coordinator.close()
