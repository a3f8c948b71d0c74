"""What the batcher raises, reports and returns: its errors, the observer it reports to, each item's result, and a
request's items answered together (``Group``).

Kept apart from the queue and worker thread (app/engine/batching/batcher.py) so the service's error mapping and the timing
headers can name these without the batching machinery.
"""
from __future__ import annotations

import contextlib
from concurrent.futures import Future, InvalidStateError
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


class Group(Generic[Out]):
    """Items queued together and answered together (``Batcher.submit_group``): one future for their results, in
    order, set once the last one has its row; the first item that fails fails it (``failed_at`` says which).
    Cancelled before any of its items is taken into a batch, they are dropped unrun; once one is, it runs to its
    end. One lock-free count an item, where a future an item took its lock five or six times on its way."""

    __slots__ = ("future", "results", "left", "started", "over", "failed_at")

    def __init__(self, size: int) -> None:
        self.future: Future[list[BatchResult[Out]]] = Future()
        self.results: list[BatchResult[Out] | None] = [None] * size
        self.left, self.started, self.over, self.failed_at = size, False, False, -1

    def wanted(self) -> bool:
        """On the thread taking a batch: whether the group's items still run (the first one taken marks it running,
        so a cancel then comes too late)."""
        if not self.started and not self.over:
            self.started = True
            self.over = not self.future.set_running_or_notify_cancel()
        return not self.over

    def done(self, index: int, result: BatchResult[Out]) -> None:
        """Item ``index``'s row; the last one sets the future."""
        self.results[index] = result
        self.left -= 1
        if not self.left and not self.over:
            self.over = True
            self.future.set_result(self.results)  # type: ignore[arg-type]

    def fail(self, index: int, exc: BaseException) -> None:
        """Item ``index`` failed: so does the group, unless it was over already."""
        if self.over:
            return
        self.over, self.failed_at = True, index
        with contextlib.suppress(InvalidStateError):  # cancelled meanwhile: nobody waits for it
            self.future.set_exception(exc)
