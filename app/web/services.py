"""How routes reach the engine: the one accessor for the service, and a watch on the request's connection."""
from __future__ import annotations

import functools
import socket
import time
from typing import Callable

from flask import current_app, g, request

from app import EXTENSION_KEY
from app.engine.contract import ServiceFace
from app.errors import DeadlinePassedBeforeQueue
from app.link.wire import peer_closed


def current_service() -> ServiceFace:
    """The service of the app handling this request: the engine's ``Service`` in this worker, or the link's
    ``RemoteService`` (ENGINE=process)."""
    return current_app.extensions[EXTENSION_KEY]


def arrival(timeout_s: float) -> float | None:
    """For ``Call.infer``: when this request's worker had it whole (``time.monotonic()``; under gunicorn, from the
    socket it hands over; None elsewhere, or for a body the parser read): its deadline of ``timeout_s`` counts from
    there. DeadlinePassedBeforeQueue when it passed already (its wait for a request thread): refused before anything
    of it is admitted or parsed, and counted as the server's capacity, not a version's failure."""
    arrived = g.get("arrived")  # (read off the socket as the request began: app/web/hooks.py)
    if arrived is not None and (waited := time.monotonic() - arrived) >= timeout_s:
        raise DeadlinePassedBeforeQueue.in_its_worker(timeout_s, waited)
    return arrived


def client_gone() -> Callable[[], bool] | None:
    """For ``Call.infer``: whether this request's client has hung up (under gunicorn, which hands over the socket;
    None elsewhere)."""
    sock = request.environ.get("gunicorn.socket")
    return functools.partial(peer_closed, sock) if isinstance(sock, socket.socket) else None
