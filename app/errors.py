"""Service errors: raised where they happen (engine, protocols, web), rendered as JSON in one place (app/web/errors.py).

Plain exceptions with an HTTP status and a stable code: no Flask here, so the engine can raise them.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple


class ServiceError(Exception):
    """An error with an HTTP status, a stable machine-readable code and a message for humans."""

    status: int = 500
    code: str = "internal_error"

    def __init__(self, message: str, *, details: Any = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details
        self.headers = headers or {}


# where a refusal's message goes on to name the request's later images refused too (its details' also_refused)
ALSO_REFUSED = "; also refused: "


def default_body(error: ServiceError, request_id: str | None) -> dict[str, Any]:
    """{"error": {"code", "message", "request_id"[, "details"]}}."""
    body: dict[str, Any] = {"code": error.code, "message": error.message, "request_id": request_id}
    if error.details is not None:
        body["details"] = error.details
    return {"error": body}


class BadRequest(ServiceError):
    """A field or parameter has a bad value (400)."""
    status, code = 400, "invalid_request"


class MalformedBody(BadRequest):
    """A body the server cannot read at all: a multipart body without a boundary, cut short, or with a part that
    has no name (400)."""
    code = "bad_request"


class InvalidImage(ServiceError):
    """The bytes are not a decodable image (400)."""
    status, code = 400, "invalid_image"


class UnknownOutput(BadRequest):
    """A request names an output the model does not answer."""

    code = "unknown_output"


class NoEmbedding(BadRequest):
    """An embedding asked of a version whose export has none."""

    code = "no_embedding"


class NoGradients(ServiceError):
    """An explanation asked of a version with no weights to take gradients of (or no feature map to read)."""

    status, code = 422, "no_gradients"


class InvalidJSON(ServiceError):
    """The body says JSON but does not parse (400)."""
    status, code = 400, "invalid_json"


class InvalidBase64(ServiceError):
    """An image string in a JSON body is not base64 (400)."""
    status, code = 400, "invalid_base64"


class PayloadTooLarge(ServiceError):
    """Body, image or image count over its limit (413)."""
    status, code = 413, "payload_too_large"


class BodyTooLarge(PayloadTooLarge):
    """The body is over max_body_bytes (413); the connection closes, since the rest of the body is not read."""
    code = "request_entity_too_large"

    def __init__(self, max_bytes: int, decompressed: bool = False) -> None:
        said = " decompressed" if decompressed else ""
        super().__init__(f"the request body{said} is over the {max_bytes} byte limit", headers={"Connection": "close"})


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


class Conflict(ServiceError):
    """The call cannot apply to the model as it is now: no candidate to promote, no previous default (409)."""

    status, code = 409, "conflict"


class LoadFailed(ServiceError):
    """A model version cannot be served: missing files, a bad checksum, a wrong output shape, a failed canary (422).
    What was serving keeps serving."""

    status, code = 422, "load_failed"


class InsufficientMemory(ServiceError):
    """A version would not fit beside the loaded ones (507); nothing was loaded."""

    status, code = 507, "insufficient_memory"


class LoadTimeout(ServiceError):
    """A repository change not done within REPOSITORY_SYNC_TIMEOUT_S (504): it could not start (another change was
    under way; nothing changed), another worker has not applied it (it keeps trying), or, across the link, the engine
    is still applying it."""

    status, code = 504, "load_timeout"


class SchemaViolation(ServiceError):
    """A JSON body does not match the request schema (422)."""
    status, code = 422, "validation_error"


class Unauthorized(ServiceError):
    """No API key, or a wrong one (401)."""
    status, code = 401, "unauthorized"


class Forbidden(ServiceError):
    """A call this client may not make here (the control API's CONTROL_API); the message says how it may (403)."""

    status, code = 403, "forbidden"


class RequestTimeout(ServiceError):
    """The client sent its body too slowly (408)."""
    status, code = 408, "request_timeout"


class ShortDeadline(BadRequest):
    """The request's deadline is shorter than its own inference would take on an idle server (400, no retry)."""
    code = "deadline_too_short"


class Backlog(NamedTuple):
    """What a refusal for the backlog ahead says of its route's like requests: before ``until`` (a
    ``time.monotonic()``, one clock for every process of a host) it answers no more image; and a request's own
    inference, ``image_s`` an image and ``company_s`` for its batch's wait (a deadline shorter than that is too short
    whatever the load: 400, not the backlog's 429)."""
    until: float
    image_s: float
    company_s: float

    def own_s(self, images: int) -> float:
        return images * self.image_s + self.company_s


class Overloaded(ServiceError):
    """The queue cannot take the request now, or not in time for its deadline (429, with Retry-After);
    ``backlog``: for a deadline the backlog ahead would outlast, what that says of the route's like requests (None:
    not said)."""
    status, code = 429, "overloaded"
    backlog: Backlog | None = None


class NotReady(ServiceError):
    """The model is not loaded and warmed up, or the worker is draining (503)."""
    status, code = 503, "not_ready"


class InferenceFailed(ServiceError):
    """The forward pass for this request's batch raised (500)."""
    status, code = 500, "inference_failed"

    @classmethod
    def of(cls, exc: BaseException, what: str) -> "InferenceFailed":
        """``what`` failed with ``exc``, told by its kind and its own words: a TorchScript model's error (its kind
        always ``Error``, its message the TorchScript traceback first) by the last line, where the model's own
        exception says itself (``builtins.RuntimeError: bright image not supported``); at most
        FAILURE_WORDS_CHARS of it."""
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        said = lines[-1].removeprefix("builtins.") if len(lines) > 1 else f"{type(exc).__name__}: {''.join(lines)}"
        said = said if len(said) <= FAILURE_WORDS_CHARS else said[:FAILURE_WORDS_CHARS - 3] + "..."
        return cls(f"{what}: {said.rstrip(': ')}")


FAILURE_WORDS_CHARS = 300  # the most of a model's own error message an answer says (the log has all of it)


class ClientGone(ServiceError):
    """The client closed its connection while its images waited (499, as nginx logs it; nobody reads it)."""
    status, code = 499, "client_closed_request"


class DeadlineExceeded(ServiceError):
    """The request did not get its inference within its time limit (504)."""
    status, code = 504, "deadline_exceeded"

    @classmethod
    def of_request(cls, timeout_s: float, passed: str = "") -> "DeadlineExceeded":
        """The request's deadline of ``timeout_s`` passed (``passed``: when, "while its images were decoded")."""
        return cls(f"no inference result within the request's {timeout_s:g}s deadline"
                   + (f": it passed {passed}" if passed else ""))


class DeadlinePassedBeforeQueue(DeadlineExceeded):
    """The request's deadline passed before its images were queued (its wait for a request thread, its images'
    decode on a busy server): 504 as any other, but the version never had them, so it counts as the server's
    capacity (a refusal), not as the version's failure in its rollout's evidence."""

    @classmethod
    def in_its_worker(cls, timeout_s: float, waited_s: float) -> "DeadlineExceeded":
        """The deadline of ``timeout_s`` passed while the request waited ``waited_s`` in its worker."""
        return cls.of_request(timeout_s, f"while the request waited {waited_s:.3g}s for this worker")


def retry_after_header(seconds: float) -> dict[str, str]:
    """A Retry-After header in whole seconds, at least 1 (the header takes integers)."""
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def check_image_count(count: int, max_images: int) -> None:
    """Raise TooManyImages when a request holds more than ``max_images`` images.

    Protocols call it as soon as they know the count, before any image is read or base64-decoded, so an over-long
    request costs nothing; ``Call.infer`` checks again, so no protocol can skip it.
    """
    if count > max_images:
        raise TooManyImages(f"{count} images in one request; the limit is {max_images}")
