"""How routes reach the engine: the one accessor for the service, and a watch on the request's connection."""
from __future__ import annotations

import functools
import socket
from typing import Callable

from flask import current_app, request

from app import EXTENSION_KEY
from app.engine.contract import ServiceFace
from app.link.wire import peer_closed


def current_service() -> ServiceFace:
    """The service of the app handling this request: the engine's ``Service`` in this worker, or the link's
    ``RemoteService`` (ENGINE=process)."""
    return current_app.extensions[EXTENSION_KEY]


def client_gone() -> Callable[[], bool] | None:
    """For ``Call.infer``: whether this request's client has hung up (under gunicorn, which hands over the socket;
    None elsewhere)."""
    sock = request.environ.get("gunicorn.socket")
    return functools.partial(peer_closed, sock) if isinstance(sock, socket.socket) else None
