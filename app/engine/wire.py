"""How the HTTP workers and the engine process talk: one Unix socket connection per request thread, messages as
frames of a pickled header followed by raw byte segments (the images), sent with one scatter-gather call and read
into one buffer, so an image's bytes are copied once on each side (into the kernel, out of it) and never pickled.

Standard library only: the HTTP side never imports torch.
"""
from __future__ import annotations

import os
import pickle
import socket
import struct
from pathlib import Path
from typing import Any, Sequence

_HEAD = struct.Struct("!II")  # the header's length, the number of segments
_LENGTH = struct.Struct("!Q")
MAX_SEGMENTS = 10_000  # a bound on one frame's segments (MAX_IMAGES is far lower): a corrupt frame fails at once
MAX_FRAME_BYTES = 1 << 32  # a bound on one frame's size (MAX_BODY_BYTES is far lower): a corrupt one fails at once
_IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
# The Catalog (app/engine/catalog.py) calls an HTTP worker may make of the engine.
CATALOG_CALLS = frozenset({"versions", "version", "default_model", "serving", "workers", "index", "in_repository",
                           "roles", "rollouts", "load", "unload", "promote", "rollback"})


class EngineGone(ConnectionError):
    """The engine process closed the connection or cannot be reached."""


def socket_path(control_dir: Path, slot: int) -> Path:
    """Where engine ``slot`` listens."""
    return control_dir / f"engine-{slot}.sock"


READY_MARKS = "http-*.ready"  # the workers' ready marks (ready_mark), for a glob
# Everything the engines and the workers leave in CONTROL_DIR (a master starting on a kept one clears them)
CONTROL_FILES = ("engine-*.failed", "engine-*.sock", READY_MARKS)


def ready_mark(control_dir: Path, pid: int) -> Path:
    """The file an HTTP worker writes once it reaches a ready engine (readiness counts the live workers' marks)."""
    return control_dir / f"http-{pid}.ready"


def engine_failure(control_dir: Path, slot: int) -> Path:
    """Where engine ``slot`` writes why it cannot serve (it then exits with status 3)."""
    return control_dir / f"engine-{slot}.failed"


def send(sock: socket.socket, header: Any, segments: Sequence[bytes | memoryview] = ()) -> None:
    """One frame: ``header`` (pickled) and ``segments`` (sent as they are)."""
    head = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
    lengths = b"".join(_LENGTH.pack(len(s)) for s in segments)
    parts = [memoryview(p).cast("B") for p in (_HEAD.pack(len(head), len(segments)), lengths, head, *segments)]
    while parts:
        sent = sock.sendmsg(parts[:_IOV_MAX])  # the kernel takes at most IOV_MAX buffers a call
        while parts and sent >= len(parts[0]):  # a partial send (a signal, a full buffer): go on from there
            sent -= len(parts.pop(0))
        if parts:
            parts[0] = parts[0][sent:]


def _read_exactly(sock: socket.socket, size: int) -> memoryview:
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise EngineGone("the connection closed mid-frame" if got else "the connection closed")
        got += n
    return view


def receive(sock: socket.socket) -> tuple[Any, list[bytes]]:
    """The next frame: its header and its segments (as bytes). EngineGone when the other side closed."""
    head_size, count = _HEAD.unpack(_read_exactly(sock, _HEAD.size))
    if count > MAX_SEGMENTS:
        raise EngineGone(f"a frame of {count} segments: the stream is corrupt")
    table = _read_exactly(sock, _LENGTH.size * count) if count else memoryview(b"")
    lengths = [_LENGTH.unpack_from(table, i * _LENGTH.size)[0] for i in range(count)]
    size = head_size + sum(lengths)
    if size > MAX_FRAME_BYTES:
        raise EngineGone(f"a frame of {size} bytes: the stream is corrupt")
    body = _read_exactly(sock, size)
    header = pickle.loads(body[:head_size])
    segments, at = [], head_size
    for length in lengths:
        segments.append(bytes(body[at:at + length]))
        at += length
    return header, segments


def connect(path: Path, timeout_s: float) -> socket.socket:
    """A connection to the engine listening at ``path``; EngineGone when none listens."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(str(path))
    except OSError as exc:
        sock.close()
        raise EngineGone(f"no engine at {path}: {exc.strerror or exc}") from None
    sock.settimeout(None)
    return sock
