"""PyTorch helpers: trainer layouts from live (DTensor) parameters, engine
parameters allocated as torch tensors.

    import weightsync.torch as wst
    layout = wst.trainer_layout(model)          # on every trainer rank, after fully_shard
    pub = ws.Publisher(coordinator=addr, rank=dist.get_rank(), layout=layout, engine=E)
    pub.register_module(model)

A DTensor's device mesh and placements become LoadSpec shards (DESIGN.md):
`Shard(d)` cuts dim d; `_StridedShard(d, sf)` (FSDP2 over an expert- or
tensor-parallel mesh) is applied after the shards it defers to; `Replicate`
and mesh axes a param does not use replicate. The trainer mesh's axes are
ordered so that ranks are row-major, read from `mesh.mesh` (which is not always
row-major in `mesh_dim_names` order). Plain tensors are replicated.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Iterable, Mapping, Optional, Union

from . import _core
from ._errors import Error
from ._tensors import clean_name, dtype_name, is_dtensor, local_tensor, torch_dtype

__all__ = ["trainer_layout", "allocate_engine_params", "hf_keys_of"]

HfKeys = Union[None, Mapping[str, Any], Callable[[str, Any], Any]]


def hf_keys_of(name: str, shape, model_type: str = "") -> dict:
    """The HF keys of a param as transformers >= 5 holds it: its own name, or,
    for stacked experts (`*.experts.gate_up_proj` [E, 2I, H], `*.experts.
    down_proj` [E, H, I]), every expert's keys (Mixtral: block_sparse_moe.*.w1/
    w3/w2). Returns {"hf_keys", "fused_dim", "stack_dim"}."""
    keys, fused, stack = _core.transformers_param(model_type, name, [int(d) for d in shape])
    return {"hf_keys": list(keys), "fused_dim": fused, "stack_dim": stack}


def _keys_for(name: str, tensor: Any, hf_keys: HfKeys, model_type: str) -> dict:
    given = None
    if callable(hf_keys):
        given = hf_keys(name, tensor)
    elif hf_keys is not None:
        given = hf_keys.get(name)
    if given is None:
        return hf_keys_of(name, tensor.shape, model_type)
    if isinstance(given, str):
        return {"hf_keys": [given], "fused_dim": None, "stack_dim": None}
    if isinstance(given, Mapping):
        return {"hf_keys": list(given["hf_keys"]), "fused_dim": given.get("fused_dim"),
                "stack_dim": given.get("stack_dim")}
    keys = list(given)
    if len(keys) != 1:
        raise Error("invalid_argument", f"param '{name}': {len(keys)} hf_keys need a fused_dim: "
                    "give {'hf_keys': [...], 'fused_dim': d} for it")
    return {"hf_keys": keys, "fused_dim": None, "stack_dim": None}


class _MeshAxes:
    """The trainer mesh, assembled from every DTensor's device mesh: each axis
    is (size, stride in global ranks); the layout lists them by stride,
    largest first, so that global ranks are row-major."""

    def __init__(self, world: int):
        self.world = world
        self.by_name: dict[str, tuple[int, int]] = {}
        self.alias: dict[str, str] = {}  # a name -> the first name of its (size, stride)

    def add(self, name: str, size: int, stride: int, param: str) -> str:
        known = self.by_name.get(name)
        if known is not None and known != (size, stride):
            raise Error("invalid_layout", f"param '{param}': mesh axis '{name}' spans {size} ranks "
                        f"{stride} apart, but {known[0]} ranks {known[1]} apart in another param")
        for other, geom in self.by_name.items():
            if geom == (size, stride) and other != name:
                self.alias[name] = other
                return other
        self.by_name[name] = (size, stride)
        return name

    def mesh(self) -> dict:
        axes, shape, covered = [], [], 1
        for name, (size, stride) in sorted(self.by_name.items(), key=lambda kv: kv[1][1]):
            if stride % covered != 0 or stride < covered:
                raise Error("unsupported", f"mesh axis '{name}' ({size} ranks, stride {stride}) "
                            "overlaps the others: the ranks do not form one grid")
            if stride > covered:  # ranks between are a replicating axis no param names
                axes.append(f"replicate_{covered}")
                shape.append(stride // covered)
            axes.append(name)
            shape.append(size)
            covered = stride * size
        if self.world % covered != 0:
            raise Error("unsupported", f"the mesh axes cover {covered} ranks, which does not divide "
                        f"the world of {self.world}")
        if covered < self.world:
            axes.append(f"replicate_{covered}")
            shape.append(self.world // covered)
        return {"axes": axes[::-1], "shape": shape[::-1]}


def _mesh_axes(param: str, mesh: Any, axes: _MeshAxes) -> list[Optional[str]]:
    """The global axis of each dim of a DTensor's mesh (None: size 1)."""
    ranks = mesh.mesh.tolist()
    names = mesh.mesh_dim_names or tuple(f"mesh_dim{i}" for i in range(mesh.ndim))
    out: list[Optional[str]] = []
    for i in range(mesh.ndim):
        size = mesh.size(i)
        if size == 1:
            out.append(None)
            continue
        at = [0] * mesh.ndim
        first = _at(ranks, at)
        at[i] = 1
        stride = _at(ranks, at) - first
        if stride <= 0:
            raise Error("unsupported", f"param '{param}': mesh dim '{names[i]}' does not step "
                        f"through increasing ranks ({mesh.mesh.tolist()})")
        out.append(axes.add(names[i], size, stride, param))
    _check_affine(param, mesh, axes, out)
    return out


def _at(nested: Any, index: list[int]) -> int:
    for i in index:
        nested = nested[i]
    return int(nested)


def _check_affine(param: str, mesh: Any, axes: _MeshAxes, out: list) -> None:
    flat = mesh.mesh.reshape(-1).tolist()
    shape = [mesh.size(i) for i in range(mesh.ndim)]
    base = flat[0]
    for pos, rank in enumerate(flat):
        expect, rest = base, pos
        for i in reversed(range(mesh.ndim)):
            coord, rest = rest % shape[i], rest // shape[i]
            if out[i] is not None:
                expect += coord * axes.by_name[out[i]][1]
        if rank != expect:
            raise Error("unsupported", f"param '{param}': the ranks of mesh {mesh.mesh.tolist()} "
                        "are not a regular grid; weightsync cannot name them by axes")


def _shards(param: str, t: Any, axis_of: list) -> list[dict]:
    """LoadSpec shards from placements: per tensor dim, plain shards in mesh
    order, each strided one after the shards it defers to (its split factor
    is their product)."""
    per_dim: dict[int, list[tuple[Optional[str], int, int]]] = {}
    for i, p in enumerate(t.placements):
        kind = type(p).__name__
        if kind == "Replicate":
            continue
        if kind == "Partial" or not hasattr(p, "dim"):
            raise Error("unsupported", f"param '{param}': placement {p} (only Shard, "
                        "_StridedShard and Replicate describe where weights live)")
        sf = int(getattr(p, "split_factor", 1)) if kind == "_StridedShard" else 1
        dim = p.dim if p.dim >= 0 else p.dim + t.ndim
        per_dim.setdefault(dim, []).append((axis_of[i], t.device_mesh.size(i), sf))
    shards = []
    for dim in sorted(per_dim):
        for axis in _order(param, per_dim[dim]):
            if axis is not None:
                shards.append({"dim": dim, "axis": axis})
    return shards


def _order(param: str, entries: list) -> list:
    if not entries:
        return []
    (axis, _, sf), rest = entries[0], entries[1:]
    if sf == 1:
        return [axis] + _order(param, rest)
    prod = 1
    for k, (_, size, _) in enumerate(rest):
        prod *= size
        if prod == sf:
            return _order(param, rest[:k + 1]) + [axis] + _order(param, rest[k + 1:])
    raise Error("unsupported", f"param '{param}': a _StridedShard with split factor {sf} that no "
                "run of the following shards multiplies to")


def trainer_layout(named_params: Any, hf_keys: HfKeys = None, model_type: Optional[str] = None,
                   world_size: Optional[int] = None) -> dict:
    """The trainer layout (DESIGN.md's JSON, as a dict) of this rank's live
    parameters: `named_params` is a module (its parameters and persistent
    buffers) or (name, tensor) pairs (DTensor or plain). HF keys default to the params' own names, transformers >= 5's
    stacked experts to their per-expert keys (`model_type` is read from
    `module.config` when a module is given: Mixtral renames its MoE block);
    `hf_keys` overrides: a dict name -> key, [keys] or {"hf_keys", "fused_dim",
    "stack_dim"}, or a callable(name, tensor) returning one (None: default).
    Every rank computes the same layout. Checks each param's local shape
    against the layout."""
    if hasattr(named_params, "named_parameters"):
        if model_type is None:
            model_type = getattr(getattr(named_params, "config", None), "model_type", None)
        items = _module_tensors(named_params)
    else:
        items = list(named_params)
    rank, world = _rank_world(world_size)
    axes = _MeshAxes(world)
    params, checks = [], []
    for raw, t in items:
        name = clean_name(raw)
        spec = {"name": name, **_keys_for(name, t, hf_keys, model_type or "")}
        if spec["stack_dim"] is None:
            del spec["stack_dim"]
        spec["global_shape"] = [int(d) for d in t.shape]
        spec["dtype"] = dtype_name(t.dtype)
        if is_dtensor(t):
            axis_of = _mesh_axes(name, t.device_mesh, axes)
            spec["shards"] = _shards(name, t, axis_of)
            checks.append((name, [int(d) for d in t.to_local().shape]))
        else:
            spec["shards"] = []
        params.append(spec)
    for spec in params:  # names given by two meshes to one axis
        for s in spec["shards"]:
            s["axis"] = axes.alias.get(s["axis"], s["axis"])
    layout = {"mesh": axes.mesh(), "params": params}
    text = _core.check_trainer_layout(json.dumps(layout))
    for name, local in checks:
        expect = list(_core.local_shape(text, name, rank))
        if expect != local:
            raise Error("unsupported", f"param '{name}': its placements give rank {rank} a local "
                        f"shard of {local}, but the layout computes {expect}")
    return json.loads(text)


def _module_tensors(module: Any) -> list:
    """A module's parameters and its persistent buffers (those its state dict
    holds, such as DeepSeek's e_score_correction_bias: checkpoints store them)."""
    items = list(module.named_parameters())
    persistent = set(module.state_dict().keys())
    items += [(n, b) for n, b in module.named_buffers() if n in persistent]
    return items


def _rank_world(world_size: Optional[int]) -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), world_size or dist.get_world_size()
    return 0, world_size or 1


def allocate_engine_params(engine: Any, replica: int = 0, rank: int = 0,
                           device: Any = "cpu") -> dict:
    """{name: zeroed torch tensor} of every parameter engine rank `rank` of
    `replica` holds, in the engine layout's dtypes and shapes."""
    import torch

    from ._api import engine_params

    return {name: torch.zeros(shape, dtype=torch_dtype(dtype), device=device)
            for name, dtype, shape in engine_params(engine, replica, rank)}
