"""Counting requests: those in flight (what a drain waits for) and those on their way to the queue (what a forming
batch may wait for)."""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator


class InFlight:
    """How many requests are inside a block now (a service's admitted requests): what a drain waits for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    def count(self) -> int:
        """Requests inside now."""
        return self._count

    def add(self, delta: int) -> None:
        """Count ``delta`` more (or fewer): requests that enter (or leave) together."""
        with self._lock:
            self._count += delta

    def enter(self) -> None:
        """Count one more (``leave`` when done): for a use that outlives a ``with`` block."""
        with self._lock:  # (not through _add: each request enters and leaves several of these)
            self._count += 1

    def leave(self) -> None:
        """Count one less."""
        with self._lock:
            self._count -= 1

    def wait_empty(self, timeout_s: float, poll_s: float = 0.02) -> bool:
        """Wait until nobody is inside (``timeout_s`` at most); returns whether nobody is."""
        until = time.monotonic() + timeout_s
        while self._count and time.monotonic() < until:
            time.sleep(poll_s)
        return self._count == 0

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """Count the caller until it leaves the block."""
        self.add(1)
        try:
            yield
        finally:
            self.add(-1)


class Arrivals(InFlight):
    """Requests between their start and the moment their images are queued: what a batch could still wait for."""

    @contextlib.contextmanager
    def arriving(self) -> Iterator[Callable[[], None]]:
        """Count one request until it calls the yielded ``arrived`` (just before queueing) or leaves, whichever
        comes first (a request that fails to decode leaves without queueing)."""
        arrived = self.begin()
        try:
            yield arrived
        finally:
            arrived()

    def begin(self) -> Callable[[], None]:
        """Count one request until the returned ``arrived`` is called (once counts: later calls do nothing)."""
        with self._lock:
            self._count += 1
        return self._arrival()

    def begin_many(self, count: int) -> list[Callable[[], None]]:
        """``begin`` for ``count`` requests at once: each its own ``arrived``."""
        with self._lock:
            self._count += count
        return [self._arrival() for _ in range(count)]

    def _arrival(self) -> Callable[[], None]:
        """One request's ``arrived``, counted already."""
        pending = [True]

        def arrived() -> None:
            if pending[0]:  # (a request's second call, at its end, takes no lock)
                with self._lock:
                    if pending[0]:
                        pending[0] = False
                        self._count -= 1

        return arrived
