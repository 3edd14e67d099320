"""LoRA adapters into a vLLM worker's LoRA manager (imports vLLM; only
weightsync.vllm's worker-side code imports this module). docs/lora.md.

Each committed step of an adapter job (weightsync.lora) becomes adapter
`name` version k in the worker's LoRA manager, built by vLLM's own adapter
code from the received tensors, as its disk loader builds it
(`WorkerLoRAManager._load_adapter`: PEFTHelper, validate_legal, the
unexpected-module check, `LoRAModel.from_lora_tensors` on the CPU, the
manager's validators), then put in place of version k-1 (remove, add,
activate: what vLLM does for `load_inplace=True`), and pinned in the
manager's CPU cache, so that vLLM never reloads it from its LoRARequest's
path. Every worker takes the whole adapter; vLLM's LoRA layers slice it for
their tensor-parallel rank (`set_lora`). The base weights are not touched.

A step applies only once committed (the data lands in private tensors
first); building the new version happens before anything changes, and a
failure while swapping puts version k-1's LoRAModel back: the worker serves
version k-1 or version k, never a mix.
"""

from __future__ import annotations

from typing import Any, Optional

from ._engine import EngineSync, UpdateProtocol
from ._errors import Error
from .lora import adapter_of, check_base, config_dict


def _lora_api():
    try:
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper
        from vllm.lora.utils import is_base_embedding_weights, parse_fine_tuned_lora_name
    except ImportError as e:
        raise Error("unsupported", f"this vLLM has no LoRA model API weightsync knows "
                    f"(vllm.lora.lora_model.LoRAModel.from_lora_tensors, vLLM 0.32): {e}") from None
    return LoRAModel, PEFTHelper, parse_fine_tuned_lora_name, is_base_embedding_weights


class VllmLora(UpdateProtocol):
    """One adapter's versions in one vLLM worker's LoRA manager."""

    load_kind = "engine"
    #: finish() changes the engine whole or not at all (EngineSync keeps no
    #: copy to restore, and never poisons the engine for a failed apply).
    atomic = True

    def __init__(self, model: Any, vllm_config: Any, adapter: dict, keys: list, where: str):
        self.adapter = adapter
        self.name, self.id = adapter["name"], adapter["id"]
        self.where = where
        # vLLM's LoRA model manager sets itself on the model it wraps.
        am = getattr(model, "lora_manager", None)
        if am is None or not hasattr(am, "_registered_adapters"):
            raise Error("unsupported", f"adapter {self.name!r}: {where} serves no LoRA adapters "
                        "(start vLLM with enable_lora=True, max_lora_rank >= the adapter's rank)")
        self.am, self.lora_config = am, am.lora_config
        self.LoRAModel, PEFTHelper, self._parse, self._is_embedding = _lora_api()
        model_config = getattr(vllm_config, "model_config", None)
        check_base(adapter, config_dict(getattr(model_config, "hf_config", None)), where)
        config = dict(adapter["config"])
        text = model_config.hf_config.get_text_config() if model_config is not None else None
        config["vllm_max_position_embeddings"] = getattr(text, "max_position_embeddings", None)
        try:
            self.peft_helper = PEFTHelper.from_dict(config)
            self.peft_helper.validate_legal(self.lora_config)
        except (ValueError, TypeError, KeyError) as e:
            raise Error("invalid_argument", f"adapter {self.name!r} does not fit {where}'s LoRA "
                        f"config (max_lora_rank {self.lora_config.max_lora_rank}): {e}") from None
        model = self.am.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        self.mapper = mapper.get_rename_mapper() if mapper is not None else None
        self.skip_prefixes = getattr(model, "lora_skip_prefixes", None)
        self._check_modules(keys)
        self._check_slot()
        self._tensors: dict = {}
        # The committed version's tensors as received (vLLM's LoRAModel
        # holds them scaled and packed): what puts the adapter back after
        # vLLM drops every adapter (its weight-transfer session's end does).
        held = _held(am)
        previous = held.get(self.id)
        self._committed: Optional[dict] = previous._committed if previous is not None else None
        held[self.id] = self

    def _expected_modules(self) -> set:
        out: set = set()
        for module in self.am.supported_lora_modules:
            out.update(self.am.packed_modules_mapping.get(module, [module]))
            if module == "experts":
                out.add(module)
        return out

    def _check_modules(self, keys: list) -> None:
        """vLLM's disk loader's unexpected-module check (from_lora_tensors
        skips it), on the adapter's keys."""
        expected = self._expected_modules()
        saved = set(self.peft_helper.modules_to_save or ())
        bad = []
        for key in keys:
            if self._is_embedding(key) or "base_layer" in key:
                continue
            if self.skip_prefixes and self.LoRAModel._should_skip_module(key, self.skip_prefixes):
                continue
            module, _ = self._parse(key, self.mapper)
            if ".experts" in module:
                if module[module.find(".experts") + 1:] not in expected:
                    bad.append(module)
            elif module.rsplit(".", 1)[-1] not in expected | saved:
                bad.append(module)
        if bad:
            raise Error("invalid_argument", f"adapter {self.name!r} targets modules {self.where} "
                        f"has no LoRA layers for: {', '.join(sorted(set(bad))[:6])} (it serves "
                        f"LoRA on {', '.join(sorted(expected))}; vLLM's enable_lora / "
                        "max_lora_rank / target modules)")

    def _check_slot(self) -> None:
        cache = self.am._registered_adapters
        pinned = set(getattr(cache, "pinned_items", ())) - {self.id}
        if len(pinned) >= self.am.capacity:
            raise Error("invalid_argument", f"adapter {self.name!r}: {self.where} has no slot "
                        f"for it: its CPU LoRA cache holds max_cpu_loras={self.am.capacity} "
                        f"adapters and adapters {sorted(pinned)} are pinned there (start vLLM "
                        "with a larger max_cpu_loras)")

    # UpdateProtocol -------------------------------------------------------------

    def begin(self) -> None:
        self._tensors = {}

    def load(self, batch: list) -> None:
        # Copies: vLLM folds the scaling into lora_B in place, and .to() of a
        # tensor already of vLLM's LoRA dtype returns that same tensor.
        for name, t in batch:
            self._tensors[name] = t.detach().clone()

    def abort(self) -> None:
        self._tensors = {}

    def build(self) -> Any:
        """Version k's LoRAModel, as vLLM's disk loader builds it."""
        am = self.am
        try:
            lora = self.LoRAModel.from_lora_tensors(
                lora_model_id=self.id, tensors=self._tensors, peft_helper=self.peft_helper,
                device="cpu", dtype=self.lora_config.lora_dtype, model_vocab_size=am.vocab_size,
                weights_mapper=self.mapper, skip_prefixes=self.skip_prefixes)
            am._validate_moe_lora_format(lora)
            am._validate_modules_to_save(lora)
            am._validate_token_classification_lora(lora)
        except (ValueError, RuntimeError, TypeError) as e:
            raise Error("invalid_argument", f"adapter {self.name!r}: vLLM refused it on "
                        f"{self.where}: {e}") from None
        return lora

    def finish(self) -> None:
        kept = {n: t.clone() for n, t in self._tensors.items()}
        lora = self.build()
        self._tensors = {}
        am = self.am
        old = am._registered_adapters.get(self.id)
        was_active = self.id in am._active_adapters
        try:
            am.remove_adapter(self.id)
            am.add_adapter(lora)
            am._pin_lora_in_cpu_cache(self.id)
            am.activate_adapter(self.id)
        except BaseException as e:
            self._put_back(old, was_active)
            raise Error("internal", f"adapter {self.name!r}: vLLM failed to apply the new version "
                        f"on {self.where} ({e}); the previous version is back") from e
        self._committed = kept

    def reinstall(self) -> None:
        """Puts the committed version back after vLLM dropped every adapter."""
        if self._committed is None or self.present():
            return
        self._tensors = {n: t.clone() for n, t in self._committed.items()}
        lora = self.build()
        self._tensors = {}
        self.am.add_adapter(lora)
        self.am._pin_lora_in_cpu_cache(self.id)

    def _put_back(self, old: Any, was_active: bool) -> None:
        am = self.am
        am.remove_adapter(self.id)
        if old is None:
            return
        am.add_adapter(old)  # already packed and scaled: adding it again changes nothing
        am._pin_lora_in_cpu_cache(self.id)
        if was_active:
            am.activate_adapter(self.id)

    def present(self) -> bool:
        """Whether the worker holds a version of this adapter."""
        return self.am.get_adapter(self.id) is not None


def _held(am: Any) -> dict:
    """{lora id: VllmLora} of the adapters weightsync keeps in the adapter
    manager `am`. vLLM drops every adapter when base weights change
    (`reset_lora_state`, at the end of each weight-transfer session) and
    would reload each from its request's path: weightsync's are put back
    from their committed versions instead (their weights do not depend on
    the base's)."""
    held: Optional[dict] = am.__dict__.get("_weightsync_held")
    if held is None:
        held = am.__dict__["_weightsync_held"] = {}
        remove_all = am.remove_all_adapters

        def remove_all_adapters(*args: Any, **kwargs: Any) -> Any:
            out = remove_all(*args, **kwargs)
            kept: VllmLora
            for kept in list((held or {}).values()):
                kept.reinstall()
            return out

        am.remove_all_adapters = remove_all_adapters
    return held


def connect_lora(model: Any, vllm_config: Any, coordinator: Any, engine: Any, replica: int,
                 rank: int, keep_previous: bool = False, **options: Any) -> tuple:
    """(adapter, EngineSync) for one vLLM worker's `model`: the adapter job
    of `engine` (an engine config with field "lora": weightsync.lora)."""
    adapter = adapter_of(engine)
    if adapter is None:
        raise Error("invalid_argument", "this engine config names no LoRA adapter (field 'lora': "
                    "made by weightsync.lora.engine_config); full models connect with "
                    "weightsync_connect / init_weight_transfer_engine")
    from ._api import engine_params

    keys = [p.name for p in engine_params(engine, replica, rank)]
    where = f"vLLM worker (replica {replica}, tensor-parallel rank {rank})"
    protocol = VllmLora(model, vllm_config, adapter, keys, where)
    options.pop("staging", None)
    # The protocol stands in for the model: EngineSync keys what it keeps of
    # the model's committed versions by it, and the base model's are not this
    # adapter's.
    sync = EngineSync(protocol, coordinator, engine, replica, rank, mode="direct",
                      protocol=protocol, keep_previous=keep_previous, **options)
    if not protocol.present():
        # Until its first step the adapter is what PEFT initializes (lora_B
        # zero: the base model's outputs), not a path vLLM would try to load
        # (a failed load there ends vLLM's engine).
        try:
            protocol.begin()
            protocol.load(list(sync._staged or []))  # zeros
            protocol.finish()
        except BaseException:
            sync.close()
            raise
    return adapter, sync


def lora_request(adapter: Any, path: Optional[str] = None) -> Any:
    """vLLM's LoRARequest naming a synced adapter (`adapter`: the adapter
    job's engine config, or its "lora" field). vLLM reads `path` only for
    an adapter it does not hold (none is read once weightsync committed a
    version: it stays pinned); default: a name that says so."""
    from vllm.lora.request import LoRARequest

    info = adapter if isinstance(adapter, dict) and "id" in adapter and "config" in adapter \
        else adapter_of(adapter)
    if info is None:
        raise Error("invalid_argument", "this engine config names no LoRA adapter (field 'lora')")
    return LoRARequest(info["name"], info["id"], path or f"weightsync-lora://{info['name']}")
