"""A client's connection in an HTTP worker, whose answer is written without blocking.

What the client does not take at once, a request running on the worker's loop waits for on the loop, and a request
thread leaves to the loop to write (app/hosting/worker.py's ``finish_request``), the thread going on: a client that
stops reading holds its connection, never a thread nor the loop, and after ``answer_timeout_s`` without progress
loses it. An answer's head goes out with its first piece of body in one send. A connection closed after its answer
lingers for the client's end on the loop (the worker's ``close_gracefully``), not in a blocking read.

Loaded by the gunicorn master with the worker class: gunicorn and the standard library only, and app.hosting's
waiting and request_framing (plain).
"""
from __future__ import annotations

import contextlib
import enum
import errno
import ipaddress
import logging
import re
import select
import socket
from typing import Any, Callable

from gunicorn.workers.gthread import TConn

from app.hosting import waiting
from app.hosting.request_framing import HELD_PIECE, ReadLimits, Refusal

HEAD_JOINED_BYTES = 64 * 1024  # an answer's first piece up to which its head goes out in the same send (one copy):
# on loopback each send delivers to the reader on the sender's CPU, 7 us more a small answer for two sends than one
INTERIM_ANSWER = re.compile(rb"HTTP/1\.[0-9] 1[0-9][0-9] ")  # a 1xx (103 Early Hints): sent as it comes, not held
_DONTWAIT = int(socket.MSG_DONTWAIT)  # a plain int: or-ing the flag enum makes a new enum member at every send
HELD_ANSWER_BYTES = 16 << 20  # the most of an answer a request thread leaves to the loop to write (the rest of one
# the app made whole is held anyway; one streamed in pieces beyond this, the thread writes as the client reads it)


class ClientSocket(socket.socket):
    """A client's connection, whose answer is written without blocking (``sendall``): the part the socket's buffer
    takes at once, then the rest as the client reads it. A request thread's rest is held (``unsent``) and the thread
    goes on: once it is done with the connection, the worker's loop writes it (``BufferingWorker.finish_request``),
    so a client that stops reading holds its connection, not a thread; beyond HELD_ANSWER_BYTES (an answer streamed
    in pieces) the thread writes what it holds itself. A loop request hands its wait to the loop; a socket no
    worker's loop writes for (``loop_writes`` off) waits by polling. Either way at most ``answer_timeout_s`` without
    progress. An answer's head (gunicorn writes it apart, as its first write) is held and goes out with the answer's
    first piece of body, in one send (``answer_begins``, ``answer_ends``)."""

    __slots__ = ("answer_timeout_s", "body_held", "loop_writes", "unsent", "head_next", "head", "stays_nonblocking",
                 "received_at", "request_head")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.answer_timeout_s, self.body_held = ReadLimits.answer_timeout_s, False
        self.stays_nonblocking = False  # while a request held whole runs on the loop (``_handle_one``)
        self.loop_writes = False  # a request thread leaves the rest of its answer to the worker's loop
        self.unsent: bytearray | None = None  # that rest, until the loop has written it
        self.head_next = False  # the next write is an answer's first: its head, held (``head``) for what follows
        self.head: bytes | None = None
        # when the loop had the request whole (time.monotonic()), its body held: its deadline counts from there, a
        # wait for a request thread included (app/web/services.py arrival); None: read by the parser
        self.received_at: float | None = None
        # the request the loop read whole, while its parser reads it: a refusal of the parser's says its X-Request-ID
        self.request_head: bytes | bytearray = b""

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



Counted = tuple[dict[str, int], str]  # a connection's count (``ClientCounts``' open or refusing) and its client


class ClientConn(TConn):
    """gthread's connection, whose graceful close (after an answer that said ``Connection: close``) is its worker's
    ``close_gracefully``: the same half-close and drain, without blocking the event loop; its close leaves its
    client's count (``ClientCounts``), a graceful one once its linger ends (the closer is handed the count)."""

    closer: Callable[[socket.socket, "Counted | None"], None] | None = None
    counted: Counted | None = None  # the count it is one of (``ClientCounts``), and its client

    def close(self, graceful: bool = False) -> None:
        counted, self.counted = self.counted, None
        if graceful and self.closer is not None:
            self.closer(self.sock, counted)  # still its client's while it lingers
            return
        if counted is not None:
            ClientCounts.leave(*counted)
        super().close(graceful)


RETRY_CONNECTION_S = 1  # Retry-After of a connection refused for its client's count: one of its others ends soon
REFUSALS_AWAITED = 8  # a client's connections over its limit whose request line a worker waits for at once (their
# 429 in their path's error shape): more are refused as they are accepted, so a flood of them holds no connection


class Joined(enum.Enum):
    """How a worker takes a new connection (``ClientCounts.join``)."""
    COUNTED = "counted"
    REFUSED_ON_ITS_LINE = "refused once its request line comes"  # (its path gives the 429's error shape)
    REFUSED_AT_ONCE = "refused at once"


class ClientCounts:
    """A worker's open connections by client, its IPv4 or IPv6 address (an IPv4-mapped one as IPv4; a Unix
    socket's not counted): ``limit`` (MAX_CONNECTIONS_PER_CLIENT; 0: no limit) each, then REFUSALS_AWAITED refused
    once their request line comes, the rest at once."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open: dict[str, int] = {}
        self.refusing: dict[str, int] = {}  # connections over the limit awaiting their request line

    def join(self, conn: ClientConn, address: Any) -> Joined:
        """``conn``, from ``address`` (accept's), counted where its client has fewer than ``limit`` open, else
        among its refusals."""
        key = client_key(address) if self.limit else None
        if key is None:
            return Joined.COUNTED
        for count, most, joined in ((self.open, self.limit, Joined.COUNTED),
                                    (self.refusing, REFUSALS_AWAITED, Joined.REFUSED_ON_ITS_LINE)):
            held = count.get(key, 0)
            if held < most:
                count[key] = held + 1
                conn.counted = (count, key)
                return joined
        return Joined.REFUSED_AT_ONCE

    @staticmethod
    def leave(count: dict[str, int], key: str) -> None:
        held = count.pop(key, 0) - 1
        if held > 0:
            count[key] = held

    def refusal(self, address: Any) -> Refusal:
        """What a connection over the limit is answered (429)."""
        return Refusal(429, "Too Many Requests", f"{client_key(address)} has {self.limit} connections open to this "
                       "worker, the most one client may (VISIONSERVE_MAX_CONNECTIONS_PER_CLIENT): send on those "
                       "(keep-alive), or close one first", RETRY_CONNECTION_S)


def client_key(address: Any) -> str | None:
    """Whom a connection from ``address`` (accept's: ``(host, port, ...)``, a string for a Unix socket) counts
    against: its IP address (an IPv4-mapped IPv6 one as IPv4, an IPv6 one without its zone), None where it has
    none. (Not an IPv6 /64: a Docker network's or a Kubernetes node's pods share one.)"""
    if not isinstance(address, tuple) or not address or not isinstance(address[0], str):
        return None
    host = address[0]
    if ":" not in host:
        return host
    host = host.split("%", 1)[0]
    if host.startswith("::ffff:"):
        with contextlib.suppress(ValueError):
            mapped = ipaddress.IPv6Address(host).ipv4_mapped
            return host if mapped is None else str(mapped)
    return host

