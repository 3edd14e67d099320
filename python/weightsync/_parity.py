"""The parity check at connect (docs/fp8.md "Parity at connect"): weightsync's
layout for an engine rank against the parameters the live engine holds, before
a byte moves. Every param of the layout must be in the engine under its name
(or its alias) with the same dtype and shape; every FP8 scale param the engine
holds beside a weight of the layout must be in the layout. Any difference is
refused with a table of the params that differ. torch is never imported: a
tensor's dtype is read from its repr."""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Optional

from . import _core
from ._common import EngineLike, load_json
from ._errors import MismatchError

#: torch dtype (str(t.dtype) without "torch.") -> safetensors name.
_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64",
           "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "int8": "I8", "uint8": "U8",
           "int16": "I16", "int32": "I32", "int64": "I64", "bool": "BOOL",
           "float8_e8m0fnu": "F8_E8M0"}

#: The names engines give a weight's FP8 scale (vLLM, SGLang: block scales
#: "weight_scale_inv"; per-tensor and MXFP8 "weight_scale").
_SCALE_SUFFIXES = ("_scale_inv", "_scale")


def dtype_name(tensor: Any) -> str:
    """A torch tensor's dtype as safetensors names it ("BF16", "F8_E4M3")."""
    name = str(tensor.dtype).removeprefix("torch.")
    return _DTYPES.get(name, name)


def _scale_of(name: str) -> Optional[str]:
    for suffix in _SCALE_SUFFIXES:
        if name.endswith("weight" + suffix):
            return name[: -len(suffix)]
    return None


def differences(layout: Iterable[tuple[str, str, list]],
                engine: Mapping[str, tuple[str, list]],
                aliases: Optional[Mapping[str, str]] = None) -> list[tuple[str, str, str, str]]:
    """Rows (param, weightsync, engine, what differs) where `layout`
    [(name, dtype, shape)] and `engine` {name: (dtype, shape)} disagree;
    `aliases` {layout name: engine name}."""
    aliases = aliases or {}
    rows = []
    names = set()
    for name, dtype, shape in layout:
        names.add(name)
        theirs = engine.get(aliases.get(name, name))
        ours = f"{dtype} {list(shape)}"
        if theirs is None:
            rows.append((name, ours, "-", "not in the engine"))
            continue
        what = [w for w, differs in (("dtype", dtype != theirs[0]),
                                     ("shape", list(shape) != list(theirs[1]))) if differs]
        if what:
            rows.append((name, ours, f"{theirs[0]} {list(theirs[1])}", " and ".join(what)))
    layout_of = {aliases.get(n, n): n for n in names}
    for name, (dtype, shape) in engine.items():
        weight = _scale_of(name)
        if name in layout_of or weight is None or weight not in layout_of:
            continue
        rows.append((layout_of[weight] + name[len(weight):], "-", f"{dtype} {list(shape)}",
                     "an FP8 scale the layout lacks"))
    return rows


def table(rows: list[tuple[str, str, str, str]]) -> str:
    """The rows as an aligned text table with a header."""
    head = ("param", "weightsync", "engine", "differs")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    return "\n".join("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
                     for r in [head, *rows])


def engine_holds(model: Any) -> dict[str, tuple[str, list]]:
    """{name: (dtype, shape)} of a torch module's parameters and buffers."""
    out: dict[str, tuple[str, list]] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        out.setdefault(name, (dtype_name(t), list(t.shape)))
    return out


def check(engine: EngineLike, replica: int, rank: int, held: Mapping[str, tuple[str, list]],
          aliases: Optional[Mapping[str, str]] = None, what: str = "engine") -> str:
    """Refuses (MismatchError with the table) when engine rank `rank` of
    `replica`'s layout and `held` {name: (dtype, shape)} differ; returns the
    summary line ("N of M linear weights FP8, scales fp32; matches the
    engine", or "" for an engine without FP8)."""
    text, base = load_json(engine, "engine config")
    layout = _core.engine_params(text, base, replica, rank)
    rows = differences(layout, held, aliases)
    summary, source = _core.engine_fp8_summary(text, base, replica, rank)
    if rows:
        fp8 = f" ({summary}, from {source})" if summary else ""
        raise MismatchError(
            f"replica {replica} rank {rank}: weightsync's layout{fp8} and the {what}'s parameters "
            f"differ in {len(rows)} params; refused before any byte moves:\n{table(rows)}")
    return f"{summary}; matches the {what}" if summary else ""


def check_load_weights(engine: EngineLike, replica: int, rank: int, serialized_fp8: bool,
                       what: str = "engine") -> None:
    """load_weights mode: weightsync hands engine rank `rank` of `replica`
    the tensors of its layout, and the engine's own loaders copy them into
    its params. An engine serving an FP8-serialized checkpoint
    (`serialized_fp8`: its quantization_config stores the weights in FP8
    with their scales) copies floats into its FP8 params numerically and
    keeps the old scales: a wrong model, and no error. Refused
    (MismatchError) before any byte moves unless the layout sends FP8
    tensors too."""
    if not serialized_fp8:
        return
    text, base = load_json(engine, "engine config")
    layout = _core.engine_params(text, base, replica, rank)
    if any(dtype.startswith("F8") for _, dtype, _ in layout):
        return
    dtypes = sorted({dtype for _, dtype, _ in layout})
    raise MismatchError(
        f"replica {replica} rank {rank}: the {what} serves an FP8 checkpoint (its "
        "quantization_config stores the weights in FP8 with their scales), and weightsync's "
        f"layout sends no FP8 tensor ({', '.join(dtypes)} only): the {what}'s loader would "
        "copy them into its FP8 params without new scales, a wrong model with no error. "
        "Refused before any byte moves. Use the engine config's framework 'vllm' (mode "
        "'direct': weightsync quantizes as the engine does, from the checkpoint's "
        "quantization_config; docs/fp8.md)")
