"""Answers compressed on request: a JSON or text answer of at least ``ANSWER_COMPRESSION_MIN_BYTES`` goes out with
``Content-Encoding: gzip`` or ``deflate`` when the request's ``Accept-Encoding`` takes one (its q-values weighed,
gzip first at a tie), as Triton's HTTP endpoint answers tritonclient's ``response_compression_algorithm``; every
such answer says ``Vary: Accept-Encoding``. Left as they are: images (compressed already), V2's binary tensors
(float32 shrinks by about 3%), files (the pages'), streamed answers, an answer already encoded or marked
``Cache-Control: no-transform``, and answers without a body (1xx, 204, 304).
"""
from __future__ import annotations

import zlib

from flask import Flask, Response, request

from app.config import Settings

# zlib's fastest level: a V2 JSON answer of 16 x 1000 float32 probabilities (371 KB) shrinks 2.1x in 3.3 ms of CPU
# here, where level 6 takes 19 ms for 2.3x.
LEVEL = 1
CODINGS = ("gzip", "deflate")  # in the order taken at equal quality
_WINDOW_BITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}  # deflate: the zlib format (RFC 9110 8.4.1.2)
_COMPRESSED_TYPES = ("text/", "application/json", "application/problem+json", "application/openmetrics-text")


def compressible(response: Response, min_bytes: int) -> bool:
    """Whether ``response`` is an answer that may go out compressed: a JSON or text body of at least ``min_bytes``,
    held whole and not encoded already."""
    # the cheapest first: most answers (a few predictions, an error) are short
    if (response.status_code < 200 or response.status_code in (204, 304) or response.direct_passthrough
            or response.is_streamed or (response.calculate_content_length() or 0) < min_bytes
            or "Content-Encoding" in response.headers):
        return False
    mimetype = response.mimetype
    if not mimetype.startswith(_COMPRESSED_TYPES) and not mimetype.endswith("+json"):
        return False
    return not response.cache_control.no_transform


def register_compression(app: Flask, settings: Settings) -> None:
    """Compress answers on request (this module's rules); nothing at all when ``ANSWER_COMPRESSION_MIN_BYTES`` is 0."""
    min_bytes = settings.answer_compression_min_bytes
    if not min_bytes:
        return

    @app.after_request
    def _compressed(response: Response) -> Response:
        if not compressible(response, min_bytes):
            return response
        response.vary.add("Accept-Encoding")
        coding = request.accept_encodings.best_match(CODINGS)
        if coding is None:
            return response
        compressor = zlib.compressobj(LEVEL, zlib.DEFLATED, _WINDOW_BITS[coding])
        response.set_data(compressor.compress(response.get_data()) + compressor.flush())
        response.headers["Content-Encoding"] = coding
        return response
