"""Test-only shims that let real SGLang 0.5.23 run its generic path on a CPU
with no sglang-kernel CPU build (this folder is put on PYTHONPATH by
tests/real_engines/test_sglang.py for the engine processes it starts; it is never
part of the weightsync package):

- `vllm._custom_ops` (the `vllm` folder beside this file): pure-torch
  rotary_embedding / silu_and_mul / moe_sum, which SGLang's generic path
  imports from vLLM.
- tp > 1: SGLang builds a PyNccl communicator for every group unless the
  platform says otherwise, and PyNccl needs CUDA; on a CPU it is turned off
  (gloo carries the collectives).

- LoRA (test_sglang_lora.py): SGLang's LoRA layers and its torch_native
  LoRA backend allocate pinned host memory unconditionally
  (`torch.tensor(..., pin_memory=True)`, sglang/srt/lora/layers.py), and
  pinning needs a CUDA driver. Without CUDA, pinning is made a no-op: it
  only speeds host-to-device copies, which a CPU-only process never makes
  (engines started with WEIGHTSYNC_TEST_SGLANG_LORA=1 only).

SGLang starts its scheduler processes with `spawn`, so each runs this file at
interpreter start; the patch is applied when SGLang's module is imported.
"""

import importlib.abc
import importlib.machinery
import sys

_TARGET = "sglang.srt.distributed.parallel_state"


def _patch(module):
    original = module.init_model_parallel_group

    def init_model_parallel_group(*args, **kwargs):
        kwargs["use_pynccl"] = False
        return original(*args, **kwargs)

    module.init_model_parallel_group = init_model_parallel_group


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _Finder())


def _unpinned_host_memory():
    import functools
    import os

    if os.environ.get("WEIGHTSYNC_TEST_SGLANG_LORA") != "1":
        return
    import torch

    if torch.cuda.is_available():
        return
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self

    def drop_pin(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return fn(*args, **kwargs)

        return call

    for name in ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_like",
                 "zeros_like", "ones_like", "as_tensor"):
        setattr(torch, name, drop_pin(getattr(torch, name)))


_unpinned_host_memory()
