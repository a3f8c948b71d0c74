"""Counting requests: those on their way to the queue (what a forming batch may wait for), and those in flight."""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator


class Arrivals:
    """Requests between their start and the moment their images are queued: what a batch could still wait for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    def count(self) -> int:
        """Requests on their way to the queue now."""
        return self._count

    @contextlib.contextmanager
    def arriving(self) -> Iterator[Callable[[], None]]:
        """Count one request until it calls the yielded ``arrived`` (just before queueing) or leaves, whichever
        comes first (a request that fails to decode leaves without queueing)."""
        pending = [True]

        def arrived() -> None:
            with self._lock:
                if pending[0]:
                    pending[0] = False
                    self._count -= 1

        with self._lock:
            self._count += 1
        try:
            yield arrived
        finally:
            arrived()


class InFlight:
    """How many requests are inside a block now (the stage runner): what a drain waits for."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    def count(self) -> int:
        """Requests inside now."""
        return self._count

    @contextlib.contextmanager
    def inside(self) -> Iterator[None]:
        """Count the caller until it leaves the block."""
        with self._lock:
            self._count += 1
        try:
            yield
        finally:
            with self._lock:
                self._count -= 1
