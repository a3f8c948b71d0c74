"""The engine's event loop: ``EngineServer`` serves one engine's ``Service`` to the HTTP workers' connections
from one thread (one selector, and one for its wake-ups alone while it waits for more requests; no thread per
connection or per request). A connection opens with the hello (a worker running other code is refused and
logged), then carries one exchange at a time, or, once it sent ``Infers`` (the connection an HTTP worker's loop
requests share: app/link/loop_link.py), many: requests several to a message, each under its id, a ``Cancel`` for
those whose client left (and its closing for all of them), and their answers sent together, one ``Answers`` a loop
turn:
- ``Infer``: read with the others of its loop turn (the loop waits up to ``MAX_WAIT_MS`` for more while they come
  faster than that and waiting brings more: app/link/gathering.py), the request admitted with those alike of its
  turn (``Service.enter_many``: readiness and routing once for them, each its outcome counted; a lone one by
  ``Service.enter``; the shared connections' one-image requests alike to the last detail as one bundle: one
  admission, call and group for all of them, each answered from its row on its connection; photos the CPU decodes,
  bundles of a hand-off's decoding at most), its images queued (a version's together, ``call.queue_prepared``; a
  lone one, or those the CPU decodes, by ``Call.queue``, the latter on a few threads) and, once the batcher's thread
  has counted them done (or the loop ran a turn's short batch itself), the ``Served`` answered from the loop
  (``Call.answer``); its deadline passing first answers 504, and anything readable from the HTTP side meanwhile
  means its client hung up (the images still queued are dropped).
- ``Unanswered``: a request the HTTP side refused before sending it, admitted and ended with its error (no answer).
- ``CatalogCall``: one of ``contract.CATALOG_CALLS``, off the loop: a read on the catalog's read thread, a change
  (``contract.CATALOG_CHANGES``, which waits for every engine) on a thread of its own; ``StateQuery``: readiness,
  liveness, draining.
- ``Explain``: one image's explanation (``Service.explain``: the explanations' own lane), waited for on a thread of
  its own, as a catalog call is.
Every answer is an ``Answer`` with the value or the ServiceError, and this engine's pid and routing generation.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import heapq
import itertools
import logging
import operator
import os
import pickle
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from app.engine.batching.batcher import Batcher
from app.engine.call import Queued, queue_prepared
from app.engine.contract import CATALOG_CALLS, CATALOG_CHANGES, Signature
from app.engine.lifecycle import not_ready
from app.engine.service import Admission, Service
from app.errors import (ClientGone, DeadlineExceeded, ImageTooLarge, InferenceFailed, InvalidImage, Overloaded,
                        ServiceError, ShortDeadline, UnsupportedImageFormat)
from app.link import wire
from app.link.arena import ArenaError, MappedArena
from app.link.decode_shares import DecodeShares, encoded_bytes
from app.link.gathering import Gathering
from app.metrics import RequestTally, this_process
from models.export.checks import device_type
from models.serving import usable_cores

log = logging.getLogger(__name__)


def _as_error(exc: BaseException) -> ServiceError:
    if isinstance(exc, ServiceError):
        return exc
    return InferenceFailed.of(exc, "the engine failed on this request")


def _parsed_alike(message: wire.Infer, answering: Signature) -> None:
    """NotReady (503: send it again) when the request's tensors were shaped for a version whose input differs from
    the one routing chose (the model changed while the request was on its way; the HTTP side's signatures are then
    stale, and are dropped on this answer). Images are decoded for the answering version whatever it is."""
    if message.tensors and tuple(message.parsed_shape) != tuple(answering.input_shape):
        raise not_ready(f"{answering.name} changed while this request was on its way: its tensors are shaped "
                        f"{list(message.parsed_shape)} for version {message.parsed_version}, and version "
                        f"{answering.version} takes {list(answering.input_shape)}; send it again")


def _without_frames(error: BaseException | None) -> None:
    """``error``'s tracebacks (its own, its cause's and its context's) let go: an ended request's error is answered
    by its type and words, and a traceback holds the frames that raised it, which hold the request (its photos, in
    a loop link's arena, held until garbage collection came round: app/link/arena.py) in a cycle."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        error.__traceback__ = None
        error = error.__cause__ or error.__context__


_UNFRAMED = (pickle.PicklingError, TypeError, AttributeError, ValueError)  # what an answer that does not frame raises
CATALOG_READ_THREADS = 1  # catalog reads at once, never on the loop: one thread, as more only contend for the
# interpreter lock with the loop (at C=64 four read threads cost 2x the CPU a /v1/models call, 0.72x its rate)
SHARED_SEND_BUFFER_BYTES = 4 << 20  # a shared connection's answers of a turn (16-image requests' rows, 64 KB each)
# in one send where the host allows (net.core.wmem_max); beyond it, the rest goes as the HTTP worker reads
STOP_COUNTS_S = 1.0  # how long a stopping engine waits for its loop to write the requests it counted
ACCEPT_PAUSE_S = 0.1  # out of file descriptors: new connections wait in the listener's backlog this long, the loop
# serving the open ones, before it accepts again
CATALOG_CHANGE_THREADS = 2  # catalog changes at once (a load waits for every engine), apart: no read waits behind one


class _Connection:
    """One HTTP worker connection (non-blocking): its frames as they come (the first one its hello), and
    the request it waits on (at most one), or, once it sent ``Infers``, its requests by id (``exchanges``) and the
    answers of this loop turn still to send. While a catalog call runs for it on a thread, the loop does not watch it
    (unregistered)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.closed = sock, False
        self.reader = wire.FrameReader(sock, wire.REQUESTS, greet=True, takes_fds=True)  # (an arena's, offered)
        self.arena: MappedArena | None = None  # shared: where its requests' photos are placed (app/link/arena.py)
        self.exchange: _Exchange | None = None
        self.read_pending = False  # a request of it is in this loop turn, not yet admitted
        self.sent_infer = False  # of one exchange at a time: it carried a request, so another may come on it (an
        # HTTP worker's pooled connection for its catalog calls and state queries alone never does)
        self.exchanges: dict[int, _Exchange] | None = None  # shared: its requests in flight, by id
        self.unadmitted: set[int] = set()  # shared: ids read in this loop turn, not yet admitted
        self.cancelled: set[int] = set()  # shared: ids of those cancelled before their admission
        self.answers: list[wire.Answered] = []  # shared: this turn's answers (each an id, or a bundle's ids here,
        # its value and its error), to send together
        self.most = 0  # shared: the most requests it had under way at once (read or in flight)
        self.unsent: list[memoryview] = []  # shared: what of its answers' frames the socket has not taken yet
        self.writes: socket.socket | None = None  # shared: its second descriptor, watched for room while unsent

    def can_come(self) -> int:
        """How many more requests a shared connection may send before an answer: as many as it had under way at
        most, less those under way now (its HTTP worker's requests come back once answered)."""
        return self.most - len(self.exchanges or ()) - len(self.unadmitted)


_PIXEL_KINDS = "biuf"  # the dtypes pixels may come in: booleans, integers, floats (numpy's kinds), in this host's
# byte order, of 8 bytes at most (what torch.from_numpy takes)
_PIXEL_TYPES: dict[str, np.dtype] = {}  # those seen, by the name a request gave (a few: float32's, uint8's)
_PIXEL_TYPES_KEPT = 64  # names kept at most (any more are looked at each time)


def _pixel_type(name: str) -> np.dtype:
    """The dtype pixels named ``name`` come in; TypeError unless numbers torch takes (objects: the bytes would read
    as pointers)."""
    pixel_type = _PIXEL_TYPES.get(name)
    if pixel_type is None:
        pixel_type = np.dtype(name)
        if pixel_type.kind not in _PIXEL_KINDS or not pixel_type.isnative or pixel_type.itemsize > 8:
            raise TypeError(f"{pixel_type} is no number torch takes")
        if len(_PIXEL_TYPES) < _PIXEL_TYPES_KEPT:
            _PIXEL_TYPES[name] = pixel_type
    return pixel_type


def _inputs(message: wire.Infer, segments: list[wire.Segment]) -> tuple[list[wire.Segment], list[np.ndarray]]:
    """The request's encoded images (each its segment's own buffer, as read, or its view of the connection's arena),
    or its images' pixels: the rows of its stacks (arrays on the segments' buffers). Nothing copied."""
    if not message.tensors:
        return segments, []
    if len(segments) != len(message.tensors):
        raise InferenceFailed(f"a request of {len(message.tensors)} tensors came with {len(segments)} segments")
    rows: list[np.ndarray] = []
    parsed = tuple(message.parsed_shape)
    for (dtype, shape), segment in zip(message.tensors, segments):
        if tuple(shape[1:]) != parsed:
            raise InferenceFailed(f"pixels of shape {tuple(shape)} came for an input of {parsed}")
        try:  # one image's pixels: its view as one array (no iteration over a stack, no reshape: a fifth less time)
            stack = np.ndarray(parsed if shape[0] == 1 else shape, _pixel_type(dtype), segment)
        except TypeError as exc:  # a segment too short for its shape, or no dtype of numbers numpy knows
            raise InferenceFailed(f"pixels of shape {tuple(shape)} ({dtype}) do not read from a segment of "
                                  f"{len(segment)} bytes: {exc}") from None
        if stack.nbytes != len(segment):
            raise InferenceFailed(f"pixels of shape {tuple(shape)} ({dtype}) came in a segment of {len(segment)} "
                                  "bytes")
        if shape[0] == 1:
            rows.append(stack)
        else:
            rows.extend(stack)  # its rows: views, one per image
    return [], rows


# A request a loop turn read: its connection, message and segments, its id on a shared connection (None on one of its
# own), and when its deadline counts from (``time.monotonic()``: when its HTTP worker had it whole, as its message
# says, else when this loop read it).
_Read = tuple[_Connection, wire.Infer, list[wire.Segment], "int | None", float]


class _Exchange:
    """One ``Infer`` in flight: its admission held from its arrival to its answer (``Admission.leave``); ``ident``
    its id on a shared connection (None on a connection of its own)."""

    __slots__ = ("conn", "admission", "call", "message", "images", "tensors", "ident", "queued", "ended", "cancelled",
                 "decode_cpu_s", "arrived", "parts")

    def __init__(self, conn: _Connection, admission: Admission, message: wire.Infer, images: list[wire.Segment],
                 tensors: list[np.ndarray], ident: int | None, arrived: float) -> None:
        self.conn, self.admission, self.call, self.message = conn, admission, admission.call, message
        self.images, self.tensors, self.ident = images, tensors, ident
        self.queued: Queued | None = None
        self.ended = False
        self.cancelled = False  # nobody waits for its answer (a Cancel, or its shared connection closed)
        self.decode_cpu_s = 0.0  # its images' decode, once queued
        self.arrived = arrived  # its deadline counts from then: its wait in its HTTP worker and for a decode thread
        # count too
        self.parts: list[_Part] | None = None  # a bundle's requests (``_admit_bundle``): each answered from its row


class _Part:
    """One request of a bundle (requests alike of the shared connections, one image each, run as one exchange under
    one admission that stands for all of them, with the first one's message): its connection and id there, its own
    message (its file name: what it runs with apart), its image (its row of pixels, or its encoded image:
    ``images``), when its deadline counts from (``_Read``'s), and whether its client left (it is then ended
    already)."""

    __slots__ = ("conn", "ident", "message", "rows", "images", "arrived", "cancelled")

    def __init__(self, conn: _Connection, ident: int, message: wire.Infer, rows: list[np.ndarray],
                 images: list[wire.Segment], arrived: float) -> None:
        self.conn, self.ident, self.message, self.rows, self.images = conn, ident, message, rows, images
        self.arrived = arrived
        self.cancelled = False


def _connection_runs(parts: list[_Part]) -> Iterator[tuple[_Connection, int, int]]:
    """A bundle's requests still waited for, as runs of those of one connection in a row: each its connection and
    where the run starts and stops among the parts (their rows among the bundle's)."""
    at = 0
    while at < len(parts):
        conn, stop = parts[at].conn, at + 1
        if not parts[at].cancelled:
            while stop < len(parts) and parts[stop].conn is conn and not parts[stop].cancelled:
                stop += 1
            yield conn, at, stop
        at = stop


_ONE_IMAGE_ERRORS = (InvalidImage, ImageTooLarge, UnsupportedImageFormat)  # what one photo of a bundle may be
# refused for (its header, or its pixels in the batch): the bundle runs apart, its others judged each alone


_BUNDLE = object()  # the first of a turn's key for requests that may run as a bundle (``_admit_turn``)
_ADMISSION_OF = operator.itemgetter(1)  # of a (place, admission) pair: an admission has no equality but its identity


def _one_image_of_pixels(message: wire.Infer) -> bool | None:
    """Whether a shared connection's request of ``message`` may run in a bundle with others alike, judged by its
    message alone: one image of pixels (True) or more (False); None for encoded images, which may when they are one
    (its segments say: ``_alike``). Encoded ones bundle where the CPU decodes them in bundles of a hand-off's
    decoding at most (``DecodeShares.runs``), named or not (a multipart file's name: an error about its image runs
    it apart, with its own message: ``_run_apart``)."""
    if message.tensors:
        return len(message.tensors) == 1 and message.tensors[0][1][0] == 1
    return None


def _alike(turn: list[_Read]) -> dict[object, list[int]]:
    """A turn's requests by what they have alike (model, version, client key, pixels or images), each by its place
    in the turn; those of the shared connections alike to the last detail, one image each, under a key of their own
    (its first item ``_BUNDLE``). Alike requests of a connection share their message (``Infers.split``): their key,
    and whether they may bundle (``_one_image_of_pixels``), are made once. A request whose fields make no key (no
    hash, no truth value: none an HTTP worker sends) is alone, under its place."""
    alike: dict[object, list[int]] = {}
    seen: wire.Infer | None = None  # the last message looked at, and the lists its requests go in, once found
    together: list[int] | None = None
    bundled: list[int] | None = None
    pixels_bundle: bool | None = None  # whether the seen message's requests may bundle (None: by their segments)
    for at, (_, message, segments, ident, _) in enumerate(turn):
        try:
            if message is not seen:
                seen, together, bundled = message, None, None
                pixels_bundle = _one_image_of_pixels(message)
            # (all that makes its answer)
            if ident is not None and (len(segments) == 1 if pixels_bundle is None else pixels_bundle):
                if bundled is None:
                    bundled = alike.setdefault((_BUNDLE, (message.model, message.version, message.client_key,
                                                          bool(message.tensors)), message.timeout_s,
                                                message.parsed_version, message.parsed_shape, message.tensors,
                                                message.embedding), [])
                bundled.append(at)
            else:
                if together is None:
                    together = alike.setdefault((message.model, message.version, message.client_key,
                                                 bool(message.tensors)), [])
                together.append(at)
        except Exception:  # noqa: BLE001 - admitted alone, as its checks judge
            seen = None
            alike[at] = [at]
    return alike


class EngineServer:
    """Serves one engine's ``Service`` to the HTTP workers' connections from one event loop: every connection is
    watched by one selector, a request's images are queued without a thread waiting on them, and the answers of a
    batch go out on the loop's next turn (the batcher's thread only counts them done). Images decoded on the CPU
    (the PIL and tensor paths) are decoded on ``decode_threads`` threads, in parallel; the device path reads only
    headers, on the loop. Catalog calls (a load waits for every engine) run on threads of their own."""

    def __init__(self, service: Service, path: Path | None = None, decode_threads: int | None = None) -> None:
        self.service, self.path = service, path
        settings = service.settings
        # every request is admitted and ended on the loop: counted there, written once a METRICS_FLUSH_MS at most
        self._counts = service.counts = RequestTally(settings.metrics_flush_ms / 1000)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self._wake_write.setblocking(False)
        self._posted: collections.deque[Callable[[], None]] = collections.deque()
        self._wake_sent = False  # a wake-up byte is on its way and the loop has not yet taken what was posted
        self._waiting = False  # the loop is in its wait for its sockets (from just before ``_wait_s`` looks)
        self._deadlines: list[tuple[float, int, _Exchange]] = []
        self._order = itertools.count()
        self.decode_shares = DecodeShares(decode_threads or settings.engine_decode_threads or usable_cores())
        self._decoders = ThreadPoolExecutor(self.decode_shares.threads, thread_name_prefix="engine-decode")
        self._catalog_reads = ThreadPoolExecutor(CATALOG_READ_THREADS, thread_name_prefix="engine-catalog")
        self._catalog_changes = ThreadPoolExecutor(CATALOG_CHANGE_THREADS, thread_name_prefix="engine-catalog-change")
        self._loop_thread: int | None = None
        self._accept_again_at: float | None = None  # when the listener, paused (``_accept``), is watched again
        self._started = threading.Lock()
        self._loop_batch_s = settings.engine_loop_batch_ms / 1000
        self.gathering = Gathering(settings.max_wait_ms / 1000, settings.batch_ceiling(device_type(settings.device)),
                                   time.monotonic())
        self._wake_only = selectors.DefaultSelector()  # the loop's wake-ups and shared connections, while it gathers
        self._explain_threads = ThreadPoolExecutor(settings.explain_concurrency + settings.explain_queue_size + 1,
                                                   thread_name_prefix="engine-explain")  # each waits on the lane
        self._handlers: dict[type, Callable[[_Connection, Any, list[bytearray]], None]] = {
            wire.Unanswered: self._unanswered, wire.CatalogCall: self._catalog, wire.StateQuery: self._state,
            wire.Explain: self._explain, wire.ArenaOffer: self._arena_offer}
        self._turn: list[_Read] = []  # read in this loop turn
        self._requesting = 0  # open connections of one exchange at a time that carried a request (sent_infer)
        self._shared: list[_Connection] = []  # connections that sent Infers (several requests at a time)
        self._exchanges = 0  # requests admitted and not yet ended on connections of one at a time
        self._answering: list[_Connection] = []  # shared connections with answers of this turn to send
        self._calls_off_loop = 0  # catalog calls and explanations made on threads for connections that carried a
        # request, not yet answered
        self._deferred: dict[int, Batcher] = {}  # the batchers this turn queued on, not yet run or woken (by id)
        self._leaving: list[tuple[Admission, BaseException | None]] = []  # shared connections' requests ended, to
        # leave together as their answers go out (``_send_answers``)

    def bind(self) -> None:
        """Bind (replacing a dead engine's socket file)."""
        assert self.path is not None
        self.path.unlink(missing_ok=True)
        self._listener.bind(str(self.path))
        self._listener.listen(1024)

    def listen(self) -> None:
        """Accept connections and serve them on this thread until the process ends."""
        log.info("engine listening on %s", self.path)
        self._listener.setblocking(False)
        self._selector.register(self._listener, selectors.EVENT_READ, self._accept)
        self._loop()

    def serve(self, sock: socket.socket) -> None:
        """Serve a connection made elsewhere (a socket pair): it joins the loop, started on a thread if none runs."""
        with self._started:
            if self._loop_thread is None:
                self._loop_thread = -1  # starting
                threading.Thread(target=self._loop, name="engine-loop", daemon=True).start()
        self._post(functools.partial(self._adopt, sock))

    def stop(self, timeout_s: float) -> None:
        """From another thread (the engine's stop, once the HTTP workers drained): the service finishes what is
        queued (``timeout_s`` at most), then the loop writes the requests it counted and holds (METRICS_FLUSH_MS),
        waited for ``STOP_COUNTS_S`` at most."""
        self.service.shutdown(timeout=timeout_s)
        if self._loop_thread is None:  # never served: nothing counted
            return
        written = threading.Event()

        def write() -> None:  # after the ends the batches posted: their shared connections' leaves counted first
            self._send_answers()
            self._counts.flush()
            written.set()

        self._post(write)
        written.wait(STOP_COUNTS_S)

    # -- the loop --------------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        self._loop_thread = threading.get_ident()
        self._selector.register(self._wake_read, selectors.EVENT_READ, self._woken)
        self._wake_only.register(self._wake_read, selectors.EVENT_READ, self._woken)
        self._woken()  # what was posted before the loop ran
        while True:
            while self._deadlines and self._deadlines[0][2].ended:  # answered before its deadline
                heapq.heappop(self._deadlines)
            self._waiting = True  # (photos let go of from here on, on this thread too, wake it: _released_off_loop)
            try:
                ready = self._selector.select(self._wait_s())
            finally:
                self._waiting = False
            for key, _ in ready:
                key.data()
            if self._accept_again_at is not None and time.monotonic() >= self._accept_again_at:
                self._accept_again_at = None
                self._selector.register(self._listener, selectors.EVENT_READ, self._accept)
            if self._turn:
                self._gather()
            self._run_turn()
            self._expire()
            self._send_answers()
            self._counts.flush_when_due(time.monotonic())

    def _wait_s(self) -> float | None:
        """How long the loop waits for its sockets: not at all when a backlog's next slice is to run (a look at what
        came) or photos let go of are still to be told, else until the first of its next deadline, its listener's
        pause and its held counts' write is due (the counts are written on time even with nothing to do); None:
        until something comes."""
        if self._deferred or any(conn.arena is not None and conn.arena.released for conn in self._shared):
            return 0.0
        due = [at for at in (self._deadlines[0][0] if self._deadlines else None, self._accept_again_at,
                             self._counts.due_at) if at is not None]
        return max(0.0, min(due) - time.monotonic()) if due else None

    def _gather(self) -> None:
        """Before a turn's requests run: the wait for more that ``gathering`` says (app/link/gathering.py), and what
        came meanwhile read. While it waits, answers and what other threads post go out, and the shared connections'
        requests are read as they come: the wait ends once the turn holds a batch of the cap, or none more can come
        from them and none from a connection of one exchange at a time could (those, hang-ups, new connections,
        catalog calls and deadlines are seen when it ends; epoll's clock may add up to a millisecond)."""
        read = len(self._turn)
        # what can still come: a request from each connection of one exchange at a time that carried one before and
        # has none under way, and from each shared one as many as it had under way at most, less those under way now
        singles_read = sum(1 for entry in self._turn if entry[3] is None)
        singles = self._requesting - self._exchanges - self._calls_off_loop - singles_read
        wait_s = self.gathering.wait_s(read, singles + sum(conn.can_come() for conn in self._shared))
        if wait_s:
            until = time.monotonic() + wait_s
            while (left := until - time.monotonic()) > 0:
                for key, _ in self._wake_only.select(left):
                    key.data()
                if len(self._turn) >= self.gathering.batch_cap or (
                        singles <= 0 and not any(conn.can_come() > 0 for conn in self._shared)):
                    break
            for key, _ in self._selector.select(0):
                key.data()
            self.gathering.waited(len(self._turn) - read)
        self.gathering.turn_runs(len(self._turn), time.monotonic())

    def _post(self, work: Callable[[], None]) -> None:
        """Run ``work`` on the loop: at once when called there, else on its next turn."""
        if threading.get_ident() == self._loop_thread:
            work()
            return
        self._posted.append(work)
        self._wake()

    def _wake(self) -> None:
        """The loop woken from its wait, to take what was posted or let go of before this call."""
        if self._wake_sent:  # the loop will take this with what is already posted: one wake-up for all of them
            return
        self._wake_sent = True
        with contextlib.suppress(BlockingIOError):  # a full wake-up socket already wakes the loop
            self._wake_write.send(b"\0")

    def _released_off_loop(self) -> None:
        """A request's photos in a shared connection's arena let go of (``MappedArena.released``): from another
        thread (a decode thread's, a batch's), or on the loop while it waits (a garbage collection that came round
        after ``_wait_s`` looked), the loop woken to tell the worker; on the loop otherwise, told before it waits
        (``_wait_s``)."""
        if self._waiting or threading.get_ident() != self._loop_thread:
            self._wake()

    def _woken(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self._wake_read.recv(4096):
                pass
        # After the bytes are read (one sent meanwhile is read too) and before taking what was posted: whatever is
        # posted from here on sends a byte, so a set flag always means a byte unread or a taking still to come
        self._wake_sent = False
        while self._posted:
            self._posted.popleft()()
        self._send_answers()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:  # gone before it was taken: the next one
                continue
            except OSError as exc:  # EMFILE, ENFILE, ENOBUFS: no room for one more connection now. Not the loop's end
                # (it serves the open ones on); the listener is left unwatched for a pause, or the loop would spin
                log.warning("cannot accept a connection (%s): the engine's connections wait %.0f ms; raise the "
                            "open-file limit (ulimit -n) if this lasts", exc, ACCEPT_PAUSE_S * 1000)
                self._selector.unregister(self._listener)
                self._accept_again_at = time.monotonic() + ACCEPT_PAUSE_S
                return
            self._adopt(sock)

    def _adopt(self, sock: socket.socket) -> None:
        sock.setblocking(False)  # read as frames come (wire.FrameReader), no poll before each read or send
        conn = _Connection(sock)
        self._selector.register(sock, selectors.EVENT_READ, functools.partial(self._readable, conn))

    def _close(self, conn: _Connection) -> None:
        """Closed; a shared connection's requests in flight then end as their clients' hang-ups."""
        if conn.closed:
            return
        conn.closed = True
        if conn.sent_infer:
            self._requesting -= 1
        for selector in (self._selector, self._wake_only):
            with contextlib.suppress(KeyError, ValueError):
                selector.unregister(conn.sock)
        self._unwatch_writes(conn)
        conn.sock.close()
        conn.reader.close_fds()
        if conn.arena is not None:
            conn.arena.close()
        if conn.exchanges is not None:
            self._shared.remove(conn)
            for ident, exchange in list(conn.exchanges.items()):
                if exchange.parts is not None:  # a bundle's: its requests of other connections run on
                    self._cancel_part(exchange, conn, ident)
                else:
                    exchange.cancelled = True
                    self._hang_up(exchange)

    def _readable(self, conn: _Connection) -> None:
        """What came of a frame (the hello, requests), or, while a request of this connection is in flight or read
        and not yet admitted (the loop waited for more), the HTTP side hanging up (it sends nothing else before the
        answer): a request read but not admitted is then ended as its client's hang-up when the turn runs. A shared
        connection sends whenever it has more (requests, cancels): read as it comes."""
        if conn.exchange is not None:
            self._hang_up(conn.exchange)
            return
        if conn.read_pending:
            self._close(conn)
            return
        try:
            frames = conn.reader.read()
        except wire.WireMismatch as exc:
            log.error("refused a connection: %s", exc)
            self._close(conn)
            return
        except (wire.EngineGone, OSError):  # the HTTP worker closed it, or it went out of step: closed here
            self._close(conn)
            return
        except Exception:  # noqa: BLE001 - one connection's fault never ends the loop every other one is served by
            log.exception("closed a connection whose frames could not be read")
            self._close(conn)
            return
        try:
            self._handle(conn, frames)
        except Exception:  # noqa: BLE001 - a message whose fields are not of their types (ids that are no tuple of
            # ints, a method that is no string): its connection closed, its requests read so far ended as hang-ups
            log.exception("closed a connection that sent a message that could not be handled")
            self._close(conn)

    def _handle(self, conn: _Connection, frames: list[tuple[Any, list[bytearray]]]) -> None:
        """A connection's messages that came in one read, in order (``_readable``). Descriptors are taken with the
        first one alone (an arena's offer), then no more (``takes_no_more_fds``)."""
        if frames and conn.reader.taking_fds and not isinstance(frames[0][0], wire.ArenaOffer):
            conn.reader.takes_no_more_fds()
        for index, (message, segments) in enumerate(frames):
            if isinstance(message, (wire.Infers, wire.Cancel)):
                if not self._shared_read(conn, message, segments):
                    return
                continue
            if conn.exchanges is not None or (
                    index < len(frames) - 1 and isinstance(message, (wire.Infer, wire.CatalogCall, wire.Explain))):
                log.warning("closed a connection that sent a %s out of step (after another request, before its "
                            "answer, or on a shared connection)", type(message).__name__)
                self._close(conn)
                return
            if isinstance(message, wire.Infer):
                conn.read_pending = True
                if not conn.sent_infer:
                    conn.sent_infer = True
                    self._requesting += 1
                arrived = time.monotonic() - (wire.time_spent(message.spent_s) or 0.0)  # when its worker had it
                self._turn.append((conn, message, segments, None, arrived))
            else:
                self._handlers[type(message)](conn, message, segments)

    def _shared_read(self, conn: _Connection, message: wire.Infers | wire.Cancel, segments: list[bytearray]) -> bool:
        """A shared connection's requests (into this turn) or cancels; False when the connection was closed for
        it (it carried a request of one exchange at a time before, or requests that do not add up)."""
        if conn.exchanges is None:
            if conn.exchange is not None or conn.read_pending:
                log.warning("closed a connection that sent several requests a message during an exchange")
                self._close(conn)
                return False
            conn.exchanges = {}
            self._shared.append(conn)
            with contextlib.suppress(OSError):  # a turn's answers in one send (up to the host's wmem_max)
                conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SHARED_SEND_BUFFER_BYTES)
            self._wake_only.register(conn.sock, selectors.EVENT_READ, functools.partial(self._readable, conn))
        if isinstance(message, wire.Cancel):
            self._cancel(conn, message.ids, message.late)
            return True
        try:
            requests = message.split(segments, conn.arena)
        except wire.EngineGone as exc:
            log.warning("closed a connection whose requests could not be read: %s", exc)
            self._close(conn)
            return False
        read_at = time.monotonic()
        for (ident, infer, its_segments), spent in zip(requests, message.spent or itertools.repeat(0.0)):
            conn.unadmitted.add(ident)
            self._turn.append((conn, infer, its_segments, ident, read_at - spent))
        conn.most = max(conn.most, len(conn.exchanges) + len(conn.unadmitted))
        return True

    def _arena_offer(self, conn: _Connection, message: wire.ArenaOffer, _: list[bytearray]) -> None:
        """A loop link's arena, offered before its requests, mapped; a connection that offers one twice, none with
        its descriptor, or one that cannot be mapped is closed (its requests' images would not be found)."""
        fd = conn.reader.take_fd()
        try:
            if fd is None or conn.arena is not None:
                if fd is not None:
                    os.close(fd)
                raise ArenaError("an arena offered twice, or without its descriptor")
            conn.arena = MappedArena(fd, message.size, self._released_off_loop)  # (which closes the descriptor,
            # mapped or not)
            conn.reader.takes_no_more_fds()
        except (ArenaError, TypeError) as exc:
            log.error("closed a connection whose arena could not be taken: %s", exc)
            self._close(conn)

    def _cancel(self, conn: _Connection, ids: tuple[int, ...], late: tuple[int, ...] = ()) -> None:
        """Requests of a shared connection whose clients left: ended as hang-ups, unanswered; those of ``late``
        (their deadline passed at their HTTP worker) as at their deadline here once their images queued (``_expire``:
        the version's 504, as a worker without an engine counts it, whichever of the two deadlines came first); one
        not yet admitted is when its turn runs; one already answered is past."""
        assert conn.exchanges is not None
        for ident in ids:
            exchange = conn.exchanges.get(ident)
            if exchange is not None and exchange.parts is not None:
                self._cancel_part(exchange, conn, ident, ident in late)
            elif exchange is not None:
                self._cancel_exchange(exchange, ident in late)
            elif ident in conn.unadmitted:
                conn.cancelled.add(ident)

    def _cancel_exchange(self, exchange: _Exchange, late: bool) -> None:
        """A request (or the last of a bundle's) nobody waits for any more: ended unanswered, at its deadline when
        ``late`` and its images are queued (``_expire``), else as a hang-up."""
        exchange.cancelled = True
        if not (late and self._end_at_deadline(exchange)):
            self._hang_up(exchange)

    def _cancel_part(self, exchange: _Exchange, conn: _Connection, ident: int, late: bool = False) -> None:
        """A bundle's request (``ident`` of ``conn``) whose client left (``late``: whose deadline passed at its
        worker, counted as its deadline here once the bundle queued): ended at once, unanswered, its image still run
        with the others'; the last one's end drops what of the bundle is still queued, as a request's own does."""
        assert exchange.parts is not None and conn.exchanges is not None
        if sum(1 for part in exchange.parts if not part.cancelled) <= 1:
            self._cancel_exchange(exchange, late)
            return
        conn.exchanges.pop(ident, None)
        for part in exchange.parts:
            if part.ident == ident and part.conn is conn and not part.cancelled:
                part.cancelled = True
                queued = exchange.queued
                exchange.admission.leave_one(
                    DeadlineExceeded.of_request(part.message.timeout_s) if late and queued is not None else
                    ClientGone("the client closed the connection; its image runs with the other requests' of its "
                               "bundle"))

    def _answer(self, value: Any = None, error: ServiceError | None = None) -> wire.Answer:
        return wire.Answer(value, error, this_process(), self.service.controller.routes.generation)

    def _reply(self, conn: _Connection, ident: int | tuple[int, ...] | None, value: Any = None,
               error: ServiceError | None = None) -> None:
        """The answer (``value`` or ``error``) sent now on a connection of one exchange at a time, or with this
        turn's others on a shared one (``_send_answers``: in one frame, no ``Answer`` made for each; ``ident`` a
        bundle's ids there, ``value`` their rows, one each, as ``wire.Answered`` says)."""
        if ident is None:
            self._send(conn, self._answer(value, error))
            return
        if conn.closed:
            return
        if not conn.answers:
            self._answering.append(conn)
        conn.answers.append((ident, value, error))

    def _send_answers(self) -> None:
        """Every shared connection's answers of this turn, in one ``Answers`` each, their requests' leaves first
        (``Service.leave_many``: counted, and what they held let go, together), with the requests whose photos in
        its arena were let go since (``MappedArena.released``; in an ``Answers`` of their own when no answer goes);
        an answer that does not pickle is sent as the server's error instead. Never a wait: what the socket does
        not take now goes when it has room (``_write``)."""
        if self._leaving:
            leaving, self._leaving = self._leaving, []
            try:
                self.service.leave_many(leaving)
            except Exception:  # noqa: BLE001 - never the loop's end: what they held is let go whatever failed
                log.exception("counting the ends of %d requests failed", len(leaving))
        answering, self._answering = self._answering, []
        engine, routes = this_process(), self.service.controller.routes.generation
        for conn in answering:
            answers, conn.answers = conn.answers, []
            if conn.closed:
                continue
            released = conn.arena.take_released() if conn.arena is not None else ()
            try:
                for first in range(0, len(answers), wire.MAX_SEGMENTS):  # a frame's segments: a row array an answer
                    some = answers[first:first + wire.MAX_SEGMENTS]
                    try:
                        conn.unsent += wire.answers_parts(some, engine, routes, released)
                    except _UNFRAMED:
                        conn.unsent += wire.answers_parts([self._sendable(answer) for answer in some], engine, routes,
                                                          released)
                    released = ()
            except Exception:  # noqa: BLE001 - one connection's fault never ends the loop: it is closed
                log.exception("closed a shared connection whose answers could not be framed")
                self._close(conn)
                continue
            self._write(conn)
        for conn in self._shared:  # photos let go with no answer to go with (cancelled, or a turn behind)
            if conn.arena is not None and conn.arena.released and not conn.closed:
                conn.unsent += wire.answers_parts((), engine, routes, conn.arena.take_released())
                self._write(conn)

    def _write(self, conn: _Connection) -> None:
        """What of a shared connection's answers its socket takes now; the rest once it has room (its second
        descriptor watched for that: the first is watched for requests). A connection that fails is closed."""
        try:
            while conn.unsent:
                wire.send_some(conn.sock, conn.unsent)
        except BlockingIOError:
            if conn.writes is None:
                try:
                    conn.writes = conn.sock.dup()
                    self._selector.register(conn.writes, selectors.EVENT_WRITE, functools.partial(self._write, conn))
                except OSError:  # no descriptor to spare: the connection cannot wait for room
                    self._close(conn)
            return
        except OSError:
            self._close(conn)
            return
        self._unwatch_writes(conn)

    def _unwatch_writes(self, conn: _Connection) -> None:
        writes, conn.writes = conn.writes, None
        if writes is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(writes)
            writes.close()

    @staticmethod
    def _sendable(answer: wire.Answered) -> wire.Answered:
        """A shared connection's answer, or, when it does not frame, the server's error instead."""
        try:
            wire.answers_parts([answer], 0, 0)
        except _UNFRAMED as exc:
            return answer[0], None, InferenceFailed(f"the engine's answer could not be sent: {exc}")
        return answer

    def _send(self, conn: _Connection, answer: wire.Answer) -> None:
        """Send ``answer``; one that does not pickle is answered as the server's error instead (nothing was sent);
        a connection that fails is closed."""
        if conn.closed:
            return
        try:
            try:
                wire.send(conn.sock, answer)
            except _UNFRAMED as exc:  # rows that make no array too
                wire.send(conn.sock, self._answer(error=InferenceFailed(f"the engine's answer could not be sent: "
                                                                        f"{exc}")))
        except OSError:
            self._close(conn)

    # -- a request, from its arrival to its answer -----------------------------------------------------------------

    def _run_turn(self) -> None:
        """The requests this turn read: every one admitted first (each then counts as on its way to its version's
        next batch, so the batcher waits for them), then their images queued: those the CPU decodes in a few
        hand-offs to the decode threads, or here when cheaper (app/link/decode_shares.py), the rest here. What was
        queued here then runs here, in batches of the cap, when they are short (``ENGINE_LOOP_BATCH_MS``; a backlog
        in slices of that long, one a turn, reads and answers between them), else on the batcher's thread.
        Each answer goes out once its futures are done, its deadline passes or its client hangs up, whichever comes
        first."""
        turn, self._turn = self._turn, []
        admitted = [exchange for exchange in self._admit_turn(turn) if exchange is not None]
        self._queue(admitted)
        deferred, self._deferred = self._deferred, {}
        ran_here = False  # whether this turn ran batches on the loop: a turn whose requests all went to the decode
        # threads ran none (their batches are the batcher's thread's), so it tells the next turns not to wait either
        # after the decode threads got theirs: a batch waits for what is on its way
        for key, batcher in deferred.items():
            try:
                if batcher.run_queued(self._loop_batch_s):
                    ran_here = True
                    if batcher.depth_for_caller:  # a backlog's next slice: the next turn's, after the answers and reads
                        self._deferred[key] = batcher
            except Exception:  # noqa: BLE001 - never the loop's end: what it left queued is the batcher's thread's
                log.exception("a batch run on the engine's loop failed")
        if admitted or deferred:
            self.gathering.batches_on_loop = ran_here

    def _admit_turn(self, turn: list[_Read]) -> list[_Exchange | None]:
        """The turn's requests admitted, those alike (model, version, client key, pixels or images) in one pass
        (``Service.enter_many``): each its exchange, or None (answered, or its client gone), in the turn's order; the
        shared connections' requests alike to the last detail, one image each (``_alike``), one exchange for all
        of them (``_admit_bundle``; photos the CPU decodes, one a run of ``DecodeShares.runs``), in the place of the
        first. A lone request (an engine with slack) is admitted as it comes (``Service.enter``: no grouping to pay
        for)."""
        if len(turn) == 1:
            message = turn[0][1]
            try:
                admission: Admission | BaseException = self.service.enter(
                    message.model, message.version, message.client_key, pixels=bool(message.tensors))
            except Exception as exc:  # noqa: BLE001 - every failure is answered, never a dropped connection
                admission = exc
            return [self._admit(*turn[0], admission)]
        alike = _alike(turn)
        admissions: list[Admission | BaseException | None] = [None] * len(turn)
        bundles: dict[int, list[int]] = {}  # a bundle's requests, by the first one's place
        for key, ats in alike.items():
            admitted = self._enter_alike([turn[at] for at in ats], isinstance(key, tuple) and key[0] is _BUNDLE)
            for _, run in itertools.groupby(zip(ats, admitted), key=_ADMISSION_OF):  # (compared as themselves)
                together = list(run)  # an admission standing for several requests is a bundle's
                if len(together) > 1 and isinstance(together[0][1], Admission):  # (not a refusal of them all)
                    bundles[together[0][0]] = [at for at, _ in together]
            for at, admission in zip(ats, admitted):
                admissions[at] = admission
        exchanges: list[_Exchange | None] = []
        for at, read in enumerate(turn):  # in the turn's order: queued as they came
            ats = bundles.get(at)
            if ats is not None:
                exchanges.append(self._admit_bundle([turn[each] for each in ats], admissions[at]))  # type: ignore
                for each in ats:
                    admissions[each] = None  # admitted with it
            elif admissions[at] is not None:
                exchanges.append(self._admit(*read, admissions[at]))  # type: ignore[arg-type]
        return exchanges

    def _enter_alike(self, reads: list[_Read], bundles: bool) -> Sequence[Admission | BaseException]:
        """Requests of a turn alike admitted together (``Service.enter_many``), each its admission or what refused
        it; ``bundles``: alike to the last detail (``_alike``), admitted as one (pixels, or photos where the
        version decodes in its batch), or, photos the CPU decodes, as one a run of ``DecodeShares.runs``."""
        message = reads[0][1]
        bundled = bundles and len(reads) > 1
        runs = () if not bundled or message.tensors else self.decode_shares.runs([len(read[2][0]) for read in reads])
        try:
            return self.service.enter_many(message.model, message.version, message.client_key, len(reads),
                                           bool(message.tensors), bundled, runs)
        except Exception as exc:  # noqa: BLE001 - every failure is answered, never a dropped connection
            return [exc] * len(reads)

    def _admit_bundle(self, reads: list[_Read], admission: Admission) -> _Exchange | None:
        """A bundle: requests of the shared connections alike to the last detail (``_alike``), admitted as one
        (``admission`` stands for all of them); each checked as ``_admit`` checks one (a request that fails is
        answered and leaves alone), those that pass one exchange whose images queue as one request's, each
        answered from its row on its connection (``_end_parts``), its deadline counted from its latest request's
        arrival: an earlier one's worker cuts it at its own (``_cancel``), never a later one's by it."""
        first: wire.Infer | None = None  # the first that passed ``_checked``: its message, and its row's layout
        # the others' pixels are read in, as what they have alike was judged with it (-1 bytes: encoded images)
        shape, dtype, nbytes = (), None, -1
        parts: list[_Part] = []
        images: list[wire.Segment] = []
        rows: list[np.ndarray] = []
        for read in reads:
            conn, segments, ident = read[0], read[2], read[3]
            if first is not None and ident not in conn.cancelled and not conn.closed and len(segments) == 1:
                if nbytes < 0:
                    conn.unadmitted.discard(ident)  # type: ignore[arg-type]
                    parts.append(_Part(conn, ident, read[1], [], segments, read[4]))  # type: ignore[arg-type]
                    images += segments
                    continue
                if len(segments[0]) == nbytes:
                    try:
                        row = np.ndarray(shape, dtype, segments[0])
                    except Exception:  # noqa: BLE001 - unforeseen: never the loop's end, checked alone below
                        pass
                    else:
                        conn.unadmitted.discard(ident)  # type: ignore[arg-type]
                        parts.append(_Part(conn, ident, read[1], [row], [], read[4]))  # type: ignore[arg-type]
                        rows.append(row)
                        continue
            inputs = self._checked(*read[:4], admission)  # answered, or counted as gone, one by one
            if inputs is None:
                continue
            if first is None:
                first = read[1]
                if inputs[1]:
                    shape, dtype, nbytes = inputs[1][0].shape, inputs[1][0].dtype, inputs[1][0].nbytes
            parts.append(_Part(conn, ident, read[1], inputs[1], inputs[0], read[4]))  # type: ignore[arg-type]
            images += inputs[0]
            rows += inputs[1]
        if first is None:
            return None
        admission.call.requests = len(parts)  # (those answered or gone already are not its to time and count)
        exchange = _Exchange(parts[0].conn, admission, first, images, rows, parts[0].ident,
                             max([part.arrived for part in parts]))
        if len(parts) > 1:
            exchange.parts = parts
        for part in parts:
            part.conn.exchanges[part.ident] = exchange  # type: ignore[index]
        return exchange

    def _admit(self, conn: _Connection, message: wire.Infer, segments: list[wire.Segment], ident: int | None,
               arrived: float, admission: Admission | BaseException) -> _Exchange | None:
        """A request of the turn, its admission made (or what refused it), becomes an exchange in flight."""
        inputs = self._checked(conn, message, segments, ident, admission)
        if inputs is None:
            return None
        exchange = _Exchange(conn, admission, message, *inputs, ident, arrived)  # type: ignore[arg-type]
        if conn.exchanges is not None:
            conn.exchanges[ident] = exchange  # type: ignore[index]
        else:
            conn.exchange = exchange
            self._exchanges += 1
        return exchange

    def _checked(self, conn: _Connection, message: wire.Infer, segments: list[wire.Segment], ident: int | None,
                 admission: Admission | BaseException) -> tuple[list[wire.Segment], list[np.ndarray]] | None:
        """A request of the turn, its admission made (or what refused it), checked: its images or pixels
        (``_inputs``), or None once it is answered (or its client gone, counted: of a bundle's admission, one)."""
        conn.read_pending = False
        cancelled = False
        if ident is not None:
            conn.unadmitted.discard(ident)
            if conn.cancelled and ident in conn.cancelled:
                cancelled = True
                conn.cancelled.discard(ident)
        if isinstance(admission, BaseException):
            if not cancelled:
                self._reply(conn, ident, error=_as_error(admission))
            return None
        if conn.closed or cancelled:  # its client hung up while the loop waited for more requests: counted, not run
            admission.leave_one(ClientGone("the client closed the connection before its request was admitted"))
            return None
        try:
            message.timeout_s = float(message.timeout_s)  # (a peer's number of another type: its messages too)
            _parsed_alike(message, admission.call.model)
            if message.embedding:  # the version routed here may not be the one the HTTP side checked
                admission.call.model.check_embedding()
            return _inputs(message, segments)
        except Exception as exc:  # noqa: BLE001 - answered
            admission.leave_one(exc)
            self._reply(conn, ident, error=_as_error(exc))
            return None

    def _queue(self, exchanges: list[_Exchange]) -> None:
        """These requests' images queued: those the CPU decodes in a few hand-offs to the decode threads, or here
        when cheaper (app/link/decode_shares.py), the rest here."""
        decoded = [exchange for exchange in exchanges if exchange.images and exchange.call.decodes_on_host]
        self._queue_here([exchange for exchange in exchanges if not (exchange.images and
                                                                     exchange.call.decodes_on_host)])
        if decoded and self.decode_shares.here(decoded):
            self._queue_all(decoded)
            return
        if (probe := self.decode_shares.probe(decoded, time.monotonic())) is not None:
            decoded.remove(probe)  # the loop's own measure of the decode, taken before the threads decode the rest
            self._queue_all([probe])
        for share in self.decode_shares.shares(decoded):
            self._decoders.submit(self._queue_all, share)

    def _queue_here(self, exchanges: list[_Exchange]) -> None:
        """On the loop: these requests' images queued (their headers read, or none to decode), those of a version
        together (``queue_prepared``: one hold of its queue for them), then watched until done; their batches the
        turn's to run (``_deferred``), as ``_queued_or_ended`` queues one (and a lone request: no grouping to pay
        for)."""
        if len(exchanges) == 1:
            queued = self._queued_or_ended(exchanges[0])
            if isinstance(queued, Queued):
                self._queued(exchanges[0], queued)
            else:
                queued()
            return
        alike: dict[int, list[tuple[_Exchange, Queued]]] = {}
        for exchange in exchanges:
            message = exchange.message
            try:
                prepared = exchange.call.prepare(exchange.images, exchange.tensors, timeout_s=message.timeout_s,
                                                 names=message.names, arrived=exchange.arrived)
            except Exception as exc:  # noqa: BLE001 - answered
                self._end(exchange, exc)
                continue
            alike.setdefault(id(exchange.call.batcher), []).append((exchange, prepared))
        for key, requests in alike.items():
            try:
                answers: list[Queued | BaseException] = list(queue_prepared(
                    [exchange.call for exchange, _ in requests], [prepared for _, prepared in requests]))
            except Exception as exc:  # noqa: BLE001 - unforeseen: every request of them is answered
                log.exception("queueing %d requests failed", len(requests))
                answers = [exc] * len(requests)
            for (exchange, _), queued in zip(requests, answers):
                if isinstance(queued, Queued):
                    if key not in self._deferred:
                        self._deferred[key] = exchange.call.batcher
                    exchange.images, exchange.tensors = [], []  # the queue holds what it needs
                    self._queued(exchange, queued)
                else:
                    self._end(exchange, queued)

    def _queue_all(self, exchanges: list[_Exchange]) -> None:
        """On a decode thread or the loop: the images of these requests decoded and queued, handed to the loop
        together; the CPU they took per byte decoded is what the next turns expect (``DecodeShares.measured``):
        requests refused before their decode (the queue's room) cost next to nothing and do not count."""
        steps: list[Callable[[], None]] = []
        decoded, spent = 0, 0.0
        try:
            for exchange in exchanges:
                size = encoded_bytes(exchange)
                queued = self._queued_or_ended(exchange)
                steps.append(functools.partial(self._queued, exchange, queued) if isinstance(queued, Queued) else
                             queued)
                if not exchange.images:  # queued: the queue holds what it needs
                    decoded, spent = decoded + size, spent + exchange.decode_cpu_s  # not a batch run here
            self.decode_shares.measured(decoded, spent, threading.get_ident() == self._loop_thread)
        except Exception as exc:  # noqa: BLE001 - unforeseen (a decode thread's executor would swallow it): every
            log.exception("queueing %d requests failed", len(exchanges))  # request not yet queued is answered
            steps += [functools.partial(self._end, exchange, exc) for exchange in exchanges[len(steps):]]

        def hand_over() -> None:
            for step in steps:
                step()

        self._post(hand_over)

    def _queued_or_ended(self, exchange: _Exchange) -> Queued | Callable[[], None]:
        """The request's images decoded (or their headers read) and queued (for ``_queued`` on the loop), or what
        the loop then does instead (its end). On the loop, queued without waking the batcher's thread: the turn then
        runs its batch there when it is short (on a CPU, or on CUDA where every batch replays a CUDA graph: the
        version says, ``tuning.loop_batches``) instead of waking that thread and being woken back; from a decode
        thread, queued for the batcher's thread, unless its client hung up meanwhile (which the loop says)."""
        message, on_loop = exchange.message, threading.get_ident() == self._loop_thread
        try:
            queued = exchange.call.queue(exchange.images, exchange.tensors, timeout_s=message.timeout_s,
                                         names=message.names, inline=False, defer=on_loop,
                                         client_gone=None if on_loop else lambda: exchange.ended,
                                         arrived=exchange.arrived)
        except Exception as exc:  # noqa: BLE001 - answered
            return functools.partial(self._end, exchange, exc)
        if on_loop:
            batcher = exchange.call.batcher
            self._deferred[id(batcher)] = batcher
        exchange.images, exchange.tensors = [], []  # the queue holds what it needs
        exchange.decode_cpu_s = queued.decode_cpu_s
        return queued

    def _queued(self, exchange: _Exchange, queued: Queued) -> None:
        """On the loop: the request's images are queued; its deadline is watched and its futures counted down."""
        exchange.queued = queued
        if exchange.ended:  # its client hung up just after its images were decoded: dropped unrun, counted
            exchange.call.hung_up(queued)
            return
        heapq.heappush(self._deadlines, (queued.deadline, next(self._order), exchange))
        queued.group.add_done_callback(functools.partial(self._done, exchange))

    def _done(self, exchange: _Exchange, _: object) -> None:
        """On the batcher's thread (or the loop): every image of the request has its row, or one failed; the
        answer is the loop's to send."""
        if threading.get_ident() == self._loop_thread:
            self._end(exchange, None)
        else:
            self._post(functools.partial(self._end, exchange, None))

    def _expire(self) -> None:
        """Answer 504 for every request whose deadline passed before its images were done."""
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            self._end_at_deadline(heapq.heappop(self._deadlines)[2])

    def _end_at_deadline(self, exchange: _Exchange) -> bool:
        """A request whose deadline passed ended with its 504 (the version's: its images queued), its images still
        queued dropped; False when it is not waiting on queued images (ended, answered, or not yet queued)."""
        queued = exchange.queued
        if exchange.ended or queued is None or queued.done():
            return False
        exchange.ended = True  # before the drop, whose cancel completes the group: its done callback finds it
        self._end(exchange, exchange.call.expired(queued), ending=True)  # ended: this answers
        return True

    def _hang_up(self, exchange: _Exchange) -> None:
        """The HTTP side closed the connection of a request in flight, or cancelled it on a shared one (its client
        left): the images still queued are dropped, the request ends as ClientGone, a connection of its own is
        closed."""
        if exchange.ended:
            return
        exchange.ended = True  # before the drop, as in _expire: its answer is this one
        queued = exchange.queued
        error = exchange.call.hung_up(queued) if queued is not None else ClientGone(
            "the client closed the connection while its images were decoded")
        if exchange.ident is None:
            self._close(exchange.conn)
        self._end(exchange, error, ending=True)

    def _end(self, exchange: _Exchange, error: BaseException | None, ending: bool = False) -> None:
        """On the loop, once: the request's admission closed with its outcome, and its answer sent. ``ending``: it
        was marked ended already, before its images were dropped (``_expire``, ``_hang_up``), so the group's done
        callback that the drop fires finds it ended: a cancelled group's outcome is no answer."""
        if exchange.ended and not ending:
            return
        exchange.ended = True
        _without_frames(error)
        if exchange.parts is not None:
            self._end_parts(exchange, error)
            return
        exchange.images, exchange.tensors = [], []  # (refused before its queueing: they were never let go)
        conn = exchange.conn
        if exchange.ident is None:
            self._exchanges -= 1
            conn.exchange = None
        else:
            conn.exchanges.pop(exchange.ident, None)  # type: ignore[union-attr]
        served = None
        if error is None:
            try:
                served = exchange.call.answer(exchange.queued, wire.NO_LABELS,  # type: ignore[arg-type]
                                              embedding=exchange.message.embedding)
            except Exception as exc:  # noqa: BLE001 - answered
                error = exc
        if exchange.ident is None or exchange.cancelled or conn.closed:  # no answer to go out with others'
            exchange.admission.leave(error)
        else:  # a shared connection's answer: the request leaves with the turn's others as they go out
            if exchange.queued is None:  # no longer on its way to a batch from now (one judged now may run here); a
                exchange.admission.arrive()  # queued one was no longer once queued
            self._leaving.append((exchange.admission, error))
        exchange.queued = None  # its deadline may stay queued a while: not the images with it
        if not exchange.cancelled:
            self._reply(conn, exchange.ident, served, None if error is None else _as_error(error))

    def _end_parts(self, exchange: _Exchange, error: BaseException | None) -> None:
        """``_end`` for a bundle: each of its requests still waited for answered from its row (those of one
        connection in a row as one answer of their rows: ``wire.Answered``), or with the error that ended them all,
        and leaving as ``_end`` leaves one; one the queue refused whole, or whose model failed
        on one of its images, runs request by request instead (``_run_apart``): one request's pixels never fail
        another's."""
        parts = exchange.parts
        assert parts is not None
        for part in parts:
            part.conn.exchanges.pop(part.ident, None)  # type: ignore[union-attr]
        served = None  # the bundle's rows, one a request, and the batches they ran in
        if error is None:
            try:
                served = exchange.call.answer(exchange.queued,  # type: ignore[arg-type]
                                              wire.NO_LABELS, embedding=exchange.message.embedding)
            except Exception as exc:  # noqa: BLE001 - answered
                error = exc
        apart = served is None and self._run_apart(exchange, error)  # type: ignore[arg-type]
        exchange.images, exchange.tensors = [], []  # what its requests' own exchanges hold now, if anything
        for part in parts:
            part.images, part.rows = [], []
        if apart:
            return
        if exchange.queued is None:  # as _end: no longer on its way to a batch (one arrival for all of them)
            exchange.admission.arrive()
        exchange.queued = None
        if exchange.cancelled:  # (its requests still waited for, at once: no answer goes out)
            exchange.admission.leave(error)
            return
        self._leaving.append((exchange.admission, error))
        answered = None if error is None else _as_error(error)
        for conn, start, stop in _connection_runs(parts):  # (not those left already, as their clients left)
            ids = tuple([part.ident for part in parts[start:stop]])
            self._reply(conn, ids if len(ids) > 1 else ids[0], None if served is None else served.between(start, stop),
                        answered)

    def _run_apart(self, exchange: _Exchange, error: BaseException) -> bool:
        """A bundle the queue refused as one request of all its images (no room for all of them, or a deadline too
        short for all of them: Overloaded, ShortDeadline), one of encoded images refused before it was queued (one
        image's header, or its decode on the CPU: InvalidImage, ImageTooLarge, ...), or whose group failed at one of
        its images (the model's fault: the batcher ran the failed batch's images again one by one to find it; or an
        image the device could not decode in its batch): its requests still waited for queued again, each its own
        exchange, call and group with the bundle's deadline, so each is judged, decoded (as a turn's requests are:
        ``_queue``) and answered on its own (after the turn's other requests: a later one of them may have taken the
        room first; one refused at a header, before those of the turn still to queue). Whether they were."""
        queued, parts = exchange.queued, exchange.parts
        refused = queued is None and (isinstance(error, (Overloaded, ShortDeadline))  # judged by its image count,
                                      or bool(exchange.images) and isinstance(error, _ONE_IMAGE_ERRORS))  # or a header
        failed = queued is not None and isinstance(error, (InferenceFailed, *_ONE_IMAGE_ERRORS)) and (
            queued.group.failed_at >= 0)  # the model's fault, or an image the device could not decode in its batch
        if not (refused or failed) or exchange.cancelled or parts is None:
            return False
        apart = []
        for part in parts:
            if not part.cancelled:
                alone = _Exchange(part.conn, exchange.admission.apart(), part.message, part.images, part.rows,
                                  part.ident, part.arrived)
                part.conn.exchanges[part.ident] = alone  # type: ignore[index]
                apart.append(alone)
        exchange.queued = None
        self._queue(apart)
        return True

    # -- the other exchanges ---------------------------------------------------------------------------------------

    def _unanswered(self, conn: _Connection, message: wire.Unanswered, _: list[bytearray]) -> None:
        """A request the HTTP side ended before sending it: admitted and ended here as it ended there, so it counts
        in its version's traffic as it would inline."""
        with contextlib.suppress(Exception):
            with self.service.admit(message.model, message.version, message.client_key):
                if message.error is not None:
                    raise message.error

    def _off_loop(self, conn: _Connection, threads: ThreadPoolExecutor, answer: Callable[[], wire.Answer]) -> None:
        """``answer`` made on one of ``threads`` (it may wait), then sent from the loop; the connection is not
        watched meanwhile (nor counted among those that could send a request)."""
        self._selector.unregister(conn.sock)
        if conn.sent_infer:
            self._calls_off_loop += 1

        def run() -> None:
            self._post(functools.partial(self._answered, conn, answer()))

        threads.submit(run)

    def _catalog(self, conn: _Connection, message: wire.CatalogCall, _: list[bytearray]) -> None:
        """On the catalog's read thread, or a change's thread (a change waits for every engine). A scrape's
        ``settle_figures`` has the requests counted so far written first, here on the loop that counts them."""
        if message.method == "settle_figures":
            self._counts.flush()
        threads = self._catalog_changes if message.method in CATALOG_CHANGES else self._catalog_reads
        self._off_loop(conn, threads, functools.partial(self._catalog_answer, message))

    def _explain(self, conn: _Connection, message: wire.Explain, segments: list[bytearray]) -> None:
        """On an explain thread (it waits for the lane)."""
        image = segments[0] if len(segments) == 1 else b""

        def answer() -> wire.Answer:
            try:
                return self._answer(self.service.explain(image, message.model, message.version, message.index,
                                                         message.png, message.timeout_s))
            except Exception as exc:  # noqa: BLE001 - answered
                return self._answer(error=_as_error(exc))

        self._off_loop(conn, self._explain_threads, answer)

    def _catalog_answer(self, message: wire.CatalogCall) -> wire.Answer:
        if message.method not in CATALOG_CALLS:
            return self._answer(error=InferenceFailed(f"no catalog call {message.method!r}"))
        try:
            value = getattr(self.service.catalog, message.method)(*message.args, **message.kwargs)
        except Exception as exc:  # noqa: BLE001 - answered
            return self._answer(error=_as_error(exc))
        return self._answer(value)

    def _answered(self, conn: _Connection, answer: wire.Answer) -> None:
        if conn.sent_infer:
            self._calls_off_loop -= 1
        self._send(conn, answer)
        if not conn.closed:
            self._selector.register(conn.sock, selectors.EVENT_READ, functools.partial(self._readable, conn))

    def _state(self, conn: _Connection, message: wire.StateQuery, _: list[bytearray]) -> None:
        service = self.service
        ready = service.ready
        self._send(conn, self._answer(wire.EngineState(ready=ready, alive=service.alive,
                                                       loaded=service.loaded, draining=service.draining,
                                                       stalled=service.stalled,
                                                       reason=None if ready else service.not_ready_reason)))
