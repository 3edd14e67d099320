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


# A tiny Qwen2 (q/k/v biases, no o_proj bias: what vLLM's Qwen2 holds too)
# whose every greedy token names the version of each of its two layers.
REVEALING = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=128,
                 intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False,
                 max_position_embeddings=1024, rms_norm_eps=1e-6, use_sliding_window=False)
REVEALING_VERSIONS = 8


def revealing_token(layer0: int, layer1: int) -> int:
    """The token the version-revealing model makes when its layer 0 holds
    version `layer0` and its layer 1 `layer1`."""
    return 32 + REVEALING_VERSIONS * layer0 + layer1


def revealed(token: int) -> Optional[tuple]:
    """(layer 0's version, layer 1's) that made `token`; None for a token
    the model never makes."""
    if not 32 <= token < 32 + REVEALING_VERSIONS ** 2:
        return None
    return divmod(token - 32, REVEALING_VERSIONS)


def make_revealing_checkpoint(out: str, version: int) -> str:
    """Version `version` of a model whose greedy token reveals, whatever
    the prompt, the version of every layer that made it: a token made by
    version k of both layers is revealing_token(k, k), and layers of
    different versions give revealing_token(a, b), a != b, which no whole
    version gives.

    How: v_proj's weight is 0 and its bias (key/value head 0) is 4 x the
    one-hot of the version, so attention returns that vector whatever it
    attends to (a KV cache that holds another version's values mixes
    them); o_proj puts layer L's in hidden dims [32 L, 32 L + 32); the
    MLP's down_proj is 0; lm_head's row of revealing_token(a, b) is the
    one-hot of a plus that of 32 + b. Everything else (embeddings at 0.01,
    q, k, norms, gate and up) is drawn from the version, so that two
    versions differ in nearly every tensor."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    assert 0 <= version < REVEALING_VERSIONS
    cfg = dict(REVEALING)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.dtype = torch.bfloat16
    g = torch.Generator().manual_seed(1000 + version)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    head = config.hidden_size // config.num_attention_heads
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        model.model.embed_tokens.weight.mul_(0.02)
        model.model.norm.weight.fill_(1.0)
        for i, layer in enumerate(model.model.layers):
            layer.input_layernorm.weight.abs_().add_(0.5)
            layer.self_attn.v_proj.weight.zero_()
            layer.self_attn.v_proj.bias.zero_()
            layer.self_attn.v_proj.bias[version] = 4.0
            layer.self_attn.o_proj.weight.zero_()
            for d in range(head):  # head 0 (key/value head 0) -> dims of layer i
                layer.self_attn.o_proj.weight[head * i + d, d] = 1.0
            layer.mlp.down_proj.weight.zero_()
        lm = model.lm_head.weight
        lm.zero_()
        for a in range(REVEALING_VERSIONS):
            for b in range(REVEALING_VERSIONS):
                lm[revealing_token(a, b), a] = 1.0
                lm[revealing_token(a, b), head + b] = 1.0
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

    def test_kernel_state_to(self, path: str) -> str:
        """test_kernel_state written to `path`.<tp rank>; returns that path
        (vllm serve's collective_rpc route answers JSON, not bytes)."""
        out = f"{path}.{self.weightsync_tp_rank()}"
        with open(out, "wb") as f:
            f.write(self.test_kernel_state())
        return out

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

    def test_cpu_gemm_packs(self) -> bool:
        """Whether a linear layer's CPU GEMM dispatch reads a packed copy of
        its weight (vLLM's CPU backend on CPUs whose oneDNN path packs)
        rather than calling torch's linear on the parameter itself."""
        import torch

        for module in self.model_runner.model.modules():
            linear = module.__dict__.get("cpu_linear")
            if linear is None or linear is torch.nn.functional.linear:
                continue
            code = getattr(linear, "__code__", None)
            if code is None or code.co_freevars or getattr(linear, "__defaults__", None):
                return True
        return False


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

def trainer_layout_and_model(path: str, world: int = 1):
    """A transformers model loaded from `path` and its trainer layout (each
    of `world` ranks holding everything; transformers >= 5 keeps MoE experts
    stacked)."""
    import torch
    import weightsync.torch as wst
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    return model, wst.trainer_layout(model, world_size=world)


def _trainer_main(coordinator: str, engine: Any, first: str, commands: Any, results: Any,
                  transport: str, bucket_bytes: int, delta: str, rank: int = 0,
                  world: int = 1) -> None:
    """Runs in its own process: trainer rank `rank` of `world` (each holding
    the whole model); each command ("push", step, checkpoint dir) loads that
    version into the model in place and pushes it; ("push_and_die", step,
    dir, seconds) starts the push and kills this process `seconds` later;
    ("stop",) ends."""
    try:
        import torch
        import weightsync as ws

        model, layout = trainer_layout_and_model(first, world)
        with ws.Publisher(coordinator=coordinator, rank=rank, layout=layout, engine=engine,
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
                 bucket_bytes: int = 256 << 20, delta: str = "off", rank: int = 0,
                 world: int = 1, wait: bool = True):
        ctx = mp.get_context("spawn")
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_trainer_main,
                                args=(coordinator, engine, first, self.commands, self.results,
                                      transport, bucket_bytes, delta, rank, world), daemon=True)
        self.proc.start()
        if wait:
            self.ready()

    def ready(self) -> None:
        """Waits for the trainer's Publisher."""
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


class Trainers:
    """Trainer ranks 0..world-1, each its own process (Trainer), driven
    together: a push is every rank's."""

    def __init__(self, coordinator: str, engine: Any, first: str, world: int, **options: Any):
        self._start([Trainer(coordinator, engine, first, rank=r, world=world, wait=False,
                             **options) for r in range(world)])

    def _start(self, ranks: list) -> None:
        """Takes the rank processes (started together) and waits for each."""
        self.ranks = ranks
        for t in ranks:
            t.ready()

    def push(self, *args: Any, **kwargs: Any) -> None:
        for t in self.ranks:
            t.push(*args, **kwargs)

    def pushed(self, timeout: float = 120) -> dict:
        """Rank 0's result (every rank's push returned)."""
        results = [t.pushed(timeout) for t in self.ranks]
        return results[0]

    def push_and_die(self, *args: Any, **kwargs: Any) -> None:
        for t in self.ranks:
            t.push_and_die(*args, **kwargs)

    def wait_dead(self, timeout: float = 60) -> None:
        for t in self.ranks:
            t.proc.join(timeout)
            assert not t.proc.is_alive(), "a trainer rank did not die"

    def close(self) -> None:
        for t in self.ranks:
            t.close()


def wait_trainers_gone(coord: Any, timeout: float = 30.0) -> None:
    """Until the coordinator has dropped every trainer rank (and so aborted
    their step)."""
    deadline = time.monotonic() + timeout
    while any(m["role"] == "trainer" for m in coord.members()):
        assert time.monotonic() < deadline, coord.members()
        time.sleep(0.1)


def engine_config(path: str, framework: str, tp: int) -> dict:
    return {"framework": framework, "hf_config": os.path.join(path, "config.json"), "tp": tp,
            "replicas": 1}


def write_json(path: str, obj: Any) -> str:
    with open(path, "w") as f:
        json.dump(obj, f)
    return path


# ---- vLLM's trainer API against a `vllm serve` process (test_vllm_trainer_api.py) ----

def free_port() -> int:
    """A TCP port nothing listens on now (`vllm serve` takes no port 0)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_cli_shim(tmp: str) -> str:
    """A directory to put on the server's PYTHONPATH so that the `vllm`
    command runs: vllm-cpu 0.32's CLI asks importlib.metadata for the
    distribution "vllm" (`--version`), which vllm-cpu does not install
    (PackageNotFoundError). The stand-in says the version vLLM itself
    reports for vllm-cpu ("<version>+cpu", which its CPU platform detection
    reads)."""
    import vllm

    shim = os.path.join(tmp, "vllm-cli-shim")
    info = os.path.join(shim, f"vllm-{vllm.__version__}+cpu.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {vllm.__version__}+cpu\n")
    return shim


def serve_args(engine_args: dict) -> list:
    """ENGINE_ARGS as `vllm serve` flags."""
    out = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif isinstance(value, (dict, list)):
            out += [flag, json.dumps(value)]
        elif value is not False and value is not None:
            out += [flag, str(value)]
    return out


class Server:
    """A real `vllm serve` process (the `vllm` command's own main, in the
    venv's python) over `path` with weight transfer backend "weightsync" and
    VLLM_SERVER_DEV_MODE=1 (vLLM mounts its weight-transfer routes only
    then). Its process group is killed at stop(): no vLLM process outlives
    it. Inherits PYTHONPATH (install_process_shims: the AMX plugin, this
    directory)."""

    def __init__(self, path: str, tmp: str, tp: int = 1, **engine_args: Any):
        import subprocess

        self.path, self.port = path, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = os.path.join(tmp, f"vllm-serve-{self.port}.log")
        args = dict(ENGINE_ARGS, tensor_parallel_size=tp,
                    weight_transfer_config={"backend": "weightsync"}, **engine_args)
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", path,
               "--host", "127.0.0.1", "--port", str(self.port)] + serve_args(args)
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
        env["PYTHONPATH"] = os.pathsep.join(
            [serve_cli_shim(tmp)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        self.started = time.monotonic()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.start_seconds: Optional[float] = None

    def wait_ready(self, timeout: float = 240) -> float:
        """Seconds from start until /health answered."""
        import requests

        deadline = self.started + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm serve exited ({self.proc.returncode}):\n"
                                     f"{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    self.start_seconds = time.monotonic() - self.started
                    return self.start_seconds
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"vllm serve did not come up in {timeout} s:\n"
                                     f"{self.log_tail()}")
            time.sleep(0.5)

    def log_tail(self, chars: int = 4000) -> str:
        with open(self.log, errors="replace") as f:
            return f.read()[-chars:]

    def post(self, route: str, body: Optional[dict] = None) -> Any:
        import requests

        r = requests.post(self.url + route, json=body, timeout=120)
        assert r.status_code == 200, (route, r.status_code, r.text)
        return r.json() if r.content else None

    def tokens(self) -> list:
        """Greedy tokens of PROMPTS (token ids in, token ids out), as
        generate() asks an LLM for them."""
        out = self.post("/v1/completions", {
            "model": self.path, "prompt": PROMPTS, "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
        choices = sorted(out["choices"], key=lambda c: c["index"])
        return [list(c["token_ids"]) for c in choices]

    def continuation(self, prompt: list, max_tokens: int) -> list:
        """The greedy token ids the server answers `prompt` with, alone (on
        this CPU engine a request's greedy tokens do not depend on what it
        is batched with: 70 streams of 150-200 tokens under the load of
        StreamingLoad and tokens() each equalled the request alone)."""
        out = self.post("/v1/completions", {
            "model": self.path, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
        return list(out["choices"][0]["token_ids"])

    def weight_version(self) -> str:
        import requests

        return requests.get(self.url + "/weight_info", timeout=30).json()["weight_version"]

    def rpc(self, method: str, *args: str) -> list:
        """A collective_rpc on every worker (the dev route; string arguments
        only): each one's result."""
        return self.post("/collective_rpc", {"method": method, "args": list(args)})["results"]

    def states(self, tmp: str) -> list:
        """Every worker's kernel state (test_kernel_state, through files: the
        dev route answers JSON), in tensor-parallel rank order."""
        out = []
        for path in self.rpc("test_kernel_state_to", os.path.join(tmp, "server-state")):
            with open(path, "rb") as f:
                out.append(load_dump(f.read()))
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except Exception:  # noqa: BLE001 - then by force
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the engine core and workers too
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)


class StreamingLoad:
    """`streams` threads that each stream greedy completions from `server`
    one after another (max_tokens long, ignore_eos) until stop(): the load
    an RL server is always under. Records every request's finish reason and
    every token's arrival time, so that a test can say what the swap did
    to requests in flight and print the serving pause (the longest gap
    between two tokens of any request)."""

    PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]

    def __init__(self, server: Server, streams: int = 3, max_tokens: Any = 200,
                 stream: bool = True):
        import threading

        # stream=False: each request is answered whole (its tokens all
        # "arrive" at its end): the server's engine then spends its time
        # generating rather than waiting for the API server to stream.
        self.stream = stream
        # One length for every stream, or one per stream (streams of
        # different lengths do not start and end their requests together).
        self.server = server
        self.max_tokens = list(max_tokens) if isinstance(max_tokens, (list, tuple)) else (
            [max_tokens] * streams)
        assert len(self.max_tokens) == streams, (max_tokens, streams)
        self.requests: list = []   # per request: _one's entry
        self.errors: list = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._started = threading.Barrier(streams + 1)
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True)
                         for i in range(streams)]
        for t in self._threads:
            t.start()
        self._started.wait(timeout=120)

    def _one(self, first: list, max_tokens: int) -> None:
        import requests

        # [finish reason, chunk times, token ids, start time, token times,
        # response id], filled as it streams
        entry: list = [None, [], [], time.monotonic(), [], None]
        with self._lock:
            self.requests.append(entry)
        times, ids, arrived = entry[1], entry[2], entry[4]
        body = {"model": self.server.path, "prompt": self.PROMPT, "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True, "stream": self.stream,
                "return_token_ids": True}
        if not self.stream:
            r = requests.post(self.server.url + "/v1/completions", json=body, timeout=300)
            r.raise_for_status()
            answer = r.json()
            choice = answer["choices"][0]
            entry[5] = answer.get("id")
            now = time.monotonic()
            ids.extend(choice["token_ids"])
            times.append(now)
            arrived.extend([now] * len(ids))
            entry[0] = choice.get("finish_reason")
            if first:
                first.pop().wait(timeout=120)
            return
        with requests.post(self.server.url + "/v1/completions", json=body, stream=True,
                           timeout=300) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[len(b"data: "):])
                entry[5] = entry[5] or chunk.get("id")
                for choice in chunk.get("choices", []):
                    if choice.get("token_ids") or choice.get("text"):  # a chunk of tokens
                        now = time.monotonic()
                        got = choice.get("token_ids") or []
                        times.append(now)
                        ids.extend(got)
                        arrived.extend([now] * len(got))  # each token of the chunk
                        if first:
                            first.pop().wait(timeout=120)  # this stream is running
                    entry[0] = choice.get("finish_reason") or entry[0]

    def _run(self, i: int) -> None:
        first = [self._started]
        try:
            while not self._stop.is_set():
                self._one(first, self.max_tokens[i])
        except Exception as e:  # noqa: BLE001 - reported by stop()
            self.errors.append(f"stream {i}: {e!r}")
            if first:
                first.pop().abort()

    def stop(self) -> list:
        """Stops after the requests in flight; returns [(finish reason, token times)]."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=300)
        assert not self.errors, self.errors
        return [(entry[0], entry[1]) for entry in self.requests]

    def streams(self) -> list:
        """[(start time, [token ids], [their arrival times], finish reason,
        response id)] of every request so far."""
        with self._lock:
            return [(e[3], list(e[2]), list(e[4]), e[0], e[5]) for e in self.requests]


    def gaps(self, since: float, until: float) -> tuple:
        """(the longest gap between two tokens of one request that overlaps
        [since, until], the median gap of every request outside it)."""
        return self.longest_gap(since, until)[0], self.steady_gap(since, until)

    def longest_gap(self, since: float, until: float) -> tuple:
        """(seconds, start, end) of the longest gap between two tokens of
        one request that overlaps [since, until] ((0, since, since): none)."""
        best = (0.0, since, since)
        with self._lock:
            requests = [list(entry[1]) for entry in self.requests]
        for times in requests:
            for a, b in zip(times, times[1:]):
                if b >= since and a <= until and b - a > best[0]:
                    best = (b - a, a, b)
        return best

    def steady_gap(self, since: float, until: float) -> float:
        """The median gap between two tokens outside [since, until]."""
        outside = []
        with self._lock:
            requests = [list(entry[1]) for entry in self.requests]
        for times in requests:
            outside += [b - a for a, b in zip(times, times[1:]) if b < since or a > until]
        outside.sort()
        return outside[len(outside) // 2] if outside else 0.0


def load_version(model: Any, path: str) -> None:
    """Loads checkpoint `path` into `model` in place: each parameter (an
    FSDP2 DTensor: this rank's shard of it) from the checkpoint's tensor of
    its name."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    fresh = hf_tensors(path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = fresh[name]
            if isinstance(p, DTensor):
                p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())
            else:
                p.copy_(full)


def _api_trainer_main(rank: int, world: int, store: str, url: str, first: str, commands: Any,
                      results: Any) -> None:
    """One rank of an FSDP2 trainer (gloo, CPU) that drives `vllm serve` at
    `url` through vLLM's trainer API (WeightTransferTrainerFactory, backend
    "weightsync", HTTPVLLMWeightSyncClient, ModuleSource over the FSDP2
    model). Commands: ("init", init_info fields), ("send", checkpoint dir:
    loaded into the model, then send_weights()), ("shutdown",), ("stop",).
    Answers (rank, "ok", value), (rank, "raised", (class, code, message))
    for a weightsync error, or (rank, "error", traceback)."""
    engine = None
    try:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world)
        import weightsync as ws
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor
        from transformers import AutoModelForCausalLM
        from vllm.distributed.weight_transfer import (HTTPVLLMWeightSyncClient, ModuleSource,
                                                      WeightTransferTrainerFactory)
        from weightsync._vllm_trainer import WeightsyncTrainerInitInfo

        model = AutoModelForCausalLM.from_pretrained(first, dtype=torch.bfloat16)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        params = list(model.named_parameters())
        shards = {"dtensors": sum(isinstance(p, DTensor) for _, p in params),
                  "params": len(params),
                  "local_bytes": sum((p.to_local() if isinstance(p, DTensor) else p).nbytes
                                     for _, p in params)}
        client = HTTPVLLMWeightSyncClient(url)
        results.put((rank, "ok", shards))
        while True:
            cmd = commands.get()
            if cmd[0] == "stop":
                break
            try:
                if cmd[0] == "init":
                    engine = WeightTransferTrainerFactory.trainer_init(
                        WeightsyncTrainerInitInfo(rank=rank, **cmd[1]), client=client,
                        source=ModuleSource(model))
                    value: Any = type(engine).__name__
                elif cmd[0] == "send":
                    load_version(model, cmd[1])
                    value = engine.send_weights()
                elif cmd[0] == "shutdown":
                    engine.shutdown()
                    engine, value = None, None
                else:
                    raise ValueError(f"unknown command {cmd!r}")
                results.put((rank, "ok", value))
            except ws.Error as e:
                results.put((rank, "raised", (type(e).__name__, e.code, str(e))))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if engine is not None:
            engine.shutdown()
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


class ApiTrainers:
    """`world` trainer-rank processes of _api_trainer_main, driven together:
    call(cmd) hands every rank the command and returns each rank's answer
    (rank order). Start: each rank's shard summary in .shards (after ready())."""

    def __init__(self, world: int, url: str, first: str, tmp: str):
        ctx = mp.get_context("spawn")
        self.world = world
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(world)]
        store = os.path.join(tmp, f"trainer-store-{os.getpid()}-{time.monotonic_ns()}")
        self.procs = [ctx.Process(target=_api_trainer_main,
                                  args=(r, world, store, url, first, self.commands[r],
                                        self.results), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.shards: Optional[list] = None

    def ready(self, timeout: float = 180) -> list:
        self.shards = [value for _, value in self._collect(timeout)]
        return self.shards

    def call(self, *cmd: Any, timeout: float = 180) -> list:
        for q in self.commands:
            q.put(cmd)
        return self._collect(timeout)

    def _collect(self, timeout: float) -> list:
        deadline = time.monotonic() + timeout
        got: dict = {}
        while len(got) < self.world:
            try:
                rank, kind, value = self.results.get(timeout=0.5)
            except queue_mod.Empty:
                dead = [p.exitcode for p in self.procs if not p.is_alive()]
                if dead:
                    raise AssertionError(f"a trainer rank exited ({dead})") from None
                if time.monotonic() > deadline:
                    raise AssertionError("the trainer ranks did not answer in time") from None
                continue
            if kind == "error":
                raise AssertionError(f"trainer rank {rank} failed:\n{value}")
            got[rank] = (kind, value)
        return [got[r] for r in range(self.world)]

    def close(self) -> None:
        for q, p in zip(self.commands, self.procs):
            if p.is_alive():
                q.put(("stop",))
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


def engine_request(reported: dict, response_id: Optional[str]) -> Optional[str]:
    """The key of `reported` (a step's "requests": the engine's request ids)
    that is the request of an OpenAI completion answered with `response_id`
    (one prompt): vLLM's id for it is the response id, "-0", then "-" and 8
    random characters. None when it is not there."""
    if not response_id:
        return None
    found = [k for k in reported if k.startswith(f"{response_id}-0-")]
    assert len(found) <= 1, (response_id, found)
    return found[0] if found else None


class HeldRequest:
    """One greedy request in flight in an offline LLM while a weight update
    runs: added, stepped until its first tokens came back (`seen` of them),
    then the scheduler paused (sleep level 0, mode "keep": the request stays,
    no engine step runs). finish() resumes it and runs it to its end, so
    that a test can compare the update's reported boundary ("requests")
    with what the request made before and after."""

    def __init__(self, llm: Any, prompt: list, max_tokens: int = 200, rid: str = "held"):
        from vllm import SamplingParams

        self.llm, self.rid, self.max_tokens = llm, rid, max_tokens
        llm.llm_engine.add_request(rid, {"prompt_token_ids": list(prompt)}, SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        self.seen = 0
        deadline = time.monotonic() + 120
        while self.seen == 0:
            assert time.monotonic() < deadline, "the held request made no token in 120 s"
            for out in llm.llm_engine.step():
                if out.request_id == rid:
                    self.seen = len(out.outputs[0].token_ids)
                    assert not out.finished, "the held request ended before the pause"
        llm.sleep(level=0, mode="keep")

    def key(self, reported: dict) -> str:
        """Its key among an update's "requests" (vLLM's id: ours, "-", 8
        random characters)."""
        found = [k for k in reported if k.startswith(self.rid + "-")]
        assert len(found) == 1, (self.rid, reported)
        return found[0]

    def finish(self) -> list:
        """Resumes the engine and returns the request's tokens at its end."""
        self.llm.wake_up(tags=["scheduling"])
        tokens: list = []
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline, "the held request did not end in 120 s"
            for out in self.llm.llm_engine.step():
                if out.request_id == self.rid:
                    tokens = list(out.outputs[0].token_ids)
                    if out.finished:
                        return tokens
