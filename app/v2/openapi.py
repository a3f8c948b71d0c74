"""The Open Inference Protocol's part of the OpenAPI document."""
from __future__ import annotations

from typing import Any

from app.v2 import schemas as v2
from app.web.openapi import BINARY, TIMEOUT_HEADER, errors, headers, health, json_answer, ref, request_wide

MODELS = (v2.ServerMetadata, v2.Live, v2.Ready, v2.ModelReady, v2.ModelMetadata, v2.ModelConfig, v2.InferRequest,
          v2.InferResponse, v2.Error, v2.RepositoryIndexRequest, v2.RepositoryModel, v2.RepositoryIndex, v2.LoadRequest,
          v2.UnloadRequest, v2.Loaded)


# What an infer call can answer besides 200: the statuses of /predict's, which runs the same admission, decode and
# Call.infer (415: an image format no decoder serves), less 422 (/predict's JSON schema; V2's body has none).
INFER_ERRORS = "400 401 404 408 413 415 429 500 503 504"


def _infer() -> dict[str, Any]:
    framing = {"name": "Inference-Header-Content-Length", "in": "header", "required": False,
               "schema": {"type": "integer"}, "description": "Set when binary tensors follow"}
    return {"post": {
        "summary": "Open Inference Protocol inference (images as BYTES, or preprocessed pixels as FP32)",
        "parameters": [TIMEOUT_HEADER, framing],
        "requestBody": {"required": True, "content": {
            "application/json": {"schema": ref(v2.InferRequest)},
            "application/octet-stream": {"schema": {**BINARY, "description": "JSON header, then binary tensors"}}}},
        "responses": {"200": {"description": "Outputs; binary tensors follow the JSON header when asked for",
                              "headers": headers("Server-Timing", "X-Batch-Size", "Inference-Header-Content-Length"),
                              "content": {"application/json": {"schema": ref(v2.InferResponse)},
                                          "application/octet-stream": {"schema": BINARY}}},
                      **errors(v2.Error, INFER_ERRORS)},
    }}


def _repository() -> dict[str, Any]:
    def call(summary: str, body: type, answer: type, codes: str) -> dict[str, Any]:
        return {"post": {"summary": summary,
                         "requestBody": {"required": False, "content": {"application/json": {"schema": ref(body)}}},
                         "responses": {"200": json_answer(answer, "OK"), **errors(v2.Error, codes)}}}

    return {
        "/v2/repository/index": call("Every model version in the repository, with its state",
                                     v2.RepositoryIndexRequest, v2.RepositoryIndex, "400 401 408 413 422"),
        "/v2/repository/models/{name}/load": call(
            "Load or reload a model: its new versions are verified, warmed up and canaried before they take traffic",
            v2.LoadRequest, v2.Loaded, "400 401 403 404 408 413 422 503 504 507"),
        "/v2/repository/models/{name}/unload": call(
            "Unload a model once the requests its versions hold are answered", v2.UnloadRequest, v2.Loaded,
            "400 401 403 404 408 413 422 503 504"),
    }


def _metadata() -> dict[str, Any]:
    return {"get": {"summary": "Model inputs and outputs",
                    "responses": {"200": json_answer(v2.ModelMetadata, "Metadata"),
                                  **errors(v2.Error, "400 404 503")}}}


def _config() -> dict[str, Any]:
    return {"get": {"summary": "The version's configuration in Triton's form (max_batch_size, inputs, outputs, "
                               "batching, instances)",
                    "responses": {"200": json_answer(v2.ModelConfig, "Configuration"),
                                  **errors(v2.Error, "400 404 503")}}}


def _model_ready() -> dict[str, Any]:
    """200 or 503 as the model (or version) takes requests or not; 404 unknown, 400 a name no model can have."""
    ready = health(v2.ModelReady, "Model readiness", v2.ModelReady)
    ready["get"]["responses"].update(errors(v2.Error, "400 404"))
    return ready


def paths() -> dict[str, Any]:
    """Every /v2 path, unversioned and versioned."""
    out = {"/v2": {"get": {"summary": "Server metadata", "responses": {"200": json_answer(v2.ServerMetadata, "OK")}}},
           "/v2/health/live": health(v2.Live, "Liveness", v2.Live),
           "/v2/health/ready": health(v2.Ready, "Readiness", v2.Ready)}
    out.update(_repository())
    for base in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        out.update({base: _metadata(), f"{base}/ready": _model_ready(), f"{base}/config": _config(),
                    f"{base}/infer": _infer()})
    return request_wide(out, v2.Error, OPERATION_IDS)


# As tritonclient names its calls, a version's own with _version
OPERATION_IDS = {
    "GET /v2": "v2_server_metadata", "GET /v2/health/live": "v2_server_live", "GET /v2/health/ready": "v2_server_ready",
    "POST /v2/repository/index": "v2_repository_index", "POST /v2/repository/models/{name}/load": "v2_load_model",
    "POST /v2/repository/models/{name}/unload": "v2_unload_model",
    **{f"{method} /v2/models/{{name}}{versioned}{tail}": f"v2_{call}{suffix}"
       for versioned, suffix in (("", ""), ("/versions/{version}", "_version"))
       for method, tail, call in (("GET", "", "model_metadata"), ("GET", "/ready", "model_ready"),
                                  ("GET", "/config", "model_config"), ("POST", "/infer", "infer"))}}
