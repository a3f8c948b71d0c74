"""The requests an HTTP worker runs on its event loop (app/hosting/loop_requests.py, ``LOOP_REQUESTS``) reach the
engine on one connection they share, several to a message: ``LoopLink``.

A request's ``Infer`` joins the loop's outbox under an id. The first request to find the outbox empty sends it: it
waits until the loop has run every request that is ready now (``before_wait``), so the others of this loop turn add
theirs, then sends all of them as one ``Infers`` message, and again whatever came while it sent. The engine reads
one frame for all of them, admits them in one turn and sends the answers of its turn as one ``Answers``; the link's
connection is watched by the loop, which hands each answer to its request by id. So a loop turn of k requests costs
the engine one read and one send, where each request had its own (about 18 of the 27 us a request costs a bare
loop on this wire: docs/performance.md), and costs this worker one send and one read.

A request's photos cross in shared memory (``arena_bytes``: LINK_ARENA_MB; app/link/arena.py): the link's arena,
made with each connection and offered to the engine first, holds them from their send until the engine says it let
go of them (``Answers.released``: it decodes them where they lie), and what finds no room goes in the frame as
before.

A request whose client leaves, or whose time runs out here, is cancelled (``Cancel``, sent like the requests): the
engine drops its images still queued and answers it no more. A connection that fails (the engine restarting) fails
every request it carries, as a request's own connection did (503 with Retry-After), and the next request connects
anew. Sends never block the loop: they are made by a request, whose waits for room are the loop's.

Standard library and the wire only: the HTTP side never imports torch.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import time
from typing import Callable, Sequence

from app.engine.contract import CLIENT_CHECK_S
from app.errors import ClientGone, DeadlineExceeded
from app.hosting.waiting import Event, OnLoop
from app.link import wire
from app.link.arena import Arena

log = logging.getLogger(__name__)

SEND_BUFFER_BYTES = 4 << 20  # a loop turn's requests in one send: 16 photos of 100 KB and more (the kernel
# caps it at net.core.wmem_max; its default, 208 KB, took two photos and made the rest wait for the engine's reads)
TURN_WAIT_S = 1.0  # the longest a sender waits for the loop to come round (it runs the ready requests, then it)


def offered_arena(conn: socket.socket, size: int) -> Arena:
    """An arena of ``size`` bytes made and offered on a new connection (its first message after the hello):
    OSError when none can be made, EngineGone when the offer cannot be sent (the arena closed then)."""
    arena = Arena(size)
    try:
        wire.send_with_fd(conn, wire.ArenaOffer(arena.size), arena.fd)
    except BaseException:
        arena.close()
        raise
    return arena


class _Asked:
    """A request sent on the link: the event its request waits for, and its answer (or why there is none)."""

    __slots__ = ("event", "answer", "arrived")

    def __init__(self, event: Event, arrived: float) -> None:
        self.event = event
        self.answer: wire.Answer | BaseException | None = None
        self.arrived = arrived  # when its HTTP worker had it whole (``time.monotonic()``)


class LoopLink:
    """One HTTP worker loop's connection to one engine, its requests several to a message (the module's
    docstring). Used on the loop's thread only: by its requests (``ask``) and the loop (the answers' reads)."""

    def __init__(self, connect: Callable[[], socket.socket], arena_bytes: int = 0) -> None:
        self._connect = connect  # a new connection, greeted and non-blocking
        self._arena_bytes = arena_bytes  # each connection's arena (0: none, every image in its frame)
        self._arena: Arena | None = None  # the connection's, offered to the engine
        self._conn: socket.socket | None = None
        self._sends: socket.socket | None = None  # the connection's second descriptor: a send's wait for room is
        # watched apart from the answers' (one descriptor takes one watch)
        self._reader: wire.FrameReader | None = None
        self._loop: OnLoop | None = None
        self._connecting: list[Event] | None = None  # while a request connects: the others waiting for it
        self._ids = itertools.count(1)
        self._asked: dict[int, _Asked] = {}  # sent or to send, not yet answered
        self._outbox: list[tuple[int, wire.Infer, Sequence[bytes | memoryview]]] = []
        self._cancels: list[tuple[int, bool]] = []  # each id, and whether its deadline passed (``wire.Cancel.late``)
        self._sending = False  # a request sends the outbox, or waits for the loop's turn to send it

    @property
    def in_flight(self) -> int:
        """Requests sent or to send, not yet answered."""
        return len(self._asked)

    def ask(self, loop: OnLoop, message: wire.Infer, segments: Sequence[bytes | memoryview], limit_s: float,
            client_gone: Callable[[], bool] | None, late_s: float | None = None, arrived: float | None = None
            ) -> wire.Answer:
        """``message`` with its ``segments`` sent with this turn's others, and its answer, within ``limit_s``; its
        client gone (``client_gone``) is ClientGone, the time up DeadlineExceeded (the request's deadline of
        ``late_s`` when given, else no answer from the engine; both cancel it at the engine); a connection that
        fails or cannot be made is EngineGone (WireMismatch when the engine runs other code). The engine counts its
        deadline from ``arrived`` (when its HTTP worker had it whole; by default now): the message says how long
        before it was made."""
        assert self._loop in (None, loop), "a loop link serves the one loop its connection was made on"
        self._connected(loop)
        ident = next(self._ids)
        asked = self._asked[ident] = _Asked(loop.event(), time.monotonic() if arrived is None else arrived)
        self._outbox.append((ident, message, segments))
        until = time.monotonic() + limit_s
        try:
            if not self._sending:
                self._send_outbox(loop)
            while not asked.event.wait(min(CLIENT_CHECK_S, until - time.monotonic()) if client_gone else
                                       until - time.monotonic()):
                if client_gone is not None and client_gone():
                    raise ClientGone("the client closed the connection; its queued images are dropped")
                if time.monotonic() >= until:
                    raise (DeadlineExceeded(f"no answer from the engine within {limit_s:g}s") if late_s is None
                           else DeadlineExceeded.of_request(late_s))
        except BaseException as exc:
            if self._asked.pop(ident, None) is not None:
                self._cancel(ident, late=late_s is not None and isinstance(exc, DeadlineExceeded))
            raise
        answer = asked.answer
        if isinstance(answer, BaseException):
            raise answer
        return answer  # type: ignore[return-value]

    def _connected(self, loop: OnLoop) -> None:
        """A connection, made by this request, or by another that is making it."""
        while self._conn is None:
            if self._connecting is not None:
                event = loop.event()
                self._connecting.append(event)
                event.wait(2 * wire.SEND_STALL_S)
                continue
            self._connecting = []
            try:
                conn = self._connect()  # greeted: its waits are the loop's
            finally:
                waiting, self._connecting = self._connecting, None
                for event in waiting:
                    event.set()
            sends = arena = None
            try:
                with contextlib.suppress(OSError):  # a turn's photos in one send (up to the host's wmem_max)
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
                arena = self._offer_arena(conn)
                sends = conn.dup()
                loop.watch(conn, self._readable)
            except BaseException:
                for sock in (conn, sends):
                    if sock is not None:
                        sock.close()
                if arena is not None:
                    arena.close()
                raise
            self._conn, self._sends, self._loop, self._arena = conn, sends, loop, arena
            self._reader = wire.FrameReader(conn, (wire.Answers,))

    def _offer_arena(self, conn: socket.socket) -> Arena | None:
        """A new connection's arena, offered to the engine (its first message), or None: none asked for, or none
        to be had (the host's memory: logged, the images then go in their frames)."""
        if not self._arena_bytes:
            return None
        try:
            return offered_arena(conn, self._arena_bytes)
        except (OSError, AttributeError) as exc:  # (AttributeError: a system without memfds or seals)
            log.warning("no shared memory for the engine link's images (%s): they go through its socket", exc)
            return None

    def _send_outbox(self, loop: OnLoop | None) -> None:
        """This request sends the outbox: with ``loop``, once the loop has run its other ready requests (which add
        theirs); then as long as more came meanwhile. A connection that fails fails every request it carries; one
        that broke meanwhile (its descriptor shut down, which ends a wait for room) is closed here, and a new one
        is left as it is. Anything else that ends a send midway breaks the connection too (the engine would read
        the next frame from the middle of this one), then is raised."""
        self._sending = True
        sends = None
        try:
            if loop is not None:
                turn = loop.event()
                loop.before_wait(turn.set)
                turn.wait(TURN_WAIT_S)
            sends = self._sends
            while (self._outbox or self._cancels) and sends is not None and self._sends is sends:
                cancels, self._cancels = self._cancels, []
                if cancels:
                    wire.send(sends, wire.Cancel(tuple([ident for ident, _ in cancels]),
                                                 tuple([ident for ident, late in cancels if late])))
                if self._outbox:
                    wire.send(sends, *self._message())
        except BaseException as exc:
            if sends is not None and self._sends is sends:
                self._broken(exc)
            if not isinstance(exc, (wire.EngineGone, OSError)):
                raise
        finally:
            self._sending = False
            if sends is not None and self._sends is not sends:  # broken while it sent: its descriptor is ours
                with contextlib.suppress(OSError):
                    sends.close()

    def _message(self) -> tuple[wire.Infers, list[bytes | memoryview]]:
        """The outbox's next message (``_next_message``) and its segments, each request's time in its HTTP worker
        said as of now."""
        taken = self._next_message()
        now, asked = time.monotonic(), self._asked
        return wire.infers(taken, self._arena, tuple([max(0.0, now - asked[ident].arrived) if ident in asked else 0.0
                                                      for ident, _, _ in taken]))

    def _next_message(self) -> list[tuple[int, wire.Infer, Sequence[bytes | memoryview]]]:
        """The outbox's first requests, as many as one frame's segments hold (``wire.MAX_SEGMENTS``; one at least),
        taken from it."""
        total, end = 0, len(self._outbox)
        for index, (_, _, segments) in enumerate(self._outbox):
            total += len(segments)
            if total > wire.MAX_SEGMENTS and index:
                end = index
                break
        taken, self._outbox = self._outbox[:end], self._outbox[end:]
        return taken

    def _cancel(self, ident: int, late: bool = False) -> None:
        """``ident`` not waited for any more (``late``: its deadline passed): dropped from the outbox when it is
        still there, else told to the engine (sent now, or by the request sending)."""
        for index, (queued, _, _) in enumerate(self._outbox):
            if queued == ident:
                del self._outbox[index]
                return
        if self._sends is None:
            return  # the connection is gone: the engine ended it with it
        self._cancels.append((ident, late))
        if not self._sending:
            with contextlib.suppress(BaseException):  # the request's own error stands, not a cancel's
                self._send_outbox(None)

    def _readable(self) -> None:
        """On the loop: the answers that came, each handed to its request (which runs on at once)."""
        reader = self._reader
        if reader is None:
            return
        try:
            frames = reader.read()
        except (wire.EngineGone, OSError) as exc:
            self._broken(exc)
            return
        for answers, _ in frames:
            for ident, answer in zip(answers.ids, answers.answers):
                asked = self._asked.pop(ident, None)
                if asked is not None:  # else cancelled: its answer crossed the cancel
                    asked.answer = answer
                    asked.event.set()
            if self._arena is not None and answers.released:  # photos the engine let go of: their places free
                self._arena.released(answers.released)

    def _broken(self, exc: BaseException) -> None:
        """The connection failed: closed, and every request it carries (or was to) fails with EngineGone. A send
        under way keeps its descriptor, shut down (which wakes its wait for room), for the sender to close."""
        conn, sends, loop, arena = self._conn, self._sends, self._loop, self._arena
        self._conn = self._sends = self._reader = self._arena = None
        if arena is not None:  # (the engine's mapping stands until it closes its end)
            arena.close()
        if conn is not None and loop is not None:
            loop.unwatch(conn)
        for sock in (conn, sends):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                if sock is conn or not self._sending:
                    with contextlib.suppress(OSError):
                        sock.close()
        gone = exc if isinstance(exc, wire.EngineGone) else wire.EngineGone(f"{type(exc).__name__}: {exc}")
        asked, self._asked = self._asked, {}
        self._outbox, self._cancels = [], []
        for waiting in asked.values():
            waiting.answer = gone
            waiting.event.set()

    def close(self) -> None:
        """Closed (the engine ends every request it carries); requests waiting here fail."""
        self._broken(wire.EngineGone("the link was closed"))

