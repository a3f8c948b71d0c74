"""The web layer: everything HTTP that is not one protocol's, registered once by ``init_app``.

Request-wide hooks (request id, body timeout, API key, metrics, access log), error rendering, the health,
metrics and OpenAPI routes, and the one accessor through which protocols reach the engine's service.
"""
from __future__ import annotations

from types import CodeType, FunctionType, MethodType
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


class ServingApp(Flask):
    """The service's Flask app: it asks once of each view's, hook's and error handler's code whether it is a
    coroutine function (``ensure_sync``, which Flask's documentation says to override to change how views run), where
    Flask asks ``inspect`` at every call, three a request here. Kept by code object, which a plain function's (or a
    method's) answer depends on alone: as many as the app's source has, holding no function, closure or instance
    that a request made; any other callable is asked as Flask asks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sync_code: dict[CodeType, bool] = {}  # each code object: whether its functions run as they are

    def ensure_sync(self, func: Callable[..., Any]) -> Callable[..., Any]:
        code = getattr(func, "__code__", None) if type(func) in _PLAIN_CALLABLES else None
        if code is None or hasattr(func, "_is_coroutine_marker"):  # (Python 3.12's inspect.markcoroutinefunction)
            return super().ensure_sync(func)
        sync = self._sync_code.get(code)
        if sync is None:
            made = super().ensure_sync(func)
            sync = self._sync_code[code] = made is func
            return made
        return func if sync else super().ensure_sync(func)


_PLAIN_CALLABLES = (FunctionType, MethodType)  # whose coroutine-ness is their code's (inspect.iscoroutinefunction)


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
