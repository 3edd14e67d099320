"""LoRA adapters: sync only the adapter (docs/lora.md).

A PEFT model's adapter parameters (`lora_A` / `lora_B`, plain or
FSDP2-sharded DTensors) travel under the keys PEFT's `save_pretrained`
writes (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`):
every engine rank receives the whole adapter, and the engine's own LoRA code
(vLLM's) builds and slices it for its tensor-parallel rank. The engine
config of an adapter job says which adapter it is (field "lora": name, the
engine's integer id for it, PEFT's adapter config, the base model's
config), so that an engine refuses an adapter that does not fit it before a
byte moves.

Trainer side (every trainer rank; torch and PEFT only):

    import weightsync.lora as wsl
    engine = wsl.engine_config(peft_model, "math", lora_id=1, tp=2)   # same on every rank
    with wsl.publisher(peft_model, coordinator=addr, rank=r, engine=engine) as pub:
        ...  # each step, after the optimizer step:
        pub.push(step)

Engine side (vLLM): weightsync.vllm.connect_lora / receive_lora, or the
weight-transfer engine's "adapters" (docs/engines.md).
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from ._errors import Error

__all__ = ["ADAPTER_FIELD", "adapter_params", "adapter_config", "engine_config", "trainer_layout",
           "publisher", "adapter_of", "peft_key", "check_base", "config_dict"]

#: The engine config's field that makes its job an adapter job.
ADAPTER_FIELD = "lora"

# PEFT's parameter names: <module>.lora_A.<adapter>.weight (also lora_B,
# lora_embedding_A/B, lora_magnitude_vector for DoRA).
_LORA_PARAM = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B)\.(?P<adapter>[^.]+)\.weight$")
_OTHER_ADAPTER_PARAM = re.compile(
    r"\.(lora_embedding_A|lora_embedding_B|lora_magnitude_vector)\.(?P<adapter>[^.]+)")

# Base-model fields an adapter's shapes depend on: an engine whose model
# differs in one of them is refused (a base model mismatch).
BASE_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
               "moe_intermediate_size", "num_experts")


def peft_key(param_name: str, adapter: str = "default") -> Optional[str]:
    """The key PEFT's save_pretrained writes for parameter `param_name` of
    adapter `adapter` (None: not one of its lora_A / lora_B weights)."""
    from ._tensors import clean_name

    m = _LORA_PARAM.match(clean_name(param_name))
    if m is None or m.group("adapter") != adapter:
        return None
    return f"{m.group('module')}.{m.group('kind')}.weight"


def adapter_params(model: Any, adapter: str = "default") -> list:
    """[(PEFT key, parameter)] of adapter `adapter` of a PEFT model (DTensors
    stay DTensors), in the model's order. Refuses adapters vLLM cannot serve
    from these tensors alone (embedding LoRA, DoRA, modules_to_save)."""
    out, adapters = [], set()
    for name, p in model.named_parameters():
        m = _LORA_PARAM.match(name)
        if m is not None:
            adapters.add(m.group("adapter"))
            if m.group("adapter") == adapter:
                out.append((peft_key(name, adapter), p))
            continue
        other = _OTHER_ADAPTER_PARAM.search(name)
        if other is not None and other.group("adapter") == adapter:
            raise Error("unsupported", f"adapter {adapter!r}: parameter {name!r} (embedding "
                        "LoRA or DoRA) is not synced: only lora_A / lora_B of linear layers")
        if ".modules_to_save." in name and f".{adapter}." in name:
            raise Error("unsupported", f"adapter {adapter!r}: modules_to_save ({name!r}) are "
                        "not synced: only lora_A / lora_B of linear layers")
    if not out:
        have = ", ".join(sorted(adapters)) or "none"
        raise Error("not_found", f"the model has no LoRA weights of adapter {adapter!r} "
                    f"(its adapters: {have})")
    return out


def _jsonable(value: Any) -> Any:
    import enum

    if isinstance(value, enum.Enum):  # PEFT's peft_type, task_type
        value = value.value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_jsonable(v) for v in value]
        return sorted(items, key=str) if isinstance(value, (set, frozenset)) else items
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def adapter_config(model: Any, adapter: str = "default") -> dict:
    """PEFT's config of adapter `adapter` as save_pretrained writes it
    (adapter_config.json), as a JSON-ready dict."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or adapter not in configs:
        raise Error("not_found", f"the model has no PEFT config of adapter {adapter!r} "
                    f"(a peft.PeftModel has .peft_config; it has {sorted(configs or {})})")
    config = configs[adapter]
    return _jsonable(config.to_dict() if hasattr(config, "to_dict") else dict(vars(config)))


def config_dict(config: Any) -> dict:
    """A transformers config (None: {}) as a dict, a multimodal config's
    language-model fields (`text_config`) merged in: what check_base
    compares, on the trainer's base model and on the engine's."""
    if config is None:
        return {}
    if not hasattr(config, "to_json_string"):
        return dict(getattr(config, "__dict__", {}))
    full = json.loads(config.to_json_string())
    return {**full.get("text_config", {}), **full}


def _base_config(model: Any) -> dict:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    full = config_dict(getattr(base, "config", None))
    return {k: full[k] for k in BASE_FIELDS if full.get(k) is not None}


def engine_config(model_or_params: Any, name: str, *, lora_id: int = 1,
                  config: Optional[dict] = None, base: Optional[dict] = None, tp: int = 1,
                  replicas: int = 1, adapter: str = "default") -> dict:
    """The engine config of an adapter job: every engine rank (`tp` per
    replica, `replicas` replicas) receives every adapter tensor whole, under
    PEFT's keys (framework "derived" with an explicit layout), and field
    "lora" names the adapter (`name`, the engine's integer `lora_id` for it:
    vLLM's LoRARequest.lora_int_id), PEFT's adapter `config` and the `base`
    model's config fields its shapes depend on. `model_or_params`: a PEFT
    model (config and base read from it), or [(PEFT key, tensor)] with
    `config` (and `base`) given. The same on every trainer rank."""
    if not isinstance(name, str) or not name:
        raise Error("invalid_argument", "a LoRA adapter needs a non-empty name")
    if not isinstance(lora_id, int) or isinstance(lora_id, bool) or lora_id < 1:
        raise Error("invalid_argument", f"adapter {name!r}: lora_id must be a positive integer "
                    f"(vLLM's lora_int_id), got {lora_id!r}")
    from ._tensors import dtype_name

    if hasattr(model_or_params, "named_parameters"):
        params = adapter_params(model_or_params, adapter)
        if config is None:
            config = adapter_config(model_or_params, adapter)
        if base is None:
            base = _base_config(model_or_params)
    else:
        params = list(model_or_params)
    if config is None:
        raise Error("invalid_argument", f"adapter {name!r}: PEFT's adapter config is needed "
                    "(pass config=, or a PEFT model)")
    tensors, rank_params = [], []
    for key, t in params:
        shape, dtype = [int(d) for d in t.shape], dtype_name(t.dtype)
        tensors.append({"key": key, "shape": shape, "dtype": dtype})
        box = {"offsets": [0] * len(shape), "lengths": shape}
        rank_params.append({"name": key, "dtype": dtype, "shape": shape, "segments": [
            {"hf_key": key, "hf_box": box, "param_box": box, "transpose": False}]})
    ranks = [{"rank": r, "params": rank_params} for r in range(tp)]
    return {"framework": "derived", "hf_config": dict(base or {}), "tp": tp,
            "replicas": replicas, "dtype": tensors[0]["dtype"] if tensors else "F32",
            "derived": {"tensors": tensors, "ranks": ranks},
            ADAPTER_FIELD: {"name": name, "id": lora_id, "config": _jsonable(dict(config)),
                            "base": dict(base or {})}}


def adapter_of(engine: Any) -> Optional[dict]:
    """The "lora" field of an engine config (path, dict or JSON; one group),
    checked: {"name", "id", "config", "base"}; None for a full-model job."""
    from ._api import load_json

    parsed = json.loads(load_json(engine, "engine config")[0])
    groups = parsed if isinstance(parsed, list) else [parsed]
    found = [g.get(ADAPTER_FIELD) for g in groups if isinstance(g, dict)]
    if all(f is None for f in found):
        return None
    if len(groups) != 1:
        raise Error("invalid_argument", "an adapter job's engine config has one group (its "
                    f"field {ADAPTER_FIELD!r} names the adapter), this one has {len(groups)}")
    lora = found[0]
    if not isinstance(lora, dict):
        raise Error("format", f"engine config: field {ADAPTER_FIELD!r} must be an object")
    for field, kind in (("name", str), ("id", int), ("config", dict)):
        if not isinstance(lora.get(field), kind):
            raise Error("format", f"engine config: field '{ADAPTER_FIELD}.{field}' must be "
                        f"{'a string' if kind is str else 'an integer' if kind is int else 'an object'}"
                        f", got {json.dumps(lora.get(field))}")
    if isinstance(lora["id"], bool):
        raise Error("format", f"engine config: field '{ADAPTER_FIELD}.id' must be an integer, "
                    f"got {json.dumps(lora['id'])}")
    base = lora.get("base")
    if base is not None and not isinstance(base, dict):
        raise Error("format", f"engine config: field '{ADAPTER_FIELD}.base' must be an object "
                    f"(the base model's config fields), got {json.dumps(base)}")
    if lora["id"] < 1:
        raise Error("invalid_argument", f"adapter {lora['name']!r}: id must be positive, got "
                    f"{lora['id']}")
    if groups[0].get("framework") != "derived":
        raise Error("format", f"adapter {lora['name']!r}: the engine config must be framework "
                    "'derived' with the adapter's tensors (weightsync.lora.engine_config)")
    return {"name": lora["name"], "id": lora["id"], "config": lora["config"],
            "base": dict(lora.get("base") or {})}


def trainer_layout(model_or_params: Any, adapter: str = "default",
                   world_size: Optional[int] = None) -> dict:
    """The trainer layout of this rank's adapter parameters (PEFT's keys;
    FSDP2 shards as LoadSpecs), as weightsync.torch.trainer_layout
    (`world_size`: the trainer ranks, default torch.distributed's world)."""
    from .torch import trainer_layout as layout_of

    params = (adapter_params(model_or_params, adapter)
              if hasattr(model_or_params, "named_parameters") else list(model_or_params))
    return layout_of(params, world_size=world_size)


def publisher(model: Any, coordinator: Any, rank: int, engine: Any, adapter: str = "default",
              world_size: Optional[int] = None, **options: Any):
    """A weightsync.Publisher of this rank's adapter parameters, registered:
    push(step) sends the adapter of step `step`. `world_size`: the trainer
    ranks (default torch.distributed's world; plain tensors are then held
    whole by every rank). `options`: Publisher's."""
    from ._publisher import Publisher

    params = adapter_params(model, adapter)
    pub = Publisher(coordinator=coordinator, rank=rank,
                    layout=trainer_layout(params, world_size=world_size),
                    engine=engine, **options)
    try:
        for key, p in params:
            pub.register(key, p)
    except BaseException:
        pub.close()
        raise
    return pub


def check_base(adapter: dict, engine_config: dict, where: str) -> None:
    """Refuses an adapter trained on another base model than the engine's:
    `engine_config` is the engine's HF config (dict); `where` names the engine.
    Only fields both configs have are compared (an engine's config may leave
    out what the adapter's base recorded, e.g. head_dim)."""
    bad = [f"{k}: the adapter's base has {v!r}, the engine's model {engine_config.get(k)!r}"
           for k, v in sorted(adapter.get("base", {}).items())
           if k in engine_config and engine_config.get(k) != v]
    if bad:
        raise Error("mismatch", f"adapter {adapter['name']!r} was trained on another base model "
                    f"than {where} serves: {'; '.join(bad)}")
