"""Checkpoint versions for the real-engine tests (test_vllm.py and
test_sglang.py), importable from either engine's venv: nothing here imports
an engine."""

from __future__ import annotations


def nearby_checkpoint(src: str, out: str, seed: int, fraction: float = 0.01,
                      prefix: str = "") -> str:
    """Checkpoint `src` with about `fraction` of each parameter's elements
    moved by one bf16 step (what an RL step's optimizer does to a few
    weights): the next version of a delta-sync run. Only the parameters
    whose name starts with `prefix` move (a partly frozen model). Persistent
    buffers are kept as they are."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if not name.startswith(prefix):
                continue
            flat = p.view(-1)
            picked = torch.rand(flat.shape, generator=g) < fraction
            bits = flat.view(torch.int16)
            bits[picked] ^= 1  # the lowest mantissa bit: the next bf16 value
    model.save_pretrained(out)
    return out


def differing_keys(a: str, b: str) -> list:
    """The tensor names whose values differ between the safetensors
    checkpoints in directories `a` and `b`."""
    import glob
    import os

    import torch
    from safetensors.torch import load_file

    def tensors(d: str) -> dict:
        out: dict = {}
        for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
            out.update(load_file(f))
        return out

    ta, tb = tensors(a), tensors(b)
    return sorted(k for k in ta if not torch.equal(ta[k], tb[k]))
