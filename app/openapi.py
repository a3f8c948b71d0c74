"""The OpenAPI 3.1 document, generated from the pydantic models the routes answer with (one source of truth)."""
from __future__ import annotations

from functools import lru_cache
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from app import __version__
from app import schemas as s
from app import v2_schemas as v2

REF = "#/components/schemas/{model}"
_MODELS: list[type[BaseModel]] = [
    s.PredictJSONRequest, s.PredictResponse, s.ErrorResponse, s.HealthResponse, s.ModelsResponse,
    v2.ServerMetadata, v2.Live, v2.Ready, v2.ModelReady, v2.ModelMetadata, v2.InferRequest, v2.InferResponse,
    v2.Error,
]

_HEADERS: dict[str, dict[str, Any]] = {
    "X-Request-ID": {"description": "The caller's request id when it sent a sane one, else a new one; also in "
                                    "the access log", "schema": {"type": "string"}},
    "Retry-After": {"description": "Seconds to wait before retrying (429 from the backlog and batch latency; 503)",
                    "schema": {"type": "integer", "minimum": 1}},
    "Server-Timing": {"description": "decode, queue and inference durations (ms) and the batch sizes",
                      "schema": {"type": "string"}},
    "X-Batch-Size": {"description": "The size of the forward pass each image ran in", "schema": {"type": "string"}},
    "Inference-Header-Content-Length": {"description": "Length of the JSON header when binary tensors follow",
                                        "schema": {"type": "integer"}},
}

# Status -> description of every error status a data route can answer.
_ERRORS = {
    "400": "Malformed request: bad image, JSON, base64, tensor shape or parameter",
    "401": "Missing or wrong API key (when one is configured)",
    "404": "No such model or version",
    "408": "The body did not arrive within client_body_timeout_s",
    "413": "Body, image pixels or image count over its limit",
    "415": "Unsupported content type or image format",
    "422": "JSON that does not match the request schema",
    "429": "Overloaded (queue full) or the backlog already exceeds the request's deadline",
    "500": "The forward pass failed",
    "503": "Not ready yet, or shutting down",
    "504": "No result within the request's deadline",
}


def _ref(model: type[BaseModel]) -> dict[str, str]:
    return {"$ref": REF.format(model=model.__name__)}


def _headers(*names: str) -> dict[str, Any]:
    return {name: {"$ref": f"#/components/headers/{name}"} for name in ("X-Request-ID", *names)}


def _json(model: type[BaseModel], description: str, *headers: str) -> dict[str, Any]:
    return {"description": description, "headers": _headers(*headers),
            "content": {"application/json": {"schema": _ref(model)}}}


def _errors(model: type[BaseModel], statuses: str) -> dict[str, Any]:
    out = {}
    for status in statuses.split():
        extra = ("Retry-After",) if status in ("429", "503") else ()
        out[status] = _json(model, _ERRORS[status], *extra)
    return out


def _health(model: type[BaseModel], summary: str, error_model: type[BaseModel] = s.HealthResponse) -> dict:
    return {"get": {"summary": summary, "responses": {"200": _json(model, "Yes"), "503": _json(error_model, "No")}}}


_TIMEOUT = {"name": "X-Request-Timeout", "in": "header", "required": False,
            "description": "This request's deadline in ms, capped by request_timeout_s", "schema": {"type": "number"}}
_BINARY = {"type": "string", "contentMediaType": "application/octet-stream"}


def _predict() -> dict[str, Any]:
    top_k = {"name": "top_k", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 1}}
    multipart = {"type": "object", "required": ["image"],
                 "properties": {"image": {"type": "array", "items": _BINARY}, "top_k": {"type": "integer"}}}
    return {"post": {
        "summary": "Classify one or more images",
        "description": "Send the images as multipart (repeat the `image` field), as a raw body (image/* or "
                       "application/octet-stream), or as JSON with base64 strings. Answers keep the order sent.",
        "parameters": [top_k, _TIMEOUT],
        "requestBody": {"required": True, "content": {
            "multipart/form-data": {"schema": multipart},
            "image/*": {"schema": _BINARY}, "application/octet-stream": {"schema": _BINARY},
            "application/json": {"schema": _ref(s.PredictJSONRequest)}}},
        "responses": {"200": _json(s.PredictResponse, "One prediction per image", "Server-Timing", "X-Batch-Size"),
                      **_errors(s.ErrorResponse, "400 401 408 413 415 422 429 500 503 504")},
    }}


def _v2_paths() -> dict[str, Any]:
    infer = {"post": {
        "summary": "Open Inference Protocol inference (images as BYTES, or preprocessed pixels as FP32)",
        "parameters": [_TIMEOUT, {"name": "Inference-Header-Content-Length", "in": "header", "required": False,
                                  "schema": {"type": "integer"}, "description": "Set when binary tensors follow"}],
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": _ref(v2.InferRequest)},
            "application/octet-stream": {"schema": {**_BINARY, "description": "JSON header, then binary tensors"}}}},
        "responses": {"200": {"description": "Outputs; binary tensors follow the JSON header when asked for",
                              "headers": _headers("Server-Timing", "X-Batch-Size", "Inference-Header-Content-Length"),
                              "content": {"application/json": {"schema": _ref(v2.InferResponse)},
                                          "application/octet-stream": {"schema": _BINARY}}},
                      **_errors(v2.Error, "400 401 404 408 413 429 500 503 504")},
    }}
    metadata = {"get": {"summary": "Model inputs and outputs",
                        "responses": {"200": _json(v2.ModelMetadata, "Metadata"), **_errors(v2.Error, "404")}}}
    ready = _health(v2.ModelReady, "Model readiness", v2.ModelReady)
    paths = {"/v2": {"get": {"summary": "Server metadata", "responses": {"200": _json(v2.ServerMetadata, "OK")}}},
             "/v2/health/live": _health(v2.Live, "Liveness", v2.Live),
             "/v2/health/ready": _health(v2.Ready, "Readiness", v2.Ready)}
    for base in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        # Copies: each path gets its own path-parameter list below.
        paths.update({base: {**metadata}, f"{base}/ready": {**ready}, f"{base}/infer": {**infer}})
    return paths


_DESCRIPTION = ('Image classification with dynamic batching. Errors outside /v2 have the shape '
                '{"error": {"code", "message", "request_id"}}; /v2 errors are {"error": "<message>"}.')


@lru_cache(maxsize=1)
def openapi_document() -> dict[str, Any]:
    """The whole document; path parameters are declared per path."""
    _, defs = models_json_schema([(m, "serialization") for m in _MODELS], ref_template=REF)
    paths: dict[str, Any] = {
        "/predict": _predict(),
        "/healthz": _health(s.HealthResponse, "Liveness: the process and its inference thread"),
        "/readyz": _health(s.HealthResponse, "Readiness: warmed up, canary passed, not draining"),
        "/v1/models": {"get": {"summary": "The served model, its batching and its limits",
                               "parameters": [{"name": "labels", "in": "query", "required": False,
                                               "schema": {"type": "string", "enum": ["1", "true", "yes"]}}],
                               "responses": {"200": _json(s.ModelsResponse, "The model")}}},
        "/metrics": {"get": {"summary": "Prometheus metrics", "responses": {"200": {
            "description": "Text exposition format", "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/openapi.json": {"get": {"summary": "This document", "responses": {"200": {
            "description": "OpenAPI 3.1", "content": {"application/json": {"schema": {"type": "object"}}}}}}},
        **_v2_paths(),
    }
    for path, item in paths.items():
        names = [part[1:-1] for part in path.split("/") if part.startswith("{")]
        if names:
            item["parameters"] = [{"name": n, "in": "path", "required": True, "schema": {"type": "string"}}
                                  for n in names]
    return {
        "openapi": "3.1.0",
        "info": {"title": "visionserve", "version": __version__, "description": _DESCRIPTION},
        "paths": paths,
        "components": {"schemas": defs["$defs"], "headers": _HEADERS,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                           "apiKey": {"type": "apiKey", "in": "header", "name": "X-API-Key"}}},
        # Either key form when VISIONSERVE_API_KEY is set; nothing when it is not.
        "security": [{}, {"bearer": []}, {"apiKey": []}],
    }
