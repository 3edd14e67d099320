"""Megatron-Core trainers: the trainer layout of a Megatron-Core model
(Transformer Engine layer spec) from its HF config and parallel sizes, so
that every rank registers its own `model.named_parameters()` as they are.

    import torch.distributed as dist
    import weightsync as ws
    import weightsync.megatron as wsm

    layout = wsm.trainer_layout(hf_config, **wsm.parallel_sizes())   # or pp=, tp=, dp=, ep=, etp=
    pub = ws.Publisher(coordinator=addr, rank=dist.get_rank(), layout=layout, engine=E)
    pub.register_module(model)          # this rank's stage only: its local layer names
    ...
    pub.push(step)                      # after each optimizer step

The layout is `weightsync trainer-layout --style megatron` (the same C++
generator): ranks in Megatron's default order tp-cp-ep-dp-pp, so the layout's
rank is the process's global rank. Names are those of one pipeline stage
(`decoder.layers.{local}`); a param's `stage` says which. docs/megatron.md
lists every name, the mesh and what Megatron refuses.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from . import _core

__all__ = ["trainer_layout", "parallel_sizes", "config_json"]


def config_json(model_config: Any) -> str:
    """The HF config as JSON text: a config.json path, a directory holding
    one, a dict, or a transformers config (anything with to_dict())."""
    if isinstance(model_config, (str, os.PathLike)):
        path = os.fspath(model_config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            return f.read()
    if hasattr(model_config, "to_dict"):
        model_config = model_config.to_dict()
    return json.dumps(dict(model_config))


def trainer_layout(model_config: Any, parallel: Optional[str] = None, *, pp: int = 1,
                   tp: int = 1, dp: int = 1, cp: int = 1, ep: int = 1, etp: Optional[int] = None,
                   dtype: Optional[str] = None, vocab_divisible_by: int = 128,
                   first_stage_layers: Optional[int] = None,
                   last_stage_layers: Optional[int] = None) -> dict:
    """The trainer layout (a dict, DESIGN.md's JSON) of a Megatron-Core model.

    `parallel` ("pp=2,tp=2,dp=1,ep=2,etp=1", the CLI's --mesh) or the keyword
    sizes; `etp` defaults to tp as in Megatron-Core. `vocab_divisible_by` is
    make_vocab_size_divisible_by (0: no padding, Megatron-Bridge's default);
    `first_stage_layers` / `last_stage_layers` are
    num_layers_in_first/last_pipeline_stage. `dtype` (a safetensors name,
    "BF16") overrides the config's. Raises weightsync.Error where
    Megatron-Core refuses the configuration (uneven stages, query groups
    neither a multiple nor a divisor of tp, experts not divisible by ep, ...)."""
    if parallel is None:
        sizes = {"pp": pp, "tp": tp, "dp": dp, "cp": cp, "ep": ep}
        if etp is not None:
            sizes["etp"] = etp
        parallel = ",".join(f"{k}={int(v)}" for k, v in sizes.items())
    text = _core.make_trainer_layout(config_json(model_config), parallel, "megatron", dtype,
                                     int(vocab_divisible_by), first_stage_layers,
                                     last_stage_layers)
    return json.loads(text)


def parallel_sizes() -> dict:
    """The sizes of the running Megatron-Core job (megatron.core.parallel_state,
    after initialize_model_parallel): {"pp", "tp", "dp", "cp", "ep", "etp"},
    to pass on as trainer_layout(config, **parallel_sizes())."""
    from megatron.core import parallel_state as ps  # imported when used

    return {
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "tp": ps.get_tensor_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
        "cp": ps.get_context_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "etp": ps.get_expert_tensor_parallel_world_size(),
    }
