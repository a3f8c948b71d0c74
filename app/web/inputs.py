"""Request pieces every protocol reads the same way: the body, the deadline header, JSON, base64-encoded images."""
from __future__ import annotations

import base64
import binascii
import json
from typing import Any, Mapping

from werkzeug import Request

from app.errors import BadRequest, BodyTooLarge, InvalidBase64, InvalidJSON


def deadline_s(headers: Mapping[str, str], maximum_s: float) -> float:
    """The request's time limit: X-Request-Timeout (ms) when given, never longer than ``maximum_s``."""
    raw = headers.get("X-Request-Timeout")
    if raw is None:
        return maximum_s
    try:
        millis = float(raw)
    except ValueError:
        raise BadRequest(f"X-Request-Timeout must be a number of milliseconds, got {raw!r}") from None
    if not millis > 0 or millis != millis:
        raise BadRequest(f"X-Request-Timeout must be positive, got {raw!r}")
    return min(millis / 1000, maximum_s)


def decode_base64(text: str, where: str) -> bytes:
    """Strict base64 -> bytes; raises InvalidBase64 naming ``where`` (e.g. "images[2]")."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidBase64(f"{where} is not valid base64") from None


def parse_json(data: bytes, what: str) -> Any:
    """JSON -> Python; raises InvalidJSON naming ``what`` (e.g. "the body") for anything that does not parse.

    RecursionError included: a body nested a thousand levels deep exhausts the decoder's stack, and is bad JSON
    to the client, not a server error.
    """
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        reason = "it is nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        raise InvalidJSON(f"{what} is not valid JSON: {reason}") from None


def read_body(request: Request) -> bytes:
    """The whole body; one over ``max_content_length`` is BodyTooLarge (413), never silently cut short.

    werkzeug refuses a Content-Length over the limit before reading, but a chunked body has none: its reader stops
    at the limit and returns what it has, as if the body ended there. So when it stops exactly at the limit, one
    more byte is asked of the server's own stream: if there is one, the body was longer.
    """
    data = request.get_data(cache=False)
    limit = request.max_content_length
    if limit is not None and request.content_length is None and len(data) >= limit:
        if request.environ["wsgi.input"].read(1):
            raise BodyTooLarge(limit)
    return data
