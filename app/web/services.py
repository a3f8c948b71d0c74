"""How routes reach the engine: the one accessor for the service, and a watch on the request's connection."""
from __future__ import annotations

import select
import socket
from typing import TYPE_CHECKING, Callable

from flask import current_app, request

from app import EXTENSION_KEY

if TYPE_CHECKING:  # the engine's Service, or app/remote_engine.py's RemoteService: the same face
    from app.engine.service import Service


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


def client_gone() -> Callable[[], bool] | None:
    """For ``Call.infer``: whether this request's client has hung up (under gunicorn, which hands over the socket;
    None elsewhere)."""
    sock = request.environ.get("gunicorn.socket")
    return _client_gone(sock) if isinstance(sock, socket.socket) else None
