"""The web layer: everything HTTP that is not one protocol's, registered once by ``init_app``.

Request-wide hooks (request id, body timeout, API key, metrics, access log), error rendering, the health,
metrics and OpenAPI routes, and the one accessor through which protocols reach the engine's service.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

from flask import Flask

from app import EXTENSION_KEY
from app.config import Settings
from app.web.connection import CloseWhenAsked
from app.web.cors import register_cors
from app.web.errors import register_error_handlers
from app.web.hooks import register_hooks
from app.web.ops import register_ops
from app.web.protocol import Protocol
from app.web.services import current_service
from app.web.tracing import register_tracing

if TYPE_CHECKING:  # the engine's Service, or app/link/client.py's RemoteService
    from app.engine.contract import ServiceFace

__all__ = ["ServingApp", "current_service", "init_app"]

SYNC_LOOKS_KEPT = 1024  # views, hooks and handlers whose ``ensure_sync`` is kept (those an app registers: a few dozen)


class ServingApp(Flask):
    """The service's Flask app: it asks once of each view, hook and error handler whether it is a coroutine function
    (``ensure_sync``, which Flask's documentation says to override to change how views run), where Flask asks
    ``inspect`` at every call, three a request here."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sync: dict[Callable[..., Any], Callable[..., Any]] = {}

    def ensure_sync(self, func: Callable[..., Any]) -> Callable[..., Any]:
        try:
            return self._sync[func]
        except KeyError:
            made = super().ensure_sync(func)
            if len(self._sync) < SYNC_LOOKS_KEPT:
                self._sync[func] = made
            return made
        except TypeError:  # (a callable that cannot be a key)
            return super().ensure_sync(func)



def init_app(app: Flask, settings: Settings, service: ServiceFace, protocols: Sequence[Protocol]) -> None:
    """Attach ``service`` to ``app`` and register the hooks, error handlers, ops routes and each protocol."""
    # werkzeug refuses a larger body with 413 from its Content-Length, before reading it.
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.extensions[EXTENSION_KEY] = service
    app.wsgi_app = CloseWhenAsked(app.wsgi_app)  # type: ignore[method-assign]
    # one before hook: the id and access-log fields, then a CORS preflight's answer, then the limit and the key
    register_hooks(app, settings, preflight=register_cors(app, settings))
    # on, its hook goes first whenever registered, so a request the one above refuses is traced; off, none
    register_tracing(app, settings)
    register_error_handlers(app, protocols, settings.client_body_timeout_s)
    register_ops(app, protocols)
    for protocol in protocols:
        app.register_blueprint(protocol.blueprint)
