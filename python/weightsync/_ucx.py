"""Which UCX library weightsync's extension runs with, chosen before it loads.

weightsync._core links UCX by its soname (libucp.so.0), so it uses the first
UCX the process loaded. Debian's UCX 1.13 moves host memory only; a UCX built
with CUDA (PyPI's libucx-cu13 or libucx-cu12) also registers and sends GPU
tensors as CUDA memory, with no pinned host copy (docs/transports.md). The
environment variable WEIGHTSYNC_UCX picks, when weightsync is imported:

    auto     (default) the libucx package's UCX when it is installed, else
             whatever the loader finds (the system's)
    libucx   the libucx package's UCX; ImportError when it is not installed
    system   whatever the loader finds (LD_LIBRARY_PATH, then the system's)
    <dir>    the UCX libraries in that directory (libucm, libucs, libuct,
             libucp .so.0)

A UCX loaded before weightsync is imported stays the one used.
"""

from __future__ import annotations

import ctypes
import os

# In dependency order. libucm calls into libucs without naming it, so it comes
# in as libucs's dependency (found through libucs's run path), not first.
_FILES = ("libucm.so.0", "libucs.so.0", "libuct.so.0", "libucp.so.0")
_LOAD = ("libucs.so.0", "libuct.so.0", "libucp.so.0")
_handles: list = []  # keeps what was loaded loaded


def _load_directory(path: str) -> None:
    missing = [n for n in _FILES if not os.path.exists(os.path.join(path, n))]
    if missing:
        raise ImportError(f"WEIGHTSYNC_UCX={path!r}: no {', '.join(missing)} in that directory")
    # RTLD_LOCAL: the loader then satisfies _core's need for libucp.so.0 by
    # soname with these, without exporting UCX symbols to everything else.
    _handles.extend(ctypes.CDLL(os.path.join(path, n), ctypes.RTLD_LOCAL) for n in _LOAD)


def _load_libucx(required: bool) -> None:
    try:
        import libucx  # type: ignore[import-not-found]
    except ImportError as e:
        if required:
            raise ImportError(
                "WEIGHTSYNC_UCX=libucx, but the libucx package is not installed "
                "(pip install libucx-cu13, or libucx-cu12 for CUDA 12)") from e
        return
    _handles.extend(libucx.load_library())


def select() -> None:
    """Loads the UCX WEIGHTSYNC_UCX asks for (nothing when the loader's
    choice stands); ucx_library() says which one the process got."""
    choice = os.environ.get("WEIGHTSYNC_UCX", "auto").strip() or "auto"
    if choice == "system":
        return
    if choice in ("auto", "libucx"):
        return _load_libucx(required=choice == "libucx")
    if os.path.isdir(choice):
        return _load_directory(choice)
    raise ImportError(f"WEIGHTSYNC_UCX={choice!r}: expected auto, libucx, system or a directory "
                      "holding libucp.so.0")


def ucx_library() -> list[str]:
    """The UCX library files (libucp) this process runs with, as mapped into
    it (Linux; normally one). WEIGHTSYNC_UCX picks it at import (docs/python.md)."""
    try:
        with open("/proc/self/maps") as f:
            files = {line.split()[-1] for line in f if "libucp.so" in line.rsplit("/", 1)[-1]}
    except OSError:
        return []
    return sorted(os.path.realpath(f) for f in files)


select()
