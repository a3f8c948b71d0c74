"""An HTTP worker's loop requests (app/hosting/loop_requests.py) without gunicorn: the worker's loop on the test's
greenlet, its requests functions run as loop requests."""
from __future__ import annotations

import contextlib
import selectors
import time
from types import SimpleNamespace
from typing import Any, Callable, Iterator


class LoopWorker:
    """The worker's loop requests with its poller and waits, without gunicorn's set-up: each request a function
    (its ``conn`` a name), each request's end noted as gthread's ``finish_request`` would see it."""

    def __init__(self, threads: int = 32) -> None:
        from app.hosting.worker import BufferingWorker

        self.worker = worker = BufferingWorker.__new__(BufferingWorker)
        worker.init_loop_requests()  # on this greenlet: the test's, standing for the loop's
        worker.poller, worker.loop_requests = selectors.DefaultSelector(), True
        worker.cfg = SimpleNamespace(threads=threads)
        self.runs: dict[str, Callable[[], object]] = {}
        self.ended: list[tuple[str, object]] = []
        self.outcomes: dict[str, Any] = {}  # each request's Outcome
        worker._handle_one = lambda conn: self.runs[conn]()
        worker.finish_request = self._finished

    def _finished(self, conn: str, outcome: Any) -> None:
        self.outcomes[conn] = outcome
        self.ended.append((conn, outcome.result()))

    def start(self, name: str, run: Callable[[], object]) -> None:
        self.runs[name] = run
        self.worker.run_on_loop(name)

    @contextlib.contextmanager
    def waits(self) -> Iterator["LoopWorker"]:
        """Every wait of a loop request handed to this loop for the block (``waiting.wait_on``)."""
        from app.hosting import waiting

        waiting.wait_on(self.worker)
        try:
            yield self
        finally:
            waiting.wait_on(None)

    def turn_until(self, done: Callable[[], bool], timeout_s: float = 10.0) -> None:
        """The loop turned (gthread's turns) until ``done``; AssertionError when it is not within ``timeout_s``."""
        until = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < until, "the loop's requests did not end in time"
            self.worker.wait_for_and_dispatch_events(0.05)
