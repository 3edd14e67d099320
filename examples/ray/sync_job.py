"""A multi-node weightsync job on Ray: FSDP2 trainer actors push their weights
into engine actors after every optimizer step, each step checked bit for bit.

    .venv/bin/python examples/ray/sync_job.py            # its own local 2-node Ray cluster
    .venv/bin/python examples/ray/sync_job.py --json --kill-engine 1:2
    RAY_ADDRESS=10.0.0.1:6379 .venv/bin/python examples/ray/sync_job.py   # an existing cluster

What runs where (docs/integrations/ray.md):
- Without RAY_ADDRESS the driver starts a local cluster (ray.cluster_utils.Cluster)
  of a head node with the custom resource {"trainer_node": 1} and one or more
  nodes with {"engine_node": 1}; with RAY_ADDRESS it joins that cluster (nodes
  may carry those resources; if not, Ray places the groups where CPUs are free).
- The weightsync Coordinator runs in a named actor ("weightsync-coordinator")
  pinned to the trainer node; it binds ray.util.get_node_ip_address() and a
  port found free there, and the driver hands its address to every actor.
  Ray restarts it (max_restarts) on the same port: the trainers and engines
  reach it again and register as the same members (docs/usage.md, "The
  coordinator dies"). `--kill-coordinator S` ray.kill()s it just before step
  S; every engine serves on meanwhile and step S commits everywhere.
- The trainer actors (one per rank, FSDP2 `fully_shard` of a transformers
  Qwen3 model; gloo on CPU, NCCL when the trainer node has a GPU per rank)
  live in one placement group on the trainer node. torch.distributed's
  master is trainer rank 0's node IP and a free port found there.
- The engine actors (replicas x tp, each a weightsync.Subscriber holding the
  params of its own Qwen3 module, framework "hf": every HF tensor whole) live
  in a second placement group on the engine node(s).
- Every step: the trainers take a real AdamW step, rank 0 hashes every full
  parameter (DTensor.full_tensor()), both push (elastic publishers: replicas
  may leave and join between steps); every engine that committed returns the
  hashes of its tensors, which the driver compares with the trainer's.
- `--kill-engine R:S` ends engine rank R's process inside step S (os._exit in
  its on_begin hook; `--kill-how ray` instead ray.kill()s it just before
  step S). Ray restarts the actor (max_restarts), the new process registers
  and prepares, and its replica joins a later step, which is verified too.

With --json, stdout holds exactly one JSON object (logs go to stderr); the
exit code is 0 iff "ok".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import warnings
from typing import Any, Optional

# The model: a tiny Qwen3 (transformers builds it from this config; --hidden-size,
# --layers and --vocab-size scale it).
QWEN3 = dict(head_dim=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
             tie_word_embeddings=False)
COORDINATOR_NAME = "weightsync-coordinator"


def log(*args: Any) -> None:
    print("[sync_job]", *args, file=sys.stderr, flush=True)


def digest(t: Any) -> str:
    """sha256 of a tensor's bytes (dtype and shape prefixed): equal digests
    mean equal bits."""
    import torch

    t = t.detach().contiguous().cpu()
    h = hashlib.sha256(f"{t.dtype}{list(t.shape)}".encode())
    h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def qwen3_config(model: dict) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**model)


def engine_config(model: dict, replicas: int, tp: int) -> dict:
    return {"framework": "hf", "hf_config": qwen3_config(model).to_dict(), "tp": tp,
            "replicas": replicas, "dtype": "F32"}


def _quiet_threads() -> None:
    import torch

    torch.set_num_threads(1)


def _actor_class(cls: type) -> Any:
    """ray.remote(cls) (its handles untyped here: Ray's stubs type them loosely)."""
    import ray

    return ray.remote(cls)


def _since(t: Optional[float], t0: Optional[float]) -> Optional[float]:
    return None if t is None or t0 is None else round(t - t0, 3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node() -> dict:
    import ray

    return {"node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}


class CoordinatorActor:
    """The weightsync control plane, in its own actor on a chosen node."""

    def __init__(self, token: Optional[str], port: int) -> None:
        import ray
        import weightsync as ws

        # A fixed port: Ray runs this again with the same arguments when it
        # restarts the actor, and the ranks come back to the same address.
        self.coord = ws.Coordinator(host=ray.util.get_node_ip_address(), port=port, token=token)

    def info(self) -> dict:
        return {**_node(), "address": self.coord.address}

    def members(self) -> dict:
        """How many trainer and engine ranks are registered now."""
        out: dict = {}
        for m in self.coord.members():
            out[m["role"]] = out.get(m["role"], 0) + 1
        return out

    def committed_versions(self, ranks: list) -> dict:
        return {g: self.coord.committed_version(g) for g in ranks}

    def close(self) -> None:
        self.coord.close()


class TrainerActor:
    """One FSDP2 trainer rank with its weightsync Publisher."""

    def __init__(self, rank: int, world: int) -> None:
        _quiet_threads()
        self.rank, self.world = rank, world
        self.pub: Any = None

    def master(self) -> tuple:
        """This node's IP and a port free on it, for torch.distributed."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return ip, s.getsockname()[1]

    def setup(self, master: tuple, coordinator: str, engine: dict, opts: dict) -> dict:
        import datetime

        import ray
        import torch
        import torch.distributed as dist
        import weightsync as ws
        import weightsync.torch as wst
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM

        cuda = bool(ray.get_gpu_ids()) and torch.cuda.is_available()
        self.device = "cuda" if cuda else "cpu"
        if cuda:
            torch.cuda.set_device(0)  # Ray set CUDA_VISIBLE_DEVICES to this actor's GPU
        self.backend = "nccl" if cuda else "gloo"
        dist.init_process_group(self.backend, init_method=f"tcp://{master[0]}:{master[1]}",
                                rank=self.rank, world_size=self.world,
                                timeout=datetime.timedelta(seconds=opts["step_timeout"] + 30))
        torch.manual_seed(0)  # every rank starts from the same weights
        self.vocab = opts["model"]["vocab_size"]
        model = AutoModelForCausalLM.from_config(qwen3_config(opts["model"])).to(self.device)
        mesh = init_device_mesh(self.device, (self.world,), mesh_dim_names=("fsdp",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=opts["lr"])
        # weightsync: this rank's layout in HF space, its publisher, its shards.
        self.layout = wst.trainer_layout(model)
        self.pub = ws.Publisher(coordinator=coordinator, rank=self.rank, layout=self.layout,
                                engine=engine, transport=opts["transport"],
                                bucket_bytes=opts["bucket_bytes"], elastic=True,
                                min_replicas=opts["min_replicas"],
                                connect_timeout=opts["connect_timeout"],
                                step_timeout=opts["step_timeout"])
        self.pub.register_module(model)
        self.pub.prepare()
        # HF key of each param (Qwen3 dense: one key each, no fusing).
        self.keys = {}
        for p in self.layout["params"]:
            if len(p["hf_keys"]) != 1 or p.get("fused_dim") is not None or p.get("stack_dim"):
                raise RuntimeError(f"{p['name']}: not one whole HF key")
            self.keys[p["name"]] = p["hf_keys"][0]
        return {**_node(), "rank": self.rank, "device": self.device, "backend": self.backend,
                "params": len(self.keys),
                "local_bytes": sum(p.to_local().numel() * p.element_size()
                                   for p in model.parameters())}

    def step(self, step: int) -> dict:
        import torch
        from torch.distributed.tensor import DTensor

        t0 = time.monotonic()
        g = torch.Generator().manual_seed(1000 + step)  # every rank draws the same batch
        batch = torch.randint(0, self.vocab, (2, 16), generator=g).to(self.device)
        loss = self.model(input_ids=batch, labels=batch).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        train_s = time.monotonic() - t0
        # The reference: every full parameter after this step (a collective).
        digests = {}
        for name, p in self.model.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else p
            if self.rank == 0:
                digests[self.keys[name]] = digest(full)
        res = self.pub.push(step)  # weightsync: the engines serve `step` from here on
        return {"rank": self.rank, "step": res.step, "loss": float(loss.detach()),
                "train_seconds": train_s, "committed": list(res.committed),
                "failed": [[int(r), str(why)] for r, why in res.failed],
                "replicas": list(res.replicas), "plan_id": res.plan_id,
                "bytes_sent": res.bytes_sent, "seconds": res.seconds,
                "digests": digests if self.rank == 0 else None}

    def close(self) -> None:
        import torch.distributed as dist

        if self.pub is not None:
            self.pub.close()
            self.pub = None
        if dist.is_initialized():
            dist.destroy_process_group()


class EngineActor:
    """One engine rank: a Qwen3 module whose params a weightsync Subscriber
    keeps at the trainer's latest version, served on a thread."""

    def __init__(self, replica: int, rank: int, tp: int, coordinator: str, engine: dict,
                 opts: dict, kill_step: Optional[int]) -> None:
        self.started_at = time.time()
        import ray
        import torch
        import weightsync as ws
        from transformers import AutoModelForCausalLM

        _quiet_threads()
        t0 = time.monotonic()
        self.replica, self.rank, self.global_rank = replica, rank, replica * tp + rank
        # True in a process Ray started again after this actor's died.
        with warnings.catch_warnings():  # Ray 2.60 warns about its own use of actor_id here
            warnings.simplefilter("ignore", DeprecationWarning)
            self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        torch.manual_seed(100 + self.global_rank)  # weights unlike the trainer's until synced
        self.model = AutoModelForCausalLM.from_config(
            qwen3_config(opts["model"])).requires_grad_(False)
        # weightsync: this engine rank, its params, ready for the next step.
        self.sub = ws.Subscriber(coordinator=coordinator, engine=engine, replica=replica,
                                 rank=rank, transport=opts["transport"],
                                 connect_timeout=opts["connect_timeout"],
                                 step_timeout=opts["step_timeout"])
        self.sub.register_module(self.model)
        if kill_step is not None and not self.restarted:
            def die(step: int) -> None:
                if step == kill_step:
                    print(f"engine rank {self.global_rank}: os._exit in step {step}",
                          file=sys.stderr, flush=True)
                    os._exit(1)
            self.sub.on_begin(die)
        self.sub.prepare()  # ready: its replica counts from the next step that begins
        self.ready_seconds = time.monotonic() - t0
        self.ready_at = time.time()
        self.outcomes: dict[int, dict] = {}
        self.cond = threading.Condition()
        self.stopping = threading.Event()
        self.error: Optional[str] = None
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            while not self.stopping.is_set():
                out = self.sub.run_step(timeout=0.5)
                if out is None:
                    continue
                rec = {"step": out.step, "committed": out.committed, "reason": out.reason,
                       "bytes": out.bytes, "seconds": out.seconds}
                if out.committed:  # before the next step can begin: the driver waits for it
                    rec["digests"] = {n: digest(p) for n, p in self.model.named_parameters()}
                with self.cond:
                    self.outcomes[out.step] = rec
                    self.cond.notify_all()
        except Exception:  # noqa: BLE001 - reported to the driver
            self.error = traceback.format_exc()
            with self.cond:
                self.cond.notify_all()

    def info(self) -> dict:
        return {**_node(), "replica": self.replica, "rank": self.global_rank,
                "restarted": self.restarted, "ready_seconds": self.ready_seconds,
                "started_at": self.started_at, "ready_at": self.ready_at,
                "version": self.sub.version}

    def outcome(self, step: int, timeout: float) -> Optional[dict]:
        """This rank's outcome of `step` (None if it took no part in time)."""
        with self.cond:
            self.cond.wait_for(lambda: step in self.outcomes or self.error, timeout)
            if self.error:
                raise RuntimeError(f"engine rank {self.global_rank} serve loop:\n{self.error}")
            return self.outcomes.get(step)

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)
        self.sub.close()


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="one JSON object on stdout, logs on stderr")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--trainers", type=int, default=2, help="FSDP2 ranks (one actor each)")
    p.add_argument("--replicas", type=int, default=2, help="engine replicas (replica slots)")
    p.add_argument("--tp", type=int, default=1, help="engine ranks per replica")
    p.add_argument("--engine-nodes", type=int, default=1,
                   help="local cluster: nodes with {'engine_node': 1} (the engines spread)")
    p.add_argument("--min-replicas", type=int, default=None,
                   help="elastic: a step waits for this many ready replicas (default: replicas-1, "
                        "at least 1)")
    p.add_argument("--kill-engine", default=None, metavar="RANK:STEP",
                   help="end engine rank RANK's process in step STEP; Ray restarts it")
    p.add_argument("--kill-how", default="exit", choices=["exit", "ray"],
                   help="exit: os._exit inside its on_begin hook of STEP (mid-step); "
                        "ray: ray.kill(actor, no_restart=False) just before STEP")
    p.add_argument("--kill-coordinator", type=int, default=None, metavar="STEP",
                   help="ray.kill the coordinator actor just before STEP; Ray restarts it on "
                        "its port, the ranks come back, and STEP commits everywhere")
    p.add_argument("--rejoin-timeout", type=float, default=90.0,
                   help="after --steps, step on up to this long until the killed rank rejoins")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="trainers: cuda+NCCL when the trainer node has a GPU per rank (auto)")
    p.add_argument("--hidden-size", type=int, default=QWEN3["hidden_size"],
                   help="model width (intermediate: twice it)")
    p.add_argument("--layers", type=int, default=QWEN3["num_hidden_layers"])
    p.add_argument("--vocab-size", type=int, default=QWEN3["vocab_size"])
    p.add_argument("--transport", default="ucx")
    p.add_argument("--bucket-bytes", type=int, default=64 << 10)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--step-timeout", type=float, default=30.0)
    p.add_argument("--connect-timeout", type=float, default=60.0)
    p.add_argument("--setup-timeout", type=float, default=180.0)
    p.add_argument("--token", default=os.environ.get("WEIGHTSYNC_TOKEN"))
    p.add_argument("--namespace", default=f"weightsync-{os.getpid()}-{int(time.time())}",
                   help="Ray namespace of the job's named coordinator actor")
    args = p.parse_args(argv)
    args.kill = None
    if args.kill_engine:
        r, s = (int(x) for x in args.kill_engine.split(":"))
        if not (0 <= r < args.replicas * args.tp and 1 <= s <= args.steps):
            p.error(f"--kill-engine {args.kill_engine}: rank in [0, {args.replicas * args.tp}), "
                    f"step in [1, {args.steps}]")
        args.kill = (r, s)
    args.model = dict(QWEN3, hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
                      num_hidden_layers=args.layers, vocab_size=args.vocab_size)
    if args.min_replicas is None:
        args.min_replicas = max(1, args.replicas - 1)
    return args


class Job:
    """The driver: cluster, actors, the step loop, the report."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.cluster: Any = None
        self.tmp: Optional[str] = None
        self.saved_ray_tmpdir: Optional[str] = None
        self.pgs: list = []
        self.actors: list[Any] = []
        self.coord: Any = None
        self.trainers: list[Any] = []
        self.engines: list[Any] = []
        self.report: dict[str, Any] = {"ok": False, "steps": [], "errors": []}
        self.out = sys.stderr if args.json else sys.stdout

    # -- the cluster --------------------------------------------------------
    def start_cluster(self) -> None:
        import ray

        a = self.args
        env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
        import weightsync

        pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(weightsync.__file__)))
        if "site-packages" not in pkg_root:  # a source checkout: the workers need it too
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [pkg_root,
                                                              os.environ.get("PYTHONPATH")]))
        runtime_env = {"env_vars": env}
        if os.environ.get("RAY_ADDRESS"):
            self.report["cluster"] = "RAY_ADDRESS"
            ray.init(address=os.environ["RAY_ADDRESS"], namespace=a.namespace,
                     runtime_env=runtime_env, log_to_driver=True)
            return
        from ray.cluster_utils import Cluster

        import torch

        self.report["cluster"] = "local ray.cluster_utils.Cluster"
        self.tmp = tempfile.mkdtemp(prefix="ray-ws-")
        # Cluster writes the head's address to <RAY_TMPDIR or TMPDIR or /tmp>/ray/
        # ray_current_cluster, a folder it never creates (only an earlier Ray run
        # leaves it), and there the address would outlive the job and steer a
        # later plain ray.init(). Both go to the job's own folder instead.
        self.saved_ray_tmpdir = os.environ.get("RAY_TMPDIR")
        os.environ["RAY_TMPDIR"] = self.tmp
        os.makedirs(os.path.join(self.tmp, "ray"))
        gpus = torch.cuda.device_count() if a.device != "cpu" else 0
        trainer_gpus = a.trainers if gpus >= a.trainers else 0
        common = dict(object_store_memory=80 << 20)
        self.cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=a.trainers, num_gpus=trainer_gpus, resources={"trainer_node": 1},
            temp_dir=self.tmp, include_dashboard=False, dashboard_port=_free_port(), **common))
        per_node = -(-a.replicas * a.tp // a.engine_nodes)
        for _ in range(a.engine_nodes):
            self.cluster.add_node(num_cpus=per_node, resources={"engine_node": 1}, **common)
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, namespace=a.namespace, runtime_env=runtime_env,
                 log_to_driver=True)

    # -- the actors ---------------------------------------------------------
    def start_actors(self) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import (NodeAffinitySchedulingStrategy,
                                                    PlacementGroupSchedulingStrategy)

        a = self.args
        res = ray.cluster_resources()
        tagged = res.get("trainer_node", 0) > 0 and res.get("engine_node", 0) > 0
        use_gpu = a.device == "cuda" or (a.device == "auto" and res.get("GPU", 0) >= a.trainers)
        if a.device == "cuda" and res.get("GPU", 0) < a.trainers:
            raise RuntimeError(f"--device cuda: the cluster has {res.get('GPU', 0)} GPUs for "
                               f"{a.trainers} trainer ranks")
        n_eng = a.replicas * a.tp
        trainer_bundle = {"CPU": 1, **({"GPU": 1} if use_gpu else {}),
                          **({"trainer_node": 0.01} if tagged else {})}
        engine_bundle = {"CPU": 1, **({"engine_node": 0.01} if tagged else {})}
        # Trainers together on one node; engines on the engine node(s).
        tpg = placement_group([trainer_bundle] * a.trainers, strategy="STRICT_PACK",
                              name="weightsync-trainers")
        epg = placement_group([engine_bundle] * n_eng,
                              strategy="SPREAD" if a.engine_nodes > 1 else "PACK",
                              name="weightsync-engines")
        self.pgs = [tpg, epg]
        ray.get([tpg.ready(), epg.ready()], timeout=a.setup_timeout)

        # The coordinator: a named actor on the trainer node, restarted by Ray
        # on the port a task found free on that node.
        where: dict[str, Any] = {}
        if tagged:
            where["resources"] = {"trainer_node": 0.01}
        else:  # the driver's node
            where["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                ray.get_runtime_context().get_node_id(), soft=False)
        port = ray.get(ray.remote(_free_port).options(num_cpus=0, **where).remote(),
                       timeout=a.setup_timeout)
        copts: dict[str, Any] = dict(name=COORDINATOR_NAME, num_cpus=0, max_restarts=3, **where)
        self.coord = _actor_class(CoordinatorActor).options(**copts).remote(a.token, port)
        self.actors.append(self.coord)
        coord_info: dict[str, Any] = ray.get(self.coord.info.remote(), timeout=a.setup_timeout)
        address = coord_info["address"]
        self.report["coordinator"] = {**coord_info, "name": COORDINATOR_NAME,
                                      "namespace": a.namespace}
        log(f"coordinator {address} on node {coord_info['node_id'][:12]}")

        opts = dict(transport=a.transport, bucket_bytes=a.bucket_bytes, lr=a.lr,
                    min_replicas=a.min_replicas, step_timeout=a.step_timeout,
                    connect_timeout=a.connect_timeout, model=a.model)
        self.engine = engine_config(opts["model"], a.replicas, a.tp)
        Trainer = _actor_class(TrainerActor)
        self.trainers = [Trainer.options(
            num_cpus=1, num_gpus=1 if use_gpu else 0, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                tpg, placement_group_bundle_index=r)
        ).remote(r, a.trainers) for r in range(a.trainers)]
        self.actors += self.trainers
        Engine = _actor_class(EngineActor)
        self.engines = []
        for g in range(n_eng):
            kill_step = a.kill[1] if a.kill and a.kill[0] == g and a.kill_how == "exit" else None
            self.engines.append(Engine.options(
                num_cpus=1, max_restarts=2, max_task_retries=0, max_concurrency=4,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    epg, placement_group_bundle_index=g)
            ).remote(g // a.tp, g % a.tp, a.tp, address, self.engine, opts, kill_step))
        self.actors += self.engines

        # torch.distributed's master: trainer rank 0's node IP and a free port there.
        master = ray.get(self.trainers[0].master.remote(), timeout=a.setup_timeout)
        self.report["master"] = f"{master[0]}:{master[1]}"
        setups = [t.setup.remote(master, address, self.engine, opts) for t in self.trainers]
        infos = [e.info.remote() for e in self.engines]
        self.report["trainers"] = ray.get(setups, timeout=a.setup_timeout)
        self.report["engines"] = ray.get(infos, timeout=a.setup_timeout)  # all ready
        t0 = self.report["trainers"][0]
        self.report.update(device=t0["device"], backend=t0["backend"],
                           placement_groups={
                               "trainers": {"bundles": [trainer_bundle] * a.trainers,
                                            "strategy": "STRICT_PACK"},
                               "engines": {"bundles": [engine_bundle] * n_eng,
                                           "strategy": "SPREAD" if a.engine_nodes > 1 else "PACK"}})
        for t in self.report["trainers"]:
            log(f"trainer rank {t['rank']}: node {t['node_id'][:12]} pid {t['pid']} "
                f"{t['device']}/{t['backend']}")
        for e in self.report["engines"]:
            log(f"engine rank {e['rank']} (replica {e['replica']}): node {e['node_id'][:12]} "
                f"pid {e['pid']}, ready in {e['ready_seconds']:.2f} s")

    # -- the steps ----------------------------------------------------------
    def run_steps(self) -> None:
        import ray

        a = self.args
        n_eng = a.replicas * a.tp
        killed, kill_step = a.kill if a.kill else (-1, 0)
        killed_replica = killed // a.tp
        rejoin_future = None
        rejoin_deadline = 0.0  # set at the kill step
        previous: Optional[dict] = None
        step = 0
        while True:
            step += 1
            rejoined = any(killed in s["verified"] for s in self.report["steps"]
                           if a.kill and s["step"] > kill_step)
            if step > a.steps:
                if not a.kill or rejoined or time.monotonic() > rejoin_deadline:
                    break
                # Past --steps: wait (bounded) until the restarted actor is up, so that
                # the next step can take its replica in.
                rejoin_future = self._wait_up(killed, rejoin_future, rejoin_deadline)
            if a.kill_coordinator == step:
                self._restart_coordinator(step)
            if a.kill and step == kill_step:
                if a.kill_how == "ray":
                    log(f"ray.kill(engine rank {killed}, no_restart=False) before step {step}")
                    ray.kill(self.engines[killed], no_restart=False)
                rejoin_deadline = time.monotonic() + a.rejoin_timeout
                self.report["kill_time"] = time.time()
            results = ray.get([t.step.remote(step) for t in self.trainers],
                              timeout=a.step_timeout + 60)
            r0 = results[0]
            ref = r0["digests"]
            rec: dict[str, Any] = {
                "step": step, "committed": r0["committed"], "verified": [],
                "failed": r0["failed"], "replicas": r0["replicas"], "plan_id": r0["plan_id"],
                "seconds": round(max(r["seconds"] for r in results), 6),
                "bytes": sum(r["bytes_sent"] for r in results),
                "train_seconds": round(max(r["train_seconds"] for r in results), 6),
                "loss": r0["loss"], "tensors": len(ref)}
            for r in results[1:]:
                if r["committed"] != r0["committed"]:
                    self.error(f"step {step}: trainer ranks disagree on the commits: "
                               f"{r0['committed']} vs {r['committed']} (rank {r['rank']})")
            if previous is not None:
                same = [k for k in ref if ref[k] == previous[k]]
                rec["unchanged_tensors"] = same
                if same:
                    self.error(f"step {step}: tensors still hold step {step - 1}'s bits: "
                               f"{same[:4]}")
            previous = ref
            # Each engine that committed returns the digests of its tensors.
            asked = {g: self.engines[g].outcome.remote(step, 30.0) for g in r0["committed"]}
            engine_bytes = {}
            for g, fut in asked.items():
                try:
                    out = ray.get(fut, timeout=60)
                except Exception as e:  # noqa: BLE001 - a failed check, reported
                    self.error(f"step {step}: engine rank {g} committed but did not report: "
                               f"{type(e).__name__}: {e}")
                    continue
                if out is None or not out["committed"]:
                    self.error(f"step {step}: engine rank {g} committed per the trainers, "
                               f"its outcome says {out and out['reason']!r}")
                    continue
                engine_bytes[g] = out["bytes"]
                bad = sorted(k for k in set(ref) | set(out["digests"])
                             if ref.get(k) != out["digests"].get(k))
                if bad:
                    self.error(f"step {step}: engine rank {g}: {len(bad)} tensors differ from "
                               f"the trainer's: {bad[:4]}")
                else:
                    rec["verified"].append(g)
            rec["engine_bytes"] = engine_bytes
            # Who had to commit: every engine rank, but the killed one's replica from
            # the kill step until it is back (it then commits every step).
            expected = set(range(n_eng))
            if a.kill and step >= kill_step:
                back = [s["step"] for s in self.report["steps"] if s["step"] > kill_step
                        and killed in s["committed"]]
                if step == kill_step or not back:
                    expected -= {killed_replica * a.tp + r for r in range(a.tp)}
            missing = sorted(expected - set(rec["committed"]))
            if missing:
                self.error(f"step {step}: engine ranks {missing} did not commit: {rec['failed']}")
            if a.kill and step == kill_step and killed in rec["committed"]:
                self.error(f"step {step}: the killed engine rank {killed} committed it")
            self.report["steps"].append(rec)
            print(f"step {step}: sync {rec['seconds']:.3f} s, {rec['bytes']} bytes "
                  f"({rec['tensors']} tensors); replicas {rec['replicas']}, committed "
                  f"{rec['committed']}, verified bit-exact {rec['verified']}"
                  + (f", failed {[f[0] for f in rec['failed']]}" if rec["failed"] else ""),
                  file=self.out, flush=True)

    def _restart_coordinator(self, step: int) -> None:
        """ray.kill()s the coordinator actor (Ray restarts it on its port) and
        waits until every trainer and engine rank registered with the new one."""
        import ray

        a = self.args
        old = self.report["coordinator"]
        log(f"ray.kill(coordinator, no_restart=False) before step {step}")
        t0 = time.monotonic()
        ray.kill(self.coord, no_restart=False)
        deadline = t0 + a.setup_timeout
        info: dict = {}
        while time.monotonic() < deadline:
            try:
                info = ray.get(self.coord.info.remote(), timeout=10)
                if info["pid"] != old["pid"]:
                    break
            except Exception:  # noqa: BLE001 - the old process's death; ask the new one
                pass
            time.sleep(0.2)
        if info.get("pid") == old["pid"] or info.get("address") != old["address"]:
            self.error(f"the coordinator did not come back on {old['address']}: {info}")
            return
        up = time.monotonic() - t0
        want = {"trainer": a.trainers, "engine": a.replicas * a.tp}
        members: dict = {}
        while time.monotonic() < deadline:
            members = ray.get(self.coord.members.remote(), timeout=10)
            if all(members.get(k, 0) >= n for k, n in want.items()):
                break
            time.sleep(0.2)
        back = time.monotonic() - t0
        self.report.setdefault("coordinator_restarts", []).append(
            {"step": step, "old_pid": old["pid"], "new_pid": info.get("pid"),
             "address": info.get("address"), "up_seconds": round(up, 3),
             "members_back_seconds": round(back, 3), "members": members})
        if not all(members.get(k, 0) >= n for k, n in want.items()):
            self.error(f"after the coordinator's restart only {members} came back, not {want}")
        log(f"coordinator back on {info.get('address')} (pid {info.get('pid')}) in {up:.2f} s; "
            f"every rank registered again in {back:.2f} s")

    def _wait_up(self, g: int, fut: Any, deadline: float) -> Any:
        """Blocks until engine actor g answers info() (its new process is up and
        prepared) or the deadline; returns the pending call, if any."""
        import ray

        while time.monotonic() < deadline:
            if fut is None:
                fut = self.engines[g].info.remote()
            ready, _ = ray.wait([fut], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                return fut
            try:
                info = ray.get(fut)
            except Exception:  # noqa: BLE001 - the old process's death: ask the new one
                fut = None
                time.sleep(0.2)
                continue
            if info["restarted"]:
                return fut
            fut = None
            time.sleep(0.2)
        return fut

    def finish(self) -> None:
        import ray

        a = self.args
        steps = self.report["steps"]
        n_eng = a.replicas * a.tp
        finals = [self.engines[g].info.remote() for g in range(n_eng)]
        infos = []
        for g, f in enumerate(finals):
            try:
                infos.append(ray.get(f, timeout=30))
            except Exception as e:  # noqa: BLE001
                infos.append({"rank": g, "error": f"{type(e).__name__}: {e}"})
        self.report["engines_final"] = infos
        if steps:
            self.report["versions"] = ray.get(
                self.coord.committed_versions.remote(list(range(n_eng))), timeout=30)
        if a.kill:
            g, s = a.kill
            before: dict[str, Any] = next((e for e in self.report["engines"] if e["rank"] == g), {})
            after = infos[g]
            later = [x["step"] for x in steps if x["step"] > s and g in x["verified"]]
            killed_at = self.report.get("kill_time")
            self.report["kill"] = {
                "rank": g, "step": s, "how": a.kill_how,
                "pid_before": before.get("pid"), "pid_after": after.get("pid"),
                "restarted": after.get("restarted"),
                # wall clock, from the kill step's start: the new process's constructor
                # began, and it was ready (registered, prepared)
                "restart_began_after_s": _since(after.get("started_at"), killed_at),
                "ready_after_s": _since(after.get("ready_at"), killed_at),
                "rejoined_step": later[0] if later else None,
                "steps_verified_after": later}
            if not after.get("restarted") or after.get("pid") == before.get("pid"):
                self.error(f"engine rank {g} was not restarted by Ray: {after}")
            if not later:
                self.error(f"engine rank {g} never rejoined and verified after step {s}")
            elif later != [x["step"] for x in steps if x["step"] >= later[0]]:
                self.error(f"engine rank {g} missed steps after rejoining at {later[0]}")
        nodes = {self.report["coordinator"]["node_id"]}
        nodes |= {t["node_id"] for t in self.report["trainers"]}
        nodes |= {e["node_id"] for e in self.report["engines"] + infos if "node_id" in e}
        self.report["nodes"] = len(nodes)
        self.report["cluster_nodes"] = len([n for n in ray.nodes() if n["Alive"]])
        ok_steps = len(steps) >= a.steps and all(s["verified"] for s in steps)
        self.report["ok"] = ok_steps and not self.report["errors"]

    def error(self, msg: str) -> None:
        log("ERROR", msg)
        self.report["errors"].append(msg)

    def shutdown(self) -> None:
        import ray

        if ray.is_initialized():
            closes = [e.close.remote() for e in self.engines]
            closes += [t.close.remote() for t in self.trainers]
            try:
                ray.wait(closes, num_returns=len(closes), timeout=20)
                if self.coord is not None:
                    ray.wait([self.coord.close.remote()], timeout=5)
            except Exception as e:  # noqa: BLE001 - tearing down anyway
                log("closing:", e)
            for actor in self.actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001
                    pass
            from ray.util.placement_group import remove_placement_group

            for pg in self.pgs:
                try:
                    remove_placement_group(pg)
                except Exception:  # noqa: BLE001
                    pass
            ray.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()  # removes the address file under RAY_TMPDIR
            self.cluster = None
        if self.tmp:
            if self.saved_ray_tmpdir is None:
                os.environ.pop("RAY_TMPDIR", None)
            else:
                os.environ["RAY_TMPDIR"] = self.saved_ray_tmpdir
            shutil.rmtree(self.tmp, ignore_errors=True)


def main(argv: Optional[list] = None) -> int:
    args = parse_args(argv)
    json_out = None
    if args.json:  # stdout: the JSON alone; anything else written there (Ray's logs) to stderr
        sys.stdout.flush()
        json_out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below
    import ray
    import torch

    import weightsync

    job = Job(args)
    t0 = time.monotonic()
    try:
        job.start_cluster()
        job.report["cluster_seconds"] = round(time.monotonic() - t0, 3)
        job.start_actors()
        job.report["setup_seconds"] = round(time.monotonic() - t0, 3)
        job.run_steps()
        job.finish()
    except BaseException as e:  # noqa: BLE001 - the report says what failed
        if isinstance(e, KeyboardInterrupt):
            job.error("interrupted")
        else:
            job.error(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        job.report["ok"] = False
    finally:
        try:
            job.shutdown()
        except BaseException as e:  # noqa: BLE001
            job.error(f"shutdown: {type(e).__name__}: {e}")
            job.report["ok"] = False
    rep = job.report
    rep.update(total_seconds=round(time.monotonic() - t0, 3),
               versions_tested={"ray": ray.__version__, "torch": torch.__version__,
                                "weightsync": getattr(weightsync, "__version__", "?"),
                                "python": sys.version.split()[0]},
               transport=args.transport, engine={"replicas": args.replicas, "tp": args.tp,
                                                 "framework": "hf", "dtype": "F32"},
               trainer_ranks=args.trainers, min_replicas=args.min_replicas,
               model={"type": "qwen3", **args.model,
                      "bytes": sum(t["local_bytes"] for t in rep.get("trainers", []))})
    rep.setdefault("nodes", 0)
    if json_out is not None:
        sys.stdout.flush()
        json_out.write(json.dumps(rep) + "\n")
        json_out.flush()
    else:
        secs = [s["seconds"] for s in rep["steps"]]
        print(("OK" if rep["ok"] else "FAILED") + f": {len(rep['steps'])} steps on "
              f"{rep['nodes']} Ray nodes"
              + (f", sync {min(secs):.3f}-{max(secs):.3f} s per step" if secs else "")
              + "".join(f"\n  {e.splitlines()[0]}" for e in rep["errors"]))
    return 0 if rep["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
