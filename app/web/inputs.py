"""Request pieces every protocol reads the same way: the body, the deadline header, JSON, base64-encoded images."""
from __future__ import annotations

import binascii
import zlib
from typing import TYPE_CHECKING, Any, Mapping

import pybase64
import pydantic_core
from werkzeug import Request
from werkzeug.datastructures import MultiDict
from werkzeug.exceptions import ClientDisconnected

from app.errors import (BadRequest, BodyTooLarge, InvalidBase64, InvalidJSON, MalformedBody, ShortDeadline,
                        UnsupportedMediaType)
from app.hosting.recent_refusals import deadline_ms_of
from app.web.auth import presented_key

if TYPE_CHECKING:
    from app.engine.contract import ServiceFace


def deadline_s(headers: Mapping[str, str], maximum_s: float, minimum_ms: float = 0.0) -> float:
    """The request's time limit: X-Request-Timeout (ms: a positive decimal number in ASCII digits) when given,
    never longer than ``maximum_s``; ShortDeadline (400) for one under ``minimum_ms`` (MIN_REQUEST_TIMEOUT_MS)."""
    raw = headers.get("X-Request-Timeout")
    if raw is None:
        return maximum_s
    millis = deadline_ms_of(raw)
    if millis is None:
        raise BadRequest(f"X-Request-Timeout must be a positive number of milliseconds, got {raw!r}")
    check_deadline_floor(millis, minimum_ms, f"X-Request-Timeout {raw}")
    return min(millis / 1000, maximum_s)


def request_deadline_s(service: ServiceFace, headers: Mapping[str, str]) -> float:
    """The request's deadline: its X-Request-Timeout (``deadline_s``) within REQUEST_TIMEOUT_S and what a drain
    leaves (``deadline_limit_s``), refused under MIN_REQUEST_TIMEOUT_MS."""
    settings = service.settings
    return deadline_s(headers, service.deadline_limit_s(settings.request_timeout_s), settings.min_request_timeout_ms)


def check_deadline_floor(asked_ms: float, minimum_ms: float, said: str) -> None:
    """ShortDeadline (400) for a deadline of ``asked_ms`` (``said``: as the request gave it) under ``minimum_ms``."""
    if asked_ms < minimum_ms:
        raise ShortDeadline(f"{said} asks for a deadline under {minimum_ms:g} ms, the shortest this server takes "
                            "(MIN_REQUEST_TIMEOUT_MS): it would pass before the request is read")


def each_once(values: MultiDict[str, str], where: str, listed: Mapping[str, str] | None = None) -> dict[str, str]:
    """Each parameter's value (``where``: what they are, "query parameter"); BadRequest for one given more than
    once, which would otherwise silently be its first value (``?top_k=3&top_k=1``: 3). ``listed``: the parameters
    whose several values are one comma-separated value, each with an example the refusal shows."""
    once = values.to_dict()
    if sum(1 for _ in values.items(multi=True)) != len(once):
        repeated = next(name for name in once if len(values.getlist(name)) > 1)
        raise given_more_than_once(where, repeated, values.getlist(repeated), listed)
    return once


def given_more_than_once(where: str, name: str, values: list[str], listed: Mapping[str, str] | None = None
                         ) -> BadRequest:
    """The refusal of parameter ``name`` given several times (``values``), with ``listed``'s example for one that
    takes several values comma-separated (``outputs=labels,embedding``)."""
    example = (listed or {}).get(name)
    hint = f" (several as one, comma-separated: {example})" if example else ""
    return BadRequest(f"{where} {name} is given {len(values)} times ({', '.join(map(repr, values))}): send it "
                      f"once{hint}")


def client_key(headers: Mapping[str, str], header: str) -> str | None:
    """What keeps a client on one side of a canary: the ``header`` it sends (CLIENT_KEY_HEADER), else its API key."""
    return headers.get(header) or presented_key(headers)


def decode_base64(text: str, where: str) -> bytes:
    """Strict base64 -> bytes (the standard library's ``validate=True`` rules); raises InvalidBase64 naming
    ``where`` (e.g. "images[2]").

    pybase64's SIMD decoder: a 4000x3000 photo's 1.5 MB of base64 takes 0.06 ms against 3 ms for the standard
    library's (bench/serving/request_forms.py).
    """
    try:
        return pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError, TypeError):
        raise InvalidBase64(f"{where} is not valid base64{_why_not_base64(text)}") from None


def _why_not_base64(text: object) -> str:
    """What makes ``text`` no standard base64, where a common cause says: line breaks, the URL-safe alphabet, missing
    padding, a data URL's prefix ("" else)."""
    if not isinstance(text, str):
        return ""
    if "\n" in text or "\r" in text:  # base64's default output, 76 a line
        return " (it holds line breaks: send it on one line, e.g. base64 -w0)"
    if text.startswith("data:") and "," in text[:100]:
        return " (it is a data URL: send what follows its comma)"
    if "-" in text or "_" in text:
        return " (it holds - or _: the URL-safe alphabet; send standard base64, with + and /)"
    if len(text) % 4:
        return f" (its length, {len(text)}, is no multiple of 4: the = padding is missing)"
    return ""


def parse_json(data: bytes, what: str) -> Any:
    """JSON -> Python; raises InvalidJSON naming ``what`` (e.g. "the body") for anything that does not parse.

    pydantic's Rust parser: a body carrying a photo in base64 parses about 9x faster than with the json module.
    Nesting deeper than its limit (a few hundred levels) is bad JSON to the client, not a server error.
    """
    try:
        return pydantic_core.from_json(data)
    except ValueError as exc:
        reason = "it is nested too deeply" if "recursion limit" in str(exc) else str(exc)
        if reason.startswith("control character"):  # most often base64 as the base64 command writes it, 76 a line
            reason += (" (a string holds a raw line break or another control character, which JSON writes escaped; "
                       "base64 wrapped in lines is one: send it on one line, e.g. base64 -w0)")
        raise InvalidJSON(f"{what} is not valid JSON: {reason}") from None


NO_BODY_FRAMING = ("the request has no body: its head gave neither Content-Length nor Transfer-Encoding, so nothing "
                   "after it is its body (HTTP/1.1); send the length, or chunked")


def read_sent_body(request: Request) -> bytes:
    """``read_body`` of a request that must carry one (an image, JSON, a form): an empty one whose head said no
    length is refused saying so, its connection closed, for what the client sent after the head would otherwise be
    read as a next request (a bare-LF 400 after an "empty image" one)."""
    data = read_body(request)
    if not data and request.content_length is None and "HTTP_TRANSFER_ENCODING" not in request.environ:
        raise MalformedBody(NO_BODY_FRAMING, headers={"Connection": "close"})
    return data


def read_body(request: Request) -> bytes:
    """The whole body, decompressed when its Content-Encoding is gzip or deflate (``decoded``); one over
    ``max_content_length``, as sent or decompressed, is BodyTooLarge (413), never silently cut short; a read that
    fails is RequestTimeout (408) or ClientGone (499) (``app.web.errors.from_disconnect``).

    werkzeug refuses a Content-Length over the limit before reading, but a chunked body has none: its reader stops
    at the limit and returns what it has, as if the body ended there. So when it stops exactly at the limit, one
    more byte is asked of the server's own stream: if there is one, the body was longer.
    """
    coding = request.environ.get("HTTP_CONTENT_ENCODING")
    if coding is not None:  # before the body is read: a coding not taken costs no read
        coding = _coding(coding)
    try:
        length, limit = request.content_length, request.max_content_length
        if length is not None and request.environ.get("wsgi.input_terminated") and (
                limit is None or length <= limit):
            # a server that ends the body itself (gunicorn) and a length within the limit: werkzeug's reader would
            # read the stream to its end in chunks; one read of that length gives the same bytes without it (~15 us)
            data = _read_input(request, length)
        else:
            data = request.get_data(cache=False)
            if limit is not None and length is None and len(data) >= limit:
                if _read_input(request, 1):
                    raise BodyTooLarge(limit)
        return data if coding is None else decoded(data, coding, limit)
    except ClientDisconnected as exc:  # the client's doing (408, 499), as the request's outcome, not its version's
        from app.web.errors import from_disconnect
        from app.web.services import current_service

        raise from_disconnect(exc, current_service().settings.client_body_timeout_s) from exc


# Each coding taken, and the zlib formats (wbits) its body is tried in: deflate is zlib's format as RFC 9110 8.4.1.2
# names it, or raw deflate as some clients send it
GZIP = (16 + zlib.MAX_WBITS,)
CODINGS = {"gzip": GZIP, "x-gzip": GZIP, "deflate": (zlib.MAX_WBITS, -zlib.MAX_WBITS)}
ACCEPTED_CODINGS = "gzip, deflate, identity"  # what a 415 for another coding says is taken (Accept-Encoding)


def _coding(header: str) -> str | None:
    """The one content coding of a Content-Encoding header that the body is read through (None: identity);
    UnsupportedMediaType (415, RFC 9110 15.5.16) for another coding (br, zstd, compress) or several stacked."""
    codings = [c for c in (part.strip().lower() for part in header.split(",")) if c and c != "identity"]
    if not codings:
        return None
    if len(codings) == 1 and codings[0] in CODINGS:
        return codings[0]
    raise UnsupportedMediaType(f"Content-Encoding {header.strip()!r} is not supported: send the body as it is, or "
                               f"compressed once with gzip or deflate", headers={"Accept-Encoding": ACCEPTED_CODINGS})


def decoded(data: bytes, coding: str, limit: int | None) -> bytes:
    """A body sent compressed with ``coding`` (one of CODINGS), decompressed up to ``limit`` bytes: a body that
    decompresses to more is BodyTooLarge (413) whatever its size as sent (a small body may hold a large one),
    without decompressing it all; one that is not what it says (corrupt, cut short) is 400."""
    bound = 0 if limit is None else limit + 1
    for wbits in CODINGS[coding]:
        stream = zlib.decompressobj(wbits)
        try:
            body = stream.decompress(data, bound)
        except zlib.error:
            continue
        if limit is not None and (len(body) > limit or stream.unconsumed_tail):
            raise BodyTooLarge(limit, decompressed=True)
        if not stream.eof or stream.unused_data:
            break
        return body
    raise BadRequest(f"the body is not valid {coding} data (its Content-Encoding): send it as it is, or compressed "
                     f"whole")


def _read_input(request: Request, size: int) -> bytes:
    """``size`` bytes of the server's own stream; a read that fails (the client too slow: the socket timeout
    app/web/hooks.py sets, or gone) is ClientDisconnected, as werkzeug's own reads report it (app/web/errors.py
    answers a timeout 408)."""
    try:
        return request.environ["wsgi.input"].read(size)
    except (OSError, ValueError) as exc:
        raise ClientDisconnected() from exc
