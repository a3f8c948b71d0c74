"""Error rendering, in one place: every exception a request can raise becomes one JSON answer.

The default shape is {"error": {"code", "message", "request_id"[, "details"]}}; a protocol may bring its own
(the Open Inference Protocol's {"error": "<message>"}), chosen by the blueprint that served the request, or for a
request no route matched, by the protocol whose URL prefix it falls under.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Sequence

from flask import Flask, Response, current_app, g, jsonify, request
from gunicorn.http.errors import InvalidResponseHeader, InvalidResponseHeaderName, ParseException
from werkzeug.exceptions import ClientDisconnected, HTTPException, MethodNotAllowed, NotFound, RequestEntityTooLarge

from app.errors import ClientGone, MalformedBody, RequestTimeout, ServiceError, default_body
from app.hosting.recent_refusals import RECENT
from app.web.protocol import Protocol

log = logging.getLogger(__name__)


def _from_http(exc: HTTPException) -> ServiceError:
    """werkzeug's exception as a ServiceError: its status, name as code, and its own headers (the Allow of a 405,
    which RFC 9110 requires) but for the HTML Content-Type, as the answer is JSON."""
    headers = {name: value for name, value in exc.get_headers() if name.lower() != "content-type"}
    if isinstance(exc, MethodNotAllowed) and exc.valid_methods:  # in one order (werkzeug's: a set's, per start)
        headers["Allow"] = ", ".join(sorted(exc.valid_methods))
    # A body refused before it was read to its end must not stay on a kept-alive connection.
    if isinstance(exc, RequestEntityTooLarge):
        headers["Connection"] = "close"
    error = ServiceError(_said(exc), headers=headers)
    error.status = exc.code or 500
    error.code = exc.name.lower().replace(" ", "_")
    return error


def _said(exc: HTTPException) -> str:
    """What werkzeug's answer says, in the request's terms where its text is generic: a path the server does not
    have (and the route it likely meant: the same without a trailing slash), a method the path does not take."""
    if isinstance(exc, NotFound) and request:
        meant = request.path.rstrip("/")
        hint = ""
        if meant != request.path and meant:
            with contextlib.suppress(HTTPException):
                current_app.url_map.bind("").match(meant, method=request.method)
                hint = f" (without the trailing slash: {meant})"
        return f"no such path: {request.path}{hint}; the routes are in /openapi.json (and /docs)"
    if isinstance(exc, MethodNotAllowed) and request and exc.valid_methods:
        return (f"{request.method} is not allowed on {request.path}; it takes "
                f"{', '.join(sorted(set(exc.valid_methods) - {'HEAD', 'OPTIONS'}) or exc.valid_methods)}")
    return exc.description or exc.name


def from_disconnect(exc: ClientDisconnected, body_timeout_s: float) -> ServiceError:
    """A body read that failed: the socket timeout the hooks set is the slow client's 408; a connection that ended
    or was reset mid-body is the client's leaving (499, ClientGone), not a bad request. ``read_body`` raises it where
    the read fails, so that an admitted request's outcome is the client's, not its version's failure."""
    # werkzeug reports every failed body read as a disconnect, with what the server's stream raised as its context.
    cause = exc.__context__
    if isinstance(cause, TimeoutError):
        return RequestTimeout(f"no byte of the body came for {body_timeout_s:g}s (CLIENT_BODY_TIMEOUT_S)",
                              headers={"Connection": "close"})
    # gunicorn's NoMoreData (the connection ended mid-chunk) and a reset are OSErrors; a body that ended short of
    # its Content-Length has no cause at all
    if cause is None or isinstance(cause, OSError):
        return ClientGone("the client closed the connection before its body ended", headers={"Connection": "close"})
    return _from_http(exc)


def _from_framing(exc: ParseException) -> ServiceError | None:
    """gunicorn's refusal of a body's framing, raised as the app reads it (a chunk size that is no number, a chunk
    without its CRLF, a bad chunk extension or trailer): the client's fault, 400; where the next request would
    start is unknown, so the connection closes. None for a header the app sent (its own fault: a 500)."""
    if isinstance(exc, (InvalidResponseHeader, InvalidResponseHeaderName)):
        return None
    return MalformedBody(f"the request body's framing is malformed: {exc}", headers={"Connection": "close"})


def register_error_handlers(app: Flask, protocols: Sequence[Protocol], body_timeout_s: float) -> None:
    """Route every exception the app can raise to one renderer."""
    by_blueprint = {p.blueprint.name: p for p in protocols}

    def render(error: ServiceError, unmatched: bool = False) -> Response:
        g.error_code = error.code  # for the access log and the rejection counter
        # no route matched: the protocol under whose prefix the path is, or whose unserved part it is (V1 has none)
        protocol = by_blueprint.get(request.blueprint or "") or next(
            (p for p in protocols if p.owns(request.path) or p.unserved and p.unserved(request.path)), None)
        shape = protocol.error_body if protocol is not None and protocol.error_body else default_body
        # the router's 404 or 405 for a path of what is not served (a route that took it for a model's name refused
        # it, or another method); the metadata route's 404 for an extension's path: its own reason said too
        as_name = (not unmatched and error.status == 404 and request.url_rule is not None
                   and "<name>" in request.url_rule.rule and request.view_args.get("name") == "stats")
        why = (protocol.unserved(request.path) if protocol and protocol.unserved and error.status in (404, 405)
               else None)
        if why is not None:
            error = ServiceError(f"{why}. As a model's name: {error.message}" if as_name else why,
                                 headers={k: v for k, v in error.headers.items() if k != "Allow"})
            error.status, error.code = 404, "not_found"
        response = jsonify(shape(error, g.get("request_id")))
        response.status_code = error.status
        response.headers.update(error.headers)
        backlog = getattr(error, "backlog", None)
        if backlog is not None:  # the engine's backlog refused this route: its worker's loop refuses its like
            environ = request.environ  # (the target as sent: gunicorn's RAW_URI, werkzeug's test client's too)
            RECENT.remember(environ.get("RAW_URI") or request.full_path, backlog, error.headers.get("Retry-After"))
        return response

    def unexpected(exc: Exception) -> Response:
        log.exception("unhandled error", extra={"request_id": g.get("request_id")})
        return render(ServiceError("internal server error"))

    def framing(exc: ParseException) -> Response:
        error = _from_framing(exc)
        return unexpected(exc) if error is None else render(error)

    app.register_error_handler(ServiceError, render)
    app.register_error_handler(ClientDisconnected, lambda exc: render(from_disconnect(exc, body_timeout_s)))
    app.register_error_handler(HTTPException, lambda exc: render(_from_http(exc), unmatched=exc.code == 404))
    app.register_error_handler(ParseException, framing)
    app.register_error_handler(Exception, unexpected)
