"""The shared memory a loop link's photos cross in (app/link/arena.py): the worker's ring, the engine's views and
its releases, the descriptor passed with the offer, and the Infers that carry where the images are."""
from __future__ import annotations

import os
import socket
import threading
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


def test_the_ring_places_after_the_last_wraps_to_the_front_and_frees_from_the_oldest_what_the_engine_released(
        ) -> None:
    arena = Arena(64 * KB)
    try:
        assert [arena.place(ident, [_image(20 * KB, ident)]) for ident in (1, 2, 3)] == [
            ((0, 20 * KB),), ((20 * KB, 20 * KB),), ((40 * KB, 20 * KB),)]
        assert arena.place(4, [_image(20 * KB, 4)]) is None  # 4 KB left at the end, the front still held
        arena.released([2])  # 2 let go, 1 still read: nothing is free yet
        assert arena.held == 3 and arena.place(4, [_image(20 * KB, 4)]) is None
        arena.released([1])  # and then 1: both places free
        assert arena.held == 1
        assert arena.place(4, [_image(20 * KB, 4)]) == ((0, 20 * KB),)  # wrapped to the front
        assert arena.place(5, [_image(20 * KB, 5)]) == ((20 * KB, 20 * KB),)  # up to 3's place
        assert arena.place(6, [_image(1 * KB, 6), _image(PLACED_MIN_BYTES, 6)]) is None  # full
        engine = _mapped(arena)
        try:  # what the engine reads is what was placed, wrapped or not
            assert [bytes(view) for view in engine.lent([(9, [(40 * KB, 20 * KB), (0, 20 * KB)])])[0]] == [
                _image(20 * KB, 3), _image(20 * KB, 4)]
        finally:
            engine.close()
        arena.released([5, 3, 4])
        assert arena.held == 0
        assert arena.place(7, [_image(30 * KB, 7), _image(30 * KB, 8)]) == ((0, 30 * KB), (30 * KB, 30 * KB))
        assert arena.placed_bytes == 5 * 20 * KB + 60 * KB
    finally:
        arena.close()


def test_the_engine_reads_a_request_s_images_where_they_lie_and_releases_it_once_the_last_thing_made_on_them_goes(
        ) -> None:
    arena = Arena(64 * KB)
    try:
        first = arena.place(1, [_image(20 * KB, 1), _image(20 * KB, 2)])
        second = arena.place(2, [_image(20 * KB, 3)])
        assert first is not None and second is not None
        engine = _mapped(arena)
        try:
            [images] = engine.lent([(1, first)])
            [[alone]] = engine.lent([(2, second)])
            assert [bytes(image[:2]) for image in images] == [b"\x01\x01", b"\x02\x02"]
            arena._view[0] = 9  # (the worker's own map) nothing was copied: the engine's view is the arena
            assert images[0][0] == 9 and not images[0].readonly  # (a tensor may wrap it: nvJPEG's input)
            pixels = np.frombuffer(images[1], np.uint8)  # what a decode makes on a view holds it too
            del alone
            assert engine.take_released() == (2,)
            del images
            assert engine.take_released() == ()  # the array made on the second image still reads the arena
            del pixels
            assert engine.take_released() == (1,) and not engine.released
        finally:
            engine.close()
    finally:
        arena.close()


def test_a_message_s_requests_are_lent_together_and_released_together_once_every_view_of_them_all_is_gone(
        ) -> None:
    # One lending a message, not one a request (a weak reference, an array and a release each; the worker's ring
    # frees from the oldest place on all the same): the ring wrapped under them too.
    arena = Arena(64 * KB)
    try:
        first = arena.place(1, [_image(20 * KB, 1)])
        arena.place(2, [_image(20 * KB, 2)])
        arena.released([1])  # the front free: 4 wraps to it
        third, fourth = arena.place(3, [_image(20 * KB, 3)]), arena.place(4, [_image(20 * KB, 4)])
        assert first is not None and third == ((40 * KB, 20 * KB),) and fourth == ((0, 20 * KB),)
        engine = _mapped(arena)
        try:
            [[wrapped], [front]] = engine.lent([(3, third), (4, fourth)])
            assert (bytes(wrapped[:1]), bytes(front[:1])) == (b"\x03", b"\x04")
            del wrapped
            assert engine.take_released() == ()  # 4's view still reads the arena: neither is let go
            del front
            assert engine.take_released() == (3, 4)
            assert engine.lent([]) == [] and engine.take_released() == ()
        finally:
            engine.close()
        arena.released([3, 4])
        assert arena.held == 3  # 2's place, never lent, still held: theirs wait behind it
        arena.released([2])
        assert arena.held == 0
    finally:
        arena.close()


def test_a_request_id_lent_twice_is_released_twice_each_once_its_own_views_are_gone() -> None:
    # Before: the second lending replaced the first's reference, whose release was then never told (its place held
    # for good, and the ring's after it).
    arena = Arena(64 * KB)
    try:
        first, second = arena.place(1, [_image(20 * KB, 1)]), arena.place(1, [_image(20 * KB, 2)])
        engine = _mapped(arena)
        try:
            views, again = engine.lent([(1, first)]), engine.lent([(1, second)])  # type: ignore[list-item]
            del views
            assert engine.take_released() == (1,)
            del again
            assert engine.take_released() == (1,)
        finally:
            engine.close()
    finally:
        arena.close()


def test_requests_released_from_other_threads_while_the_loop_takes_them_are_each_told_once() -> None:
    arena = Arena(4 << 20)
    try:
        placed = [arena.place(ident, [_image(PLACED_MIN_BYTES, ident % 250)]) for ident in range(200)]
        engine = _mapped(arena)
        try:
            lent = [engine.lent([(ident, where)]) for ident, where in enumerate(placed)]  # type: ignore[list-item]
            taken: list[int] = []

            def drop(share: list[list[list[memoryview]]]) -> None:
                while share:
                    share.pop()

            shares = [lent[i::4] for i in range(4)]
            del lent
            threads = [threading.Thread(target=drop, args=(share,)) for share in shares]
            for thread in threads:
                thread.start()
            while any(thread.is_alive() for thread in threads):
                taken += engine.take_released()
            taken += engine.take_released()
            assert sorted(taken) == list(range(200))
        finally:
            engine.close()
        arena.released(taken)
        assert arena.held == 0
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
            [[lent]] = engine.lent([(4, [(0, 32 * KB)])])
            assert np.array_equal(np.frombuffer(lent, np.float32), pixels)
        finally:
            engine.close()
        assert arena.held == 1
    finally:
        arena.close()


def test_the_engine_lends_nothing_outside_the_arena_and_maps_no_arena_larger_than_its_descriptor() -> None:
    arena = Arena(64 * KB)
    try:
        engine = _mapped(arena)
        try:
            for bad in ((60 * KB, 8 * KB), (-1, 10), (0, -1), (0, 64 * KB + 1), ("0", 10)):
                with pytest.raises(ArenaError):
                    engine.lent([(1, [bad])])  # type: ignore[list-item]
            [empty] = engine.lent([(2, [(64 * KB, 0)])])
            assert [bytes(view) for view in empty] == [b""]  # empty: the decode refuses it
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


def test_an_offer_passes_the_arena_s_descriptor_infers_carry_where_its_images_are_and_answers_what_was_released(
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
        assert [(ident, [bytes(s) for s in its]) for ident, _, its in split] == [
            (1, [photos[0]]), (2, [photos[1]]), (3, [photos[2]]), (4, [b"small"])]
        assert arena.held == 2
        del split  # the requests done with: 1 and 2 told released, with no answer to go with
        wire.send_some(engine, wire.answers_parts((), 0, 0, mapped.take_released()))
    finally:
        mapped.close()
    answers = wire.FrameReader(worker, (wire.Answers,))
    worker.setblocking(False)
    got: list[tuple[object, list[bytearray]]] = []
    while not got:
        got += answers.read()
    [(told, _)] = got
    assert isinstance(told, wire.Answers) and told.ids == () and sorted(told.released) == [1, 2]
    arena.released(told.released)
    assert arena.held == 0
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
