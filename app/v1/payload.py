"""Reads a /predict request in any of its shapes into image bytes and a top_k.

It takes the werkzeug request as an argument rather than using Flask's global, so it stays a plain function.
"""
from __future__ import annotations

from dataclasses import dataclass

import pydantic
from werkzeug import Request

from app.errors import BadRequest, SchemaViolation, UnsupportedMediaType, check_image_count
from app.v1.schemas import PredictJSONRequest
from app.web.inputs import decode_base64, parse_json, read_body

RAW_TYPES = ("application/octet-stream",)
IMAGE_FIELD = "image"


@dataclass(frozen=True)
class PredictInput:
    """What a /predict request asks for."""

    images: list[bytes]
    top_k: int


def _parse_top_k(raw: str | int | None, default: int, num_classes: int, where: str) -> int:
    if raw is None or raw == "":
        return min(default, num_classes)
    try:
        value = int(raw)
    except (TypeError, ValueError):
        raise BadRequest(f"top_k ({where}) must be an integer from 1 to {num_classes}, got {raw!r}") from None
    if not 1 <= value <= num_classes:
        raise BadRequest(f"top_k ({where}) must be from 1 to {num_classes}, got {value}")
    return value


def _image_from_base64(text: str, position: int) -> bytes:
    if text.startswith("data:") and "," in text:  # accept data URLs as browsers produce them
        text = text.split(",", 1)[1]
    return decode_base64(text, f"images[{position}]")


def _from_json(request: Request, default_top_k: int, num_classes: int, max_images: int) -> PredictInput:
    body = parse_json(read_body(request), "the body")
    try:
        parsed = PredictJSONRequest.model_validate(body)
    except pydantic.ValidationError as exc:
        details = [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors()]
        raise SchemaViolation("the JSON body does not match the request schema", details=details) from None
    query_top_k = request.args.get("top_k")
    raw_top_k = parsed.top_k if parsed.top_k is not None else query_top_k
    top_k = _parse_top_k(raw_top_k, default_top_k, num_classes, "body" if parsed.top_k is not None else "query")
    check_image_count(len(parsed.images), max_images)
    return PredictInput([_image_from_base64(s, i) for i, s in enumerate(parsed.images)], top_k)


def _from_multipart(request: Request, max_images: int) -> list[bytes]:
    files = request.files.getlist(IMAGE_FIELD)
    if not files:
        raise BadRequest(f"multipart body has no {IMAGE_FIELD!r} file field")
    check_image_count(len(files), max_images)
    return [f.read() for f in files]


def parse_predict(request: Request, *, default_top_k: int, num_classes: int, max_images: int) -> PredictInput:
    """Images and top_k from a multipart, raw-bytes or JSON request; raises a ServiceError on bad input."""
    mimetype = request.mimetype
    if mimetype == "application/json":
        return _from_json(request, default_top_k, num_classes, max_images)
    if mimetype == "multipart/form-data":
        images = _from_multipart(request, max_images)
        raw_top_k = request.form.get("top_k", request.args.get("top_k"))
    elif mimetype.startswith("image/") or mimetype in RAW_TYPES:
        images = [read_body(request)]
        raw_top_k = request.args.get("top_k")
    else:
        raise UnsupportedMediaType(
            f"content type {mimetype or '(none)'!r} is not supported; send multipart/form-data with an "
            f"{IMAGE_FIELD!r} field, a raw image body (image/* or application/octet-stream), or JSON")
    return PredictInput(images, _parse_top_k(raw_top_k, default_top_k, num_classes, "parameter"))
