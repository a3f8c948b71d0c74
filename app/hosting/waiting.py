"""How the HTTP side waits for a socket (the engine's answer, room to send): ``wait_for``.

A request thread polls. A request an HTTP worker runs on its event loop as a greenlet (app/hosting/loop_requests.py,
``LOOP_REQUESTS``) hands the wait to that loop, which goes on with its other requests and resumes this one when the
socket is ready or the time is up: no thread sleeps and no thread is woken for it. The worker installs its loop's
``wait`` with ``wait_on``; anywhere else (a request thread, the engine-wait thread, the engine, a test) that ``wait``
declines (None) and the caller polls.

Standard library only: the gunicorn master imports the worker, which imports this.
"""
from __future__ import annotations

import select
import socket
from typing import Callable, Optional

Waiter = Callable[[socket.socket, int, float, bool], Optional[bool]]

_loop_wait: Waiter | None = None


def wait_on(loop_wait: Waiter | None) -> None:
    """Hand the waits of the requests ``loop_wait`` runs to it (None: every wait polls)."""
    global _loop_wait
    _loop_wait = loop_wait


def wait_for(sock: socket.socket, events: int, timeout_s: float, for_client: bool = False) -> bool:
    """Whether ``sock`` shows ``events`` (select.POLLIN and the like) within ``timeout_s``; ``for_client``: a wait
    for the client to read its answer (a loop request then leaves its slot to the next)."""
    if _loop_wait is not None and timeout_s > 0:
        ready = _loop_wait(sock, events, timeout_s, for_client)
        if ready is not None:
            return ready
    poller = select.poll()  # poll: no limit on the descriptor's number
    poller.register(sock, events)
    return bool(poller.poll(max(0, int(timeout_s * 1000))))
