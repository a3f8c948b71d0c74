"""ExplainLane: explanations in a lane of their own, never inside the batches ``/predict`` runs.

``EXPLAIN_CONCURRENCY`` threads compute them (each a forward and a backward pass on the version's Explainer), at a
lower CPU priority (``EXPLAIN_NICE``), so on busy cores the batches go first; ``EXPLAIN_QUEUE_SIZE`` more may wait,
and past that a new one is refused at once (429 with Retry-After). A caller that stops waiting (its deadline) does
not free the lane before its explanation ends: the lane counts work, not callers.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from concurrent.futures import CancelledError, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from app.config import Settings
from app.engine.contract import Explanation
from app.engine.lifecycle import not_ready
from app.engine.loaded.version import LoadedVersion
from app.errors import DeadlineExceeded, Overloaded, ServiceError, retry_after_header
from app.metrics import EXPLAIN_SECONDS, EXPLANATIONS, series

log = logging.getLogger(__name__)


def _lower_priority(nice: int) -> None:
    """This thread's CPU priority lowered to ``nice`` (Linux: a thread's own; elsewhere left as it is)."""
    if nice and hasattr(os, "setpriority"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)


class ExplainLane:
    """Explanations computed on threads of their own, bounded in number (running and waiting)."""

    def __init__(self, settings: Settings) -> None:
        self._room = threading.BoundedSemaphore(settings.explain_concurrency + settings.explain_queue_size)
        self._threads = ThreadPoolExecutor(settings.explain_concurrency, thread_name_prefix="explain",
                                           initializer=_lower_priority, initargs=(settings.explain_nice,))
        self._seconds = 1.0  # the last explanation's time: what Retry-After says per explanation ahead

    def explain(self, version: LoadedVersion, image: bytes, index: int | None, png: bool,
                timeout_s: float) -> Explanation:
        """``image``'s explanation by ``version``, within ``timeout_s`` (DeadlineExceeded after it); Overloaded at
        once when the lane and its queue are full."""
        if not self._room.acquire(blocking=False):
            self._count(version, "refused")
            raise Overloaded("explanations are busy: the lane and its queue are full; try again later",
                             headers=retry_after_header(self._seconds))
        try:
            future = self._threads.submit(self._run, version, image, index, png)
        except RuntimeError:  # the lane closed (the process is going away)
            self._room.release()
            raise not_ready("the server is shutting down", close=True) from None
        future.add_done_callback(lambda _: self._room.release())
        try:
            explanation = future.result(timeout=timeout_s)
        except CancelledError:  # still waiting when the lane closed
            self._count(version, "refused")
            raise not_ready("the server is shutting down", close=True) from None
        except FutureTimeout:
            future.cancel()  # not yet begun: never runs
            self._count(version, "failed")
            raise DeadlineExceeded(f"no explanation within the request's {timeout_s:g}s deadline") from None
        except ServiceError:
            self._count(version, "refused")
            raise
        except Exception:
            self._count(version, "failed")
            raise
        self._count(version, "ok")
        return explanation

    def _run(self, version: LoadedVersion, image: bytes, index: int | None, png: bool) -> Explanation:
        started = time.perf_counter()
        explanation = version.explainer().explain(image, index, png)
        self._seconds = time.perf_counter() - started
        series(EXPLAIN_SECONDS, version.name).observe(self._seconds)
        return explanation

    @staticmethod
    def _count(version: LoadedVersion, outcome: str) -> None:
        series(EXPLANATIONS, version.name, version.version, outcome).inc()

    def close(self) -> None:
        """Stop taking explanations; those running end."""
        self._threads.shutdown(wait=False, cancel_futures=True)
