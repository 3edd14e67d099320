"""Torch tensors as the C++ side sees them: pointer, dtype name, shape, strides,
device. Duck-typed, so that `import weightsync` never imports torch."""

from __future__ import annotations

from typing import Any, NamedTuple

from ._errors import Error

# torch dtype -> safetensors name (the names of DESIGN.md's contract).
_DTYPES = {
    "torch.bool": "BOOL",
    "torch.uint8": "U8",
    "torch.int8": "I8",
    "torch.int16": "I16",
    "torch.uint16": "U16",
    "torch.int32": "I32",
    "torch.uint32": "U32",
    "torch.int64": "I64",
    "torch.uint64": "U64",
    "torch.float16": "F16",
    "torch.bfloat16": "BF16",
    "torch.float32": "F32",
    "torch.float64": "F64",
    "torch.float8_e4m3fn": "F8_E4M3",
    "torch.float8_e5m2": "F8_E5M2",
    "torch.float8_e8m0fnu": "F8_E8M0",
}
_TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}

# Components that wrappers insert into parameter names (torch.compile,
# activation checkpointing, FSDP1); the layout uses the model's own names.
# DDP's "module." is dropped only as the first component.
_WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


class View(NamedTuple):
    """A tensor as the C++ side takes it (register_tensor / register_param)."""

    data: int  #: the address of its first element
    dtype: str  #: the safetensors dtype name ("BF16")
    shape: list[int]
    strides: list[int]  #: in elements
    device: int  #: -1: host memory, else the CUDA ordinal


def dtype_name(dtype: Any) -> str:
    """The safetensors name of a torch dtype (torch.bfloat16 -> "BF16")."""
    name = _DTYPES.get(str(dtype))
    if name is None:
        raise Error("invalid_argument", f"dtype {dtype} has no safetensors name "
                    f"(supported: {', '.join(sorted(_DTYPES))})")
    return name


def torch_dtype(name: str) -> Any:
    """The torch dtype of a safetensors dtype name ("BF16" -> torch.bfloat16)."""
    import torch

    try:
        return getattr(torch, _TORCH_DTYPES[name].split(".", 1)[1])
    except KeyError:
        raise Error("invalid_argument", f"unknown dtype name {name!r}") from None


def is_dtensor(t: Any) -> bool:
    """Whether `t` is a torch DTensor (duck-typed: torch is not imported)."""
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local") and hasattr(t, "placements")


def local_tensor(t: Any) -> Any:
    """The tensor whose memory holds this rank's data: a DTensor's local shard,
    a Parameter's data, without autograd."""
    if is_dtensor(t):
        t = t.to_local()
    return t.detach() if hasattr(t, "detach") else t


def view(t: Any, what: str) -> View:
    """Describes a torch tensor (CPU or CUDA, any strides) for the C++ side."""
    for attr in ("data_ptr", "dtype", "shape", "stride", "device"):
        if not hasattr(t, attr):
            raise Error("invalid_argument", f"{what}: expected a torch tensor, got {type(t).__name__}")
    device = t.device
    if device.type == "cpu":
        ordinal = -1
    elif device.type == "cuda":
        ordinal = device.index if device.index is not None else 0
    else:
        raise Error("unsupported", f"{what}: tensor on device '{device}'; weightsync takes "
                    "tensors in host (cpu) or CUDA memory")
    shape = [int(d) for d in t.shape]
    strides = [int(s) for s in t.stride()]
    return View(int(t.data_ptr()), dtype_name(t.dtype), shape, strides, ordinal)


def clean_name(name: str) -> str:
    """A parameter name without wrapper components (`_orig_mod.` etc.)."""
    parts = [p for p in name.split(".") if p not in _WRAPPER_PARTS]
    while len(parts) > 1 and parts[0] == "module":  # DDP, Megatron's Float16Module, ...
        parts = parts[1:]
    return ".".join(parts)
