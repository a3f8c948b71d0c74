"""Requests an HTTP worker runs on its event loop's own thread, as greenlets (``LOOP_REQUESTS``, ENGINE=process).

A request the loop read whole starts on the loop (``run_on_loop``) and runs until it waits: every wait of the HTTP
side goes through app/hosting/waiting.py, which the worker points at ``loop_wait``, so the request's socket (its
engine connection, or its client's while its answer is written) is watched by the loop's poller with a deadline and
the loop runs on; ``_step`` resumes the request when the socket is ready or its time is up. At most THREADS of them
run at once (the rest wait their turn, read and not parsed); a request waiting for its client to read its answer
gives its slot to the next. One that ends is settled (gthread's ``finish_request``: keep-alive, a pipelined next
request) after the one that started it, never inside it.

Beyond a socket's wait, a loop request may wait for a ``LoopEvent`` that code on the loop sets (an answer read for
it on a connection the loop's requests share), have a socket watched while it stays open (``watch``: that shared
connection's answers), and leave work to run before the loop's next wait (``before_wait``: what the requests of
this turn gave it, sent together once all of them ran).

``LoopRequests`` is the worker's part that does this (app/hosting/worker.py's ``BufferingWorker`` inherits it): it
uses the worker's poller, its ``cfg.threads``, ``_handle_one`` and ``finish_request``. Standard library, gunicorn's
worker (through the class that inherits it) and greenlet only: the gunicorn master imports it.
"""
from __future__ import annotations

import contextlib
import heapq
import itertools
import select
import selectors
import socket
import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

from greenlet import GreenletExit, getcurrent, greenlet


class LoopRequest(greenlet):
    """A request the worker runs on its event loop's thread: it waits by handing its socket to the loop. It holds
    one of THREADS slots until it ends or first waits to write its answer (a client that stops reading then holds
    its connection, not a slot). The greenlet outlives its request: once settled it waits, idle, to run the next
    (``LoopRequests._idle``): a new greenlet's first Python frame maps a fresh 16 KiB frame stack and its end unmaps
    it, a system call and page faults each request on a VM."""

    conn: Any  # gthread's TConn
    outcome: "Outcome"
    holds_slot = True
    running = False  # its request runs (or waits); False once it ended, until the next starts


class Outcome:
    """How a loop request's ``_handle_one`` ended, as gthread's ``finish_request`` reads a request thread's future
    (``result``, ``cancelled``, ``exception``): what it returned, or what it raised. A Future's lock and condition
    are for a result another thread waits for; this one is read on the loop, once it is there."""

    __slots__ = ("value", "error")

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error

    def result(self) -> Any:
        if self.error is not None:
            try:
                raise self.error
            finally:  # as a Future does: the error's traceback holds this frame, which would hold the error
                self = None  # type: ignore[assignment]  # noqa: PLW0642
        return self.value

    def exception(self) -> BaseException | None:
        return self.error

    def cancelled(self) -> bool:
        return False


def _resumed_already(_ready: bool) -> None:
    """A finished wait's resume (its entry may stay in the deadline heap until its deadline)."""


@dataclass(eq=False)
class LoopWait:
    """A loop request's wait for a socket: ``resume`` once, with True when the socket is ready, False when its time
    is up (whichever comes first)."""
    resume: Callable[[bool], None]
    done: bool = False

    def ready(self, _fileobj: Any = None) -> None:
        if not self.done:
            self.done = True
            self.resume(True)

    def expire(self) -> None:
        if not self.done:
            self.done = True
            self.resume(False)


class LoopEvent:
    """What a loop request waits for (``wait``) until code on the loop's thread sets it (``set``): set from the loop's
    greenlet, the request runs on at once; from another loop request's greenlet, once that one waits (a request
    switched to from another would never return to it). Set before the wait, the wait returns at once."""

    def __init__(self, loop: "LoopRequests", request: "LoopRequest") -> None:
        self._loop, self._request = loop, request
        self.is_set = False
        self._wait: LoopWait | None = None

    def set(self) -> None:
        if self.is_set:
            return
        self.is_set = True
        wait = self._wait
        if wait is not None:
            if getcurrent() is self._loop.loop_greenlet:
                wait.ready()
            else:
                self._loop.before_wait(wait.ready)

    def wait(self, timeout_s: float) -> bool:
        """Whether it was set within ``timeout_s``; the loop serves its other requests meanwhile."""
        if self.is_set:
            return True
        wait = self._wait = LoopWait(partial(self._loop._step, self._request))
        try:
            return self._loop.parked(wait, timeout_s)
        finally:
            self._wait = None


class LoopRequests:
    """The worker's loop requests: queued, started, resumed from their waits and settled (see the module's
    docstring). ``init_loop_requests`` before the loop runs."""

    poller: Any  # the worker's (gthread's) selector; and it calls the worker's _handle_one and finish_request
    cfg: Any
    loop_greenlet: greenlet | None = None

    def init_loop_requests(self) -> None:
        self.loop_greenlet = getcurrent()
        self.waits: list[tuple[float, int, LoopWait]] = []  # the loop requests' waits, a heap by deadline
        self._wait_order = itertools.count()
        self.loop_queue: deque[Any] = deque()  # connections whose request waits for room (at most THREADS run)
        self.loop_running = 0
        self._ended: deque[LoopRequest] = deque()  # loop requests that ended, to settle
        self._idle: list[LoopRequest] = []  # greenlets whose request was settled, each to run a next one
        self._settling = False
        self._before_wait: list[Callable[[], Any]] = []  # to run before the loop's next wait

    def run_on_loop(self, conn: Any) -> None:
        """Run ``conn``'s request on the loop up to its first wait, once fewer than THREADS loop requests run (as
        many as the request threads would: the engine gets no more connections than before); until then it waits
        its turn, read and not yet parsed."""
        self.loop_queue.append(conn)
        self._run_loop_requests()

    def _run_loop_requests(self) -> None:
        """Settle the loop requests that ended (gthread's ``finish_request``: the connection kept alive, or the next
        request pipelined on it started) and start queued ones while there is room, one after another: a request
        that ends at once never settles inside another's settling (600 pipelined requests nested 600 deep)."""
        if self._settling:
            return  # the outer call goes on with whatever this one queued or ended
        self._settling = True
        try:
            while True:
                if self._ended:
                    request = self._ended.popleft()
                    self._free_slot(request)
                    self.finish_request(request.conn, request.outcome)
                    self._keep_idle(request)
                elif self.loop_queue and self.loop_running < self.cfg.threads:
                    self.loop_running += 1
                    request = self._idle.pop() if self._idle else LoopRequest(self._run_on_loop,
                                                                              parent=self.loop_greenlet)
                    request.conn, request.holds_slot, request.running = self.loop_queue.popleft(), True, True
                    self._switch(request)
                else:
                    return
        finally:
            self._settling = False

    def _free_slot(self, request: LoopRequest) -> None:
        if request.holds_slot:
            request.holds_slot = False
            self.loop_running -= 1

    def _keep_idle(self, request: LoopRequest) -> None:
        """A settled request's greenlet kept to run a next one (up to THREADS idle; the rest end when dropped)."""
        del request.conn, request.outcome
        if not request.dead and len(self._idle) < self.cfg.threads:
            self._idle.append(request)

    def _run_on_loop(self) -> None:
        """A loop request's greenlet: its request, then, once settled and started again, the next one's. Idle, its
        frame holds no reference to itself: one ``_keep_idle`` drops is freed (a paused greenlet is never collected
        as part of a cycle), and ends with GreenletExit."""
        while True:
            request: LoopRequest = getcurrent()  # type: ignore[assignment]
            try:
                request.outcome = Outcome(self._handle_one(request.conn))  # no linger: the loop reads the next one
            except BaseException as exc:  # noqa: BLE001 - gthread's handle caught what it handles; the rest is told
                request.outcome = Outcome(error=exc)
                if isinstance(exc, GreenletExit):  # the greenlet is being thrown away (the worker's end)
                    return
            request.running = False
            del request
            self.loop_greenlet.switch()  # type: ignore[union-attr] # ended: idle until its next request starts

    def _switch(self, request: LoopRequest, *resumed: Any) -> None:
        """On the loop's greenlet: ``request`` runs on from where it waits until it waits again or ends."""
        request.switch(*resumed)
        if not request.running or request.dead:
            request.running = False
            self._ended.append(request)

    def _step(self, request: LoopRequest, *resumed: Any) -> None:
        """A wait of ``request`` is over (its socket ready, or its time up): it runs on, then what it ended is
        settled."""
        self._switch(request, *resumed)
        self._run_loop_requests()

    def loop_wait(self, sock: socket.socket, events: int, timeout_s: float, for_client: bool = False) -> bool | None:
        """``waiting.wait_for`` in a loop request: the socket watched by the loop and a deadline, then the loop's
        greenlet runs on; True once the socket is ready, False when the time is up. A wait ``for_client`` (to write
        its answer) gives the request's slot to the next. None (the caller polls) on any other greenlet or
        thread."""
        if not self.in_loop_request():
            return None
        request: LoopRequest = getcurrent()  # type: ignore[assignment]
        mask = ((selectors.EVENT_READ if events & select.POLLIN else 0)
                | (selectors.EVENT_WRITE if events & select.POLLOUT else 0))
        if for_client:  # its answer waits for the client to read: the slot goes to the next request
            self._free_slot(request)
        wait = LoopWait(partial(self._step, request))
        self.poller.register(sock, mask, wait.ready)
        try:
            return self.parked(wait, timeout_s)
        finally:
            self.poller.unregister(sock)

    def parked(self, wait: LoopWait, timeout_s: float) -> bool:
        """The calling loop request waits on the loop's greenlet until ``wait`` resumes it (ready: True) or its
        ``timeout_s`` is up (False)."""
        heapq.heappush(self.waits, (time.monotonic() + timeout_s, next(self._wait_order), wait))
        try:
            return self.loop_greenlet.switch()  # type: ignore[union-attr]
        finally:
            wait.done, wait.resume = True, _resumed_already  # the heap keeps no ended request alive

    def in_loop_request(self) -> bool:
        """Whether the caller is one of this loop's requests."""
        return isinstance(getcurrent(), LoopRequest) and self.loop_greenlet is not None

    def event(self) -> LoopEvent:
        """An event the calling loop request can wait for."""
        request = getcurrent()
        assert isinstance(request, LoopRequest), "an event is a loop request's"
        return LoopEvent(self, request)

    def watch(self, sock: socket.socket, on_readable: Callable[[], None]) -> None:
        """``on_readable`` called on the loop's greenlet whenever ``sock`` is readable, until ``unwatch``."""
        self.poller.register(sock, selectors.EVENT_READ, lambda _fileobj: on_readable())

    def unwatch(self, sock: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.poller.unregister(sock)

    def before_wait(self, work: Callable[[], Any]) -> None:
        """``work`` run on the loop's greenlet before it next waits for events (after what is ready now ran)."""
        self._before_wait.append(work)

    def wait_for_and_dispatch_events(self, timeout: float) -> None:
        """gthread's turn, waking no later than the first loop request's deadline; then the waits whose time is up
        resume (False). First, what was left to run before the wait (it may leave more)."""
        while self._before_wait:
            work, self._before_wait = self._before_wait, []
            for step in work:
                step()
        waits = self.waits
        while waits and waits[0][2].done:
            heapq.heappop(waits)
        if waits:
            timeout = min(timeout, max(0.0, waits[0][0] - time.monotonic()))
        super().wait_for_and_dispatch_events(timeout)
        now = time.monotonic()
        while waits and (waits[0][2].done or waits[0][0] <= now):
            heapq.heappop(waits)[2].expire()
