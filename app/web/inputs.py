"""Request pieces every protocol reads the same way: the deadline header, JSON bodies, base64-encoded images."""
from __future__ import annotations

import base64
import binascii
import json
from typing import Any, Mapping

from app.errors import BadRequest, InvalidBase64, InvalidJSON


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
