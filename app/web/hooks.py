"""Request-wide hooks, registered on the app (not on one blueprint): every route gets them, /v2 and /docs too.

Before: the request id, a body announced over the limit (413), the socket timeout for slow bodies, the API key.
After: the id header, the request metrics and one structured access-log line.
"""
from __future__ import annotations

import logging
import re
import time
import uuid

from flask import Flask, Response, g, request

from app.config import Settings
from app.errors import BodyTooLarge
from app.metrics import PROBES, REJECTED, REQUEST_SECONDS, REQUESTS
from app.web.auth import OPEN_PATHS, check_api_key, is_page, needs_key

access_log = logging.getLogger("visionserve.access")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")


def register_hooks(app: Flask, settings: Settings) -> None:
    """Install the before/after hooks for every request of ``app``."""
    api_key = settings.resolved_api_key()
    body_timeout_s, health_open = settings.client_body_timeout_s, settings.auth_health_open
    max_body_bytes = settings.max_body_bytes

    @app.before_request
    def _start_request() -> None:
        # Keep a caller's id when it is sane, so logs can be joined across services; otherwise make one.
        incoming = request.headers.get("X-Request-ID", "")
        g.request_id = incoming if _REQUEST_ID.match(incoming) else uuid.uuid4().hex
        g.started = time.perf_counter()
        g.log_fields = {}
        if (request.content_length or 0) > max_body_bytes:
            # Announced over the limit: refused here, on every route, before any of it is read (werkzeug's own
            # 413 said "The data value transmitted exceeds the capacity limit.", and only on routes that read).
            raise BodyTooLarge(max_body_bytes)
        sock = request.environ.get("gunicorn.socket")
        if sock is not None:
            # A client that stalls while sending its body gets 408 instead of holding a thread forever.
            sock.settimeout(body_timeout_s)
        if api_key is not None and needs_key(request.path, health_open):
            check_api_key(request.headers, api_key)

    app.after_request(_finish_request)

    if settings.trust_forwarded_for:
        @app.before_request
        def _forwarded_for() -> None:
            g.log_fields["forwarded_for"] = request.headers.get("X-Forwarded-For")


def is_probe(path: str) -> bool:
    """Health probes, scrapes, the API description and the demo page: counted and logged apart from traffic."""
    return path in OPEN_PATHS or is_page(path)


def _finish_request(response: Response) -> Response:
    response.headers["X-Request-ID"] = g.get("request_id", "")
    elapsed = time.perf_counter() - g.get("started", time.perf_counter())
    endpoint = request.url_rule.rule if request.url_rule is not None else "unmatched"
    probe = is_probe(request.path)
    if probe:
        PROBES.labels(endpoint, str(response.status_code)).inc()
    else:
        REQUESTS.labels(endpoint, str(response.status_code)).inc()
        REQUEST_SECONDS.labels(endpoint).observe(elapsed)
    code = g.get("error_code")
    if response.status_code in (429, 503) and code and not probe:
        REJECTED.labels(code).inc()
    fields = {"request_id": g.get("request_id"), "client": request.remote_addr, "method": request.method,
              "route": endpoint,
              "status": response.status_code, "error": code, "duration_ms": round(elapsed * 1000, 2),
              **g.get("log_fields", {})}
    access_log.log(logging.DEBUG if probe else logging.INFO, "request", extra=fields)
    return response
