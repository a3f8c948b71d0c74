"""Service errors: raised where they happen, rendered as JSON in one place."""
from __future__ import annotations

import logging
import math
from typing import Any

from flask import Flask, Response, g, jsonify, request
from werkzeug.exceptions import HTTPException

from app.batch_types import BatcherClosed, DeadlineExpired, DeadlineUnreachable, QueueFull

log = logging.getLogger(__name__)


class ServiceError(Exception):
    """An error with an HTTP status, a stable machine-readable code and a message for humans."""

    status: int = 500
    code: str = "internal_error"

    def __init__(self, message: str, *, details: Any = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details
        self.headers = headers or {}


class BadRequest(ServiceError):
    """A field or parameter has a bad value (400)."""
    status, code = 400, "invalid_request"


class InvalidImage(ServiceError):
    """The bytes are not a decodable image (400)."""
    status, code = 400, "invalid_image"


class InvalidJSON(ServiceError):
    """The body says JSON but does not parse (400)."""
    status, code = 400, "invalid_json"


class InvalidBase64(ServiceError):
    """An image string in a JSON body is not base64 (400)."""
    status, code = 400, "invalid_base64"


class PayloadTooLarge(ServiceError):
    """Body, image or image count over its limit (413)."""
    status, code = 413, "payload_too_large"


class ImageTooLarge(PayloadTooLarge):
    """An image has more pixels than allowed (413), found from its header before decoding."""
    code = "image_too_large"


class TooManyImages(PayloadTooLarge):
    """More images in one request than allowed (413)."""
    code = "too_many_images"


class UnsupportedMediaType(ServiceError):
    """The request's content type is not one we read (415)."""
    status, code = 415, "unsupported_media_type"


class UnsupportedImageFormat(UnsupportedMediaType):
    """An image in a format we do not serve, e.g. TIFF or PDF (415)."""
    code = "unsupported_image_format"


class NotFound(ServiceError):
    """No such model or version (404)."""

    status, code = 404, "not_found"


class SchemaViolation(ServiceError):
    """A JSON body does not match the request schema (422)."""
    status, code = 422, "validation_error"


class Unauthorized(ServiceError):
    """No API key, or a wrong one (401)."""
    status, code = 401, "unauthorized"


class RequestTimeout(ServiceError):
    """The client sent its body too slowly (408)."""
    status, code = 408, "request_timeout"


class Overloaded(ServiceError):
    """The queue cannot take the request now, or not in time for its deadline (429, with Retry-After)."""
    status, code = 429, "overloaded"


class NotReady(ServiceError):
    """The model is not loaded and warmed up, or the worker is draining (503)."""
    status, code = 503, "not_ready"


class InferenceFailed(ServiceError):
    """The forward pass for this request's batch raised (500)."""
    status, code = 500, "inference_failed"


class DeadlineExceeded(ServiceError):
    """The request did not get its inference within its time limit (504)."""
    status, code = 504, "deadline_exceeded"


def retry_after_header(seconds: float) -> dict[str, str]:
    """A Retry-After header in whole seconds, at least 1 (the header takes integers)."""
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def from_batcher(exc: Exception) -> ServiceError:
    """The HTTP meaning of the batcher's own errors."""
    if isinstance(exc, QueueFull):
        error = Overloaded(str(exc), headers=retry_after_header(exc.retry_after_s))
        if isinstance(exc, DeadlineUnreachable):
            error.code = "deadline_unreachable"
        return error
    if isinstance(exc, DeadlineExpired):
        return DeadlineExceeded(str(exc))
    return NotReady(str(exc), headers=retry_after_header(5))


def _from_http(exc: HTTPException) -> ServiceError:
    error = ServiceError(exc.description or exc.name)
    error.status = exc.code or 500
    error.code = exc.name.lower().replace(" ", "_")
    return error


# The Open Inference Protocol fixes its own error body, {"error": "<message>"}, which Triton's clients read.
V2_PREFIX = "/v2"


def render(error: ServiceError) -> Response:
    """The one JSON shape every error takes: {"error": {"code", "message", "request_id"[, "details"]}}.

    Under /v2 the protocol's shape {"error": "<message>"} is used instead, with the same status and headers.
    """
    g.error_code = error.code  # for the access log and the rejection counter
    if request.path == V2_PREFIX or request.path.startswith(V2_PREFIX + "/"):
        response = jsonify(error=error.message)
    else:
        body: dict[str, Any] = {"code": error.code, "message": error.message, "request_id": g.get("request_id")}
        if error.details is not None:
            body["details"] = error.details
        response = jsonify(error=body)
    response.status_code = error.status
    response.headers.update(error.headers)
    return response


def register_error_handlers(app: Flask) -> None:
    """Route every exception the app can raise to ``render``."""
    app.register_error_handler(ServiceError, render)
    for batcher_error in (QueueFull, BatcherClosed, DeadlineExpired):
        app.register_error_handler(batcher_error, lambda exc: render(from_batcher(exc)))
    app.register_error_handler(HTTPException, lambda exc: render(_from_http(exc)))

    def unexpected(exc: Exception) -> Response:
        log.exception("unhandled error", extra={"request_id": g.get("request_id")})
        return render(ServiceError("internal server error"))

    app.register_error_handler(Exception, unexpected)
