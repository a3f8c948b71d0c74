"""What the batcher raises, reports and returns: its errors, the observer it reports to, each item's result, and a
request's items answered together (``Group``).

Kept apart from the queue and worker thread (app/engine/batching/batcher.py) so the service's error mapping and the timing
headers can name these without the batching machinery.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import CancelledError
from typing import Any, Callable, Generic, NamedTuple, Protocol, Sequence, TypeVar

log = logging.getLogger(__name__)

Out = TypeVar("Out")


class BatcherError(Exception):
    """Base of the batcher's own errors."""


class QueueFull(BatcherError):
    """The queue has no room for the submitted items; ``retry_after_s`` estimates when it will."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DeadlineUnreachable(QueueFull):
    """The backlog ahead would outlast the caller's deadline, so the items are refused before they queue;
    ``busy_until``: the ``time.monotonic()`` before which one more item would not be answered, as judged (a deadline
    that ends sooner is refused the same way while nothing ahead is dropped); an item's own time as judged
    (``item_s``) and a batch's wait for company (``company_s``)."""

    def __init__(self, message: str, retry_after_s: float, busy_until: float, item_s: float = 0.0,
                 company_s: float = 0.0) -> None:
        super().__init__(message, retry_after_s)
        self.busy_until, self.item_s, self.company_s = busy_until, item_s, company_s


class DeadlineTooShort(BatcherError):
    """What is left of the caller's deadline (``left_s``) is shorter than its ``count`` items' own forward passes
    would take with nothing queued (``own_s``); ``retry_after_s`` estimates when the queue ahead clears, for a
    deadline that time already spent made short, not its length (app/engine/call.py ``service_error``)."""

    def __init__(self, count: int, own_s: float, left_s: float, retry_after_s: float) -> None:
        self.count, self.own_s, self.left_s, self.retry_after_s = count, own_s, left_s, retry_after_s
        super().__init__(self.said(left_s))

    def said(self, deadline_s: float) -> str:
        """The refusal of a ``deadline_s`` deadline shorter than the items' own inference."""
        images = "this image's" if self.count == 1 else f"these {self.count} images'"
        return f"the {ms(deadline_s)} deadline is shorter than {images} own inference (about {ms(self.own_s)})"


def ms(seconds: float) -> str:
    """``seconds`` in milliseconds as a message says them: whole ones from 10, two significant digits below (a V2
    deadline may be a few microseconds; an X-Request-Timeout of 1.5 was said as "2 ms")."""
    millis = max(0.0, seconds) * 1000
    return f"{millis:.0f} ms" if millis >= 10 or millis == 0 else f"{millis:.2g} ms"


class DeadlineExpired(BatcherError):
    """The item's deadline passed while it waited; it was dropped before its forward pass."""


class BatcherClosed(BatcherError):
    """The batcher is stopping or stopped and takes no new work."""


class PrepareTimeout(BatcherError, TimeoutError):
    """``Batcher.start``'s ``prepare`` (a version's warm-up and canary) did not end within the time given."""


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


class BatchRun(NamedTuple):
    """Consecutive items of a group that ran in one batch: how many (``rows``), the batch's id and size, how long
    they waited from their queueing to its start, and its forward pass's time."""

    rows: int
    batch_id: int
    batch_size: int
    queued_s: float
    run_s: float


class BatchResult(NamedTuple, Generic[Out]):
    """One item's output and how it was served (a tuple: made per image on both sides of the link, in under half a
    frozen dataclass's time)."""

    value: Out
    batch_id: int
    batch_size: int
    queued_s: float  # from submit() until its batch started
    run_s: float  # duration of the batch's predict_fn call


class Group(Generic[Out]):
    """Items queued together and answered together (``Batcher.submit_group``): their outputs, in order, once the last
    one has its row, and the batches they ran in (``runs``); the first item that fails fails the group (``failed_at``
    says which). Cancelled before any of its items is taken into a batch, they are dropped unrun (``on_cancel``, the
    queue's, told how many at once, so they stop counting as its backlog); once one is, it runs to its end. Failed,
    its items still queued are dropped unrun (``on_failed``, the queue's, told at once: a request run again after
    its group failed finds the room they held).

    Its own completion, as much of a ``concurrent.futures.Future``'s as a request needs (``done``, ``cancel``,
    ``result``, ``add_done_callback``, ``wait``): one plain lock taken at each of its few changes of state and an event
    made only for a caller that waits, where a future took its condition five or six times a request. A batch hands
    it the rows of its consecutive items at once (``set_rows``): no object and no call per item."""

    __slots__ = ("values", "_runs", "left", "started", "over", "failed_at", "_error", "_cancelled", "_callbacks",
                 "_lock", "_finished", "_on_cancel", "_on_failed", "queued")

    def __init__(self, size: int, on_cancel: Callable[[int], object] | None = None,
                 on_failed: Callable[["Group[Out]"], object] | None = None) -> None:
        self.values: list[Out | None] = [None] * size
        self._runs: list[tuple[int, BatchRun]] = []  # (first item, its run), as the batches came
        self.left, self.started, self.over, self.failed_at = size, False, False, -1
        self._error: BaseException | None = None
        self._cancelled = False
        self._callbacks: list[Callable[["Group[Out]"], object]] | None = []  # None once done
        self._lock = threading.Lock()
        self._finished: threading.Event | None = None  # made by the first wait that finds it not done
        self._on_cancel, self._on_failed = on_cancel, on_failed
        self.queued: Sequence[Any] = ()  # the queue's entries of its items (each with its ``item``), set as queued:
        # a cancel lets go of their items at once (a loop link's photos waiting for the device's decode hold the
        # worker's arena: app/link/arena.py), where the queue reaches them only once the batches before them ran

    # -- the batcher's side ----------------------------------------------------------------------------------------

    def wanted(self) -> bool:
        """On the thread taking a batch: whether the group's items still run (the first one taken marks it running,
        so a cancel then comes too late)."""
        if not self.started and not self.over:
            with self._lock:
                if not self.over:
                    self.started = True
        return not self.over

    def set_rows(self, start: int, values: Sequence[Out], run: BatchRun) -> None:
        """Items ``start`` to ``start + run.rows - 1`` ran in one batch (``run``): their outputs; the last row
        completes the group."""
        self.values[start:start + run.rows] = values
        self._runs.append((start, run))
        self.left -= run.rows
        if not self.left and not self.over:  # rows come after the start, which no cancel passes: no race here
            self.over = True
            self._finish()

    def runs(self) -> tuple[BatchRun, ...]:
        """Once done: the batches its items ran in, in item order (a group's items queue together, so a batch takes
        a run of them; an item a failed batch ran again alone is a run of its own)."""
        if len(self._runs) == 1:  # every item in one batch
            return (self._runs[0][1],)
        return tuple(run for _, run in sorted(self._runs))  # by first item: no two runs start at the same one

    def set_failed(self, index: int, exc: BaseException) -> None:
        """Item ``index`` failed: so does the group, unless it was over already (answered, failed or cancelled)."""
        with self._lock:
            if self.over:
                return
            self.over, self.failed_at, self._error = True, index, exc
        if self._on_failed is not None and len(self.values) > 1:  # (one item: it was the one that failed)
            self._on_failed(self)
        self._finish()

    def _finish(self) -> None:
        self.queued = ()  # (done: the queue holds none of its items)
        with self._lock:
            callbacks, self._callbacks, finished = self._callbacks or [], None, self._finished
        if finished is not None:
            finished.set()
        for callback in callbacks:
            try:
                callback(self)
            except Exception:  # noqa: BLE001 - as a future's: one callback's fault is logged, the others still run
                log.exception("a group's done callback failed")

    # -- the waiting side ------------------------------------------------------------------------------------------

    def done(self) -> bool:
        """Every item has its row, one failed, or the group was cancelled."""
        return self._callbacks is None

    def cancelled(self) -> bool:
        """Cancelled before any of its items ran."""
        return self._cancelled

    def cancel(self) -> bool:
        """Drop the items unrun unless one was taken into a batch already; whether the group is cancelled."""
        with self._lock:
            if self._cancelled:
                return True
            if self.started or self.over:
                return False
            self._cancelled = self.over = True
        if self._on_cancel is not None:  # every item is still queued: none was taken, or it would have started
            self._on_cancel(len(self.values))
        for entry in self.queued:  # none is read again: the queue skips a cancelled group's items unrun
            entry.item = None
        self.queued = ()
        self._finish()
        return True

    def add_done_callback(self, callback: Callable[["Group[Out]"], object]) -> None:
        """``callback(group)`` once it is done, on the thread that completes it (at once when it is done already)."""
        with self._lock:
            if self._callbacks is not None:
                self._callbacks.append(callback)
                return
        callback(self)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until it is done (``timeout`` seconds at most); whether it is."""
        if self._callbacks is None:
            return True
        with self._lock:
            if self._callbacks is None:
                return True
            if self._finished is None:
                self._finished = threading.Event()
            finished = self._finished
        return finished.wait(timeout)

    def result(self, timeout: float | None = None) -> list[Out]:
        """The items' outputs in order; raises what failed the group, CancelledError, or TimeoutError."""
        if self._callbacks is None and self._error is None and not self._cancelled:  # done and answered: as is
            return self.values  # type: ignore[return-value]
        error = self.exception(timeout)
        if error is not None:
            raise error
        return self.values  # type: ignore[return-value]

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """What failed the group (None when it was answered); CancelledError, or TimeoutError when not done."""
        if not self.wait(timeout):
            raise TimeoutError(f"the group was not done within {timeout}s")
        if self._cancelled:
            raise CancelledError()
        return self._error
