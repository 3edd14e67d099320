"""Engine layouts derived from the engine's own loader (engine framework
"derived", docs/engines.md): the engine is the ground truth for how its
parameters are made of Hugging Face tensors.

The engine's `load_weights` runs on probe tensors whose values encode where
they come from: element i of HF tensor number t holds (t + 1) * 2**32 + i, in
float64 (exact up to 2**53), and each parameter the loader writes is, for the
trace, a float64 tensor of its loading shape filled with -1. Whatever the
loader does (fuse q/k/v, stack gate and up, slice this rank's part, stack
experts, pad the vocab), each parameter element then names the HF tensor and
element it came from, or -1 for padding. Those maps are compressed into the
segments of weightsync's engine layouts (row blocks of an HF tensor landing
in row blocks of a parameter). A loader that transforms values (scales them,
adds one, transposes, casts) shows as values that decode to nothing, or as a
pattern of single elements, and is refused with the parameter's name.

This module knows no engine: the engine integrations (weightsync.vllm) swap
their parameters for the probes' targets and call `trace`.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Optional

import numpy as np
import torch

from ._errors import Error

_SHIFT = 32
_UNSET = -1.0
_MAX_TENSORS = (1 << 20) - 1  # (t + 1) << 32 stays below 2**53
_MAX_NUMEL = 1 << _SHIFT

_LAYER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_group(name: str) -> Optional[int]:
    """The first number in a dotted name (a decoder layer's index, in HF and
    in every engine's names), or None (embeddings, final norm, lm_head)."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def probe(tensor_id: int, shape: Iterable[int]) -> torch.Tensor:
    """The probe of HF tensor number `tensor_id` (float64, `shape`)."""
    shape = tuple(int(d) for d in shape)
    n = int(np.prod(shape)) if shape else 1
    if tensor_id > _MAX_TENSORS or n > _MAX_NUMEL:
        raise Error("unsupported", f"layout derivation: tensor {tensor_id} of {n} elements is "
                    f"past what a float64 probe encodes ({_MAX_TENSORS} tensors of "
                    f"{_MAX_NUMEL} elements)")
    base = float((tensor_id + 1) << _SHIFT)
    return (torch.arange(n, dtype=torch.float64) + base).reshape(shape)


def target(shape: Iterable[int]) -> torch.Tensor:
    """A parameter's stand-in during the trace: float64, -1 everywhere."""
    return torch.full(tuple(int(d) for d in shape), _UNSET, dtype=torch.float64)


def _unravel(index: np.ndarray, dims: list) -> list:
    """Row-major coordinates of flat `index` (arrays) over `dims`."""
    out = []
    for d in reversed(dims):
        out.append(index % d)
        index = index // d
    return list(reversed(out))


def segments(name: str, values: torch.Tensor, shapes: list) -> list:
    """The segments of one traced parameter: `values` is what the loader left
    in its stand-in, `shapes[t]` the shape of HF tensor t. Returns
    [(t, hf_box, param_box)] with boxes as (offsets, lengths); [] when the
    loader wrote nothing there."""
    pshape = list(values.shape) or [1]
    cols = pshape[-1]
    if cols == 0:
        return []
    flat = values.reshape(-1, cols)
    valid = flat != _UNSET
    if not bool(valid.any()):
        return []
    v = torch.where(valid, flat, torch.zeros((), dtype=flat.dtype))
    bad = valid & ((v != v.round()) | (v < float(1 << _SHIFT)))
    if bool(bad.any()):
        at = [int(i) for i in bad.nonzero()[0]]
        raise Error("unsupported", f"layout derivation: the engine's loader transforms the "
                    f"values of {name!r} (element {at} holds {float(flat[at[0], at[1]])!r}, not "
                    "a copied probe value): its layout cannot be derived (use framework 'hf')")
    iv = v.to(torch.int64)
    tid = (iv >> _SHIFT) - 1
    idx = iv & ((1 << _SHIFT) - 1)
    if bool((valid & (tid >= len(shapes))).any()):
        raise Error("internal", f"layout derivation: {name!r} holds a value of no probe")
    hcols = torch.tensor([int(s[-1]) if len(s) else 1 for s in shapes], dtype=torch.int64)
    cper = hcols[tid.clamp(min=0)]
    hcol = idx % cper
    # Horizontal runs: consecutive elements of one HF row.
    cont = (valid[:, 1:] & valid[:, :-1] & (tid[:, 1:] == tid[:, :-1])
            & (idx[:, 1:] == idx[:, :-1] + 1) & (hcol[:, 1:] != 0))
    start = valid.clone()
    start[:, 1:] &= ~cont
    end = valid.clone()
    end[:, :-1] &= ~cont
    rs, cs = (a.numpy() for a in start.nonzero(as_tuple=True))
    _, ce = (a.numpy() for a in end.nonzero(as_tuple=True))
    rows = flat.shape[0]
    if len(rs) > 4 * rows + 64:
        raise Error("unsupported", f"layout derivation: the engine's loader writes {name!r} "
                    f"({list(values.shape)}) in {len(rs)} pieces, not in row blocks of HF "
                    "tensors (a transpose?): its layout cannot be derived (use framework 'hf')")
    length = ce - cs + 1
    t = tid.numpy()[rs, cs]
    first = idx.numpy()[rs, cs]
    hc = hcols.numpy()[t]
    hrow = first // hc
    h0 = first % hc
    # Vertical merges: the next param row (inside one block of the
    # second-to-last dim) takes the next HF row, same columns.
    prow_block = pshape[-2] if len(pshape) >= 2 else 1
    hrows_of = np.array([int(s[-2]) if len(s) >= 2 else 1 for s in shapes], dtype=np.int64)
    hblock = hrows_of[t]
    plead, pin = rs // prow_block, rs % prow_block
    hlead, hin = hrow // hblock, hrow % hblock
    order = np.lexsort((rs, hlead, plead, h0, length, cs, t))
    keys = np.stack([t, cs, length, h0, plead, hlead], axis=1)[order]
    same = np.all(keys[1:] == keys[:-1], axis=1)
    step = (np.diff(pin[order]) == 1) & (np.diff(hin[order]) == 1)
    new = np.concatenate([[True], ~(same & step)])
    group = np.cumsum(new) - 1
    starts = np.flatnonzero(new)
    counts = np.bincount(group)
    out = []
    for g, s0 in enumerate(starts):
        k = order[s0]
        n = int(counts[g])
        ti = int(t[k])
        hshape = [int(d) for d in shapes[ti]] or [1]
        width = int(length[k])
        if len(pshape) == 1:
            p_off, p_len = [int(cs[k])], [width]
        else:
            p_off = [int(c) for c in _unravel(np.array(rs[k]), pshape[:-1])] + [int(cs[k])]
            p_len = [1] * (len(pshape) - 2) + [n, width]
        if len(hshape) == 1:
            h_off, h_len = [int(h0[k])], [width]
        else:
            h_off = [int(c) for c in _unravel(np.array(hrow[k]), hshape[:-1])] + [int(h0[k])]
            h_len = [1] * (len(hshape) - 2) + [n, width]
        if len(hshape) > len(pshape) or (len(hshape) == 1 and n != 1):
            raise Error("unsupported", f"layout derivation: {name!r} {pshape} takes a block of "
                        f"HF tensor {ti} {hshape} that weightsync's segments cannot express")
        out.append((ti, (h_off, h_len), (p_off, p_len)))
    return out


def trace(keys: list, shapes: list, groups: list, load: Callable[[list], None],
          install: Callable[[Optional[int]], dict], release: Callable[[], None]) -> dict:
    """Runs the loader on every HF tensor's probe, one layer group at a time
    (memory: the probes and stand-ins of one layer), and returns
    {param name: [segments]} for every parameter the loader wrote.

    keys/shapes: the HF tensors (index = tensor id). groups: each tensor's
    layer_group. load(batch): the engine's load_weights on [(key, probe)].
    install(group): puts float64 stand-ins (target()) in place of the
    parameters of that layer group (and sinks for every other parameter) and
    returns {param name: stand-in}, read back after load; release() puts the
    engine's own tensors back (also when anything fails).
    """
    found: dict = {}
    order: dict = {}
    for i, g in enumerate(groups):
        order.setdefault(g, []).append(i)
    try:
        for g, ids in order.items():
            stand_ins = install(g)
            load([(keys[i], probe(i, shapes[i])) for i in ids])
            for name, values in stand_ins.items():
                segs = segments(name, values, shapes)
                if segs:
                    if name in found:
                        raise Error("unsupported", f"layout derivation: {name!r} takes HF "
                                    "tensors of two layer groups")
                    found[name] = segs
    finally:
        release()
    return found


def rank_layout(rank: int, params: list, found: dict, keys: list) -> dict:
    """One rank's layout as the engine config's "derived" field holds it:
    `params` [(name, dtype name, shape)] in the engine's order, `found` from
    trace. Parameters the loader never wrote are left out (tied or derived
    tensors: the engine makes them itself)."""
    out = []
    for name, dtype, shape in params:
        segs = found.get(name)
        if not segs:
            continue
        out.append({"name": name, "dtype": dtype, "shape": [int(d) for d in shape],
                    "segments": [{"hf_key": keys[t], "hf_box": {"offsets": h[0], "lengths": h[1]},
                                  "param_box": {"offsets": p[0], "lengths": p[1]},
                                  "transpose": False} for t, h, p in segs]})
    return {"rank": rank, "params": out}


def engine_config(base: dict, ranks: list, keys: list, shapes: list, dtypes: list,
                  hf_config: dict) -> dict:
    """The engine config of framework "derived" from the user's (`base`: tp,
    replicas, dtype...) and every rank's layout (rank order)."""
    used = sorted({s["hf_key"] for r in ranks for p in r["params"] for s in p["segments"]})
    index = {k: i for i, k in enumerate(keys)}
    config = {k: v for k, v in base.items() if k not in ("hf_config", "derived")}
    config.update(framework="derived", hf_config=hf_config, tp=len(ranks))
    config.setdefault("dtype", dtypes[index[used[0]]] if used else "BF16")
    config["derived"] = {
        "tensors": [{"key": k, "shape": [int(d) for d in shapes[index[k]]],
                     "dtype": dtypes[index[k]]} for k in used],
        "ranks": ranks}
    return config


_TORCH_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
                 torch.float64: "F64", torch.int64: "I64", torch.int32: "I32",
                 torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        _TORCH_DTYPES[getattr(torch, _name)] = "F8_E4M3" if "e4m3" in _name else "F8_E5M2"


def dtype_name(dtype: torch.dtype) -> str:
    """weightsync's (safetensors') name of a torch dtype."""
    try:
        return _TORCH_DTYPES[dtype]
    except KeyError:
        raise Error("unsupported", f"layout derivation: dtype {dtype}") from None


def checkpoint_tensors(model_dir: str) -> tuple:
    """(keys, shapes, dtype names) of the .safetensors files in `model_dir`
    (headers only), sorted by key."""
    import glob
    import os

    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise Error("not_found", f"layout derivation: no .safetensors files in {model_dir!r} "
                    "(the engine's checkpoint names the HF tensors to trace)")
    info: dict = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                info[key] = (list(sl.get_shape()), str(sl.get_dtype()))
    keys = sorted(info)
    return keys, [info[k][0] for k in keys], [info[k][1] for k in keys]
