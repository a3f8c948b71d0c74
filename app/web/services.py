"""How routes reach the engine: the one accessor for the service, and ``serve`` to run a request through it."""
from __future__ import annotations

import select
import socket
from typing import Callable, TypeVar

from flask import current_app, request

from app import EXTENSION_KEY
from app.engine.loaded_version import LoadedVersion
from app.engine.service import Job, Served, Service

P = TypeVar("P")


def current_service() -> Service:
    """The service of the app handling this request."""
    return current_app.extensions[EXTENSION_KEY]


def _client_gone(sock: socket.socket) -> Callable[[], bool]:
    def gone() -> bool:
        # select first: the socket carries the body timeout, so a bare recv would wait for data. A closed
        # connection is readable and reads as b""; a live one has nothing to read, or already a next request.
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
        except (ConnectionResetError, BrokenPipeError):
            return True
        except (OSError, ValueError):  # anything else: assume the client is still there
            return False

    return gone


def serve(service: Service, read: Callable[[LoadedVersion], Job[P]], name: str | None = None,
          version: str | None = None) -> Served[P]:
    """``service.run`` for this request on model ``name`` (None: the only one) at ``version`` (None: its default),
    watching the request's connection (under gunicorn) while its images wait."""
    sock = request.environ.get("gunicorn.socket")
    return service.run(read, _client_gone(sock) if isinstance(sock, socket.socket) else None, name, version)
