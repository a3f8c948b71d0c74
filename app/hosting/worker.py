"""gunicorn's gthread worker, changed so that a slow client costs a connection, never a thread.

gunicorn hands a connection to a thread as soon as its first byte arrives; the thread then blocks reading the rest
of the headers and the body. Enough clients sending one byte a second hold every thread, and every other request
times out, for slow headers and slow bodies alike (docs/performance.md: Figures behind the code's choices).
Here the event loop reads each request itself, as a buffering proxy would: the headers, then a body of known
length up to ``max_body_bytes``, and only a whole request goes to a thread (the parser then reads it from memory).
A client that takes longer than ``client_header_timeout_s`` for its headers, or stays silent longer than
``client_body_timeout_s`` in its body, gets ``408`` and the connection closes. A head the parser would refuse once
more bytes came (a line ending in a bare LF, a request line over gunicorn's limit, a head over ``MAX_HEADER_BYTES``)
is refused by the loop at once (400, 414, 431), never handed to a thread that would wait for those bytes; empty lines
before a request line are skipped (RFC 9112 2.2: a client may send one after a body). A chunked body is read by
the loop too, its framing followed and checked as it arrives (``ChunkedBody``: malformed framing 400, its data over
``max_body_bytes`` 413) and held as it came, for the parser to decode from memory; a client that announces
``Expect: 100-continue`` (it waits for the 100 before sending its body) gets its ``100 Continue`` from the loop,
which then reads that body as any (``body_framing``). Only a body announced over the limit (the app refuses it from
the headers alone) goes to a thread after its headers, as does a head whose framing only the parser can judge (a
repeated Content-Length, an unknown transfer coding: it refuses it from the head). The thread's parser reads the
request out of a ``HeldUnreader``, which copies each byte once (gunicorn's own unreader copied everything it held on
every read: quadratic in the body's size). What the app leaves unread of a body held whole is skipped in memory
before the next request on the connection, whatever its size (gunicorn's own skip reads the socket, gives up after
64 KiB and closes a connection its answer called kept alive: a 503 refusing a photo while the engine restarts was
then followed by a reset of the client's next request).

Under ENGINE=process a request read whole runs on the loop itself, as a greenlet, not on a thread
(app/hosting/loop_requests.py, ``LOOP_REQUESTS``). Every answer is written without blocking (``ClientSocket``): what
the client does not take at once, a loop request waits for on the loop and a request thread leaves to the loop to
write (``finish_request``), the thread going on; a client that stops reading holds its connection, and after
``answer_timeout_s`` without progress loses it. A connection closed after its answer lingers for the client's end
on the loop (``close_gracefully``), not in a blocking read.

``NoAccessLog`` is gunicorn's logger without its access line: the app writes one structured line per request.

The master loads these classes: they import gunicorn, greenlet and the standard library only (and app.errors and
app.hosting's control, waiting and loop_requests, which are plain); a refusal's count imports app.metrics in the
worker, when it is made (``count_unparsed``).
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import resource
import select
import selectors
import socket
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable

from greenlet import getcurrent
from gunicorn import util as gunicorn_util
from gunicorn.glogging import Logger
from gunicorn.http import errors as http_errors
from gunicorn.http import get_parser
from gunicorn.http.body import CHUNK_EXT_RE, DEFAULT_MAX_CHUNK_SIZE_LINE
from gunicorn.http.unreader import SocketUnreader
from gunicorn.workers.gthread import STOP_KEEPALIVE_LINGER, TConn, ThreadWorker

from app.errors import ServiceError, default_body
from app.hosting import control, waiting
from app.hosting.loop_requests import LoopRequests

HEADER_END = b"\r\n\r\n"
READ_SIZE = 1 << 20  # the most one read asks for: a body's rest in as few calls as possible (the GIL is contended)
FIRST_READ = 1 << 16  # a request's first read: its headers and a small body. Python allocates what a read asks for:
# a 1 MiB ask cost a small request 10-12 us (the allocation and its release), a 64 KB one 1 us
HELD_PIECE = 64 * 1024  # what a read of "the next chunk" (the header parser's) takes out of the held bytes
HEAD_JOINED_BYTES = 64 * 1024  # an answer's first piece up to which its head goes out in the same send (one copy):
# on loopback each send delivers to the reader on the sender's CPU, 7 us more a small answer for two sends than one
CLOSE_LINGER_S = 2.0  # a connection's graceful close reads what the client still sends for this long at most
CLOSE_DRAIN_BYTES = 64 * 1024  # and this much at most (gunicorn's close_graceful, on the loop without blocking)
EMPTY_LINES = re.compile(rb"(?:\r\n)+")  # what may come before a request line (RFC 9112 2.2), skipped
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"  # what a client that sent Expect: 100-continue waits for
HTTP_11_ON = re.compile(rb"HTTP/1\.[1-9]")  # a request version that may send a chunked body or expect 100 Continue
CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]+")
INTERIM_ANSWER = re.compile(rb"HTTP/1\.[0-9] 1[0-9][0-9] ")  # a 1xx (103 Early Hints): sent as it comes, not held
_DONTWAIT = int(socket.MSG_DONTWAIT)  # a plain int: or-ing the flag enum makes a new enum member at every send
CODINGS = frozenset((b"chunked", b"identity", b"gzip", b"deflate", b"compress"))  # the transfer codings gunicorn takes
MALFORMED = "the request body's framing is malformed: "  # as app/web/errors.py says it of what the parser refuses
# accept(2)'s errors that end one connection before it was taken (Linux passes a pending network error on as accept's;
# EPERM: a firewall refused it): the listener is asked again for the next one
ACCEPT_GONE = frozenset(getattr(errno, name) for name in (
    "EAGAIN", "EWOULDBLOCK", "ECONNABORTED", "EINTR", "EPROTO", "EPERM", "ENETDOWN", "ENETUNREACH", "ENOPROTOOPT",
    "EHOSTDOWN", "EHOSTUNREACH", "EOPNOTSUPP", "ENONET") if hasattr(errno, name))
# and those that say there is no room for one more connection now (the open-file limit, the system's, memory)
ACCEPT_NO_ROOM = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))
HELD_ANSWER_BYTES = 16 << 20  # the most of an answer a request thread leaves to the loop to write (the rest of one
# the app made whole is held anyway; one streamed in pieces beyond this, the thread writes as the client reads it)
ACCEPT_PAUSE_S = 0.1  # out of file descriptors: new connections wait in the listen backlog this long, the loop
# serving the open ones, before it accepts again (as the engine's loop, app/link/loop.py)
ACCEPT_WARN_EVERY_S = 60.0  # the warning that it paused, at most this often
OWN_FILES = 64  # what a worker opens beside its clients' connections (its listeners, poller and pipes, metrics files,
# its engine connections beyond THREADS): 10 measured in an idle inline worker, with room

log = logging.getLogger("visionserve.access")


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
    chunked: ChunkedBody | None = None  # a chunked body's framing, as far as it came
    continue_owed: bool = False  # the client waits for 100 Continue to send its body (told by the loop: ``_continue``)

    def take(self, data: bytes) -> None:
        """``data`` added to what arrived; empty lines (CRLF) before the request line are skipped (RFC 9112 2.2): a
        connection that sent only those after its last answer holds no request, and stays idle."""
        buffer = self.buffer
        buffer += data
        if buffer.startswith(b"\r\n"):
            del buffer[:EMPTY_LINES.match(buffer).end()]  # type: ignore[union-attr]
            self.scanned = 0

    def wanted(self) -> int:
        """What the next read asks for: the rest of a body whose length is known, or of a chunk's data (at least
        FIRST_READ, at most READ_SIZE), else FIRST_READ."""
        if self.body_end is None:
            return FIRST_READ
        return min(max(self.body_end - len(self.buffer), FIRST_READ), READ_SIZE)


@dataclass(frozen=True)
class Framing:
    """How a body comes that is chunked or follows ``Expect: 100-continue`` (``body_framing``)."""
    chunked: bool
    length: int  # its Content-Length, when it is not chunked
    expects_continue: bool  # the client waits for 100 Continue before it sends the body


def body_framing(head: bytes) -> int | Framing | None:
    """How a header block frames its body, where the loop reads it as gunicorn's parser will (gunicorn/http/message.py's
    set_body_reader): most heads, with neither Transfer-Encoding nor Expect, by the body's length alone (a missing
    Content-Length: 0); the others by a Framing: chunked (the last of its transfer codings and only there, each one a
    coding gunicorn takes, HTTP/1.1 and no Content-Length), else one Content-Length or none; after
    ``Expect: 100-continue`` or not (HTTP/1.0 ignores it). None for any other: the parser refuses it from its head (a
    repeated or malformed Content-Length, both framings, an unknown coding, another expectation)."""
    lines = head.split(b"\r\n")
    codings: list[bytes] = []
    lengths, expects = [], []
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            lengths.append(value.strip())
        elif name == b"transfer-encoding":
            codings += (coding.strip(b" \t").lower() for coding in value.split(b","))
        elif name == b"expect":
            expects.append(value.strip(b" \t").lower())
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
    return Framing(bool(codings), length, bool(expects) and http_11)


@dataclass(frozen=True)
class Refusal:
    """An answer the loop gives itself to a request it ends (a timeout) or refuses from its head or its chunked
    framing; the connection closes after it. Its code is its reason's (as app/web/errors.py names werkzeug's)."""
    status: int
    reason: str
    message: str

    @property
    def code(self) -> str:
        return self.reason.lower().replace(" ", "_")

    def tell(self, send: Callable[[bytes], object], client: str | None) -> None:
        """Send this answer (under a new request id) by ``send``, a client gone meanwhile aside, log its access
        line and count it (``count_unparsed``)."""
        request_id = uuid.uuid4().hex
        with contextlib.suppress(OSError):
            send(self.response(request_id))
        log.info("request", extra={"client": client, "status": self.status, "error": self.code,
                                   "detail": self.message, "request_id": request_id})
        count_unparsed(self.status)

    def response(self, request_id: str) -> bytes:
        """The answer in the service's error shape, with its request id (as every answer has: the access line names
        it too)."""
        error = ServiceError(self.message)
        error.status, error.code = self.status, self.code
        body = json.dumps(default_body(error, request_id)).encode()
        return (f"HTTP/1.1 {self.status} {self.reason}\r\n".encode()
                + b"Content-Type: application/json\r\nConnection: close\r\nX-Request-ID: " + request_id.encode()
                + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


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


def parser_refusal(exc: BaseException) -> Refusal | None:
    """The answer to a request gunicorn's parser refused (``PARSER_REFUSALS``); None for any other error."""
    for kinds, status, reason in PARSER_REFUSALS:
        if isinstance(exc, kinds):
            return Refusal(status, reason, str(exc) or reason)
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


class NoAccessLog(Logger):
    """gunicorn's logger, its access log off. The app writes one structured line per request itself
    (visionserve.access); gunicorn counts a ``logconfig_dict`` as access logging on and built every request's log
    atoms (about 4% of an HTTP worker's CPU per request, sampled) for a logger that dropped them."""

    def access(self, resp: Any, req: Any, environ: Any, request_time: Any) -> None:
        """Nothing: the app's own access line is the one."""


class ClientSocket(socket.socket):
    """A client's connection, whose answer is written without blocking (``sendall``): the part the socket's buffer
    takes at once, then the rest as the client reads it. A request thread's rest is held (``unsent``) and the thread
    goes on: once it is done with the connection, the worker's loop writes it (``BufferingWorker.finish_request``),
    so a client that stops reading holds its connection, not a thread; beyond HELD_ANSWER_BYTES (an answer streamed
    in pieces) the thread writes what it holds itself. A loop request hands its wait to the loop; a socket no
    worker's loop writes for (``loop_writes`` off) waits by polling. Either way at most ``answer_timeout_s`` without
    progress. An answer's head (gunicorn writes it apart, as its first write) is held and goes out with the answer's
    first piece of body, in one send (``answer_begins``, ``answer_ends``)."""

    __slots__ = ("answer_timeout_s", "body_held", "loop_writes", "unsent", "head_next", "head", "stays_nonblocking")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.answer_timeout_s, self.body_held = ReadLimits.answer_timeout_s, False
        self.stays_nonblocking = False  # while a request held whole runs on the loop (``_handle_one``)
        self.loop_writes = False  # a request thread leaves the rest of its answer to the worker's loop
        self.unsent: bytearray | None = None  # that rest, until the loop has written it
        self.head_next = False  # the next write is an answer's first: its head, held (``head``) for what follows
        self.head: bytes | None = None

    def setblocking(self, flag: bool) -> None:
        self.settimeout(None if flag else 0.0)  # (what socket.setblocking does, through the check below)

    def settimeout(self, value: float | None) -> None:
        """socket's, without the system call when the socket has that mode already, nor for a blocking mode asked for
        while its request runs on the worker's loop (``stays_nonblocking``: gthread's ``handle`` sets the socket
        blocking, its parser sets the timeout it found again, and its ``finish_request`` sets it non-blocking, three
        calls of ioctl a request): such a request reads nothing from the socket (its body is held) and writes
        without blocking, and a blocking read there would hold up the loop's every request."""
        if value == self.gettimeout() or (self.stays_nonblocking and value != 0.0):
            return
        super().settimeout(value)

    def answer_begins(self) -> None:
        """The next write is an answer's first (gunicorn's head, or an error answer whole): held for the next."""
        self.head_next, self.head = True, None

    def answer_ends(self) -> None:
        """The answer is written: a head still held (no body followed it: a HEAD request's, a 204's) goes now."""
        self.head_next = False
        if self.head is not None:
            head, self.head = self.head, None
            self._write(memoryview(head), 0)

    def shutdown(self, how: int) -> None:
        """A head still held goes out before the write side closes: gunicorn closes a connection whose app failed
        once the head was written, and for an answer without a body that head is all of it."""
        if self.head is not None and how != socket.SHUT_RD:
            with contextlib.suppress(OSError):
                self.answer_ends()
        super().shutdown(how)

    def sendall(self, data: Any, flags: int = 0) -> None:  # type: ignore[override]
        view = memoryview(data).cast("B")
        if self.head_next and not INTERIM_ANSWER.match(bytes(view[:13])):
            self.head_next, self.head = False, bytes(view)
            return
        if self.head is not None:  # the head held, then this answer's first piece of body: one send for both
            head, self.head = self.head, None
            if len(view) <= HEAD_JOINED_BYTES:
                view = memoryview(head + view)
            else:
                self._write(memoryview(head), flags)
        self._write(view, flags)

    def _write(self, view: memoryview, flags: int) -> None:
        if self.gettimeout():  # a body read from the socket had one (app/web/hooks.py): Python would poll before a
            self.settimeout(None)  # send for that long, whatever its flags, then raise instead of waiting here
        unsent = self.unsent
        if unsent is not None:  # behind what is held already, in order
            if len(unsent) + len(view) <= HELD_ANSWER_BYTES:
                unsent += view
                return
            self.unsent = None  # a streamed answer beyond what is held: written here, as the client reads it
            self._send(memoryview(unsent), flags, may_hold=False)
        self._send(view, flags, may_hold=True)

    def _send(self, view: memoryview, flags: int, may_hold: bool) -> None:
        """``view`` written without blocking: what the socket takes at once, then the rest as the client reads it,
        waiting by ``waiting.wait_for`` (a loop request hands the wait to the loop; a thread polls),
        ``answer_timeout_s`` at most without progress; but with ``may_hold``, a request thread's rest is held for
        the loop to write (``unsent``) and the thread goes on."""
        while view:
            try:
                sent = self.send(view, flags | _DONTWAIT)
            except (BlockingIOError, InterruptedError):
                if may_hold and self.loop_writes and waiting.on_loop() is None:  # a request thread: the loop writes it
                    self.unsent = bytearray(view)
                    return
                if not waiting.wait_for(self, select.POLLOUT, self.answer_timeout_s, for_client=True):
                    self._leave()
                continue
            view = view[sent:]

    def _leave(self) -> None:
        """A client that took none of its answer for ``answer_timeout_s``: its connection ends (gunicorn closes it
        on the broken pipe, quietly; this says why)."""
        message = self.left()
        try:
            self.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        raise BrokenPipeError(errno.EPIPE, message)

    def left(self) -> str:
        """Say in the log that the client took none of its answer for ``answer_timeout_s`` (its connection ends);
        the line."""
        message = f"the client took none of its answer for {self.answer_timeout_s:g}s: its connection is closed"
        logging.getLogger(__name__).info(message)
        return message

    def sendfile(self, file: Any, offset: int = 0, count: int | None = None) -> int:
        """A file's bytes (the demo page's) through ``sendall``, a piece at a time: never a blocking write."""
        file.seek(offset)
        total = 0
        while count is None or total < count:
            piece = file.read(HELD_PIECE if count is None else min(HELD_PIECE, count - total))
            if not piece:
                break
            self.sendall(piece)
            total += len(piece)
        return total


class ClientConn(TConn):
    """gthread's connection, whose graceful close (after an answer that said ``Connection: close``) is its worker's
    ``close_gracefully``: the same half-close and drain, without blocking the event loop for up to 2 s."""

    closer: Callable[[socket.socket], None] | None = None

    def close(self, graceful: bool = False) -> None:
        if graceful and self.closer is not None:
            self.closer(self.sock)
            return
        super().close(graceful)


@dataclass(eq=False)
class Writing:
    """A connection whose request thread left the rest of its answer (``ClientSocket.unsent``) to the loop: written
    as the client reads it, then settled as the thread left it (``outcome``: its ``handle``'s)."""
    conn: TConn
    outcome: Any  # the request thread's future
    last_progress: float
    sent: int = 0  # how much of the rest went


@dataclass(eq=False)
class Closing:
    """A connection half-closed after its last answer: read until the client closes its end, CLOSE_DRAIN_BYTES
    have come or CLOSE_LINGER_S has passed, then closed (RFC 9112 9.6: no reset that would cut the answer short)."""
    sock: socket.socket
    deadline: float
    drained: int = 0


class BufferingWorker(LoopRequests, ThreadWorker):
    """gthread with requests read in the event loop (see the module's docstring)."""

    limits = ReadLimits()
    control_dir: Path | None = None  # CONTROL_DIR (gunicorn.conf.py's post_fork): the workers' ready marks
    loop_requests = False  # LOOP_REQUESTS under ENGINE=process (gunicorn.conf.py's post_fork)
    accept_paused_until = 0.0  # out of file descriptors: no accept before then (time.monotonic())
    accept_warned_at = -ACCEPT_WARN_EVERY_S  # when the last pause was said in the log
    held_back_draining = False  # the reason held back last said in the log: its drain, or not serving yet

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reading: set[Reading] = set()
        self.held_back = False  # new connections left to the workers that serve (said in the log once a reason)
        self.draining = False  # its drain began (app/hosting/drain.py): it takes new connections only if none serves
        self.closing: set[Closing] = set()  # connections half-closed after their last answer
        self.writing: set[Writing] = set()  # connections whose answer's rest the loop writes
        self.init_loop_requests()

    def init_process(self) -> None:
        """The loop's greenlet noted (app/hosting/loop_requests.py) and, with ``loop_requests``, every wait of a
        request on it handed to it; MAX_CONNECTIONS fitted to the open-file limit; then gthread's start (which runs
        the loop)."""
        self.loop_greenlet = getcurrent()
        if self.loop_requests:
            waiting.wait_on(self)
        self._fit_connections_to_file_limit()
        super().init_process()

    def _fit_connections_to_file_limit(self) -> None:
        """MAX_CONNECTIONS (gunicorn's worker_connections) with this worker's own files, within its open-file limit
        (``raise_file_limit``); where even the hard limit is below, it takes fewer connections at once, keeping room
        for its own files (a report, a metrics file, an engine connection), and says so. Past the limit accept fails
        (EMFILE), which pauses accepting (``_pause_accepting``)."""
        own = self.cfg.threads + OWN_FILES
        limit = raise_file_limit(self.worker_connections + own)
        if limit == resource.RLIM_INFINITY or limit >= self.worker_connections + own:
            return
        fitted = max(limit - own, 1)
        self.log.warning("worker %d may open %d files (ulimit -n), below the %d that MAX_CONNECTIONS=%d and its own "
                         "files need: it takes %d connections at once, the rest wait in the listen backlog; raise "
                         "the hard limit (LimitNOFILE, docker run --ulimit nofile) or lower MAX_CONNECTIONS",
                         os.getpid(), limit, self.worker_connections + own, self.worker_connections, fitted)
        self.worker_connections = fitted
        self.max_keepalived = min(self.max_keepalived, fitted - self.cfg.threads)  # gthread's room for active ones

    def enqueue_req(self, conn: TConn) -> None:
        """A request the loop read whole runs on the loop itself (``loop_requests``: ``run_on_loop``); any other (a
        body announced over the limit, a head the parser refuses) goes to a request thread, as in gthread."""
        if (self.loop_requests and getattr(conn, "prefetched", None) and conn.body_held
                and getcurrent() is self.loop_greenlet):
            self.run_on_loop(conn)
            return
        super().enqueue_req(conn)

    def set_accept_enabled(self, enabled: bool) -> None:
        """gthread's, but a worker that does not serve (a killed one's replacement, importing the app and loading or
        reaching its models; one whose engine restarts; or one draining: a HUP's old worker, one told to stop alone)
        takes no new connection while another worker serves: they wait in the shared listen backlog for a worker
        that answers them, instead of a 503 from this one. gthread's loop asks again each turn (a second apart at
        most) until it serves, or no other does; one that takes connections is asked at each (``accept``). A server
        starting (no worker serves) takes them all, each worker answering 503 while it loads; so does a server
        stopping (every worker draining), until each closes its listener, and one whose only engine restarts. Nor
        does one while its pause after running out of file descriptors lasts (``_pause_accepting``)."""
        if enabled and time.monotonic() < self.accept_paused_until:
            return
        if enabled and self._another_serves_instead():
            self._hold_back()
            return
        if enabled and self.held_back:
            self.held_back = False
            if self.draining:
                self.log.info("worker %d drains and no other worker serves: taking new connections", os.getpid())
            elif self._marked():
                self.log.info("worker %d serves: taking new connections", os.getpid())
            else:  # none serves: its one engine restarts, or the worker that served drains
                self.log.info("worker %d takes new connections: no worker serves (503 until one does)", os.getpid())
        super().set_accept_enabled(enabled)

    def _marked(self) -> bool:
        """This worker's ready mark is there: it serves."""
        try:
            return self.control_dir is not None and control.ready_mark(self.control_dir, os.getpid()).exists()
        except OSError:
            return False

    def _hold_back(self) -> None:
        """New connections left in the listen backlog to the workers that serve (said in the log once a reason: a
        worker held back while it loaded, then told to stop before its loop asked again, says it drains)."""
        if not self.held_back or self.held_back_draining != self.draining:
            self.held_back, self.held_back_draining = True, self.draining
            if self.draining:
                self.log.info("worker %d drains: new connections go to the workers that serve", os.getpid())
            else:
                self.log.info("worker %d takes new connections once it serves (another worker serves them)",
                              os.getpid())
        super().set_accept_enabled(False)

    def leaves_backlog(self) -> bool:
        """Whether this worker's drain, at its end, leaves the listen backlog to another: a worker serves still
        (asked then: when every other one has begun its drain too, this one takes its share, answered, rather than
        leaving it to be reset when the last listener closes)."""
        return self._another_serves_instead()

    def _another_serves_instead(self) -> bool:
        """This worker does not serve (not yet, or no longer: draining, or its engine restarting) and another live
        one does (CONTROL_DIR's ready marks)."""
        return self.control_dir is not None and not control.takes_connections(self.control_dir, os.getpid())

    def accept(self, listener: Any) -> None:
        """A new connection waits in the loop for its request (app/hosting/drain.py counts on nr_conns growing by
        one). A worker that does not serve takes none while another worker serves: it holds back
        (``set_accept_enabled``). Asked here, at each connection, for gthread asks ``set_accept_enabled`` only when
        accepting should change for its own reasons: a worker that began taking them while none served (a server
        starting), or that served until its drain or its engine's end, would take them for good."""
        if getattr(listener, "sock", listener) is None:
            # Closed by app/hosting/drain.py's last step, which ran earlier in the same poller turn that found it
            # readable (gthread's accept raised here: the worker died and its open connections were reset).
            return
        if self._another_serves_instead():
            self._hold_back()
            return
        try:
            accepted, client = listener.accept()
        except OSError as exc:
            if exc.errno in ACCEPT_NO_ROOM:
                self._pause_accepting(exc)
            elif exc.errno not in ACCEPT_GONE:
                raise
            return
        sock = ClientSocket(accepted.family, accepted.type, accepted.proto, fileno=accepted.detach())
        sock.answer_timeout_s, sock.loop_writes = self.limits.answer_timeout_s, True
        self.nr_conns += 1
        conn = ClientConn(self.cfg, sock, client, listener.getsockname())  # non-blocking
        conn.closer = self.close_gracefully
        self._start_reading(conn)

    def _pause_accepting(self, exc: OSError) -> None:
        """No room for one more connection (EMFILE: the open-file limit; ENFILE, ENOBUFS, ENOMEM): new connections
        wait in the listen backlog for ACCEPT_PAUSE_S while the loop serves the open ones, instead of the worker's
        end (gthread's accept raised: every connection it held was reset, and the backlog did the same to its
        replacement). Said in the log once a minute at most."""
        now = time.monotonic()
        if now - self.accept_warned_at >= ACCEPT_WARN_EVERY_S:
            self.accept_warned_at = now
            self.log.warning("worker %d cannot accept a connection (%s) with %d open: new connections wait %.0f ms "
                             "at a time; raise the open-file limit (ulimit -n, LimitNOFILE) or lower "
                             "MAX_CONNECTIONS", os.getpid(), exc, self.nr_conns, ACCEPT_PAUSE_S * 1000)
        self.accept_paused_until = now + ACCEPT_PAUSE_S
        super().set_accept_enabled(False)

    def wait_for_and_dispatch_events(self, timeout: float) -> None:
        """The loop's turn (app/hosting/loop_requests.py's), ending by the end of a pause of accepting, when gthread's
        loop asks to accept again."""
        paused_s = self.accept_paused_until - time.monotonic()
        if paused_s > 0:
            timeout = min(timeout, paused_s)
        super().wait_for_and_dispatch_events(timeout)

    def on_client_socket_readable(self, conn: TConn, client: Any) -> None:
        """A kept-alive connection's next request: read in the loop too, at once (its bytes are there), the socket
        kept in the poller with its callback changed (no system call)."""
        self.keepalived_conns.remove(conn)
        reading = self._reading(conn)
        self.poller.modify(client, selectors.EVENT_READ, partial(self._on_data, reading))
        self._on_data(reading, client)

    def _start_reading(self, conn: TConn) -> None:
        reading = self._reading(conn)
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_data, reading))

    def _reading(self, conn: TConn) -> Reading:
        """A request starting to arrive on ``conn``, watched by the loop's timeouts (``reading``)."""
        reading = self._new_reading(conn)
        self.reading.add(reading)
        return reading

    def _new_reading(self, conn: TConn, held: bytes = b"") -> Reading:
        """A request starting now on ``conn`` with ``held`` already read; its header time counted from now."""
        now = time.monotonic()
        reading = Reading(conn, now + self.limits.header_timeout_s, now)
        reading.take(held)
        return reading

    def _on_data(self, reading: Reading, sock: Any) -> None:
        """What the socket holds, read on at once while a read took all it asked for and the request is not whole
        (a photo's body that came with its headers is read in this wake-up, not the loop's next turn)."""
        while True:
            wanted = reading.wanted()
            try:
                data = sock.recv(wanted)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                data = b""
            if not data:  # the client went away before its request was whole
                self._close(reading)
                return
            reading.take(data)
            reading.last_data = time.monotonic()
            if self._whole(reading):
                self._dispatch(reading)
                return
            if len(data) < wanted:
                break
        if reading.continue_owed:  # its head is in, and the client waits for this to send the body
            self._continue(reading)

    def _whole(self, reading: Reading) -> bool:
        """Whether the loop's wait for the request is over: it is whole (its body too when the loop reads it), or
        refused (``reading.refusal``: from its head, or from its chunked framing)."""
        if reading.refusal is not None:
            return True
        if reading.body_end is None:
            buffer, start = reading.buffer, reading.scanned
            end = buffer.find(HEADER_END, max(start - len(HEADER_END) + 1, 0))
            reading.scanned = len(buffer)
            reading.refusal = head_refusal(buffer, start, end, self.limits.request_line_limit,
                                           self.limits.head_limit)
            if reading.refusal is not None:
                return True
            if end < 0:
                return False
            framing = body_framing(bytes(buffer[:end]))
            if not isinstance(framing, int):  # chunked, Expect, or a head the parser refuses
                return self._framed(reading, end, framing)
            if framing > self.limits.max_body_bytes:
                return True
            reading.body_end = end + len(HEADER_END) + framing
        if len(reading.buffer) < reading.body_end:
            return False
        return reading.chunked is None or self._chunks_whole(reading)

    def _framed(self, reading: Reading, end: int, framing: Framing | None) -> bool:
        """``_whole`` for a head that ``body_framing`` did not frame by a length alone (its end at ``end``): a chunked
        body, or one after ``Expect: 100-continue``, is read on here as its ``framing`` says, the client that waits
        for it owed its ``100 Continue`` (``continue_owed``: once the loop waits for the body, ``_continue``); any
        other head (None), and a Content-Length over the limit, go to the parser as they are (True), but for one after
        ``Expect: 100-continue``, refused here (413) before its client is asked for the body it announced."""
        if framing is not None and framing.length > self.limits.max_body_bytes and framing.expects_continue:
            reading.refusal = Refusal(413, "Request Entity Too Large",
                                      f"the request body is over the {self.limits.max_body_bytes} byte limit")
            return True
        if framing is None or framing.length > self.limits.max_body_bytes:
            return True
        start = reading.body_end = end + len(HEADER_END)
        if framing.chunked:
            reading.chunked = ChunkedBody(start)
        else:
            reading.body_end += framing.length
        # nothing of the body came yet: the client waits for the 100 (one sending it anyway needs none, RFC 9110 10.1.1)
        reading.continue_owed = (framing.expects_continue and (framing.chunked or framing.length > 0)
                                 and len(reading.buffer) == start)
        return self._whole(reading)

    def _chunks_whole(self, reading: Reading) -> bool:
        """Whether a chunked body came whole, its framing read on as far as it came (``ChunkedBody.scan``); refused
        (``reading.refusal``) when that framing is malformed or over its limits."""
        reach = reading.chunked.scan(reading.buffer, self.limits)  # type: ignore[union-attr]
        if isinstance(reach, Refusal):
            reading.refusal = reach
            return True
        reading.body_end = reach
        return reading.chunked.end is not None  # type: ignore[union-attr]

    def _continue(self, reading: Reading) -> None:
        """``100 Continue`` to a client that waits for it to send its body (``Expect: 100-continue``), said by the
        loop, which then reads that body; the parser says it no more once the request reaches it
        (``continued_request``)."""
        reading.continue_owed = False
        conn = reading.conn
        with contextlib.suppress(OSError):  # small: fits the socket buffer (a client gone: its next read says so)
            conn.sock.send(CONTINUE)
        if conn.parser is None:  # the connection's first request: its parser made here, as gthread's init would
            conn.parser = get_parser(self.cfg, conn.sock, conn.client)
        conn.parser.mesg_class = partial(continued_request, conn.parser)

    def _dispatch(self, reading: Reading) -> None:
        if reading.refusal is not None:
            self._refuse(reading)
            return
        self._forget(reading)
        self._hand_over(reading)
        self.enqueue_req(reading.conn)

    @staticmethod
    def _hand_over(reading: Reading) -> None:
        """A whole request's bytes given to its connection's parser (``_handle_one``)."""
        conn = reading.conn
        conn.data_ready = True  # gthread's handle() must not wait for data again
        conn.prefetched = reading.buffer
        _body_held(conn, reading.body_end is not None)  # set only once the whole body is in the buffer

    def handle(self, conn: TConn) -> Any:
        """In a request thread: the request, then the connection's next ones while it is kept alive and no other
        request waits for a thread (``_next_request``: one already read behind it, or one that arrives within
        ``linger_s`` of the answer) instead of handing it back to the loop, which would read the next request and
        hand it to a thread again (the loop woken twice and a thread once, for each request). A request begun and not
        whole by then goes back to the loop (``finish_request``), which reads the rest with its timeouts: a slow client
        holds this thread ``linger_s`` at most. An answer whose rest the client has not taken yet (``unsent``) ends
        the lingering: the loop writes it, then reads the next request."""
        keepalive = self._handle_one(conn)
        while (keepalive is True and self.alive and self.limits.linger_s > 0 and self.tpool._work_queue.empty()
               and not getattr(conn.sock, "unsent", None)):  # an answer's rest held: the loop writes it first
            reading = self._next_request(conn)
            if reading is None or reading is False:  # nothing came (kept alive, watched by the loop), or it closed
                return reading is None
            if not self._whole(reading) or reading.refusal is not None:  # the loop reads on, or refuses it
                return reading
            self._hand_over(reading)
            keepalive = self._handle_one(conn)
        return keepalive

    def _next_request(self, conn: TConn) -> Reading | bool | None:
        """The connection's next request: what the parser holds past the last one (pipelined), then what arrives
        within ``linger_s``; its Reading once whole or when the time is up, None when nothing came, False when the
        client closed the connection."""
        reading = self._new_reading(conn, _held(conn))
        deadline = reading.last_data + self.limits.linger_s
        poller = select.poll()  # (a socket of any number: select's fd limit does not apply)
        poller.register(conn.sock, select.POLLIN)
        while not (reading.buffer and self._whole(reading)) and (left := deadline - time.monotonic()) > 0:
            if not poller.poll(left * 1000):
                break
            try:
                data = conn.sock.recv(reading.wanted(), socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return False
            if not data:
                return False
            reading.take(data)
            reading.last_data = time.monotonic()
        return reading if reading.buffer else None

    def finish_request(self, conn: TConn, fs: Any) -> None:
        """On the loop, once a request thread is done with the connection: a request begun on it (pipelined behind
        the last answer, or begun while the thread lingered) is read on here and handed to a thread once whole;
        the rest as gthread does (kept alive in the poller, or closed; empty lines held behind the last answer
        leave it kept alive). First, the rest of the thread's answer that the client had not taken (``unsent``),
        written as it reads it (``_write_unsent``)."""
        if getattr(conn.sock, "unsent", None):
            self._write_unsent(Writing(conn, fs, time.monotonic()))
            return
        result = fs.result() if not fs.cancelled() and fs.exception() is None else None
        if result is True and (held := _held(conn)) and (reading := self._new_reading(conn, held)).buffer:
            result = reading
        if not isinstance(result, Reading):
            super().finish_request(conn, fs)
        elif not self._whole(result):
            conn.sock.setblocking(False)
            self.reading.add(result)
            self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_data, result))
            if result.continue_owed:
                self._continue(result)
        elif result.refusal is not None:
            self._refuse(result)
        else:
            self._hand_over(result)
            self.enqueue_req(conn)

    def _write_unsent(self, writing: Writing, _sock: Any = None) -> None:
        """On the loop: what the socket takes now of the rest of the answer, watched for room (EVENT_WRITE) until all
        of it went, then the connection settled as its thread left it (``finish_request``); a client gone meanwhile
        closes it, one that takes nothing for ``answer_timeout_s`` too (``murder_pending``)."""
        conn = writing.conn
        unsent = conn.sock.unsent
        try:
            with memoryview(unsent) as view:
                while writing.sent < len(view):
                    writing.sent += conn.sock.send(view[writing.sent:], socket.MSG_DONTWAIT)
                    writing.last_progress = time.monotonic()
        except (BlockingIOError, InterruptedError):
            if writing not in self.writing:
                self.writing.add(writing)
                self.poller.register(conn.sock, selectors.EVENT_WRITE, partial(self._write_unsent, writing))
            return
        except (OSError, ValueError):  # the client went away (or its socket was closed): the connection ends
            self._end_writing(writing, gone=True)
            return
        self._end_writing(writing)
        self.finish_request(conn, writing.outcome)

    def _end_writing(self, writing: Writing, gone: bool = False) -> None:
        """The loop writes no more for ``writing``; ``gone``: its connection closes."""
        if writing in self.writing:
            self.writing.discard(writing)
            self._unwatch(writing.conn.sock)
        writing.conn.sock.unsent = None
        if gone:
            self.nr_conns -= 1
            writing.conn.close()

    def _handle_one(self, conn: TConn) -> Any:
        """In a request thread or a loop request: give the parser what the loop read, then gthread's own handling."""
        prefetched = getattr(conn, "prefetched", None)
        sock = conn.sock
        sock.stays_nonblocking = bool(prefetched) and conn.body_held and waiting.on_loop() is not None
        if prefetched:
            conn.prefetched = None
            conn.init()  # plain HTTP/1.1 (no TLS or HTTP/2 configured): only makes the parser
            if not isinstance(conn.parser.unreader, HeldUnreader):  # the connection's first request
                conn.parser.unreader = HeldUnreader(conn.sock)
            conn.parser.unreader.unread_request(prefetched)
        else:  # a request gthread hands over itself (bytes its parser read ahead): its body may be on the socket
            _body_held(conn, False)
        sock.answer_begins()
        try:
            return super().handle(conn)
        finally:  # an answer gthread gave after an error (its own, whole): the connection closes after it
            with contextlib.suppress(OSError):
                sock.answer_ends()
            sock.stays_nonblocking = False

    def _keepalive_after(self, conn: TConn, keepalive: bool) -> bool:
        """Whether the connection serves another request, once its answer is written (a head held alone goes now:
        a client gone meanwhile closes it, as gthread closes it on a write): a body the loop held whole is skipped in
        memory, whatever the app left of it; others as gthread does (a bounded read of the socket, else closed)."""
        conn.sock.answer_ends()
        if keepalive and getattr(conn, "body_held", False):
            return skip_held_body(conn.parser)
        return super()._keepalive_after(conn, keepalive)

    def murder_pending(self) -> None:
        """Every loop turn: gthread's own sweep, then the requests that arrive too slowly, the answers whose client
        took none of them for ``answer_timeout_s`` and the closes that have lingered long enough."""
        super().murder_pending()
        now = time.monotonic()
        for reading in [r for r in self.reading if self._expired(r, now)]:
            self._time_out(reading, now)
        for writing in [w for w in self.writing if now - w.last_progress > w.conn.sock.answer_timeout_s]:
            writing.conn.sock.left()
            self._end_writing(writing, gone=True)
        for closing in [c for c in self.closing if c.deadline <= now]:
            self._closed(closing)

    def close_gracefully(self, sock: socket.socket) -> None:
        """gunicorn's graceful close on the loop: the write side shut (the client sees the answer end), then what
        the client still sends read as it comes (``_drain``), and the socket closed once it closes its end."""
        try:
            sock.shutdown(socket.SHUT_WR)
            sock.setblocking(False)
            closing = Closing(sock, time.monotonic() + CLOSE_LINGER_S)
            self.poller.register(sock, selectors.EVENT_READ, partial(self._drain, closing))
        except (OSError, ValueError):
            sock.close()
            return
        self.closing.add(closing)

    def _drain(self, closing: Closing, _sock: Any = None) -> None:
        while True:
            try:
                data = closing.sock.recv(HELD_PIECE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            closing.drained += len(data)
            if not data or closing.drained >= CLOSE_DRAIN_BYTES:
                self._closed(closing)
                return

    def _closed(self, closing: Closing) -> None:
        self.closing.discard(closing)
        self._unwatch(closing.sock)
        closing.sock.close()

    def _expired(self, reading: Reading, now: float) -> bool:
        if reading.body_end is not None:
            return now - reading.last_data > self.limits.body_timeout_s
        deadline = reading.header_deadline
        if not reading.buffer:  # idle (empty lines at most came): a kept-alive connection ends with its keep-alive
            kept_until = getattr(reading.conn, "timeout", None)  # gthread's, set when it was kept alive
            if kept_until is not None:
                deadline = min(deadline, kept_until)
            if not self.alive:  # stopping: an idle connection is not kept, as gthread's own
                deadline = min(deadline, reading.last_data + STOP_KEEPALIVE_LINGER)
        return now > deadline

    def _time_out(self, reading: Reading, now: float) -> None:
        if reading.buffer:  # a request was started: say why it ends (nothing started: close quietly)
            if reading.body_end is None:
                message = f"the request headers did not arrive within {self.limits.header_timeout_s:g}s"
            else:
                message = f"the body did not arrive within {self.limits.body_timeout_s:g}s"
            self._answer(reading, Refusal(408, "Request Timeout", message))
        self._close(reading)

    def handle_error(self, req: Any, client: Any, addr: Any, exc: BaseException) -> None:
        """A request gunicorn's parser refused (a request line or header it cannot read): its status, in the
        service's JSON error shape (gunicorn's own answer is an HTML page); any other error as gunicorn answers it."""
        refusal = parser_refusal(exc)
        if refusal is None:
            super().handle_error(req, client, addr, exc)
            return
        refusal.tell(partial(gunicorn_util.write_nonblock, client), addr[0] if isinstance(addr, tuple) else None)

    def _refuse(self, reading: Reading) -> None:
        """A request whose head the loop refuses: told why, then its connection closes gracefully (the client may
        still be sending: a reset must not cut its answer short)."""
        assert reading.refusal is not None
        self._answer(reading, reading.refusal)
        self._close(reading, graceful=True)

    @staticmethod
    def _answer(reading: Reading, refusal: Refusal) -> None:
        """The loop's own answer to a request it ends, and its access line."""
        refusal.tell(reading.conn.sock.send, _peer(reading.conn))  # small: fits the socket buffer

    def _forget(self, reading: Reading) -> None:
        self.reading.discard(reading)
        self._unwatch(reading.conn.sock)

    def _unwatch(self, sock: socket.socket) -> None:
        """``sock`` out of the loop's poller, if it was in it (closed meanwhile, or never registered: nothing)."""
        try:
            self.poller.unregister(sock)
        except (KeyError, ValueError, OSError):
            pass

    def _close(self, reading: Reading, graceful: bool = False) -> None:
        self._forget(reading)
        self.nr_conns -= 1
        reading.conn.close(graceful)


def raise_file_limit(needed: int) -> int:
    """The soft open-file limit (RLIMIT_NOFILE: each client connection is a file) raised to the hard one where it is
    below ``needed`` (systemd's default soft limit is 1024, below the default MAX_CONNECTIONS and a worker's own
    files); the soft limit now (RLIM_INFINITY: none)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return soft
    wanted = needed if hard == resource.RLIM_INFINITY else hard
    with contextlib.suppress(ValueError, OSError):  # refused: the limit stays, and the caller says so
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _body_held(conn: TConn, held: bool) -> None:
    """Note whether the request's whole body is in memory, on the connection and its socket (app/web/hooks.py then
    sets no timeout for reading a body that no read will wait for)."""
    conn.body_held = held
    if isinstance(conn.sock, ClientSocket):
        conn.sock.body_held = held


def _held(conn: TConn) -> bytes:
    """What the connection's parser holds past the request it answered: the start of the next one (pipelined)."""
    unreader = getattr(conn.parser, "unreader", None)
    return unreader.take_buffered() if isinstance(unreader, HeldUnreader) else b""


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


def _peer(conn: TConn) -> str | None:
    client = conn.client
    return client[0] if isinstance(client, tuple) and client else None
