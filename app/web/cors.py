"""CORS, for a browser front-end on another origin: off unless ``CORS_ORIGINS`` names origins (or ``*``).

A preflight (OPTIONS with Access-Control-Request-Method) is answered here, before the body limit and the API key
check: browsers send it without credentials. An origin not in the list gets no CORS headers, so its browser refuses
the answer.
"""
from __future__ import annotations

from typing import Callable

from flask import Flask, Request, Response, request

from app.config import Settings

# What a browser's script may read of an answer: the timings, the request id, the retry hint, an explanation's class
# (the PNG's headers), the version that answered it, and a binary V2 answer's framing.
EXPOSED = ("Server-Timing, X-Request-ID, X-Batch-Size, Retry-After, X-Explained-Class, X-Explained-Index, "
           "X-Explained-Score, X-Model-Version, Inference-Header-Content-Length")
# What it may send: the key, the content type, the request id, the deadline, trace context, a binary V2 request's
# framing (and the CLIENT_KEY_HEADER the settings name, added by register_cors).
ALLOWED_HEADERS = ("Authorization, Content-Type, X-API-Key, X-Request-ID, X-Request-Timeout, traceparent, tracestate, "
                   "Inference-Header-Content-Length")
MAX_AGE_S = 600


def parse_origins(setting: str) -> frozenset[str]:
    """``https://a.example, https://b.example`` or ``*``; empty means off."""
    return frozenset(origin.strip().rstrip("/") for origin in setting.split(",") if origin.strip())


def register_cors(app: Flask, settings: Settings) -> Callable[[Request], Response | None] | None:
    """Add CORS headers for the allowed origins, and return what answers a preflight (app/web/hooks.py calls it
    after the request's id is given and before any refusal); nothing at all when ``CORS_ORIGINS`` is empty."""
    origins = parse_origins(settings.cors_origins)
    if not origins:
        return None
    allowed_headers = f"{ALLOWED_HEADERS}, {settings.client_key_header}"

    def allowed(origin: str | None) -> bool:
        return origin is not None and ("*" in origins or origin in origins)

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
        origin = request.headers.get("Origin")
        if origin is not None and allowed(origin):
            response.headers["Access-Control-Allow-Origin"] = "*" if "*" in origins else origin
            response.headers["Access-Control-Expose-Headers"] = EXPOSED
        response.vary.add("Origin")
        return response

    return preflight
