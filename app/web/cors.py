"""CORS, for a browser front-end on another origin: off unless ``CORS_ORIGINS`` names origins (or ``*``).

A preflight (OPTIONS with Access-Control-Request-Method) is answered here, before the API key check: browsers send
it without credentials. An origin not in the list gets no CORS headers, so its browser refuses the answer.
"""
from __future__ import annotations

from flask import Flask, Response, request

EXPOSED = "Server-Timing, X-Request-ID, X-Batch-Size, Retry-After"
ALLOWED_HEADERS = "Authorization, Content-Type, X-API-Key, X-Request-ID, X-Request-Timeout, traceparent"
MAX_AGE_S = 600


def parse_origins(setting: str) -> frozenset[str]:
    """``https://a.example, https://b.example`` or ``*``; empty means off."""
    return frozenset(origin.strip().rstrip("/") for origin in setting.split(",") if origin.strip())


def register_cors(app: Flask, setting: str) -> None:
    """Answer preflights and add CORS headers for the allowed origins; nothing at all when ``setting`` is empty."""
    origins = parse_origins(setting)
    if not origins:
        return

    def allowed(origin: str | None) -> bool:
        return origin is not None and ("*" in origins or origin in origins)

    @app.before_request
    def _preflight() -> Response | None:
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
            return None
        response = Response(status=204)
        if allowed(request.headers.get("Origin")):
            response.headers.update({"Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                                     "Access-Control-Allow-Headers": ALLOWED_HEADERS,
                                     "Access-Control-Max-Age": str(MAX_AGE_S)})
        return response

    @app.after_request
    def _headers(response: Response) -> Response:
        origin = request.headers.get("Origin")
        if allowed(origin):
            response.headers["Access-Control-Allow-Origin"] = "*" if "*" in origins else origin  # type: ignore[assignment]
            response.headers["Access-Control-Expose-Headers"] = EXPOSED
        response.vary.add("Origin")
        return response
