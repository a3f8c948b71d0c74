"""The /predict and /v1/models part of the OpenAPI document."""
from __future__ import annotations

from typing import Any

from app.v1 import schemas as s
from app.web.openapi import BINARY, NAME_SCHEMA, TIMEOUT_HEADER, errors, json_answer, ref, request_wide
from app.web.schemas import ErrorResponse

MODELS = (s.PredictJSONRequest, s.PredictResponse, s.ExplainJSONRequest, s.ExplainResponse, s.ModelsResponse,
          s.VersionChoice, s.RolloutChanged)
# A 4x4 red PNG, so "Try it out" on the JSON form sends an image any model accepts.
EXAMPLE_IMAGE_BASE64 = ("iVBORw0KGgoAAAANSUhEUgAAAAQAAAAECAIAAAAmkwkpAAAAFElEQVR4nGO8IyfHAANMDEgANwcAOHIBIO1BLLkAAAAA"
                        "SUVORK5CYII=")


def _model_params() -> list[dict[str, Any]]:
    return [{"name": name, "in": "query", "required": False, "schema": {**NAME_SCHEMA},
             "description": f"The {name} this request is for; 404 (naming the served one) when it is not served"}
            for name in ("model", "version")]


def _image_body(multipart: dict[str, Any], json_schema: type, example: dict[str, Any]) -> dict[str, Any]:
    """A request body of images: multipart, a raw image, or JSON with base64 (``json_schema``)."""
    return {"required": True, "content": {
        "multipart/form-data": {"schema": multipart},
        "image/*": {"schema": BINARY}, "application/octet-stream": {"schema": BINARY},
        "application/json": {"schema": ref(json_schema), "example": example}}}


def _predict() -> dict[str, Any]:
    top_k = {"name": "top_k", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 1},
             "description": "Classes per image (1 to the model's classes); left out, the server's TOP_K"}
    outputs = {"name": "outputs", "in": "query", "required": False, "schema": {"type": "string"},
               "description": "What to answer per image, comma-separated: labels (the top k, the default) and/or "
                              "embedding (the model's pooled features, L2-normalised: `embeddings`)"}
    # top_k and outputs are accepted as form fields too, but described only as the query parameters (and in the
    # operation's description): /docs would otherwise pre-fill a form box with 0 and every "Try it out" would
    # answer 400.
    multipart = {"type": "object", "required": ["image"],
                 "properties": {"image": {"type": "array", "items": BINARY, "minItems": 1,
                                          "description": "One or more image files (pick them in /docs)"}}}
    return {"post": {
        "summary": "Classify one or more images",
        "description": "Send the images as multipart (repeat the `image` field; `top_k` and `outputs` may also be "
                       "form fields), as a raw body (image/* or application/octet-stream), or as JSON with base64 "
                       "strings. Answers keep the order sent.",
        "parameters": [top_k, outputs, *_model_params(), TIMEOUT_HEADER],
        "requestBody": _image_body(multipart, s.PredictJSONRequest, {"images": [EXAMPLE_IMAGE_BASE64], "top_k": 1}),
        "responses": {"200": json_answer(s.PredictResponse, "One prediction per image", "Server-Timing",
                                         "X-Batch-Size"),
                      **errors(ErrorResponse, "400 401 404 408 413 415 422 429 500 503 504")},
    }}


def _explain() -> dict[str, Any]:
    index = {"name": "class_index", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 0},
             "description": "The class to explain; left out (and no label): the top one"}
    label = {"name": "label", "in": "query", "required": False, "schema": {"type": "string"},
             "description": "The class to explain, by its label"}
    answer_format = {"name": "format", "in": "query", "required": False,
                     "schema": {"type": "string", "enum": ["json", "png"]},
                     "description": "json: the map's grid; png: the map drawn over the region of the photo the model "
                                    "saw"}
    multipart = {"type": "object", "required": ["image"],  # its fields described as query parameters: _predict's
                 "properties": {"image": {**BINARY, "description": "One image file"}}}
    png = {"description": "The overlay (format=png), its class in X-Explained-Class (URL-encoded), "
                          "X-Explained-Index and X-Explained-Score",
           "content": {"image/png": {"schema": BINARY}}}
    json_body = json_answer(s.ExplainResponse, "The Grad-CAM map of the class over the photo (format=json)",
                            "X-Explained-Class", "X-Explained-Index", "X-Explained-Score", "X-Model-Version")
    return {"post": {
        "summary": "Why the model chooses a class for one image (Grad-CAM)",
        "description": "One forward and one backward pass on the version's weights with gradients (its state "
                       "dict when the served format has none), in a lane of its own beside the batches. Send the "
                       "image as multipart, a raw body, or JSON with base64; `class_index` or `label`, and `format`, "
                       "may also be form fields (multipart) or JSON fields.",
        "parameters": [index, label, answer_format, *_model_params(), TIMEOUT_HEADER],
        "requestBody": _image_body(multipart, s.ExplainJSONRequest, {"image": EXAMPLE_IMAGE_BASE64}),
        "responses": {"200": {**json_body, "content": {**json_body["content"], **png["content"]},
                              "description": f"{json_body['description']}; or {png['description']}"},
                      **errors(ErrorResponse, "400 401 404 408 413 415 422 429 500 503 504")},
    }}


def paths() -> dict[str, Any]:
    """/predict, /explain and /v1/models."""
    labels = {"name": "labels", "in": "query", "required": False,
              "description": "Each version's labels too (1, true, yes; 0, false, no leave them out; any case)",
              "schema": {"type": "string",  # (any case)
                         "pattern": "^(1|0|[Tt][Rr][Uu][Ee]|[Yy][Ee][Ss]|[Ff][Aa][Ll][Ss][Ee]|[Nn][Oo])$"}}
    return request_wide({
        "/predict": _predict(), "/explain": _explain(),
        "/v1/models": {"get": {"summary": "The served model, its batching and its limits", "parameters": [labels],
                               "responses": {"200": json_answer(s.ModelsResponse, "The model"),
                                             **errors(ErrorResponse, "400 503")}}},
        "/v1/models/{name}": {"get": {"summary": "One model: its loaded versions, its rollout, what each worker "
                                             "serves of it (as GET /v1/models)", "parameters": [labels],
                                      "responses": {"200": json_answer(s.ModelsResponse, "The model"),
                                                    **errors(ErrorResponse, "400 404 503")}}},
        "/v1/models/{name}/promote": _rollout_call(
            "Make a version (default: the rollout's candidate) the model's default in every worker"),
        "/v1/models/{name}/rollback": _rollout_call(
            "Serve a version (default: the previous default) again; the one it replaces is rolled back")},
        ErrorResponse, {"POST /predict": "predict", "POST /explain": "explain", "GET /v1/models": "list_models",
                        "GET /v1/models/{name}": "get_model", "POST /v1/models/{name}/promote": "promote_model",
                        "POST /v1/models/{name}/rollback": "rollback_model"})


def _rollout_call(summary: str) -> dict[str, Any]:
    name = {"name": "name", "in": "path", "required": True, "schema": {**NAME_SCHEMA}}
    return {"post": {"summary": summary, "parameters": [name],
                     "requestBody": {"required": False,
                                     "content": {"application/json": {"schema": ref(s.VersionChoice)}}},
                     "responses": {"200": json_answer(s.RolloutChanged, "The model's default and versions now"),
                                   **errors(ErrorResponse, "400 401 403 404 408 409 413 422 503 504 507")}}}
