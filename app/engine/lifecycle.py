"""A service's life, alike in the worker (``app/engine/service.py``'s ``Service``) and across the link
(``app/link/client.py``'s ``RemoteService``), torch-free: started once its first models serve, draining (its
window, its deadline limit, answering on while a HUP's new worker loads), refusing, the requests in flight a drain
waits for, the worker's ready, leaving and loading marks in CONTROL_DIR; and every 503 they answer (``not_ready``).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable

from app.engine.batching.arrivals import InFlight
from app.errors import NotReady, retry_after_header
from app.hosting import control

log = logging.getLogger(__name__)

NOT_READY_RETRY_S = 5  # Retry-After of every 503: loading, draining, a stopped batcher, an engine away
DRAINING = ("the server is shutting down, or reloading its workers (a HUP): retry; its other workers, or the new ones "
            "once they serve, answer")  # a draining worker's 503: it cannot tell a stop from a reload
ANSWER_ON_POLL_S = 0.1  # how often a drain that answers on looks whether it still should (``wait_drained``)
ANSWER_ON_FIRST_LOOK_S = 1.0  # how long after its SIGTERM a drain looks for a new worker loading, whatever its window
ANSWER_ON_SETTLE_S = 1.0  # how long a drain that answered on answers once the new worker serves: the connections it
# took before (it takes none after) are answered, not 503 (3 of 2,021 requests of a HUP under a loaded suite were)
ANSWER_ON_LEAVES_S = 5.0  # what answering on leaves of the drain's limit (SHUTDOWN_DRAIN_S when longer): the
# deadline of the last requests it admits (``deadline_limit_s``)
DRAIN_LEAST_DEADLINE_S = 1.0  # less than this left of a drain: a new request goes elsewhere (503), not in a hurry


def not_ready(why: str, close: bool = False) -> NotReady:
    """503 with Retry-After saying ``why``; ``close``: the client should reconnect elsewhere (Connection: close)."""
    headers = retry_after_header(NOT_READY_RETRY_S)
    return NotReady(why, headers={**headers, "Connection": "close"} if close else headers)


class Lifecycle:
    """A service's life, alike in the worker and across the link: started once its first models serve, draining
    from ``begin_drain`` (not ready, its answers closing their connections, still answering new requests), refusing
    them once its drain's window ends (``stop_serving``), its admitted requests counted in ``in_flight`` (what a
    drain waits for)."""

    def __init__(self) -> None:
        self.in_flight = InFlight()  # requests admitted and not yet answered
        self._started = threading.Event()
        self._draining = threading.Event()
        self._refusing = threading.Event()
        self._drain_ends: float | None = None  # time.monotonic() by which a drain must be over (begin_drain's within_s)
        self._leaving_lock = threading.Lock()  # the leaving mark's write against stop_serving's refusal and removal
        # An HTTP worker's file saying it serves (CONTROL_DIR's http-<pid>.ready): there from its first models (or
        # its engine reached) until its drain, and away while its engine restarts (app/link/client.py). A worker
        # without one leaves new connections to the workers that have one (app/hosting/worker.py); None: no file
        # (an engine process, a test's app).
        self.ready_mark: Path | None = None
        self._mark_unwritten = False  # the last try to write the ready mark failed (warned of once)

    @property
    def draining(self) -> bool:
        """True once this process's shutdown has begun."""
        return self._draining.is_set()

    @property
    def refusing(self) -> bool:
        """True once its drain stopped answering new requests (``stop_serving``)."""
        return self._refusing.is_set()

    @property
    def leaving_mark(self) -> Path | None:
        """Beside the ready mark: the file saying this worker drains and still answers (CONTROL_DIR's
        http-<pid>.leaving), or None without a ready mark."""
        return None if self.ready_mark is None else control.leaving_mark(self.ready_mark.parent, os.getpid())

    def begin_drain(self, within_s: float | None = None) -> None:
        """Turn readiness off so load balancers stop sending; accepted work still completes, and new requests are
        still answered (each answer closing its connection) until ``stop_serving``. ``within_s``: the drain must be
        over by then (its worker is stopped after it), so a request admitted from now on gets at most what is left
        of it for its deadline (``deadline_limit_s``). A worker that served says it leaves (its leaving mark, made
        before its ready mark goes: a HUP's new worker, still loading, leaves the new connections to it meanwhile).
        Never raises (a worker's SIGTERM handler calls it): a mark that cannot be written or removed (CONTROL_DIR
        read-only) is warned of."""
        if within_s is not None and self._drain_ends is None:
            self._drain_ends = time.monotonic() + within_s
        self._draining.set()
        if self.ready_mark is not None:
            try:
                served = self.ready_mark.exists()
            except OSError:
                served = False
            if served:
                self._mark_leaving()
        self._remove_ready_mark()
        self._remove_mark(self.loading_mark, None)  # (told to stop while it loads: no replacement on its way)
        self._drain_begun()

    def _mark_leaving(self) -> None:
        """The leaving mark written, unless the drain's window is over or this worker answers nothing new now
        (``_answers_new``)."""
        leaving = self.leaving_mark
        if leaving is None:
            return
        with self._leaving_lock:
            if self.refusing or not self._answers_new():
                return
            try:
                leaving.touch()
            except OSError as exc:
                log.warning("could not write the leaving mark %s: %s; a worker still loading takes new connections "
                            "meanwhile (503 until it serves)", leaving, exc)

    def _answers_new(self) -> bool:
        """Whether new requests would be answered now, a drain aside (read under the leaving mark's lock): here
        always; an HTTP worker whose engine is gone or silent answers them 503 (app/link/client.py)."""
        return True

    def deadline_limit_s(self, request_timeout_s: float) -> float:
        """The longest deadline a request admitted now may have: ``request_timeout_s``, or during a drain that must
        end sooner (``begin_drain``'s ``within_s``) what is left of it, so that its answer (a 504 at worst) comes
        before its worker is stopped; NotReady (503, the connection closing) once less than DRAIN_LEAST_DEADLINE_S
        is left."""
        ends = self._drain_ends
        if ends is None:
            return request_timeout_s
        left_s = ends - time.monotonic()
        if left_s < min(DRAIN_LEAST_DEADLINE_S, request_timeout_s):
            raise not_ready(DRAINING, close=True)
        return min(request_timeout_s, left_s)

    def stop_serving(self) -> None:
        """The drain's window is over: new requests are answered 503 (``require_ready``), and the leaving mark goes.
        Never raises."""
        if not self.draining:
            self.begin_drain()
        with self._leaving_lock:
            self._refusing.set()
            self._remove_leaving_mark()

    @property
    def loading_mark(self) -> Path | None:
        """Beside the ready mark: the file saying this worker still loads (CONTROL_DIR's http-<pid>.loading, written
        after its fork by gunicorn.conf.py's post_fork), or None without a ready mark."""
        return None if self.ready_mark is None else control.loading_mark(self.ready_mark.parent, os.getpid())

    def _remove_ready_mark(self) -> None:
        self._remove_mark(self.ready_mark, "; the other workers take this worker for one that serves while it is "
                                           "there (a drain goes on all the same)")

    def _remove_leaving_mark(self) -> None:
        self._remove_mark(self.leaving_mark, "")

    @staticmethod
    def _remove_mark(mark: Path | None, left: str | None) -> None:
        """``mark`` removed where this process has one; a failure warned of, with what it ``left`` (None: quietly,
        the master removes it when the worker ends). Never raises."""
        if mark is None:
            return
        try:
            mark.unlink(missing_ok=True)
        except OSError as exc:
            if left is not None:
                log.warning("could not remove the %s mark %s: %s%s", mark.suffix.lstrip("."), mark, exc, left)

    def _serving_now(self) -> None:
        """The first models serve (or the engine was reached): the ready mark made, unless a drain began (one that
        began meanwhile takes it away again). A mark that cannot be written leaves this worker serving: the others
        then hold back new connections longer (until they serve), readiness waits for it in process mode, and
        ``_keep_ready_mark`` writes it again. The first failure is warned of, the next ones until a write succeeds
        are at debug."""
        if self.ready_mark is None or self.draining:
            return
        self._remove_mark(self.loading_mark, None)
        try:
            self.ready_mark.touch()
        except OSError as exc:
            log.log(logging.DEBUG if self._mark_unwritten else logging.WARNING, "could not write the ready mark %s: %s "
                    "(tried again while this worker serves)", self.ready_mark, exc)
            self._mark_unwritten = True
            return
        if self._mark_unwritten:
            log.info("wrote the ready mark %s", self.ready_mark)
            self._mark_unwritten = False
        if self.draining:  # began between the look and the touch: its look and unlink may have come first
            self._mark_leaving()
            self._remove_ready_mark()

    def _keep_ready_mark(self) -> None:
        """The ready mark written again where it is missing while this process serves and is not draining (a write
        that failed: CONTROL_DIR full during a HUP). Called on a path that follows this process's state anyway (the
        engine's reports, the link's watch of its engine); a stat when the mark is there. Never raises."""
        if self.ready_mark is None or not self._started.is_set() or self.draining:
            return
        try:
            missing = not self.ready_mark.exists()
        except OSError:  # the directory cannot be looked into: the touch says why
            missing = True
        if missing:
            self._serving_now()

    def _drain_begun(self) -> None:
        """What else a drain turns off (a gauge)."""

    def wait_drained(self, min_s: float, max_s: float, answer_on: Callable[[], bool] | None = None) -> bool:
        """After begin_drain: wait ``min_s``, then until no admitted request is left unanswered, ``max_s`` at most.

        The server keeps its listener open meanwhile, so nothing waits unanswered in the listen backlog: for
        ``min_s`` new requests are answered as before (each with Connection: close), and on while ``answer_on`` says
        so (a HUP's new worker still loading: ``_answer_on``), as long as that leaves ``min_s``, and
        ANSWER_ON_LEAVES_S at least, for what is admitted last, then 503 (``stop_serving``). Returns whether every
        request finished in time.
        """
        started = time.monotonic()
        time.sleep(min(min_s, max_s))
        if answer_on is not None:
            self._answer_on(started, max_s - max(min_s, ANSWER_ON_LEAVES_S), answer_on)
        self.stop_serving()
        return self.in_flight.wait_empty(max(0.0, max_s - (time.monotonic() - started)), poll_s=0.05)

    @staticmethod
    def _answer_on(started: float, last_s: float, answer_on: Callable[[], bool]) -> None:
        """``wait_drained``'s answering past its window: while ``answer_on`` says so, then ANSWER_ON_SETTLE_S more
        (the requests on connections it took before the new worker served), until ``last_s`` after ``started``;
        looked at for ANSWER_ON_FIRST_LOOK_S at least (a HUP's new worker writes its loading mark just after its
        fork, which may come just after the old worker's SIGTERM)."""
        told = False
        while (elapsed := time.monotonic() - started) < last_s:
            if answer_on():
                if not told:
                    told = True
                    log.info("draining: a new worker is still loading and none serves; answering on until one does "
                             "(%.1f s at most)", last_s - elapsed)
            elif told:  # the new worker serves: what this one took before it did is answered too
                time.sleep(min(ANSWER_ON_SETTLE_S, last_s - elapsed))
                return
            elif elapsed >= ANSWER_ON_FIRST_LOOK_S:
                return
            time.sleep(ANSWER_ON_POLL_S)

    def wait_loaded(self, timeout_s: float) -> None:
        """Wait for the first models (``timeout_s`` at most), then as ``require_loaded``: a repository call reaching
        a process that is still starting waits for it instead of failing."""
        self._started.wait(timeout_s)
        self.require_loaded()

    def require_loaded(self) -> None:
        """NotReady (503 with Retry-After) while the first models load."""
        if not self._started.is_set():
            raise not_ready("the model is still loading")

    def require_ready(self) -> None:
        """NotReady (503 with Retry-After) unless new work can be accepted."""
        if self.refusing:  # the client should go elsewhere: this connection will not serve it again
            raise not_ready(DRAINING, close=True)
        self.require_loaded()
        self._require_serving()

    def _require_serving(self) -> None:
        """What else must hold before a request is admitted (the engine: its batchers run)."""
