"""How the HTTP side waits for a socket (the engine's answer, room to send): ``wait_for``.

A request thread polls. A request an HTTP worker runs on its event loop as a greenlet (app/hosting/loop_requests.py,
``LOOP_REQUESTS``) hands the wait to that loop, which goes on with its other requests and resumes this one when the
socket is ready or the time is up: no thread sleeps and no thread is woken for it. The worker installs its loop's
``wait`` with ``wait_on``; anywhere else (a request thread, the engine-wait thread, the engine, a test) that ``wait``
declines (None) and the caller polls. ``on_loop`` gives a loop request the rest of what its loop offers (``OnLoop``:
an event to wait on, a socket watched for as long as it is open, work before the loop's next wait), so the requests of
one loop can share a connection (app/link/loop_link.py).

Standard library only: the gunicorn master imports the worker, which imports this.
"""
from __future__ import annotations

import select
import socket
from typing import Any, Callable, Optional, Protocol


class Event(Protocol):
    """Set once, from the loop's thread; waited for by the loop request that made it."""

    def set(self) -> None: ...

    def wait(self, timeout_s: float) -> bool: ...


class OnLoop(Protocol):
    """A worker's event loop as its loop requests use it (app/hosting/loop_requests.py's ``LoopRequests``)."""

    def loop_wait(self, sock: socket.socket, events: int, timeout_s: float,
                  for_client: bool = False) -> Optional[bool]: ...

    def in_loop_request(self) -> bool: ...

    def event(self) -> Event: ...

    def watch(self, sock: socket.socket, on_readable: Callable[[], None]) -> None: ...

    def unwatch(self, sock: socket.socket) -> None: ...

    def before_wait(self, work: Callable[[], Any]) -> None: ...


_loop: OnLoop | None = None


def wait_on(loop: OnLoop | None) -> None:
    """Hand the waits of the requests ``loop`` runs to it (None: every wait polls)."""
    global _loop
    _loop = loop


def on_loop() -> OnLoop | None:
    """The loop the caller runs on as a loop request, else None (a thread, the loop's own greenlet)."""
    loop = _loop
    return loop if loop is not None and loop.in_loop_request() else None


def wait_for(sock: socket.socket, events: int, timeout_s: float, for_client: bool = False) -> bool:
    """Whether ``sock`` shows ``events`` (select.POLLIN and the like) within ``timeout_s``; ``for_client``: a wait
    for the client to read its answer (a loop request then leaves its slot to the next)."""
    if _loop is not None and timeout_s > 0:
        ready = _loop.loop_wait(sock, events, timeout_s, for_client)
        if ready is not None:
            return ready
    poller = select.poll()  # poll: no limit on the descriptor's number
    poller.register(sock, events)
    return bool(poller.poll(max(0, int(timeout_s * 1000))))
