"""How an HTTP answer, or its absence, is read: the service's result, its JSON error, whether to try again and
when (Retry-After), and what a failure that got no answer means."""
from __future__ import annotations

import email.utils
import math
import re
from datetime import datetime, timezone
from typing import Any, Callable, TypeVar

import requests
import urllib3

from visionserve_client.errors import VisionServeError

T = TypeVar("T")

# Overloaded or not ready: the server says when to come back. Other errors are the caller's to handle.
RETRY_STATUSES = frozenset({429, 503})
# A proxy's or load balancer's own answer (its HTML or text, not the service's JSON error): the service was not
# reached, or did not answer it in time, and may answer the next attempt. The service's own 502 or 504 (504
# deadline_exceeded: the request's deadline passed) is its answer to this request, and is not retried.
PROXY_RETRY_STATUSES = frozenset({502, 504})


def failure_of(exc: requests.RequestException) -> tuple[VisionServeError, bool]:
    """A request that got no answer: its error, and whether to try again. Yes for a connection that could not be
    opened (nothing was sent) and for one cut with no answer (the worker died: a prediction has no side effect,
    docs/deployment.md "Faults"); never for a read timeout (the server may still be working on it, and sending it
    again adds to its load; the call's time is spent anyway) nor a TLS failure (the same the next time: its own
    code, ``tls_error``, as a server did answer)."""
    if isinstance(exc, requests.exceptions.ReadTimeout) or _read_timed_out(exc):
        return VisionServeError(f"no answer in time: {exc}", code="timeout"), False
    if isinstance(exc, requests.exceptions.SSLError):  # a server answered, in no TLS it shares: not "no server"
        plain = " (a server speaking plain HTTP there? its URL then starts http://)" if "WRONG_VERSION_NUMBER" in str(
            exc) or "wrong version number" in str(exc) else ""
        return VisionServeError(f"the TLS handshake failed{plain}: {exc}", code="tls_error"), False
    retry = isinstance(exc, (requests.exceptions.ConnectionError, requests.exceptions.ChunkedEncodingError))
    return VisionServeError(_connection_failure(exc), code="connection_error"), retry


def _read_timed_out(exc: BaseException) -> bool:
    """Whether urllib3's read timeout is what ``exc`` says: requests raises one that came while the answer's body
    was read as a ConnectionError (it was then said to be "connection_error", and the command line told to start a
    server, where one answered too slowly)."""
    seen: set[int] = set()
    stack: list[object] = [exc]
    while stack:
        found = stack.pop()
        if not isinstance(found, BaseException) or id(found) in seen:
            continue
        seen.add(id(found))
        if isinstance(found, urllib3.exceptions.ReadTimeoutError):
            return True
        stack += [*found.args, found.__cause__, found.__context__]
    return False


def _connection_failure(exc: requests.RequestException) -> str:
    """What went wrong, said first (``could not connect to 127.0.0.1:8999: Connection refused``), urllib3's own
    wording after it: its pool's repr led the line before."""
    said = str(exc)
    reason = re.search(r"\[Errno -?\d+\] ([^'\")\]]+)", said)
    where = re.search(r"host='([^']+)', port=(\d+)", said)
    if reason is None or where is None:
        return said
    return f"could not connect to {where[1]}:{where[2]}: {reason[1].strip()} ({said})"


def service_error(response: requests.Response) -> dict[str, Any] | None:
    """The service's own JSON error (``{"error": {"code": ...}}``), None for anything else (a proxy's page)."""
    try:
        body = response.json()
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) and isinstance(error.get("code"), str) else None


def retried(response: requests.Response) -> bool:
    """Whether to try an error answer again: overloaded or not ready, or a proxy's 502/504 (not the service's)."""
    status = response.status_code
    return status in RETRY_STATUSES or (status in PROXY_RETRY_STATUSES and service_error(response) is None)


def retry_after_s(response: requests.Response) -> float | None:
    """Retry-After in seconds: a number of them (finite, not negative), or an HTTP-date, counted from the answer's
    Date (the server's clock, so a skewed one here does not matter) or else this machine's clock; None for anything
    else (nan, -1, a typo), so that the backoff applies."""
    raw = response.headers.get("Retry-After", "").strip()
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        at = http_date(raw)
        if at is None:
            return None
        now = http_date(response.headers.get("Date", "")) or datetime.now(timezone.utc)
        return max(0.0, (at - now).total_seconds())
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def http_date(text: str) -> datetime | None:
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    return when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)  # "-0000": UTC, said vaguely


def error_of(response: requests.Response) -> VisionServeError:
    body = service_error(response)
    if body is not None:
        code, message, details = body["code"], str(body.get("message", "")), body.get("details")
    else:  # a proxy's or another server's page: said in one line, not its markup
        code, details = "invalid_response", None
        text = " ".join(re.sub(r"<[^>]*>", " ", response.text[:2000]).split())[:160]
        message = (f"not visionserve's answer (HTTP {response.status_code} {response.reason or ''}, "
                   f"{response.headers.get('Content-Type', 'no content type')})".replace(" ,", ",")
                   + (f": {text}" if text else ""))
    return VisionServeError(message, status=response.status_code, code=code, details=details,
                            request_id=response.headers.get("X-Request-ID"), retry_after_s=retry_after_s(response))


def health_said(response: requests.Response) -> bool:
    """Whether a health check's answer says yes: the service's (200 yes, 503 no, a JSON object with its status);
    any other answer raised (``error_of``): the service's own error, or one that is not the service's (another
    server's 404 page said "no" before, as a server that is down would)."""
    if response.status_code in (200, 503):
        try:
            body = response.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and isinstance(body.get("status"), str):
            return response.status_code == 200
    raise error_of(response)


# What reading an answer that is not the service's raises (a JSONDecodeError is a ValueError).
MISREAD = (ValueError, KeyError, TypeError, AttributeError, IndexError)


def parsed(response: requests.Response, read: Callable[[dict[str, Any]], T]) -> T:
    """``read`` of a 200's JSON body; a VisionServeError ``invalid_response`` when it is not the service's answer
    (not JSON: a captive portal's page, a proxy's; or JSON without what the service answers)."""
    try:
        body = response.json()
        if not isinstance(body, dict):
            raise TypeError(f"a JSON {type(body).__name__}, not an object")
        return read(body)
    except MISREAD as exc:
        raise invalid_response(response, exc) from None


def invalid_response(response: requests.Response, exc: Exception) -> VisionServeError:
    kind = response.headers.get("Content-Type", "no content type")
    return VisionServeError(f"not visionserve's answer ({kind}; {type(exc).__name__}: "
                            f"{exc}): {response.text[:100]!r}", status=response.status_code, code="invalid_response",
                            request_id=response.headers.get("X-Request-ID"))
