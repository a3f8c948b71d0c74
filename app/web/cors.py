"""CORS, for a browser front-end on another origin: off unless ``CORS_ORIGINS`` names origins (or ``*``).

A preflight (OPTIONS with Access-Control-Request-Method) is answered here, before the body limit and the API key
check: browsers send it without credentials. An origin not in the list gets no CORS headers, so its browser refuses
the answer.
"""
from __future__ import annotations

from typing import Callable

from flask import Flask, Request, Response, request

from app.config import Settings
from app.hosting.browser_origins import LOOP_ORIGINS, BrowserOrigins, parse_origins

# What it may send: the key, the content type, the request id, the deadline, trace context, a binary V2 request's
# framing (and the CLIENT_KEY_HEADER the settings name, added by register_cors).
ALLOWED_HEADERS = ("Authorization, Content-Type, X-API-Key, X-Request-ID, X-Request-Timeout, traceparent, tracestate, "
                   "Inference-Header-Content-Length")
MAX_AGE_S = 600


def register_cors(app: Flask, settings: Settings) -> Callable[[Request], Response | None] | None:
    """Add CORS headers for the allowed origins, and return what answers a preflight (app/web/hooks.py calls it
    after the request's id is given and before any refusal); nothing at all when ``CORS_ORIGINS`` is empty."""
    browser_origins = BrowserOrigins(parse_origins(settings.cors_origins))
    LOOP_ORIGINS.configure(browser_origins.origins)  # the worker loop's own answers say the same (a 408, a 431)
    if not browser_origins.origins:
        return None
    allowed_headers = f"{ALLOWED_HEADERS}, {settings.client_key_header}"
    allowed = browser_origins.allows

    def preflight(req: Request) -> Response | None:
        if req.method != "OPTIONS" or "Access-Control-Request-Method" not in req.headers:
            return None
        response = Response(status=204)
        del response.headers["Content-Type"]  # no body: not werkzeug's default text/html
        if allowed(req.headers.get("Origin")):
            response.headers.update({"Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                                     "Access-Control-Allow-Headers": allowed_headers,
                                     "Access-Control-Max-Age": str(MAX_AGE_S)})
        return response

    @app.after_request
    def _headers(response: Response) -> Response:
        for name, value in browser_origins.headers(request.headers.get("Origin")).items():
            if name == "Vary":
                response.vary.add(value)
            else:
                response.headers[name] = value
        return response

    return preflight
