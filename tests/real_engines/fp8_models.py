"""Each engine's own model construction from a tiny FP8 config.json, on the
meta device (issue 54): which params the engine builds in FP8, with which
scale params, with no kernel and no weights. Run as a script in the engine's
venv (a process of its own: the engines set up torch.distributed and their
global config):

    python fp8_models.py vllm|sglang MODEL_DIR...

prints one JSON object {model_dir: {param: [dtype, shape]}} of every FP8
weight and every scale param beside one, or {model_dir: {"error": text}}
where the engine refuses the model; for vLLM, also a line FP8-SERIALIZED
{model_dir: what vLLM's quant config says of the checkpoint
(is_checkpoint_fp8_serialized)}. Facts only: nothing of weightsync is
imported here. SGLang on a CPU needs sglang_shim/ on PYTHONPATH
(test_sglang_fp8.py puts it there)."""

from __future__ import annotations

import json
import socket
import sys


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fp8_of(model) -> dict:
    params = {n: (str(p.dtype).removeprefix("torch."), list(p.shape))
              for n, p in model.named_parameters()}
    out = {}
    for name, (dtype, shape) in params.items():
        if dtype == "float8_e4m3fn":
            out[name] = [dtype, shape]
            for suffix in ("_scale_inv", "_scale"):
                if name + suffix in params:
                    out[name + suffix] = list(params[name + suffix])
    return out


def vllm_models(dirs: list) -> dict:
    import torch
    import vllm.model_executor.layers.quantization.fp8 as fp8
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model

    # The linear kernel is chosen when the weights are created; this CPU may
    # have none for FP8 (AMX): the params are all this needs.
    fp8.init_fp8_linear_kernel = lambda *a, **k: None
    out = {}
    serialized = {}
    for i, d in enumerate(dirs):
        vc = EngineArgs(model=d, skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
                        load_format="dummy", dtype="bfloat16").create_engine_config()
        serialized[d] = getattr(vc.quant_config, "is_checkpoint_fp8_serialized", None)
        with set_current_vllm_config(vc):
            if i == 0:
                init_distributed_environment(
                    world_size=1, rank=0, local_rank=0, backend="gloo",
                    distributed_init_method=f"tcp://127.0.0.1:{_port()}")
                initialize_model_parallel(1, 1)
            try:
                with torch.device("meta"):
                    out[d] = _fp8_of(initialize_model(vllm_config=vc))
            except ValueError as e:
                out[d] = {"error": str(e)}
    print("FP8-SERIALIZED " + json.dumps(serialized))
    return out


def sglang_models(dirs: list) -> dict:
    import torch
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.model_loader.loader import _get_quantization_config, _initialize_model
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    out = {}
    for i, d in enumerate(dirs):
        args = ServerArgs(model_path=d, skip_tokenizer_init=True, device="cpu",
                          dtype="bfloat16", load_format="dummy")
        publish(args, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=0))
        initialize_moe_config()
        if i == 0:
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{_port()}")
            initialize_model_parallel()
        try:
            mc = ModelConfig.from_server_args(args)
            lc = LoadConfig(load_format="dummy")
            with torch.device("meta"):
                out[d] = _fp8_of(_initialize_model(mc, lc, _get_quantization_config(mc, lc)))
        except ValueError as e:
            out[d] = {"error": str(e)}
    return out


def main() -> None:
    engine, dirs = sys.argv[1], sys.argv[2:]
    got = {"vllm": vllm_models, "sglang": sglang_models}[engine](dirs)
    print("FP8-MODELS " + json.dumps(got))


if __name__ == "__main__":
    main()
