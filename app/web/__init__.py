"""The web layer: everything HTTP that is not one protocol's, registered once by ``init_app``.

Request-wide hooks (request id, body timeout, API key, metrics, access log), error rendering, the health,
metrics and OpenAPI routes, and the one accessor through which protocols reach the engine's service.
"""
from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING, Sequence

from flask import Flask

from app import EXTENSION_KEY
from app.config import Settings
from app.hosting.recent_refusals import RECENT
from app.web.auth import carries_key, key_forms
from app.web.compression import register_compression
from app.web.connection import CloseWhenAsked
from app.web.cors import register_cors
from app.web.errors import register_error_handlers
from app.web.hooks import options_answer, register_hooks
from app.web.ops import register_ops
from app.web.protocol import Protocol
from app.web.services import current_service
from app.web.tracing import register_tracing

if TYPE_CHECKING:  # the engine's Service, or app/link/client.py's RemoteService
    from app.engine.contract import ServiceFace

__all__ = ["current_service", "init_app"]

log = logging.getLogger(__name__)


def init_app(app: Flask, settings: Settings, service: ServiceFace, protocols: Sequence[Protocol]) -> None:
    """Attach ``service`` to ``app`` and register the hooks, error handlers, ops routes and each protocol."""
    # werkzeug refuses a larger body with 413 from its Content-Length, before reading it.
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.json.sort_keys = False  # type: ignore[attr-defined]
    # //predict or /demo//x: a 404, not werkzeug's 308 (an HTML body, its Location built from the request's Host)
    app.url_map.merge_slashes = False
    app.make_default_options_response = options_answer  # type: ignore[method-assign]  # 204, its Allow sorted
    app.extensions[EXTENSION_KEY] = service
    app.wsgi_app = CloseWhenAsked(app.wsgi_app, lambda: service.draining)  # type: ignore[method-assign]
    # one before hook: the id and access-log fields, then a CORS preflight's answer, then the limit and the key
    api_key = settings.resolved_api_key()  # once: an empty one's warning said once
    register_hooks(app, settings, api_key, preflight=register_cors(app, settings))
    register_compression(app, settings)  # a JSON or text answer compressed when the request takes it
    # on, its hook goes first whenever registered, so a request the one above refuses is traced; off, none
    register_tracing(app, settings)
    register_error_handlers(app, protocols, settings.client_body_timeout_s)
    # what the worker refuses itself, before the app, after the engine refused a request of that route for its backlog
    if settings.control_api == "open" and api_key is None:
        log.warning("CONTROL_API=open and no API key: any client that reaches this server may load, unload, promote "
                    "and roll back its models; set VISIONSERVE_API_KEY, or leave CONTROL_API local")
    RECENT.configure(settings.refusal_memory_ms / 1000, settings.request_timeout_s, settings.max_images,
                     None if api_key is None else partial(carries_key, forms=key_forms(api_key)),
                     settings.trust_forwarded_for, settings.min_request_timeout_ms)
    register_ops(app, protocols)
    for protocol in protocols:
        app.register_blueprint(protocol.blueprint)
