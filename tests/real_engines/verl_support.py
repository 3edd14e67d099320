"""Support for tests/real_engines/test_verl.py: verl's own classes on the CPU.

- The trainer: `FSDPActorWorker`, a verl `Worker` in a verl `RayWorkerGroup`
  (2 ranks, gloo), holding a transformers Qwen3 (fp32 parameters, as verl's
  FSDP actor keeps them) under real FSDP2
  (`fully_shard` per decoder layer and at the root, a CPU device mesh). It
  builds its checkpoint engine exactly as verl's ActorRolloutRefWorker does
  (engine_workers.py:678-688) and its `update_weights` is verl's
  (engine_workers.py:735-765) for the non-naive backends. Its weights
  generator is verl's FSDP engine's (`FSDPEngine.get_per_tensor_param`,
  transformer_impl.py:977-1036: `state_dict()`, `convert_weight_keys`, a
  `full_tensor()` per DTensor, `unfuse_moe_params`) with "cpu" where verl
  calls `get_device_id()` (`torch.cuda.current_device()`): verl's
  FSDPEngine itself builds a CUDA device mesh and cannot run here.
- The rollout: `RolloutWorker` is verl's `CheckpointEngineWorker` (the class
  verl's manager drives on the rollout side), given a server adapter for a
  real vLLM on the CPU (`VllmCpuAdapter`) in place of verl's vLLM
  `ServerAdapter`, which ships weights over CUDA IPC (its sender allocates
  its bucket on `cuda:N`: bucketed_weight_transfer.py:183). The adapter
  loads what `receive_weights` yields through vLLM's own layerwise reload
  (`initialize_layerwise_reload`, the model's `load_weights`,
  `finalize_layerwise_reload`: what re-packs vLLM's CPU GEMM weights),
  inside the vLLM worker process (`VerlTestExtension.test_load_hf`), then
  resets the prefix cache (verl's adapter calls the server's
  `clear_kv_cache`).
- `CpuReplica` is verl's `RolloutReplica` with no HTTP server in front of the
  engine (its abort / release / resume calls reach no server).
"""

from __future__ import annotations

import os
import time
from typing import Any, Optional

import ray
import torch
from verl.checkpoint_engine.base import CheckpointEngineRegistry, CheckpointEngineWorker
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils.import_utils import import_external_libs
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica

import vllm_support as vs

HERE = os.path.dirname(os.path.abspath(__file__))


def _loopback() -> None:
    """The gloo rendezvous on the loopback (verl's worker group hands out the
    node's address)."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


# ---- the trainer ---------------------------------------------------------------------

class FSDPActorWorker(Worker):
    """A verl Worker holding a real FSDP2 model (module docstring)."""

    def __init__(self, checkpoint_engine: Any, model_path: str) -> None:
        super().__init__()
        self.checkpoint_engine_config = checkpoint_engine  # a CheckpointEngineConfig
        self.model_path = model_path
        self.fail_after: Optional[int] = None
        self.rollout_handles: list = []

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM

        _loopback()
        dist.init_process_group("gloo")
        world = dist.get_world_size()
        # fp32 parameters, as verl's FSDP actor keeps them (its mixed precision
        # computes in bf16); the checkpoint is bf16, so fp32 holds it exactly.
        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.module = model
        # As ActorRolloutRefWorker.init_model builds it (engine_workers.py:678-688).
        config = self.checkpoint_engine_config
        backend = config.backend
        bucket_size = config.update_weights_bucket_megabytes << 20
        engine_kwargs = config.engine_kwargs.get(backend, {})
        import_external_libs(config.custom_backend_module or None)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            backend, is_master=(dist.get_rank() == 0), bucket_size=bucket_size, **engine_kwargs)
        from torch.distributed.tensor import DTensor

        local = {n: (tuple(p.to_local().shape) if isinstance(p, DTensor) else None)
                 for n, p in model.named_parameters()}
        return {"rank": dist.get_rank(), "backend": type(self.checkpoint_engine).__name__,
                "dtensors": sum(v is not None for v in local.values()), "params": len(local),
                "embed_local_shape": local["model.embed_tokens.weight"]}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_version(self, path: str) -> None:
        """Sets every parameter to checkpoint `path` in place (what an
        optimizer step does to the shards): each rank writes its own shard."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        full = vs.hf_tensors(path)
        with torch.no_grad():
            for name, p in self.module.named_parameters():
                if isinstance(p, DTensor):
                    p.to_local().copy_(distribute_tensor(full[name], p.device_mesh,
                                                         p.placements).to_local())
                else:
                    p.copy_(full[name])

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_fail_after(self, n: Optional[int]) -> None:
        """The weights generator raises after yielding `n` tensors (None: never)."""
        self.fail_after = n

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_drain(self, drain: bool) -> None:
        """The backend's engine kwarg `drain` (False: verl's generator is
        closed unrun: no full_tensor() at all)."""
        self.checkpoint_engine.drain = drain

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_rollouts(self, handles: list) -> None:
        self.rollout_handles = handles

    def get_per_tensor_param(self):
        """verl's FSDPEngine.get_per_tensor_param (transformer_impl.py:977-1036),
        FSDP2 without LoRA, QAT or offload; "cpu" for get_device_id()."""
        from torch.distributed.tensor import DTensor
        from verl.utils.model import convert_weight_keys
        from verl.workers.engine.fsdp.utils import unfuse_moe_params

        params = self.module.state_dict()
        params = convert_weight_keys(params, getattr(self.module, "_fsdp_wrapped_module", self.module))
        device = "cpu"
        per_tensor_param = (
            (name, param.to(device, non_blocking=True).full_tensor() if isinstance(param, DTensor) else param)
            for name, param in params.items()
        )
        per_tensor_param = unfuse_moe_params(per_tensor_param, self.module.config.model_type)
        if self.fail_after is not None:
            per_tensor_param = _failing(per_tensor_param, self.fail_after)
        return per_tensor_param, None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int = None, mode: str = "auto"):
        """ActorRolloutRefWorker.update_weights (engine_workers.py:735-765) for
        a disaggregated rollout. mode "naive" (colocated in verl: the trainer's
        own rollout over CUDA IPC) runs here as verl's naive engine's data
        path: every rank drains the full-tensor generator through verl's
        ColocatedCheckpointEngine, and rank 0 hands the tensors to the
        rollout workers with a Ray call (in place of CUDA IPC)."""
        effective_mode = mode if mode != "auto" else self.checkpoint_engine_config.backend
        if effective_mode != "naive":
            per_tensor_param, _ = self.get_per_tensor_param()
            metrics = await self.checkpoint_engine.send_weights(per_tensor_param, global_steps=global_steps)
            return metrics or {}
        import torch.distributed as dist

        naive = CheckpointEngineRegistry.new("naive", bucket_size=0, is_master=dist.get_rank() == 0)
        per_tensor_param, _ = self.get_per_tensor_param()
        naive.send_weights(per_tensor_param, global_steps=global_steps)
        tensors = [(name, t) for name, t in naive.receive_weights(global_steps=global_steps)]
        if dist.get_rank() == 0:
            data = vs._dump({n: t.contiguous() for n, t in tensors})
            await _gather_refs([h.test_load_hf.remote(data) for h in self.rollout_handles])
        return {}

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def close_engine(self) -> None:
        close = getattr(self.checkpoint_engine, "close", None)
        if callable(close):
            close()


async def _gather_refs(refs: list) -> list:
    import asyncio

    return list(await asyncio.gather(*refs))


def _failing(weights, n: int):
    for i, item in enumerate(weights):
        if i == n:
            raise RuntimeError(f"test: the weights generator fails after {n} tensors")
        yield item


# ---- the rollout ---------------------------------------------------------------------

class VerlTestExtension(vs.VllmTestExtension):
    """The tests' vLLM worker extension plus a load of whole HF tensors
    through vLLM's layerwise reload."""

    def test_load_hf(self, data: bytes) -> int:
        from weightsync._vllm_reload import VllmReload

        tensors = vs.load_dump(data)
        proto = VllmReload(self.model_runner.model, self.model_config, self.vllm_config,
                           load_kind="hf")
        proto.begin()
        try:
            proto.load(sorted(tensors.items()))
            proto.finish()
        except BaseException:
            proto.abort()
            raise
        return len(tensors)


class VllmCpuAdapter(BaseRollout):
    """verl's server-adapter interface (BaseRollout) over a real vLLM LLM
    on the CPU, started in this process (its engine core and worker in
    processes of their own)."""

    def __init__(self, model_path: str, replica_rank: int = 0) -> None:
        self.config = self.model_config = self.device_mesh = None
        self.model_path = model_path
        self.replica_rank, self.is_leader_rank = replica_rank, True
        self.llm = vs.start_engine(model_path, tp=1, transfer=False,
                                   worker_extension_cls="verl_support.VerlTestExtension")
        self.loads: list = []

    async def update_weights(self, weights, global_steps: int = None,
                             wire_format: str = "named_tensors", **kwargs) -> None:
        from verl.workers.rollout.utils import ensure_async_iterator

        assert wire_format == "named_tensors", wire_format
        t0 = time.perf_counter()
        tensors = {}
        try:
            async for name, tensor in ensure_async_iterator(weights):
                tensors[name] = tensor.contiguous()
        except BaseException as e:
            self.loads.append({"step": global_steps, "tensors": len(tensors),
                               "error": f"{type(e).__name__}: {e}",
                               "receive_s": time.perf_counter() - t0})
            raise
        t1 = time.perf_counter()
        if tensors:
            self.load(vs._dump(tensors))
        self.loads.append({"step": global_steps, "tensors": len(tensors),
                           "receive_s": t1 - t0, "load_s": time.perf_counter() - t1})

    def load(self, data: bytes) -> None:
        self.llm.collective_rpc("test_load_hf", args=(data,))
        self.llm.reset_prefix_cache()

    async def resume(self, tags: list) -> None:
        pass

    async def release(self) -> None:
        pass


class RolloutWorker(CheckpointEngineWorker):
    """verl's CheckpointEngineWorker with the CPU vLLM adapter, plus what the
    test reads from the engine."""

    def __init__(self, rollout_config: Any, model_path: str, replica_rank: int = 0) -> None:
        _loopback()
        adapter = VllmCpuAdapter(model_path, replica_rank)
        super().__init__(rollout_config, None, server_adapter=adapter)

    def test_states(self) -> list:
        return self.server_adapter.llm.collective_rpc("test_kernel_state")

    def test_tokens(self) -> list:
        return vs.generate(self.server_adapter.llm)

    def test_load_hf(self, data: bytes) -> None:
        self.server_adapter.load(data)

    def test_loads(self) -> list:
        return self.server_adapter.loads

    def test_start_seconds(self) -> float:
        return self.server_adapter.llm.weightsync_start_seconds

    def test_shutdown(self) -> None:
        close = getattr(self.checkpoint_engine, "close", None)
        if callable(close):
            close()
        vs.stop_engine(self.server_adapter.llm)


class CpuReplica(RolloutReplica):
    """verl's RolloutReplica whose workers are RolloutWorkers; no HTTP server
    (verl's vLLMHttpServer needs CUDA), so the manager's abort / release /
    resume calls reach none."""

    async def launch_servers(self) -> None:
        pass


def start_ray(tmp: str) -> None:
    """A private local Ray cluster on the loopback (never one found in
    /tmp/ray), logical CPUs enough for the worker groups."""
    ray.init(address="local", num_cpus=16, include_dashboard=False, _node_ip_address="127.0.0.1",
             _temp_dir=os.path.join(tmp, "ray"), log_to_driver=True,
             runtime_env={"env_vars": {"RAY_DEDUP_LOGS": "0"}})
