"""weightsync.Error and its subclasses, one per error code of the library.

The C++ library raises one error type with a code (include/weightsync/
error.h); the extension turns it into `weightsync.Error(code, message)`.
Constructing `Error` with a code returns the subclass of that code, so every
error the library raises is an instance of its code's class:

    try:
        out = sub.run_step(timeout=5.0)
    except ws.TimeoutError:            # also a builtin TimeoutError
        ...
    except ws.Error as e:              # every weightsync error, e.code names it
        ...

Every class is picklable (errors cross processes: multiprocessing, futures).
"""

from __future__ import annotations

import builtins
from typing import Any, ClassVar, Optional

__all__ = [
    "Cancelled",
    "Error",
    "FormatError",
    "InternalError",
    "InvalidArgument",
    "InvalidLayout",
    "IoError",
    "MismatchError",
    "NotFound",
    "PeerFailure",
    "ProtocolError",
    "TimeoutError",
    "TransportError",
    "Unsupported",
    "error_class",
]

# code -> the class raised for it (filled by Error.__init_subclass__).
_BY_CODE: dict[str, type[Error]] = {}

_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE


def _static_base(cls: type) -> type:
    """The builtin exception type whose layout `cls`'s instances have (the
    one whose __new__ may create them: OSError's for builtins.TimeoutError)."""
    base = cls
    while base.__flags__ & _HEAPTYPE and base.__base__ is not None:
        base = base.__base__
    return base


class Error(RuntimeError):
    """A weightsync error: `.code` is the library's error code and the message
    names the tensor, key, rank or peer involved and what was expected.

    Codes, each with its subclass: invalid_argument (InvalidArgument),
    invalid_layout (InvalidLayout), format (FormatError), io (IoError),
    mismatch (MismatchError), not_found (NotFound), timeout (TimeoutError),
    peer_failure (PeerFailure), transport (TransportError), protocol
    (ProtocolError), unsupported (Unsupported), cancelled (Cancelled),
    internal (InternalError).

    `Error(code, message)` returns an instance of the code's subclass (an
    unknown code gives a plain Error); a subclass is also constructed from the
    message alone: `ws.TimeoutError("step 3 timed out")`.
    """

    #: The error code of the class (an instance's own `.code` is the one it
    #: was raised with).
    code: str = "internal"
    #: The message, without the code.
    message: str

    # The code of each subclass, declared in its class body.
    _code: ClassVar[Optional[str]] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        code = cls.__dict__.get("_code")
        if isinstance(code, str):
            _BY_CODE.setdefault(code, cls)
            cls.code = code

    def __new__(cls, *args: Any) -> Error:
        if cls is Error and len(args) == 2 and isinstance(args[0], str):
            target = _BY_CODE.get(args[0], Error)
            if target is not Error:
                cls = target
        return _static_base(cls).__new__(cls, *args)

    def __init__(self, *args: str) -> None:
        if len(args) == 2:
            code, message = args
        elif len(args) == 1 and type(self)._code is not None:
            code, message = type(self).code, args[0]
        else:
            raise builtins.TypeError(
                f"{type(self).__name__}() takes (code, message)"
                + ("" if type(self)._code is None else " or (message)")
                + f", got {len(args)} arguments")
        RuntimeError.__init__(self, message)
        if isinstance(self, OSError):  # the OSError layout: (errno, strerror)
            setattr(self, "errno", None)
            setattr(self, "strerror", message)
        self.code = code
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        """Picklable across processes (multiprocessing, futures): the same
        class, code and message."""
        return (type(self), (self.code, self.message))

    def __repr__(self) -> str:
        return f"weightsync.{type(self).__name__}(code={self.code!r}, message={self.message!r})"


def error_class(code: str) -> type[Error]:
    """The class raised for error code `code` (Error for an unknown code)."""
    return _BY_CODE.get(code, Error)


class InvalidArgument(Error, ValueError):
    """invalid_argument: a caller passed something unusable (a bad option, an
    unknown name, a tensor that cannot be described). Also a ValueError."""

    _code = "invalid_argument"


class InvalidLayout(Error, ValueError):
    """invalid_layout: a trainer layout, engine config or plan is
    inconsistent. Also a ValueError."""

    _code = "invalid_layout"


class FormatError(Error, ValueError):
    """format: a file or message is malformed (safetensors, JSON, a frame).
    Also a ValueError."""

    _code = "format"


class IoError(Error, OSError):
    """io: the operating system refused (open, read, write, mmap, a socket).
    Also an OSError (its errno is None: the message says what failed)."""

    _code = "io"


class MismatchError(Error):
    """mismatch: shapes, dtypes, sizes or checksums disagree (e.g. a tensor
    registered with another shape than the layout's)."""

    _code = "mismatch"


class NotFound(Error, LookupError):
    """not_found: a key, tensor, file or peer that should exist does not.
    Also a LookupError."""

    _code = "not_found"


class TimeoutError(Error, builtins.TimeoutError):
    """timeout: a bounded wait ran out (connecting, a step, a peer). Also the
    builtin TimeoutError (which asyncio.TimeoutError is, on Python >= 3.11)."""

    _code = "timeout"


class PeerFailure(Error):
    """peer_failure: a peer died, left, or sent garbage."""

    _code = "peer_failure"


class TransportError(Error):
    """transport: the transport library (UCX, NCCL, CUDA IPC) reported an
    error."""

    _code = "transport"


class ProtocolError(Error):
    """protocol: the control-plane protocol was violated."""

    _code = "protocol"


class Unsupported(Error):
    """unsupported: a feature not built in or not available here (e.g. no
    GPU, a tensor on a device weightsync does not take)."""

    _code = "unsupported"


class Cancelled(Error):
    """cancelled: an operation was aborted on purpose (e.g. a hook raised,
    which fails its step)."""

    _code = "cancelled"


class InternalError(Error):
    """internal: a broken invariant, a bug in weightsync."""

    _code = "internal"


# Shown and pickled as weightsync.<Name>, where the package exports them.
for _cls in (Error, *_BY_CODE.values()):
    _cls.__module__ = "weightsync"
del _cls
