"""vLLM's own update protocol, run by weightsync inside one vLLM worker
(imports vLLM; only weightsync.vllm's worker-side code imports this module).

vLLM (0.32) updates weights with its layerwise reload: the model's layers are
put back in their loading form (on the meta device), `model.load_weights`
fills them, and each layer is processed (CPU GEMM packing, MoE prepacking,
quantization) as soon as it has all its weights, then copied into the tensors
the kernels read (`initialize_layerwise_reload` -> `load_weights` ->
`finalize_layerwise_reload`, vllm/model_executor/model_loader/reload/).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterable, Optional

import torch

from ._engine import EngineSync, UpdateProtocol, engine_framework
from ._errors import Error

logger = logging.getLogger("weightsync.vllm")

_warned_fallback = False
_MISSING = object()


def _vllm_version() -> str:
    try:
        import vllm

        return getattr(vllm, "__version__", "?")
    except ImportError:  # pragma: no cover - this module runs inside vLLM
        return "?"


def _reload_api():
    try:
        from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                             initialize_layerwise_reload)
    except ImportError as e:
        raise Error("unsupported", f"vLLM {_vllm_version()} has no layerwise reload "
                    "(vllm.model_executor.model_loader.reload, vLLM >= 0.32): weightsync "
                    f"cannot update its weights through its own protocol ({e})") from None
    return initialize_layerwise_reload, finalize_layerwise_reload


def _moe_layers_needing_experts_processing(model: Any) -> list:
    """The quant methods of MoE layers whose experts repack weights after
    loading (vLLM's CPU experts: pad the intermediate, prepack) and that vLLM
    0.32's reload skips: UnquantizedFusedMoEMethod._setup_kernel runs
    `moe_kernel.fused_experts.process_weights_after_loading(layer)` on the
    first load only, so a reload leaves the experts in loading form (tp=1:
    wrong values; tp>1 with padding: a shape mismatch)."""
    out = []
    for module in model.modules():
        qm = getattr(module, "quant_method", None)
        kernel = getattr(qm, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or type(qm).__name__ != "UnquantizedFusedMoEMethod":
            continue
        # The base class's (FusedMoEExperts*) is a no-op: only an override
        # repacks.
        owner = next(k for k in type(experts).__mro__
                     if "process_weights_after_loading" in vars(k))
        if not owner.__module__.endswith("modular_kernel"):
            out.append(qm)
    return out


class VllmReload(UpdateProtocol):
    """vLLM's layerwise reload, driven by weightsync's steps.

    load_kind "hf": load(batch) hands HF tensors to the model's own
    `load_weights` (vLLM's loaders fuse and slice them for this rank).
    load_kind "engine": load(batch) takes tensors under vLLM's parameter names
    in their loading form (what the engine config's "vllm" layout describes:
    fused, this rank's slice), copied as they are into the layers' loading
    tensors; vLLM then processes each layer as for any reload.
    """

    def __init__(self, model: Any, model_config: Any, vllm_config: Any = None,
                 load_kind: str = "hf", aliases: Optional[dict] = None):
        self.model = model
        self.aliases = aliases or {}
        self.model_config = model_config
        self.vllm_config = vllm_config
        self.load_kind = load_kind
        self._init, self._finalize = _reload_api()
        self._patched: list = []
        self._saved_loaders: list = []
        self._poisoned = False

    @contextlib.contextmanager
    def _context(self):
        """What vLLM's worker sets around its own updates: the current vLLM
        config (the hooks run on weightsync's threads) and no autograd."""
        ctx = contextlib.nullcontext()
        if self.vllm_config is not None:
            from vllm.config import set_current_vllm_config

            ctx = set_current_vllm_config(self.vllm_config)
        with ctx, torch.no_grad():
            yield

    def _patch_moe(self) -> None:
        for qm in _moe_layers_needing_experts_processing(self.model):
            original = qm.process_weights_after_loading

            def process(layer, original=original, qm=qm):
                original(layer)
                qm.moe_kernel.fused_experts.process_weights_after_loading(layer)

            qm.process_weights_after_loading = process
            self._patched.append(qm)

    def _unpatch(self) -> None:
        for qm in self._patched:
            qm.__dict__.pop("process_weights_after_loading", None)
        self._patched = []
        # The loading tensors persist across reloads (vLLM keeps them in
        # LAYERWISE_INFO): their own loaders go back (a property on vLLM's
        # parameter classes, a plain attribute on others).
        for param, loader in reversed(self._saved_loaders):
            if loader is _MISSING:
                try:
                    del param.weight_loader
                except AttributeError:
                    pass
            else:
                param.weight_loader = loader
        self._saved_loaders = []

    def begin(self) -> None:
        with self._context():
            self._patch_moe()
            try:
                self._init(self.model)
            except BaseException:
                self.abort()
                raise

    def load(self, batch: list) -> None:
        with self._context():
            if self.load_kind == "hf":
                self.model.load_weights(batch)
            else:
                self._load_engine_tensors(batch)

    def _load_engine_tensors(self, batch: list) -> None:
        """Tensors under vLLM's names in loading form: each layer's (meta)
        loading tensor gets a plain copy loader, wrapped by vLLM's own
        layerwise loader so that the layer is processed once complete."""
        try:
            from vllm.model_executor.model_loader.reload.layerwise import (
                make_online_process_loader)
            from vllm.model_executor.model_loader.weight_utils import default_weight_loader
        except ImportError as e:
            raise Error("unsupported", f"vLLM {_vllm_version()}: no layerwise loader to apply "
                        f"tensors of the engine's layout ({e}); use mode 'load_weights' with an "
                        "engine group of framework 'hf'") from None
        targets = []
        for layout_name, tensor in batch:
            name = self.aliases.get(layout_name, layout_name)
            module_name, _, param_name = name.rpartition(".")
            layer = self.model.get_submodule(module_name)
            param = getattr(layer, param_name, None)
            if not isinstance(param, torch.Tensor):
                raise Error("not_found", f"vLLM has no parameter {name!r} to reload")
            if tuple(param.shape) != tuple(tensor.shape) or param.dtype != tensor.dtype:
                raise Error("mismatch", f"vLLM loads {name!r} as {param.dtype} "
                            f"{list(param.shape)}, the engine layout has {tensor.dtype} "
                            f"{list(tensor.shape)}")
            targets.append((layer, param_name, param, tensor))
        # Every tensor of a layer must have the copy loader before the layer
        # completes (vLLM then calls each buffered tensor's own loader).
        for layer, param_name, param, _ in targets:
            try:
                saved = param.weight_loader
            except AttributeError:
                saved = _MISSING
            self._saved_loaders.append((param, saved))
            param.weight_loader = default_weight_loader
            param.weight_loader = make_online_process_loader(layer, param_name)
        for _, _, param, tensor in targets:
            param.weight_loader(param, tensor)

    def finish(self) -> None:
        try:
            with self._context():
                self._finalize(self.model, self.model_config)
        finally:
            self._unpatch()

    def abort(self) -> None:
        # Puts every layer back on its kernel tensors (layers that took part of
        # the step are processed with what they had: EngineSync restores a
        # whole version next).
        try:
            with self._context():
                self._finalize(self.model, self.model_config)
        finally:
            self._unpatch()

    def initial_weights(self) -> Optional[Iterable]:
        """The checkpoint the engine loaded at start (vLLM's own loader, as its
        reload_weights reads it)."""
        if self.vllm_config is None:
            return None
        from vllm.model_executor.model_loader import get_model_loader

        loader = get_model_loader(self.vllm_config.load_config)
        if not hasattr(loader, "get_all_weights"):
            return None
        return loader.get_all_weights(self.model_config, self.model)

    def poison(self, reason: str) -> None:
        """vLLM's forward raises from now on (the engine stops with this
        error rather than serve mixed weights)."""

        def refuse(*args: Any, **kwargs: Any):
            raise Error("cancelled", reason)

        self.model.forward = refuse
        self._poisoned = True
        logger.error(reason)

    def unpoison(self) -> None:
        if self._poisoned:
            self.model.__dict__.pop("forward", None)
            self._poisoned = False


def inplace_blockers(model: Any) -> list:
    """Why writing this model's parameters in place would not update what
    its kernels read ([] when it would): parameters that differ from their
    loading form, packed copies held by CPU GEMM dispatch, and weight
    processing weightsync cannot vouch for (quantized methods, MoE kernels
    other than Triton's)."""
    reasons: list = []
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:
        LAYERWISE_INFO = {}
    for name, module in model.named_modules():
        info = LAYERWISE_INFO.get(module) if hasattr(LAYERWISE_INFO, "get") else None
        if info is not None:
            loading = info.restore_metadata[0]
            for pname, meta in loading.items():
                cur = module._parameters.get(pname)
                full = f"{name}.{pname}" if name else pname
                if cur is None:
                    reasons.append(f"{full} is gone after loading")
                elif tuple(cur.shape) != tuple(meta.shape) or cur.dtype != meta.dtype:
                    reasons.append(f"{full} is {cur.dtype} {list(cur.shape)} after loading, "
                                   f"{meta.dtype} {list(meta.shape)} when loaded")
        cpu_linear = module.__dict__.get("cpu_linear")
        if cpu_linear is not None and cpu_linear is not torch.nn.functional.linear:
            code = getattr(cpu_linear, "__code__", None)
            held = list(code.co_freevars) if code is not None else ["?"]
            if held or getattr(cpu_linear, "__defaults__", None):
                reasons.append(f"{name}: CPU GEMM dispatch reads a packed copy "
                               f"({', '.join(held)})")
        qm = getattr(module, "quant_method", None)
        if qm is None:
            continue
        kind = type(qm).__name__
        if kind in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"):
            continue
        if kind == "UnquantizedFusedMoEMethod":
            backend = getattr(getattr(qm, "unquantized_backend", None), "name", None)
            if backend == "TRITON" and not _moe_layers_needing_experts_processing(module):
                continue
            reasons.append(f"{name}: MoE backend {backend} repacks the expert weights")
            continue
        reasons.append(f"{name}: {kind} processes weights after loading")
    return reasons


def table_aliases(model: Any, names: Iterable[str]) -> dict:
    """{layout name: vLLM's name} for the names of weightsync's "vllm" table
    that this vLLM holds elsewhere: vLLM >= 0.32 nests FusedMoE's fused
    experts in a RoutedExperts submodule (`mlp.experts.routed_experts.
    w13_weight`), where the table (and older vLLMs) say `mlp.experts.
    w13_weight`."""
    have = {n for n, _ in model.named_parameters()}
    out = {}
    for name in names:
        if name in have:
            continue
        module, _, pname = name.rpartition(".")
        nested = f"{module}.routed_experts.{pname}"
        if module.endswith(".experts") and nested in have:
            out[name] = nested
    return out


def _single_group(engine: Any) -> dict:
    import json

    from ._api import load_json

    config = json.loads(load_json(engine, "engine config")[0])
    if not isinstance(config, dict):
        raise Error("unsupported", "engine framework 'derived': one engine group per config "
                    "(the replicas of a group derive the same layout)")
    return config


def _gather_tp(obj: Any) -> list:
    """obj of every rank of this worker's tensor-parallel group, in rank order."""
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return [obj]
    import torch.distributed as dist

    out: list = [None] * group.world_size
    dist.all_gather_object(out, obj, group=group.cpu_group)
    return out


def _agree_tp(ok: bool) -> bool:
    """Whether every rank of this worker's tensor-parallel group is ok."""
    return all(_gather_tp(bool(ok)))


def connect(model: Any, model_config: Any, vllm_config: Any, coordinator: Any, engine: Any,
            replica: int, rank: int, mode: Optional[str] = None, keep_previous: bool = True,
            **options: Any) -> EngineSync:
    """An EngineSync for one vLLM worker's model.

    mode None: "load_weights" for an engine group of framework "hf", else
    "direct". Framework "derived": the layout is derived here from vLLM's
    own loader (derive_engine_config), identical on every rank of the
    replica; the trainers take it from the job (Publisher without `engine`).
    mode "load_weights": HF tensors through vLLM's layerwise reload.
    mode "direct": in place when vLLM's parameters are what its kernels read;
    otherwise (vLLM's CPU backend, quantized or repacked MoE kernels) the
    data of the engine's layout lands in private tensors and goes through
    the layerwise reload once committed, with a warning (once per process).
    `staged=True` (options; not for in-place direct mode): each step is
    received on a background thread while vLLM serves, and the update call
    only applies it (EngineSync, weightsync._staged).
    """
    global _warned_fallback
    framework = engine_framework(engine, replica)
    if framework == "derived":
        engine = derive_engine_config(model, vllm_config, _single_group(engine), rank, _gather_tp)
    if mode is None:
        mode = "load_weights" if framework == "hf" else "direct"
    if options.get("staged"):
        # The step is committed before it is applied: the ranks of the
        # replica agree on the apply (each update_weights gathers them).
        options.setdefault("agree", _agree_tp)
    if mode == "load_weights":
        from ._parity import check_load_weights

        quant = getattr(vllm_config, "quant_config", None)
        check_load_weights(engine, replica, rank,
                           bool(getattr(quant, "is_checkpoint_fp8_serialized", False)))
        protocol = VllmReload(model, model_config, vllm_config, load_kind="hf")
        return EngineSync(model, coordinator, engine, replica, rank, mode=mode, protocol=protocol,
                          keep_previous=keep_previous, **options)
    if mode != "direct":
        raise Error("invalid_argument", f"mode {mode!r}: expected 'direct' or 'load_weights'")
    aliases = {}
    if framework == "vllm":
        from ._api import engine_params

        aliases = table_aliases(model, [p.name for p in engine_params(engine, replica, rank)])
    # The parity check (EngineSync) compares the layout with the params as
    # vLLM's loader creates them (before any repacking).
    from ._parity import dtype_name

    held = {f"{m}.{p}" if m else p: (dtype_name(t), list(t.shape))
            for m, _, templates in _loading_tensors(model) for p, t in templates.items()}
    options["held"] = held
    blockers = inplace_blockers(model)
    if not blockers:
        # In place; staging keeps a failed step from showing (the copy is
        # published at commit). Receiving while vLLM serves would publish
        # the copy under a forward pass: no staged mode here.
        options.pop("agree", None)
        if options.pop("staged", False):
            logger.info("weightsync: staged=True: vLLM's parameters are written in place "
                        "(staging published at commit); steps are received in the update call")
        options.setdefault("staging", True)
        return EngineSync(model, coordinator, engine, replica, rank, mode=mode, aliases=aliases,
                          **options)
    if not _warned_fallback:
        _warned_fallback = True
        more = f" (and {len(blockers) - 1} more)" if len(blockers) > 1 else ""
        msg = (f"weightsync: direct mode: vLLM {_vllm_version()}'s parameters are not what its "
               f"kernels read ({blockers[0]}{more}); falling back to vLLM's layerwise reload: "
               "each committed step is received into private tensors and then reloaded "
               "through the engine")
        logger.warning(msg)
    protocol = VllmReload(model, model_config, vllm_config, load_kind="engine", aliases=aliases)
    options.pop("staging", None)  # the private tensors are the staging copy
    # aliases: the parity check compares the layout's names with vLLM's.
    sync = EngineSync(model, coordinator, engine, replica, rank, mode=mode, protocol=protocol,
                      keep_previous=keep_previous, aliases=aliases, **options)
    sync.fallback_reason = blockers[0]
    return sync


def _loading_tensors(model: Any) -> list:
    """[(module name, module, {param name: template})] of every module with
    parameters: the template is the parameter in its loading form (vLLM's
    recorded metadata, on the meta device, where vLLM repacks after
    loading), else the live parameter."""
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:
        LAYERWISE_INFO = {}
    out = []
    for mname, module in model.named_modules():
        info = LAYERWISE_INFO.get(module) if hasattr(LAYERWISE_INFO, "get") else None
        templates = dict(info.restore_metadata[0]) if info is not None else {}
        for pname, live in module._parameters.items():
            if live is not None and pname not in templates:
                templates[pname] = live
        if templates:
            out.append((mname, module, templates))
    return out


def derive_engine_config(model: Any, vllm_config: Any, base: dict, rank: int,
                         gather: Any) -> dict:
    """Engine framework "derived" (weightsync._derive): this worker traces
    vLLM's own `load_weights` on probe tensors, layer by layer, over its
    parameters in loading form; `gather(obj)` returns every TP rank's obj
    (rank order). Returns the engine config every rank of the replica then
    uses (identical on each). The model's tensors are put back as they were;
    nothing the kernels read is touched."""
    from . import _derive

    try:
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
    except ImportError:
        def restore_layer_refs(tensor, layer):
            return tensor

    model_dir = vllm_config.model_config.model
    keys, shapes, dtypes = _derive.checkpoint_tensors(model_dir)
    groups = [_derive.layer_group(k) for k in keys]
    modules = _loading_tensors(model)
    saved = [(module, dict(module._parameters)) for _, module, _ in modules]

    def put_back() -> None:
        for module, params in saved:
            for pname in list(module._parameters):
                if pname not in params:
                    del module._parameters[pname]
            module._parameters.update(params)

    def install(group: Optional[int]) -> dict:
        put_back()
        stand_ins = {}
        for mname, module, templates in modules:
            for pname, tmpl in templates.items():
                full = f"{mname}.{pname}" if mname else pname
                if _derive.layer_group(full) == group:
                    t = _derive.target(tmpl.shape)
                    stand_ins[full] = t
                else:  # writes into other groups' parameters go nowhere
                    t = torch.empty(tuple(tmpl.shape), dtype=torch.float64, device="meta")
                if type(tmpl) is not torch.Tensor:
                    t.__class__ = tmpl.__class__
                t.__dict__ = tmpl.__dict__.copy()
                # After a reload, vLLM's loading tensors keep its layerwise
                # wrapper (it buffers and then writes the kernel tensors): the
                # trace calls the loader underneath.
                for key in ("weight_loader", "_weight_loader"):
                    loader = t.__dict__.get(key)
                    while getattr(loader, "__name__", "") == "online_process_loader":
                        loader = getattr(loader, "__wrapped__")
                    if loader is not None:
                        t.__dict__[key] = loader
                restore_layer_refs(t, module)
                module._parameters[pname] = t
        return stand_ins

    with VllmReload(model, vllm_config.model_config, vllm_config)._context():
        found = _derive.trace(keys, shapes, groups, model.load_weights, install, put_back)
    params = []
    for mname, _, templates in modules:
        for pname, tmpl in templates.items():
            full = f"{mname}.{pname}" if mname else pname
            params.append((full, _derive.dtype_name(tmpl.dtype), list(tmpl.shape)))
    mine = _derive.rank_layout(rank, params, found, keys)
    ranks = gather(mine)
    import json
    import os

    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        hf_config = json.load(f)
    return _derive.engine_config(base, ranks, keys, shapes, dtypes, hf_config)
