"""HTTP endpoints: parse the request shape, run the stages, shape the answer."""
from __future__ import annotations

import logging
import re
import time
import uuid

import torch
from flask import Blueprint, Response, current_app, g, jsonify, request
from werkzeug.exceptions import ClientDisconnected

from app.auth import OPENAPI_PATH, check_api_key, needs_key
from app.errors import RequestTimeout
from app.metrics import REJECTED, REQUEST_SECONDS, REQUESTS
from app.metrics import render as render_metrics
from app.openapi import openapi_document
from app.payload import PredictInput, deadline_s, parse_predict
from app.schemas import (Batching, ClassScore, HealthResponse, Limits, ModelInfo, ModelRef, ModelsResponse,
                         Prediction, PredictResponse)
from app.service import EXTENSION_KEY, Service
from app.timing import annotate

log = logging.getLogger(__name__)
access_log = logging.getLogger("visionserve.access")

bp = Blueprint("visionserve", __name__)

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")


def _service() -> Service:
    return current_app.extensions[EXTENSION_KEY]


@bp.before_app_request
def _start_request() -> None:
    # Keep a caller's id when it is sane, so logs can be joined across services; otherwise make one.
    incoming = request.headers.get("X-Request-ID", "")
    g.request_id = incoming if _REQUEST_ID.match(incoming) else uuid.uuid4().hex
    g.started = time.perf_counter()
    g.log_fields = {}
    service = _service()
    sock = request.environ.get("gunicorn.socket")
    if sock is not None:
        # A client that stalls while sending its body gets 408 instead of holding a thread forever.
        sock.settimeout(service.settings.client_body_timeout_s)
    if service.api_key is not None and needs_key(request.path, service.settings.auth_health_open):
        check_api_key(request.headers, service.api_key)


@bp.after_app_request
def _finish_request(response: Response) -> Response:
    response.headers["X-Request-ID"] = g.get("request_id", "")
    elapsed = time.perf_counter() - g.get("started", time.perf_counter())
    endpoint = request.url_rule.rule if request.url_rule is not None else "unmatched"
    REQUESTS.labels(endpoint, str(response.status_code)).inc()
    REQUEST_SECONDS.labels(endpoint).observe(elapsed)
    code = g.get("error_code")
    if response.status_code in (429, 503) and code:
        REJECTED.labels(code).inc()
    access_log.info("request", extra={"request_id": g.get("request_id"), "method": request.method,
                                      "route": endpoint, "status": response.status_code, "error": code,
                                      "duration_ms": round(elapsed * 1000, 2), **g.get("log_fields", {})})
    return response


def _read_request(service: Service) -> PredictInput:
    try:
        return parse_predict(request, default_top_k=service.settings.top_k,
                             num_classes=service.predictor.num_classes, max_images=service.settings.max_images)
    except ClientDisconnected as exc:
        # werkzeug reports every failed body read as a disconnect; the socket timeout set above is the slow case.
        if isinstance(exc.__context__, TimeoutError):
            raise RequestTimeout(f"the body did not arrive within {service.settings.client_body_timeout_s:g}s",
                                 headers={"Connection": "close"}) from None
        raise


def _top_k(row: torch.Tensor, k: int, labels: list[str]) -> Prediction:
    scores, indices = torch.topk(row, k)
    ranked = [ClassScore(label=labels[i], index=i, score=s) for s, i in zip(scores.tolist(), indices.tolist())]
    return Prediction(**ranked[0].model_dump(), top_k=ranked)


@bp.post("/predict")
def predict() -> Response:
    """Classify one or more images."""
    service = _service()
    service.require_ready()
    predictor = service.predictor
    timeout_s = deadline_s(request.headers, service.settings.request_timeout_s)
    with service.arrivals.arriving() as arrived:
        parsed = _read_request(service)
        tensors, decode_s = service.preprocess_all(parsed.images)
        results = service.infer(tensors, timeout_s, arrived)
    body = PredictResponse(model=ModelRef(name=predictor.manifest.name, version=predictor.manifest.version),
                           predictions=[_top_k(r.value, parsed.top_k, predictor.labels) for r in results])
    return annotate(Response(body.model_dump_json(), mimetype="application/json"), decode_s, results)


def _health(ok: bool, checks: dict[str, bool], good: str, bad: str) -> tuple[Response, int]:
    body = HealthResponse(status=good if ok else bad, checks=checks)
    return jsonify(body.model_dump()), 200 if ok else 503


@bp.get("/healthz")
def healthz() -> tuple[Response, int]:
    """Liveness: the process answers and its batcher thread runs. Independent of the model's readiness."""
    alive = _service().batcher.is_alive()
    return _health(alive, {"batcher_thread": alive}, "alive", "dead")


@bp.get("/readyz")
def readyz() -> tuple[Response, int]:
    """Readiness: model loaded, every batch shape warmed up, canary passed, not draining."""
    service = _service()
    checks = {"model_loaded": True, "warmed_up": service.warmed_up,
              "batcher_thread": service.batcher.is_alive(), "accepting": not service.draining}
    return _health(service.ready, checks, "ready", "not_ready")


@bp.get("/metrics")
def metrics() -> Response:
    """Prometheus text exposition."""
    body, content_type = render_metrics()
    return Response(body, content_type=content_type)


@bp.get(OPENAPI_PATH)
def openapi() -> Response:
    """The OpenAPI 3.1 description of every endpoint (rendered at /docs)."""
    return jsonify(openapi_document())


@bp.get("/v1/models")
def models() -> Response:
    """Metadata of the served model, its device and dtype, and the batching settings."""
    service = _service()
    s = service.settings
    show_labels = request.args.get("labels", "").lower() in ("1", "true", "yes")
    info = ModelInfo(
        **service.predictor.info(), labels=service.predictor.labels if show_labels else None, ready=service.ready,
        batching=Batching(max_batch_size=s.max_batch_size, batch_cap=service.batcher.max_batch_size,
                          profile={k: round(v, 1) for k, v in service.batch_profile.items()},
                          max_wait_ms=s.max_wait_ms,
                          current_max_batch_size=service.batcher.current_max_batch_size,
                          queue_size=s.queue_size, queue_depth=service.batcher.depth),
        limits=Limits(max_body_bytes=s.max_body_bytes, max_pixels=s.max_pixels, max_images=s.max_images,
                      max_aspect_ratio=s.max_aspect_ratio, default_top_k=s.top_k,
                      request_timeout_s=s.request_timeout_s))
    body = ModelsResponse(models=[info]).model_dump_json(exclude_none=True)
    return Response(body, mimetype="application/json")
