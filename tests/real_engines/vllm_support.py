"""Support for tests/real_engines/test_vllm.py: tiny checkpoints, real vLLM engines
on the CPU, a trainer process that pushes versions on command, and the
engines' full kernel state for bit-exact comparisons.

Test-only shims (never in the package):
- AMX: vLLM 0.32's CPU attention runs AMX tile instructions without asking
  Linux for AMX state (arch_prctl ARCH_REQ_XCOMP_PERM): the first forward
  dies with SIGILL unless something in the process asked first (oneDNN does,
  for the larger GEMMs of real models; tiny models never reach it). A
  `vllm.general_plugins` entry point (generated under a temporary directory
  on PYTHONPATH) calls torch.cpu._init_amx() in every vLLM process.
- The test worker extension (VllmTestExtension, importable from this
  directory, also put on PYTHONPATH) reads every tensor a worker's forward
  reads.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import sys
import time
import traceback
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

#: Greedy prompts (token ids): the long one fills a whole KV block (vLLM's
#: CPU block size is 128), so a prefix cache kept across a sync would show.
PROMPTS = [[(7 * i + 3) % 128 for i in range(160)], [1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]]
MAX_TOKENS = 8

# Tiny configs vLLM's CPU backend runs (head_dim 32; vocab 128).
CONFIGS = {
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=32,
                  hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                  tie_word_embeddings=False, max_position_embeddings=512, rms_norm_eps=1e-6),
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], head_dim=32,
                      hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                      num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                      mlp_only_layers=[1], num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False,
                      max_position_embeddings=512, rms_norm_eps=1e-6),
    # A family weightsync has no table for (engine framework "derived"): the
    # checkpoint fuses q/k/v and gate/up, which vLLM's loader slices per rank.
    "phi3": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], hidden_size=128,
                 intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False,
                 max_position_embeddings=512, original_max_position_embeddings=512,
                 rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 rope_scaling=None, sliding_window=None),
}


def make_checkpoint(kind: str, out: str, seed: int) -> str:
    """A random bf16 checkpoint of a tiny model (transformers' save_pretrained):
    every tensor drawn from `seed`, so two seeds differ in every tensor."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(CONFIGS[kind])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.dtype = torch.bfloat16
    g = torch.Generator().manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    model.save_pretrained(out)
    return out


def hf_tensors(path: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


# ---- shims for vLLM's processes ------------------------------------------------

def install_process_shims(tmp: str) -> None:
    """Makes this directory importable and the AMX plugin load in every vLLM
    process started from now on (through PYTHONPATH, which they inherit)."""
    shim = os.path.join(tmp, "vllm-test-shims")
    info = os.path.join(shim, "weightsync_vllm_test_shims-0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(shim, "weightsync_vllm_test_amx.py"), "w") as f:
        f.write("def init():\n"
                "    import torch\n"
                "    if torch.cpu._is_amx_tile_supported():\n"
                "        torch.cpu._init_amx()\n")
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: weightsync-vllm-test-shims\nVersion: 0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[vllm.general_plugins]\nweightsync_test_amx = weightsync_vllm_test_amx:init\n")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    paths = [HERE, shim] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    for p in (HERE, shim):
        if p not in sys.path:
            sys.path.insert(0, p)
    import importlib

    importlib.invalidate_caches()
    import torch

    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()


def kernel_state(model: Any) -> dict:
    """{name: CPU copy} of every tensor the model's forward reads: parameters,
    buffers, and tensors that callables kept on a module hold (vLLM's CPU GEMM
    dispatch keeps the packed weight in `cpu_linear`'s closure, leaving the
    parameter empty), as `module.attr<var>`."""
    import torch

    out = {}

    def add(name: str, t: Any) -> None:
        if isinstance(t, torch.Tensor) and not t.is_meta:
            out[name] = t.detach().to("cpu", copy=True).contiguous()

    for mname, module in model.named_modules():
        pre = f"{mname}." if mname else ""
        for n, p in module._parameters.items():
            if p is not None:
                add(pre + n, p)
        for n, b in module._buffers.items():
            if b is not None:
                add(pre + n, b)
        for key, value in vars(module).items():
            closure = getattr(value, "__closure__", None) if callable(value) else None
            if key.startswith("_") or not closure:
                continue
            for var, cell in zip(value.__code__.co_freevars, closure):
                try:
                    add(f"{pre}{key}<{var}>", cell.cell_contents)
                except ValueError:  # an empty cell
                    pass
    return out


def _dump(tensors: dict) -> bytes:
    from safetensors.torch import save

    return save(tensors)


def load_dump(data: bytes) -> dict:
    from safetensors.torch import load

    return load(data)


try:  # the worker extension vLLM mixes into its workers (imported there by name)
    from weightsync.vllm import WorkerExtension as _Base
except ImportError:  # pragma: no cover - weightsync not importable: the tests skip
    _Base = object


class VllmTestExtension(_Base):
    """weightsync's worker extension plus what the tests read from a worker."""

    def test_kernel_state(self) -> bytes:
        return _dump(kernel_state(self.model_runner.model))

    def test_derived_config(self, base: dict) -> dict:
        """The engine config of framework "derived" this worker's replica
        derives (weightsync's connect does the same)."""
        from weightsync import _vllm_reload

        return _vllm_reload.derive_engine_config(
            self.model_runner.model, self.vllm_config, base,
            self.weightsync_tp_rank(),
            _vllm_reload._gather_tp)

    def test_lora_slot(self, lora_id: int) -> bytes:
        """The LoRA buffers every LoRA layer's kernels read for adapter
        `lora_id` (its slot's rows of lora_a/b_stacked), as they are."""
        import torch

        am = self.model_runner.model.lora_manager
        index = am.lora_index_to_id.index(lora_id)
        out = {}
        for name, module in am.modules.items():
            for kind in ("lora_a_stacked", "lora_b_stacked"):
                stacks = getattr(module, kind)
                # One tensor (embeddings) or one per packed slice.
                for i, t in enumerate((stacks,) if isinstance(stacks, torch.Tensor) else stacks):
                    out[f"{name}.{kind}.{i}"] = t[index].clone().contiguous()
        return _dump(out)

    def test_transfer_engine(self) -> Optional[str]:
        engine = getattr(self, "weight_transfer_engine", None)
        return None if engine is None else type(engine).__name__


# ---- engines ---------------------------------------------------------------------

ENGINE_ARGS = dict(skip_tokenizer_init=True, max_model_len=256, dtype="bfloat16",
                   enforce_eager=True, max_num_seqs=4, gpu_memory_utilization=0.05,
                   kv_cache_memory_bytes=32 << 20,
                   worker_extension_cls="vllm_support.VllmTestExtension")


def start_engine(path: str, tp: int = 1, transfer: bool = True, **engine_args: Any) -> Any:
    """A real vLLM LLM over `path` (multiprocess: engine core and workers in
    their own processes), weightsync's worker extension and, with `transfer`,
    vLLM's weight-transfer engine "weightsync"; `engine_args`: more of LLM's."""
    from vllm import LLM

    if tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
    kwargs = dict(ENGINE_ARGS, **engine_args)
    if transfer:
        kwargs["weight_transfer_config"] = {"backend": "weightsync"}
    t = time.monotonic()
    llm = LLM(model=path, tensor_parallel_size=tp, **kwargs)
    llm.weightsync_start_seconds = time.monotonic() - t
    return llm


def stop_engine(llm: Any) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort at teardown
        pass


def generate(llm: Any, lora_request: Any = None) -> list:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False,
                        lora_request=lora_request)
    return [list(o.outputs[0].token_ids) for o in outs]


def worker_states(llm: Any) -> list:
    """Every worker's kernel state, in tensor-parallel rank order."""
    return [load_dump(d) for d in llm.collective_rpc("test_kernel_state")]


def reference(path: str, tp: int) -> dict:
    """What a fresh engine started from `path` holds and answers: {"states":
    [per worker], "tokens", "start_seconds"}."""
    llm = start_engine(path, tp, transfer=False)
    try:
        return {"states": worker_states(llm), "tokens": generate(llm),
                "start_seconds": llm.weightsync_start_seconds}
    finally:
        stop_engine(llm)


def diff_states(got: list, want: list) -> list:
    """Names (rank, name) that differ in dtype, shape or bits; [] when equal."""
    import torch

    def bits(t):
        return t.contiguous().reshape(-1).view(torch.uint8)

    bad = []
    for rank, (g, w) in enumerate(zip(got, want)):
        for name in sorted(set(g) | set(w)):
            a, b = g.get(name), w.get(name)
            if a is None or b is None or a.dtype != b.dtype or a.shape != b.shape \
                    or not torch.equal(bits(a), bits(b)):
                bad.append((rank, name))
    if len(got) != len(want):
        bad.append(("ranks", len(got), len(want)))
    return bad


# ---- the trainer -------------------------------------------------------------------

def trainer_layout_and_model(path: str):
    """A transformers model loaded from `path` and its trainer layout (one
    rank holding everything; transformers >= 5 keeps MoE experts stacked)."""
    import torch
    import weightsync.torch as wst
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    return model, wst.trainer_layout(model)


def _trainer_main(coordinator: str, engine: Any, first: str, commands: Any, results: Any,
                  transport: str, bucket_bytes: int, delta: str) -> None:
    """Runs in its own process: a one-rank trainer; each command ("push",
    step, checkpoint dir) loads that version into the model in place and
    pushes it; ("push_and_die", step, dir, seconds) starts the push and kills
    this process `seconds` later; ("stop",) ends."""
    try:
        import torch
        import weightsync as ws

        model, layout = trainer_layout_and_model(first)
        with ws.Publisher(coordinator=coordinator, rank=0, layout=layout, engine=engine,
                          transport=transport, bucket_bytes=bucket_bytes, delta=delta,
                          step_timeout=60.0) as pub:
            pub.register_module(model)
            results.put(("ready", None))
            while True:
                cmd = commands.get()
                if cmd[0] == "stop":
                    break
                step, path = cmd[1], cmd[2]
                fresh = type(model).from_pretrained(path, dtype=torch.bfloat16).state_dict()
                with torch.no_grad():
                    for name, p in model.state_dict().items():
                        p.copy_(fresh[name])
                if cmd[0] == "push_and_die":
                    pub.push_async(step)
                    time.sleep(cmd[3])
                    os.kill(os.getpid(), signal.SIGKILL)
                res = pub.push(step)
                results.put(("pushed", {"step": res.step, "committed": list(res.committed),
                                        "failed": [tuple(f) for f in res.failed],
                                        "delta_buckets": res.delta_buckets,
                                        "bytes_sent": res.bytes_sent}))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put(("error", traceback.format_exc()))


class Trainer:
    """The trainer process, driven from the test."""

    def __init__(self, coordinator: str, engine: Any, first: str, transport: str = "ucx",
                 bucket_bytes: int = 256 << 20, delta: str = "off"):
        ctx = mp.get_context("spawn")
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_trainer_main,
                                args=(coordinator, engine, first, self.commands, self.results,
                                      transport, bucket_bytes, delta), daemon=True)
        self.proc.start()
        kind, value = self._next(120)
        assert kind == "ready", value

    def _next(self, timeout: float):
        deadline = time.monotonic() + timeout
        while True:
            try:
                kind, value = self.results.get(timeout=0.5)
                if kind == "error":
                    raise AssertionError(f"the trainer failed:\n{value}")
                return kind, value
            except queue_mod.Empty:
                if not self.proc.is_alive():
                    raise AssertionError(f"the trainer exited ({self.proc.exitcode})") from None
                if time.monotonic() > deadline:
                    raise AssertionError("the trainer did not answer in time") from None

    def push(self, step: int, path: str) -> None:
        """Starts pushing version `path` as step `step` (result: pushed())."""
        self.commands.put(("push", step, path))

    def pushed(self, timeout: float = 120) -> dict:
        kind, value = self._next(timeout)
        assert kind == "pushed", (kind, value)
        return value

    def push_and_die(self, step: int, path: str, seconds: float) -> None:
        self.commands.put(("push_and_die", step, path, seconds))

    def close(self) -> None:
        if self.proc.is_alive():
            self.commands.put(("stop",))
            self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=10)


def engine_config(path: str, framework: str, tp: int) -> dict:
    return {"framework": framework, "hf_config": os.path.join(path, "config.json"), "tp": tp,
            "replicas": 1}


def write_json(path: str, obj: Any) -> str:
    with open(path, "w") as f:
        json.dump(obj, f)
    return path
