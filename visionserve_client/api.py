"""``Client``: /predict, health, readiness and model metadata over a pooled ``requests`` session, with retries."""
from __future__ import annotations

import contextlib
import io
import math
import os
import random
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import (Any, BinaryIO, Callable, Iterable, Iterator, Mapping, NamedTuple, Sequence, TypeVar, Union,
                    overload)
from urllib.parse import quote, unquote, urlsplit

import requests
from requests.adapters import HTTPAdapter
from requests.utils import check_header_validity

from visionserve_client.answers import (MISREAD, error_of, failure_of, health_said, invalid_response, parsed, retried,
                                       retry_after_s)
from visionserve_client.errors import UsageError, VisionServeError
from visionserve_client.types import Embedding, Explanation, ModelInfo, Overlay, Prediction

# One image: a path, the file's bytes, or a file opened in binary mode (read from where it stands, once)
ImageInput = Union[str, "os.PathLike[str]", bytes, bytearray, memoryview, BinaryIO]
_BYTES = (bytes, bytearray, memoryview)
T = TypeVar("T")
# One request's answers, an image each (_predict_files, _embed_files): the files, the query parameters, the time.
_Send = Callable[[list[tuple[str, bytes]], dict[str, str], "_Budget"], list[T]]
# Nothing a retry changes: the URL or a header is wrong. Raised at once, as a UsageError.
SETUP_ERRORS = (requests.exceptions.InvalidSchema, requests.exceptions.MissingSchema, requests.exceptions.InvalidURL,
                requests.exceptions.InvalidHeader, requests.exceptions.URLRequired)
# The server's own defaults (MAX_IMAGES, MAX_BODY_BYTES), for a server whose /v1/models does not say its limits.
DEFAULT_MAX_IMAGES, DEFAULT_MAX_BODY_BYTES = 16, 20 * 1024 * 1024
# A multipart part's framing beyond its file's bytes and name (its boundary line, Content-Disposition and line ends:
# about 100 bytes; a name's byte may be sent as 3, %22), and the closing boundary: upper bounds, so that a request
# planned to fit the server's body limit does.
_PART_FRAMING, _CLOSING = 160, 64
# The server's refusal of a deadline shorter than it takes (MIN_REQUEST_TIMEOUT_MS, or the request's own inference):
# the caller's to fix when it gave that deadline, not when a retry sent what the waits before it left.
SHORT_DEADLINE = "deadline_too_short"
# The longest a connection may take to open (within the call's timeout): a server that does not accept in this long
# is not there, and the retries go on while the call has time left.
DEFAULT_CONNECT_TIMEOUT_S = 5.0
# Retry-After is honoured with up to this share more, so that clients told the same do not all come back at once.
RETRY_AFTER_JITTER = 0.2


class _Limits(NamedTuple):
    """What one /predict request may hold (the server's MAX_IMAGES and MAX_BODY_BYTES)."""

    max_images: int
    max_body_bytes: int


DEFAULT_LIMITS = _Limits(DEFAULT_MAX_IMAGES, DEFAULT_MAX_BODY_BYTES)


@dataclass(frozen=True)
class _Part:
    """One image of a request: its position in the caller's list, the name it is sent under, its bytes."""

    position: int
    name: str
    data: bytes


@dataclass(frozen=True)
class _Budget:
    """One call's time on ``clock``: its ``end`` (``timeout`` after it starts: its attempts and the waits between
    them all within it) and its deadline's (``deadline_ms`` after it starts; None without one), of which each
    attempt tells the server what is left."""

    clock: Callable[[], float]
    end: float
    deadline: float | None

    def left_s(self) -> float:
        """Seconds left for another attempt: to the call's end, or to its deadline when that comes first."""
        return min(self.end, self.end if self.deadline is None else self.deadline) - self.clock()

    def end_left_s(self) -> float:
        """Seconds left to the call's end (its ``timeout``), whatever its deadline."""
        return self.end - self.clock()

    def attempt_timeout(self, connect_s: float) -> tuple[float, float]:
        """requests' (connect, read) timeouts for an attempt starting now: what is left of the call, the connect
        at most ``connect_s``."""
        left = max(self.end - self.clock(), 0.001)
        return min(connect_s, left), left

    def header_ms(self) -> str | None:
        """X-Request-Timeout for an attempt starting now: the milliseconds left of the deadline (at least 1)."""
        return None if self.deadline is None else str(max(1, math.floor((self.deadline - self.clock()) * 1000)))


class _TimedOut(Exception):
    """A call's time ran out waiting for a pooled connection or for its answer's body (``Client._exchange``)."""

    def __init__(self, error: VisionServeError) -> None:
        super().__init__(error.message)
        self.error = error


def _read_within(response: requests.Response, seconds: float) -> bool:
    """Whether ``response``'s body (asked for streamed) came whole within ``seconds``: its socket is shut then, so
    that a server or a proxy sending it a byte at a time cannot hold the call past its timeout (requests' read
    timeout bounds each read of the socket, not the answer: a dribbled answer took 56 s of a 2 s call)."""
    cut = threading.Event()

    def shut() -> None:
        cut.set()
        connection = getattr(response.raw, "connection", None)
        sock = getattr(connection, "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    watchdog = threading.Timer(max(seconds, 0.0), shut)
    watchdog.daemon = True
    watchdog.start()
    try:
        response.content  # noqa: B018 - read whole (streamed, so that the watchdog bounds it)
    except requests.RequestException:
        if cut.is_set():
            return False
        raise
    finally:
        watchdog.cancel()
    return True


def _sendable(name: str) -> str:
    """A file's name as it can go in a multipart header: a name of bytes that are not UTF-8 (which Python decodes
    with surrogate escapes: a Latin-1 disk, an old archive) keeps its UTF-8 parts, the rest replaced by U+FFFD."""
    try:
        raw = name.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate no decoding made
        raw = name.encode("utf-8", "replace")
    return raw.decode("utf-8", "replace")


def _is_image(image: object) -> bool:
    return isinstance(image, (str, os.PathLike, *_BYTES)) or callable(getattr(image, "read", None))


def _images(images: object, call: str) -> tuple[list[ImageInput], bool]:
    """``images`` as a list, and whether it was one image: one image (``ImageInput``) or any other iterable of them
    (a list, a tuple, a generator, ``Path.glob``'s), each checked before any is read or sent. Anything else is a
    TypeError saying what is taken (before: an open file was iterated as a list, each of its lines sent as an image,
    and a bytearray's ints were taken for paths); a file opened in text mode, or closed, is refused here too."""
    if _is_image(images):
        _check_readable(images, 0, call)
        return [images], True  # type: ignore[list-item]
    if isinstance(images, Mapping) or not isinstance(images, Iterable):
        raise TypeError(_not_an_image(call, images))
    batch = list(images)
    for position, image in enumerate(batch):
        if not _is_image(image):
            raise TypeError(_not_an_image(call, image, position))
        _check_readable(image, position, call)
    return batch, False


def _check_readable(image: object, position: int, call: str) -> None:
    """TypeError for a file opened in text mode, ValueError for a closed one: said before anything is sent (a later
    image's refusal would lose the answers of requests already made)."""
    if isinstance(image, (str, os.PathLike, *_BYTES)):
        return
    which = f"{call}: image {position} ({_name(image, position)})"  # type: ignore[arg-type]
    if isinstance(image, io.TextIOBase) or "b" not in getattr(image, "mode", "b"):
        raise TypeError(f"{which}: a file opened in text mode; open it in binary mode: open(path, 'rb')")
    if getattr(image, "closed", False):
        raise ValueError(f"{which}: the file is closed")


def _not_an_image(call: str, image: object, position: int | None = None, one: bool = False) -> str:
    which = "" if position is None else f"image {position}: "
    hint = (" (a PIL image: save it to an io.BytesIO as JPEG or PNG and pass its getvalue())"
            if callable(getattr(image, "save", None)) else
            " (a numpy array of a file's bytes: pass its .tobytes())" if hasattr(image, "tobytes") else "")
    takes = "one" if one else "one or a list of them"
    return (f"{call}: {which}an image is a path (str or Path), the file's bytes (bytes, bytearray, memoryview) or a "
            f"file opened in binary mode ('rb'), and {call} takes {takes}; got {type(image).__name__}{hint}")


def _name(image: ImageInput, position: int) -> str:
    if isinstance(image, _BYTES):
        return f"image{position}"
    if isinstance(image, (str, os.PathLike)):
        return _sendable(Path(image).name)
    named = getattr(image, "name", None)  # an open file's path; a BytesIO has none, stdin's is "<stdin>" or 0
    return _sendable(Path(named).name) if isinstance(named, str) and not named.startswith("<") else f"image{position}"


def _read(image: ImageInput, position: int) -> tuple[str, bytes]:
    if isinstance(image, _BYTES):
        return _name(image, position), bytes(image)
    if not isinstance(image, (str, os.PathLike)):
        data = image.read()  # (checked binary and open before: _images, _explained)
        if not isinstance(data, _BYTES):  # None: a non-blocking stream with nothing to read now
            raise ValueError(f"image {position} ({_name(image, position)}): reading it gave {type(data).__name__}, "
                             "not bytes (a non-blocking stream: read it whole yourself and pass the bytes)")
        return _name(image, position), bytes(data)
    try:
        return _name(image, position), Path(image).read_bytes()
    except OSError as exc:
        _name_the_file(exc, str(image))
        raise


def _size(image: ImageInput) -> int:
    """Its bytes, from the file system for a file (not read: one too large to send is never read); for an open
    file, what is left of it from where it stands, 0 where that cannot be told (measured once read)."""
    if isinstance(image, _BYTES):
        return memoryview(image).nbytes
    if isinstance(image, (str, os.PathLike)):
        try:
            return Path(image).stat().st_size
        except OSError as exc:
            _name_the_file(exc, str(image))
            raise
    try:
        return max(0, os.fstat(image.fileno()).st_size - image.tell())
    except (AttributeError, OSError, io.UnsupportedOperation):
        getbuffer = getattr(image, "getbuffer", None)  # an io.BytesIO
        return max(0, len(getbuffer()) - image.tell()) if callable(getbuffer) else 0


def _part_bytes(name: str, size: int) -> int:
    """An upper bound of what an image of ``size`` bytes named ``name`` adds to a multipart body."""
    return size + _PART_FRAMING + 3 * len(name.encode("utf-8"))


def _too_large(position: int, name: str, size: int, limits: _Limits) -> VisionServeError:
    """The error of an image that alone is over the server's body limit: not sent (no answer, so no status)."""
    return VisionServeError(f"image {position} ({name}): {size} bytes, over the server's limit of "
                            f"{limits.max_body_bytes} bytes for a request (MAX_BODY_BYTES); not sent",
                            code="request_entity_too_large",
                            details={"image": position, "filename": name, "max_body_bytes": limits.max_body_bytes})


def _at_position(error: VisionServeError, index: int, position: int) -> VisionServeError:
    """``error``, about the image at ``position`` of the caller's list, said of that position: the server counted
    it ``index``, in a request that held part of the list (a later one, or one sent again without a refused image)."""
    details = dict(error.details) if isinstance(error.details, dict) else {}
    message, said = error.message, f"image {index} ("
    if index != position and message.startswith(said):
        message = f"image {position} (" + message[len(said):]
    return VisionServeError(message, status=error.status, code=error.code, request_id=error.request_id,
                            retry_after_s=error.retry_after_s, details={**details, "image": position})


def _also_refused(error: VisionServeError, count: int) -> dict[int, VisionServeError]:
    """The other images of a request of ``count`` that ``error`` says the server refused too (its details'
    ``also_refused``: each one's index, status, code and message), each as its own error; malformed entries are
    left out (those images are sent again)."""
    refused = {}
    listed = error.details.get("also_refused") if isinstance(error.details, dict) else None
    for item in listed if isinstance(listed, list) else ():
        index = item.get("image") if isinstance(item, dict) else None
        if isinstance(index, int) and not isinstance(index, bool) and 0 <= index < count:
            status = item.get("status")
            refused[index] = VisionServeError(
                str(item.get("message") or error.message), status=status if isinstance(status, int) else error.status,
                code=str(item.get("code") or error.code), request_id=error.request_id,
                details={"image": index, "filename": item.get("filename")})
    return refused


def _name_the_file(error: OSError, path: str) -> None:
    """``error`` naming the file in its repr too: an OSError's repr (what a REPL or a printed list of
    ``predict_each``'s results shows) leaves its filename out, ``FileNotFoundError(2, 'No such file or directory')``.
    Its type, errno and ``filename`` stay as they are, and so does str()."""
    if error.errno is None:  # an OSError without errno: its message is all it says
        error.args = (f"{path}: {error}",)
        return
    if error.filename is None:
        error.filename = path
    error.args = (error.errno, error.strerror, error.filename)  # repr: FileNotFoundError(2, '...', 'notes.txt')


def _route(model: str | None, version: str | None) -> dict[str, str]:
    """The ``model`` and ``version`` query parameters, those given (the server picks the rest)."""
    return {key: value for key, value in (("model", model), ("version", version)) if value is not None}


def _check_deadline(deadline_ms: float | None) -> None:
    if deadline_ms is not None and not (isinstance(deadline_ms, (int, float)) and math.isfinite(deadline_ms)
                                        and deadline_ms > 0):
        raise ValueError(f"deadline_ms must be a positive number of milliseconds, got {deadline_ms!r}")


def _base_url(url: str) -> str:
    """``url`` without its trailing slash; a UsageError for one no request can go to (no http:// or https://, no
    host, a port that is no number), rather than every call failing as if no server answered there."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError for a port that is no number
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{url!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(f"{url!r} is not a server's URL: it starts with http:// or https:// and names a host "
                         "(e.g. http://localhost:8000)")
    if parts.path.rstrip("/") in _ROUTE_PATHS:  # every call would go to <route>/predict and the like, and read a
        # 404 as no server's answer (a path under a proxy's prefix, /ml/v1, may well be a server's root: taken)
        raise UsageError(f"{url!r} names a route ({parts.path.rstrip('/')}), not the server: give its root URL "
                         f"({parts.scheme}://{parts.netloc}); the client picks the routes")
    return url.rstrip("/")


_ROUTE_PATHS = ("/v2", "/v1", "/predict", "/v1/models", "/explain", "/openapi.json", "/docs")  # none a server's root


def _header(name: str, value: str) -> bytes:
    """A header's value as UTF-8 (requests would send a str as Latin-1, failing for a character past U+00FF; the
    server reads UTF-8); a UsageError, without the value (a key's), for one that cannot go in a header."""
    encoded = value.encode("utf-8")
    try:
        check_header_validity((name, encoded))
    except requests.exceptions.InvalidHeader:
        raise UsageError(f"the {name} header cannot be sent: its value holds a line break or another control "
                         "character") from None
    return encoded


def _usage_error(exc: requests.RequestException) -> UsageError:
    if isinstance(exc, requests.exceptions.InvalidHeader):  # its text holds the header's value: maybe a key
        return UsageError("a header cannot be sent: its value holds a line break or another control character")
    return UsageError(f"no request can go to that URL: {exc} (a server's URL starts with http:// or https://)")


def _listing(body: dict[str, Any]) -> tuple[str | None, list[dict[str, Any]]]:
    """/v1/models's default model and its entries."""
    return body.get("default_model"), [dict(m) for m in body["models"]]


def _limits_of(body: dict[str, Any]) -> _Limits:
    """The tightest max_images and max_body_bytes of the versions /v1/models lists (each says its worker's); the
    defaults for what none says."""
    said = [m["limits"] for m in body.get("models") or [] if isinstance(m, dict) and isinstance(m.get("limits"), dict)]

    def tightest(key: str, default: int) -> int:
        values = [v for v in (limits.get(key) for limits in said)
                  if isinstance(v, int) and not isinstance(v, bool) and v > 0]
        return min(values, default=default)

    return _Limits(tightest("max_images", DEFAULT_MAX_IMAGES), tightest("max_body_bytes", DEFAULT_MAX_BODY_BYTES))


class Client:
    """A visionserve client. Thread-safe for concurrent calls; reuse one instance (it pools connections: up to
    ``pool_size`` of them; more threads than that wait for one rather than open connections they cannot keep).

    ``timeout`` bounds a call, end to end: its wait for a pooled connection, its attempts (their answers' bodies
    too, however slowly they come) and the waits between them (each attempt's connect at most ``connect_timeout`` of
    it); past it, the error's code is ``timeout``. A failed TLS handshake is ``tls_error`` (a server answered), not
    retried. 429 and 503 answers, a proxy's 502 and 504, a connection that could not be opened
    and one cut with no answer are retried up to ``retries`` times, waiting what the server's Retry-After says (at
    most ``max_backoff_s``, and up to a fifth more), or an exponential backoff with jitter when it says nothing; never
    a read timeout, and never a wait the call's ``timeout`` or deadline would end first. A URL without http://, or
    an API key that cannot go in a header, is a UsageError at once. ``client_id`` (sent as X-Client-ID) keeps this
    client on the same side of a canary rollout. ``sleep`` and ``clock`` (monotonic seconds) are for tests.
    """

    def __init__(self, base_url: str = "http://127.0.0.1:8000", *, api_key: str | None = None,
                 client_id: str | None = None, timeout: float = 30.0, retries: int = 3, backoff_s: float = 0.5,
                 max_backoff_s: float = 30.0, pool_size: int = 16,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        seconds = (timeout, connect_timeout, backoff_s, max_backoff_s)
        counts = (retries, pool_size)
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in counts):
            raise TypeError(f"retries and pool_size are whole numbers, got {retries!r} and {pool_size!r}")
        if not all(isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) and s >= 0
                   for s in seconds) or timeout <= 0 or connect_timeout <= 0 or retries < 0 or pool_size <= 0:
            raise ValueError("timeout, connect_timeout and pool_size must be positive; retries and backoffs must not "
                             "be negative; the times finite")
        self.base_url = _base_url(base_url)
        self.timeout, self.connect_timeout, self.retries = timeout, connect_timeout, retries
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self._sleep, self._clock = sleep, clock
        self._limits: _Limits | None = None  # the server's, read by the first predict_each
        # A pooled connection per call at most: a call waits for one within its own time (the pool itself would
        # wait for ever, uncounted: six threads of a pool of two, 2 s each, ended at 2, 4 and 6 s)
        self.pool_size, self._connections = pool_size, threading.BoundedSemaphore(pool_size)
        self.session = requests.Session()
        # pool_block: never waited on (the semaphore above holds calls to pool_size), but without it a call past
        # the pool's size opens a connection of its own and drops it ("Connection pool is full, discarding").
        adapter = HTTPAdapter(pool_connections=1, pool_maxsize=pool_size, pool_block=True)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        if api_key:
            self.session.headers["Authorization"] = _header("Authorization", f"Bearer {api_key}")  # type: ignore
        if client_id:  # keeps this client on one side of a canary rollout (the server's CLIENT_KEY_HEADER)
            self.session.headers["X-Client-ID"] = _header("X-Client-ID", client_id)  # type: ignore[assignment]

    def close(self) -> None:
        """Close pooled connections."""
        self.session.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _budget(self, deadline_ms: float | None) -> _Budget:
        """A call's time, from now."""
        _check_deadline(deadline_ms)
        now = self._clock()
        return _Budget(self._clock, now + self.timeout, None if deadline_ms is None else now + deadline_ms / 1000)

    def _wait_s(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:  # at least what the server asked (capped), up to a fifth more
            return min(retry_after, self.max_backoff_s) * (1 + RETRY_AFTER_JITTER * random.random())
        return min(self.backoff_s * 2.0 ** attempt * (0.5 + random.random()), self.max_backoff_s)

    def _request(self, method: str, path: str, budget: _Budget | None = None, retries: int | None = None,
                 **kwargs: Any) -> requests.Response:
        """One call: attempts until an answer that is not retried, the retries run out, or the wait before the
        next attempt would outlast the call's time or its deadline; then the last attempt's error (the one before it
        when a retry's deadline, what the waits left of the caller's, was refused as too short)."""
        budget = budget or self._budget(None)
        error: VisionServeError | None = None
        for attempt in range(1 + (self.retries if retries is None else retries)):
            if error is not None:
                wait = self._wait_s(attempt - 1, error.retry_after_s)
                if wait >= budget.left_s():  # the next attempt would start after the call's end
                    raise error
                self._sleep(wait)
                if budget.left_s() <= 0:
                    raise error
            outcome = self._attempt(method, path, budget, kwargs)
            if isinstance(outcome, requests.Response):
                return outcome
            if error is not None and outcome[0].code == SHORT_DEADLINE:  # what the retries left of the deadline
                raise error  # was too short, not the deadline the caller gave: the refusal that cost the time
            error, retry = outcome
            if not retry:
                raise error
        assert error is not None
        raise error

    def _attempt(self, method: str, path: str, budget: _Budget,
                 kwargs: dict[str, Any]) -> requests.Response | tuple[VisionServeError, bool]:
        """One exchange: the 200 answer, or the error and whether to try again."""
        headers = dict(kwargs.get("headers") or {})
        left_ms = budget.header_ms()
        if left_ms is not None:  # what is left of the caller's deadline, not what it was at the first attempt
            headers["X-Request-Timeout"] = left_ms
        try:
            response = self._exchange(method, path, budget.end_left_s(), **{**kwargs, "headers": headers},
                                      timeout=budget.attempt_timeout(self.connect_timeout))
        except _TimedOut as exc:
            return exc.error, False
        except SETUP_ERRORS as exc:
            raise _usage_error(exc) from None
        except requests.RequestException as exc:
            return failure_of(exc)
        if response.status_code == 200:
            return response
        return error_of(response), retried(response)

    @overload
    def predict(self, images: ImageInput, top_k: int | None = None, *, deadline_ms: float | None = None,
                model: str | None = None, version: str | None = None) -> Prediction: ...

    @overload
    def predict(self, images: Iterable[ImageInput], top_k: int | None = None, *, deadline_ms: float | None = None,
                model: str | None = None, version: str | None = None) -> list[Prediction]: ...

    def predict(self, images: ImageInput | Iterable[ImageInput], top_k: int | None = None, *,
                deadline_ms: float | None = None, model: str | None = None,
                version: str | None = None) -> Prediction | list[Prediction]:
        """Classify one image (a path, the file's bytes, or a file opened with 'rb') or a list of them, in one
        request, in order.

        ``top_k``: classes per image; left out, the server's default (``TOP_K``, at most the model's classes).
        ``model`` and ``version``: which served model and version answer; left out, the server's default model
        and that model's default version. Each prediction says which answered (``Prediction.model``, ``.version``).
        ``deadline_ms``: the call's deadline, end to end: each attempt sends what is left of it (X-Request-Timeout),
        and no retry starts once it has passed.
        """
        batch, single = _images(images, "predict")
        if not batch:
            raise ValueError("predict needs at least one image")
        budget = self._budget(deadline_ms)
        files = [_read(image, i) for i, image in enumerate(batch)]
        predictions = self._predict_files(files, _params(model, version, top_k), budget)
        return predictions[0] if single else predictions

    @overload
    def embed(self, images: ImageInput, *, deadline_ms: float | None = None, model: str | None = None,
              version: str | None = None) -> Embedding: ...

    @overload
    def embed(self, images: Iterable[ImageInput], *, deadline_ms: float | None = None, model: str | None = None,
              version: str | None = None) -> list[Embedding]: ...

    def embed(self, images: ImageInput | Iterable[ImageInput], *, deadline_ms: float | None = None,
              model: str | None = None, version: str | None = None) -> Embedding | list[Embedding]:
        """The embedding of one image (a path, the file's bytes, or a file opened with 'rb') or of each of a list,
        in one request, in order (``/predict?outputs=embedding``); a model exported without one answers
        VisionServeError ``no_embedding``.
        ``model``, ``version`` and ``deadline_ms`` as for ``predict``. More images than one request may hold (the
        server's ``max_images``, ``max_body_bytes``): ``embed_each``."""
        batch, single = _images(images, "embed")
        if not batch:
            raise ValueError("embed needs at least one image")
        budget = self._budget(deadline_ms)
        files = [_read(image, i) for i, image in enumerate(batch)]
        embeddings = self._embed_files(files, _embed_params(model, version), budget)
        return embeddings[0] if single else embeddings

    def embed_each(self, images: Iterable[ImageInput], *, deadline_ms: float | None = None,
                   model: str | None = None,
                   version: str | None = None) -> list[Embedding | VisionServeError | OSError]:
        """Like ``embed`` for a list, in as many requests as the server's limits need, one bad image not sinking
        the others: each entry is its image's embedding or its own error, as ``predict_each`` gives them (and
        splits the images, sends a request again without a refused image, or in halves after a 413)."""
        _check_deadline(deadline_ms)
        return self._each("embed_each", images, self._embed_files, _embed_params(model, version), deadline_ms)

    def predict_each(self, images: Iterable[ImageInput], top_k: int | None = None, *,
                     deadline_ms: float | None = None, model: str | None = None,
                     version: str | None = None) -> list[Prediction | VisionServeError | OSError]:
        """Like ``predict`` for a list, but one bad image does not sink the others: each entry is its image's
        prediction, or the error for that image (the server's, said of its position in ``images``; or an OSError
        for a file that cannot be read, naming the file in its str() and repr() and as ``filename``).

        The images go in as few requests as the server's limits allow (its ``max_images`` and ``max_body_bytes``,
        read once from /v1/models; 16 images and 20 MiB when it does not say), each file read when its request is
        made; an image alone over the body limit gets its own ``request_entity_too_large`` and is not sent. When the
        server refuses one image, the rest of its request are sent again without it; when it finds a request too
        large after all (413), it gets it in halves. A refusal of a request as a whole (auth, overload after the
        retries, no server, a bad ``top_k``) is the error of each image it held and of every image not sent yet:
        the rest are not sent. ``timeout`` and ``deadline_ms`` hold for each request; a UsageError is raised."""
        _check_deadline(deadline_ms)
        return self._each("predict_each", images, self._predict_files, _params(model, version, top_k), deadline_ms)

    def _each(self, call: str, images: Iterable[ImageInput], send: _Send[T], params: dict[str, str],
              deadline_ms: float | None) -> list[T | VisionServeError | OSError]:
        """``images`` in requests that fit the server's limits, each answered by ``send`` (a list of answers, one an
        image): every image's answer or its own error; a request refused as a whole, the error of the rest."""
        images = _images(images, call)[0]  # each checked before any is sent
        results: list[T | VisionServeError | OSError | None] = [None] * len(images)
        for parts in self._requests_of(images, results):
            refused = self._answer_each(parts, send, params, deadline_ms, results)
            if refused is not None:
                results = [refused if result is None else result for result in results]
                break
        return results  # type: ignore[return-value]

    def _requests_of(self, images: Sequence[ImageInput],
                     results: list[Any]) -> Iterator[list[_Part]]:
        """``images`` in requests that fit the server's limits, each file read as its request is made (never all of
        them at once); a file that cannot be read, or alone over the body limit, gets its error in ``results``."""
        limits: _Limits | None = None  # asked once an image is there to send
        parts: list[_Part] = []
        taken = _CLOSING  # the body's bytes so far
        for position, image in enumerate(images):
            name = _name(image, position)
            try:
                size = _size(image)
                limits = limits or self._server_limits()
                if _CLOSING + _part_bytes(name, size) > limits.max_body_bytes:
                    results[position] = _too_large(position, name, size, limits)
                    continue
                data = _read(image, position)[1]
            except OSError as exc:
                results[position] = exc
                continue
            cost = _part_bytes(name, len(data))
            if _CLOSING + cost > limits.max_body_bytes:  # grown since it was measured
                results[position] = _too_large(position, name, len(data), limits)
                continue
            if len(parts) == limits.max_images or taken + cost > limits.max_body_bytes:
                yield parts
                parts, taken = [], _CLOSING
            parts.append(_Part(position, name, data))
            taken += cost
        if parts:
            yield parts

    def _server_limits(self) -> _Limits:
        """The server's limits, read once from /v1/models (one attempt); the defaults while it cannot answer (no
        server, 429, 5xx: asked again by the next call), and for good from a server that answers without them."""
        if self._limits is not None:
            return self._limits
        try:
            response = self._request("GET", "/v1/models", retries=0)
        except UsageError:
            raise
        except VisionServeError as exc:
            if exc.status is None or exc.status == 429 or exc.status >= 500:
                return DEFAULT_LIMITS
            self._limits = DEFAULT_LIMITS  # no listing here (a proxy's path, an older server): it will not come
            return self._limits
        try:
            self._limits = parsed(response, _limits_of)
        except VisionServeError:
            self._limits = DEFAULT_LIMITS
        return self._limits

    def _answer_each(self, parts: list[_Part], send: _Send[T], params: dict[str, str], deadline_ms: float | None,
                     results: list[T | VisionServeError | OSError | None]) -> VisionServeError | None:
        """Send ``parts``, putting each image's answer or own error into ``results`` at its position: an image
        the server refuses is taken out and the rest sent again; a request it finds too large (413 about the request,
        when its limits were not known or are lower than it said) is sent in halves, and an image alone in one gets
        that error. Returns the error of a request refused as a whole, None once every image has its answer."""
        pending = [parts]  # a stack: the next request last
        while pending:
            parts = pending.pop()
            try:
                answers = send([(p.name, p.data) for p in parts], params, self._budget(deadline_ms))
            except UsageError:
                raise
            except VisionServeError as exc:
                index = exc.image_index if exc.image_index is not None and 0 <= exc.image_index < len(parts) else None
                if index is None and exc.status == 413 and len(parts) > 1:
                    half = len(parts) // 2
                    pending += [parts[half:], parts[:half]]
                    continue
                if index is None and exc.status != 413:
                    return exc
                index = index or 0  # alone, and too large
                refused = {index: exc, **_also_refused(exc, len(parts))}
                for at, error in refused.items():
                    results[parts[at].position] = _at_position(error, at, parts[at].position)
                if len(parts) > len(refused):
                    pending.append([part for at, part in enumerate(parts) if at not in refused])
                continue
            for part, answer in zip(parts, answers):
                results[part.position] = answer
        return None

    def _predict_files(self, files: list[tuple[str, bytes]], params: dict[str, str],
                       budget: _Budget) -> list[Prediction]:
        return self._answers(files, params, budget, "predictions",
                             lambda p, model, version: Prediction.from_json(p, model=model, version=version))

    def _embed_files(self, files: list[tuple[str, bytes]], params: dict[str, str],
                     budget: _Budget) -> list[Embedding]:
        return self._answers(files, params, budget, "embeddings",
                             lambda vector, model, version: Embedding(list(vector), model, version))

    def _answers(self, files: list[tuple[str, bytes]], params: dict[str, str], budget: _Budget, key: str,
                 answer: Callable[[Any, str | None, str | None], T]) -> list[T]:
        """One POST of ``files``: the answer's ``key`` list, an item each made by ``answer`` with the model and
        version that served it; ValueError (a malformed answer) unless there is one per file."""
        response = self._post_files(files, params, budget)

        def read(body: dict[str, Any]) -> list[T]:
            served = body.get("model") or {}
            found = [answer(item, served.get("name"), served.get("version")) for item in body[key]]
            if len(found) != len(files):
                raise ValueError(f"{len(found)} {key} for {len(files)} images")
            return found

        return parsed(response, read)

    def _post_files(self, files: list[tuple[str, bytes]], params: dict[str, str],
                    budget: _Budget) -> requests.Response:
        return self._request("POST", "/predict", budget, params=params or None, files=[("image", f) for f in files])

    def explain(self, image: ImageInput, *, label: str | None = None, class_index: int | None = None,
                deadline_ms: float | None = None, model: str | None = None,
                version: str | None = None) -> Explanation:
        """Why the model chooses a class for one image (a path, the file's bytes, or a file opened with 'rb'): its
        Grad-CAM map over the region of the photo the model saw (``/explain``). The class: ``label`` or
        ``class_index`` (left out, the top one). ``model``, ``version`` and ``deadline_ms`` as for ``predict``
        (without ``version`` the model's default version explains, never a rollout's candidate). A version with no
        weights to take gradients of answers VisionServeError ``no_gradients``."""
        response = self._explained(image, _explain_params(model, version, label, class_index), deadline_ms)
        return parsed(response, Explanation.from_json)

    def explain_overlay(self, image: ImageInput, *, label: str | None = None, class_index: int | None = None,
                        deadline_ms: float | None = None, model: str | None = None,
                        version: str | None = None) -> Overlay:
        """``explain``'s map drawn over the region of the photo the model saw: a PNG (``Overlay.png``; write it to a
        file to look at it) with the class it explains and its probability."""
        params = {**_explain_params(model, version, label, class_index), "format": "png"}
        response = self._explained(image, params, deadline_ms)
        said = response.headers
        try:
            return Overlay(response.content, unquote(said["X-Explained-Class"]), int(said["X-Explained-Index"]),
                           float(said["X-Explained-Score"]), said.get("X-Model-Version"))
        except (KeyError, ValueError) as exc:
            raise invalid_response(response, exc) from None

    def _explained(self, image: ImageInput, params: dict[str, str], deadline_ms: float | None) -> requests.Response:
        if not _is_image(image):
            raise TypeError(_not_an_image("explain", image, one=True))
        _check_readable(image, 0, "explain")
        budget = self._budget(deadline_ms)
        return self._request("POST", "/explain", budget, params=params, files=[("image", _read(image, 0))])

    def health(self) -> bool:
        """Liveness: True when the process and its inference thread run, False when it says not or no server
        answers (no retries); VisionServeError for an answer that is not its health answer (``says_yes``)."""
        return self.says_yes("/healthz") is True

    def ready(self) -> bool:
        """Readiness: True when the model is warm and the server accepts work, False when it says not or no server
        answers (no retries); VisionServeError for an answer that is not its health answer (``says_yes``)."""
        return self.says_yes("/readyz") is True

    def says_yes(self, path: str) -> bool | None:
        """What the service's health answer at ``path`` says (no retries): yes (200) or no (503), None when no server
        answers; VisionServeError for any other answer: the service's own error (401 without the key), or one that
        is not the service's (``invalid_response``: another server on that port, a proxy's page)."""
        response = self._probe(path)
        return None if response is None else health_said(response)

    def probe(self, path: str) -> int | None:
        """The status a GET of ``path`` answers (no retries), or None when no server answers: what tells a server
        that is not ready (503) from none at all."""
        response = self._probe(path)
        return None if response is None else response.status_code

    def _probe(self, path: str) -> requests.Response | None:
        """One GET, in the call's ``timeout`` (a pooled connection's wait, and its answer, included)."""
        try:
            return self._exchange("GET", path, self.timeout,
                                  timeout=(min(self.connect_timeout, self.timeout), self.timeout))
        except SETUP_ERRORS as exc:
            raise _usage_error(exc) from None
        except requests.exceptions.SSLError as exc:  # a server is there, in no TLS this client shares
            raise failure_of(exc)[0] from None
        except (_TimedOut, requests.RequestException):
            return None

    def _exchange(self, method: str, path: str, left_s: float, **kwargs: Any) -> requests.Response:
        """One request and its whole answer within ``left_s``, on one of the pool's connections (waited for within
        that time too; requests' (connect, read) ``timeout`` held to what the wait left): _TimedOut when none came
        free or the answer came too slowly; requests' own errors as they are."""
        end = self._clock() + left_s
        if not self._connections.acquire(timeout=max(left_s, 0.0)):
            raise _TimedOut(VisionServeError(
                f"no connection of this client's pool (pool_size {self.pool_size}) came free within the call's "
                f"timeout ({self.timeout:g} s): its other calls held them all", code="timeout"))
        try:
            connect_s, read_s = kwargs.pop("timeout")
            left = max(end - self._clock(), 0.001)  # what the wait for a connection left
            response = self.session.request(method, self.base_url + path, stream=True,
                                            timeout=(min(connect_s, left), min(read_s, left)), **kwargs)
            if not _read_within(response, end - self._clock()):
                raise _TimedOut(VisionServeError(
                    f"the answer did not come whole within the call's timeout ({self.timeout:g} s): the server or "
                    "a proxy sent it too slowly", code="timeout", status=response.status_code))
            return response
        finally:
            self._connections.release()

    def model(self, labels: bool = False, model: str | None = None) -> ModelInfo:
        """A served model's metadata at its default version (with its class names when ``labels``): ``model``, else
        the server's default model (``default_model`` of /v1/models), the one ``predict`` without ``model`` meets.
        With several models and none the default, it raises what ``predict`` gets then: a 400 ``invalid_request``
        naming them (``details["models"]``); the client never picks one the server would not. A ``model`` the server
        does not serve raises its 404 ``not_found`` (its request id, and the models it serves in ``details``)."""
        if not isinstance(labels, bool):  # model("name") read the name as labels: the default model, unsaid
            raise TypeError(f"labels takes True or False, got {labels!r}: name the model with model=...")
        path = "/v1/models/" + quote(model, safe="") if model else "/v1/models"
        response = self._request("GET", path, params={"labels": "1"} if labels else None)
        default_model, models = parsed(response, _listing)
        name = model or default_model
        if name is None:
            names = sorted({str(m.get("name")) for m in models})
            if len(names) > 1:  # the server's own words for a request naming no model (its RoutingTable)
                raise VisionServeError(
                    f"this server serves {len(names)} models ({', '.join(names)}) and none is the default "
                    "(DEFAULT_MODEL, or repository.json): name one (?model=NAME, or /v2/models/NAME/...)",
                    status=400, code="invalid_request", details={"models": names},
                    request_id=response.headers.get("X-Request-ID"))
            name = names[0] if names else None  # the only model is the default (a server that did not say so)
        entries = [m for m in models if m.get("name") == name]
        if not entries:
            raise VisionServeError("the server serves no model" + (f" {name!r}" if name else ""), status=404,
                                   code="not_found", request_id=response.headers.get("X-Request-ID"))
        try:
            return ModelInfo.from_json(next((m for m in entries if m.get("default")), entries[0]))
        except MISREAD as exc:
            raise invalid_response(response, exc) from None


def _params(model: str | None, version: str | None, top_k: int | None) -> dict[str, str]:
    """/predict's query parameters: the route, and ``top_k`` when given."""
    return {**_route(model, version), **({"top_k": str(top_k)} if top_k is not None else {})}


def _embed_params(model: str | None, version: str | None) -> dict[str, str]:
    """/predict's query parameters for embeddings: the route, and the embedding alone as the answer."""
    return {**_route(model, version), "outputs": "embedding"}


def _explain_params(model: str | None, version: str | None, label: str | None,
                    class_index: int | None) -> dict[str, str]:
    """/explain's query parameters: the route, and the class when named (by its label or its index)."""
    if label is not None and class_index is not None:
        raise ValueError("name the class by its label or by its index, not both")
    named = {"label": label} if label is not None else {}
    if class_index is not None:
        named = {"class_index": str(class_index)}
    return {**_route(model, version), **named}
