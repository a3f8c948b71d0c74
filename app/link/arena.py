"""Shared memory a loop link's images cross in (``LINK_ARENA_MB``): the HTTP worker writes a request's images into
an arena of its own and sends where they are; the engine copies them out when it reads the request's frame. A photo
then costs each side one copy in memory instead of a pass through the socket's buffers (the kernel copies it in on
the worker's send and out on the engine's read, a system call's work each: about 15 us of the engine's time for a
100 KB photo on a 2-core VM: docs/performance.md).

The arena is a ring. The worker places each request's images after the last ones placed, starting again from the
front when the end has no room, and frees a request's place once an answer to it or to any request sent after it
has come: the engine copies every placed image out as it reads the frame, frames are read in the order they are
sent, and request ids grow in that order, so an answer proves every frame up to its request's was read. The two
processes share no lock and no counter: the send and the read of a frame order the writes and the copies. Whatever
finds no room (a burst, or a request larger than the arena) goes through the socket as before.

The worker's arena is a memfd (no file, not bounded by /dev/shm's size in a container), handed to the engine with
the link's first message (``wire.ArenaOffer``, its descriptor passed with SCM_RIGHTS), unmapped when the link closes.
Standard library only: the HTTP side never imports torch.
"""
from __future__ import annotations

import collections
import contextlib
import fcntl
import mmap
import os
from typing import Sequence

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

    def answered(self, ident: int) -> None:
        """An answer to request ``ident`` came: its place and every earlier one's are free (their frames were read)."""
        places = self._places
        while places and places[0][0] <= ident:
            places.popleft()

    @property
    def held(self) -> int:
        """Places not yet freed."""
        return len(self._places)

    def close(self) -> None:
        """Unmapped and the descriptor closed (the engine's mapping stands until it closes the connection)."""
        self._places.clear()
        with contextlib.suppress(BufferError):  # a view of it still held (none is): unmapped with its last reference
            self._view.release()
            self._map.close()
        os.close(self.fd)


class MappedArena:
    """The engine's side: a worker's arena mapped from the descriptor it handed over, its images copied out."""

    def __init__(self, fd: int, size: int) -> None:
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
        self._view = memoryview(self._map)

    def copied(self, placed: Sequence[tuple[int, int]]) -> list[bytearray]:
        """The images at ``placed`` (each (offset, length)), each copied into a buffer of the engine's own; ArenaError
        when one lies outside the arena."""
        images = []
        for offset, length in placed:
            if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset
                    and 0 <= length <= self.size - offset):  # (an empty image: the decode says what is wrong)
                raise ArenaError(f"an image at {offset!r} of {length!r} bytes in an arena of {self.size}")
            images.append(bytearray(self._view[offset:offset + length]))
        return images

    def close(self) -> None:
        """Unmapped (the connection's end)."""
        with contextlib.suppress(BufferError):  # a view of it still held (none is): unmapped with its last reference
            self._view.release()
            self._map.close()
