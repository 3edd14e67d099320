"""The in-process coordinator."""

from __future__ import annotations

import json
from typing import Any, Optional, Union

from . import _core
from ._errors import InvalidArgument
from ._options import _address


class Coordinator:
    """The control-plane coordinator, in this process (a thread serving TCP).
    `port=0` binds any free port; `.address` is "HOST:PORT" as bound. A
    standalone one is the `weightsync coordinator` command."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, token: Optional[str] = None,
                 metrics_port: Optional[int] = None):
        """Binds `host:port` and serves until close(). `token`: a shared
        secret every endpoint must present (None: none). `metrics_port`:
        serve Prometheus metrics on http://host:metrics_port/metrics (0: any
        free port, read back from `.metrics_port`; None: no metrics;
        docs/metrics.md)."""
        self._core = _core.Coordinator(host, port, token or "",
                                       -1 if metrics_port is None else metrics_port)

    @property
    def address(self) -> str:
        """"HOST:PORT" as bound: what Publishers and Subscribers connect to."""
        return self._core.address

    @property
    def port(self) -> int:
        """The port as bound."""
        return self._core.port

    @property
    def metrics_port(self) -> int:
        """The bound port of the Prometheus metrics (0: metrics are off)."""
        return self._core.metrics_port

    @property
    def closed(self) -> bool:
        """Whether close() was called."""
        return self._core.closed

    def committed_version(self, engine_rank: int) -> int:
        """The last step engine rank `engine_rank` committed (-1: none)."""
        return self._core.committed_version(engine_rank)

    def members(self) -> list[dict[str, Any]]:
        """Every registered member: {"role", "rank", "replica", "id"} (a
        member keeps its id when it comes back to a restarted coordinator)."""
        return [{"role": role, "rank": rank, "replica": replica, "id": member_id}
                for role, rank, replica, member_id in self._core.members()]

    def close(self) -> None:
        """Stops serving (endpoints still connected see it go)."""
        self._core.close()

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



#: Where the coordinator is: "HOST:PORT", or a Coordinator of this process.
CoordinatorLike = Union[str, Coordinator]


def status(coordinator: CoordinatorLike, *, token: Optional[str] = None,
           timeout: float = 10.0) -> dict[str, Any]:
    """The job as its coordinator sees it: what `weightsync status --json`
    prints (docs/metrics.md). "members" (each engine rank with its
    "version", "lag", "torn" and "parity"), "newest" (the newest committed
    version), "open_step" (None between steps) and the last decided
    "steps". Asked as an observer, which takes no part in steps; any rank or
    process may call it (a trainer, a router). `timeout`: seconds to connect
    and be answered (weightsync.TimeoutError or PeerFailure past it)."""
    address = _address(coordinator)
    if not timeout > 0:
        raise InvalidArgument(f"timeout must be positive, got {timeout!r}")
    answer: dict[str, Any] = json.loads(
        _core.coordinator_status(address, token or "", float(timeout)))
    return answer
