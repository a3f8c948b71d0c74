"""Request-wide hooks, registered on the app (not on one blueprint): every route gets them, /v2 and /docs too.

Before, in one hook: the request id, the clock and the access log's fields (a trusted X-Forwarded-For among them),
then a CORS preflight's answer, then a body announced over the limit (413), the socket timeout for slow bodies, the
API key. After: the id header, the request metrics (probes and CORS preflights apart from traffic) and one
structured access-log line.
"""
from __future__ import annotations

import logging
import re
import time
from typing import Any, Callable

from flask import Flask, Request, Response, current_app, g, request
from flask.globals import request_ctx
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from app.config import Settings
from app.errors import BodyTooLarge
from app.hosting.request_framing import request_id_of
from app.logs import ACCESS_LOGGER
from app.metrics import PREFLIGHTS, PROBES, REJECTED, REQUEST_SECONDS, REQUESTS, series
from app.web.auth import check_api_key, is_health, is_page, key_forms, needs_key

access_log = logging.getLogger(ACCESS_LOGGER)
_ONE_BYTE_RANGE = re.compile(r"\s*bytes\s*=[^,]*\Z", re.IGNORECASE)  # what werkzeug's files answer 206 or 416 to

def register_hooks(app: Flask, settings: Settings, api_key: str | None,
                   preflight: Callable[[Request], Response | None] | None = None) -> None:
    """One before hook for every request of ``app``, in this order: its id, its start time and its access-log fields
    (a trusted X-Forwarded-For among them), so every answer has them; a CORS ``preflight``'s answer (app/web/cors.py),
    before any refusal; then the refusals: an announced body over the limit, the body's socket timeout, the API
    key; then a Range werkzeug's files would refuse for its unit or its several ranges dropped. And the after hook
    that sends the id and writes the log line. One hook, not one per step: Flask checks and calls each hook of every
    request."""
    trust_forwarded_for = settings.trust_forwarded_for
    forms = None if api_key is None else key_forms(api_key)
    body_timeout_s, health_open = settings.client_body_timeout_s, settings.auth_health_open
    max_body_bytes = settings.max_body_bytes

    @app.before_request
    def _start_request() -> Response | None:
        req, context = request._get_current_object(), g._get_current_object()  # not a proxy lookup per field
        context.request_id = request_id_of(req.headers.get("X-Request-ID"))  # a caller's kept when sane
        # its wait in the worker before the app began (a burst beyond THREADS) counts in its time (the histogram,
        # the access line, Server-Timing's wait): from when the worker's loop had it whole (client_socket.py)
        context.arrived = arrived = received_at(req.environ)
        context.waited_s = 0.0 if arrived is None else max(0.0, time.monotonic() - arrived)
        context.started = time.perf_counter() - context.waited_s
        fields = context.log_fields = context.get("log_fields", {})  # a trace's ids (app/web/tracing.py) first
        if trust_forwarded_for:
            fields["forwarded_for"] = req.headers.get("X-Forwarded-For")
        if preflight is not None and (answer := preflight(req)) is not None:
            context.preflight = True  # counted apart from traffic (_finish_request)
            return answer
        if (req.content_length or 0) > max_body_bytes:
            # Announced over the limit: refused here, on every route, before any of it is read (werkzeug's own
            # 413 said "The data value transmitted exceeds the capacity limit.", and only on routes that read).
            raise BodyTooLarge(max_body_bytes)
        sock = req.environ.get("gunicorn.socket")
        if sock is not None and not getattr(sock, "body_held", False):
            # A client that stalls while sending its body gets 408 instead of holding a thread forever (a body the
            # worker's loop read whole needs no read of the socket, and its answer is written without a timeout
            # that would block: app/hosting/client_socket.py's ClientSocket).
            sock.settimeout(body_timeout_s)
        if forms is not None and needs_key(req.path, health_open):
            check_api_key(req.headers, forms)
        if "HTTP_RANGE" in req.environ and not _ONE_BYTE_RANGE.match(req.environ["HTTP_RANGE"]):
            # another unit (RFC 9110 14.2: an origin server must ignore it), or several ranges (it may): the whole
            # file, where werkzeug answered 416 (the pages' files, /docs's)
            del req.environ["HTTP_RANGE"]
        return None

    app.after_request(_finish_request)


def options_answer() -> Response:
    """OPTIONS on a path (not a CORS preflight: cors.py answers those), in Flask's place: 204 with the methods the
    path takes in ``Allow``, in one order (werkzeug's come in a set's, which changes from one server start to the
    next), and no body nor content type (Flask's was a 200 saying text/html)."""
    response = Response(status=204)
    del response.headers["Content-Type"]
    response.headers["Allow"] = ", ".join(sorted(request_ctx.url_adapter.allowed_methods()))  # type: ignore[union-attr]
    return response


def received_at(environ: dict[str, Any]) -> float | None:
    """When the worker's loop had the request whole (a ``time.monotonic()``, app/hosting/client_socket.py), or None
    where no such worker handed it over (a test client, gunicorn's own worker)."""
    return getattr(environ.get("gunicorn.socket"), "received_at", None)


def is_probe(path: str) -> bool:
    """Health probes, scrapes, the API description and the demo page: counted and logged apart from traffic."""
    return is_health(path) or is_page(path)


def _route_refusing(req: Request) -> str:
    """The route of a request no rule took: the one whose path it matched when only its method was not allowed
    (a 405 counts under its route, as a 400 does), else ``unmatched`` (a 404)."""
    refused = req.routing_exception
    if isinstance(refused, MethodNotAllowed) and refused.valid_methods:
        try:
            rule, _ = current_app.url_map.bind_to_environ(req.environ).match(method=refused.valid_methods[0],
                                                                             return_rule=True)
            return rule.rule
        except HTTPException:
            pass
    return "unmatched"


def _finish_request(response: Response) -> Response:
    req, context = request._get_current_object(), g._get_current_object()
    request_id = getattr(context, "request_id", "")
    response.headers["X-Request-ID"] = request_id
    elapsed = time.perf_counter() - getattr(context, "started", time.perf_counter())
    endpoint = req.url_rule.rule if req.url_rule is not None else _route_refusing(req)
    status = response.status_code
    probe = is_probe(req.path)
    if probe:
        series(PROBES, endpoint, str(status)).inc()
    elif status == 204 and getattr(context, "preflight", False):  # a CORS preflight (cors.py answers 204): not
        series(PREFLIGHTS, endpoint, "204").inc()  # traffic, kept out of the alerts' ratios and the latency
    else:
        series(REQUESTS, endpoint, str(status)).inc()
        series(REQUEST_SECONDS, endpoint).observe(elapsed)
    code = getattr(context, "error_code", None)
    if status in (429, 503) and code and not probe:
        REJECTED.labels(code).inc()
    level = logging.DEBUG if probe else logging.INFO
    if access_log.isEnabledFor(level):
        access_log.log(level, "request", extra={
            "request_id": request_id or None, "client": req.remote_addr, "method": req.method, "route": endpoint,
            "status": status, "error": code, "duration_ms": round(elapsed * 1000, 2),
            **getattr(context, "log_fields", {})})
    return response
