"""The tiny FP8 models of test_vllm_fp8.py and test_sglang_fp8.py: the
configs/models/tiny-*-fp8 configs (Qwen3-FP8's and Qwen3-30B-A3B-FP8's
modules_to_not_convert, DeepSeek-V3's quantization_config) and variants
where the engines' rules differ. Nothing here imports an engine."""
from __future__ import annotations

import copy
import json
import os

import weightsync as ws

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(name: str) -> dict:
    with open(os.path.join(ROOT, "configs", "models", name, "config.json")) as f:
        return json.load(f)


def _with_ignored(name: str, ignored: list) -> dict:
    c = copy.deepcopy(_config(name))
    c["quantization_config"]["modules_to_not_convert"] = ignored
    return c


#: case -> config.json
#: (an MoE model first: vLLM makes its expert-parallel group only when the
#: model it is set up for has experts)
CASES = {
    "qwen3_moe": _config("tiny-qwen3-moe-fp8"),
    # Routers not listed: vLLM 0.32 quantizes Qwen3-MoE's, SGLang does not.
    "qwen3_moe_routers": _with_ignored("tiny-qwen3-moe-fp8", ["lm_head"]),
    # Layer 0's experts listed by one expert's projection; no "model." prefix
    # on an attention module (SGLang adds it, vLLM matches exactly).
    "qwen3_moe_experts": _with_ignored("tiny-qwen3-moe-fp8", [
        "model.layers.0.mlp.gate", "model.layers.0.mlp.experts.1.down_proj",
        "layers.1.self_attn.o_proj"]),
    "deepseek_v3": _config("tiny-deepseek-v3-fp8"),
    "deepseek_v3_mla_bf16": _with_ignored("tiny-deepseek-v3-fp8", [
        "model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa"]),
    # One part of a fused module listed: both engines refuse the model.
    "deepseek_v3_mixed": _with_ignored("tiny-deepseek-v3-fp8", [
        "model.layers.0.self_attn.q_a_proj"]),
    "qwen3": _config("tiny-qwen3-fp8"),
}


def expected_refusals(framework: str) -> dict:
    """case -> the start of weightsync's refusal."""
    engine = {"vllm": "vLLM 0.32", "sglang": "SGLang 0.5.23"}[framework]
    return {"deepseek_v3_mixed": f"{engine} refuses this model"}


def model_dirs(tmp: str) -> dict:
    """case -> a model directory holding the case's config.json."""
    out = {}
    for case, config in CASES.items():
        d = os.path.join(tmp, case)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(config, f)
        out[case] = d
    return out


_TORCH = {"F8_E4M3": "float8_e4m3fn", "F32": "float32"}


def weightsync_fp8(model_dir: str, framework: str) -> dict:
    """{param: [torch dtype, shape]} of every FP8 param of weightsync's
    layout (tp=1) and its scale param."""
    engine = {"framework": framework, "hf_config": os.path.join(model_dir, "config.json"),
              "tp": 1, "replicas": 1, "dtype": "BF16"}
    params = {p.name: (p.dtype, list(p.shape)) for p in ws.engine_params(engine, 0, 0)}
    out = {}
    for name, (dtype, shape) in params.items():
        if dtype == "F8_E4M3":
            out[name] = [_TORCH[dtype], shape]
            scale = params[name + "_scale_inv"]
            out[name + "_scale_inv"] = [_TORCH[scale[0]], scale[1]]
    return out


def adversarial_bf16(shape: list, seed: int):
    """A BF16 tensor of random normal blocks and, at fixed places, the blocks
    a quantizer gets wrong first: all zeros, amax under the 1e-4 floor,
    +-448 (codes unscaled: ties, subnormal codes), the largest finite BF16
    values, one outlier among tiny values; edge blocks where the shape is
    not a multiple of 128."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 0.02
    rows, cols = shape

    def block(i: int, j: int):
        return x[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]

    nb = [(i, j) for i in range((rows + 127) // 128) for j in range((cols + 127) // 128)]
    fills = [
        lambda b: b.zero_(),
        lambda b: b.mul_(1e-5),
        lambda b: b.copy_((torch.rand(b.shape, generator=g) * 896 - 448).round()),
        lambda b: b.copy_(torch.randn(b.shape, generator=g).sign() * 3.3e38),
        lambda b: (b.mul_(1e-3), b.__setitem__((0, 0), 7.5)),
    ]
    for k, (i, j) in enumerate(nb[1:]):
        fills[k % len(fills)](block(i, j))
    return x.to(torch.bfloat16)


def materialize_fp8(tmp: str, model: str, scale: str, seed: int = 5) -> tuple:
    """({key: BF16 tensor} of an adversarial checkpoint of configs/models/
    `model`, {name: tensor} of `weightsync materialize` of it into an FP8
    engine of framework "hf" with `scale`: every linear weight whole, beside
    its "<key>_scale_inv")."""
    import subprocess

    import torch
    from safetensors.torch import load_file, save_file

    from weightsync._cli import cli_path

    hf = _config(model)
    ckpt = {}
    for i, p in enumerate(ws.engine_params({"framework": "hf", "hf_config": hf, "tp": 1,
                                            "dtype": "BF16"}, 0, 0)):
        shape = list(p.shape)
        ckpt[p.name] = (adversarial_bf16(shape, seed + i) if len(shape) == 2
                        else torch.ones(shape, dtype=torch.bfloat16))
    path = os.path.join(tmp, f"{model}.safetensors")
    save_file(ckpt, path)
    engine = os.path.join(tmp, f"engine-{scale}.json")
    with open(engine, "w") as f:
        json.dump({"framework": "hf", "hf_config": hf, "tp": 1, "dtype": "BF16",
                   "quantization": {"method": "fp8", "scale": scale}}, f)
    out = os.path.join(tmp, f"fp8-{scale}.safetensors")
    subprocess.run([cli_path(), "materialize", "--checkpoint", path, "--engine", engine,
                    "--rank", "0", "--out", out], check=True, capture_output=True, timeout=300)
    return ckpt, load_file(out)
