"""What the batcher raises, reports and returns: its errors, the observer it reports to, and each item's result.

Kept apart from the queue and worker thread (app/engine/batching/batcher.py) so the service's error mapping and the timing
headers can name these without the batching machinery.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, Sequence, TypeVar

Out = TypeVar("Out")


class BatcherError(Exception):
    """Base of the batcher's own errors."""


class QueueFull(BatcherError):
    """The queue has no room for the submitted items; ``retry_after_s`` estimates when it will."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineUnreachable(QueueFull):
    """The backlog ahead would outlast the caller's deadline, so the items are refused before they queue."""


class DeadlineTooShort(BatcherError):
    """The caller's deadline is shorter than its own items' forward passes would take with nothing queued."""


class DeadlineExpired(BatcherError):
    """The item's deadline passed while it waited; it was dropped before its forward pass."""


class BatcherClosed(BatcherError):
    """The batcher is stopping or stopped and takes no new work."""


class BatchObserver(Protocol):
    """What the batcher reports as it works (metrics plug in here; the batcher imports none)."""

    def batch_done(self, size: int, run_s: float, queued_s: Sequence[float], cpu_s: float) -> None: ...

    def event(self, name: str, count: int = 1) -> None: ...

    def queue_depth(self, depth: int) -> None: ...

    def running(self, alive: bool) -> None: ...


class NullObserver:
    """Reports nowhere."""

    def batch_done(self, size: int, run_s: float, queued_s: Sequence[float], cpu_s: float) -> None:
        """Ignore a finished batch."""

    def event(self, name: str, count: int = 1) -> None:
        """Ignore an event."""

    def queue_depth(self, depth: int) -> None:
        """Ignore the queue depth."""

    def running(self, alive: bool) -> None:
        """Ignore the thread's start and end."""


class BackgroundJob(Protocol):
    """Work that runs on the batcher's thread only when no item waits and none is on its way (a shadow
    comparison): it never delays a queued item by more than the one job already running."""

    size: int  # images: jobs with the same group_key run together up to the batch cap
    deadline: float  # time.monotonic() after which it is dropped unrun

    def group_key(self) -> object: ...

    def run_group(self, jobs: list["BackgroundJob"]) -> None: ...

    def drop(self, reason: str) -> None: ...


class BatchSizeMismatch(BatcherError):
    """``predict_fn`` returned a different number of outputs than it was given inputs."""


@dataclass(frozen=True)
class BatchResult(Generic[Out]):
    """One item's output and how it was served."""

    value: Out
    batch_id: int
    batch_size: int
    queued_s: float  # from submit() until its batch started
    run_s: float  # duration of the batch's predict_fn call
