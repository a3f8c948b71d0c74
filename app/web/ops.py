"""Routes for probes, scrapers, readers of the API and people: /healthz, /readyz, /metrics, /openapi.json, /docs,
and the demo page at /."""
from __future__ import annotations

import contextlib
import os
from functools import lru_cache
from typing import Any, Sequence

from flask import Blueprint, Flask, Response, jsonify, request
from flask_swagger_ui import get_swaggerui_blueprint

from app.errors import ServiceError
from app.hosting import control
from app.metrics import render as render_metrics
from app.web.auth import DOCS_PATH, OPENAPI_PATH
from app.web.demo import demo_blueprint
from app.web.openapi import openapi_document
from app.web.protocol import Protocol
from app.web.schemas import HealthResponse
from app.web.services import current_service


def _health(ok: bool, checks: dict[str, bool], good: str, bad: str, reason: str | None) -> tuple[Response, int]:
    # ``reason`` (why it fails, for a person reading the probe's answer) only when there is one
    body = HealthResponse(status=good if ok else bad, checks=checks, reason=reason).model_dump(exclude_none=True)
    return jsonify(body), 200 if ok else 503


def healthz() -> tuple[Response, int]:
    """Liveness: the process answers, its batcher threads run and no batch has run past STALL_S (or its model is
    still loading); ``reason`` names a stuck batch's version and how long it has run."""
    service = current_service()
    stalled = service.stalled
    alive = service.alive and stalled is None  # (a batch may pass STALL_S between the two readings)
    return _health(alive, {"batcher_thread": alive}, "alive", "dead", stalled)


def readyz() -> tuple[Response, int]:
    """Readiness: model loaded, every batch shape warmed up, canary passed, no batch past STALL_S (``reason`` names
    it), not draining; not ready for a reason none of the checks says (an engine that does not answer, another
    worker behind the port not serving yet): ``reason`` says it."""
    service = current_service()
    ready, loaded, alive, stalled = service.ready, service.loaded, service.alive, service.stalled
    checks = {"model_loaded": loaded, "warmed_up": loaded,  # warm-up and canary are part of loading
              "batcher_thread": alive and stalled is None,  # as /healthz says it: none dead (a loading one counts)
              "not_draining": not service.draining,  # a drain answers new requests for SHUTDOWN_DRAIN_S
              "accepting": not service.refusing}  # then refuses them
    ok = ready and stalled is None
    if not ok and loaded and alive and stalled is None and _answers_for_a_reload(service):
        return _health(True, checks, "ready", "not_ready", None)
    return _health(ok, checks, "ready", "not_ready", stalled or (None if ok else service.not_ready_reason))


def _answers_for_a_reload(service: Any) -> bool:
    """A HUP's old worker, draining, that answers on while a new worker loads and none other serves
    (app/hosting/drain.py): the server serves through it, so readiness holds (before: 503 for the whole reload,
    an inline worker's load of 16 s, which would take a serving pod out of its Service: an operator's trial).
    A stop has no new worker loading: its drain says not ready from its first moment, as before."""
    control_dir = service.settings.control_dir
    return (service.draining and not service.refusing and control_dir is not None
            and control.replacement_loading(control_dir, os.getpid()))


def metrics() -> Response:
    """Prometheus text exposition, every request answered before the scrape counted in it: the figures its
    worker's versions hold (METRICS_FLUSH_MS) are written first. An engine that cannot be asked at once (loading,
    restarting, silent) leaves them as last written; the other engines' and workers' are at most METRICS_FLUSH_MS
    and the batch running then behind."""
    with contextlib.suppress(ServiceError):
        current_service().catalog.settle_figures()
    body, content_type = render_metrics()
    return Response(body, content_type=content_type)


def register_ops(app: Flask, protocols: Sequence[Protocol]) -> None:
    """Register the ops routes, the OpenAPI document of ``protocols`` and Swagger UI on ``app``."""
    ops = Blueprint("ops", __name__)
    ops.get("/healthz")(healthz)
    ops.get("/readyz")(readyz)
    ops.get("/metrics")(metrics)

    @lru_cache(maxsize=1)
    def document() -> dict[str, Any]:
        return openapi_document(protocols)

    @ops.get(OPENAPI_PATH)
    def openapi() -> Response:
        """The OpenAPI 3.1 description of every endpoint (rendered at /docs)."""
        return jsonify(document())

    app.register_blueprint(ops)
    app.register_blueprint(demo_blueprint())
    # Swagger UI's files ship inside flask-swagger-ui: /docs works offline.
    docs = get_swaggerui_blueprint(DOCS_PATH, OPENAPI_PATH, config={"app_name": "visionserve"})
    docs.add_url_rule("", "moved", _to_the_docs_page)  # /docs: before werkzeug's redirect, named for the Host header
    app.register_blueprint(docs)


def _to_the_docs_page() -> Response:
    """/docs to /docs/ (the page's own files are relative to it), by a Location relative to this server: werkzeug's
    slash redirect wrote it absolute from the request's Host, which a client sets (``Host: evil.example`` sent the
    next request there: a cache in front would keep it; a security review), in an HTML body."""
    query = request.query_string.decode("latin-1")
    moved = Response(status=308, headers={"Location": f"{DOCS_PATH}/" + (f"?{query}" if query else "")})
    del moved.headers["Content-Type"]  # no body
    return moved
