"""Progress of long work on a terminal: one line on stderr, redrawn in place
(what is done of a total, the rate, the time left); nothing when stderr is
no terminal. save_hf uses it: the bytes its files hold on disk, whichever
ranks write them."""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from types import TracebackType
from typing import Optional, TextIO, Type

#: Bytes per element of the safetensors dtypes a layout names.
_ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2, "F16": 2,
             "I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}


def layout_bytes(layout_text: str) -> int:
    """The bytes of the HF tensors a trainer layout covers (each param's
    unpadded shape once, whichever ranks hold it)."""
    total = 0
    for p in json.loads(layout_text).get("params", []):
        shape = p.get("origin_shape") or p.get("global_shape") or []
        total += math.prod(int(n) for n in shape) * _ITEMSIZE.get(str(p.get("dtype")), 2)
    return total


def safetensors_bytes_on_disk(directory: str) -> int:
    """Bytes the .safetensors files of `directory` hold on disk (their
    allocated blocks, each file at most its size)."""
    total = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for e in entries:
        if not e.name.endswith(".safetensors"):
            continue
        try:
            st = e.stat()
        except OSError:
            continue
        total += min(st.st_blocks * 512, st.st_size)
    return total


def format_line(label: str, done: float, total: float, seconds: float) -> str:
    """"save_hf: 12.0 / 48.0 MB, 6.0 MB/s, 6 s left"."""
    line = f"{label}: {min(done, total) / 1e6:.1f} / {total / 1e6:.1f} MB"
    if seconds > 0 and done > 0:
        rate = done / seconds
        line += f", {rate / 1e6:.1f} MB/s, {max(0.0, total - done) / rate:.0f} s left"
    return line


class DirProgress:
    """While the `with` block runs, shows the bytes written into
    `directory`'s safetensors files against `total` on `stream` (stderr),
    five times a second, when `enabled` (None: when the stream is a
    terminal)."""

    def __init__(self, label: str, directory: str, total: int, enabled: Optional[bool] = None,
                 stream: Optional[TextIO] = None):
        self.label, self.directory, self.total = label, directory, total
        self.stream = stream if stream is not None else sys.stderr
        is_tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.enabled = (is_tty if enabled is None else enabled) and total > 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._start = 0.0
        self.lines = 0  # reports drawn

    def _draw(self) -> None:
        done = safetensors_bytes_on_disk(self.directory)
        line = format_line(self.label, done, self.total, time.monotonic() - self._start)
        self.stream.write("\r" + line + "\033[K")
        self.stream.flush()
        self.lines += 1

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self._draw()

    def __enter__(self) -> DirProgress:
        if self.enabled:
            self._start = time.monotonic()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]],
                 exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        if exc_type is None:
            self._draw()
        self.stream.write("\n")
        self.stream.flush()
