"""The shared memory a loop link's photos cross in (app/link/arena.py): the worker's ring, the engine's copies,
the descriptor passed with the offer, and the Infers that carry where the images are."""
from __future__ import annotations

import os
import socket
from typing import Iterator

import numpy as np
import pytest

from app.link import wire
from app.link.arena import PLACED_MIN_BYTES, Arena, ArenaError, MappedArena

KB = 1 << 10


def _image(size: int, fill: int) -> bytes:
    return bytes([fill]) * size


def _infer() -> wire.Infer:
    return wire.Infer("m", None, None, 5.0, "1", (3, 8, 8))


def _mapped(arena: Arena) -> MappedArena:
    """The engine's mapping of ``arena``, from a descriptor of its own (as SCM_RIGHTS hands one over)."""
    return MappedArena(os.dup(arena.fd), arena.size)


def test_the_ring_places_after_the_last_wraps_to_the_front_and_frees_what_an_answer_proves_read() -> None:
    arena = Arena(64 * KB)
    try:
        assert [arena.place(ident, [_image(20 * KB, ident)]) for ident in (1, 2, 3)] == [
            ((0, 20 * KB),), ((20 * KB, 20 * KB),), ((40 * KB, 20 * KB),)]
        assert arena.place(4, [_image(20 * KB, 4)]) is None  # 4 KB left at the end, the front still held
        arena.answered(2)  # an answer to 2: 1's frame and 2's were read
        assert arena.held == 1
        assert arena.place(4, [_image(20 * KB, 4)]) == ((0, 20 * KB),)  # wrapped to the front
        assert arena.place(5, [_image(20 * KB, 5)]) == ((20 * KB, 20 * KB),)  # up to 3's place
        assert arena.place(6, [_image(1 * KB, 6), _image(PLACED_MIN_BYTES, 6)]) is None  # full
        engine = _mapped(arena)
        try:  # what the engine copies is what was placed, wrapped or not
            assert engine.copied([(40 * KB, 20 * KB), (0, 20 * KB)]) == [bytearray(_image(20 * KB, 3)),
                                                                          bytearray(_image(20 * KB, 4))]
        finally:
            engine.close()
        arena.answered(5)
        assert arena.held == 0
        assert arena.place(7, [_image(30 * KB, 7), _image(30 * KB, 8)]) == ((0, 30 * KB), (30 * KB, 30 * KB))
        assert arena.placed_bytes == 5 * 20 * KB + 60 * KB
    finally:
        arena.close()


def test_small_requests_what_is_no_contiguous_buffer_and_what_exceeds_the_arena_are_left_to_the_socket() -> None:
    arena = Arena(64 * KB)
    try:
        assert arena.place(1, [_image(PLACED_MIN_BYTES - 1, 1)]) is None
        strided = np.zeros((128, 128), np.uint8)[:, ::2]  # 8 KB a view, not contiguous
        assert arena.place(2, [_image(PLACED_MIN_BYTES, 2), memoryview(strided)]) is None
        assert arena.place(3, [_image(65 * KB, 3)]) is None
        pixels = np.arange(8 * KB, dtype=np.float32)  # tensors' segments, as wire.tensor_segments gives them
        assert arena.place(4, [memoryview(pixels)]) == ((0, 32 * KB),)
        engine = _mapped(arena)
        try:
            [copied] = engine.copied([(0, 32 * KB)])
            assert np.array_equal(np.frombuffer(copied, np.float32), pixels)
        finally:
            engine.close()
        assert arena.held == 1
    finally:
        arena.close()


def test_the_engine_copies_nothing_outside_the_arena_and_maps_no_arena_larger_than_its_descriptor() -> None:
    arena = Arena(64 * KB)
    try:
        engine = _mapped(arena)
        try:
            for bad in ((60 * KB, 8 * KB), (-1, 10), (0, -1), (0, 64 * KB + 1), ("0", 10)):
                with pytest.raises(ArenaError):
                    engine.copied([bad])  # type: ignore[list-item]
            assert engine.copied([(64 * KB, 0)]) == [bytearray()]  # an empty image: the decode's to refuse
        finally:
            engine.close()
        with pytest.raises(ArenaError):
            MappedArena(os.dup(arena.fd), 128 * KB)
        with pytest.raises(OSError):  # sealed: it can never shrink under the engine's mapping
            os.ftruncate(arena.fd, 32 * KB)
    finally:
        arena.close()
    unsealed = os.memfd_create("unsealed")
    os.ftruncate(unsealed, 64 * KB)
    with pytest.raises(ArenaError, match="may shrink"):  # a read past a shrunk end would end the engine (SIGBUS)
        MappedArena(unsealed, 64 * KB)


@pytest.fixture
def offered() -> Iterator[tuple[socket.socket, socket.socket, Arena]]:
    """A worker's end and an engine's of one connection, and the arena the worker offered on it."""
    worker, engine = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    arena = Arena(64 * KB)
    try:
        wire.send_with_fd(worker, wire.ArenaOffer(arena.size), arena.fd)
        yield worker, engine, arena
    finally:
        arena.close()
        worker.close()
        engine.close()


def test_an_offer_passes_the_arena_s_descriptor_and_infers_carry_where_its_images_are(
        offered: tuple[socket.socket, socket.socket, Arena]) -> None:
    worker, engine, arena = offered
    photos = [_image(30 * KB, 1), _image(30 * KB, 2), _image(30 * KB, 3)]  # the third finds no room
    requests = [(ident, _infer(), [photo]) for ident, photo in zip((1, 2, 3), photos)]
    requests.append((4, _infer(), [b"small"]))
    message, segments = wire.infers(requests, arena)
    assert message.placed == ((0, ((0, 30 * KB),)), (1, ((30 * KB, 30 * KB),)))
    assert message.counts == (0, 0, 1, 1) and segments == [photos[2], b"small"]
    wire.send(worker, message, segments)
    reader = wire.FrameReader(engine, wire.REQUESTS, takes_fds=True)
    frames: list[tuple[object, list[bytearray]]] = []
    while len(frames) < 2:
        frames += reader.read()
    (offer, _), (read, read_segments) = frames
    assert offer == wire.ArenaOffer(64 * KB)
    fd = reader.take_fd()
    assert fd is not None and reader.take_fd() is None
    mapped = MappedArena(fd, offer.size)
    try:
        split = read.split(read_segments, mapped)
    finally:
        mapped.close()
    assert [(ident, [bytes(s) for s in its]) for ident, _, its in split] == [
        (1, [photos[0]]), (2, [photos[1]]), (3, [photos[2]]), (4, [b"small"])]
    with pytest.raises(wire.EngineGone):  # placed images on a connection that offered no arena
        read.split(read_segments)


def test_a_reader_closes_the_descriptors_passed_to_it_that_nobody_took(
        offered: tuple[socket.socket, socket.socket, Arena]) -> None:
    _, engine, _ = offered
    reader = wire.FrameReader(engine, wire.REQUESTS, takes_fds=True)
    assert [type(m) for m, _ in reader.read()] == [wire.ArenaOffer]
    [fd] = reader.fds
    reader.close_fds()
    assert reader.fds == []
    with pytest.raises(OSError):
        os.fstat(fd)
