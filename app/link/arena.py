"""Shared memory a loop link's images cross in (``LINK_ARENA_MB``): the HTTP worker writes a request's images into
an arena of its own and sends where they are; the engine decodes them where they lie, copying nothing. A photo then
costs the worker one copy in memory and the engine none, where the socket cost each side a pass through its buffers
(the kernel copies it in on the worker's send and out on the engine's read, a system call's work each: about 15 us
of the engine's time for a 100 KB photo on a 2-core VM), and a copy out of the arena still about 8 us (16 for a
photo out of the caches: docs/performance.md).

The arena is a ring. The worker places each request's images after the last ones placed, starting again from the
front when the end has no room. The engine lends a message's images to whatever reads them (views of one array on
its mapping) and tells the worker, with the next answers it sends on the connection (``Answers.released``), the
message's requests once their views are all gone: once they are decoded (on the CPU; on a device, once their batch
is), cancelled (their images dropped from the queue), or ended (the engine's loop lets go of an ended request's
images and of its error's tracebacks, which hold the frames that read them: garbage collection would otherwise free
them when it comes round; a rollout's shadow share copies what it keeps). One lending a message, not one a request
(a weak reference, an array and a release each: about 2 us of the engine's time a photo), holds no place much
longer: a message's requests are placed in a row and most often batched together, and a place let go of before the
one ahead of it waits for it all the same. The worker frees a place once its request is released, and its
ring from the oldest place on, so a place held long leaves the ring full behind it: whatever finds no room (a burst,
a request larger than the arena, or a ring behind a place still held) goes through the socket as before. The two
processes share no lock and no counter: the frames that carry the places and the releases order the writes and the
reads.

The worker's arena is a memfd (no file, not bounded by /dev/shm's size in a container), handed to the engine with
the link's first message (``wire.ArenaOffer``, its descriptor passed with SCM_RIGHTS), unmapped when the link closes;
the engine's mapping stands while a view of it does.
Standard library and numpy only: the HTTP side never imports torch.
"""
from __future__ import annotations

import collections
import contextlib
import fcntl
import functools
import itertools
import mmap
import os
import weakref
from typing import Callable, Iterable, Sequence

import numpy as np

PLACED_MIN_BYTES = 16 << 10  # a request's images smaller than this in all go through the socket with its frame (one
# send of a joined buffer): a photo's are placed


_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL if hasattr(fcntl, "F_ADD_SEALS") else 0
# what the worker seals its arena with: an engine maps only an arena that can never shrink (a read past the end of
# a shrunk mapping is SIGBUS, which would end the engine), and none can unseal it


class ArenaError(ValueError):
    """An engine was told of images outside the arena it maps (or of an arena it could not map)."""


def _bytes_view(segment: bytes | bytearray | memoryview) -> memoryview | None:
    """``segment`` as a flat view of bytes, or None when it is no contiguous buffer."""
    view = memoryview(segment)
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B") if view.c_contiguous else None


class Arena:
    """The worker's side: the memfd, its mapping and the ring's places, each (request id, start, end), oldest first.
    Used on one loop's thread only."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.fd = os.memfd_create("visionserve-link-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, _SEALS)  # its size fixed for good: the engine checks
            self._map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self._view = memoryview(self._map)
        self._places: collections.deque[tuple[int, int, int]] = collections.deque()
        self._released: set[int] = set()  # requests the engine let go of whose places are not yet free (one before
        # them is still held)
        self.placed_bytes = 0  # image bytes placed so far, in all

    def _start_for(self, length: int) -> int | None:
        """Where ``length`` bytes fit after the last place (or from the front), None when nowhere now."""
        if not self._places:
            return 0 if length <= self.size else None
        first, last = self._places[0][1], self._places[-1][2]
        if last > first:  # used: [first, last); free: [last, size) and [0, first)
            if self.size - last >= length:
                return last
            return 0 if first >= length else None
        return last if first - last >= length else None  # used: [first, size) and [0, last); free: [last, first)

    def place(self, ident: int, segments: Sequence[bytes | bytearray | memoryview]
              ) -> tuple[tuple[int, int], ...] | None:
        """Request ``ident``'s segments written one after the other into the ring: each one's (offset, length),
        or None (nothing written) when they are too small to be worth it, no contiguous buffers, or find no room."""
        total = sum(segment.nbytes if isinstance(segment, memoryview) else len(segment) for segment in segments)
        if total < PLACED_MIN_BYTES:  # (before any view is made: most requests of tensors are small)
            return None
        views = [_bytes_view(segment) for segment in segments]
        if any(view is None for view in views):
            return None
        start = self._start_for(total)
        if start is None:
            return None
        at, placed = start, []
        for view in views:
            self._view[at:at + len(view)] = view  # type: ignore[index]
            placed.append((at, len(view)))
            at += len(view)  # type: ignore[arg-type]
        self._places.append((ident, start, at))
        self.placed_bytes += total
        return tuple(placed)

    def released(self, idents: Iterable[int]) -> None:
        """The engine let go of these requests' images: their places are free, from the oldest place on up to the
        first one still held (the rest once it is released too)."""
        places, released = self._places, self._released
        released.update(idents)
        while places and places[0][0] in released:
            released.discard(places.popleft()[0])

    @property
    def held(self) -> int:
        """Places not yet freed."""
        return len(self._places)

    def close(self) -> None:
        """Unmapped and the descriptor closed (the engine's mapping stands until it closes the connection)."""
        self._places.clear()
        self._released.clear()
        with contextlib.suppress(BufferError):  # a view of it still held (none is): unmapped with its last reference
            self._view.release()
            self._map.close()
        os.close(self.fd)


class MappedArena:
    """The engine's side: a worker's arena mapped from the descriptor it handed over, its images lent where they lie
    (``lent``) and the requests whose images are all let go (``released``: their ids, for the worker)."""

    def __init__(self, fd: int, size: int, on_release: Callable[[], None] | None = None) -> None:
        try:
            if not fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK:
                raise ArenaError("an arena offered that may shrink (its reads past the end would end the engine)")
            if not 0 < size <= os.fstat(fd).st_size:
                raise ArenaError(f"an arena of {size} bytes offered on a descriptor of {os.fstat(fd).st_size}")
            self._map = mmap.mmap(fd, size)
        except OSError as exc:
            raise ArenaError(f"the arena offered could not be mapped: {exc}") from None
        finally:
            os.close(fd)
        self.size = size
        self._lent: dict[int, weakref.ref[np.ndarray]] = {}  # each lending's array, until it is gone (by a count
        # of its own: a request id sent twice would lose a release, its first reference dropped)
        self._lendings = itertools.count()
        self.released: collections.deque[int] = collections.deque()  # requests whose images are all let go, not
        # yet told to the worker: appended by whichever thread drops a request's last view, taken by the loop
        self._on_release = on_release  # called on that thread after each (the engine's loop: woken from another)

    def lent(self, requests: Sequence[tuple[int, Sequence[tuple[int, int]]]]) -> list[list[memoryview]]:
        """The images of ``requests`` (each its id and its images' places, (offset, length) each: a message's), each
        request's a list of views of the arena where they lie, nothing copied: their ids join ``released`` together
        once every view of them all (and whatever was made on them: a tensor, an array) is gone. One lending for the
        message, not one a request: a request's place freed sooner would wait all the same for the places before it,
        which the worker's ring frees from the oldest on. ArenaError when one lies outside the arena."""
        start, end = self.size, 0  # what they span
        for _, placed in requests:
            for offset, length in placed:
                if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset
                        and 0 <= length <= self.size - offset):  # (an empty image: the decode says what is wrong)
                    raise ArenaError(f"an image at {offset!r} of {length!r} bytes in an arena of {self.size}")
                start, end = min(start, offset), max(end, offset + length)
        if not requests:
            return []
        start = min(start, end)  # (requests of no images: a view of nothing, released as soon as it goes)
        whole = np.frombuffer(self._map, np.uint8, end - start, start)  # (numpy's: an owner a weak reference sees)
        lending = next(self._lendings)
        self._lent[lending] = weakref.ref(whole, functools.partial(self._let_go, lending,
                                                                   tuple(ident for ident, _ in requests)))
        view = memoryview(whole)  # (each slice holds the array: released once the last one goes)
        return [[view[offset - start:offset - start + length] for offset, length in placed]
                for _, placed in requests]

    def _let_go(self, lending: int, idents: tuple[int, ...], _: object) -> None:
        self._lent.pop(lending, None)
        self.released.extend(idents)
        if self._on_release is not None:
            self._on_release()

    def take_released(self) -> tuple[int, ...]:
        """The requests let go of since the last call, taken from ``released`` one by one (another thread may
        append meanwhile: a deque's ends are safe to use from two threads, a list swapped for an empty one is not)."""
        released = self.released
        return tuple([released.popleft() for _ in range(len(released))])

    def close(self) -> None:
        """Unmapped (the connection's end), once the last view lent of it is gone."""
        self._lent.clear()
        with contextlib.suppress(BufferError):  # views lent still held: unmapped with the last of them
            self._map.close()
