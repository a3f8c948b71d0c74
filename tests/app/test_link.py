"""The engine link without gunicorn: the wire's frames, and an HTTP worker's RemoteService talking to an
EngineServer over socket.socketpair(), the engine a real Service on the tiny colour model."""
from __future__ import annotations

import collections
import dataclasses
import errno
import functools
import gc
import inspect
import logging
import os
import pickle
import select
import shutil
import socket
import tempfile
import threading
import time
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pytest
from prometheus_client import REGISTRY
import torch

import app.engine.decoding.decoders as decoders
from app.config import Settings
from app.engine import contract, lifecycle
from app.engine.catalog import Catalog
from app.engine.loaded.predictor import Predictor
from app.engine.service import Service
from app.errors import BadRequest, ClientGone, DeadlineExceeded, InvalidImage, NotFound, NotReady, ServiceError
from app.link import wire
from app.link.arena import Arena
from app.link.client import RemoteCatalog, RemoteService
from app.link import decode_shares
from app.link.decode_shares import HAND_OFF_S, LOOP_IMAGE_MAX_S, PROBE_EVERY_S, PROBE_IMAGE_MAX_S, DecodeShares
from app.link.gathering import YIELD_WEIGHT
from app.link.loop import EngineServer
from app.metrics import VERSION_REQUESTS
from harness.servers import metric_sum
from tests.support.fakes import ColourModel, FakeRepository, OtherInputRepository, infer, tiny_manifest, wait_until
from tests.support.imaging import BLUE, RED, image_bytes
from tests.support.loop import LoopWorker


def _pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


# -- the wire ----------------------------------------------------------------------------------------------------

def test_every_message_crosses_with_its_segments() -> None:
    left, right = _pair()
    messages = [wire.Infer("colour", None, "k", 2.5, "1", (3, 8, 8), names=("a.jpg",),
                           tensors=(("<f8", (1, 3, 8, 8)),)),
                wire.Unanswered("colour", "1", None, BadRequest("no image")), wire.CatalogCall("version", ("x",)),
                wire.StateQuery(), wire.EngineState(True, True, True, False), wire.Answer([1, 2], None, 7, 3)]
    with left, right:
        reader = wire.FrameReader(right)
        for message in messages:
            wire.send(left, message, [b"\xff\xd8" * 3, b"", memoryview(b"abc")])
            [(got, segments)] = reader.read()
            assert type(got) is type(message) and segments == [b"\xff\xd8" * 3, b"", b"abc"]
        assert str(got) == str(messages[-1])


def test_the_engine_takes_a_stack_s_rows_and_refuses_pixels_not_shaped_as_parsed() -> None:
    from app.errors import InferenceFailed
    from app.link.loop import _inputs

    stack = np.arange(2 * 3 * 8 * 8, dtype=np.float32).reshape(2, 3, 8, 8)
    specs, segments = wire.tensor_segments([stack])
    images, rows = _inputs(wire.Infer("colour", None, None, 1.0, "1", (3, 8, 8), tensors=specs), segments)
    assert images == [] and [row.shape for row in rows] == [(3, 8, 8)] * 2
    assert all(np.array_equal(row, expected) for row, expected in zip(rows, stack))
    with pytest.raises(InferenceFailed, match="shape"):
        _inputs(wire.Infer("colour", None, None, 1.0, "1", (3, 4, 4), tensors=specs), segments)
    one = (("<f4", (1, 3, 8, 8)),)  # one image's pixels: its own view, the segment read whole or refused
    [row] = _inputs(wire.Infer("colour", None, None, 1.0, "1", (3, 8, 8), tensors=one), [segments[0][:768]])[1]
    assert np.array_equal(row, stack[0])
    unknown, objects = (("<f9", (1, 3, 8, 8)),), (("|O", (1, 3, 8, 8)),)  # (objects: 8 bytes a pointer)
    swapped, wide = (("<f4".replace("<", ">" if np.little_endian else "<"), (1, 3, 8, 8)),), (("f16", (1, 3, 8, 8)),)
    for segment, tensors in ((segments[0], one), (segments[0][:700], one), (segments[0][:768], unknown),
                             (segments[0][:1000], specs), (segments[0][:1536], objects), (segments[0][:768], swapped),
                             (bytes(segments[0]) * 2, wide)):
        with pytest.raises(InferenceFailed, match="segment of"):  # longer, shorter, no dtype, cut short, no numbers
            _inputs(wire.Infer("colour", None, None, 1.0, "1", (3, 8, 8), tensors=tensors), [segment])


def test_the_pixel_types_a_loop_keeps_are_numbers_only_and_few(monkeypatch: pytest.MonkeyPatch) -> None:
    # The dtypes requests name are looked at once each (kept by name), a bounded number of them; a refused one never
    from app.link import loop

    monkeypatch.setattr(loop, "_PIXEL_TYPES", {})
    monkeypatch.setattr(loop, "_PIXEL_TYPES_KEPT", 2)
    for name in ("float32", "<f4" if np.little_endian else ">f4", "uint8", "float32"):
        assert loop._pixel_type(name).kind in "fu"
    for refused in ("|O", "f16", ">f4" if np.little_endian else "<f4", ["f4"]):
        with pytest.raises(TypeError):
            loop._pixel_type(refused)  # type: ignore[arg-type]
    assert list(loop._PIXEL_TYPES) == ["float32", "<f4" if np.little_endian else ">f4"]  # two at most


def test_frames_are_read_as_they_come_whole_in_pieces_or_several_in_one_read() -> None:
    left, right = _pair()
    right.setblocking(False)
    with left, right:
        reader = wire.FrameReader(right, wire.REQUESTS)
        assert reader.read() == [] and not reader.started  # nothing came: a spurious wake-up reads nothing
        wire.send(left, wire.StateQuery())
        wire.send(left, wire.Unanswered("colour", "1", None))
        wire.send(left, wire.CatalogCall("version", ("x",)))
        assert [type(m) for m, _ in reader.read()] == [wire.StateQuery, wire.Unanswered, wire.CatalogCall]
        big = np.arange(100_000, dtype=np.float32)  # 400 KB: beyond the read-ahead buffer, in many pieces
        specs, segments = wire.tensor_segments([big, big[:10]])
        sender = threading.Thread(target=wire.send, args=(left, wire.Infer("colour", None, None, 1.0, "1", (3,),
                                                                           tensors=specs), segments))
        sender.start()
        got: list[tuple[object, list[memoryview]]] = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            got = reader.read()
        sender.join()
        [(message, [first, second])] = got
        assert isinstance(message, wire.Infer) and not reader.started
        assert np.array_equal(np.frombuffer(first, np.float32), big) and type(first) is bytearray  # writable, own
        assert np.array_equal(np.frombuffer(second, np.float32), big[:10])
        many = [b"\xff"] * 9_000  # a table of lengths (72 KB) beyond the read-ahead buffer
        sender = threading.Thread(target=wire.send, args=(left, wire.Infer("colour", None, None, 1.0, "1", (3,),
                                                                           names=(None,) * len(many)), many))
        sender.start()
        got, deadline = [], time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            got = reader.read()
        sender.join()
        [(message, segments)] = got
        assert isinstance(message, wire.Infer) and segments == many
        frame, _ = wire._encoded(wire.StateQuery(), ())
        left.sendall(wire._HEAD.pack(len(frame), 0) + frame[:2])  # a frame cut short: nothing yet
        assert reader.read() == [] and reader.started
        left.sendall(frame[2:])
        assert [type(m) for m, _ in reader.read()] == [wire.StateQuery]
        left.sendall(wire._HEAD.pack(len(frame), 0))
        assert reader.read() == []
        left.close()
        with pytest.raises(wire.EngineGone, match="closed mid-frame"):
            reader.read()


def test_a_large_frame_that_has_come_whole_is_read_in_one_wake_up() -> None:
    left, right = _pair()
    right.setblocking(False)
    with left, right:
        reader = wire.FrameReader(right, wire.REQUESTS)
        photo = bytes(range(256)) * 400  # a photo's 100 KB: beyond the read-ahead buffer
        sender = threading.Thread(target=wire.send, args=(left, wire.Infer("colour", None, None, 1.0, "1", (3,),
                                                                           names=(None,)), [photo]))
        sender.start()
        sender.join(10)  # all of it waits in the socket
        [(message, [segment])] = reader.read()  # one read, not one a buffer's worth
        assert isinstance(message, wire.Infer) and segment == photo and not reader.started
        assert type(segment) is bytearray  # the image's own buffer, as the engine decodes it: no copy to stand alone
        assert reader.read() == []
        # the same when more parts are left beyond the buffer than one scatter read takes
        many = [photo[:70_000]] + [b"\x01"] * (2 * wire._IOV_MAX + 5)
        sender = threading.Thread(target=wire.send, args=(left, wire.Infer("colour", None, None, 1.0, "1", (3,),
                                                                           names=(None,) * len(many)), many))
        sender.start()
        sender.join(10)  # about 90 KB, all of it in the socket
        [(message, segments)] = reader.read()
        assert segments == many and not reader.started


def test_a_loop_turn_s_answers_frame_as_the_answers_message_of_their_answers_would() -> None:
    # The engine's loop frames a turn's answers from their values and errors, no Answer made for each
    rows = np.arange(8, dtype=np.float32).reshape(2, 4)
    served = contract.Served(rows, (contract.BatchRun(2, 7, 2, 0.0, 0.001),), "colour", "1", wire.NO_LABELS, 0.0, 5,
                             0)
    answered = [(served, None), (None, NotFound("gone")), (contract.VersionState("colour", "1", "READY"), None)]
    parts = wire.answers_parts([(ident, value, error) for ident, (value, error) in zip([3, 1, 2], answered)], 42, 9)
    message = wire.Answers((3, 1, 2), tuple(wire.Answer(value, error, 42, 9) for value, error in answered))
    assert b"".join(parts) == wire.frame(message)
    left, right = _pair()
    with left, right:
        left.sendall(b"".join(parts))
        [(read, _)] = wire.FrameReader(right, (wire.Answers,)).read()
    assert read.ids == (3, 1, 2) and [(a.engine, a.routes) for a in read.answers] == [(42, 9)] * 3
    assert np.array_equal(read.answers[0].value.rows, rows) and read.answers[0].value.batches == served.batches
    assert isinstance(read.answers[1].error, NotFound) and read.answers[2].value == answered[2][0]


def test_a_backlog_s_refusal_crosses_with_until_when_its_route_is_refused() -> None:
    # The HTTP worker's loop refuses a route's like requests until then (app/hosting/recent_refusals.py)
    from app.errors import Backlog, Overloaded

    refused = Overloaded("the queue ahead may need up to 0.400s", headers={"Retry-After": "1"})
    refused.code, refused.backlog = "deadline_unreachable", Backlog(1234.5, 0.01, 0.002)
    left, right = _pair()
    with left, right:
        left.sendall(b"".join(wire.answers_parts([(7, None, refused), (8, None, Overloaded("full"))], 42, 9)))
        [(read, _)] = wire.FrameReader(right, (wire.Answers,)).read()
    said, full = (answer.error for answer in read.answers)
    assert (said.code, said.backlog, said.headers, full.backlog) == (
        "deadline_unreachable", (1234.5, 0.01, 0.002), {"Retry-After": "1"}, None)


def test_a_bundle_s_answers_cross_with_one_head_pickled_once_and_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # Answers made together (a bundle's, each field the same object) frame one head, pickled once and read once;
    # an answer of another head between them has its own, and every answer comes out as it went
    batch = np.arange(64, dtype=np.float32).reshape(16, 4)
    run = (contract.BatchRun(1, 7, 16, 0.0, 0.002),)
    bundle = [contract.Served(batch[i:i + 1], run, "colour", "1", wire.NO_LABELS, 0.25, 5, 0) for i in range(16)]
    other = contract.Served(batch[:2], (contract.BatchRun(2, 8, 2, 0.0, 0.001),), "colour", "2", wire.NO_LABELS,
                            0.5, 6, 0)
    answered = [(served, None) for served in bundle[:8]] + [(other, None)] + [(s, None) for s in bundle[8:]]
    # the same answers, none made together: every field alike, none the same object
    apart = [(contract.Served(served.rows, tuple(contract.BatchRun(*r) for r in served.batches), str(served.model),
                              str(served.version), served.labels, float(served.decode_s), served.started_ns, 0), None)
             for served, _ in answered]
    shared, alone = (b"".join(wire.answers_parts([(ident, *answer) for ident, answer in enumerate(each)], 42, 9))
                     for each in (answered, apart))
    assert len(shared) < len(alone) - 14 * 60  # a head pickles to about a hundred bytes, a memo's reference to two
    reads: list[tuple] = []
    real_read = wire._read_head
    monkeypatch.setattr(wire, "_read_head", lambda raw: reads.append(raw) or real_read(raw))
    left, right = _pair()
    with left, right:
        left.sendall(shared)
        [(read, _)] = wire.FrameReader(right, (wire.Answers,)).read()
    assert len(reads) == 3  # the bundle's first eight, the other, the bundle's last eight
    for (sent, _), got in zip(answered, [answer.value for answer in read.answers], strict=True):
        assert np.array_equal(got.rows, sent.rows) and got.batches == sent.batches
        assert (got.model, got.version, got.decode_s, got.started_ns) == (sent.model, sent.version, sent.decode_s,
                                                                          sent.started_ns)


def test_a_bundle_s_requests_of_one_connection_cross_as_one_answer_of_their_rows_each_read_as_its_own() -> None:
    # Rows 1 to 4 of a bundle that ran in two batches (rows 0-2, 3-5) answer ids 7, 8, 9 and 5 as one head and one
    # segment; each id reads its own row and the run it ran in, as an answer of its own would; an answer of one
    # request beside them and an error for two more cross as before
    batch = np.arange(24, dtype=np.float32).reshape(6, 4)
    runs = (contract.BatchRun(3, 1, 3, 0.1, 0.01), contract.BatchRun(3, 2, 3, 0.2, 0.02))
    bundle = contract.Served(batch, runs, "colour", "1", wire.NO_LABELS, 0.25, 5, 0)
    part = bundle.between(1, 5)
    assert part.batches == (contract.BatchRun(2, 1, 3, 0.1, 0.01), contract.BatchRun(2, 2, 3, 0.2, 0.02))
    assert bundle.between(0, 6) is bundle and np.shares_memory(part.rows, batch)
    alone = bundle.between(0, 1)
    answered = [((7, 8, 9, 5), part, None), (3, alone, None), ((11, 12), None, NotFound("gone"))]
    frame = b"".join(wire.answers_parts(answered, 42, 9))
    assert frame.count(part.rows.tobytes()) == 1
    left, right = _pair()
    with left, right:
        left.sendall(frame)
        [(read, _)] = wire.FrameReader(right, (wire.Answers,)).read()
    assert read.ids == (7, 8, 9, 5, 3, 11, 12) and [(a.engine, a.routes) for a in read.answers] == [(42, 9)] * 7
    for at, answer in enumerate(read.answers[:4], start=1):
        assert np.array_equal(answer.value.rows, batch[at:at + 1]) and answer.error is None
        assert answer.value.batches == (contract.BatchRun(1, 1 if at < 3 else 2, 3, 0.1 if at < 3 else 0.2,
                                                          0.01 if at < 3 else 0.02),)
        assert (answer.value.model, answer.value.decode_s, answer.value.started_ns) == ("colour", 0.25, 5)
    assert np.array_equal(read.answers[4].value.rows, batch[:1])
    assert [(a.value, a.error.message) for a in read.answers[5:]] == [(None, "gone")] * 2
    with pytest.raises(ValueError):  # rows that are not one for each id do not frame
        wire.answers_parts([((1, 2), part, None)], 42, 9)


def test_answers_for_more_or_fewer_requests_than_their_ids_end_the_stream() -> None:
    rows = np.zeros((2, 4), dtype=np.float32)
    served = contract.Served(rows, (contract.BatchRun(2, 1, 2, 0.0, 0.0),), "colour", "1", wire.NO_LABELS, 0.0)
    head = wire._head(served, rows)
    for items, segments in ((((head, None, None, 3),), [memoryview(rows).cast("B")]),  # two rows for three
                            (((None, None, None, 0),), []), (((None, None, None, 10 ** 9),), [])):
        with pytest.raises(wire.EngineGone):
            wire._answers_from(((1, 2, 3), items, 42, 9, ()), segments)


def test_alike_requests_of_one_message_cross_as_one_infer_and_others_as_their_own() -> None:
    # Requests alike (every field equal, made apart) carry one fields object, pickled once, and the engine reads
    # them as one Infer; a request of other fields between them has its own, and each comes out as it went
    def infer(timeout_s: float) -> wire.Infer:
        return wire.Infer(str("colour"), None, None, timeout_s, "1", (3, 8, 8), names=(None,),
                          tensors=(("<f4", (1, 3, 8, 8)),))

    sent = [infer(5.0), infer(5.0), infer(2.5), infer(5.0), infer(5.0)]
    requests = [(ident, message, [_one_colour(0)]) for ident, message in enumerate(sent, start=1)]
    message, segments = wire.infers(requests)
    assert message.requests[0] is message.requests[1] and message.requests[3] is message.requests[4]
    assert message.requests[2] is not message.requests[1] and message.requests[3] is not message.requests[1]
    alone = wire.frame(wire.Infers(message.ids, tuple(tuple(list(fields)) for fields in message.requests),
                                   message.counts))
    assert len(wire.frame(message)) < len(alone)  # the repeats pickle as references to the first
    left, right = _pair()
    with left, right:
        wire.send(left, message, segments)
        [(read, read_segments)] = wire.FrameReader(right, wire.REQUESTS).read()
    split = read.split(read_segments)
    assert [ident for ident, _, _ in split] == [1, 2, 3, 4, 5] and [m for _, m, _ in split] == sent
    infers = [m for _, m, _ in split]
    assert infers[0] is infers[1] and infers[3] is infers[4] and len({id(m) for m in infers}) == 3
    assert all(bytes(its[0]) == _one_colour(0) for _, _, its in split)
    for fields in (None, ()):  # what makes no Infer, first or after one that does: the stream cannot go on
        for requests in ((fields,), (message.requests[0], fields)):
            with pytest.raises(wire.EngineGone):
                wire.Infers(tuple(range(len(requests))), requests, (0,) * len(requests)).split([])
    # each request's time in its worker crosses beside it; times that are not one a request's are not read
    two = [(ident, infer(5.0), [_one_colour(0)]) for ident in (1, 2)]
    assert wire.infers(two, spent=(0.25, 0.0))[0].spent == (0.25, 0.0)
    for spent in ((0.25,), (0.25, -1.0), (0.25, float("nan")), (0.25, float("inf")), (0.25, "0")):
        with pytest.raises(wire.EngineGone, match="times spent"):
            wire.Infers((1, 2), message.requests[:2], (0, 0), (), spent).split([])  # type: ignore[arg-type]


def test_answers_whose_rows_are_no_array_frame_after_a_bundle_s_as_alone() -> None:
    # A head is looked at for sharing once the rows are as they cross: rows of another kind after a bundle's answer
    # (a list, or columns of a batch) cross as a copy, as alone
    batch = np.arange(12, dtype=np.float32).reshape(3, 4)
    run = (contract.BatchRun(1, 1, 3, 0.0, 0.0),)
    answered = [(contract.Served(rows, run, "colour", "1", wire.NO_LABELS, 0.0, 0, 0), None)
                for rows in (batch[:1], [[1.0, 2.0, 3.0, 4.0]], batch[1:2, :2], batch[2:3])]
    left, right = _pair()
    with left, right:
        left.sendall(b"".join(wire.answers_parts([(ident, *answer) for ident, answer in enumerate(answered, 1)],
                                                 42, 9)))
        [(read, _)] = wire.FrameReader(right, (wire.Answers,)).read()
    for (sent, _), answer in zip(answered, read.answers, strict=True):
        assert np.array_equal(answer.value.rows, np.asarray(sent.rows))


def test_an_answer_s_rows_cross_whatever_their_layout() -> None:
    # A batch's rows cross as they are; rows of another layout (columns of a batch, a transpose) or no array at all
    # as a C-contiguous copy
    batch = np.arange(12, dtype=np.float32).reshape(3, 4)
    for rows in (batch, batch[:1], batch[:, :2], batch.T, [[1.0, 2.0]]):
        served = contract.Served(rows, (contract.BatchRun(len(rows), 1, 3, 0.0, 0.0),), "colour", "1",
                                 wire.NO_LABELS, 0.0, 0, 0)
        head, segment = wire._served_head(served)
        assert np.array_equal(wire._served(head, bytes(segment)).rows, np.asarray(rows))


@pytest.mark.parametrize("seed", range(4))
def test_frames_cut_anywhere_come_out_whole_each_segment_in_a_buffer_of_its_own(seed: int) -> None:
    # Segments of every size (empty, a byte, beyond the read-ahead buffer, more than one scatter read takes), frames
    # back to back, the stream cut at random places: each read takes what came, and the frames come out as sent.
    rng = np.random.default_rng(seed)
    sizes = [[0, 1, 3], [200_000], [70_000] + [1] * (2 * wire._IOV_MAX + 5), [70_000, 0, 5, 90_000], [], [10] * 40]
    sent = [[rng.integers(0, 256, size, dtype=np.uint8).tobytes() for size in frame] for frame in sizes]
    frames = [_frame_bytes(frame) for frame in sent]
    stream, ends = b"".join(frames), np.cumsum([len(frame) for frame in frames])
    middles = (ends - np.array([len(frame) for frame in frames]) // 2).tolist()  # within every frame's segments
    cuts = sorted({0, len(stream), *middles, *rng.choice(np.arange(1, len(stream)), size=60).tolist()})
    left, right = _pair()
    right.setblocking(False)

    def send_in_pieces() -> None:
        for start, end in zip(cuts, cuts[1:]):
            left.sendall(stream[start:end])
            time.sleep(0.001)  # mostly read a piece at a time; what a read finds does not change what comes out

    with left, right:
        reader = wire.FrameReader(right, wire.REQUESTS)
        sender = threading.Thread(target=send_in_pieces)
        sender.start()
        got: list[list[bytearray]] = []
        deadline = time.monotonic() + 20
        while len(got) < len(sent) and time.monotonic() < deadline:
            if select.select([right], [], [], 0.1)[0]:
                got.extend(segments for _, segments in reader.read())
        sender.join()
        assert got == sent and not reader.started
        assert all(type(segment) is bytearray for frame in got for segment in frame)
        assert len({id(segment) for frame in got for segment in frame}) == sum(map(len, sent))  # no buffer shared


def _frame_bytes(segments: list[bytes]) -> bytes:
    """An Infer frame with ``segments``, as ``wire.send`` puts it on the stream."""
    a, b = _pair()

    def send() -> None:
        wire.send(a, wire.Infer("colour", None, None, 1.0, "1", (3,), names=(None,) * len(segments)), segments)
        a.shutdown(socket.SHUT_WR)

    with a, b:
        sender = threading.Thread(target=send)
        sender.start()
        chunks = [b.recv(1 << 20)]
        while chunks[-1]:  # to the end the sender's shutdown marks
            chunks.append(b.recv(1 << 20))
        sender.join()
        return b"".join(chunks)


def test_only_messages_are_sent_and_a_frame_out_of_step_ends_the_stream() -> None:
    left, right = _pair()
    with left, right:
        with pytest.raises(TypeError, match="no message"):
            wire.send(left, ("infer", {}))  # the untyped tuples of before
        wire.send(left, wire.Answer(1))
        with pytest.raises(wire.EngineGone, match="Answer frame where"):
            wire.FrameReader(right, wire.REQUESTS).read()  # the engine never takes an answer as a request
        wire._send_frame(left, pickle.dumps(("state",)), ())  # the untyped tuples of before, as they were sent
        with pytest.raises(wire.EngineGone, match="does not unpickle as a message"):
            wire.FrameReader(right).read()
        wire._send_frame(left, pickle.dumps((-1, ())), ())  # no message of that kind
        with pytest.raises(wire.EngineGone, match="no message of kind"):
            wire.FrameReader(right).read()
        wire._send_frame(left, b"not a pickle", ())
        with pytest.raises(wire.EngineGone, match="does not unpickle"):
            wire.FrameReader(right).read()
        left.sendall(wire._HEAD.pack(10, wire.MAX_SEGMENTS + 1))
        with pytest.raises(wire.EngineGone, match="corrupt"):
            wire.FrameReader(right).read()



class _CountedReads(socket.socket):
    reads = 0

    def recv(self, *args: object) -> bytes:  # type: ignore[override]
        type(self).reads += 1
        return super().recv(*args)  # type: ignore[arg-type]


def test_an_answer_is_read_in_as_few_calls_as_it_arrived_in_and_never_past_its_end() -> None:
    left, right = _pair()
    right = _CountedReads(socket.AF_UNIX, socket.SOCK_STREAM, fileno=right.detach())
    with left, right:
        wire.send(left, wire.Answer([1.5] * 100, None, 7, 3))
        assert wire.receive_answer(right, 1.0).value == [1.5] * 100 and _CountedReads.reads == 1
        big = np.arange(100_000, dtype=np.float32)  # 400 KB: beyond the first read's buffer
        sender = threading.Thread(target=wire.send, args=(left, wire.Answer(big, None, 7, 3)))
        sender.start()  # more than the socket buffers hold: sent while it is read
        assert np.array_equal(wire.receive_answer(right, 1.0).value, big)
        sender.join()
        sent = wire.Answer(1)
        whole, _ = wire._encoded(sent, ())
        left.sendall(wire._HEAD.pack(len(whole), 0) + whole[:3])  # an answer that stops arriving
        with pytest.raises(wire.EngineGone, match="nothing more"):
            wire.receive_answer(right, 0.1)
    left, right = _pair()
    with left, right:
        wire.send(left, sent)
        left.sendall(b"more")  # the engine never sends past an answer: the stream is out of step
        time.sleep(0.05)
        with pytest.raises(wire.EngineGone, match="beyond the answer"):
            wire.receive_answer(right, 1.0)
        left.close()
        with pytest.raises(wire.EngineGone, match="closed"):
            wire.receive_answer(right, 1.0)


def test_an_answer_s_rows_cross_as_one_raw_segment_and_come_back_as_the_served_that_was_sent() -> None:
    rows = np.random.default_rng(0).random((3, 1000), dtype=np.float32)
    runs = (contract.BatchRun(2, 4, 2, 0.25, 0.5), contract.BatchRun(1, 5, 1, 0.75, 0.5))
    sent = contract.Served(rows, runs, "colour", "2", wire.NO_LABELS, 0.125, 99)
    left, right = _pair()
    with left, right:
        wire.send(left, wire.Answer(sent, None, 7, 3))
        answer = wire.receive_answer(right, 1.0)
        assert (answer.engine, answer.routes, answer.error) == (7, 3, None)
        got = answer.value
        assert isinstance(got, contract.Served) and got.labels is wire.NO_LABELS
        assert (got.model, got.version, got.decode_s, got.started_ns) == ("colour", "2", 0.125, 99)
        assert got.batches == runs and got.batch_sizes() == [2, 2, 1]
        assert np.array_equal(got.probabilities(), rows) and got.probabilities().dtype == np.float32
        # an answer with embeddings: the rows' last columns, said by the head
        wire.send(left, wire.Answer(dataclasses.replace(sent, embedding_dim=24), None, 7, 3))
        with_embeddings = wire.receive_answer(right, 1.0).value
        assert np.array_equal(with_embeddings.probabilities(), rows[:, :976])
        assert np.array_equal(with_embeddings.embeddings(), rows[:, 976:])
        # what goes out is the rows' bytes as they are (one segment), not pickled arrays
        head, segments = wire._encoded(wire.Answer(sent, None, 7, 3), ())
        assert len(head) < 400 and [bytes(s) for s in segments] == [rows.tobytes()]
        assert wire.frame(wire.Answer(sent, None, 7, 3)) == b"".join(
            [wire._HEAD.pack(len(head), 1), wire._LENGTH.pack(rows.nbytes), head, rows.tobytes()])
        # rows that do not fit what the head says end the stream, as any frame out of step does
        bad = ("colour", "2", [], 0.0, 0, ((1, 1, 1, 0.0, 0.0),), "<f4", (1, 1000), 0)
        wire._send_frame(left, pickle.dumps((wire._SERVED, (bad, None, 7, 3))), [b"\0" * 12])
        with pytest.raises(wire.EngineGone, match="do not read as its head says"):
            wire.receive_answer(right, 1.0)
        fewer = ("colour", "2", [], 0.0, 0, ((1, 1, 1, 0.0, 0.0),) * 2, "<f4", (1, 3), 0)
        wire._send_frame(left, pickle.dumps((wire._SERVED, (fewer, None, 7, 3))), [b"\0" * 12])
        with pytest.raises(wire.EngineGone, match="out of step"):
            wire.receive_answer(right, 1.0)


def test_a_worker_running_other_code_is_refused_on_both_sides_by_its_hello(caplog: pytest.LogCaptureFixture) -> None:
    left, right = _pair()
    with left, right:
        engine = threading.Thread(target=wire.FrameReader(right, greet=True).read)
        engine.start()
        wire.say_hello(left)  # the same code: welcomed
        engine.join()
        failures: list[BaseException] = []

        def refuse() -> None:
            try:
                wire.FrameReader(right, greet=True).read()
            except wire.WireMismatch as exc:
                failures.append(exc)

        engine = threading.Thread(target=refuse)
        engine.start()
        wire._send_frame(left, b"visionserve-wire/1 0123456789abcdef", ())
        reply, _ = wire._receive_frame(left)
        engine.join()
    assert "visionserve-wire/1 0123456789abcdef" in bytes(reply).decode() and "restart the server" in str(failures[0])


def test_a_hello_on_a_non_blocking_connection_waits_for_its_answer_by_readable_and_gives_up_in_its_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # how a connection made by a request on the HTTP worker's loop is greeted: its waits are the loop's, not a
    # blocking read that would hold the loop
    waits: list[float] = []
    real = wire.readable
    monkeypatch.setattr(wire, "readable", lambda sock, timeout_s=0.0: waits.append(timeout_s) or real(sock, timeout_s))
    left, right = _pair()
    with left, right:
        left.setblocking(False)
        late = threading.Timer(0.2, wire.FrameReader(right, greet=True).read)
        late.start()
        wire.say_hello(left, 3.0)  # welcomed once the engine's side reads the hello, 0.2 s later
        late.join()
        assert waits and set(waits) == {3.0}
        started = time.monotonic()
        with pytest.raises(wire.EngineGone, match="nothing more of a frame for 0.3s"):
            wire.say_hello(left, 0.3)  # nobody answers
        assert time.monotonic() - started < 2


def test_the_fingerprint_follows_the_messages_and_the_data_they_carry() -> None:
    assert len(wire.FINGERPRINT) == 16 and wire.HELLO.decode().endswith(wire.FINGERPRINT)

    @dataclasses.dataclass(frozen=True)
    class Signature:  # the contract's, with a field renamed: an engine on the old code could not read it
        name: str
        version: str
        labels: list[str]
        shape: tuple[int, ...]

    Signature.__module__, Signature.__qualname__ = contract.Signature.__module__, "Signature"
    assert wire._shape(Signature) != wire._shape(contract.Signature)


def test_the_catalog_calls_come_from_one_face_that_both_catalogs_implement() -> None:
    assert set(contract.CATALOG_CALLS) >= {"versions", "signature", "load", "promote", "rollback", "index"}
    for name in contract.CATALOG_CALLS:
        face = inspect.signature(getattr(contract.CatalogFace, name))
        assert list(inspect.signature(getattr(Catalog, name)).parameters) == list(face.parameters), name
        assert callable(getattr(RemoteCatalog, name)) and getattr(RemoteCatalog, name).__name__ == name
    with pytest.raises(AttributeError):
        RemoteCatalog(lambda call: None).applier  # type: ignore[attr-defined]


# -- a worker and an engine over socketpair ------------------------------------------------------------------------

class Link:
    """An engine (Service + EngineServer) and an HTTP worker's RemoteService joined by socket pairs: each new
    connection of the worker is one pair, its engine end handed to the engine's loop as its listener would."""

    def __init__(self, settings: Settings, service: Service) -> None:
        self.engine, self.server = service, EngineServer(service)
        self.connections: list[socket.socket] = []
        self.frames: list[str] = []
        self.sent: list[object] = []  # every message, as sent
        self.worker = RemoteService(settings, 0, connect=self._connect)

    def _connect(self) -> socket.socket:
        worker_end, engine_end = _pair()
        self.connections.append(engine_end)
        # (serve only posts it to the loop: no thread of its own, which a test counting the threads a request
        # starts would have seen alive now and then, its end not yet reached, on a busy machine)
        self.server.serve(engine_end)
        return worker_end

    def start(self) -> "Link":
        self.worker._started.set()  # as RemoteService.start does once the engine says it is ready
        return self


@pytest.fixture
def link(settings: Settings, predictor: Predictor, tmp_path: Path,
         monkeypatch: pytest.MonkeyPatch) -> Iterator[Link]:
    settings = settings.model_copy(update={"control_dir": tmp_path / "control"})
    service = Service.build(settings.model_copy(update={"control_dir": None}), predictor)
    joined = Link(settings, service).start()
    real = wire.send

    def counted(sock: socket.socket, message: object, segments: object = ()) -> None:
        joined.frames.append(type(message).__name__)
        joined.sent.append(message)
        real(sock, message, segments)  # type: ignore[arg-type]

    def parts(answered: Sequence[wire.Answered], engine: int, routes: int,
              released: tuple[int, ...] = ()) -> list[memoryview]:  # the engine's shared answers
        ids: list[int] = []
        for ident, _, _ in answered:
            ids += ident if isinstance(ident, tuple) else (ident,)
        joined.frames.append("Answers")
        joined.sent.append(wire.Answers(tuple(ids), (), released))  # (what the tests read: the ids, released)
        return real_parts(answered, engine, routes, released)

    real_parts = wire.answers_parts
    monkeypatch.setattr(wire, "send", counted)
    monkeypatch.setattr(wire, "answers_parts", parts)
    yield joined
    joined.server.stop(5)  # as at a SIGTERM: the counts its loop holds written too


def test_a_request_is_one_exchange_of_two_frames(link: Link) -> None:
    served = infer(link.worker, [image_bytes(RED)])
    assert served.model == "colour" and served.top_k(1)[0][0].label == "red"
    assert link.frames == ["CatalogCall", "Answer", "Infer", "Answer"]  # the signature once, then the request
    link.frames.clear()
    served = infer(link.worker, [image_bytes(BLUE), image_bytes(RED)])
    assert [ranked[0].label for ranked in served.top_k(1)] == ["blue", "red"]
    assert link.frames == ["Infer", "Answer"] and len(link.connections) == 1


def test_a_deadline_that_passed_while_the_request_waited_in_its_worker_is_504_unsent(link: Link) -> None:
    # Before: a request's deadline counted from when the engine received it: one that waited seconds for its
    # worker's loop (a burst beyond its requests at once) was run all the same, answered long past its deadline.
    assert infer(link.worker, [image_bytes(RED)], arrived=time.monotonic() - 0.5, timeout_s=1.0).model == "colour"
    link.frames.clear()
    with pytest.raises(DeadlineExceeded, match="1s deadline: it passed while the request waited 2.* for this worker"):
        infer(link.worker, [image_bytes(RED)], arrived=time.monotonic() - 2.0, timeout_s=1.0)
    assert "Infer" not in link.frames


def test_an_embedding_crosses_only_when_asked_for(settings: Settings, tmp_path: Path) -> None:
    predictor = Predictor(ColourModel(embedding=True), tiny_manifest(embedding=True), device="cpu")
    service = Service.build(settings, predictor)
    link = Link(settings.model_copy(update={"control_dir": tmp_path / "control"}), service).start()
    try:
        plain = infer(link.worker, [image_bytes(RED)])
        both = infer(link.worker, [image_bytes(RED), image_bytes(BLUE)], embedding=True)
        assert plain.embedding_dim == 0 and plain.rows.shape == (1, 4)  # 4 classes, nothing more
        assert both.embedding_dim == 3 and both.embeddings().shape == (2, 3)
        assert [top[0].label for top in both.top_k(1)] == ["red", "blue"]
        assert np.array_equal(both.probabilities()[:1], plain.probabilities())
        assert both.embeddings()[0].argmax() == 0 and both.embeddings()[1].argmax() == 2  # red's, blue's channel
    finally:
        link.server.stop(5)  # as at a SIGTERM: the counts its loop holds written too


@pytest.mark.slow  # a real export (about 3 s)
def test_an_explanation_crosses_as_the_engine_made_it_and_its_refusals_as_they_are(settings: Settings, link: Link,
                                                                                   tmp_path: Path) -> None:
    from models.explain import crop_box
    from tests.support.fakes import export_tiny

    with pytest.raises(ServiceError) as refused:  # ColourModel has no feature map: 422 from the engine
        link.worker.explain(image_bytes(RED))
    assert refused.value.status == 422 and refused.value.code == "no_gradients"
    weights = export_tiny(tmp_path / "weights", head_scale=1e10)
    service = Service.build(settings, Predictor.load(weights, device="cpu"))
    joined = Link(settings.model_copy(update={"control_dir": tmp_path / "control"}), service).start()
    try:
        photo = image_bytes(RED, size=(64, 48))
        remote = joined.worker.explain(photo, index=2, png=True, timeout_s=10)
        here = service.explain(photo, index=2, timeout_s=10)
        assert isinstance(remote, contract.Explanation) and (remote.index, remote.label) == (2, "c")
        assert remote.grid == here.grid and remote.crop == crop_box(64, 48, service.loaded_version().predictor
                                                                    .manifest.preprocess)
        assert remote.png is not None and remote.png.startswith(b"\x89PNG") and here.png is None
        with pytest.raises(InvalidImage):
            joined.worker.explain(b"not an image")
        assert joined.worker.explain(photo).index in (0, 1, 2)  # the connection serves on after an error
    finally:
        joined.server.stop(5)  # as at a SIGTERM: the counts its loop holds written too


def test_an_embedding_asked_of_a_version_the_engine_routes_without_one_is_a_400_from_the_engine(link: Link) -> None:
    signature = link.worker.signature(None, None)
    # the HTTP side's kept signature says the version has an embedding (another version's, kept from before)
    link.worker._signatures[(None, None)] = dataclasses.replace(signature, embedding_dim=3)
    with pytest.raises(ServiceError) as refused:
        infer(link.worker, [image_bytes(RED)], embedding=True)
    assert (refused.value.status, refused.value.code) == (400, "no_embedding")
    assert infer(link.worker, [image_bytes(RED)]).top_k(1)[0][0].label == "red"  # the connection serves on


def test_pixels_parsed_for_the_default_are_answered_by_it_when_the_canary_takes_another_input(
        settings: Settings, tmp_path: Path) -> None:
    # Before: the HTTP side parsed pixels with the default's signature and the engine routed them to the canary (a
    # 16x16 input): 503 "send it again", and again at every retry of a client whose key the canary share holds.
    repository = OtherInputRepository()
    repository.add("colour", "1")
    repository.add("colour", "2")
    repository.policies["colour"] = {"rollout": {"canary_percent": 100}}
    service = Service.build(settings, repository)  # type: ignore[arg-type]
    link = Link(settings.model_copy(update={"control_dir": tmp_path / "control"}), service).start()
    try:
        for key in ("a", "b", "c"):
            with link.worker.admit(client_key=key) as call:
                assert call.model.version == "1" and call.model.input_shape == (3, 8, 8)
                served = call.infer(tensors=np.zeros((1, 3, 8, 8), np.float32), timeout_s=5)
            assert served.version == "1"
            assert infer(link.worker, [image_bytes(RED)]).version == "2"  # images: the canary's
    finally:
        link.server.stop(5)  # as at a SIGTERM: the counts its loop holds written too


def test_the_labels_stay_on_the_http_side_and_a_request_carries_no_signature(link: Link) -> None:
    served = infer(link.worker, [image_bytes(RED)])
    infer_message, answer = link.sent[-2:]
    assert isinstance(infer_message, wire.Infer) and (infer_message.parsed_version, infer_message.parsed_shape) == (
        "test", (3, 8, 8))
    assert isinstance(answer, wire.Answer) and answer.value.labels == []  # not pickled on each answer
    assert served.labels == link.worker.signature(None, None).labels == ["red", "green", "blue", "other"]
    assert served.top_k(1)[0][0].label == "red"


def test_the_engine_s_errors_cross_as_they_are(link: Link) -> None:
    with pytest.raises(NotFound, match="no model 'other'"):
        infer(link.worker, [image_bytes(RED)], name="other")
    with pytest.raises(InvalidImage, match=r"image 1 \(b.jpg\)"):
        with link.worker.admit() as call:
            call.infer([image_bytes(RED), b"not an image"], names=["a.jpg", "b.jpg"], timeout_s=5)
    with pytest.raises(ServiceError) as refused:  # more images than MAX_IMAGES (4 here)
        infer(link.worker, [image_bytes(RED)] * 5)
    assert refused.value.status == 413 and "5 images" in refused.value.message
    assert infer(link.worker, [image_bytes(RED)]).model == "colour"  # the same connection goes on
    assert len(link.connections) == 1


def test_the_signatures_kept_are_dropped_when_the_engine_s_routing_changes(link: Link) -> None:
    assert link.worker.signature(None, None).version == "test"
    link.frames.clear()
    link.worker.signature(None, None)
    assert link.frames == []  # kept
    loaded = link.engine.controller.routes.find(None, None)
    link.engine.controller.routes.route("colour", {"test": loaded}, "test")  # a new generation, the same version
    infer(link.worker, [image_bytes(RED)])
    link.frames.clear()
    link.worker.signature(None, None)
    assert link.frames == ["CatalogCall", "Answer"]  # asked again after the answer said the routing changed


def test_tensors_shaped_for_a_version_that_no_longer_answers_are_sent_again(link: Link) -> None:
    with link.worker.admit() as call:
        stale = dataclasses.replace(call.model, input_shape=(3, 16, 16))
        call.model = stale
        with pytest.raises(NotReady, match="send it again"):
            call.infer(tensors=[np.zeros((3, 16, 16), np.float32)], timeout_s=5)


def test_a_request_refused_before_it_is_sent_counts_in_its_version_s_traffic(link: Link) -> None:
    refused = VERSION_REQUESTS.labels("colour", "test", "live", "refused")
    before = refused._value.get()
    with pytest.raises(BadRequest):
        with link.worker.admit():
            raise BadRequest("the body is no image")
    wait_until(lambda: refused._value.get() == before + 1)
    assert link.frames[-1] == "Unanswered" and "Answer" not in link.frames[link.frames.index("Unanswered"):]
    assert infer(link.worker, [image_bytes(RED)]).model == "colour"  # no answer was left to read out of step


def test_a_client_that_hangs_up_drops_its_images_in_the_engine(link: Link, model: ColourModel) -> None:
    model.gate = threading.Event()
    gone = threading.Event()
    failures: list[BaseException] = []

    def request() -> None:
        try:
            infer(link.worker, [image_bytes(RED)], client_gone=gone.is_set)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            failures.append(exc)

    thread = threading.Thread(target=request)
    batches = len(model.batch_sizes)
    thread.start()
    wait_until(lambda: len(model.batch_sizes) > batches)  # its forward pass runs (held by the gate)
    gone.set()
    thread.join(5)
    model.gate.set()
    assert isinstance(failures[0], ClientGone)
    wait_until(lambda: link.engine.in_flight.count() == 0)  # the engine saw the connection close and let go


def test_images_of_a_client_that_hung_up_while_they_were_decoded_are_dropped_unrun_and_counted(
        link: Link, model: ColourModel) -> None:
    version = link.engine.loaded_version()
    prepare, decoding, release = version.decoder.prepare, threading.Event(), threading.Event()

    def held(data: bytes) -> object:
        decoding.set()
        release.wait(10)
        return prepare(data)

    version.decoder.prepare = held  # type: ignore[method-assign]
    before, batches, gone = _client_gone(), list(model.batch_sizes), threading.Event()
    failures: list[BaseException | None] = []
    thread = threading.Thread(target=lambda: failures.append(_failure(lambda: infer(
        link.worker, [image_bytes(RED), image_bytes(BLUE)], client_gone=gone.is_set))))
    thread.start()
    assert decoding.wait(10)  # a lone request's images are worth a hand-off: decoded on a thread, held there
    gone.set()
    thread.join(5)
    assert isinstance(failures[0], ClientGone)
    wait_until(lambda: link.engine.in_flight.count() == 0)  # ended as the connection closed, mid-decode
    release.set()
    wait_until(lambda: _client_gone() == before + 2)  # queued after its end: dropped at once, counted
    assert model.batch_sizes == batches  # no forward pass for them


def test_requests_whose_queueing_fails_unforeseen_are_answered_not_left_waiting(
        link: Link, monkeypatch: pytest.MonkeyPatch) -> None:
    from app.link import loop

    def broken(exchange: object) -> int:
        raise RuntimeError("a bug on the way to the queue")

    monkeypatch.setattr(loop, "encoded_bytes", broken)  # on a decode thread, whose executor would swallow it
    with pytest.raises(ServiceError, match="RuntimeError: a bug on the way to the queue") as failure:
        infer(link.worker, [image_bytes(RED)])
    assert failure.value.status == 500
    wait_until(lambda: link.engine.in_flight.count() == 0)  # admitted, ended, counted: nothing held
    monkeypatch.undo()
    assert infer(link.worker, [image_bytes(RED)]).probabilities().argmax() == 0  # the connection serves on


def _one_colour(channel: int) -> bytes:
    """One image's pixels (1, 3, 8, 8), float32, all of ``channel`` (0 red, 1 green, 2 blue): a segment."""
    pixels = np.zeros((1, 3, 8, 8), "<f4")
    pixels[0, channel] = 1.0
    return pixels.tobytes()


_ONE_PIXELS = wire.Infer("colour", None, None, 5.0, "1", (3, 8, 8), tensors=(("<f4", (1, 3, 8, 8)),))


def _answers_by_id(reader: wire.FrameReader, count: int) -> dict[int, wire.Answer]:
    answers: dict[int, wire.Answer] = {}
    while len(answers) < count:
        for message, _ in reader.read():
            answers.update(zip(message.ids, message.answers))
    return answers


def _bundles_answered(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many requests each bundle answered (its ``Call.answer``, a call standing for several requests, made one
    row each), as they are answered."""
    from app.engine.call import Call

    made: list[int] = []
    answer = Call.answer

    def counted(self: Call, *args: Any, **kwargs: Any) -> Any:
        served = answer(self, *args, **kwargs)
        if self.requests > 1:
            made.append(len(served.rows))
        return served

    monkeypatch.setattr(Call, "answer", counted)
    return made


def _all_let_go(link: Link) -> bool:
    loaded = link.engine.loaded_version()
    return link.engine.in_flight.count() == 0 and loaded.arrivals.count() == 0 and loaded.in_use.count() == 0


def test_a_shared_connection_s_alike_one_image_pixel_requests_run_as_one_bundle_each_answered_from_its_row(
        link: Link, monkeypatch: pytest.MonkeyPatch) -> None:
    bundles, before = _bundles_answered(monkeypatch), _outcome_counts(link)
    conn, reader = _shared_connection(link)
    conn.settimeout(10)
    with conn:
        requests = [(ident, _ONE_PIXELS, [_one_colour(ident % 3)]) for ident in range(1, 7)]
        requests.insert(3, (7, _ONE_PIXELS, [_one_colour(0)[:-4]]))  # its pixels a float short: answered alone
        wire.send(conn, *wire.infers(requests))
        answers = _answers_by_id(reader, 7)
    assert answers[7].error is not None and answers[7].error.status == 500 and "segment" in answers[7].error.message
    assert {ident: int(answers[ident].value.rows.argmax()) for ident in range(1, 7)} == {
        ident: ident % 3 for ident in range(1, 7)}  # each its own row, in order
    assert bundles == [6]  # the six queued and answered as one (MAX_BATCH_SIZE 4: in two batches)
    runs = [answers[ident].value.batches for ident in range(1, 7)]
    assert all(len(run) == 1 and run[0].rows == 1 for run in runs)  # each the batch its row ran in
    by_batch = collections.Counter(run[0].batch_id for run in runs)
    assert len(by_batch) == 2 and all(run[0].batch_size == by_batch[run[0].batch_id] for run in runs)
    wait_until(lambda: _outcome_counts(link)["ok"] == before["ok"] + 6 and _all_let_go(link))  # each a request
    assert _outcome_counts(link)["failed"] == before["failed"] + 1


def test_a_shared_connection_s_stack_of_pixels_runs_apart_from_the_bundle_of_its_one_image_neighbours(
        link: Link, monkeypatch: pytest.MonkeyPatch) -> None:
    # requests of two rows among one-image requests alike in all else: each its own rows back, the others one bundle
    bundles = _bundles_answered(monkeypatch)
    two_rows = wire.Infer("colour", None, None, 5.0, "1", (3, 8, 8), tensors=(("<f4", (2, 3, 8, 8)),))
    conn, reader = _shared_connection(link)
    conn.settimeout(10)
    with conn:
        requests = [(ident, _ONE_PIXELS, [_one_colour(ident % 3)]) for ident in range(1, 5)]
        requests[2:2] = [(5, two_rows, [_one_colour(2) + _one_colour(1)]), (6, two_rows, [_one_colour(0) * 2])]
        wire.send(conn, *wire.infers(requests))
        answers = _answers_by_id(reader, 6)
    assert [answers[ident].error for ident in (5, 6)] == [None, None]
    assert [answers[ident].value.rows.argmax(axis=1).tolist() for ident in (5, 6)] == [[2, 1], [0, 0]]
    assert {ident: answers[ident].value.rows.argmax(axis=1).tolist() for ident in range(1, 5)} == {
        ident: [ident % 3] for ident in range(1, 5)}
    assert bundles == [4]


@pytest.fixture
def device_link(settings: Settings, predictor: Predictor, tmp_path: Path) -> Iterator[Link]:
    """``link``'s engine on the device decode path (its batches decode their JPEGs; the CPU stands for the GPU)."""
    settings = settings.model_copy(update={"control_dir": tmp_path / "control", "decode_path": "device"})
    joined = Link(settings, Service.build(settings.model_copy(update={"control_dir": None}), predictor)).start()
    yield joined
    joined.server.stop(5)


def _photos_together(conn: socket.socket, images: dict[int, bytes]) -> None:
    wire.send(conn, *wire.infers([(ident, wire.Infer("colour", None, None, 5.0, "1", (3, 8, 8), names=(None,)),
                                   [image]) for ident, image in images.items()]))


def _broken_in_its_batch(monkeypatch: pytest.MonkeyPatch) -> bytes:
    """A photo whose header passes and whose pixels fail in its batch (the device path's collate made to refuse
    it, as a corrupt scan would be)."""
    collate = decoders.collate_on_device

    def failing(items: Sequence[Any], *rest: Any) -> Any:
        if any(b"BROKEN" in bytes(getattr(item, "data", b"")) for item in items):  # (a view of the arena too)
            raise InvalidImage("the image's pixels could not be decoded")
        return collate(items, *rest)

    monkeypatch.setattr(decoders, "collate_on_device", failing)
    return _padded(image_bytes(RED), 200)[:-2] + b"BROKEN" + image_bytes(RED)[-2:]


def _watched_shared_connection(link: Link, monkeypatch: pytest.MonkeyPatch
                               ) -> tuple[list[int], dict[str, float], socket.socket, wire.FrameReader]:
    """The bundles answered from here on (``_bundles_answered``), the outcome counts now, and a shared connection
    (its reads time out after 10 s)."""
    bundles, before = _bundles_answered(monkeypatch), _outcome_counts(link)
    conn, reader = _shared_connection(link)
    conn.settimeout(10)
    return bundles, before, conn, reader


def _four_alike_photos_each_answered_from_its_row(conn: socket.socket, reader: wire.FrameReader) -> None:
    _photos_together(conn, {ident: image_bytes((RED, BLUE)[ident % 2]) for ident in range(1, 5)})
    answers = _answers_by_id(reader, 4)
    assert {ident: int(answer.value.rows.argmax()) for ident, answer in answers.items()} == {
        ident: 2 * (ident % 2) for ident in range(1, 5)}  # each its own row, in order (red 0, blue 2)


def test_on_the_device_path_a_shared_connection_s_alike_one_photo_requests_run_as_one_bundle_a_bad_one_alone(
        device_link: Link, monkeypatch: pytest.MonkeyPatch) -> None:
    link = device_link
    bundles, before, conn, reader = _watched_shared_connection(link, monkeypatch)
    with conn:
        _four_alike_photos_each_answered_from_its_row(conn, reader)
        assert bundles == [4]  # queued and answered as one request of four photos
        _photos_together(conn, {5: image_bytes(RED), 6: b"\xff\xd8 no jpeg", 7: image_bytes(BLUE)})
        answers = _answers_by_id(reader, 3)
        assert answers[6].error is not None and answers[6].error.status == 400  # its header: run apart, alone
        assert int(answers[5].value.rows.argmax()) == 0 and int(answers[7].value.rows.argmax()) == 2
        _photos_together(conn, {8: image_bytes(RED), 9: _broken_in_its_batch(monkeypatch), 10: image_bytes(BLUE)})
        answers = _answers_by_id(reader, 3)  # 9 fails in the batch: the bundle runs apart, each judged alone
    assert answers[9].error is not None and answers[9].error.status == 400 and "pixels" in answers[9].error.message
    assert int(answers[8].value.rows.argmax()) == 0 and int(answers[10].value.rows.argmax()) == 2
    assert bundles == [4]  # (the failed bundle's requests answered apart)
    wait_until(lambda: _outcome_counts(link)["ok"] == before["ok"] + 8 and _all_let_go(link))  # each a request


def _named_photos_together(conn: socket.socket, images: dict[int, tuple[str, bytes]]) -> None:
    """Photos each sent as a multipart file is (its name beside it), one request each, in one message."""
    wire.send(conn, *wire.infers([(ident, wire.Infer("colour", None, None, 5.0, "1", (3, 8, 8), names=(name,)),
                                   [image]) for ident, (name, image) in images.items()]))


@pytest.mark.parametrize("path", ["tensor", "device"])
def test_named_photos_run_as_one_bundle_and_a_bad_one_is_answered_apart_under_its_own_name(
        path: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: a request whose photo had a file name (every multipart one) ran as a request of its own, never in a
    # bundle (its error must name its own file); now it runs in one, and an error about its photo runs it apart
    # with its own message: the error names its file, not the bundle's first
    served: Link = request.getfixturevalue("link" if path == "tensor" else "device_link")
    if path == "tensor":
        served.server.decode_shares.s_per_byte = HAND_OFF_S / 10_000_000  # one bundle, on the loop
    bundles, before, conn, reader = _watched_shared_connection(served, monkeypatch)
    with conn:
        _named_photos_together(conn, {1: ("red.jpg", image_bytes(RED)), 2: ("blue.jpg", image_bytes(BLUE)),
                                      3: ("red2.jpg", image_bytes(RED))})
        answers = _answers_by_id(reader, 3)
        assert [int(answers[ident].value.rows.argmax()) for ident in (1, 2, 3)] == [0, 2, 0]
        assert bundles == [3]
        _named_photos_together(conn, {4: ("first.jpg", image_bytes(RED)), 5: ("bad.jpg", b"\xff\xd8 no jpeg"),
                                      6: ("last.jpg", image_bytes(BLUE))})
        answers = _answers_by_id(reader, 3)
    error = answers[5].error
    assert error is not None and error.status == 400 and "bad.jpg" in error.message and "first.jpg" not in \
        error.message
    assert int(answers[4].value.rows.argmax()) == 0 and int(answers[6].value.rows.argmax()) == 2
    assert bundles == [3]  # (the second ran apart)
    wait_until(lambda: _outcome_counts(served)["ok"] == before["ok"] + 5 and _all_let_go(served))


def _decodes() -> float:
    return metric_sum(REGISTRY, "visionserve_stage_duration_seconds_count", stage="decode")


def _client_gone() -> float:
    return metric_sum(REGISTRY, "visionserve_batcher_events_total", event="client_gone")


def test_each_photo_of_a_bundle_is_timed_and_counted_as_its_own_request_s_decode(
        device_link: Link, monkeypatch: pytest.MonkeyPatch) -> None:
    bundles, _, conn, reader = _watched_shared_connection(device_link, monkeypatch)
    before = _decodes()
    with conn:
        _photos_together(conn, {ident: image_bytes(BLUE) for ident in range(1, 5)})
        answers = _answers_by_id(reader, 4)
    assert bundles == [4] and _decodes() == before + 4  # one observation a request, not one a bundle
    decoded = {answer.value.decode_s for answer in answers.values()}
    assert len(decoded) == 1 and 0 < decoded.pop() < 1  # each the bundle's header reads, which it waited for


@pytest.mark.parametrize("path", ["tensor", "device"])
def test_a_bundle_counts_and_times_only_the_requests_it_runs(
        settings: Settings, predictor: Predictor, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    # Before: a request cancelled before its admission still counted in its bundle's call: four decodes observed
    # for three photos; and each answer was timed with its share of the bundle's decode, a third of what it waited
    settings = settings.model_copy(update={"control_dir": tmp_path / "control", "decode_path": path})
    link = Link(settings, Service.build(settings.model_copy(update={"control_dir": None}), predictor)).start()
    try:
        bundles, _, conn, reader = _watched_shared_connection(link, monkeypatch)
        link.server.decode_shares.s_per_byte = HAND_OFF_S / 10_000_000  # one bundle
        decoder = link.engine.loaded_version().decoder
        prepare = decoder.prepare
        monkeypatch.setattr(decoder, "prepare", lambda data: (time.sleep(0.02), prepare(data))[1])  # 20 ms a photo
        before, held, go = _decodes(), threading.Event(), threading.Event()
        with conn:
            link.server._post(lambda: (held.set(), go.wait(10)))  # the loop held: the cancel read with the requests
            assert held.wait(5)
            _photos_together(conn, {ident: image_bytes(BLUE) for ident in range(1, 5)})
            wire.send(conn, wire.Cancel((2,)))
            go.set()
            answers = _answers_by_id(reader, 3)
        assert sorted(answers) == [1, 3, 4] and bundles == [3] and _decodes() == before + 3
        assert all(answer.value.decode_s >= 0.06 for answer in answers.values())  # the bundle's three decodes
    finally:
        link.server.stop(5)


def test_a_photo_bundle_across_two_batches_failing_at_its_first_photo_leaves_its_others_the_queue_s_room(
        device_link: Link, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the failed group's four photos still queued held their room (QUEUE_SIZE 8) while the bundle's
    # requests were queued again one by one: four of them answered 429
    link = device_link
    for _ in range(3):  # batches known short: the loop runs them (the first of a version never does)
        infer(link.worker, [image_bytes(RED)])
    bundles, before, conn, reader = _watched_shared_connection(link, monkeypatch)
    with conn:  # eight alike (MAX_BATCH_SIZE 4: two batches), the first failing in its batch
        _photos_together(conn, {1: _broken_in_its_batch(monkeypatch),
                                **{ident: image_bytes(BLUE) for ident in range(2, 9)}})
        answers = _answers_by_id(reader, 8)
    assert answers[1].error is not None and answers[1].error.status == 400
    assert {ident: answers[ident].error for ident in range(2, 9)} == {ident: None for ident in range(2, 9)}
    assert all(int(answers[ident].value.rows.argmax()) == 2 for ident in range(2, 9))
    wait_until(lambda: _outcome_counts(link)["ok"] == before["ok"] + 7 and _all_let_go(link))
    assert link.engine.loaded_version().batcher.depth == 0


def _decoded_on(link: Link) -> list[str]:
    """The threads the engine's version decodes its photos on, as it does."""
    decoded_on: list[str] = []
    version = link.engine.loaded_version()
    prepare = version.decoder.prepare

    def recorded(data: bytes) -> object:
        decoded_on.append(threading.current_thread().name)
        return prepare(data)

    version.decoder.prepare = recorded  # type: ignore[method-assign]
    return decoded_on


def test_photos_a_version_decodes_on_the_cpu_run_as_bundles_of_about_a_hand_off_s_decoding(
        link: Link, monkeypatch: pytest.MonkeyPatch) -> None:
    bundles, before, conn, reader = _watched_shared_connection(link, monkeypatch)
    decoded_on, shares = _decoded_on(link), link.server.decode_shares
    shares.threads = 2
    with conn:
        _four_alike_photos_each_answered_from_its_row(conn, reader)  # not measured yet: each its own
        assert bundles == [] and all(name.startswith("engine-decode") for name in decoded_on)
        shares.handed_s_per_byte = None  # the threads' measure, lower than what is set here, left out
        shares.s_per_byte = HAND_OFF_S / (2 * max(len(image_bytes(RED)), len(image_bytes(BLUE))))  # two hand-offs
        _four_alike_photos_each_answered_from_its_row(conn, reader)
        assert bundles == [2, 2] and all(name.startswith("engine-decode") for name in decoded_on[4:])
        shares.s_per_byte = HAND_OFF_S / 10_000_000  # all four cheaper than one hand-off: one bundle, on the loop
        _four_alike_photos_each_answered_from_its_row(conn, reader)
    assert bundles == [2, 2, 4] and decoded_on[8:] == ["engine-loop"] * 4
    wait_until(lambda: _outcome_counts(link)["ok"] == before["ok"] + 12 and _all_let_go(link))


def test_a_bundle_of_photos_decoded_on_the_cpu_answers_a_bad_one_alone_and_each_decode_once(
        link: Link, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the bundle's requests run apart shared its call of three requests, so each counted its decode three
    # times
    decodes = _decodes

    bundles, before, conn, reader = _watched_shared_connection(link, monkeypatch)
    link.server.decode_shares.s_per_byte = HAND_OFF_S / 10_000_000  # one bundle
    decoded = decodes()
    with conn:
        _photos_together(conn, {5: image_bytes(RED), 6: b"\xff\xd8 no jpeg", 7: image_bytes(BLUE)})
        answers = _answers_by_id(reader, 3)
    assert answers[6].error is not None and answers[6].error.status == 400  # its decode: run apart, alone
    assert int(answers[5].value.rows.argmax()) == 0 and int(answers[7].value.rows.argmax()) == 2
    assert bundles == [] and decodes() == decoded + 2  # each answered alone, each decode counted once
    wait_until(lambda: _outcome_counts(link)["ok"] == before["ok"] + 2 and _all_let_go(link))
    assert _outcome_counts(link)["refused"] == before["refused"] + 1


def test_a_bundle_the_queue_cannot_take_whole_is_queued_request_by_request_as_each_would_be_alone(
        link: Link, monkeypatch: pytest.MonkeyPatch) -> None:
    bundles, before = _bundles_answered(monkeypatch), _outcome_counts(link)
    conn, reader = _shared_connection(link)
    conn.settimeout(10)
    with conn:  # ten alike, on an idle engine whose queue takes eight images (QUEUE_SIZE 8)
        wire.send(conn, *wire.infers([(ident, _ONE_PIXELS, [_one_colour(ident % 3)]) for ident in range(1, 11)]))
        answers = _answers_by_id(reader, 10)
    refused = sorted(ident for ident, answer in answers.items() if answer.error is not None)
    assert refused == [9, 10] and all(answers[ident].error.status == 429 for ident in refused)  # type: ignore[union-attr]
    assert all(int(answers[ident].value.rows.argmax()) == ident % 3 for ident in range(1, 9))
    assert bundles == []  # each on its own, as the queue judged the bundle too large for it
    wait_until(lambda: _outcome_counts(link)["ok"] == before["ok"] + 8 and _all_let_go(link))
    assert _outcome_counts(link)["refused"] == before["refused"] + 2


def test_a_bundle_whose_shape_is_of_whole_numbers_of_another_type_answers_each_its_error_and_the_loop_serves_on(
        link: Link) -> None:
    # Before: the bundle read its pixels with a shape of (3.0, 8, 8), which numpy refuses, outside any guard: the
    # engine's loop ended, and every request after it waited for an engine that no longer answered
    conn, reader = _shared_connection(link)
    conn.settimeout(10)
    shaped = dataclasses.replace(_ONE_PIXELS, parsed_shape=(3.0, 8, 8))
    with conn:
        wire.send(conn, *wire.infers([(ident, shaped, [_one_colour(0)]) for ident in (1, 2)]))
        answers = _answers_by_id(reader, 2)
    assert all(answer.error is not None and answer.error.status == 500 for answer in answers.values())
    assert infer(link.worker, [image_bytes(RED)]).probabilities().argmax() == 0
    wait_until(lambda: _all_let_go(link))


def _sent_in_one_turn(link: Link, sends: dict[socket.socket, dict[int, int]]) -> None:
    """Each connection's blue, red or green pixel requests (by id, their colour) sent while the engine's loop is held,
    so that its next turn reads them all."""
    held, go = threading.Event(), threading.Event()
    link.server._post(lambda: (held.set(), go.wait(10)))
    assert held.wait(5)
    for conn, colours in sends.items():
        wire.send(conn, *wire.infers([(ident, _ONE_PIXELS, [_one_colour(colour)])
                                      for ident, colour in colours.items()]))
    go.set()


def _held_and_bundled(link: Link, model: ColourModel, monkeypatch: pytest.MonkeyPatch,
                      sends: dict[socket.socket, dict[int, int]]) -> int:
    """A lone request's batch held by the gate on the batcher's thread, and the pixel requests of ``sends`` (a
    bundle: ``_sent_in_one_turn``) queued behind it, admitted; the batches that ran before the held one."""
    _batches_off_the_loop(link, monkeypatch)
    infer(link.worker, [image_bytes(RED)])  # (batches were timed)
    model.gate, batches = threading.Event(), len(model.batch_sizes)
    held = threading.Thread(target=infer, args=(link.worker, [image_bytes(RED)]), daemon=True)
    held.start()
    wait_until(lambda: len(model.batch_sizes) == batches + 1)  # in its forward pass, held there
    _sent_in_one_turn(link, sends)
    wait_until(lambda: link.engine.in_flight.count() == 1 + sum(map(len, sends.values())))
    return batches


def _left_while_held(link: Link, model: ColourModel, monkeypatch: pytest.MonkeyPatch,
                     sends: dict[socket.socket, dict[int, int]], leave: Callable[[], object], left: int
                     ) -> tuple[int, dict[str, float]]:
    """``sends`` held and bundled (``_held_and_bundled``), then ``leave`` done: ``left`` of them counted at once, as
    hang-ups, the others still in flight until the gate opens. The batches before the held one, and the outcome
    counts before the leave."""
    try:
        batches = _held_and_bundled(link, model, monkeypatch, sends)
        before = _outcome_counts(link)
        leave()
        wait_until(lambda: _outcome_counts(link)["refused"] == before["refused"] + left)
        assert link.engine.in_flight.count() == 1 + sum(map(len, sends.values())) - left
    finally:
        assert model.gate is not None
        model.gate.set()
    return batches, before


def test_a_bundled_request_whose_client_leaves_is_counted_at_once_and_the_bundle_s_others_are_answered(
        link: Link, model: ColourModel, monkeypatch: pytest.MonkeyPatch) -> None:
    conn, reader = _shared_connection(link)
    conn.settimeout(10)
    _, before = _left_while_held(link, model, monkeypatch, {conn: {1: 2, 2: 2, 3: 2}},
                                 lambda: wire.send(conn, wire.Cancel((2,))), 1)
    answers = _answers_by_id(reader, 2)
    assert sorted(answers) == [1, 3] and all(int(answer.value.rows.argmax()) == 2 for answer in answers.values())
    wait_until(lambda: _outcome_counts(link)["ok"] == before["ok"] + 3 and _all_let_go(link))  # the lone one's too
    conn.settimeout(0.2)
    with pytest.raises(OSError):  # nothing for the one that left
        reader.read()
    conn.close()


def test_alike_requests_of_two_shared_connections_in_one_turn_run_as_one_bundle_each_answered_on_its_own(
        link: Link, monkeypatch: pytest.MonkeyPatch) -> None:
    bundles, before = _bundles_answered(monkeypatch), _outcome_counts(link)
    (one, one_read), (two, two_read) = _shared_connection(link), _shared_connection(link)
    with one, two:
        one.settimeout(10)
        two.settimeout(10)
        _sent_in_one_turn(link, {one: {1: 0, 2: 2}, two: {1: 1, 2: 0, 3: 2}})  # (ids are each connection's own)
        answers = _answers_by_id(one_read, 2), _answers_by_id(two_read, 3)
    assert bundles == [5]  # one admission, call and group for the turn's five
    assert [{ident: int(answer.value.rows.argmax()) for ident, answer in each.items()} for each in answers] == [
        {1: 0, 2: 2}, {1: 1, 2: 0, 3: 2}]  # each its own row, on its own connection
    wait_until(lambda: _outcome_counts(link)["ok"] == before["ok"] + 5 and _all_let_go(link))


def test_a_connection_that_closes_leaves_its_requests_of_a_bundle_the_other_connection_s_are_answered(
        link: Link, model: ColourModel, monkeypatch: pytest.MonkeyPatch) -> None:
    (one, _), (two, two_read) = _shared_connection(link), _shared_connection(link)
    two.settimeout(10)
    batches, before = _left_while_held(link, model, monkeypatch, {one: {1: 2, 2: 2}, two: {1: 2, 2: 2}},  # a bundle
                                       one.close, 2)  # its HTTP worker gone: its two requests leave at once
    answers = _answers_by_id(two_read, 2)
    assert sorted(answers) == [1, 2] and all(int(answer.value.rows.argmax()) == 2 for answer in answers.values())
    wait_until(lambda: _outcome_counts(link)["ok"] == before["ok"] + 3 and _all_let_go(link))  # the lone one's too
    assert model.batch_sizes[batches + 1:] == [4]  # the bundle ran whole, its closed connection's images too
    two.close()


def test_a_bundle_whose_every_client_left_is_dropped_unrun(
        link: Link, model: ColourModel, monkeypatch: pytest.MonkeyPatch) -> None:
    conn, reader = _shared_connection(link)
    with conn:
        try:
            _held_and_bundled(link, model, monkeypatch, {conn: {1: 2, 2: 2}})
            dropped, batches = _client_gone(), len(model.batch_sizes)
            wire.send(conn, wire.Cancel((1,)))
            wire.send(conn, wire.Cancel((2,)))
            wait_until(lambda: link.engine.in_flight.count() == 1)
        finally:
            assert model.gate is not None
            model.gate.set()
        wait_until(lambda: _all_let_go(link))
    assert _client_gone() == dropped + 2  # the bundle's two images, dropped from the queue
    assert model.batch_sizes[batches:] == []  # no batch after the held one's (counted as it began)


def test_a_bundle_whose_model_fails_on_one_image_answers_the_others_from_their_own_run(
        link: Link, model: ColourModel, monkeypatch: pytest.MonkeyPatch) -> None:
    bundles, before = _bundles_answered(monkeypatch), _outcome_counts(link)
    model.fail_when = 0.5  # any red image fails its batch (the batcher runs a failed batch's images one by one)
    conn, reader = _shared_connection(link)
    conn.settimeout(10)
    with conn:
        wire.send(conn, *wire.infers([(ident, _ONE_PIXELS, [_one_colour(channel)])
                                      for ident, channel in ((1, 2), (2, 0), (3, 1))]))
        answers = _answers_by_id(reader, 3)
    assert answers[2].error is not None and answers[2].error.status == 500
    assert int(answers[1].value.rows.argmax()) == 2 and int(answers[3].value.rows.argmax()) == 1
    assert bundles == []  # the bundle failed; its requests were run again each on its own
    wait_until(lambda: _outcome_counts(link)["ok"] == before["ok"] + 2 and _all_let_go(link))
    assert _outcome_counts(link)["failed"] == before["failed"] + 1


def test_a_bundle_with_one_client_s_pixels_out_of_scale_answers_only_that_client_400(link: Link) -> None:
    # The bundle's model output is infinite for one client's pixels of 3e38: its requests run apart, so only that
    # client is told of its pixels (400), the others answered (a review found every request of the bundle 400, with
    # the other client's index and range, when the bundle's failure was the client's).
    before = _outcome_counts(link)
    huge = np.full((1, 3, 8, 8), 3e38, "<f4").tobytes()
    conn, reader = _shared_connection(link)
    conn.settimeout(10)
    with conn:
        wire.send(conn, *wire.infers([(1, _ONE_PIXELS, [_one_colour(0)]), (2, _ONE_PIXELS, [huge]),
                                      (3, _ONE_PIXELS, [_one_colour(2)])]))
        answers = _answers_by_id(reader, 3)
    assert answers[2].error is not None and answers[2].error.status == 400, answers[2].error
    assert "of values from 3e+38 to 3e+38" in str(answers[2].error)
    assert int(answers[1].value.rows.argmax()) == 0 and int(answers[3].value.rows.argmax()) == 2
    wait_until(lambda: _outcome_counts(link)["ok"] == before["ok"] + 2 and _all_let_go(link))
    assert _outcome_counts(link)["failed"] == before["failed"]


def test_pixels_whose_queueing_on_the_loop_fails_unforeseen_are_answered_and_the_loop_serves_on(
        link: Link, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from app.link import loop

    conn, reader = _shared_connection(link)
    conn.settimeout(10)
    red = np.zeros((1, 3, 8, 8), "<f4")
    red[0, 0] = 1.0
    def pixels(timeout_s: float) -> wire.Infer:  # (deadlines of two lengths: two exchanges, not one bundle)
        return wire.Infer("colour", None, None, timeout_s, "1", (3, 8, 8), names=(None,),
                          tensors=(("<f4", (1, 3, 8, 8)),))

    queue, broken = loop.queue_prepared, [True]
    monkeypatch.setattr(loop, "queue_prepared", lambda *args: 1 / 0 if broken[0] else queue(*args))
    with caplog.at_level(logging.ERROR, logger="app.link.loop"):
        wire.send(conn, *wire.infers([(ident, pixels(4.0 + ident), [red.tobytes()]) for ident in (1, 2)]))
        answers: dict[int, wire.Answer] = {}
        while len(answers) < 2:
            for message, _ in reader.read():
                answers.update(zip(message.ids, message.answers))
    assert all(answer.error is not None and answer.error.status == 500 for answer in answers.values())
    assert any("queueing 2 requests failed" in record.getMessage() for record in caplog.records)
    wait_until(lambda: link.engine.in_flight.count() == 0 and link.engine.loaded_version().arrivals.count() == 0)
    broken[0] = False
    wire.send(conn, *wire.infers([(3, pixels(5.0), [red.tobytes()]), (4, pixels(6.0), [red.tobytes()])]))
    assert sorted(_answered(reader, 2)) == [3, 4]


def test_a_request_whose_queueing_faults_is_answered_alone_and_its_turn_s_others_are_queued_and_answered(
        link: Link) -> None:
    conn, reader = _shared_connection(link)
    conn.settimeout(10)
    batcher = link.engine.loaded_version().batcher
    red = np.zeros((1, 3, 8, 8), "<f4")
    red[0, 0] = 1.0

    def pixels(timeout_s: object) -> wire.Infer:
        return wire.Infer("colour", None, None, timeout_s, "1", (3, 8, 8), names=(None,),  # type: ignore[arg-type]
                          tensors=(("<f4", (1, 3, 8, 8)),))

    wire.send(conn, *wire.infers([(1, pixels(5.0), [red.tobytes()]), (2, pixels(1j), [red.tobytes()]),
                                  (3, pixels(5.0), [red.tobytes()])]))  # 2: a deadline no time compares with
    answers: dict[int, wire.Answer] = {}
    while len(answers) < 3:
        for message, _ in reader.read():
            answers.update(zip(message.ids, message.answers))
    assert answers[1].error is None and answers[3].error is None and answers[2].error is not None
    wait_until(lambda: link.engine.in_flight.count() == 0)
    assert batcher.depth == 0 and batcher._live == 0  # nothing left queued for nobody


def test_a_deadline_of_another_number_type_is_taken_as_seconds_and_its_504_ends_no_loop(
        link: Link, model: ColourModel, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _queued_behind_a_held_batch(link, model, monkeypatch)
    conn, reader = _shared_connection(link)
    conn.settimeout(10)
    red = np.zeros((1, 3, 8, 8), "<f4")
    pixels = functools.partial(wire.Infer, "colour", None, None, parsed_version="1", parsed_shape=(3, 8, 8),
                               names=(None,), tensors=(("<f4", (1, 3, 8, 8)),))
    try:  # (a Fraction's 504 message failed to format in the loop's expiry, which ended the loop's thread)
        wire.send(conn, *wire.infers([(1, pixels(timeout_s=Fraction(3, 10)), [red.tobytes()])]))
        [(message, _)] = reader.read()  # its deadline passes while it waits behind the held batch
        assert message.ids == (1,) and isinstance(message.answers[0].error, DeadlineExceeded)
    finally:
        model.gate.set()
        first.join(10)
    wire.send(conn, *wire.infers([(2, pixels(timeout_s=5.0), [red.tobytes()])]))
    assert _answered(reader, 1, red=False) == [2]


def test_an_engine_gone_mid_request_is_a_503_with_retry_after_and_a_failed_connection_is_made_again(
        link: Link, model: ColourModel) -> None:
    infer(link.worker, [image_bytes(RED)])
    model.gate, batches = threading.Event(), len(model.batch_sizes)
    failures: list[BaseException | None] = []
    thread = threading.Thread(target=lambda: failures.append(_failure(lambda: infer(link.worker, [image_bytes(RED)]))))
    thread.start()
    wait_until(lambda: len(model.batch_sizes) > batches)  # its forward pass runs (held by the gate)
    assert len(link.connections) == 1  # the request took the idle connection of the one before
    link.connections[-1].shutdown(socket.SHUT_RDWR)  # that request's connection ends, as when the engine dies
    thread.join(5)
    model.gate.set()
    failure = failures[0]
    assert isinstance(failure, NotReady) and failure.headers["Retry-After"] == "5" and "restarting" in failure.message
    assert infer(link.worker, [image_bytes(RED)]).model == "colour" and len(link.connections) == 2  # made again
    link.connections[-1].shutdown(socket.SHUT_RDWR)  # the idle connection ends between two requests (a restart)
    assert infer(link.worker, [image_bytes(RED)]).model == "colour" and len(link.connections) == 3


def _failure(run: Callable[[], object]) -> BaseException | None:
    try:
        run()
    except BaseException as exc:  # noqa: BLE001 - returned for the test
        return exc
    return None


def test_a_catalog_read_answers_while_a_change_waits_for_every_engine(link: Link,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    assert contract.CATALOG_CHANGES < set(contract.CATALOG_CALLS)
    infer(link.worker, [image_bytes(RED)])  # the engine's loop runs
    waiting, release = threading.Event(), threading.Event()

    def load(name: str, config: object = None) -> dict[str, object]:
        waiting.set()
        assert release.wait(10)  # as a load waits for every engine to apply it
        return {"loaded": name}

    monkeypatch.setattr(link.engine.catalog, "load", load)
    results: list[object] = []
    changes = [threading.Thread(target=lambda: results.append(link.worker.catalog.load("colour"))) for _ in range(4)]
    for change in changes:
        change.start()
    assert waiting.wait(10)
    for _ in range(3):  # reads answer on their own thread, none behind the changes (which fill theirs)
        assert [info.name for info in link.worker.catalog.versions()] == ["colour"]
    release.set()
    for change in changes:
        change.join(10)
    assert results == [{"loaded": "colour"}] * 4


def test_the_catalog_and_the_state_answer_across_the_link(link: Link, tmp_path: Path) -> None:
    assert link.worker.catalog.default_model() == "colour"
    (info,) = link.worker.catalog.versions()
    assert info.name == "colour" and info.default and isinstance(info, contract.VersionInfo)
    assert [row.state for row in link.worker.catalog.index()] == ["READY"]
    with pytest.raises(NotFound):
        link.worker.catalog.version("other")
    assert link.worker.loaded and link.worker.alive
    assert not link.worker.ready  # this worker has not marked itself ready in CONTROL_DIR (RemoteService.start)
    (tmp_path / "control").mkdir(exist_ok=True)
    (tmp_path / "control" / f"http-{__import__('os').getpid()}.ready").touch()
    assert link.worker.ready
    link.worker.begin_drain()
    assert not link.worker.ready and not (tmp_path / "control" / f"http-{__import__('os').getpid()}.ready").exists()
    leaving = tmp_path / "control" / f"http-{__import__('os').getpid()}.leaving"
    assert leaving.exists() and infer(link.worker, [image_bytes(RED)]).version  # its drain still answers
    link.worker.stop_serving()
    assert not leaving.exists()
    with pytest.raises(NotReady, match="shutting down"):
        infer(link.worker, [image_bytes(RED)])


def _counts_held(settings: Settings, predictor: Predictor, tmp_path: Path, flush_ms: float) -> tuple[Service, Link]:
    """An engine whose loop holds its request counts ``flush_ms`` (METRICS_FLUSH_MS), and a worker joined to it."""
    settings = settings.model_copy(update={"metrics_flush_ms": flush_ms})
    service = Service.build(settings, predictor)
    return service, Link(settings.model_copy(update={"control_dir": tmp_path / "control"}), service).start()


@pytest.mark.parametrize("flush_ms", [60_000.0, 50.0])
def test_the_loop_holds_its_request_counts_until_a_scrape_asks_or_metrics_flush_ms_has_passed(
        settings: Settings, predictor: Predictor, tmp_path: Path, flush_ms: float) -> None:
    # An engine's loop wrote its request counts at the end of every turn that counted any: a turn's metric writes
    # on every few requests. Now it writes them once they have been held METRICS_FLUSH_MS, idle or not, and at once
    # when a scrape asks (settle_figures), so a scrape still counts every request answered before it.
    service, link = _counts_held(settings, predictor, tmp_path, flush_ms)
    try:
        before = _outcome_counts()
        for _ in range(3):
            infer(link.worker, [image_bytes(RED)])
        if flush_ms > 1000:
            time.sleep(0.2)
            assert _outcome_counts() == before  # answered, and held
            link.worker.catalog.settle_figures()
            assert _outcome_counts()["ok"] == before["ok"] + 3  # the scrape's ask wrote them before its answer
        else:  # written by the loop with nothing more to do, once they were due
            wait_until(lambda: _outcome_counts()["ok"] == before["ok"] + 3, timeout=5)
    finally:
        link.server.stop(5)  # as at a SIGTERM: the counts its loop holds written too


def test_a_stopping_engine_writes_the_request_counts_its_loop_holds_before_it_exits(
        settings: Settings, predictor: Predictor, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from app.link import server as engine_process

    service, link = _counts_held(settings, predictor, tmp_path, 60_000.0)
    exits: list[BaseException] = []
    monkeypatch.setattr(engine_process, "exit_now", exits.append)
    before = _outcome_counts()
    infer(link.worker, [image_bytes(RED)])
    assert _outcome_counts() == before  # held a minute
    engine_process._stop(link.server, settings)  # SIGTERM's, once the HTTP workers drained
    assert _outcome_counts()["ok"] == before["ok"] + 1 and len(exits) == 1  # written, then the exit


def test_a_stopping_engine_writes_the_counts_of_the_shared_requests_its_stop_finishes(
        link: Link, model: ColourModel, monkeypatch: pytest.MonkeyPatch) -> None:
    # A shared connection's request leaves as its turn's answers go out (_send_answers). The stop's write ran in the
    # same wake-up as the end its batch posted, before those answers: the count came after it, and the exit lost it.
    from app.link import server as engine_process

    _batches_off_the_loop(link, monkeypatch)
    infer(link.worker, [image_bytes(RED)])  # (batches were timed)
    conn, reader = _shared_connection(link)
    conn.settimeout(10)
    model.gate, batches = threading.Event(), len(model.batch_sizes)
    wire.send(conn, *wire.infers([(1, _ONE_PIXELS, [_one_colour(2)])]))
    wait_until(lambda: len(model.batch_sizes) == batches + 1)  # its batch runs, held by the gate
    before = _outcome_counts(link)
    exits: list[BaseException] = []
    monkeypatch.setattr(engine_process, "exit_now", exits.append)
    stopper = threading.Thread(target=engine_process._stop, args=(link.server, link.engine.settings))
    stopper.start()  # SIGTERM's: waits in the service's shutdown for the batch
    held = threading.Event()
    link.server._post(lambda: held.wait(5))  # the loop busy (a turn's work) as the batch's end and the write come
    model.gate.set()
    time.sleep(0.3)  # the batch's end posted, and the stop's write behind it
    held.set()
    stopper.join(10)
    assert exits and list(_answers_by_id(reader, 1)) == [1]  # answered, then the process would exit
    assert _outcome_counts()["ok"] == before["ok"] + 1  # what it wrote before its exit


def test_what_v1_models_shows_crosses_in_one_exchange_and_agrees_with_the_calls_one_by_one(link: Link) -> None:
    link.frames.clear()
    overview = link.worker.catalog.overview()
    assert link.frames == ["CatalogCall", "Answer"]
    assert isinstance(overview, contract.ModelsOverview) and overview.default_model == "colour"
    assert [(info.name, info.version, info.default) for info in overview.versions] == [
        (info.name, info.version, info.default) for info in link.worker.catalog.versions()]
    assert overview.workers == link.worker.catalog.workers() and overview.rollouts == link.worker.catalog.rollouts()


def test_what_the_repository_index_shows_crosses_in_one_exchange_and_agrees_with_the_calls_one_by_one(
        link: Link) -> None:
    link.frames.clear()
    overview = link.worker.catalog.repository_overview()
    assert link.frames == ["CatalogCall", "Answer"]
    catalog = link.worker.catalog
    assert isinstance(overview, contract.RepositoryOverview)
    assert overview.roles[("colour", catalog.serving()["colour"]["default"])] == "live"  # the index's default
    assert overview.index == catalog.index() and overview.index[0].state == "READY"
    assert overview.roles == catalog.roles() and overview.rollouts == catalog.rollouts()


def test_both_services_have_one_face_and_one_lifecycle() -> None:
    for service in (Service, RemoteService):
        assert issubclass(service, lifecycle.Lifecycle)
        for name in ("admit", "begin_drain", "shutdown", "wait_drained", "wait_loaded", "require_loaded",
                     "require_ready", "loaded", "alive", "ready", "draining"):
            assert hasattr(service, name), (service, name)
    shared = ("wait_drained", "wait_loaded", "require_loaded", "require_ready", "begin_drain", "draining",
              "deadline_limit_s")
    assert not [n for n in shared if n in vars(Service) or n in vars(RemoteService)], "written twice"


def test_a_tensor_request_crosses_as_numpy(link: Link) -> None:
    red = torch.zeros(3, 8, 8)
    red[0] = 1.0
    served = infer(link.worker, tensors=[red.numpy()])
    assert served.top_k(1)[0][0].label == "red" and served.rows.dtype == np.float32


def test_a_request_s_pixels_cross_as_one_stack_and_come_back_row_by_row_in_order(
        link: Link, monkeypatch: pytest.MonkeyPatch) -> None:
    pixels = np.zeros((4, 3, 8, 8), np.float32)
    for row, channel in enumerate([0, 2, 2, 0]):  # red, blue, blue, red
        pixels[row, channel] = 1.0
    sent: list[tuple[object, list]] = []
    send = wire.send

    def spied(sock: socket.socket, message: object, segments: Sequence = ()) -> None:
        if isinstance(message, wire.Infer):
            sent.append((message, list(segments)))
        send(sock, message, segments)

    monkeypatch.setattr(wire, "send", spied)
    for tensors in (pixels, list(pixels)):  # one (N, C, H, W) array, or a row each
        served = infer(link.worker, tensors=tensors)
        assert [ranked[0].label for ranked in served.top_k(1)] == ["red", "blue", "blue", "red"]
    assert len(sent) == 2
    for message, segments in sent:
        assert message.tensors == (("<f4", (4, 3, 8, 8)),) and len(segments) == 1


def test_a_lone_request_s_short_batch_runs_on_the_engine_s_loop_and_a_long_one_on_the_batcher_s_thread(
        link: Link, model: ColourModel, monkeypatch: pytest.MonkeyPatch) -> None:
    red = torch.zeros(3, 8, 8)
    red[0] = 1.0
    monkeypatch.setattr(link.server, "_loop_batch_s", 1.0)  # "short", however busy the machine running the test
    assert infer(link.worker, tensors=[red.numpy()]).top_k(1)[0][0].label == "red"
    assert model.threads[-1] != link.server._loop_thread  # the version's first batch: not measured yet
    # no hand-off to the batcher's thread and back, once that thread is done with the batch before (its answer
    # wakes the loop before it frees the queue, and a request the loop reads meanwhile goes to that thread)
    batcher = link.engine.loaded_version().batcher
    for _ in range(3):
        wait_until(lambda: not batcher._busy)
        assert infer(link.worker, tensors=[red.numpy()]).top_k(1)[0][0].label == "red"
        assert model.threads[-1] == link.server._loop_thread
    monkeypatch.setattr(link.server, "_loop_batch_s", -1.0)  # as if its batches took longer than that
    assert infer(link.worker, tensors=[red.numpy()]).top_k(1)[0][0].label == "red"
    assert model.threads[-1] != link.server._loop_thread


def test_a_version_whose_batches_may_not_run_on_a_loop_has_even_its_short_ones_run_on_the_batcher_s_thread(
        link: Link, model: ColourModel, monkeypatch: pytest.MonkeyPatch) -> None:
    # as on CUDA for a version whose forward passes are eager (no CUDA graphs): the batcher's thread holds the tuned
    # cuDNN plans, so the engine's loop wakes it for every batch, the short ones too
    red = torch.zeros(3, 8, 8)
    red[0] = 1.0
    monkeypatch.setattr(link.server, "_loop_batch_s", 1.0)  # "short", however busy the machine running the test
    batcher = link.engine.loaded_version().batcher
    batcher.runs_queued_on_caller = False
    for _ in range(3):
        wait_until(lambda: not batcher._busy)
        assert infer(link.worker, tensors=[red.numpy()]).top_k(1)[0][0].label == "red"
        assert model.threads[-1] == batcher._thread.ident
    assert batcher.batches_inline == 0


def test_requests_read_in_one_loop_turn_run_as_one_batch_on_the_loop(link: Link, model: ColourModel,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    red = torch.zeros(3, 8, 8)
    red[0] = 1.0
    monkeypatch.setattr(link.server, "_loop_batch_s", 1.0)  # "short", however busy the machine running the test
    rounds, together, answers = 3, threading.Barrier(3), []

    def client() -> None:
        infer(link.worker, tensors=[red.numpy()])  # its connection, and a batch measured
        for _ in range(rounds):
            together.wait(10)  # ready
            together.wait(10)  # the loop is held
            answers.append(infer(link.worker, tensors=[red.numpy()]).top_k(1)[0][0].label)
            together.wait(10)

    clients = [threading.Thread(target=client) for _ in range(2)]
    for thread in clients:
        thread.start()
    for _ in range(rounds):
        together.wait(10)
        held, go = threading.Event(), threading.Event()
        link.server._post(lambda: (held.set(), go.wait(10)))  # the loop held while both requests are sent
        assert held.wait(10)
        together.wait(10)
        wait_until(lambda: len(select.select(link.connections, [], [], 0)[0]) == 2)
        go.set()  # its next turn reads both
        together.wait(10)
    for thread in clients:
        thread.join(10)
    # one batch of both, run by the loop itself: no hand-off to the batcher's thread and back (the first round's
    # requests may find that thread still finishing a batch before: then its)
    assert answers == ["red"] * 2 * rounds
    assert model.batch_sizes[-1] == 2 and model.threads[-1] == link.server._loop_thread


def _idle_connections(link: Link, count: int) -> None:
    """``count`` connections idle in the worker's pool, as after that many requests at once (an exchange takes an
    idle connection and makes one only when none is): sent while the engine's loop is held, each needs its own."""
    infer(link.worker, tensors=[np.zeros((3, 8, 8), "float32")])  # the engine's loop runs once a connection came
    held, go = threading.Event(), threading.Event()
    link.server._post(lambda: (held.set(), go.wait(10)))
    assert held.wait(10)
    senders = [threading.Thread(target=infer, args=(link.worker,), kwargs={"tensors": [np.zeros((3, 8, 8), "float32")]})
               for _ in range(count)]
    for sender in senders:
        sender.start()
    wait_until(lambda: len(link.connections) >= count)
    go.set()
    for sender in senders:
        sender.join(10)
    assert len(link.worker.connections._idle) == count


def test_a_backlog_of_short_batches_runs_on_the_loop_a_slice_a_turn_with_the_answers_between(
        link: Link, model: ColourModel, monkeypatch: pytest.MonkeyPatch) -> None:
    colours = {"red": torch.zeros(3, 8, 8), "blue": torch.zeros(3, 8, 8)}
    colours["red"][0], colours["blue"][2] = 1.0, 1.0
    together, answers = threading.Barrier(3), {}
    _idle_connections(link, 2)  # one for each client: their requests below cross at once

    def client(colour: str) -> None:
        infer(link.worker, tensors=[colours[colour].numpy()])  # its connection, and a batch measured
        together.wait(10)  # ready
        together.wait(10)  # the loop is held
        served = infer(link.worker, tensors=[colours[colour].numpy()] * 4)  # a batch of the cap
        answers[colour] = [ranked[0].label for ranked in served.top_k(1)]

    clients = [threading.Thread(target=client, args=(colour,)) for colour in colours]
    for thread in clients:
        thread.start()
    together.wait(10)
    batcher = link.engine.loaded_version().batcher
    wait_until(lambda: not batcher._busy)  # the batcher's thread done with a batch before, whatever the machine's load
    monkeypatch.setattr(link.server, "_loop_batch_s", 1.0)
    monkeypatch.setattr(batcher, "expected_batch_s", lambda items: 0.6)  # a slice: one batch of the cap
    slices, run_queued = [], batcher.run_queued

    def sliced(limit: float) -> bool:
        before, answered = batcher.depth, link.frames.count("Answer")
        ran = run_queued(limit)
        slices.append((before, batcher.depth, ran, answered))
        return ran

    monkeypatch.setattr(batcher, "run_queued", sliced)
    held, go = threading.Event(), threading.Event()
    link.server._post(lambda: (held.set(), go.wait(10)))  # the loop held while both requests are sent
    assert held.wait(10)
    together.wait(10)
    wait_until(lambda: len(select.select(link.connections, [], [], 0)[0]) == 2)
    go.set()  # its next turn reads both: eight images, two batches of the cap
    for thread in clients:
        thread.join(10)
    assert answers == {"red": ["red"] * 4, "blue": ["blue"] * 4}
    assert model.batch_sizes[-2:] == [4, 4] and model.threads[-2:] == [link.server._loop_thread] * 2
    # a batch a turn: the first request answered before the second's batch ran, no hand-off to the batcher's thread
    wait_until(lambda: len(slices) == 2)  # the second answer leaves from within its slice's call
    (first, second) = slices
    assert first[:3] == (8, 4, True) and second[:3] == (4, 0, True) and second[3] == first[3] + 1


def test_the_engine_answers_504_at_the_deadline_while_the_batch_still_runs(link: Link, model: ColourModel) -> None:
    model.gate = threading.Event()
    started = time.monotonic()
    try:
        with pytest.raises(DeadlineExceeded, match="0.3s deadline"):
            infer(link.worker, [image_bytes(RED)], timeout_s=0.3)
        assert time.monotonic() - started < 3  # answered by the loop's deadline, not after the held batch
    finally:
        model.gate.set()
    assert infer(link.worker, [image_bytes(RED)]).model == "colour"  # the connection goes on
    wait_until(lambda: link.engine.in_flight.count() == 0)


def _outcome_counts(link: Link | None = None, role: str = "live") -> dict[str, float]:
    """The colour model's requests counted so far, by outcome; with ``link``, as a scrape reads them: its engine's
    loop asked first to write the counts it holds (METRICS_FLUSH_MS)."""
    if link is not None:
        link.worker.catalog.settle_figures()
    return {outcome: VERSION_REQUESTS.labels("colour", "test", role, outcome)._value.get()
            for outcome in ("ok", "failed", "refused")}


def _queued_behind_a_held_batch(link: Link, model: ColourModel, monkeypatch: pytest.MonkeyPatch) -> threading.Thread:
    """A request's batch running on the batcher's thread, held by the gate: what comes next waits in the queue."""
    _batches_off_the_loop(link, monkeypatch)
    infer(link.worker, [image_bytes(RED)])
    model.gate, batches = threading.Event(), len(model.batch_sizes)
    first = threading.Thread(target=lambda: _failure(lambda: infer(link.worker, [image_bytes(RED)])))
    first.start()
    wait_until(lambda: len(model.batch_sizes) > batches)
    return first


def test_a_request_whose_deadline_passes_while_its_images_wait_is_a_504(link: Link, model: ColourModel,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: dropping its queued images completed its group as cancelled, and that was answered first: 500
    # inference_failed (CancelledError), the version's failure.
    first = _queued_behind_a_held_batch(link, model, monkeypatch)
    batches = len(model.batch_sizes)
    try:
        with pytest.raises(DeadlineExceeded, match="0.3s deadline"):
            infer(link.worker, [image_bytes(BLUE)], timeout_s=0.3)  # queued: never taken into a batch
    finally:
        model.gate.set()
        first.join(10)
    wait_until(lambda: link.engine.in_flight.count() == 0)
    assert len(model.batch_sizes) == batches  # it never ran


def test_a_client_that_hangs_up_while_its_images_wait_counts_as_gone_not_as_the_version_s_failure(
        link: Link, model: ColourModel, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: as above, its end was answered from the cancelled group: counted failed (the rollback rule's evidence).
    first = _queued_behind_a_held_batch(link, model, monkeypatch)
    batcher, gone = link.engine.loaded_version().batcher, threading.Event()
    before = _outcome_counts(link)
    thread = threading.Thread(target=lambda: _failure(lambda: infer(link.worker, [image_bytes(BLUE)],
                                                                    client_gone=gone.is_set)))
    try:
        thread.start()
        wait_until(lambda: batcher.depth == 1)  # its image waits in the queue
        gone.set()
        thread.join(10)
        wait_until(lambda: _outcome_counts(link)["refused"] == before["refused"] + 1)  # a client's leaving (499)
        assert _outcome_counts(link)["failed"] == before["failed"] and link.engine.in_flight.count() == 1
    finally:
        model.gate.set()
        first.join(10)


def test_requests_that_arrive_together_share_a_batch_and_no_thread_waits_on_them(link: Link,
                                                                                 model: ColourModel) -> None:
    model.gate = threading.Event()
    answers: list[str] = []

    def request(colour: tuple[int, int, int]) -> None:
        answers.append(infer(link.worker, [image_bytes(colour)]).top_k(1)[0][0].label)

    batches = len(model.batch_sizes)  # the warm-up's
    blocker = threading.Thread(target=request, args=(RED,))
    blocker.start()
    wait_until(lambda: len(model.batch_sizes) == batches + 1)  # the first batch runs, held by the gate
    threads_before = set(threading.enumerate())
    waiting = [threading.Thread(target=request, args=(BLUE,)) for _ in range(3)]
    for thread in waiting:
        thread.start()
    batcher = link.engine.loaded_version().batcher
    wait_until(lambda: link.engine.in_flight.count() == 4 and batcher.depth == 3)  # decoded and queued, however slow
    # the three requests wait in the queue with no engine thread of their own: only this test's three clients
    # and the pool's decode threads (the CPU decodes these images) are new
    new = set(threading.enumerate()) - threads_before
    assert all(thread in waiting or thread.name.startswith("engine-decode") for thread in new), new
    model.gate.set()
    for thread in (blocker, *waiting):
        thread.join(10)
    assert sorted(answers) == ["blue", "blue", "blue", "red"] and model.batch_sizes[batches:] == [1, 3]


def test_work_posted_to_the_loop_from_other_threads_all_runs_however_the_wake_ups_fall(link: Link) -> None:
    # Posts share one wake-up byte while the loop has not yet taken what was posted: a flag left set with no byte
    # on its way would park the loop with work waiting (an engine benchmark hung on such a race before it was
    # fixed: the flag is cleared after the bytes are read, before the posted work is taken).
    server = link.server
    server.serve(_pair()[1])  # the loop runs on its own thread
    ran: list[int] = []
    per_thread, threads = 20_000, 4

    def post(offset: int) -> None:
        for i in range(per_thread):
            server._post(functools.partial(ran.append, offset + i))
            if i % 97 == 0:
                time.sleep(0)  # let the loop take some midway

    posters = [threading.Thread(target=post, args=(t * per_thread,)) for t in range(threads)]
    for poster in posters:
        poster.start()
    for poster in posters:
        poster.join()
    wait_until(lambda: len(ran) == per_thread * threads, timeout=10)
    assert sorted(ran) == list(range(per_thread * threads))


def test_a_turn_s_images_are_decoded_in_a_few_shares_and_on_the_loop_when_that_is_cheaper(link: Link) -> None:
    # Handing a request's decode to a thread and back costs more than decoding a small image: a turn's images go
    # to the decode threads in at most one share per thread, each worth a hand-off, and stay on the loop when
    # all of them decode in less than one (expected from their bytes and the decode CPU per byte measured so far)
    plan = link.server.decode_shares
    turn = [type("Read", (), {"images": [b"x" * 1000] * count})() for count in (1, 5, 2, 1, 3)]  # 12,000 bytes
    plan.s_per_byte = HAND_OFF_S / 1_000_000
    assert plan.here(turn) and plan.shares(turn) == [turn]
    big = [type("Read", (), {"images": [b"x" * 2_000_000]})()]  # one large photo after small ones: not on the loop
    assert not plan.here(big)
    plan.s_per_byte = HAND_OFF_S / 1000  # each image worth a hand-off of its own
    shares = plan.shares(turn)
    assert not plan.here(turn) and len(shares) == plan.threads
    assert sorted(map(id, sum(shares, []))) == sorted(map(id, turn))  # every request once
    loads = sorted(sum(len(read.images) for read in share) for share in shares)
    assert loads[-1] - loads[0] <= 1 or len(shares) == 1  # balanced by bytes (5 1 | 3 2 1 with two threads)
    plan.s_per_byte = HAND_OFF_S / 4000  # twelve images worth three hand-offs at most
    assert len(plan.shares(turn)) == min(3, plan.threads)


def test_a_turn_s_alike_photos_are_admitted_as_consecutive_bundles_of_about_a_hand_off_s_decoding() -> None:
    plan = DecodeShares(3)
    assert plan.runs([100] * 5) == [1] * 5  # not measured: each its own
    plan.s_per_byte = HAND_OFF_S / 1_000_000
    assert plan.runs([1000] * 12) == [12]  # all of them less than a hand-off: one bundle
    plan.s_per_byte = HAND_OFF_S / 2500  # 7,000 bytes: runs of a hand-off's at most, in order
    assert plan.runs([1000] * 7) == [2, 2, 2, 1]
    plan.s_per_byte = HAND_OFF_S / 5000  # a photo of more than a hand-off alone, wherever it comes
    assert plan.runs([5000] + [1000] * 5) == [1, 5] and plan.runs([1000] * 4 + [20_000] + [1000] * 2) == [4, 1, 2]
    plan.s_per_byte = HAND_OFF_S / 1000  # each photo two hand-offs: each its own
    assert plan.runs([2000] * 4) == [1] * 4


def test_images_each_cheaper_than_loop_image_max_s_stay_on_the_loop_however_many() -> None:
    # Their Python steps hold the interpreter lock: on decode threads beside the loop they ran slower than the loop
    # alone, however much of them a turn holds
    plan = DecodeShares(2)
    turn = [type("Read", (), {"images": [b"x" * 1000] * 16})() for _ in range(8)]  # 128 images of 1,000 bytes
    plan.s_per_byte = LOOP_IMAGE_MAX_S / 1000 * 0.9  # each image just under: the turn many hand-offs' worth
    assert 128 * 1000 * plan.s_per_byte > HAND_OFF_S and plan.here(turn)
    plan.s_per_byte = LOOP_IMAGE_MAX_S / 1000 * 1.1  # each just over: handed out in a share per thread
    assert not plan.here(turn) and len(plan.shares(turn)) == 2
    big_one = [*turn, type("Read", (), {"images": [b"x" * 4000]})()]  # one image over it: the turn is handed out
    plan.s_per_byte = LOOP_IMAGE_MAX_S / 1000 * 0.9
    assert not plan.here(big_one)
    assert not DecodeShares(2).here(turn)  # nothing measured: any image is worth a hand-off


def test_the_loop_s_decode_measure_is_kept_apart_from_the_threads_and_taken_by_a_probe() -> None:
    # A decode thread's measure counts its waits for the interpreter lock: it runs high where decoding is mostly
    # Python steps, and would keep such photos on the threads for good
    plan = DecodeShares(2)
    small = type("Read", (), {"images": [b"x" * 1000] * 4})()
    larger = type("Read", (), {"images": [b"x" * 1000] * 8})()
    assert plan.probe([larger, small], now=0.0) is None  # nothing measured yet
    plan.measured(1000, LOOP_IMAGE_MAX_S * 1.5, on_loop=False)  # the threads': over LOOP_IMAGE_MAX_S an image
    assert plan.expected_s_per_byte() == plan.handed_s_per_byte and plan.s_per_byte is None
    assert not plan.here([larger, small])
    assert plan.probe([larger, small], now=10.0) is small  # the smallest, decoded on the loop for the loop's measure
    assert plan.probe([larger, small], now=10.0 + PROBE_EVERY_S / 2) is None  # at most once every PROBE_EVERY_S
    plan.measured(1000, LOOP_IMAGE_MAX_S / 4, on_loop=True)
    assert plan.s_per_byte == LOOP_IMAGE_MAX_S / 4000 and plan.expected_s_per_byte() == plan.s_per_byte
    assert plan.here([larger, small])  # the loop's, the lower, is expected
    plan.measured(1000, LOOP_IMAGE_MAX_S * 3, on_loop=False)  # a threads' decode leaves the loop's as it was
    assert plan.s_per_byte == LOOP_IMAGE_MAX_S / 4000
    plan.measured(1000, LOOP_IMAGE_MAX_S * 40, on_loop=True)  # the loop's moves with its own decodes only
    assert plan.s_per_byte > plan.handed_s_per_byte and not plan.here([larger, small])
    plan.handed_s_per_byte = LOOP_IMAGE_MAX_S / 2000  # the threads' the lower: expected, though the loop's is known
    assert plan.expected_s_per_byte() == plan.handed_s_per_byte and plan.here([larger, small])
    plan.handed_s_per_byte = LOOP_IMAGE_MAX_S * 2 / 1000
    assert plan.probe([larger, small], now=10.0 + PROBE_EVERY_S) is small  # a second later: probed again
    big = type("Read", (), {"images": [b"x" * 1000] * 3 + [b"x" * 3000]})()  # an image the threads' measure
    plan.handed_s_per_byte = PROBE_IMAGE_MAX_S / 2500  # puts over PROBE_IMAGE_MAX_S: the turn is theirs, unprobed
    assert plan.probe([big, small], now=100.0) is None and plan.probe([small], now=100.0) is small


def test_photos_first_decoded_on_the_threads_are_then_probed_on_the_loop(
        link: Link, monkeypatch: pytest.MonkeyPatch) -> None:
    decoded_on, shares = _decoded_on(link), link.server.decode_shares
    monkeypatch.setattr(decode_shares, "PROBE_EVERY_S", 3600.0)  # the next probe due only after the test, however slow
    image = image_bytes(RED)
    infer(link.worker, [image])  # nothing measured: a hand-off
    assert decoded_on[-1].startswith("engine-decode") and shares.s_per_byte is None
    monkeypatch.setattr(shares, "here", lambda requests: False)  # as a turn of more than a hand-off's decoding
    shares.handed_s_per_byte = PROBE_IMAGE_MAX_S / (2 * len(image))  # as if the threads put it near the loop's
    infer(link.worker, [image])
    assert decoded_on[-1] == "engine-loop" and shares.s_per_byte is not None  # the probe: the loop's own measure
    infer(link.worker, [image])  # within PROBE_EVERY_S of it: no probe
    assert decoded_on[-1].startswith("engine-decode")


def test_a_probe_is_decoded_on_the_loop_before_the_rest_of_its_turn_is_handed_to_the_decode_threads(
        link: Link, monkeypatch: pytest.MonkeyPatch) -> None:
    # so that the decode threads' steps do not wait for the lock in the loop's own measure; every request answered
    decoded_on, shares = _decoded_on(link), link.server.decode_shares
    monkeypatch.setattr(shares, "here", lambda requests: False)  # as a turn of more than a hand-off's decoding
    sizes = [(64, 48), (16, 12), (32, 24)]  # the smallest, 16x12, the probe
    colours = [RED, BLUE, RED]
    shares.handed_s_per_byte = PROBE_IMAGE_MAX_S / (2 * len(image_bytes(RED, size=sizes[0])))
    monkeypatch.setattr(decode_shares, "PROBE_EVERY_S", 3600.0)  # one probe in the test, however slow
    _idle_connections(link, len(sizes))  # each request its own connection: one turn reads them all
    held, go = threading.Event(), threading.Event()
    link.server._post(lambda: (held.set(), go.wait(10)))  # the loop held while the requests are sent
    assert held.wait(10)
    answers: dict[int, str] = {}

    def client(index: int) -> None:
        image = image_bytes(colours[index], size=sizes[index])
        answers[index] = infer(link.worker, [image]).top_k(1)[0][0].label

    clients = [threading.Thread(target=client, args=(index,)) for index in range(len(sizes))]
    for thread in clients:
        thread.start()
    wait_until(lambda: len(select.select(link.connections, [], [], 0)[0]) == len(sizes))
    decoded_on.clear()
    go.set()  # its next turn reads all three
    for thread in clients:
        thread.join(10)
    assert answers == {0: "red", 1: "blue", 2: "red"}
    assert decoded_on[0] == "engine-loop" and all(name.startswith("engine-decode") for name in decoded_on[1:])
    assert len(decoded_on) == len(sizes) and shares.s_per_byte is not None


def test_small_images_are_decoded_on_the_loop_once_their_cost_is_measured(link: Link) -> None:
    decoded_on = _decoded_on(link)
    # The first decodes' one-time costs (a decoder's first use, on a loaded machine) weigh in the moving average of
    # the cost per byte until a few more decodes took their place: on the loop once it has (30 requests leave room
    # for a first decode 400 times a hand-off). What a decode costs is the machine's: the rule, not a speed, is
    # asserted
    image = image_bytes(RED)
    for _ in range(30):
        per_byte = link.server.decode_shares.expected_s_per_byte()
        expected_here = per_byte is not None and len(image) * per_byte < HAND_OFF_S
        infer(link.worker, [image])
        assert (decoded_on[-1] == "engine-loop") is expected_here  # here exactly when cheaper than a hand-off
        if expected_here:
            break
    assert decoded_on[0].startswith("engine-decode")  # before any is measured, an image is worth a hand-off
    assert decoded_on[-1] == "engine-loop"


@pytest.mark.slow  # about 1.5 s
def test_a_batch_run_where_images_were_decoded_is_not_counted_as_their_decode(settings: Settings) -> None:
    # The loop learns what decoding costs per byte from what its decodes took; a lone batch it then runs itself must
    # not count, or a slow forward pass would read as slow decoding and send small images to the decode threads.
    class Burning(ColourModel):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            until = time.thread_time() + 0.05  # 50 ms of this thread's CPU
            while time.thread_time() < until:
                pass
            return super().forward(x)

    service = Service.build(settings, Predictor(Burning(), tiny_manifest(), device="cpu"))
    try:
        with service.admit(None, None, None) as call:
            assert call.queue([image_bytes(RED)], timeout_s=10).done()  # run here, measured: so do later ones
        with service.admit(None, None, None) as call:
            started = time.thread_time()
            queued = call.queue([image_bytes(RED)], timeout_s=10, defer=True)
            call.batcher.run_queued(10.0)
            assert queued.done() and time.thread_time() - started >= 0.05  # its batch ran on this thread
            assert 0 < queued.decode_cpu_s < 0.03
    finally:
        service.shutdown(timeout=5)


def _as_if_busy(server: EngineServer, monkeypatch: pytest.MonkeyPatch, wait_s: float, yield_: float = 1.0) -> None:
    """The loop as if requests came every 10 ms, its batches ran on it and other HTTP threads' connections were open
    with no request under way, each having carried some (so it waits for more, up to ``wait_s``), and waits so far
    brought ``yield_`` requests each; the pace stays as it is."""
    monkeypatch.setattr("app.link.gathering.ARRIVAL_WEIGHT", 0.0)
    monkeypatch.setattr(server, "_requesting", server._requesting + 8)
    gathering = server.gathering
    gathering.max_wait_s, gathering.batch_cap = wait_s, 1000  # no cap on the wait from the pace
    gathering.arrival_gap_s, gathering.wait_yield, gathering.batches_on_loop = 0.01, yield_, True


def _waits(server: EngineServer, monkeypatch: pytest.MonkeyPatch, on_loop: bool = False) -> list[bool]:
    """Whether each loop turn from now on waited for more requests (``on_loop``: each as if the turn before ran its
    batches on the loop, wherever they ran)."""
    waited: list[bool] = []
    gather = server._gather

    def counted() -> None:
        if on_loop:
            server.gathering.batches_on_loop = True
        gather()
        waited.append(server.gathering.turns_since_wait == 0)

    monkeypatch.setattr(server, "_gather", counted)
    return waited


@pytest.mark.slow  # the loop's wait lasts a second
def test_requests_that_come_while_the_loop_waits_for_more_run_as_one_batch(link: Link, model: ColourModel,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    red = torch.zeros(3, 8, 8)
    red[0] = 1.0
    monkeypatch.setattr(link.server, "_loop_batch_s", 1.0)  # "short", however busy the machine running the test
    answers: list[str] = []
    connected, go = threading.Barrier(3), [threading.Event(), threading.Event()]
    _idle_connections(link, 2)  # the second request needs no connection made while the loop waits

    def client(turn: threading.Event) -> None:  # an HTTP worker's request
        infer(link.worker, tensors=[red.numpy()])
        connected.wait(10)
        assert turn.wait(10)
        answers.append(infer(link.worker, tensors=[red.numpy()]).top_k(1)[0][0].label)

    clients = [threading.Thread(target=client, args=(event,)) for event in go]
    for thread in clients:
        thread.start()
    connected.wait(10)
    _as_if_busy(link.server, monkeypatch, wait_s=1.0, yield_=0.6)
    go[0].set()
    wait_until(lambda: len(link.server._turn) == 1)  # read (not yet admitted): the loop waits for more
    go[1].set()  # its request comes while the loop waits
    for thread in clients:
        thread.join(10)
    assert answers == ["red", "red"] and model.batch_sizes[-1] == 2, model.batch_sizes
    assert link.server.gathering.wait_yield == pytest.approx(0.6 + YIELD_WEIGHT * (1 - 0.6))  # the wait brought one


def test_a_lone_client_s_requests_stop_the_waits_that_bring_nothing_but_for_a_probe(
        link: Link, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("app.link.gathering.GATHER_PROBE_TURNS", 4)
    red = torch.zeros(3, 8, 8)
    red[0] = 1.0
    infer(link.worker, tensors=[red.numpy()])
    _as_if_busy(link.server, monkeypatch, wait_s=0.05, yield_=0.6)  # one wait that brings nothing stops them
    waited = _waits(link.server, monkeypatch, on_loop=True)  # a batch may still go to the batcher's thread
    for _ in range(6):
        infer(link.worker, tensors=[red.numpy()])
    # a sequential client's next request cannot come while the loop waits: the first wait brought nothing, the
    # next three turns did not wait, the fourth looked again (and brought nothing), the one after did not wait
    assert waited == [True, False, False, False, True, False]


def test_the_loop_never_waits_for_requests_that_cannot_come(link: Link, monkeypatch: pytest.MonkeyPatch) -> None:
    red = torch.zeros(3, 8, 8)
    red[0] = 1.0
    infer(link.worker, tensors=[red.numpy()])
    _as_if_busy(link.server, monkeypatch, wait_s=0.05)
    monkeypatch.setattr(link.server, "_requesting", link.server._requesting - 8)  # this thread's connection alone
    waited = _waits(link.server, monkeypatch, on_loop=True)
    for _ in range(3):
        infer(link.worker, tensors=[red.numpy()])
    # its one connection carries the request the turn read: no other can come, whatever the pace and the yield say
    assert waited == [False, False, False] and link.server._exchanges == 0


def _shared_connection(link: Link) -> tuple[socket.socket, wire.FrameReader]:
    """A connection to the engine greeted, as a loop link's (its reads of Answers)."""
    worker_end, engine_end = _pair()
    link.server.serve(engine_end)
    wire.say_hello(worker_end)
    return worker_end, wire.FrameReader(worker_end, (wire.Answers,))


def _sent_together(conn: socket.socket, ids: Sequence[int], image: bytes) -> None:
    wire.send(conn, *wire.infers([(ident, wire.Infer("colour", None, None, 5.0, "1", (3, 8, 8), names=(None,)),
                                   [image]) for ident in ids]))


def _answered(reader: wire.FrameReader, count: int, red: bool = True) -> list[int]:
    """The ids of ``count`` answers read (a blocking socket), each a red image's (``red``; else any answer, the
    queue's refusals included)."""
    ids: list[int] = []
    while len(ids) < count:
        for answers, _ in reader.read():
            if red:
                assert [answer.error for answer in answers.answers if answer.error] == []
                assert all(answer.value.rows.argmax() == 0 for answer in answers.answers)
            ids.extend(answers.ids)
    return ids


def test_an_answer_whose_rows_do_not_cross_fails_alone_and_its_turn_s_others_are_answered(
        link: Link, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: rows of objects crossed as their pointers' bytes, and the HTTP side's read of the whole Answers failed
    # (every request on that link); an answer that does not pickle is the server's error for its request alone
    from app.engine.call import Call
    from app.errors import InferenceFailed

    answer, made = Call.answer, []

    def second_of_objects(self: Call, queued: Any, labels: Any = None, embedding: bool = False) -> contract.Served:
        served = answer(self, queued, labels, embedding)
        made.append(served)
        if len(made) == 2:
            served.rows = served.rows.astype(object)
        return served

    monkeypatch.setattr(Call, "answer", second_of_objects)
    shared, reader = _shared_connection(link)
    with shared:  # (each its file name: each its own call, not a bundle's)
        wire.send(shared, *wire.infers([(ident, wire.Infer("colour", None, None, 5.0, "1", (3, 8, 8),
                                                           names=(f"{ident}.jpg",)), [image_bytes(RED)])
                                        for ident in (1, 2, 3)]))
        got: dict[int, wire.Answer] = {}
        while len(got) < 3:
            for answers, _ in reader.read():
                got.update(zip(answers.ids, answers.answers))
        failed = [ident for ident, each in got.items() if each.error is not None]
        assert len(failed) == 1 and isinstance(got[failed[0]].error, InferenceFailed)
        assert "could not be sent" in str(got[failed[0]].error)
        assert all(each.value.rows.argmax() == 0 for ident, each in got.items() if ident not in failed)
        _sent_together(shared, [4], image_bytes(RED))  # the connection still carries requests
        assert _answered(reader, 1) == [4]


def test_rows_a_model_answers_that_are_no_numbers_fail_their_request_and_count_as_failed(
        link: Link, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: such a request was counted ok (and its time, and a canary's evidence) while its client got a 500 for
    # an answer the link could not carry
    from app.engine.loaded.version import LoadedVersion
    from app.errors import InferenceFailed

    run_batch = LoadedVersion._run_batch
    monkeypatch.setattr(LoadedVersion, "_run_batch", lambda self, prepared: run_batch(self, prepared).astype(object))
    ok, failed = (VERSION_REQUESTS.labels("colour", "test", "live", outcome) for outcome in ("ok", "failed"))
    before = (ok._value.get(), failed._value.get())
    with pytest.raises(InferenceFailed, match="not numbers"):
        infer(link.worker, [image_bytes(RED)])
    wait_until(lambda: failed._value.get() == before[1] + 1)  # counted as the loop's turn ends
    assert ok._value.get() == before[0]


def test_the_loop_s_wait_for_more_ends_once_its_shared_connections_sent_what_they_can(
        link: Link, model: ColourModel, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(link.server, "_loop_batch_s", 1.0)  # "short", however busy the machine running the test
    (first, first_answers), (second, second_answers) = _shared_connection(link), _shared_connection(link)
    with first, second:
        _sent_together(first, [1, 2], image_bytes(RED))  # each has had two requests under way at once
        _sent_together(second, [1, 2], image_bytes(RED))
        assert sorted(_answered(first_answers, 2)) == [1, 2] and sorted(_answered(second_answers, 2)) == [1, 2]
        _as_if_busy(link.server, monkeypatch, wait_s=5.0)
        monkeypatch.setattr(link.server, "_requesting", link.server._requesting - 8)  # these two connections alone
        link.server.gathering.arrival_gap_s = 2.5  # a wait of 5 s for the two the second connection can send
        waited = _waits(link.server, monkeypatch)
        started = time.monotonic()
        _sent_together(first, [3, 4], image_bytes(RED))
        wait_until(lambda: len(link.server._turn) == 2)  # read: the loop waits for the second connection's
        _sent_together(second, [3, 4], image_bytes(RED))
        assert sorted(_answered(first_answers, 2)) == [3, 4] and sorted(_answered(second_answers, 2)) == [3, 4]
        assert time.monotonic() - started < 2.5  # the wait ended as they came, not at its 5 s
        assert waited[-1] and model.batch_sizes[-1] == 4  # one batch of the four


def test_the_loop_s_wait_for_more_ends_with_a_batch_of_the_cap_though_a_connection_could_still_send(
        link: Link, model: ColourModel, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the wait ended early only while no connection of one exchange at a time could send, and an HTTP worker
    # keeps one idle in its pool: a turn holding a full batch waited its whole time.
    monkeypatch.setattr(link.server, "_loop_batch_s", 1.0)  # "short", however busy the machine running the test
    _idle_connections(link, 1)  # idle, having carried a request: another may come on it
    shared, answers = _shared_connection(link)
    with shared:
        _sent_together(shared, [1, 2, 3, 4], image_bytes(RED))  # it has had four under way at once
        assert sorted(_answered(answers, 4)) == [1, 2, 3, 4]
        _as_if_busy(link.server, monkeypatch, wait_s=5.0)
        monkeypatch.setattr(link.server, "_requesting", link.server._requesting - 8)  # the real connections alone
        link.server.gathering.batch_cap = 4
        link.server.gathering.arrival_gap_s = 2.5  # a wait of 5 s for the three more a batch of the cap needs
        waited = _waits(link.server, monkeypatch)
        started = time.monotonic()
        _sent_together(shared, [5], image_bytes(RED))
        wait_until(lambda: len(link.server._turn) == 1)  # read: the loop waits for more
        _sent_together(shared, [6, 7, 8], image_bytes(RED))  # a batch of the cap
        assert sorted(_answered(answers, 4)) == [5, 6, 7, 8]
        assert time.monotonic() - started < 2.5  # the wait ended with the batch, not at its 5 s
        assert waited[-1] and model.batch_sizes[-1] == 4


def test_a_connection_that_carried_only_state_queries_and_catalog_calls_is_not_waited_for(
        link: Link, model: ColourModel, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: every idle connection counted as a request that could still come, and an HTTP worker's pooled one (its
    # state queries, signatures) never sends one: the wait went on after the shared connection sent all it could.
    monkeypatch.setattr(link.server, "_loop_batch_s", 1.0)  # "short", however busy the machine running the test
    assert link.worker._engine_state(fresh=True).ready  # the worker's readiness query...
    assert len(link.worker.connections._idle) == 1  # ... leaves its connection idle in the pool
    shared, answers = _shared_connection(link)
    with shared:
        _sent_together(shared, [1, 2], image_bytes(RED))  # it has had two under way at once
        assert sorted(_answered(answers, 2)) == [1, 2]
        _as_if_busy(link.server, monkeypatch, wait_s=10.0)
        monkeypatch.setattr(link.server, "_requesting", link.server._requesting - 8)  # the real connections alone
        link.server.gathering.arrival_gap_s = 5.0  # a wait of 5 s for the one more it can send
        waited = _waits(link.server, monkeypatch)
        started = time.monotonic()
        _sent_together(shared, [3], image_bytes(RED))
        wait_until(lambda: len(link.server._turn) == 1)  # read: the loop waits for more
        _sent_together(shared, [4], image_bytes(RED))  # all it can send
        assert sorted(_answered(answers, 2)) == [3, 4]
        assert time.monotonic() - started < 2.5  # the wait ended as it came, not at its 5 s or 10 s
        assert waited[-1] and model.batch_sizes[-1] == 2


def test_connections_whose_catalog_call_runs_are_not_waited_for(link: Link, monkeypatch: pytest.MonkeyPatch) -> None:
    red = torch.zeros(3, 8, 8)
    red[0] = 1.0
    assert link.worker.catalog.default_model() == "colour"  # a catalog call made on a thread and answered
    assert link.server._calls_off_loop == 0
    infer(link.worker, tensors=[red.numpy()])
    _as_if_busy(link.server, monkeypatch, wait_s=0.05)  # eight more connections, open and idle...
    monkeypatch.setattr(link.server, "_calls_off_loop", 8)  # ... as if each waited on a catalog call
    waited = _waits(link.server, monkeypatch, on_loop=True)
    infer(link.worker, tensors=[red.numpy()])
    assert waited == [False]


def test_the_loop_waits_only_while_its_turns_batches_run_on_it(link: Link, monkeypatch: pytest.MonkeyPatch) -> None:
    red = torch.zeros(3, 8, 8)
    red[0] = 1.0
    infer(link.worker, tensors=[red.numpy()])
    monkeypatch.setattr(link.server, "_loop_batch_s", -1.0)  # as on a GPU: the batcher's thread runs them all
    _as_if_busy(link.server, monkeypatch, wait_s=0.05)
    waited = _waits(link.server, monkeypatch)
    for _ in range(3):
        infer(link.worker, tensors=[red.numpy()])
    assert waited == [True, False, False]  # the first turn after _as_if_busy; then its batches ran on the thread


def test_the_loop_stops_waiting_once_its_turns_photos_go_to_the_batcher_s_thread_after_a_batch_ran_on_it(
        link: Link, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: only a turn that queued on the loop told whether its batches ran there, so after a batch run on the
    # loop every later turn whose photos were decoded (and batched) on other threads still waited for more.
    monkeypatch.setattr(link.server.decode_shares, "here", lambda requests: False)  # photos: the decode threads'
    monkeypatch.setattr(link.server.decode_shares, "probe", lambda requests, now: None)
    infer(link.worker, [image_bytes(RED)])
    _as_if_busy(link.server, monkeypatch, wait_s=0.05)  # as if the turn before ran its batches on the loop
    waited = _waits(link.server, monkeypatch)
    for _ in range(3):
        infer(link.worker, [image_bytes(RED)])
    assert waited == [True, False, False]  # the first turn after _as_if_busy; then its batches ran on the thread
    assert not link.server.gathering.batches_on_loop


@pytest.mark.slow  # the loop's wait lasts up to four seconds
def test_answers_go_out_while_the_loop_waits_for_more_requests(link: Link, model: ColourModel,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    red = torch.zeros(3, 8, 8)
    red[0] = 1.0
    infer(link.worker, tensors=[red.numpy()])
    monkeypatch.setattr(link.server, "_loop_batch_s", -1.0)  # the held batch on the batcher's thread
    model.gate = threading.Event()
    still_read: dict[str, int] = {}  # requests read and not yet run when each answer came

    def request(name: str) -> None:
        infer(link.worker, tensors=[red.numpy()])
        still_read[name] = len(link.server._turn)

    held = threading.Thread(target=request, args=("held",))
    held.start()
    wait_until(lambda: link.engine.in_flight.count() == 1)
    _as_if_busy(link.server, monkeypatch, wait_s=4.0)  # (2 s was once too short to be seen in a busy suite run)
    waiting = threading.Thread(target=request, args=("waiting",))  # the loop reads it, then waits for more
    waiting.start()
    wait_until(lambda: len(link.server._turn) == 1)  # read (not yet admitted): the loop waits for more
    model.gate.set()  # the held batch ends: its answer is posted to the loop, which is waiting
    for thread in (held, waiting):
        thread.join(10)
    assert still_read == {"held": 1, "waiting": 0}  # the held answer left while the loop still waited


@pytest.mark.slow  # the loop's wait lasts two seconds
def test_a_client_that_hangs_up_while_the_loop_waits_is_counted_gone_and_nothing_runs(
        link: Link, model: ColourModel, monkeypatch: pytest.MonkeyPatch) -> None:
    red = torch.zeros(3, 8, 8)
    red[0] = 1.0
    infer(link.worker, tensors=[red.numpy()])
    gone, failures = threading.Event(), []

    def request() -> None:
        try:
            infer(link.worker, tensors=[red.numpy()], client_gone=gone.is_set)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            failures.append(exc)

    batches = len(model.batch_sizes)
    _as_if_busy(link.server, monkeypatch, wait_s=2.0)
    thread = threading.Thread(target=request)
    thread.start()
    wait_until(lambda: len(link.server._turn) == 1)  # read (not yet admitted): the loop waits for more
    gone.set()  # the HTTP side closes the connection while the loop waits
    thread.join(10)
    assert isinstance(failures[0], ClientGone)
    wait_until(lambda: link.server._turn == [] and link.engine.in_flight.count() == 0)
    assert len(model.batch_sizes) == batches  # admitted and ended as gone when the wait ended: never run


# -- requests on an HTTP worker's loop: one shared connection, several requests a message -------------------------

def _outcome(run: Callable[[], object]) -> object:
    """What ``run`` returned, or the exception it raised."""
    try:
        return run()
    except BaseException as exc:  # noqa: BLE001 - the test reads it
        return exc


def _on_loop(link: Link, requests: dict[str, Callable[[], object]],
             loop: LoopWorker | None = None) -> dict[str, object]:
    """``requests`` run as an HTTP worker's loop requests (their waits the loop's, their engine requests on the
    worker's loop link), the loop turned until all ended; what each returned or raised."""
    loop = loop or LoopWorker()
    with loop.waits():
        for name, run in requests.items():
            loop.start(name, functools.partial(_outcome, run))
        loop.turn_until(lambda: all(name in loop.outcomes for name in requests))
    return {name: loop.outcomes[name].result() for name in requests}


def _labelled(link: Link, image: bytes, **kwargs: object) -> Callable[[], str]:
    """A request of ``image``, returning its top label."""
    return lambda: infer(link.worker, [image], **kwargs).top_k(1)[0][0].label  # type: ignore[arg-type]


def test_the_requests_of_a_loop_turn_reach_the_engine_as_one_message_and_come_back_each_with_its_own_answer(
        link: Link) -> None:
    infer(link.worker, [image_bytes(RED)])  # the signature kept: the loop's requests all send in its first turn
    link.frames.clear()
    colours = {f"r{i}": (RED, BLUE)[i % 2] for i in range(6)}
    loop = LoopWorker()
    got = _on_loop(link, {name: _labelled(link, image_bytes(colour)) for name, colour in colours.items()}, loop)
    assert got == {name: ("red" if colour == RED else "blue") for name, colour in colours.items()}
    assert link.frames.count("Infers") == 1 and "Infer" not in link.frames  # one message for the six
    [message] = [m for m in link.sent if isinstance(m, wire.Infers)]
    assert len(message.ids) == 6 and sum(message.counts) == 6
    assert 1 <= link.frames.count("Answers") <= 6 and link.worker.loop_link.in_flight == 0
    wait_until(lambda: link.engine.in_flight.count() == 0)
    # the next turn's requests go on the same connection
    connections = len(link.connections)
    assert _on_loop(link, {"again": _labelled(link, image_bytes(BLUE))}, loop)["again"] == "blue"
    assert len(link.connections) == connections


def test_a_loop_request_is_answered_504_at_its_own_deadline_which_counts_from_when_its_worker_had_it(
        link: Link) -> None:
    # Before: the engine's deadline, counted from its receipt, was the request's: one that waited in its worker was
    # answered (200 or 504) that wait past its deadline (a 500 ms one's 200s at 0.74 s on the 2-core VM).
    assert infer(link.worker, [image_bytes(RED)]).model == "colour"
    link.engine.loaded_version().predictor.module.delay_s = 2.0  # its batch outlasts what is left of the deadline
    link.frames.clear()
    started = time.monotonic()
    got = _on_loop(link, {"late": lambda: infer(link.worker, [image_bytes(RED)], timeout_s=2.0,
                                                arrived=started - 1.8)})["late"]
    assert isinstance(got, DeadlineExceeded) and str(got) == "no inference result within the request's 2s deadline"
    # at its deadline (0.2 s from now), not the engine's (2 s from its receipt, never sooner): the margin a loaded
    # host's stall needs (0.6 s of it failed once in the fast subset beside a training run, 1.2 s once beside the
    # whole suite)
    assert time.monotonic() - started < 1.9
    # ended by the worker's Cancel at the deadline, or, on a loaded host, by the engine's own 504 first (it counts
    # the same deadline, from when the worker had the request: failed once beside the whole suite, "Answers" alone)
    assert "Cancel" in link.frames or "Answers" in link.frames, link.frames
    link.engine.loaded_version().predictor.module.delay_s = 0.0


@pytest.mark.parametrize("on_loop", [True, False])
def test_the_engine_judges_a_request_s_room_by_what_is_left_of_its_deadline_since_its_worker_had_it(
        link: Link, on_loop: bool) -> None:
    # Before: the engine counted the whole deadline from its receipt: a request with 0.3 s left of its 1 s, behind
    # nothing but its own 0.6 s batch, was admitted and run, and its worker's 504 cut it at its deadline (under
    # ENGINE=process some admitted requests ran out of time; the engine never judged what was left). On a request
    # thread (its own connection) too.
    module = link.engine.loaded_version().predictor.module
    module.delay_s = 0.6
    try:
        assert infer(link.worker, [image_bytes(RED)]).model == "colour"  # a batch timed: 0.6 s an image
        batches = link.engine.loaded_version().batcher.batches_run
        link.sent.clear()

        def late() -> object:
            return infer(link.worker, [image_bytes(RED)], timeout_s=1.0, arrived=time.monotonic() - 0.7)

        got = _on_loop(link, {"late": late})["late"] if on_loop else _failure(late)
    finally:
        module.delay_s = 0.0
    assert isinstance(got, ServiceError) and got.status == 429 and got.code == "deadline_unreachable", got
    assert "less than their own inference" in got.message
    assert link.engine.loaded_version().batcher.batches_run == batches
    [spent] = [sent.spent[0] if on_loop else sent.spent_s for sent in link.sent
               if isinstance(sent, wire.Infers if on_loop else wire.Infer)]
    assert 0.7 <= spent < 1.0  # its time in its worker, as it was sent


def test_a_bundle_counts_its_deadline_from_its_latest_request_and_each_run_apart_from_its_own(link: Link) -> None:
    # Before (a bundle counted from its earliest request): one request that had spent its deadline in its worker
    # took its alike fresh ones down with it (429 "0.69 ms was left", or all four 504).
    infer(link.worker, [image_bytes(RED)])  # a batch timed
    conn, reader = _shared_connection(link)
    with conn:
        for stale in (4.999, 5.01):  # of a 5 s deadline: nearly spent, or spent
            wire.send(conn, *wire.infers([(ident, _ONE_PIXELS, [_one_colour(0)]) for ident in range(1, 5)],
                                         spent=(stale, 0.0, 0.0, 0.0)))
            answers = _answers_by_id(reader, 4)
            assert [answers[ident].error for ident in (2, 3, 4)] == [None] * 3  # the fresh ones answered
            assert all(answers[ident].value.rows.argmax() == 0 for ident in (2, 3, 4))


def test_a_cancel_of_a_request_whose_deadline_passed_at_its_worker_counts_as_its_deadline_not_a_hang_up(
        link: Link, model: ColourModel, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: whichever came first, the engine's own deadline (504: the version's failure, as a worker without an
    # engine counts it) or the worker's cancel at the same deadline (a hang-up: refused), counted the request.
    first = _queued_behind_a_held_batch(link, model, monkeypatch)
    conn, reader = _shared_connection(link)
    try:
        with conn:
            for ident, late in ((1, ()), (2, (2,))):  # a client gone, then a deadline passed
                before = _outcome_counts(link)
                wire.send(conn, *wire.infers([(ident, _ONE_PIXELS, [_one_colour(0)])]))
                wait_until(lambda: link.engine.loaded_version().batcher._live == 1)  # queued behind the held batch
                # (its backlog: the queue's length counts the one cancelled before until a batch takes it)
                wire.send(conn, wire.Cancel((ident,), late))
                outcome = "failed" if late else "refused"
                wait_until(lambda: _outcome_counts(link)[outcome] == before[outcome] + 1)
                assert link.engine.loaded_version().batcher._live == 0  # dropped: no backlog, never run
    finally:
        model.gate.set()
        first.join(10)


def _padded(jpeg: bytes, size: int = 40_000) -> bytes:
    """``jpeg`` padded with comment segments to about ``size`` bytes: a photo's size, its pixels ``jpeg``'s."""
    comments = []
    for at in range(0, size - len(jpeg), 60_000):
        length = min(60_000, size - len(jpeg) - at)
        comments.append(b"\xff\xfe" + (length + 2).to_bytes(2, "big") + bytes(length))
    return jpeg[:2] + b"".join(comments) + jpeg[2:]


def test_a_loop_turn_s_photos_cross_in_the_link_s_arena_whose_places_the_engine_s_releases_free(link: Link) -> None:
    infer(link.worker, [image_bytes(RED)])  # the signature kept: the loop's requests all send in its first turn
    link.sent.clear()
    colours = {f"r{i}": (RED, BLUE)[i % 2] for i in range(4)}
    loop = LoopWorker()
    got = _on_loop(link, {name: _labelled(link, _padded(image_bytes(colour))) for name, colour in colours.items()},
                   loop)
    assert got == {name: ("red" if colour == RED else "blue") for name, colour in colours.items()}
    [message] = [m for m in link.sent if isinstance(m, wire.Infers)]
    assert [index for index, _ in message.placed] == [0, 1, 2, 3] and message.counts == (0, 0, 0, 0)
    arena = link.worker.loop_link._arena
    assert arena is not None and arena.placed_bytes >= 4 * 39_000
    with loop.waits():  # all let go of: all free, told with the answers or just after them
        loop.turn_until(lambda: arena.held == 0)
    assert sorted(i for m in link.sent if isinstance(m, wire.Answers) for i in m.released) == sorted(message.ids)
    # small images go in the frame, as before
    assert _on_loop(link, {"small": _labelled(link, image_bytes(BLUE))}, loop)["small"] == "blue"
    assert [m for m in link.sent if isinstance(m, wire.Infers)][-1].placed == ()


def test_an_empty_image_placed_beside_a_photo_is_its_own_request_s_400_and_the_turn_s_others_are_answered(
        link: Link) -> None:
    infer(link.worker, [image_bytes(RED)])
    got = _on_loop(link, {"empty": lambda: infer(link.worker, [_padded(image_bytes(RED)), b""]),
                          "other": _labelled(link, _padded(image_bytes(BLUE)))})
    assert isinstance(got["empty"], InvalidImage) and "image 1" in got["empty"].message
    assert got["other"] == "blue"
    [message] = [m for m in link.sent if isinstance(m, wire.Infers)]
    assert [index for index, _ in message.placed] == [0, 1]


def _memfds_open(name: str) -> int:
    """Descriptors of this process open on memfds named ``name``."""
    return sum(1 for fd in Path("/proc/self/fd").iterdir()
               if os.path.exists(fd) and os.readlink(fd).startswith(f"/memfd:{name}"))


def test_an_engine_keeps_no_descriptor_passed_after_a_connection_s_first_message(link: Link) -> None:
    conn, reader = _shared_connection(link)
    try:
        _sent_together(conn, [1], image_bytes(RED))  # its first message: no arena offered
        assert _answered(reader, 1) == [1]
        for _ in range(3):  # descriptors passed with later messages: none kept by the engine
            probe = os.memfd_create("visionserve-test-probe")
            socket.send_fds(conn, [wire.frame(wire.Cancel((99,)))], [probe])
            os.close(probe)
        _sent_together(conn, [2], image_bytes(BLUE))
        assert _answered(reader, 1, red=False) == [2]
        assert _memfds_open("visionserve-test-probe") == 0
    finally:
        conn.close()


def test_with_no_arena_asked_for_a_loop_turn_s_photos_go_in_its_frame(link: Link) -> None:
    link.worker.settings = link.worker.settings.model_copy(update={"link_arena_mb": 0})
    infer(link.worker, [image_bytes(RED)])
    got = _on_loop(link, {"photo": _labelled(link, _padded(image_bytes(BLUE)))})
    assert got == {"photo": "blue"}
    [message] = [m for m in link.sent if isinstance(m, wire.Infers)]
    assert message.placed == () and message.counts == (1,) and link.worker.loop_link._arena is None


def test_images_placed_outside_the_arena_close_the_link_s_connection_its_requests_fail_503_and_it_connects_again(
        link: Link, monkeypatch: pytest.MonkeyPatch) -> None:
    infer(link.worker, [image_bytes(RED)])
    real = Arena.place
    monkeypatch.setattr(Arena, "place", lambda arena, ident, segments: ((arena.size - 10, 1000),))
    loop = LoopWorker()
    failed = _on_loop(link, {"photo": _labelled(link, _padded(image_bytes(RED)))}, loop)["photo"]
    assert isinstance(failed, NotReady) and failed.headers["Retry-After"] == "5"
    monkeypatch.setattr(Arena, "place", real)
    connections = len(link.connections)
    assert _on_loop(link, {"after": _labelled(link, _padded(image_bytes(BLUE)))}, loop)["after"] == "blue"
    assert len(link.connections) == connections + 1
    wait_until(lambda: link.engine.in_flight.count() == 0)


def test_a_turn_s_requests_for_several_versions_are_admitted_by_kind_and_each_answered_by_its_own(
        settings: Settings, tmp_path: Path) -> None:
    repository = FakeRepository()
    for version in ("1", "2"):
        repository.add("colour", version)
    service = Service.build(settings.model_copy(update={"version_policy": "latest:2"}), repository)  # type: ignore
    link = Link(settings.model_copy(update={"control_dir": tmp_path / "control"}), service).start()
    try:
        conn, reader = _shared_connection(link)
        wanted = {1: "1", 2: None, 3: "9", 4: "1", 5: None, 6: "2"}  # one message: one turn, alike ones apart
        wire.send(conn, *wire.infers([(ident, wire.Infer("colour", version, None, 5.0, "2", (3, 8, 8), names=(None,)),
                                       [image_bytes(RED)]) for ident, version in wanted.items()]))
        answers: dict[int, wire.Answer] = {}
        while len(answers) < len(wanted):
            for message, _ in reader.read():
                answers.update(zip(message.ids, message.answers))
        assert {ident: answer.value.version for ident, answer in answers.items() if answer.error is None} == {
            1: "1", 2: "2", 4: "1", 5: "2", 6: "2"}
        assert isinstance(answers[3].error, NotFound)
        wait_until(lambda: service.in_flight.count() == 0)
    finally:
        link.server.stop(5)  # as at a SIGTERM: the counts its loop holds written too


def test_a_fault_counting_a_turn_s_ends_is_logged_and_lets_go_of_what_they_held_and_the_loop_serves_on(
        link: Link, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    conn, reader = _shared_connection(link)
    count, broken = link.engine._count, [True]
    monkeypatch.setattr(link.engine, "_count", lambda *args: 1 / 0 if broken[0] else count(*args))
    with caplog.at_level(logging.ERROR, logger="app.link.loop"):
        _sent_together(conn, [1, 2, 3], image_bytes(RED))
        assert sorted(_answered(reader, 3)) == [1, 2, 3]
        wait_until(lambda: link.engine.in_flight.count() == 0)
    assert link.engine.loaded_version().in_use.count() == 0
    assert any("counting the ends of" in record.getMessage() for record in caplog.records)
    broken[0] = False
    _sent_together(conn, [4], image_bytes(RED))
    assert _answered(reader, 1) == [4]


def test_requests_of_a_shared_connection_closed_as_the_turn_s_answers_go_out_let_go_of_what_they_hold_at_once(
        link: Link, model: ColourModel, monkeypatch: pytest.MonkeyPatch) -> None:
    first = _queued_behind_a_held_batch(link, model, monkeypatch)  # a batch held on the batcher's thread
    loaded = link.engine.loaded_version()
    conn, _ = _shared_connection(link)
    try:
        wire.send(conn, *wire.infers([(2, wire.Infer("colour", None, None, 30.0, "1", (3, 8, 8), names=(None,)),
                                       [image_bytes(RED)])]))
        wait_until(lambda: loaded.batcher.depth == 1)  # queued behind the held batch
        conn.shutdown(socket.SHUT_RD)  # the worker reads no more: the engine's next write on it fails
        wire.send(conn, *wire.infers([(1, wire.Infer("colour", None, None, 30.0, "1", (3, 8, 8), names=(None,)),
                                       [b"not an image"])]))  # refused at once: its answer's write fails
        # the engine closes the connection as it writes, which hangs up request 2: it leaves then, not at the next
        # wake-up of the loop (here, the held batch's end)
        wait_until(lambda: link.engine.in_flight.count() == 1 and loaded.in_use.count() == 1, timeout=5)
    finally:
        model.gate.set()
        first.join(10)


def test_a_request_refused_as_it_is_queued_is_no_longer_on_its_way_and_the_turn_s_batch_still_runs_on_the_loop(
        link: Link) -> None:
    conn, reader = _shared_connection(link)
    batcher = link.engine.loaded_version().batcher
    red = np.zeros((1, 3, 8, 8), "<f4")
    red[0, 0] = 1.0

    def turn(refused: bool) -> int:
        """Batches run on the loop in a turn of one red image's pixels (and one request of none, ``refused``)."""
        requests = [(1, wire.Infer("colour", None, None, 5.0, "1", (3, 8, 8), names=(None,),
                                   tensors=(("<f4", (1, 3, 8, 8)),)), [red.tobytes()])]
        if refused:  # no rows: refused (400) as it is queued, before its images would have arrived
            requests.append((2, wire.Infer("colour", None, None, 5.0, "1", (3, 8, 8), tensors=(("<f4", (0, 3, 8, 8)),)),
                             [b""]))
        before = batcher.batches_inline
        wire.send(conn, *wire.infers(requests))
        answers: dict[int, wire.Answer] = {}
        while len(answers) < len(requests):
            for message, _ in reader.read():
                answers.update(zip(message.ids, message.answers))
        assert answers[1].error is None and (not refused or isinstance(answers[2].error, BadRequest))
        return batcher.batches_inline - before

    for _ in range(5):
        turn(False)  # batches measured: the loop runs them
    assert [turn(refused) for refused in (True, False, True, True)] == [1, 1, 1, 1]


def test_a_request_whose_fields_do_not_hash_or_have_no_truth_value_is_admitted_alone_and_the_loop_serves_on(
        link: Link) -> None:
    conn, reader = _shared_connection(link)
    conn.settimeout(10)  # (a loop that ended would answer nothing)
    no_truth = wire.Infer("colour", None, None, 5.0, "1", (3, 8, 8), names=(None,), tensors=np.array([1, 2]))
    wire.send(conn, *wire.infers([(ident, wire.Infer("colour", None, key, 5.0, "1", (3, 8, 8), names=(None,)),
                                   [image_bytes(RED)]) for ident, key in ((1, ["k"]), (2, None))]
                                 + [(3, no_truth, [b"x"])]))  # type: ignore[arg-type]
    answers: dict[int, wire.Answer] = {}
    while len(answers) < 3:
        for message, _ in reader.read():
            answers.update(zip(message.ids, message.answers))
    assert answers[1].error is None and answers[2].error is None  # (no rollout reads the client's key here)
    assert answers[3].error is not None  # its tensors' checks refuse it
    _sent_together(conn, [3], image_bytes(RED))
    assert _answered(reader, 1) == [3]


def test_a_loop_turn_s_requests_beyond_one_frame_s_segments_go_in_as_many_messages_as_they_need(
        link: Link, monkeypatch: pytest.MonkeyPatch) -> None:
    infer(link.worker, [image_bytes(RED)])
    monkeypatch.setattr(wire, "MAX_SEGMENTS", 3)  # (the engine's reads bound frames by it too)
    link.frames.clear()
    got = _on_loop(link, {f"r{i}": _labelled(link, image_bytes(RED)) for i in range(5)}
                   | {"two": lambda: infer(link.worker, [image_bytes(BLUE)] * 2).rows.argmax(axis=1).tolist()})
    assert got == {**{f"r{i}": "red" for i in range(5)}, "two": [2, 2]}
    counts = [message.counts for message in link.sent if isinstance(message, wire.Infers)]
    assert counts == [(1, 1, 1), (1, 1), (2,)]  # in order, none over 3 segments


def test_a_link_broken_while_a_send_waits_for_room_ends_that_send_and_leaves_the_next_connection_be() -> None:
    from app.link.loop_link import LoopLink

    engine_ends: list[socket.socket] = []

    def connect() -> socket.socket:  # an engine that reads nothing on the first connection, answers on the next
        ours, theirs = _pair()
        ours.setblocking(False)
        engine_ends.append(theirs)
        return ours

    def answer_one(conn: socket.socket) -> None:
        reader = wire.FrameReader(conn, (wire.Infers,))
        got: list[tuple[object, list[bytearray]]] = []
        while not got:
            got = reader.read()
        [(message, _)] = got
        rows = np.zeros((1, 4), np.float32)
        served = contract.Served(rows, (contract.BatchRun(1, 1, 4, 0.0, 0.0),), "colour", "1", wire.NO_LABELS, 0.0)
        wire.send(conn, wire.Answers(message.ids, (wire.Answer(served, None, 1, 0),)))  # type: ignore[attr-defined]

    link, loop = LoopLink(connect), LoopWorker()
    message = wire.Infer("colour", None, None, 5.0, "1", (3, 8, 8), names=(None,))
    with loop.waits():
        loop.start("big", functools.partial(_outcome, lambda: link.ask(loop.worker, message, [b"x" * (16 << 20)],
                                                                        30.0, None)))
        loop.turn_until(lambda: link._sending and len(loop.worker.poller.get_map()) == 2)  # its send waits for room
        started = time.monotonic()
        engine_ends[0].sendall(wire._HEAD.pack(8, wire.MAX_SEGMENTS + 1))  # a frame that cannot be: the link breaks
        loop.turn_until(lambda: "big" in loop.outcomes)  # while the send waits for room the engine never makes
        assert isinstance(loop.outcomes["big"].result(), wire.EngineGone) and time.monotonic() - started < 5
        loop.start("next", functools.partial(_outcome, lambda: link.ask(loop.worker, message, [b"y"], 30.0, None)))
        engine = threading.Thread(target=answer_one, args=(engine_ends[1],))
        engine.start()
        loop.turn_until(lambda: "next" in loop.outcomes)
        engine.join(10)
    assert isinstance(loop.outcomes["next"].result(), wire.Answer) and link.in_flight == 0
    assert link._conn is not None and link._conn.fileno() >= 0  # the new connection stands
    for conn in engine_ends:
        conn.close()


def _batches_off_the_loop(link: Link, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's batches on the batcher's thread, as on a GPU: a batch held by the gate leaves its loop free."""
    monkeypatch.setattr(link.server, "_loop_batch_s", 0.0)


def test_a_loop_request_whose_client_leaves_is_cancelled_in_the_engine_and_the_others_are_answered(
        link: Link, model: ColourModel, monkeypatch: pytest.MonkeyPatch) -> None:
    _batches_off_the_loop(link, monkeypatch)
    infer(link.worker, [image_bytes(RED)])
    model.gate, batches, gone = threading.Event(), len(model.batch_sizes), threading.Event()
    loop = LoopWorker()
    requests = {"stays": _labelled(link, image_bytes(RED)),
                "leaves": _labelled(link, image_bytes(BLUE), client_gone=gone.is_set)}
    with loop.waits():
        for name, run in requests.items():
            loop.start(name, functools.partial(_outcome, run))
        loop.turn_until(lambda: len(model.batch_sizes) > batches)  # their forward pass runs, held by the gate
        gone.set()
        loop.turn_until(lambda: "leaves" in loop.outcomes)
        assert isinstance(loop.outcomes["leaves"].result(), ClientGone)
        assert any(isinstance(m, wire.Cancel) for m in link.sent)
        model.gate.set()
        loop.turn_until(lambda: "stays" in loop.outcomes)
    assert loop.outcomes["stays"].result() == "red"
    wait_until(lambda: link.engine.in_flight.count() == 0)  # the cancelled one ended in the engine too
    assert link.worker.loop_link.in_flight == 0


def _gated_loop(link: Link, model: ColourModel, monkeypatch: pytest.MonkeyPatch
               ) -> tuple[threading.Event, int, LoopWorker]:
    """A worker's loop for requests whose forward pass the model's gate holds (on the batcher's thread, the engine's
    loop free), the signature kept: the event that tells its clients they left, the batches run so far, the loop."""
    _batches_off_the_loop(link, monkeypatch)
    infer(link.worker, [image_bytes(RED)])
    model.gate = threading.Event()
    return threading.Event(), len(model.batch_sizes), LoopWorker()


def test_a_placed_photo_whose_request_is_cancelled_has_its_place_freed_with_no_answer_to_carry_its_release(
        link: Link, model: ColourModel, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the engine copied each placed photo out as it read the frame, and the worker freed a place only on an
    # answer to its request or a later one.
    gone, batches, loop = _gated_loop(link, model, monkeypatch)

    def messages() -> list[wire.Infers]:
        return [m for m in link.sent if isinstance(m, wire.Infers)]

    try:
        with loop.waits():  # placed in this order, each its message (a message's requests are let go of together):
            sent = len(messages())  # the one that leaves holds the ring's oldest place
            loop.start("leaves", lambda: _failure(lambda: infer(link.worker, [_padded(image_bytes(BLUE))],
                                                                 client_gone=gone.is_set)))
            loop.turn_until(lambda: len(model.batch_sizes) > batches)  # its forward pass held by the gate
            loop.start("stays", lambda: _labelled(link, _padded(image_bytes(RED)))())
            loop.turn_until(lambda: len(messages()) == sent + 2)
            arena = link.worker.loop_link._arena
            assert arena is not None and arena.placed_bytes >= 2 * 39_000 and arena.held == 2
            gone.set()
            loop.turn_until(lambda: "leaves" in loop.outcomes)
            loop.turn_until(lambda: arena.held == 1)  # the cancelled one let go of: told with no answer
            [leaves] = messages()[sent].ids
            assert [m.released for m in link.sent if isinstance(m, wire.Answers) and not m.ids] == [(leaves,)]
            model.gate.set()
            loop.turn_until(lambda: "stays" in loop.outcomes and arena.held == 0)
    finally:
        model.gate.set()
    assert isinstance(loop.outcomes["leaves"].result(), ClientGone) and loop.outcomes["stays"].result() == "red"
    wait_until(lambda: link.engine.in_flight.count() == 0)


@pytest.mark.parametrize("engine", ["link", "device_link"])
def test_a_placed_photo_the_engine_refuses_is_let_go_of_with_its_answer_without_a_garbage_collection(
        engine: str, request: pytest.FixtureRequest) -> None:
    # Before: the refusal's tracebacks held the frames that read the photo, and they the request, in a cycle: its
    # place (and the ring's after it) stayed held until a garbage collection came round.
    joined: Link = request.getfixturevalue(engine)
    infer(joined.worker, [image_bytes(RED)])
    broken = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00" + bytes(40_000)  # a JPEG's start, then nothing a decoder reads
    gc.collect()
    gc.disable()
    try:
        loop = LoopWorker()
        got = _on_loop(joined, {"broken": lambda: _failure(lambda: infer(joined.worker, [broken]))}, loop)
        assert isinstance(got["broken"], InvalidImage)
        arena = joined.worker.loop_link._arena
        assert arena is not None and arena.placed_bytes >= 40_000
        joined.sent.clear()  # (this test's record of the answers holds their errors)
        with loop.waits():
            loop.turn_until(lambda: arena.held == 0, timeout_s=5)
    finally:
        gc.enable()


def test_a_bundle_of_placed_photos_whose_clients_left_lets_go_of_them_while_an_earlier_request_still_runs(
        device_link: Link, model: ColourModel, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: an ended bundle's requests kept their photos until its deadline left the loop's heap, behind every
    # request of an earlier deadline still running, and the batcher's queue its cancelled items until it reached
    # them. (On the device path: photos decoded in their batch, one-image requests alike of a turn one bundle.)
    link = device_link
    gone, batches, loop = _gated_loop(link, model, monkeypatch)
    try:
        with loop.waits():
            loop.start("first", functools.partial(_outcome, lambda: infer(link.worker, [image_bytes(RED)])))
            loop.turn_until(lambda: len(model.batch_sizes) > batches)  # its batch held by the gate
            for name in ("b", "c"):  # one-image requests alike of one turn: a bundle
                loop.start(name, functools.partial(_outcome, lambda: infer(
                    link.worker, [_padded(image_bytes(BLUE))], client_gone=gone.is_set)))
            arena = link.worker.loop_link._arena
            loop.turn_until(lambda: arena is not None and arena.placed_bytes >= 2 * 39_000 and
                            link.engine.in_flight.count() == 3)
            gone.set()
            loop.turn_until(lambda: "b" in loop.outcomes and "c" in loop.outcomes)
            loop.turn_until(lambda: arena.held == 0)  # let go of while the first still runs
            assert "first" not in loop.outcomes
            model.gate.set()
            loop.turn_until(lambda: "first" in loop.outcomes)
    finally:
        model.gate.set()
    assert [type(loop.outcomes[name].result()) for name in ("b", "c")] == [ClientGone, ClientGone]
    assert loop.outcomes["first"].result().top_k(1)[0][0].label == "red"


def test_a_loop_request_cancelled_while_queued_is_dropped_unrun(link: Link, model: ColourModel,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    _batches_off_the_loop(link, monkeypatch)
    infer(link.worker, [image_bytes(RED)])
    model.gate, gone = threading.Event(), threading.Event()
    first = threading.Thread(target=lambda: _failure(lambda: infer(link.worker, [image_bytes(RED)])))
    batches = len(model.batch_sizes)
    first.start()  # on a connection of its own: its batch holds the batcher
    wait_until(lambda: len(model.batch_sizes) > batches)
    before, counted = _client_gone(), _outcome_counts(link)
    loop = LoopWorker()
    with loop.waits():
        loop.start("leaves", lambda: _failure(lambda: infer(link.worker, [image_bytes(BLUE)],
                                                             client_gone=gone.is_set)))
        loop.turn_until(lambda: link.engine.in_flight.count() == 2)  # queued behind the held batch
        gone.set()
        loop.turn_until(lambda: "leaves" in loop.outcomes)
    assert isinstance(loop.outcomes["leaves"].result(), ClientGone)
    wait_until(lambda: _client_gone() == before + 1)  # its queued image dropped
    wait_until(lambda: _outcome_counts(link)["refused"] == counted["refused"] + 1)  # its client's leaving (499)...
    assert _outcome_counts(link)["failed"] == counted["failed"]  # ...not the version's failure
    model.gate.set()
    first.join(10)
    wait_until(lambda: link.engine.in_flight.count() == 0)
    assert model.batch_sizes[-1] == 1 and len(model.batch_sizes) == batches + 1  # it never ran


def test_an_engine_gone_fails_every_request_of_the_loop_link_with_a_503_and_the_next_connects_again(
        link: Link, model: ColourModel, monkeypatch: pytest.MonkeyPatch) -> None:
    _batches_off_the_loop(link, monkeypatch)
    infer(link.worker, [image_bytes(RED)])
    model.gate, batches = threading.Event(), len(model.batch_sizes)
    loop = LoopWorker()
    requests = {f"r{i}": _labelled(link, image_bytes(RED)) for i in range(3)}
    with loop.waits():
        for name, run in requests.items():
            loop.start(name, functools.partial(_outcome, run))
        loop.turn_until(lambda: len(model.batch_sizes) > batches)
        link.connections[-1].shutdown(socket.SHUT_RDWR)  # the loop link's connection ends, as when the engine dies
        loop.turn_until(lambda: len(loop.outcomes) == 3)
    model.gate.set()
    wait_until(lambda: link.engine.in_flight.count() == 0)  # the engine ended them as its connection closed
    failures = [outcome.result() for outcome in loop.outcomes.values()]
    assert all(isinstance(f, NotReady) and f.headers["Retry-After"] == "5" and "restarting" in f.message
               for f in failures)
    assert link.worker.loop_link.in_flight == 0
    connections = len(link.connections)
    assert _on_loop(link, {"after": _labelled(link, image_bytes(BLUE))}, loop)["after"] == "blue"
    assert len(link.connections) == connections + 1  # made again


def test_a_loop_request_past_its_deadline_is_answered_504_through_the_shared_connection(
        link: Link, model: ColourModel, monkeypatch: pytest.MonkeyPatch) -> None:
    _batches_off_the_loop(link, monkeypatch)
    infer(link.worker, [image_bytes(RED)])
    model.gate = threading.Event()
    started = time.monotonic()
    got = _on_loop(link, {"late": lambda: infer(link.worker, [image_bytes(RED)], timeout_s=0.2)})
    model.gate.set()
    assert isinstance(got["late"], DeadlineExceeded) and got["late"].status == 504
    assert time.monotonic() - started < 3  # the engine's deadline, not the HTTP side's grace beyond it
    assert not any(isinstance(m, wire.Cancel) for m in link.sent)  # answered: nothing to cancel
    wait_until(lambda: link.engine.in_flight.count() == 0)


def test_answers_a_shared_connection_does_not_read_wait_for_room_while_the_loop_serves_the_others(
        link: Link, monkeypatch: pytest.MonkeyPatch) -> None:
    from app.link import loop

    monkeypatch.setattr(loop, "SHARED_SEND_BUFFER_BYTES", 4096)  # the least a socket takes: a few answers' worth
    (slow, slow_answers), (other, other_answers) = _shared_connection(link), _shared_connection(link)
    with slow, other:
        _sent_together(slow, range(1, 201), image_bytes(RED))  # 200 answers, far beyond its buffer; none read yet
        wait_until(lambda: any(conn.writes is not None for conn in link.server._shared))  # the rest waits for room
        _sent_together(other, [1], image_bytes(RED))
        assert _answered(other_answers, 1, red=False) == [1]  # the loop serves on (run, or refused: the queue
        # may still hold the slow connection's requests)
        # and the rest goes as it is read: each answered, run or refused by the queue (it holds a few here)
        assert sorted(_answered(slow_answers, 200, red=False)) == list(range(1, 201))
        wait_until(lambda: all(conn.writes is None and not conn.unsent for conn in link.server._shared))


def test_a_shared_connection_that_sends_a_request_of_its_own_is_closed_out_of_step(link: Link) -> None:
    conn, answers = _shared_connection(link)
    with conn:
        _sent_together(conn, [1], image_bytes(RED))
        assert _answered(answers, 1) == [1]
        wire.send(conn, wire.Infer("colour", None, None, 5.0, "1", (3, 8, 8), names=(None,)), [image_bytes(RED)])
        conn.settimeout(10)
        with pytest.raises(wire.EngineGone):
            while True:
                answers.read()


@pytest.mark.parametrize("message", [wire.Cancel(5), wire.Infers(5, (), ()),  # type: ignore[arg-type]
                                     wire.Infers((1,), ((1, 2),), (0,)), wire.CatalogCall([], (), {})])  # type: ignore
def test_a_message_whose_fields_are_not_of_their_types_closes_its_connection_not_the_loop(
        link: Link, message: object) -> None:
    # A frame that unpickles as a message, whose fields are of other types (ids that are no tuple, a method that
    # cannot be looked up): its handler's TypeError ended the engine's loop, and every worker's requests with it.
    conn, answers = _shared_connection(link)
    with conn:
        wire.send(conn, message)
        conn.settimeout(10)
        with pytest.raises(wire.EngineGone):
            while True:
                answers.read()
    other, other_answers = _shared_connection(link)  # the loop serves the others on
    with other:
        _sent_together(other, [1], image_bytes(RED))
        assert _answered(other_answers, 1) == [1]
    assert infer(link.worker, [image_bytes(RED)]).top_k(1)[0][0].label == "red"


class _FullListener:
    """The engine's listener as when the process has no file descriptor to spare: its first ``refusals`` accepts
    raise EMFILE; counted."""

    def __init__(self, listener: socket.socket, refusals: int) -> None:
        self.listener, self.refusals, self.accepts = listener, refusals, 0

    def fileno(self) -> int:
        return self.listener.fileno()

    def setblocking(self, flag: bool) -> None:
        self.listener.setblocking(flag)

    def accept(self) -> tuple[socket.socket, object]:
        self.accepts += 1
        if self.refusals:
            self.refusals -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return self.listener.accept()


def test_out_of_file_descriptors_the_loop_pauses_its_accepts_and_serves_on(
        settings: Settings, predictor: Predictor, caplog: pytest.LogCaptureFixture) -> None:
    # accept() raising EMFILE ended the engine's loop, and the engine with it: every worker's requests failed and
    # the models loaded again. The listener now rests ACCEPT_PAUSE_S (it stays readable: the loop would spin).
    service = Service.build(settings, predictor)
    folder = Path(tempfile.mkdtemp(prefix="vs-", dir="/tmp"))  # a socket path within its 108 bytes
    server = EngineServer(service, folder / "engine.sock")
    server.bind()
    full = server._listener = _FullListener(server._listener, refusals=2)  # type: ignore[assignment]
    threading.Thread(target=server.listen, daemon=True).start()
    try:
        with caplog.at_level("WARNING", logger="app.link.loop"):
            clients = [socket.socket(socket.AF_UNIX) for _ in range(3)]
            for client in clients:
                client.connect(str(folder / "engine.sock"))  # waits in the backlog while accepts rest
                client.settimeout(10)
                wire.say_hello(client)  # each taken and greeted once the accepts resume
                wire.send(client, wire.StateQuery())
                (answer, _), = wire.FrameReader(client, (wire.Answer,)).read()
                assert answer.value.ready
                client.close()
        assert [r for r in caplog.records if "cannot accept a connection" in r.getMessage()]
        assert full.accepts < 20  # rested between tries (the loop spinning on the readable listener made thousands)
    finally:
        server.stop(5)  # as at a SIGTERM: the counts its loop holds written too
        shutil.rmtree(folder, ignore_errors=True)  # (each run left its socket's folder in /tmp)


def test_the_engine_decodes_on_the_cores_its_container_may_use_or_the_setting_gives(
        settings: Settings, predictor: Predictor, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: one decode thread per core of the node the engine's affinity names (64 in a pod of a 4-CPU limit)
    import models.serving

    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("400000 100000\n")  # a Kubernetes limit of 4 CPUs
    monkeypatch.setattr(models.serving, "_CGROUP_CPU_MAX", cpu_max)
    monkeypatch.setattr(models.serving.os, "sched_getaffinity", lambda _: set(range(64)))
    server = EngineServer(Service.build(settings, predictor))
    try:
        assert server.decode_shares.threads == 4
    finally:
        server.stop(5)
    # where the container has no limit to read, the setting says (deploy/k8s: the pod's CPU request)
    cpu_max.write_text("max 100000\n")
    server = EngineServer(Service.build(settings.model_copy(update={"engine_decode_threads": 8}), predictor))
    try:
        assert server.decode_shares.threads == 8
    finally:
        server.stop(5)
