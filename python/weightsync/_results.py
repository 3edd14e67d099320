"""The typed results the API returns: PushResult, StepOutcome, SaveHfResult,
LoadReport, ParamInfo (frozen copies of the extension's results)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

_R = TypeVar("_R")


@dataclass(frozen=True)
class PushResult:
    """What `Publisher.push(step)` returns on this trainer rank, once the
    coordinator decided the step.

    Attributes:
        step: the version pushed.
        committed: the engine ranks (global) that committed it, ascending.
        failed: (engine rank, reason) of every engine rank that did not.
        bytes_sent: payload bytes this rank put on the wire.
        bytes_direct: of those, sent straight from the registered tensors
            (zero copy).
        buckets_lent: buckets written straight into the engine's lent params
            (one copy, over cuda_ipc: docs/transports.md).
        delta_buckets: delta sync: buckets sent as the elements that changed.
        delta_bytes_whole: the bytes those buckets hold whole.
        delta_base_bytes: delta sync: host memory this rank keeps as its
            buckets' bases (what their engine ranks hold; buckets that go
            alike to several replicas share one).
        seconds: the push, call to return.
        plan_id: the plan of the step.
        replicas: elastic publishers: the replicas the step served (else []).
        phases: seconds per phase: "begin", "pack", "gather", "wire", "commit".
    """

    step: int
    committed: list[int]
    failed: list[tuple[int, str]]
    bytes_sent: int
    bytes_direct: int
    buckets_lent: int
    delta_buckets: int
    delta_bytes_whole: int
    delta_base_bytes: int
    seconds: float
    plan_id: str
    replicas: list[int]
    phases: dict[str, float]

    @property
    def ok(self) -> bool:
        """True when no engine rank failed the step."""
        return not self.failed


@dataclass(frozen=True)
class StepOutcome:
    """What `Subscriber.run_step()` returns for a step that began on this
    engine rank.

    Attributes:
        step: the version.
        committed: whether it committed (the weights are that version now).
        reason: why not, when not committed; or why the on_end hook failed.
        bytes: payload bytes received.
        bytes_direct: of those, landed straight in the params (or staging).
        buckets_lent: buckets its trainers wrote into its lent params.
        delta_buckets: delta sync: buckets that came as deltas.
        weights_handed: load_weights mode: HF tensors handed to on_weights.
        checksum: the checksum this rank acked.
        seconds: from the step's begin to its decision.
        phases: seconds per phase: "receive", "verify", "apply", "commit".
        torn: after this step the params hold part of a step that did not
            commit (no staging): `Subscriber.torn`, until the next commit.
        torn_reason: when torn and not committed, the sentence `reason`
            ends with that says so ("" otherwise).
    """

    step: int
    committed: bool
    reason: str
    bytes: int
    bytes_direct: int
    buckets_lent: int
    delta_buckets: int
    weights_handed: int
    checksum: int
    seconds: float
    phases: dict[str, float]
    torn: bool = False
    torn_reason: str = ""


@dataclass(frozen=True)
class SaveHfResult:
    """What `Publisher.save_hf()` returns on each trainer rank
    (docs/checkpoints.md).

    Attributes:
        dir: the checkpoint directory.
        files: the number of .safetensors files of the checkpoint.
        total_bytes: its payload (the index's metadata.total_size).
        files_written: the files this rank wrote (full paths).
        bytes_written: their payload.
        bytes_local: of those, from this rank's own shards (nothing moved).
        bytes_sent: sent to the other writers.
        bytes_received: received from the other ranks.
        arena_bytes: memory where this rank assembled its keys.
        staging_bytes: this rank's bucket slots.
        disk_wait_s: transfers waiting for this rank's disk writes.
        disk_s: this rank's disk thread writing (and flushing).
        seconds: the call, end to end (setup_s + data_s + finish_s).
        setup_s: options agreed, writer layout, plan, transport connected.
        data_s: this rank's transfers and files written.
        finish_s: waiting for the other ranks' files and the index.
    """

    dir: str
    files: int
    total_bytes: int
    files_written: list[str]
    bytes_written: int
    bytes_local: int
    bytes_sent: int
    bytes_received: int
    arena_bytes: int
    staging_bytes: int
    disk_wait_s: float
    disk_s: float
    seconds: float
    setup_s: float
    data_s: float
    finish_s: float


@dataclass(frozen=True)
class LoadReport:
    """What `Publisher.load_hf()` returns.

    Attributes:
        bytes: bytes copied out of the checkpoint's files.
        pieces: pieces read.
        files: files touched.
        seconds: the call.
    """

    bytes: int
    pieces: int
    files: int
    seconds: float


class ParamInfo(NamedTuple):
    """A parameter an engine rank holds (engine_params, Subscriber.params):
    a (name, dtype, shape) tuple."""

    name: str
    dtype: str  #: the safetensors dtype name ("BF16")
    shape: list[int]


def _result(cls: type[_R], core: object) -> _R:
    """The dataclass `cls` holding the fields of the extension's result."""
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    return cls(**{name: getattr(core, name) for name in names})
