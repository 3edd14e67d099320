"""What both sides share: the layout and engine config inputs (a path, a dict
or JSON text), engine_params, and the registry that keeps registered
tensors alive."""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterable, Mapping, Sequence, Union

from . import _core
from ._errors import InvalidArgument, IoError, NotFound
from ._results import ParamInfo
from ._tensors import clean_name, local_tensor, view

#: A trainer layout: a path to its JSON file, its JSON text, or the dict.
LayoutLike = Union[str, "os.PathLike[str]", Mapping[str, Any]]
#: An engine config: a path to its JSON file, its JSON text, the dict, or a
#: list of them (engine groups).
EngineLike = Union[str, "os.PathLike[str]", Mapping[str, Any], Sequence[Mapping[str, Any]]]


def load_json(value: Any, what: str) -> tuple[str, str]:
    """(JSON text, base directory) of a layout or engine config given as a
    path, a dict (a list of them: engine groups) or a JSON string; relative
    paths inside resolve against the file's directory (or the working
    directory for a dict or a string)."""
    if isinstance(value, (Mapping, list, tuple)):  # a list: engine groups
        return json.dumps(value), os.getcwd()
    if isinstance(value, (str, os.PathLike)):
        text = os.fspath(value)
        if text.lstrip().startswith(("{", "[")):
            return text, os.getcwd()
        path = os.path.abspath(text)
        try:
            with open(path, encoding="utf-8") as f:
                return f.read(), os.path.dirname(path)
        except OSError as e:
            raise IoError(f"cannot read {what} '{path}': {e.strerror}") from None
    raise InvalidArgument(
        f"{what}: expected a path, a dict or a JSON string, got {type(value).__name__}")



def engine_params(engine: EngineLike, replica: int = 0, rank: int = 0) -> list[ParamInfo]:
    """[(name, dtype, shape)] of every parameter engine rank `rank` of replica
    `replica` holds (dtype: the safetensors name, e.g. "BF16"): allocate them,
    then register them with a Subscriber."""
    text, base = load_json(engine, "engine config")
    return [ParamInfo(n, d, list(s)) for n, d, s in _core.engine_params(text, base, replica, rank)]



class _Registry:
    """Shared by both sides: keeps every registered tensor alive (the C++ side
    holds raw pointers into them) and registers modules by name."""

    def __init__(self, side: str, names: Iterable[str]):
        self._side = side
        self._names = list(names)
        self._refs: dict[str, Any] = {}

    def add(self, name: str, tensor: Any, register: Callable[..., None]) -> None:
        local = local_tensor(tensor)
        register(name, *view(local, f"{self._side} param '{name}'"))
        self._refs[name] = (tensor, local)

    def add_module(self, module: Any, register: Callable[[str, Any], None],
                   strict: bool) -> list[str]:
        wanted = set(self._names)
        seen: set[str] = set()
        unknown: list[str] = []
        for name, tensor in module.named_parameters():
            name = clean_name(name)
            if name in wanted:
                register(name, tensor)
                seen.add(name)
            else:
                unknown.append(name)
        for name, tensor in module.named_buffers():
            name = clean_name(name)  # only the buffers the layout names
            if name in wanted and name not in seen:
                register(name, tensor)
                seen.add(name)
        missing = [n for n in self._names if n not in seen]
        if missing:
            raise NotFound(f"{self._side}: {len(missing)} params of the layout are not in "
                           f"the module: {_some(missing)}")
        if unknown and strict:
            raise NotFound(f"{self._side}: {len(unknown)} params of the module are not in "
                           f"the layout: {_some(unknown)} (strict=False ignores them)")
        return unknown


def _some(names: list[str], n: int = 8) -> str:
    head = ", ".join(repr(x) for x in names[:n])
    return head + (f", ... ({len(names) - n} more)" if len(names) > n else "")
