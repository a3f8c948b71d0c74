"""How the HTTP workers and the engine process talk over the engine's Unix socket: typed messages in frames.

A connection opens with a hello (raw ASCII, never pickled: ``visionserve-wire/<PROTOCOL> <FINGERPRINT>``), which the
engine answers with ``ok`` or why not; it closes a connection whose code differs from its own (after a ``kill -HUP``
the HTTP workers run new code, the engines the old), and both sides log it. Then each exchange is one frame each way: a
request (``Infer`` with the images or tensors as raw segments, ``CatalogCall``, ``StateQuery``) and its ``Answer`` (an
inference's rows as one raw segment); ``Unanswered`` (a request the HTTP side refused before its images were sent,
counted by the engine as the version's traffic) has no answer. A connection an HTTP worker's loop requests share
(app/link/loop_link.py) carries several requests a message instead: ``Infers`` (each ``Infer``'s fields under its
id, the segments of all of them), ``Cancel`` (ids whose client left), and the engine's ``Answers`` (several answers
under their ids, the rows of each a segment: a bundle's requests of one connection the rows of one segment, one
each), in any order. Such a connection opens with ``ArenaOffer``: the shared
memory its requests' photos are then placed in (app/link/arena.py), its descriptor passed with the frame
(``send_with_fd``; a reader made with ``takes_fds`` keeps what comes); an ``Infers`` request whose images were placed
carries where they are instead of its segments, and ``Answers`` tells which requests' placed images the engine let
go of (``released``: their places free again).

A frame is a header (a message, one of ``MESSAGES``, pickled as its kind and its fields' values) and raw byte
segments, sent with one scatter-gather call and never pickled. The engine reads the header and each segment into a
buffer of its own (``FrameReader``), so an image's bytes are copied once on each side and the engine decodes them
where they were read (a JPEG's bytes are the tensor nvJPEG reads).

Standard library and numpy only (and the engine's torch-free contract, and app/hosting/waiting.py, through which
every wait here goes: a request on an HTTP worker's loop hands it to the loop): the HTTP side never imports torch.
"""
from __future__ import annotations

import array
import contextlib
import dataclasses
import hashlib
import inspect
import math
import operator
import os
import pickle
import select
import socket
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import numpy as np

from app import errors
from app.engine import contract
from app.hosting import waiting
from app.link.arena import Arena, ArenaError, MappedArena

PROTOCOL = 10  # the frame layout, what segments carry, and the hello; each message's own fields are in FINGERPRINT
_HEAD = struct.Struct("!II")  # the header's length, the number of segments
_LENGTH = struct.Struct("!Q")
MAX_SEGMENTS = 10_000  # a bound on one frame's segments (MAX_IMAGES is far lower): a corrupt frame fails at once
MAX_FRAME_BYTES = 1 << 32  # a bound on one frame's size (MAX_BODY_BYTES is far lower): a corrupt one fails at once
MAX_HELLO_BYTES = 256
JOIN_BYTES = 1 << 16  # segments up to this size in all are copied into one buffer with the header: one send, no list
SEND_STALL_S = 10.0  # a non-blocking socket whose other side takes none of a frame for this long has left
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)


class EngineGone(ConnectionError):
    """The other side closed the connection, cannot be reached, or sent what this side cannot read."""


class WireMismatch(EngineGone):
    """The two sides run different code (a hello that differs)."""


class _Message:
    """What every message shares: pickled as its class and its fields' values in order (a dataclass with slots
    otherwise pickles through dataclasses.fields() on both sides, about 20 us a message). Not frozen, though none is
    changed once made: a frozen dataclass sets each field through ``object.__setattr__``, 1.3 us for an ``Infer``'s
    nine against 0.16, made or read on both sides of every request."""

    __slots__ = ()

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        return type(self), tuple(getattr(self, name) for name in self.__slots__)


@dataclass(slots=True)
class Infer(_Message):
    """Admit and run one request, parsed with the signature of version ``parsed_version``, whose input is
    ``parsed_shape`` (not the signature itself: its labels, 1,000 for an ImageNet model, cost about 160 us a request
    to pickle and unpickle). The frame's segments are its encoded images, or, when ``tensors`` is not empty, its
    images' pixels as stacks of rows, (N, *parsed_shape) each (one for a request's pixels): ``tensors`` holds each
    stack's (dtype, shape) (``tensor_segments``; pickling arrays copied them twice more and cost about 15 us each on
    both sides, and a segment per image cost both sides a few us an image)."""

    model: str | None
    version: str | None
    client_key: str | None
    timeout_s: float
    parsed_version: str
    parsed_shape: tuple[int, ...]
    names: tuple[str | None, ...] = ()
    tensors: tuple[tuple[str, tuple[int, ...]], ...] = ()
    embedding: bool = False  # answer each image's embedding too
    spent_s: float = 0.0  # sent alone on a connection of its own: its seconds in its HTTP worker, from when the worker
    # had it whole, so its deadline counts from then at the engine too (in ``Infers``, beside it: ``Infers.spent``)


@dataclass(slots=True)
class Explain(_Message):
    """Explain one image (the frame's one segment) by ``model`` at ``version`` for class ``index`` (None: the top
    one), with its overlay PNG when ``png``; answered with a ``contract.Explanation``."""

    model: str | None
    version: str | None
    index: int | None
    png: bool
    timeout_s: float


@dataclass(slots=True)
class Unanswered(_Message):
    """A request admitted on the HTTP side that never reached ``Infer`` (its body refused: ``error``; or nothing
    asked of the model: None): the engine counts it as the routed version's request would be. No answer."""

    model: str | None
    version: str | None
    client_key: str | None
    error: errors.ServiceError | None = None


@dataclass(slots=True)
class CatalogCall(_Message):
    """One of ``contract.CATALOG_CALLS`` with its arguments."""

    method: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class StateQuery(_Message):
    """The engine's readiness, liveness and draining."""


@dataclass(slots=True)
class EngineState(_Message):
    """What ``StateQuery`` answers; ``stalled``: why the engine is not live though its threads run (a batch past
    STALL_S: ``Service.stalled``); ``reason``: why it is not ready where none of the rest says it (another engine
    not serving yet: ``Service.not_ready_reason``)."""

    ready: bool
    alive: bool
    loaded: bool
    draining: bool
    stalled: str | None = None
    reason: str | None = None


@dataclass(slots=True)
class Answer(_Message):
    """The engine's answer: ``value`` or ``error``; ``engine`` (its pid) and ``routes`` (its routing generation) say
    when what the HTTP side keeps of it (the signatures requests are parsed with) is stale. A ``Served`` value comes
    without its labels (``NO_LABELS``): the HTTP side has them in the signatures it keeps."""

    value: Any = None
    error: errors.ServiceError | None = None
    engine: int = 0
    routes: int = 0


Segment = bytearray | memoryview  # an Infer's image or stack of pixels in the engine: its frame's segment as read,
# or a view of its connection's arena where the worker placed it (``MappedArena.lent``)


_NO_FIELDS = object()  # ``Infers.split``'s fields read before the first request's (no fields a peer sends are it)


@dataclass(slots=True)
class Infers(_Message):
    """Several requests in one message, each an ``Infer``'s fields (``requests``) under its id (``ids``), the frame's
    segments theirs one request after another, ``counts`` of them each: the requests a loop turn of an HTTP worker
    gave its shared connection (one message where each had its frame: a request's header, read and reply cost the
    engine about 18 of its 27 us on this wire alone; docs/performance.md). ``split`` gives them back."""

    ids: tuple[int, ...]
    requests: tuple[tuple[Any, ...], ...]
    counts: tuple[int, ...]
    placed: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] = ()  # requests whose images are in the
    # connection's arena: each its place in ``requests`` and its images' (offset, length) there (none in segments)
    spent: tuple[float, ...] = ()  # each request's seconds in its HTTP worker when the message was made, from when
    # the worker had it whole: its deadline counts from then at the engine too (none: from the engine's receipt)

    def split(self, segments: list[bytearray], arena: MappedArena | None = None
              ) -> list[tuple[int, Infer, list[Segment]]]:
        """Each request: its id, its ``Infer`` and its segments (those placed in ``arena`` lent where they lie, the
        message's in one lending: ``MappedArena.lent``); EngineGone when they do not add up or lie outside the
        arena."""
        if not len(self.ids) == len(self.requests) == len(self.counts) or sum(self.counts) != len(segments):
            raise EngineGone(f"{len(self.ids)} requests of {sum(self.counts)} segments came with {len(segments)}")
        if self.spent:
            if len(self.spent) != len(self.ids) or any(time_spent(spent) is None for spent in self.spent):
                raise EngineGone(f"the times spent of {len(self.ids)} requests are not theirs: {self.spent!r:.200}")
        split, at = [], 0
        read: object = _NO_FIELDS  # the fields of the last Infer made: alike requests' are one object (``infers``),
        message: Infer | None = None  # so they share one Infer
        for ident, fields, count in zip(self.ids, self.requests, self.counts):
            if fields is not read:
                try:
                    message = Infer(*fields)
                except TypeError as exc:
                    raise EngineGone(f"a request that is no Infer: {exc}") from None
                read = fields
            split.append((ident, message, segments[at:at + count]))
            at += count
        if self.placed:
            if arena is None:
                raise EngineGone("images placed in an arena on a connection that offered none")
            try:
                placed = [(split[index][0], images) for index, images in self.placed]
                for (index, _), views in zip(self.placed, arena.lent(placed)):
                    split[index][2].extend(views)
            except (ArenaError, TypeError, ValueError, IndexError) as exc:
                raise EngineGone(f"placed images that could not be read: {exc}") from None
        return split


def time_spent(value: object) -> float | None:
    """``value`` as a request's seconds in its HTTP worker (a finite number, 0 or more), or None for what is no such
    time (``Infers.spent``, ``Infer.spent_s``, as a peer sent them)."""
    return float(value) if isinstance(value, (float, int)) and 0.0 <= value < math.inf else None


def infers(requests: Sequence[tuple[int, Infer, Sequence[bytes | memoryview]]], arena: Arena | None = None,
           spent: tuple[float, ...] = ()) -> tuple[Infers, list[bytes | memoryview]]:
    """The one message (and its segments) that carries ``requests``, each (id, its Infer, its segments), and the
    seconds each had spent in its HTTP worker (``spent``, in their order; none: counted from the engine's receipt);
    with ``arena``, each request's images placed there when they fit (``Arena.place``), sent in the frame
    otherwise."""
    fields = _FIELDS[_KINDS[Infer]]
    placed: list[tuple[int, tuple[tuple[int, int], ...]]] = []
    segments: list[bytes | memoryview] = []
    counts: list[int] = []
    requests_fields: list[tuple[Any, ...]] = []
    for index, (ident, message, its_segments) in enumerate(requests):
        where = arena.place(ident, its_segments) if arena is not None and its_segments else None
        if where is None:
            segments += its_segments
            counts.append(len(its_segments))
        else:
            placed.append((index, where))
            counts.append(0)
        these = fields(message)
        if requests_fields:
            try:  # alike to the one before, as a turn's requests most often are: one object, pickled once
                if these == requests_fields[-1]:  # (pickle's memo) and read as one Infer (``Infers.split``)
                    these = requests_fields[-1]
            except Exception:  # noqa: BLE001 - fields that do not compare (no truth value): sent as they are, for
                pass  # the engine to judge
        requests_fields.append(these)
    return Infers(tuple([ident for ident, _, _ in requests]), tuple(requests_fields), tuple(counts),
                  tuple(placed), spent), segments


@dataclass(slots=True)
class ArenaOffer(_Message):
    """A shared connection's first message (after the hello): the arena its requests' images may be placed in
    (app/link/arena.py), ``size`` bytes, its descriptor passed with this frame (``send_with_fd``)."""

    size: int


@dataclass(slots=True)
class Cancel(_Message):
    """The requests of these ids (sent in ``Infers``) are not waited for any more: their clients left or their time
    ran out on the HTTP side (``late``: those of them whose deadline passed there, which the engine ends as at its
    own: a 504 of images queued is the version's, as in a worker without an engine). The engine drops what of them
    is still queued and answers none of them."""

    ids: tuple[int, ...]
    late: tuple[int, ...] = ()


@dataclass(slots=True)
class Answers(_Message):
    """Answers to requests sent in ``Infers``, under their ids, in the order they were made (not the requests'), and
    the requests whose images placed in the connection's arena the engine let go of (``released``; with no answer
    when nothing else goes out). Sent by the engine's loop as ``answers_parts`` frames them (a bundle's answers on
    one connection as one head and one segment of their rows), read as one ``Answer`` an id."""

    ids: tuple[int, ...]
    answers: tuple[Answer, ...]
    released: tuple[int, ...] = ()


class _ServedHead(NamedTuple):
    """A ``contract.Served`` as it crosses in an ``Answer``: all of it but its rows, which follow as the frame's one
    segment (``dtype`` and ``shape``: one array, a row per input), its batch runs as plain tuples. Pickled, its rows'
    arrays and a result object per row cost about 26 us to send and 17 to read for one image, 100 and 90 for 16."""

    model: str
    version: str
    labels: list[str]
    decode_s: float
    started_ns: int
    batches: tuple[tuple[int, int, int, float, float], ...]  # each BatchRun's fields (rows, batch_id, ..., run_s)
    dtype: str
    shape: tuple[int, ...]
    embedding_dim: int


MESSAGES = (Infer, Unanswered, CatalogCall, StateQuery, EngineState, Answer, Explain, Infers, Cancel, Answers,
            ArenaOffer)
# A frame's header is the pickled tuple (kind, fields): kind the message's place in MESSAGES, or _SERVED for an Answer
# whose value is a Served (its fields: the _ServedHead's, error, engine, routes). Pickling the message itself wrote
# and looked up its class by name both ways: about 4 us more to send and 2 more to read an Infer, 8 and 3 an answer.
_KINDS = {cls: kind for kind, cls in enumerate(MESSAGES)}
_FIELDS = [operator.attrgetter(*cls.__slots__) if len(cls.__slots__) > 1 else
           (lambda message, names=cls.__slots__: tuple(getattr(message, name) for name in names)) for cls in MESSAGES]
_SERVED = len(MESSAGES)
_ANSWER = _KINDS[Answer]
_ANSWERS = _KINDS[Answers]
NO_LABELS: list[str] = []  # what an answer's Served holds in place of its version's labels
REQUESTS = (Infer, Unanswered, CatalogCall, StateQuery, Explain, Infers, Cancel, ArenaOffer)


def _shape(cls: type) -> str:
    """A class as the other side must know it to unpickle it: its place, name and fields."""
    if dataclasses.is_dataclass(cls):
        names = [f.name for f in dataclasses.fields(cls)]
    else:  # a pydantic model (the manifest), a NamedTuple, or an error class
        names = list(getattr(cls, "model_fields", None) or getattr(cls, "_fields", ()))
    return f"{cls.__module__}.{cls.__qualname__}({','.join(names)})"


def _fingerprint() -> str:
    """What both sides must agree on: the messages, the contract's data and every error an answer may carry."""
    carried = [*MESSAGES, _ServedHead, contract.Signature, contract.Served, contract.Ranked, contract.VersionInfo,
               contract.Explanation, contract.MonitorSnapshot, contract.ClassCount, contract.ReferenceSummary,
               contract.VersionState, contract.ModelsOverview, contract.RepositoryOverview, contract.Manifest,
               contract.BatchRun,
               *(c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, errors.ServiceError)),
               *(getattr(contract.CatalogFace, name) for name in contract.CATALOG_CALLS)]
    shapes = sorted(_shape(c) if isinstance(c, type) else f"{c.__qualname__}{inspect.signature(c)}" for c in carried)
    return hashlib.sha256("\n".join(shapes).encode()).hexdigest()[:16]


FINGERPRINT = _fingerprint()
HELLO = f"visionserve-wire/{PROTOCOL} {FINGERPRINT}".encode("ascii")


def _frame_parts(head: bytes, segments: Sequence[bytes | memoryview]) -> list[memoryview]:
    """A frame's bytes as the buffers one scatter-gather send takes: the header and the segment table, then the
    segments, joined into one buffer when small."""
    first = b"".join([_HEAD.pack(len(head), len(segments)), *[_LENGTH.pack(len(s)) for s in segments], head])
    if not segments:
        return [memoryview(first)]
    if sum(map(len, segments)) <= JOIN_BYTES:  # a small frame (an answer's rows, a few tensors): one buffer
        return [memoryview(b"".join([first, *segments]))]
    return [memoryview(first), *[memoryview(s).cast("B") for s in segments]]  # images: sent from where they are


def send_some(sock: socket.socket, parts: list[memoryview]) -> None:
    """What of ``parts`` a non-blocking ``sock`` takes now, taken from ``parts`` (those left are what it did not
    take); BlockingIOError when it takes none."""
    sent = sock.sendmsg(parts[:_IOV_MAX])  # the kernel takes at most IOV_MAX buffers a call
    while parts and sent >= len(parts[0]):  # a partial send (a signal, a full buffer): go on from there
        sent -= len(parts.pop(0))
    if parts:
        parts[0] = parts[0][sent:]


def _send_frame(sock: socket.socket, head: bytes, segments: Sequence[bytes | memoryview]) -> None:
    parts = _frame_parts(head, segments)
    while parts:
        try:
            send_some(sock, parts)
        except BlockingIOError:  # a non-blocking socket's buffer is full: on once the other side has read some
            if not _writable(sock, SEND_STALL_S):
                raise EngineGone(f"the other side took nothing of a frame for {SEND_STALL_S:g}s") from None


def _encoded(message: Any, segments: Sequence[bytes | memoryview]) -> tuple[bytes, Sequence[bytes | memoryview]]:
    """The frame's header (the pickled (kind, fields)) and its segments: an answer's Served as its head, its rows'
    bytes the one segment."""
    kind = _KINDS.get(type(message))
    if kind is None:
        raise TypeError(f"{type(message).__name__} is no message of the wire")
    served = message.value if kind == _ANSWER else None
    if isinstance(served, contract.Served):
        head, rows = _served_head(served)
        fields: tuple[Any, ...] = (head, message.error, message.engine, message.routes)
        kind, segments = _SERVED, [rows]
    elif kind == _ANSWERS:
        fields, segments = _answers_fields(message)
    else:
        fields = _FIELDS[kind](message)
    return pickle.dumps((kind, fields), protocol=pickle.HIGHEST_PROTOCOL), segments


def _served_head(served: contract.Served) -> tuple[tuple[Any, ...], memoryview]:
    """A Served as it crosses: its ``_ServedHead``'s fields and its rows' bytes."""
    rows, segment = _rows_segment(served.rows)
    return _head(served, rows), segment


def _head(served: contract.Served, rows: np.ndarray) -> tuple[Any, ...]:
    """``served``'s ``_ServedHead`` fields, its rows as ``_rows_segment`` made them cross."""
    return (served.model, served.version, served.labels, served.decode_s, served.started_ns,
            tuple([tuple(run) for run in served.batches]), rows.dtype.str, rows.shape, served.embedding_dim)


def _rows_segment(rows: Any) -> tuple[np.ndarray, memoryview]:
    """Rows as they cross (an array, made C-contiguous when it is not, or made one), and their bytes; TypeError for
    rows that are not numbers."""
    try:
        segment = memoryview(rows).cast("B")  # (a batch's rows, as they most often are: no copy, no numpy call)
    except TypeError:  # rows not C-contiguous, or no buffer
        rows = np.ascontiguousarray(rows)
        segment = memoryview(rows).cast("B")
    if rows.dtype.hasobject:  # their bytes would be pointers: the request answered its error alone (the callers')
        raise TypeError(f"rows of {rows.dtype} do not cross the link")
    return rows, segment


def _same_head(served: contract.Served, rows: np.ndarray, other: contract.Served, other_rows: np.ndarray) -> bool:
    """Whether ``served`` (its ``rows`` as they cross) crosses with ``other``'s head: each of its fields the same
    object as ``other``'s (a bundle's answers, made together), its rows of the same type and shape. Those fields
    make the head, so it is the same head whatever made them; looked at by identity, it costs less than making
    the head again."""
    return (served.batches is other.batches and served.model is other.model and served.version is other.version
            and served.labels is other.labels and served.decode_s is other.decode_s
            and served.started_ns is other.started_ns and served.embedding_dim is other.embedding_dim
            and rows.dtype is other_rows.dtype and rows.shape == other_rows.shape)


def _answers_fields(message: Answers) -> tuple[tuple[Any, ...], list[memoryview]]:
    """An ``Answers``' fields: the ids, each answer as ``_answered_items`` frames it, the engine and the latest
    routing generation among them; each Served's rows a segment."""
    ids, items, segments = _answered_items([(ident, answer.value, answer.error)
                                            for ident, answer in zip(message.ids, message.answers)])
    engine = message.answers[0].engine if message.answers else 0
    routes = max([answer.routes for answer in message.answers], default=0)  # the latest: a routing change of the
    return (ids, items, engine, routes, message.released), segments  # turn drops what the HTTP side keeps


Answered = tuple[int | tuple[int, ...], Any, "errors.ServiceError | None"]  # an answer as the engine's loop sends
# it: its request's id and its value and error; or several requests' ids (a bundle's on one connection) and one
# Served of their rows, one each in the ids' order (or the error that ended them all)


def _answered_items(answered: Sequence[Answered]) -> tuple[tuple[int, ...], tuple[tuple[Any, ...], ...],
                                                           list[memoryview]]:
    """Answers as an ``Answers`` frame carries them: the ids, and each answer as (its Served's head or None, its
    other value, its error, how many of the ids it answers), each Served's rows a segment: several requests' rows
    one segment, read as a row each. Answers in a row whose heads are the same (made together: ``_same_head``)
    share one head object: pickled once (pickle's memo), read as one (``_answers_from``). ValueError for a Served
    whose rows are not one for each of its ids."""
    ids: list[int] = []
    items, segments = [], []
    last: contract.Served | None = None  # the last Served framed, its rows as they crossed and its head
    last_rows: np.ndarray | None = None
    head: tuple[Any, ...] = ()
    for ident, value, error in answered:
        if type(ident) is tuple:
            ids += ident
            count = len(ident)
        else:
            ids.append(ident)  # type: ignore[arg-type]
            count = 1
        if isinstance(value, contract.Served):
            rows, segment = _rows_segment(value.rows)
            if count > 1 and len(rows) != count:
                raise ValueError(f"{len(rows)} rows answer {count} requests")
            if last is None or not _same_head(value, rows, last, last_rows):  # type: ignore[arg-type]
                last, last_rows, head = value, rows, _head(value, rows)
            items.append((head, None, error, count))
            segments.append(segment)
        else:
            items.append((None, value, error, count))
    return tuple(ids), tuple(items), segments


def answers_parts(answered: Sequence[Answered], engine: int, routes: int, released: tuple[int, ...] = ()
                  ) -> list[memoryview]:
    """The frame of ``Answers`` for ``answered`` (each as ``Answered`` says: an answer, or several requests' as
    one), with this ``engine`` and ``routes`` and no ``Answer`` made for each (an event loop's answers of a turn),
    as the buffers ``send`` would send, for a sender that waits for room itself (``send_some``)."""
    ids, items, segments = _answered_items(answered)
    head = pickle.dumps((_ANSWERS, (ids, items, engine, routes, released)), protocol=pickle.HIGHEST_PROTOCOL)
    return _frame_parts(head, segments)


def send_with_fd(sock: socket.socket, message: Any, fd: int) -> None:
    """``message`` (no segments) with the descriptor ``fd`` passed along (SCM_RIGHTS), in one call: the frame is
    small and goes first on its connection, so its socket takes it whole; EngineGone when it does not."""
    head, _ = _encoded(message, ())
    data = b"".join(_frame_parts(head, ()))
    try:
        sent = socket.send_fds(sock, [data], [fd])
    except BlockingIOError:
        sent = 0
    if sent != len(data):
        raise EngineGone(f"the other side took {sent} of a {len(data)}-byte frame that passes a descriptor")


def send(sock: socket.socket, message: Any, segments: Sequence[bytes | memoryview] = ()) -> None:
    """One frame: ``message`` (one of MESSAGES, its kind and values pickled; an answer's rows a segment) and
    ``segments`` (sent as they are)."""
    _send_frame(sock, *_encoded(message, segments))


def frame(message: Any) -> bytes:
    """``message``'s whole frame as ``send`` sends it: for several frames sent in one call."""
    head, segments = _encoded(message, ())
    return b"".join([_HEAD.pack(len(head), len(segments)), *(_LENGTH.pack(len(s)) for s in segments), head,
                     *segments])


def _answer_with_served(fields: tuple[Any, ...], segments: Sequence[memoryview]) -> Answer:
    """The Answer a ``_SERVED`` frame's fields and rows make."""
    raw, error, engine, routes = fields
    if len(segments) != 1:
        raise EngineGone(f"an answer's rows in {len(segments)} segments: the stream is out of step")
    return Answer(_served(raw, segments[0]), error, engine, routes)


class _HeadRead(NamedTuple):
    """A ``_ServedHead`` as read: itself, its rows' type, its batch runs and the rows they add up to."""

    head: _ServedHead
    dtype: np.dtype
    runs: tuple[contract.BatchRun, ...]
    rows: int


def _read_head(raw: tuple[Any, ...]) -> _HeadRead:
    """A ``_ServedHead``'s fields read; EngineGone when they do not read as one."""
    try:
        head = _ServedHead(*raw)
        runs = tuple([contract.BatchRun(*run) for run in head.batches])
        return _HeadRead(head, np.dtype(head.dtype), runs, sum([run.rows for run in runs]))
    except (TypeError, ValueError, IndexError) as exc:
        raise EngineGone(f"an answer's head does not read as one ({raw}): {exc}") from None


def _served(raw: tuple[Any, ...], segment: bytes | bytearray | memoryview, read: _HeadRead | None = None
            ) -> contract.Served:
    """The Served a ``_ServedHead``'s fields and its rows' segment make (``read``: that head read already, for
    answers that share it)."""
    head, dtype, runs, expected = read or _read_head(raw)
    try:
        rows = np.frombuffer(segment, dtype=dtype).reshape(head.shape)
    except (TypeError, ValueError) as exc:
        raise EngineGone(f"an answer's rows do not read as its head says ({head}): {exc}") from None
    if len(rows) != expected:
        raise EngineGone(f"an answer's {len(rows)} rows for batch runs of other rows: the stream is out of step")
    return contract.Served(rows, runs, head.model, head.version, head.labels or NO_LABELS, head.decode_s,
                           head.started_ns, head.embedding_dim)


def _one_each(served: contract.Served, count: int) -> list[contract.Served]:
    """Several requests' answer (``count`` of them, in order) as each one's: its row (a view) and the run it ran
    in; EngineGone when the rows are not one each."""
    if len(served.rows) != count:
        raise EngineGone(f"{len(served.rows)} rows answer {count} requests: the stream is out of step")
    each: list[tuple[contract.BatchRun, ...]] = []
    for run in served.batches:
        each += [(run if run.rows == 1 else run._replace(rows=1),)] * run.rows
    rows, model, version, labels = served.rows, served.model, served.version, served.labels
    return [contract.Served(rows[at:at + 1], runs, model, version, labels, served.decode_s, served.started_ns,
                            served.embedding_dim) for at, runs in enumerate(each)]


def _answers_from(fields: tuple[Any, ...], segments: Sequence[bytes | bytearray | memoryview]) -> Answers:
    """The ``Answers`` an ``_ANSWERS`` frame's fields and segments make: an ``Answer`` an id."""
    ids, items, engine, routes, released = fields
    answers, rows = [], iter(segments)
    last: tuple[Any, ...] | None = None  # the last head read, and what it read as: answers that share it read it once
    read: _HeadRead | None = None
    try:
        for head, value, error, count in items:
            if not 0 < count <= len(ids):
                raise EngineGone(f"an answer for {count} of {len(ids)} requests: the stream is out of step")
            if head is None:
                answers += [Answer(value, error, engine, routes) for _ in range(count)]
                continue
            if head is not last:
                last, read = head, _read_head(head)
            served = _served(head, next(rows), read)
            if count == 1:
                answers.append(Answer(served, error, engine, routes))
            else:
                answers += [Answer(one, error, engine, routes) for one in _one_each(served, count)]
    except StopIteration:
        raise EngineGone("answers with fewer row segments than served answers: the stream is out of step") from None
    if next(rows, None) is not None or len(answers) != len(ids):
        raise EngineGone("answers whose ids, rows and segments do not add up: the stream is out of step")
    return Answers(tuple(ids), tuple(answers), tuple(released))


def tensor_segments(tensors: Sequence[Any]) -> tuple[tuple[tuple[str, tuple[int, ...]], ...], list[memoryview]]:
    """What ``Infer`` carries of C-contiguous arrays (numpy's or any with the buffer protocol, a dtype and a shape):
    each one's (dtype, shape), and its bytes as a segment, not copied."""
    views = [memoryview(tensor) for tensor in tensors]
    if not all(view.c_contiguous for view in views):
        raise ValueError("tensors cross the link C-contiguous")
    return (tuple((tensor.dtype.str, tuple(tensor.shape)) for tensor in tensors),
            [view.cast("B") for view in views])


def _read_exactly(sock: socket.socket, size: int, grace_s: float = SEND_STALL_S) -> memoryview:
    """``size`` bytes; on a non-blocking socket each wait for more is ``readable``'s (a request on the HTTP worker's
    loop hands it to the loop), ``grace_s`` at most."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        try:
            n = sock.recv_into(view[got:], size - got)
        except BlockingIOError:
            if not readable(sock, grace_s):
                raise EngineGone(f"the other side sent nothing more of a frame for {grace_s:g}s") from None
            continue
        if n == 0:
            raise EngineGone("the connection closed mid-frame" if got else "the connection closed")
        got += n
    return view


def _frame_head(data: bytes | bytearray | memoryview, max_head: int = MAX_FRAME_BYTES) -> tuple[int, int]:
    """A frame's header length and segment count, from its first bytes; EngineGone when out of bounds."""
    head_size, count = _HEAD.unpack_from(data)
    if count > MAX_SEGMENTS or head_size > max_head:
        raise EngineGone(f"a frame of {count} segments and a {head_size}-byte header: the stream is corrupt")
    return head_size, count


def _segment_lengths(table: bytes | bytearray | memoryview, at: int, count: int, head_size: int) -> list[int]:
    """The segments' lengths from the table at ``at``; EngineGone when the frame's body would be out of bounds."""
    lengths = [_LENGTH.unpack_from(table, at + i * _LENGTH.size)[0] for i in range(count)]
    if head_size + sum(lengths) > MAX_FRAME_BYTES:
        raise EngineGone(f"a frame of {head_size + sum(lengths)} bytes: the stream is corrupt")
    return lengths


def _receive_frame(sock: socket.socket, max_head: int = MAX_FRAME_BYTES,
                   grace_s: float = SEND_STALL_S) -> tuple[memoryview, list[memoryview]]:
    head_size, count = _frame_head(_read_exactly(sock, _HEAD.size, grace_s), max_head)
    table = _read_exactly(sock, _LENGTH.size * count, grace_s) if count else memoryview(b"")
    lengths = _segment_lengths(table, 0, count, head_size)
    body = _read_exactly(sock, head_size + sum(lengths), grace_s)
    return body[:head_size], _split(body, head_size, lengths)


def _split(body: memoryview, at: int, lengths: Sequence[int]) -> list[memoryview]:
    """A frame's segments: views of ``body`` of ``lengths`` one after the other from ``at`` (the header's end)."""
    segments = []
    for length in lengths:
        segments.append(body[at:at + length])
        at += length
    return segments


def _loads(head: bytes | bytearray | memoryview, segments: Sequence[bytes | bytearray | memoryview]) -> Any:
    """The message a frame's header and segments make."""
    try:
        kind, fields = pickle.loads(head)
        if kind == _SERVED:
            return _answer_with_served(fields, segments)
        if kind == _ANSWERS:
            return _answers_from(fields, segments)
        if not 0 <= kind < _SERVED:
            raise ValueError(f"no message of kind {kind!r}")
        return MESSAGES[kind](*fields)
    except EngineGone:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever unpickling raises, the stream cannot go on
        raise EngineGone(f"a frame that does not unpickle as a message: {type(exc).__name__}: {exc}") from None


FDS_PER_READ = 4  # descriptors one read takes (a connection passes one, its arena's: more are closed by the kernel)
_FD = array.array("i")  # a descriptor as SCM_RIGHTS passes it
READ_AHEAD_BYTES = 1 << 16  # one read's buffer: a request of a few small images or tensors comes in one call


class FrameReader:
    """The frames of a connection as they arrive, for a non-blocking socket that a selector watches (no poll before
    each read, no read that waits): one ``recv`` a ``read()``, more only while a large frame's buffers fill. A frame
    that arrives in pieces is completed over several reads. Its header and each of its segments are read into a
    buffer of their own (a bytearray), the part beyond the read-ahead buffer straight into them (a scatter read), so
    a segment is the request's image, not a view that would be copied to stand alone. With ``greet``, the first
    frame is the hello, answered here (``ok``, or WireMismatch saying both sides' code, also told to the other
    side). EngineGone when the other side closed or sent what cannot be read."""

    def __init__(self, sock: socket.socket, expected: tuple[type, ...] = MESSAGES, greet: bool = False,
                 takes_fds: bool = False) -> None:
        self.sock, self._expected, self._greeting = sock, expected, greet
        self._ancillary = socket.CMSG_SPACE(FDS_PER_READ * _FD.itemsize) if takes_fds else 0
        self.fds: list[int] = []  # with ``takes_fds``: descriptors passed along (SCM_RIGHTS), in order, for the
        # caller to take (``take_fd``) or close (``close_fds``)
        self._ahead, self._have = bytearray(READ_AHEAD_BYTES), 0
        self._parts: list[bytearray] | None = None  # the frame being read: its header, then its segments
        self._unfilled: list[memoryview] = []  # what of its parts is still to come, in order from ``_next``
        self._next = 0

    @property
    def started(self) -> bool:
        """Whether part of a frame has come."""
        return bool(self._have) or self._parts is not None

    def read(self) -> list[tuple[Any, list[bytearray]]]:
        """One read: the messages (of ``expected``) it completed, in order, each with its segments (a bytearray
        each); none when nothing had come (a spurious wake-up). A read that filled what it was given and left a frame
        begun reads on at once (a large frame, such as a photo's, sent in one call, comes whole in one wake-up, not a
        turn of the loop a buffer's worth)."""
        frames: list[tuple[Any, list[bytearray]]] = []
        while True:
            if self._parts is not None:
                into = self._unfilled[self._next:self._next + _IOV_MAX]
                try:
                    count = self._receive_into(into)
                except (BlockingIOError, InterruptedError):
                    return frames
                if count == 0:
                    raise EngineGone("the connection closed mid-frame")
                filled = self._filled(count)
                frames = self._completed(frames)
            else:
                view = memoryview(self._ahead)[self._have:]
                room = len(view)
                try:
                    count = self._receive_into([view])
                except (BlockingIOError, InterruptedError):
                    return frames
                finally:
                    view.release()  # the buffer it views may be replaced by a larger one
                if count == 0:
                    raise EngineGone("the connection closed mid-frame" if self.started else "the connection closed")
                filled = count == room
                self._have += count
                frames = self._from_ahead(frames)
            if not (filled and self._parts is not None):
                return frames

    def _receive_into(self, buffers: list[memoryview]) -> int:
        """One read into ``buffers``; with ``takes_fds``, the descriptors passed with what it read kept (``fds``)."""
        if not self._ancillary:
            return self.sock.recv_into(buffers[0]) if len(buffers) == 1 else self.sock.recvmsg_into(buffers)[0]
        count, ancillary, _, _ = self.sock.recvmsg_into(buffers, self._ancillary)
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                passed = array.array(_FD.typecode)
                passed.frombytes(data[:len(data) - len(data) % _FD.itemsize])
                self.fds += passed
        return count

    @property
    def taking_fds(self) -> bool:
        """Whether descriptors passed along are kept (``takes_fds``, until ``takes_no_more_fds``)."""
        return bool(self._ancillary)

    def takes_no_more_fds(self) -> None:
        """Descriptors passed along from here on are not taken (the kernel closes them), and those not taken are
        closed: a connection passes one, with its first message."""
        self._ancillary = 0
        self.close_fds()

    def take_fd(self) -> int | None:
        """The first descriptor passed along and not yet taken (the caller's to close), or None."""
        return self.fds.pop(0) if self.fds else None

    def close_fds(self) -> None:
        """Every descriptor passed along and not taken, closed (its connection's end)."""
        fds, self.fds = self.fds, []
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _filled(self, count: int) -> bool:
        """``count`` bytes read into the parts still to come: whether they filled every one the read was given."""
        unfilled, at, given = self._unfilled, self._next, min(self._next + _IOV_MAX, len(self._unfilled))
        while count and at < given:
            view = unfilled[at]
            if count < len(view):
                unfilled[at] = view[count:]
                break
            count -= len(view)
            at += 1
        self._next = at
        return at == given

    def _from_ahead(self, frames: list[tuple[Any, list[bytearray]]]) -> list[tuple[Any, list[bytearray]]]:
        """``frames`` and every frame whose start is in the read-ahead buffer: taken from it, whole or begun."""
        while self._parts is None and self._have >= _HEAD.size:
            head_size, count = _frame_head(self._ahead, MAX_HELLO_BYTES if self._greeting else MAX_FRAME_BYTES)
            table_end = _HEAD.size + _LENGTH.size * count
            if table_end > len(self._ahead):  # a table of many segments: beyond the buffer as it is
                grown = bytearray(table_end)  # a new one: the read's view of the old one may still be held
                grown[:self._have] = memoryview(self._ahead)[:self._have]
                self._ahead = grown
            if self._have < table_end:
                break
            used = self._take_parts([head_size, *_segment_lengths(self._ahead, _HEAD.size, count, head_size)],
                                    table_end)
            if used < self._have:  # the start of a next frame: to the buffer's start
                self._ahead[:self._have - used] = self._ahead[used:self._have]
            self._have -= used
            frames = self._completed(frames)
        return frames

    def _take_parts(self, sizes: list[int], at: int) -> int:
        """The frame whose parts (its header, then its segments) have ``sizes`` and start at ``at`` in the read-ahead
        buffer, made ``_parts``: a part the buffer holds whole copied out of it (one copy, nothing zeroed first); the
        part the buffer ends in begun, and the rest of it and every part after it left to be read into
        (``_unfilled``). Returns where the buffer's bytes of the frame end."""
        ahead, have = memoryview(self._ahead), self._have
        parts: list[bytearray] = []
        unfilled: list[memoryview] = []
        for size in sizes:
            if not unfilled and at + size <= have:
                parts.append(bytearray(ahead[at:at + size]))
                at += size
                continue
            part = bytearray(size)
            if not unfilled:  # the part the buffer ends in
                part[:have - at] = ahead[at:have]
                unfilled.append(memoryview(part)[have - at:])
                at = have
            elif size:
                unfilled.append(memoryview(part))
            parts.append(part)
        ahead.release()
        self._parts, self._unfilled, self._next = parts, unfilled, 0
        return at

    def _completed(self, frames: list[tuple[Any, list[bytearray]]]) -> list[tuple[Any, list[bytearray]]]:
        """``frames`` and the one being read, once whole (the hello answered, not returned)."""
        parts = self._parts
        if parts is None or self._next < len(self._unfilled):
            return frames
        self._parts, self._unfilled, self._next = None, [], 0
        head, segments = parts[0], parts[1:]
        if self._greeting:
            self._greeting = False
            _answer_hello(self.sock, head)
            return frames
        message = _loads(head, segments)
        if not isinstance(message, self._expected):
            raise EngineGone(f"a {type(message).__name__} frame where "
                             f"{'/'.join(t.__name__ for t in self._expected)} belongs")
        frames.append((message, segments))
        return frames


ANSWER_READ_BYTES = 1 << 16  # an answer's first read: one image's answer (a row of 1,000 classes) fits in it


def _receive_some(sock: socket.socket, most: int, grace_s: float) -> bytes:
    """What has arrived (at least one byte, at most ``most``), else what arrives within ``grace_s``: read into a
    fresh buffer that is not zeroed first (``recv``; a zeroed 64 KiB buffer was most of an answer's read)."""
    while True:
        try:
            data = sock.recv(most, socket.MSG_DONTWAIT)
        except BlockingIOError:
            if not readable(sock, grace_s):
                raise EngineGone(f"the engine sent nothing more of its answer for {grace_s:g}s") from None
            continue
        if not data:
            raise EngineGone("the connection closed mid-frame")
        return data


def _answer_layout(data: bytes | bytearray) -> tuple[int, int, int, list[int]] | None:
    """A frame's whole size, where its header starts (after the segment table), the header's length and the segments'
    lengths, once ``data`` holds its header and segment table, else None."""
    if len(data) < _HEAD.size:
        return None
    head_size, count = _frame_head(data)
    table_end = _HEAD.size + _LENGTH.size * count
    if len(data) < table_end:
        return None
    lengths = _segment_lengths(data, _HEAD.size, count, head_size)
    return table_end + head_size + sum(lengths), table_end, head_size, lengths


def receive_answer(sock: socket.socket, grace_s: float) -> Answer:
    """The engine's answer to the exchange in progress, read in as few calls as it arrived in (one, for a small
    answer: no timeout toggled, no poll before each read). The engine sends nothing on a connection but the answer
    of its exchange, so reading ahead of the frame's length takes nothing of a next one; an answer that stops
    arriving for ``grace_s`` is EngineGone. Its frame's layout is read once."""
    data: bytes | bytearray = _receive_some(sock, ANSWER_READ_BYTES, grace_s)
    layout = _answer_layout(data)
    if layout is None or len(data) < layout[0]:  # a large answer, or one still arriving: gathered in one buffer
        data = bytearray(data)
        while layout is None or len(data) < layout[0]:
            data += _receive_some(sock, layout[0] - len(data) if layout else ANSWER_READ_BYTES, grace_s)
            layout = layout or _answer_layout(data)
    size, table_end, head_size, lengths = layout
    if len(data) > size:
        raise EngineGone(f"{len(data) - size} bytes beyond the answer: the stream is out of step")
    view = memoryview(data)
    message = _loads(view[table_end:table_end + head_size], _split(view, table_end + head_size, lengths))
    if not isinstance(message, Answer):
        raise EngineGone(f"a {type(message).__name__} frame where Answer belongs")
    return message


_WELCOME = b"ok"


def say_hello(sock: socket.socket, timeout_s: float = SEND_STALL_S) -> None:
    """The HTTP side's greeting: which code it runs; WireMismatch with the engine's reason when it differs,
    EngineGone when no answer comes within ``timeout_s`` (a non-blocking socket's wait is ``readable``'s)."""
    _send_frame(sock, HELLO, ())
    head, _ = _receive_frame(sock, max_head=MAX_HELLO_BYTES * 4, grace_s=timeout_s)
    if bytes(head) != _WELCOME:
        raise WireMismatch(bytes(head).decode("utf-8", "replace"))


def _answer_hello(sock: socket.socket, head: bytes | bytearray | memoryview) -> None:
    """The engine's side of the greeting, to the first frame's ``head``: ``ok``, or WireMismatch (saying both sides'
    code, also told to the other side) when it is not this code's hello."""
    if bytes(head) == HELLO:
        _send_frame(sock, _WELCOME, ())
        return
    theirs = bytes(head[:MAX_HELLO_BYTES]).decode("ascii", "replace")
    why = (f"an HTTP worker speaks {theirs!r} and the engine {HELLO.decode()!r}: they run different code (a HUP "
           "restarts the HTTP workers, not the engines): restart the server")
    _send_frame(sock, why.encode("utf-8"), ())
    raise WireMismatch(why)


def readable(sock: socket.socket, timeout_s: float = 0.0) -> bool:
    """Whether ``sock`` has data or its end within ``timeout_s``."""
    return waiting.wait_for(sock, select.POLLIN | select.POLLHUP | select.POLLERR, timeout_s)


def _writable(sock: socket.socket, timeout_s: float) -> bool:
    return waiting.wait_for(sock, select.POLLOUT, timeout_s)


def peer_closed(sock: socket.socket) -> bool:
    """Whether the other end has closed ``sock`` (a readable socket with data, such as a next request, has not)."""
    try:
        return readable(sock) and sock.recv(1, socket.MSG_PEEK) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except (OSError, ValueError):  # anything else: assume the peer is still there
        return False


def connect(path: Path, timeout_s: float) -> socket.socket:
    """A connection to the engine listening at ``path`` (the caller greets it: say_hello); EngineGone when none
    listens."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(str(path))
    except OSError as exc:
        sock.close()
        raise EngineGone(f"no engine at {path}: {exc.strerror or exc}") from None
    sock.settimeout(None)
    return sock
