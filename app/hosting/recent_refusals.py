"""Requests an HTTP worker refuses itself, as its engine just did, without the app: a storm's 429s made cheap.

Under a storm of requests with short deadlines, most are refused: the backlog ahead would outlast their deadline (429
``deadline_unreachable``). Each such refusal went through the whole app (the request parsed by gunicorn and Flask,
admitted, sent to the engine, refused there, its error rendered): about what an answered request costs the HTTP
side, so on a 2-core host the refusals took a core from the forward passes they make room for. The engine's refusal
says until when its backlog would not answer one more image (``Overloaded.backlog``: a ``time.monotonic()``,
one clock for the host's processes); the app's error handler tells it here (``remember``) with the request's route
(``route_key``: the inference route and the model and version its target names), and for ``memory_s``
(``REFUSAL_MEMORY_MS``) after it the worker answers that route's requests whose deadline ends before then with the
same 429, from the head its loop read (``refusal``, asked where a request thread or a loop request takes the
request, before gunicorn's parser: app/hosting/worker.py's ``_handle_one``): the app and the engine never see them.
It is asked there, not as the loop reads the request: under a storm a request waits in its worker (for a thread or
a loop slot) for much of its deadline, and judged on arrival it would still have had time.

Only what the engine would refuse the same way is refused here: a deadline counts from when the loop had the request
whole, as the engine counts it; a backlog shrinks only as its batches run (which the engine's time already counts) or
as requests leave it (a client gone, a deadline dropped: the memory lasts ``memory_s``, 100 ms by default). Left to
the app: a refusal of a request a rollout's draw routed (the engine leaves ``backlog`` out); a request with an Origin
header (CORS answers), without the API key when one is set (its 401), with a malformed deadline, one under
MIN_REQUEST_TIMEOUT_MS, or a repeated parameter or header (its 400); one whose deadline is shorter than a request of
MAX_IMAGES images would take alone (it may be too short, 400), or passed already (its 504); every request of a
draining worker. The connection stays open as the worker would keep it after an answer of the app's (``keep_alive``:
not past its keep-alive count, nor with KEEPALIVE_S 0, nor in a stopping worker). What the memory does not see: a
promotion, a rollback or a new canary within ``memory_s`` of a refusal (the route's requests then go to another
version, whose queue may have room): for that long at most they may be refused by the backlog of the version they no
longer go to.

Loaded by the gunicorn master with the worker class: the standard library, app.errors and request_framing (its
error shape); the counts import app.metrics in the worker, when a refusal is made (as ``count_unparsed``).
"""
from __future__ import annotations

import email.utils
import json
import logging
import re
import time
import urllib.parse
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple

from app.errors import Backlog
from app.hosting.request_framing import error_body, request_id_of
from app.logs import ACCESS_LOGGER

access_log = logging.getLogger(ACCESS_LOGGER)

DEADLINE_HEADER = "x-request-timeout"
_FIELD_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+\Z")  # a header's name (RFC 9110 5.1's token), lower-cased
_V2_INFER = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer\Z")
V1_PREDICT_RULE = "/predict"
V2_INFER_RULES = ("/v2/models/<name>/infer", "/v2/models/<name>/versions/<version>/infer")
CODE = "deadline_unreachable"


class RouteKey(NamedTuple):
    """An inference request's route as its target says it: the app's rule (its requests' endpoint label) and the
    model and version it names (None: the default's)."""
    rule: str
    model: str | None
    version: str | None


def route_key(target: str) -> RouteKey | None:
    """The inference route a request target (its path and query, as sent) names; None for another path, or for a
    query the app would refuse (a parameter given twice: its 400)."""
    path, _, query = target.partition("?")
    if path == V1_PREDICT_RULE:
        named = {"model": None, "version": None}
        for name, value in urllib.parse.parse_qsl(query, keep_blank_values=True):
            if name in named:
                if named[name] is not None:
                    return None
                named[name] = value
        return RouteKey(V1_PREDICT_RULE, named["model"], named["version"])
    found = _V2_INFER.fullmatch(path)
    if found is None:
        return None
    model, version = (urllib.parse.unquote(part) if part is not None else None for part in found.groups())
    return RouteKey(V2_INFER_RULES[version is not None], model, version)


@dataclass(frozen=True, slots=True)
class _Refused:
    backlog: Backlog  # the engine's: until when it answers no more image, and a request's own inference
    retry_after: str | None  # the engine's Retry-After
    at: float  # when the app had the engine's refusal


class LoopRefusal(NamedTuple):
    """An answer the worker gives a request it refuses: the whole HTTP answer, and whether the connection stays."""
    answer: bytes
    keep_alive: bool


class RecentRefusals:
    """The engine's recent refusals of a route for its backlog, in one worker: what it refuses itself meanwhile."""

    def __init__(self) -> None:
        self.memory_s = 0.0  # 0: nothing remembered (a worker whose app did not configure it)
        self.max_deadline_s = 30.0
        self.max_images = 16
        self.forwarded_for = False  # TRUST_FORWARDED_FOR: the access line says X-Forwarded-For
        self.min_deadline_ms = 0.0  # MIN_REQUEST_TIMEOUT_MS: a deadline under it is the app's 400
        self.key_ok: Callable[[Mapping[str, str]], bool] | None = None
        self._routes: dict[RouteKey, _Refused] = {}
        self._stale_at = 0.0  # when every refusal remembered is older than memory_s

    def configure(self, memory_s: float, max_deadline_s: float, max_images: int,
                  key_ok: Callable[[Mapping[str, str]], bool] | None, forwarded_for: bool = False,
                  min_deadline_ms: float = 0.0) -> None:
        """From the app's settings: REFUSAL_MEMORY_MS, REQUEST_TIMEOUT_S, MAX_IMAGES, whether a request carries the
        API key (None: none is required), TRUST_FORWARDED_FOR and MIN_REQUEST_TIMEOUT_MS."""
        self.memory_s, self.max_deadline_s, self.key_ok = memory_s, max_deadline_s, key_ok
        self.max_images, self.forwarded_for, self.min_deadline_ms = max_images, forwarded_for, min_deadline_ms
        self._routes.clear()

    def remember(self, target: str, backlog: Backlog, retry_after: str | None) -> None:
        """The engine refused a request of ``target`` (its path and query as sent) for ``backlog``."""
        if self.memory_s <= 0:
            return
        key = route_key(target)
        if key is not None:
            now = time.monotonic()
            self._routes[key] = _Refused(Backlog(*backlog), retry_after, now)
            self._stale_at = now + self.memory_s

    def refusal(self, request: bytes | bytearray, received_at: float, client: str | None,
                kept_alive_s: Callable[[], int] | None = None) -> LoopRefusal | None:
        """The 429 for a request (``request``: its bytes, head first; ``received_at``: when the loop had it
        whole; ``client``: its peer's address) that its route's backlog would refuse now, said and counted as the
        app would, the connection kept open if ``kept_alive_s`` says for how long the worker would keep it idle (0:
        it would not; asked only where the request allows; None: kept, for a time not said); None otherwise."""
        if not self._routes:
            return None
        now = time.monotonic()
        if now > self._stale_at:  # every one remembered is too old: forgotten at once
            self._routes.clear()
            return None
        line_end = request.find(b"\r\n")
        method, _, rest = bytes(request[:line_end]).partition(b" ")
        target, _, version = rest.partition(b" ")
        if method != b"POST":
            return None
        key = route_key(target.decode("latin-1"))
        refused = None if key is None else self._routes.get(key)
        if refused is None:
            return None
        if now - refused.at > self.memory_s:
            self._routes.pop(key, None)
            return None
        backlog = refused.backlog
        if now >= backlog.until:
            return None
        headers = _headers(request, line_end, request.find(b"\r\n\r\n", line_end))
        if headers is None or "origin" in headers or (self.key_ok is not None and not self.key_ok(headers)):
            return None
        deadline_s = _deadline_s(headers.get(DEADLINE_HEADER), self.max_deadline_s, self.min_deadline_ms)
        ends = None if deadline_s is None else received_at + deadline_s
        if ends is None or ends >= backlog.until or ends <= now or deadline_s < backlog.own_s(self.max_images):
            return None  # (ends passed: the app's 504, for the time it waited in its worker)
        assert key is not None
        keep_alive: int | bool = (version != b"HTTP/1.0" and headers.get("connection", "").lower() != "close"
                                  and (kept_alive_s is None or kept_alive_s()))
        message = (f"the queue ahead may need up to {backlog.until - now:.3f}s, more than the "
                   f"{received_at + deadline_s - now:.3f}s deadline")
        answer = _refusal_answer(key, headers, refused.retry_after, message, keep_alive, now - received_at, client,
                                 self.forwarded_for)
        return LoopRefusal(answer, bool(keep_alive))


class _Headers(dict):
    """A request's headers by their lower-case names; ``get`` takes any case (as werkzeug's, for app/web/auth.py)."""

    def get(self, name: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return super().get(name.lower(), default)


def _headers(request: bytes | bytearray, line_end: int, head_end: int) -> _Headers | None:
    """The fields between a request's line and its head's end; None where a field repeats or its name is no token
    (the app decides, or gunicorn's parser refuses it)."""
    headers = _Headers()
    for line in bytes(request[line_end + 2:head_end]).split(b"\r\n") if head_end > line_end else ():
        name, _, value = line.partition(b":")
        key = name.decode("latin-1").lower()
        if key in headers or not _FIELD_NAME.match(key):
            return None
        headers[key] = value.strip(b" \t").decode("latin-1")
    return headers


_MILLISECONDS = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")  # ASCII, no sign: float() took
# "1_000", "+5", " 5", full-width digits, "inf" and "nan"


def deadline_ms_of(raw: str) -> float | None:
    """An X-Request-Timeout's milliseconds: a positive decimal number in ASCII digits (an exponent allowed, as
    "1e3"); None for anything else."""
    if not _MILLISECONDS.fullmatch(raw):
        return None
    millis = float(raw)
    return millis if 0 < millis < float("inf") else None


def _deadline_s(raw: str | None, maximum_s: float, minimum_ms: float) -> float | None:
    """As app/web/inputs.py's deadline_s reads X-Request-Timeout; None for a value it refuses (its 400s: not such a
    number, or under MIN_REQUEST_TIMEOUT_MS's ``minimum_ms``)."""
    if raw is None:
        return maximum_s
    millis = deadline_ms_of(raw)
    if millis is None or millis < minimum_ms:
        return None
    return min(millis / 1000, maximum_s)


def _refusal_answer(key: RouteKey, headers: Mapping[str, str], retry_after: str | None, message: str,
                    keep_alive: int | bool, elapsed_s: float, client: str | None, forwarded_for: bool) -> bytes:
    """The refusal's answer in its route's error shape, its access line and its counts (as app/web/hooks.py's);
    ``keep_alive``: False (it closes), True (kept, for a time not said) or the seconds it is kept idle."""
    from app.metrics import REJECTED, REQUEST_SECONDS, REQUESTS, series

    said_id = request_id_of(headers.get("x-request-id"))
    body = json.dumps(error_body(key.rule, CODE, message, said_id), separators=(",", ":")).encode() + b"\n"
    series(REQUESTS, key.rule, "429").inc()
    series(REQUEST_SECONDS, key.rule).observe(elapsed_s)
    REJECTED.labels(CODE).inc()
    if access_log.isEnabledFor(logging.INFO):
        fields = {"forwarded_for": headers.get("x-forwarded-for")} if forwarded_for else {}
        access_log.info("request", extra={"request_id": said_id, "client": client, "method": "POST",
                                          "route": key.rule, "status": 429, "error": CODE,
                                          "duration_ms": round(elapsed_s * 1000, 2), **fields})
    return (b"HTTP/1.1 429 Too Many Requests\r\nDate: " + email.utils.formatdate(usegmt=True).encode()
            + b"\r\nContent-Type: application/json\r\n"
            + (b"" if retry_after is None else b"Retry-After: " + retry_after.encode("latin-1") + b"\r\n")
            + (b"Connection: close\r\n" if not keep_alive
               else b"" if keep_alive is True else b"Keep-Alive: timeout=%d\r\n" % keep_alive)
            + b"X-Request-ID: " + said_id.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
            + b"\r\n\r\n" + body)


RECENT = RecentRefusals()  # the worker's: its app's error handler remembers, _handle_one refuses (one app a process)
