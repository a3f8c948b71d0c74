"""How an engine loop turn's CPU decoding is handed out (app/link/loop.py): to the decode threads in at most one
share per thread, each worth a hand-off, or kept on the loop when all of it decodes in less than one hand-off costs;
alike photos (one call for several requests) admitted as bundles of a hand-off's decoding at most (``runs``).
What a request's decoding is expected to cost comes from its encoded bytes and the decode CPU per byte measured so
far (requests refused before their decode left out), so one large photo after small ones is still handed off."""
from __future__ import annotations

from typing import Protocol, Sequence, TypeVar

HAND_OFF_S = 0.005  # what handing a turn's decoding to a thread and back costs, about: less decoding stays here
DECODE_S_WEIGHT = 0.2  # how fast the expected decode time per byte follows the measured one


class Encoded(Protocol):
    images: list[bytes]


R = TypeVar("R", bound=Encoded)


def encoded_bytes(request: Encoded) -> int:
    """A request's encoded image bytes."""
    return sum(len(image) for image in request.images)


class DecodeShares:
    """The expected decode CPU per byte (None until measured: any image is then worth a hand-off), and the split
    of a turn's requests it implies over ``threads`` decode threads."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.s_per_byte: float | None = None

    def here(self, requests: Sequence[Encoded]) -> bool:
        """Whether these requests decode in less time than a hand-off to a decode thread costs."""
        per_byte = self.s_per_byte
        return per_byte is not None and sum(map(encoded_bytes, requests)) * per_byte < HAND_OFF_S

    def shares(self, requests: Sequence[R]) -> list[list[R]]:
        """The requests split into at most one share per thread, each worth a hand-off (at least HAND_OFF_S of
        expected decoding), balanced by their bytes: one hand-off per share, not per request."""
        if not requests:
            return []
        sized = sorted(((encoded_bytes(request), request) for request in requests), key=lambda pair: -pair[0])
        per_byte = self.s_per_byte
        worth = len(requests) if per_byte is None else int(sum(size for size, _ in sized) * per_byte / HAND_OFF_S)
        count = max(1, min(self.threads, len(requests), worth))
        if count == 1:
            return [list(requests)]
        shares: list[list[R]] = [[] for _ in range(count)]
        loads = [0] * count
        for size, request in sized:
            lightest = loads.index(min(loads))
            shares[lightest].append(request)
            loads[lightest] += size
        return shares

    def runs(self, sizes: Sequence[int]) -> list[int]:
        """Requests of ``sizes`` encoded bytes, in order, as the lengths of consecutive runs, each a bundle (one
        call, decoded by one thread, queued once all of it is; ``shares`` hands them out), each expected to decode
        within HAND_OFF_S, so that a bundle's first photo waits little for its last (a photo that decodes longer
        runs alone, as every photo does until the decode is measured)."""
        per_byte = self.s_per_byte
        if per_byte is None:
            return [1] * len(sizes)
        limit = HAND_OFF_S / per_byte  # the bytes a hand-off's time decodes
        runs, taken, length = [], 0, 0
        for size in sizes:
            if length and taken + size > limit:
                runs.append(length)
                taken, length = 0, 0
            taken, length = taken + size, length + 1
        return runs + [length] if length else runs

    def measured(self, decoded_bytes: int, cpu_s: float) -> None:
        """``decoded_bytes`` of images took ``cpu_s`` of a thread's CPU to decode and queue."""
        if decoded_bytes:
            measured, before = cpu_s / decoded_bytes, self.s_per_byte
            self.s_per_byte = measured if before is None else before + DECODE_S_WEIGHT * (measured - before)
