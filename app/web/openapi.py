"""The OpenAPI 3.1 document, generated from the pydantic models the routes answer with (one source of truth).

The web layer's own routes are described here; each protocol brings its paths and models (``Protocol``), built
with the helpers below.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from app import __version__
from app.hosting.request_framing import REQUEST_ID
from app.web.auth import is_health, is_page
from app.web.protocol import Protocol
from app.web.schemas import ErrorResponse, HealthResponse
from models.export.repository import NAME_PATTERN

REF = "#/components/schemas/{model}"
NAME_SCHEMA = {"type": "string", "pattern": f"^{NAME_PATTERN}$"}  # a model's or version's name (400 outside it)

_HEADERS: dict[str, dict[str, Any]] = {
    "X-Request-ID": {"description": "The caller's request id when it sent a sane one (1 to 128 of the ASCII "
                                    "letters, digits and ._:@/+=-), else a new one; also in the access log",
                     "schema": {"type": "string"}},
    "Retry-After": {"description": "Seconds to wait before retrying (429 from the backlog and batch latency; 503)",
                    "schema": {"type": "integer", "minimum": 1}},
    "Server-Timing": {"description": "decode, queue and inference durations (ms) and the batch sizes",
                      "schema": {"type": "string"}},
    "X-Batch-Size": {"description": "The size of the forward pass each image ran in", "schema": {"type": "string"}},
    "Inference-Header-Content-Length": {"description": "Length of the JSON header when binary tensors follow",
                                        "schema": {"type": "integer"}},
    "WWW-Authenticate": {"description": "How to present the API key: Bearer", "schema": {"type": "string"}},
    "Allow": {"description": "The methods the path takes", "schema": {"type": "string"}},
    "Content-Range": {"description": "The bytes answered, of how many (a Range request)",
                      "schema": {"type": "string"}},
    "X-Explained-Class": {"description": "The class explained, its label URL-encoded", "schema": {"type": "string"}},
    "X-Explained-Index": {"description": "The class explained, its index", "schema": {"type": "integer"}},
    "X-Explained-Score": {"description": "The class's probability", "schema": {"type": "string"}},
    "X-Model-Version": {"description": "The model version that answered", "schema": {"type": "string"}},
}

# Status -> description of every error status a data route can answer.
ERROR_STATUSES = {
    "400": "Malformed request: bad image, JSON, base64, tensor shape or parameter",
    "401": "Missing or wrong API key (when one is configured)",
    "403": "A control call this client may not make here (CONTROL_API: local, the default, answers clients on the "
           "server's machine alone; off, none); the message says how to make it",
    "404": "No such model or version",
    "408": "No byte of the body came for client_body_timeout_s, or came slower than client_body_min_rate",
    "409": "The call does not apply to the model now: no rollout candidate to promote, no previous default",
    "413": "Body, image pixels or image count over its limit (an announced body over max_body_bytes on any route)",
    "415": "Unsupported content type or image format",
    "416": "The Range (one of bytes: another unit, or several ranges, are ignored) is malformed or asks for bytes "
           "the file does not have",
    "422": "JSON that does not match the request schema, or a model version that cannot be served (load_failed)",
    "429": "Overloaded (queue full) or the backlog already exceeds the request's deadline",
    "500": "The forward pass failed",
    "503": "Not ready yet, or shutting down",
    "504": "No result within the request's deadline (or, for a repository call, another worker has not applied "
           "it yet)",
    "507": "A model version would not fit in memory beside the loaded ones",
}


# Every operation takes it (app/web/hooks.py): the caller's id, kept where it is sane, said back in the answer's
REQUEST_ID_HEADER = {"name": "X-Request-ID", "in": "header", "required": False,
                     "schema": {"type": "string", "pattern": "^" + REQUEST_ID.pattern.removesuffix(r"\Z") + "$"},
                     "description": "The caller's id for this request, said back in the answer's X-Request-ID and "
                                    "logged (one that does not match the pattern is replaced by a new one)"}


def ref(model: type[BaseModel]) -> dict[str, str]:
    """A reference to ``model``'s schema in the components."""
    return {"$ref": REF.format(model=model.__name__)}


def headers(*names: str) -> dict[str, Any]:
    """References to the named response headers (X-Request-ID is on every answer)."""
    return {name: {"$ref": f"#/components/headers/{name}"} for name in ("X-Request-ID", *names)}


def json_answer(model: type[BaseModel], description: str, *names: str) -> dict[str, Any]:
    """A JSON response of ``model`` with the named headers."""
    return {"description": description, "headers": headers(*names),
            "content": {"application/json": {"schema": ref(model)}}}


def errors(model: type[BaseModel], statuses: str) -> dict[str, Any]:
    """The error responses for the space-separated ``statuses``, in ``model``'s shape."""
    out = {}
    for status in statuses.split():
        extra = _ERROR_HEADERS.get(status, ())
        out[status] = json_answer(model, ERROR_STATUSES[status], *extra)
    return out


_TOO_MANY_CONNECTIONS = ("the client holds MAX_CONNECTIONS_PER_CLIENT connections to this worker already (answered "
                         "by the worker before the app, the connection closing)")
_HEALTH_UNAUTHORIZED = "Missing or wrong API key (when one is configured and AUTH_HEALTH_OPEN is off)"
_STARTING = ("Not ready: the worker is still starting (its first seconds after a start or a reload, while it imports "
             "the app, every path but the health probes answers so; app/hosting/starting.py)")
_ERROR_HEADERS = {"401": ("WWW-Authenticate",), "429": ("Retry-After",), "503": ("Retry-After",)}
_METHODS = frozenset({"get", "put", "post", "delete", "options", "head", "patch", "trace"})


def request_wide(paths: dict[str, Any], model: type[BaseModel], operation_ids: Mapping[str, str]) -> dict[str, Any]:
    """``paths`` with what is answered on every route added to each operation, in ``model``'s shape: by
    app/web/hooks.py 401 (but on the pages, which are open; on the health paths only when AUTH_HEALTH_OPEN is off)
    and 413 (a body announced over the limit, refused before it is read); by a worker's loop, 408 (a body announced
    on any route, a GET's too, that does not come in time); by a worker, 429 with Retry-After to a
    client over MAX_CONNECTIONS_PER_CLIENT, and 503 with Retry-After while it starts (an operation's own 429 or
    503, where it has one, says its other reasons too). And what every operation takes: its ``operation_ids``
    (``"METHOD /path"``: the name a generated client gives its function; KeyError for an operation not named) and
    the caller's X-Request-ID."""
    for path, item in paths.items():
        for method in _METHODS & item.keys():
            item[method]["operationId"] = operation_ids[f"{method.upper()} {path}"]
            item[method]["parameters"] = [*item[method].get("parameters", []), REQUEST_ID_HEADER]
            responses = item[method]["responses"]
            if not is_page(path):
                unauthorized = errors(model, "401")["401"]
                if is_health(path):
                    unauthorized["description"] = _HEALTH_UNAUTHORIZED
                responses.setdefault("401", unauthorized)
            responses.setdefault("413", errors(model, "413")["413"])
            responses.setdefault("408", errors(model, "408")["408"])
            if "429" in responses:
                responses["429"]["description"] += f"; or {_TOO_MANY_CONNECTIONS}"
            else:
                crowded = errors(model, "429")["429"]
                crowded["description"] = _TOO_MANY_CONNECTIONS[0].upper() + _TOO_MANY_CONNECTIONS[1:]
                responses["429"] = crowded
            if "503" not in responses:
                starting = errors(model, "503")["503"]
                starting["description"] = _STARTING
                responses["503"] = starting
    return paths


def health(model: type[BaseModel], summary: str, error_model: type[BaseModel] = HealthResponse) -> dict[str, Any]:
    """A GET answering 200 when the check holds and 503 when it does not."""
    return {"get": {"summary": summary,
                    "responses": {"200": json_answer(model, "Yes"), "503": json_answer(error_model, "No")}}}


TIMEOUT_HEADER = {"name": "X-Request-Timeout", "in": "header", "required": False,
                  "description": "This request's deadline in ms, capped by request_timeout_s; one under "
                                 "min_request_timeout_ms (1 by default) is 400 deadline_too_short",
                  "schema": {"type": "number", "exclusiveMinimum": 0}}
# contentMediaType is OAS 3.1's way to say "a file"; Swagger UI shows a file picker for array items only with
# format: binary (swagger-ui issue 10825), so both are given.
BINARY = {"type": "string", "format": "binary", "contentMediaType": "application/octet-stream"}

_DESCRIPTION = (
    'Image classification with dynamic batching. Errors outside /v2 have the shape '
    '{"error": {"code", "message", "request_id"}}; /v2 errors are {"error": "<message>"}.\n\n'
    'Besides each operation\'s own statuses: a path the server does not have answers 404 and a method a path does '
    'not take 405 with `Allow` (components/responses NotFound and MethodNotAllowed), once the body limit (413) '
    'and the API key (401), checked first on every path, let it through. HEAD is answered for every GET as the GET, '
    'without a body; OPTIONS for every path 204 with its `Allow` (with CORS_ORIGINS set, a preflight 204 with the CORS '
    'headers). A request head the server cannot take is refused before any route: 400 (malformed), 408 (not '
    'complete within client_header_timeout_s), 414 (request line too long), 431 (head over max_header_bytes), '
    '417 (an Expect other than 100-continue), 501 (a Transfer-Encoding other than chunked: RFC 9112 6.1), 403 (a '
    'PROXY protocol line from an address not in gunicorn\'s proxy_allow_ips).')


def _refusal(description: str, *names: str) -> dict[str, Any]:
    """A response no operation holds (a path the server does not have, a method a path does not take), in either
    error shape: the default one, or, under /v2, the Open Inference Protocol's."""
    shape = {"oneOf": [ref(ErrorResponse),
                       {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}}]}
    return {"description": description, "headers": headers(*names),
            "content": {"application/json": {"schema": shape}}}


_REFUSALS = {"NotFound": _refusal("No such path (404)"),
             "MethodNotAllowed": _refusal("The path does not take this method (405); Allow lists those it does",
                                          "Allow")}


def _static_file(summary: str, description: str, media_type: str) -> dict[str, Any]:
    """A file the server sends as it is (conditional and Range requests answered: 206, 304, 416)."""
    content = {media_type: {"schema": {"type": "string"}}}
    return {"get": {"summary": summary, "responses": {
        "200": {"description": description, "headers": headers(), "content": content},
        "206": {"description": "The part of it a Range asked for", "headers": headers("Content-Range"),
                "content": content},
        "304": {"description": "Not modified since the copy the request names (If-None-Match, If-Modified-Since)",
                "headers": headers()},
        **errors(ErrorResponse, "416")}}}


def _ops_paths() -> dict[str, Any]:
    return request_wide({
        "/healthz": health(HealthResponse, "Liveness: the process and its inference thread"),
        "/readyz": health(HealthResponse, "Readiness: warmed up, canary passed, not draining"),
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {
            "description": "Text exposition format", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/openapi.json": {"get": {"summary": "This document", "responses": {"200": {
            "description": "OpenAPI 3.1", "content": {"application/json": {"schema": {"type": "object"}}}}}}},
        "/": _static_file("The demo page: pick or drop photos and see their classes",
                          "HTML (its script and style under /demo/)", "text/html"),
        "/favicon.ico": _static_file("The site's icon, for every browser's tab", "An SVG image", "image/svg+xml"),
    }, ErrorResponse, {"GET /healthz": "liveness", "GET /readyz": "readiness", "GET /metrics": "metrics",
                       "GET /openapi.json": "openapi_document", "GET /": "demo_page", "GET /favicon.ico": "favicon"})


def _drop_null_defaults(schema: Any) -> None:
    """``"default": null`` taken out of every schema in ``schema`` (pydantic writes it for each optional field): a
    field left out of ``required`` says it may be absent, where a default made code generators (openapi-typescript)
    type it as always there, and a request without it as incomplete (a web developer's trial)."""
    if isinstance(schema, dict):
        if "default" in schema and schema["default"] is None:
            del schema["default"]
        for value in schema.values():
            _drop_null_defaults(value)
    elif isinstance(schema, list):
        for value in schema:
            _drop_null_defaults(value)


def openapi_document(protocols: Sequence[Protocol]) -> dict[str, Any]:
    """The whole document: the web layer's routes and every protocol's; path parameters declared per path."""
    models = [ErrorResponse, HealthResponse, *(m for p in protocols for m in p.openapi_models)]
    _, defs = models_json_schema([(m, "serialization") for m in models], ref_template=REF)
    _drop_null_defaults(defs)
    paths: dict[str, Any] = {}
    for protocol in protocols:
        paths.update(protocol.openapi_paths())
    paths.update(_ops_paths())
    for path, item in paths.items():
        names = [part[1:-1] for part in path.split("/") if part.startswith("{")]
        if names:
            item["parameters"] = [{"name": n, "in": "path", "required": True,
                                   "schema": {**NAME_SCHEMA} if n in ("name", "version") else {"type": "string"}}
                                  for n in names]
    return {
        "openapi": "3.1.0",
        "info": {"title": "visionserve", "version": __version__, "description": _DESCRIPTION},
        "paths": paths,
        "components": {"schemas": defs["$defs"], "headers": _HEADERS, "responses": _REFUSALS,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                           "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"}}},
        # Either key form when VISIONSERVE_API_KEY is set; nothing when it is not.
        "security": [{}, {"bearer": []}, {"apiKey": []}],
    }
