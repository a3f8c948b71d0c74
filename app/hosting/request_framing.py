"""A request as an HTTP worker's event loop reads it off the wire, before a thread or the app sees it: its limits,
how its body is framed, what the loop refuses from its head or its framing, and the reader the parser then reads the
held request from.

The loop (app/hosting/worker.py) reads the headers, then a body of known length up to ``max_body_bytes``
(``ReadLimits``, ``Reading``, ``head_framing``). A head the parser would refuse once more bytes came (a line ending in
a bare LF, a request line over gunicorn's limit, a head over ``MAX_HEADER_BYTES``) is refused at once (400, 414, 431:
``head_refusal``), never handed to a thread that would wait for those bytes; what gunicorn's parser refuses of a
whole head is answered in the service's JSON error shape (``parser_refusal``), as is a client too slow for its
headers or its body (408, ``timeout_response``). A chunked body's framing is followed and checked as it arrives
(``ChunkedBody``: malformed framing 400, its data over ``max_body_bytes`` 413) and held as it came, for the parser to
decode from memory; a client that announces ``Expect: 100-continue`` gets its ``100 Continue`` from the loop
(``CONTINUE``; gunicorn would say it again: ``continued_request``). Only a body announced over the limit (the app
refuses it from the headers alone) goes to a thread after its headers, as does a head whose framing only the parser
can judge (a repeated Content-Length, an unknown transfer coding: it refuses it from the head).

The thread's parser reads the request out of a ``HeldUnreader``, which copies each byte once (gunicorn's own
unreader copied everything it held on every read: quadratic in the body's size). What the app leaves unread of a body
held whole is skipped in memory before the next request on the connection, whatever its size (``skip_held_body``;
gunicorn's own skip reads the socket, gives up after 64 KiB and closes a connection its answer called kept alive: a
503 refusing a photo while the engine restarts was then followed by a reset of the client's next request).

Loaded by the gunicorn master with the worker class: gunicorn, the standard library and app.errors only (a refusal's
count imports app.metrics in the worker, when it is made: ``count_unparsed``).
"""
from __future__ import annotations

import contextlib
import json
import logging
import random
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from gunicorn.http import errors as http_errors
from gunicorn.http.body import CHUNK_EXT_RE, DEFAULT_MAX_CHUNK_SIZE_LINE
from gunicorn.http.unreader import SocketUnreader
from gunicorn.workers.gthread import TConn

from app.errors import ServiceError, default_body
from app.logs import ACCESS_LOGGER

HEADER_END = b"\r\n\r\n"
READ_SIZE = 1 << 20  # the most one read asks for: a body's rest in as few calls as possible (the GIL is contended)
FIRST_READ = 1 << 16  # a request's first read: its headers and a small body. Python allocates what a read asks for:
# a 1 MiB ask cost a small request 10-12 us (the allocation and its release), a 64 KB one 1 us
HELD_PIECE = 64 * 1024  # what a read of "the next chunk" (the header parser's) takes out of the held bytes
EMPTY_LINES = re.compile(rb"(?:\r\n)+")  # what may come before a request line (RFC 9112 2.2), skipped
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"  # what a client that sent Expect: 100-continue waits for
# A Host header's value: RFC 3986's host (a name, an IPv4 address or a bracketed IP literal) and port, or nothing
HOST_VALUE = re.compile(rb"(?:[A-Za-z0-9._~%!$&'()*+,;=-]+|\[[0-9A-Za-z:.%_~-]+\])?(?::[0-9]*)?")
LENGTH_DIGITS = 18  # the most digits a Content-Length may have (a body under an exabyte; more: 400 from the head)
HTTP_11_ON = re.compile(rb"HTTP/1\.[1-9]")  # a request version that may send a chunked body or expect 100 Continue
CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]+")
CODINGS = frozenset((b"chunked", b"identity", b"gzip", b"deflate", b"compress"))  # the transfer codings gunicorn takes
DECODED_CODINGS = frozenset((b"chunked", b"identity"))  # of those, the ones a body is read through: gunicorn passes
# a gzip, deflate or compress transfer coding's bytes on as they came (a body compressed with Content-Encoding is
# decompressed by the app, app/web/inputs.py)
MALFORMED = "the request body's framing is malformed: "  # as app/web/errors.py says it of what the parser refuses

log = logging.getLogger(ACCESS_LOGGER)  # the loop's own answers' access lines, as the app's
REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}\Z")  # a caller's X-Request-ID kept (\Z, not $: $ also matches
# before a final newline, and a header holding one cannot be sent)


def new_request_id() -> str:
    """A new request id: 128 random bits in hex from the process's generator, which random reseeds in each forked
    worker (os.urandom took a system call a request)."""
    return f"{random.getrandbits(128):032x}"


def request_id_of(incoming: str | None) -> str:
    """A request's id: the caller's X-Request-ID when it is sane, so logs can be joined across services; else a new
    one. Every answer says it (the app's, the starting app's, the worker's own)."""
    return incoming if incoming and REQUEST_ID.match(incoming) else new_request_id()


_REQUEST_ID_FIELD = re.compile(rb"\r\nX-Request-ID:[ \t]*([^\r\n]*?)[ \t]*(?=\r\n)", re.IGNORECASE)


def caller_request_id(head: bytes | bytearray) -> str | None:
    """The X-Request-ID a request's head (or as much of it as came: a field whose line has not ended is not read)
    says, where it says one once: what an answer made before the app or the parser read the head (a refusal, a
    timeout) is told by, as the app's are (``request_id_of`` keeps it only where it is sane)."""
    end = head.find(HEADER_END)
    found = _REQUEST_ID_FIELD.findall(head, 0, len(head) if end < 0 else end + len(HEADER_END))
    return found[0].decode("latin-1") if len(found) == 1 else None


@dataclass(frozen=True)
class ReadLimits:
    """The request limits the loop enforces (set from Settings in gunicorn.conf.py's post_fork)."""
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_body_bytes: int = 20 * 1024 * 1024
    linger_s: float = 0.002  # KEEPALIVE_LINGER_MS: a request thread's wait for its connection's next request
    answer_timeout_s: float = 30.0  # CLIENT_ANSWER_TIMEOUT_S: a client taking none of its answer this long is left
    request_line_limit: int = 8190  # gunicorn's limit_request_line (gunicorn.conf.py): a longer one is refused (414)
    head_limit: int = 64 * 1024  # MAX_HEADER_BYTES: a longer request head (line and headers) is refused (431)
    chunk_line_limit: int = DEFAULT_MAX_CHUNK_SIZE_LINE  # gunicorn's limit on a chunk-size line (its
    # limit_request_field_size, MAX_HEADER_BYTES in gunicorn.conf.py): a longer one is refused (400)
    body_min_rate: float = 0.0  # CLIENT_BODY_MIN_RATE: bytes a second a body must average past body_timeout_s (0: any)
    per_client: int = 0  # MAX_CONNECTIONS_PER_CLIENT: open connections from one client address (0: any number)



@dataclass(eq=False)
class Reading:
    """A connection whose request is still arriving."""
    conn: TConn
    header_deadline: float
    last_data: float
    buffer: bytearray = field(default_factory=bytearray)
    body_end: int | None = None  # header length + Content-Length, once the headers are in; for a chunked body, how
    # far the buffer must reach before its framing can be read on, then where it ends (``ChunkedBody.scan``)
    scanned: int = 0  # how much of the buffer the head's checks have seen (each byte looked at once)
    refusal: Refusal | None = None  # why the loop refuses the request (from its head, or its chunked framing)
    refuse_on_line: Refusal | None = None  # refused once its request line is in (its path: the error's shape)
    chunked: ChunkedBody | None = None  # a chunked body's framing, as far as it came
    continue_owed: bool = False  # the client waits for 100 Continue to send its body (told by the loop: ``_continue``)
    body_since: float = 0.0  # when its head was whole (time.monotonic()): the body's time counts from there
    to_parser: bool = False  # its head goes to the parser as it is (a body over the limit: the app's 413)

    def take(self, data: bytes) -> None:
        """``data`` added to what arrived; empty lines (CRLF) before the request line are skipped (RFC 9112 2.2): a
        connection that sent only those after its last answer holds no request, and stays idle."""
        buffer = self.buffer
        buffer += data
        if buffer.startswith(b"\r\n"):
            del buffer[:EMPTY_LINES.match(buffer).end()]  # type: ignore[union-attr]
            self.scanned = 0

    def left_mid_body(self, client: str | None) -> None:
        """Its client closed the connection (or reset it) after its head and before the end of its body: logged
        and counted as its leaving, status 499 (``count_unparsed``), not as a bad request; nothing is answered."""
        if self.body_end is None:  # its head was not whole: no request began
            return
        log.info("request", extra={"client": client, **head_fields(self.buffer), "status": 499,
                                   "error": "client_closed_request",
                                   "detail": "the client closed the connection while it sent its body",
                                   "request_id": request_id_of(caller_request_id(self.buffer))})
        count_unparsed(499)

    def wanted(self) -> int:
        """What the next read asks for: the rest of a body whose length is known, or of a chunk's data (at least
        FIRST_READ, at most READ_SIZE), else FIRST_READ."""
        if self.body_end is None:
            return FIRST_READ
        return min(max(self.body_end - len(self.buffer), FIRST_READ), READ_SIZE)



@dataclass(frozen=True)
class Framing:
    """How a body comes that is chunked or follows ``Expect: 100-continue`` (``head_framing``)."""
    chunked: bool
    length: int  # its Content-Length, when it is not chunked
    expects_continue: bool  # the client waits for 100 Continue before it sends the body



def head_framing(head: bytes) -> int | Framing | Refusal | None:
    """How a header block frames its body, where the loop reads it as gunicorn's parser will (gunicorn/http/message.py's
    set_body_reader): most heads, with neither Transfer-Encoding nor Expect, by the body's length alone (a missing
    Content-Length: 0); the others by a Framing: chunked (the last of its transfer codings and only there, each one a
    coding gunicorn takes, HTTP/1.1 and no Content-Length), else one Content-Length or none; after
    ``Expect: 100-continue`` or not (HTTP/1.0 ignores it). None for any other: the parser refuses it from its head (a
    repeated or malformed Content-Length, both framings, an unknown coding, another expectation). A Refusal where the
    head itself is refused that gunicorn would take: 400 for its Host fields or its Content-Length's digits
    (``_fields_refused``); 501 for a transfer coding gunicorn takes but does not undo (gzip, deflate,
    compress before chunked): its bytes would reach the app still compressed, read as the body (RFC 9112 6.1: 501
    for a coding the server does not implement)."""
    lines = head.split(b"\r\n")
    codings: list[bytes] = []
    lengths, expects = [], []
    hosts, host = 0, b""
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"host":
            hosts += 1
            host = value.strip(b" \t")
        elif name == b"content-length":
            lengths.append(value.strip())
        elif name == b"transfer-encoding":
            codings += (coding.strip(b" \t").lower() for coding in value.split(b","))
        elif name == b"expect":
            expects.append(value.strip(b" \t").lower())
    refused = _fields_refused(lines[0], hosts, host, lengths)
    if refused is not None:
        return refused
    if len(lengths) > 1 or (lengths and not lengths[0].isdigit()):
        return None
    length = int(lengths[0]) if lengths else 0
    if not (codings or expects):
        return length
    if any(expect != b"100-continue" for expect in expects):
        return None
    http_11 = HTTP_11_ON.fullmatch(lines[0].rpartition(b" ")[2]) is not None
    if codings and (lengths or not http_11 or codings[-1] != b"chunked" or codings.count(b"chunked") > 1
                    or not CODINGS.issuperset(codings)):
        return None
    if not DECODED_CODINGS.issuperset(codings):
        undone = b", ".join(sorted(set(codings) - DECODED_CODINGS)).decode()
        return Refusal(501, "Not Implemented", f"the transfer coding {undone} is not implemented: send the body "
                       "compressed with Content-Encoding: gzip or deflate instead, Transfer-Encoding chunked alone")
    return Framing(bool(codings), length, bool(expects) and http_11)



def _fields_refused(request_line: bytes, hosts: int, host: bytes, lengths: list[bytes]) -> "Refusal | None":
    """What ``head_framing`` refuses of a head's Host fields (``hosts`` of them, the last ``host``) and its
    Content-Length (``lengths``): none for an HTTP/1.1 request, two, or one that is no host[:port] (400: RFC 9112
    3.2, a server must); a length of more digits than any body needs (int() of 4,301 raised, and ended the
    worker with every connection it held)."""
    if hosts != 1 and (hosts or HTTP_11_ON.fullmatch(request_line.rpartition(b" ")[2]) is not None):
        return Refusal(400, "Bad Request", f"the request has {hosts or 'no'} Host header fields: HTTP/1.1 requests "
                       "carry exactly one, naming the server's host and port (RFC 9112 3.2)")
    if hosts and not HOST_VALUE.fullmatch(host):
        return Refusal(400, "Bad Request", "the Host header is no host[:port] (RFC 9112 3.2: a server must refuse "
                       "an invalid one)")
    if len(lengths) == 1 and lengths[0].isdigit() and len(lengths[0]) > LENGTH_DIGITS:
        return Refusal(400, "Bad Request", f"the Content-Length has {len(lengths[0])} digits, over "
                       f"{LENGTH_DIGITS}: no body is that long")
    return None


REQUEST_METHOD = re.compile(rb"([A-Z]{1,20}) /")  # a request line's method, as sent


def head_fields(head: bytes | bytearray) -> dict[str, str | None]:
    """The access line's ``method`` and ``route`` of a request the loop answers itself, as the app's lines have
    them: the method its request line says (None where it did not come), the route ``unparsed`` (as
    ``visionserve_requests_total`` counts it)."""
    line = REQUEST_METHOD.match(head)
    return {"method": line.group(1).decode() if line else None, "route": "unparsed"}


@dataclass(frozen=True)
class Refusal:
    """An answer the loop gives itself to a request it ends (a timeout) or refuses from its head or its chunked
    framing; the connection closes after it. Its code is its reason's (as app/web/errors.py names werkzeug's)."""
    status: int
    reason: str
    message: str
    retry_after_s: int | None = None  # its Retry-After header, where it has one

    @property
    def code(self) -> str:
        return self.reason.lower().replace(" ", "_")

    def tell(self, send: Callable[[bytes], object], client: str | None, path: str | None = None,
             head: bytes | bytearray = b"", cors: bytes = b"") -> None:
        """Send this answer by ``send``, a client gone meanwhile aside, log its access line and count it
        (``count_unparsed``); ``path``: the request's, where its head says it (its error shape); ``head``: as much
        of the request as came, whose X-Request-ID the answer says (``caller_request_id``), else a new id;
        ``cors``: the CORS header lines for the origin that head says (``response``)."""
        request_id = request_id_of(caller_request_id(head))
        with contextlib.suppress(OSError):
            send(self.response(request_id, path, cors))
        log.info("request", extra={"client": client, **head_fields(head), "status": self.status,
                                   "error": self.code, "detail": self.message, "request_id": request_id})
        count_unparsed(self.status)

    def response(self, request_id: str, path: str | None = None, cors: bytes = b"") -> bytes:
        """The answer in the error shape of its ``path`` (``error_body``), with its request id (as every answer has:
        the access line names it too) and ``cors``, the CORS header lines of its request's origin."""
        body = json.dumps(error_body(path, self.code, self.message, request_id)).encode()
        retry = b"" if self.retry_after_s is None else b"Retry-After: %d\r\n" % self.retry_after_s
        return (f"HTTP/1.1 {self.status} {self.reason}\r\n".encode()
                + b"Content-Type: application/json\r\nConnection: close\r\n" + retry + cors + b"X-Request-ID: "
                + request_id.encode() + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)



def is_v2(path: str | None) -> bool:
    """A path of the Open Inference Protocol's routes, whose errors are ``{"error": "<message>"}``."""
    return path is not None and (path == "/v2" or path.startswith("/v2/"))


def error_body(path: str | None, code: str, message: str, request_id: str) -> dict[str, Any]:
    """An error answered before the app, in the shape the app answers ``path`` in (the OpenAPI document's): under
    /v2 the protocol's, elsewhere the service's (``default_body``)."""
    if is_v2(path):
        return {"error": message}
    error = ServiceError(message)
    error.code = code
    return default_body(error, request_id)


def target_path(head: bytes | bytearray) -> str | None:
    """The path a request head's request line targets (its query left out), or None where no such line is there."""
    end = head.find(b"\n")  # (a head refused for its bare LF says its path too)
    parts = bytes(head[:end if end >= 0 else len(head)]).rstrip(b"\r").split(b" ")
    if len(parts) != 3 or not parts[1].startswith(b"/"):
        return None
    return parts[1].partition(b"?")[0].decode("latin-1")


def count_unparsed(status: int) -> None:
    """A request answered before the app (refused from its head, or timed out) in ``visionserve_requests_total``,
    endpoint ``unparsed``. app.metrics is imported here, in the worker: the master loads this module before it sets
    PROMETHEUS_MULTIPROC_DIR, and prometheus-client chooses its multiprocess mode once, on its import."""
    from app.metrics import REQUESTS, UNPARSED, series

    series(REQUESTS, UNPARSED, str(status)).inc()



# What gunicorn's parser refuses once a head is whole, as gunicorn answers it (its status and reason), written in the
# service's JSON error shape instead of its HTML page. Most specific first: the first class an error is wins.
PARSER_REFUSALS: tuple[tuple[type[Exception], int, str], ...] = (
    (http_errors.LimitRequestLine, 414, "URI Too Long"),
    (http_errors.LimitRequestHeaders, 431, "Request Header Fields Too Large"),
    (http_errors.ExpectationFailed, 417, "Expectation Failed"),
    (http_errors.UnsupportedTransferCoding, 501, "Not Implemented"),
    (http_errors.ForbiddenProxyRequest, 403, "Forbidden"),
    ((http_errors.InvalidRequestLine, http_errors.InvalidRequestMethod, http_errors.InvalidHTTPVersion,  # type: ignore
      http_errors.InvalidHeader, http_errors.InvalidHeaderName, http_errors.ObsoleteFolding,
      http_errors.InvalidProxyLine, http_errors.InvalidSchemeHeaders, http_errors.InvalidChunkSize,
      http_errors.ChunkMissingTerminator, http_errors.InvalidChunkExtension), 400, "Bad Request"),
)



# gunicorn's words for what it refuses most, and what they mean to a client (by its message)
_SAID = {
    "Invalid HTTP Header: 'CONTENT-LENGTH'": "the Content-Length header is invalid: not a whole number, given twice, "
                                            "or beside Transfer-Encoding (a body is framed by one or the other)",
    "Invalid HTTP Header: 'TRANSFER-ENCODING'": "the Transfer-Encoding header is invalid: chunked must be its last "
                                                "coding, and given once",
    "limit request headers fields": "the request has more header fields than the server takes (gunicorn's "
                                    "limit_request_fields, 100 by default)",
    "limit request headers fields size": "a header field is over the server's size limit (gunicorn's "
                                         "limit_request_field_size, 8190 bytes by default)",
}


def parser_refusal(exc: BaseException) -> Refusal | None:
    """The answer to a request gunicorn's parser refused (``PARSER_REFUSALS``), in words a client can act on where
    gunicorn's are its own (``_SAID``); None for any other error."""
    for kinds, status, reason in PARSER_REFUSALS:
        if isinstance(exc, kinds):
            said = str(exc) or reason
            return Refusal(status, reason, _SAID.get(said, said))
    return None



def timeout_response(message: str, request_id: str) -> bytes:
    """A 408 in the service's error shape; the connection closes after it."""
    return Refusal(408, "Request Timeout", message).response(request_id)



def head_refusal(buffer: bytearray, start: int, end: int, line_limit: int, head_limit: int) -> Refusal | None:
    """What the loop refuses of a request head from its bytes so far (looked at from ``start`` on; ``end``: where
    HEADER_END starts, -1 before it came): a line ending in a bare LF (400), a request line longer than
    ``line_limit`` (414, 0: no limit) or a head longer than ``head_limit`` (431). gunicorn's parser refuses these
    too, but a thread waits on the socket (blocking, no timeout) for more bytes first: for a head over 64 KiB up to
    its own limit (about 800 KiB), for a head that ends its lines in LF alone for ever."""
    stop = len(buffer) if end < 0 else end + len(HEADER_END)
    if buffer.count(b"\n", start, stop) != buffer.count(b"\r\n", max(start - 1, 0), stop):
        return Refusal(400, "Bad Request", "a line of the request head ends in a bare LF, not CRLF (RFC 9112 2.2)")
    if 0 < line_limit and stop >= line_limit + 2 and buffer.find(b"\r\n", 0, line_limit + 2) < 0:
        return Refusal(414, "URI Too Long", f"the request line is over the {line_limit} byte limit")
    if stop > head_limit:
        return Refusal(431, "Request Header Fields Too Large",
                       f"the request line and headers are over the {head_limit} byte limit (MAX_HEADER_BYTES)")
    return None



def malformed(exc: http_errors.ParseException) -> Refusal:
    """The loop's answer to chunked framing gunicorn's parser would refuse (``exc``: its error, which says why)."""
    return Refusal(400, "Bad Request", f"{MALFORMED}{exc}")



def chunk_size(line: bytes) -> int | Refusal:
    """The size a chunk-size line (its CRLF aside) says, checked as gunicorn's parser checks it (ChunkedReader's
    parse_chunk_size: hex digits, then chunk extensions, RFC 9112 7.1.1), or why it is refused."""
    size, *extension = line.split(b";", 1)
    if extension:
        if b"\r" in extension[0]:
            return malformed(http_errors.InvalidChunkExtension("bare CR not allowed"))
        size = size.rstrip(b" \t")
    if not CHUNK_SIZE.fullmatch(size):
        return malformed(http_errors.InvalidChunkSize(size))
    if extension and not CHUNK_EXT_RE.fullmatch(b";" + extension[0]):
        return malformed(http_errors.InvalidChunkExtension("invalid chunk extension"))
    return int(size, 16)



@dataclass(eq=False)
class ChunkedBody:
    """A chunked body's framing (RFC 9112 7.1) as the loop reads it, from the buffer's ``line`` on: chunk-size lines,
    each chunk's data and its CRLF, then the trailer section up to its empty line. Checked as gunicorn's parser
    checks it, so that the held bytes are the request it will read (``chunk_size``); a line ending in a bare LF is
    refused at once, as in a head. Bounded: the chunks' data by ``max_body_bytes`` and the framing (the chunk-size
    lines and CRLFs) by as much again (413), a chunk-size line by ``chunk_line_limit`` (400) and the trailer section
    by ``head_limit`` (431). Each byte of a line is looked at once; a chunk's data not at all."""
    line: int  # where the line read next starts: a chunk-size line, or one of the trailer section's
    scanned: int = 0  # how far the buffer was searched for that line's end
    data: int = 0  # the chunks' data so far: the body's length as the app will read it
    framing: int = 0  # the chunk-size lines and CRLFs so far
    data_end: int | None = None  # where the chunk being read ends (its CRLF next), until that CRLF came
    trailers: int | None = None  # where the trailer section starts, once the last chunk (size 0) came
    end: int | None = None  # where the body ends, once it came whole

    def scan(self, buffer: bytearray, limits: ReadLimits) -> int | Refusal:
        """The framing read on as far as ``buffer`` goes: the body's end once it is whole, else how long the buffer
        must be before it can be read on (``Reading.body_end``); or why it is refused."""
        while self.end is None:
            if self.data_end is not None:  # a chunk's data, then its CRLF
                crlf = self.data_end
                if len(buffer) < crlf + 2:
                    return crlf + 2
                if buffer[crlf:crlf + 2] != b"\r\n":
                    return malformed(http_errors.ChunkMissingTerminator(bytes(buffer[crlf:crlf + 2])))
                self.line = self.scanned = crlf + 2
                self.data_end, self.framing = None, self.framing + 2
            line_end = buffer.find(b"\n", max(self.scanned, self.line))
            if line_end < 0:  # the line goes on past what came
                self.scanned = len(buffer)
                if self.trailers is not None and len(buffer) - self.trailers > limits.head_limit:
                    return trailers_too_long(limits)
                if self.trailers is None and len(buffer) - self.line > limits.chunk_line_limit + 1:  # (+ its CR)
                    return chunk_line_too_long(limits)
                return len(buffer) + 1
            if line_end == self.line or buffer[line_end - 1] != 0x0D:
                return Refusal(400, "Bad Request", f"{MALFORMED}a line ends in a bare LF, not CRLF (RFC 9112 2.2)")
            line = bytes(buffer[self.line:line_end - 1])
            self.line = self.scanned = line_end + 1
            if self.trailers is not None:  # a trailer field, or the empty line that ends the body
                if self.line - self.trailers > limits.head_limit:
                    return trailers_too_long(limits)
                if not line:
                    self.end = self.line
                continue
            if len(line) > limits.chunk_line_limit:
                return chunk_line_too_long(limits)
            size = chunk_size(line)
            if isinstance(size, Refusal):
                return size
            self.framing += len(line) + 2
            if size == 0:
                self.trailers = self.line
                continue
            self.data += size
            if self.data > limits.max_body_bytes or self.framing > limits.max_body_bytes:
                what = "body" if self.data > limits.max_body_bytes else "body's chunked framing"
                return Refusal(413, "Request Entity Too Large",
                               f"the request {what} is over the {limits.max_body_bytes} byte limit")
            self.data_end = self.line + size
        return self.end



def chunk_line_too_long(limits: ReadLimits) -> Refusal:
    """A chunk-size line over ``chunk_line_limit``: 400, as gunicorn's parser says it."""
    return malformed(http_errors.InvalidChunkSize(b"line over %d bytes" % limits.chunk_line_limit))



def trailers_too_long(limits: ReadLimits) -> Refusal:
    """A trailer section over ``head_limit`` (MAX_HEADER_BYTES), as a head over it: 431."""
    return Refusal(431, "Request Header Fields Too Large",
                   f"the request's trailer section is over the {limits.head_limit} byte limit (MAX_HEADER_BYTES)")



class HeldUnreader(SocketUnreader):
    """gunicorn's socket unreader for a connection whose request the loop read whole: the bytes are held as they
    came and each read hands out a slice of them, then reads the socket as gunicorn's does.

    gunicorn's Unreader keeps what it holds in a BytesIO and, on every read, copies all of it out and the rest back
    in: a body the app reads in pieces is copied over and over, quadratic in its size, which a base64 JSON request
    for a large photo makes costly (docs/performance.md: Figures behind the code's choices). Here each byte is
    copied once, into the slice that returns it. An unread of bytes just handed out (the header parser's surplus)
    steps back instead of copying. A request the loop read whole (``unread_request``) gives the header parser its
    head alone: given a piece of the body behind it, the parser copied that piece six times over (26 us a 100 KB
    photo's request) before it gave it back.
    """

    def __init__(self, sock: Any) -> None:
        super().__init__(sock)
        self._held = b""
        self._at = 0  # where the next read starts in _held
        self._head_end = 0  # where the next read ends at most (the end of the head of a request held whole), or 0

    def unread_request(self, data: bytes | bytearray) -> None:
        """``data``, a request (its head, then its body or a part of it), held: the next read gives its head alone."""
        self.unread(data)
        end = self._held.find(HEADER_END, self._at, self._at + HELD_PIECE)
        self._head_end = end + len(HEADER_END) if end >= 0 else 0

    def unread(self, data: bytes | bytearray) -> None:
        if not data:
            return
        n = len(data)
        if n <= self._at and self._held[self._at - n:self._at] == data:  # the same bytes come next either way
            self._at -= n
            return
        self._held = b"".join((data, memoryview(self._held)[self._at:]))  # before anything still held
        self._at = 0

    def read(self, size: int | None = None, read_ahead: int | None = None) -> bytes:
        if size is not None and (not isinstance(size, int) or size < 0):
            return super().read(size, read_ahead)  # gunicorn's checks and meanings (TypeError; < 0: a chunk)
        left = len(self._held) - self._at
        if not left or size == 0:
            return super().read(size, read_ahead)
        take = min(left, HELD_PIECE if size is None else size)
        if self._head_end:  # (a read of a size takes it whole: the rest of it is held, not on the socket)
            take, self._head_end = (min(take, self._head_end - self._at) if size is None else take), 0
        piece = self._held[self._at:self._at + take]
        self._at += take
        if self._at == len(self._held):  # all handed out: an idle kept-alive connection holds nothing
            self._held, self._at = b"", 0
        if size is not None and take < size:  # the rest from the socket (gunicorn's read: its buffer, then recv)
            piece += super().read(size - take, read_ahead)
        return piece

    def take_buffered(self) -> bytes:
        held = self._held[self._at:]
        self._held, self._at = b"", 0
        return held + super().take_buffered()



def continued_request(parser: Any, *args: Any) -> Any:
    """The request whose ``100 Continue`` the loop said (``BufferingWorker._continue``), made by ``parser`` as any:
    gunicorn would say it again before the app runs (its wsgi.create), to a client whose body is in already. The
    parser's next requests are its class's own again."""
    del parser.mesg_class
    request = type(parser).mesg_class(*args)
    request._expected_100_continue = False
    return request



def skip_held_body(parser: Any) -> bool:
    """Read past what the app left of the current request's body, all of it held in memory (no socket read:
    the body's reader asks for its remaining length, which is held); False when reading it had failed."""
    body = getattr(parser.mesg, "body", None)
    if body is None:
        return True
    if getattr(body, "failed", False) is True:  # where the next request starts is unknown
        return False
    while body.read(HELD_PIECE):
        pass
    return True

