"""How an engine loop turn's CPU decoding is handed out (app/link/loop.py): to the decode threads in at most one
share per thread, each worth a hand-off, or kept on the loop when all of it decodes in less than one hand-off costs,
or when each of its images decodes in less than LOOP_IMAGE_MAX_S; alike photos (one call for several requests)
admitted as bundles of a hand-off's decoding at most (``runs``).
What a request's decoding is expected to cost comes from its encoded bytes and the decode CPU per byte measured so
far (requests refused before their decode left out), so one large photo after small ones is still handed off. The
decode threads' measure runs high where an image's decode is mostly Python steps: each torch step lets go of the
interpreter lock, and a thread then waits for it behind the loop and the other decode threads, which costs CPU
(2-core VM: a 100 KB JPEG of 8x8 pixels 52 us on the loop, 209 on two threads; a 160x120 photo 180 against
314-336; 500x375 922 against 996). So the loop's own measure is kept apart and the lower one expected; a turn the
threads' measure alone sends to them though its images may belong on the loop has one request decoded on the loop
now and then to take (or refresh) the loop's (``probe``): before the rest is handed out, so that the decode
threads' steps do not wait for the lock in it too."""
from __future__ import annotations

from typing import Protocol, Sequence, TypeVar

HAND_OFF_S = 0.005  # what handing a turn's decoding to a thread and back costs, about: less decoding stays here
LOOP_IMAGE_MAX_S = 0.0003  # images each expected to decode in less stay on the loop, however many: their Python
# steps hold the interpreter lock, and two decode threads beside the loop ran them slower than the loop alone (2-core
# VM, engine alone, 16 photos a request: 8x8 JPEGs padded to 100 KB, 52 us each, 2.4x the requests a second on the
# loop; 160x120 photos, 180 us, 1.34x; 320x240, 437 us, 0.76x; 500x375, 922 us, 0.62x)
PROBE_IMAGE_MAX_S = 4 * LOOP_IMAGE_MAX_S  # a turn the decode threads' measure puts each image of under this may
# belong on the loop (the threads' measure ran 1.8-4x the loop's for photos under LOOP_IMAGE_MAX_S there): ``probe``
PROBE_EVERY_S = 1.0  # at most one probe this often: one request decoded on the loop before the turn's shares are
# handed out, which waits for it (at most 16 x 1.2 ms, of a second, where photos so decoded belong on the threads)
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
        self.s_per_byte: float | None = None  # measured on the loop: a decode alone
        self.handed_s_per_byte: float | None = None  # measured on the decode threads: their waits for the lock in it
        self._probe_after = 0.0  # time.monotonic() before which no probe is made

    def expected_s_per_byte(self) -> float | None:
        """The decode CPU per byte to expect: the lower of the two measures (a wait for the lock only adds)."""
        known = [measure for measure in (self.s_per_byte, self.handed_s_per_byte) if measure is not None]
        return min(known) if known else None

    def here(self, requests: Sequence[Encoded]) -> bool:
        """Whether these requests decode on the loop: in less time than a hand-off to a decode thread costs, or
        each of their images in less than LOOP_IMAGE_MAX_S."""
        per_byte = self.expected_s_per_byte()
        sizes = [len(image) for request in requests for image in request.images]
        return per_byte is not None and bool(sizes) and (sum(sizes) * per_byte < HAND_OFF_S or
                                                         max(sizes) * per_byte < LOOP_IMAGE_MAX_S)

    def probe(self, requests: Sequence[R], now: float) -> R | None:
        """For a turn going to the decode threads: its smallest request, to be decoded on the loop to take (or
        refresh) the loop's measure, when the threads' puts each of the turn's images under PROBE_IMAGE_MAX_S (photos
        the threads' measure alone would keep on them for good, though the loop may decode them faster); at most
        once every PROBE_EVERY_S (``now``: time.monotonic())."""
        handed = self.handed_s_per_byte
        if handed is None or not requests or now < self._probe_after:
            return None
        largest = max((len(image) for request in requests for image in request.images), default=0)
        if largest * handed >= PROBE_IMAGE_MAX_S:
            return None
        self._probe_after = now + PROBE_EVERY_S
        return min(requests, key=encoded_bytes)

    def shares(self, requests: Sequence[R]) -> list[list[R]]:
        """The requests split into at most one share per thread, each worth a hand-off (at least HAND_OFF_S of
        expected decoding), balanced by their bytes: one hand-off per share, not per request."""
        if not requests:
            return []
        sized = sorted(((encoded_bytes(request), request) for request in requests), key=lambda pair: -pair[0])
        per_byte = self.expected_s_per_byte()
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
        per_byte = self.expected_s_per_byte()
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

    def measured(self, decoded_bytes: int, cpu_s: float, on_loop: bool) -> None:
        """``decoded_bytes`` of images took ``cpu_s`` of a thread's CPU to decode and queue, on the loop or on a
        decode thread."""
        if not decoded_bytes:
            return
        measured = cpu_s / decoded_bytes
        if on_loop:
            self.s_per_byte = _moved(self.s_per_byte, measured)
            return
        self.handed_s_per_byte = _moved(self.handed_s_per_byte, measured)


def _moved(before: float | None, measured: float) -> float:
    """A moving average ``before`` moved towards ``measured`` (its first value when None)."""
    return measured if before is None else before + DECODE_S_WEIGHT * (measured - before)
