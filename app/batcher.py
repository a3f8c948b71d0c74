"""Dynamic batching: a bounded queue and one worker thread that runs one forward pass per batch.

The batcher knows neither Flask nor the model: it takes items, calls ``predict_fn(list_of_items)`` and hands each
caller its own row of the result through a Future.
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Generic, Sequence, TypeVar

log = logging.getLogger(__name__)

In = TypeVar("In")
Out = TypeVar("Out")


class BatcherError(Exception):
    """Base of the batcher's own errors."""


class QueueFull(BatcherError):
    """The queue has no room for the submitted items; ``retry_after_s`` estimates when it will."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class BatcherClosed(BatcherError):
    """The batcher is stopping or stopped and takes no new work."""


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


@dataclass
class _Pending(Generic[In]):
    item: In
    future: Future
    enqueued_at: float


class Batcher(Generic[In, Out]):
    """Collects up to ``max_batch_size`` items, waiting at most ``max_wait_ms`` after the first, then runs them."""

    def __init__(self, predict_fn: Callable[[list[In]], Sequence[Out]], *, max_batch_size: int,
                 max_wait_ms: float, queue_size: int, name: str = "batcher") -> None:
        if max_batch_size <= 0:
            raise ValueError(f"max_batch_size must be positive, got {max_batch_size}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        if queue_size <= 0:
            raise ValueError(f"queue_size must be positive, got {queue_size}")
        self._predict_fn = predict_fn
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self.queue_size = queue_size
        self._queue: collections.deque[_Pending[In]] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._batch_ids = itertools.count(1)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._batch_seconds = 0.0  # moving average of one predict_fn call, for Retry-After estimates
        self.batches_run = 0

    def start(self) -> "Batcher[In, Out]":
        """Start the worker thread; returns self."""
        self._thread.start()
        return self

    def is_alive(self) -> bool:
        """True while the worker thread runs (liveness)."""
        return self._thread.is_alive()

    @property
    def depth(self) -> int:
        """Items waiting in the queue now."""
        return len(self._queue)

    def submit(self, item: In) -> "Future[BatchResult[Out]]":
        """Queue one item; raises QueueFull or BatcherClosed at once instead of blocking."""
        return self.submit_many([item])[0]

    def submit_many(self, items: Sequence[In]) -> "list[Future[BatchResult[Out]]]":
        """Queue several items all together or none of them, so a rejected request leaves nothing behind."""
        now = time.monotonic()
        pending = [_Pending(item, Future(), now) for item in items]
        with self._cond:
            if self._closed:
                raise BatcherClosed("the inference worker is shutting down")
            if len(self._queue) + len(pending) > self.queue_size:
                raise QueueFull(f"inference queue is full ({len(self._queue)}/{self.queue_size} waiting)",
                                retry_after_s=self.expected_wait_s(len(self._queue) + len(pending)))
            self._queue.extend(pending)
            self._cond.notify()
        return [p.future for p in pending]

    def expected_wait_s(self, items: int) -> float:
        """How long ``items`` queued items take to clear at the recent batch latency."""
        batches = -(-items // self.max_batch_size)
        return batches * max(self._batch_seconds, self.max_wait_s)

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new work, finish everything already queued, then end the worker thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _collect(self) -> list[_Pending[In]] | None:
        """Block for the first item, then gather more until the batch is full or max_wait has passed."""
        with self._cond:
            while not self._queue:
                if self._closed:
                    return None
                self._cond.wait()
            batch = [self._queue.popleft()]
            deadline = time.monotonic() + self.max_wait_s
            while len(batch) < self.max_batch_size:
                if self._queue:
                    batch.append(self._queue.popleft())
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    break
                self._cond.wait(remaining)
            return batch

    def _run(self) -> None:
        while (batch := self._collect()) is not None:
            # A caller that gave up (timed out and cancelled) costs no forward pass.
            live = [p for p in batch if p.future.set_running_or_notify_cancel()]
            if live:
                self._run_batch(live)
        log.info("batcher stopped after %d batches", self.batches_run)

    def _run_batch(self, batch: list[_Pending[In]]) -> None:
        batch_id = next(self._batch_ids)
        started = time.monotonic()
        try:
            outputs = self._predict_fn([p.item for p in batch])
            if len(outputs) != len(batch):
                raise BatchSizeMismatch(f"predict_fn returned {len(outputs)} outputs for {len(batch)} inputs")
        except Exception as exc:  # noqa: BLE001 - a failing batch fails its callers, never the worker
            log.exception("batch %d of %d failed", batch_id, len(batch))
            for p in batch:
                p.future.set_exception(exc)
            return
        finished = time.monotonic()
        run_s = finished - started
        self.batches_run += 1
        self._batch_seconds = run_s if self.batches_run == 1 else 0.8 * self._batch_seconds + 0.2 * run_s
        for p, value in zip(batch, outputs):
            p.future.set_result(BatchResult(value, batch_id, len(batch), started - p.enqueued_at, run_s))
