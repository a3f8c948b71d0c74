"""When the engine's loop waits for more requests before a turn runs (app/link/loop.py ``EngineServer._gather``):
one wake-up then reads several requests and their images run as one batch. A request that woke the loop for itself
alone paid that wake-up, and the cold caches after it, with most of its CPU on a busy two-core host
(docs/performance.md). The wait is bounded (``MAX_WAIT_MS``, less when a batch of the cap comes sooner at the pace
requests come, or when fewer can come: a connection carries one exchange at a time, so those whose request is
read or in flight, or whose catalog call or explanation runs, send nothing more before their answer, and one that
never carried a request, as an HTTP worker's for its catalog calls and state queries, is not waited for; nor
is any once the turn holds a batch of the cap), and taken only when it pays:
- the turns' batches run on the loop (short batches on a CPU, or on CUDA where they replay CUDA graphs; where the
  batcher's thread runs them it waits for more images itself, and a second wait would only add latency);
- requests come faster than one per wait (a moving average of the time between them, reset by a pause);
- recent waits brought at least ``GATHER_MIN_YIELD`` requests each (a moving average). A lone client's next request
  cannot come before its answer, so its waits bring nothing and stop (four, from the start), but for one turn in
  ``GATHER_PROBE_TURNS``, which looks again.
"""
from __future__ import annotations

ARRIVAL_WEIGHT = 0.2  # a turn's weight in the pace requests come at
YIELD_WEIGHT = 0.2  # a wait's weight in what waits bring
ARRIVAL_GAP_IDLE_S = 1.0  # the pace after a pause: no wait for the first requests after it
GATHER_MIN_YIELD = 0.5  # requests a wait brought, on average, below which the loop stops waiting
GATHER_PROBE_TURNS = 100  # then it waits again once in this many turns, to see whether waiting brings more


class Gathering:
    """The pace requests come at (``arrival_gap_s``), what recent waits brought (``wait_yield``), the turns since
    the last wait, and whether the turns' batches run on the loop (``batches_on_loop``, the loop's to tell): how
    long a turn waits for more. One loop's, used from its thread only."""

    def __init__(self, max_wait_s: float, batch_cap: int, now: float) -> None:
        self.max_wait_s, self.batch_cap = max_wait_s, batch_cap
        self.arrival_gap_s, self.last_turn = ARRIVAL_GAP_IDLE_S, now
        self.wait_yield = 1.0  # at first, hoped for
        self.turns_since_wait = 0
        self.batches_on_loop = False  # the last turn that admitted requests (or ran a backlog's slice) ran batches
        # on the loop: one whose requests went to the decode threads ran none

    def wait_s(self, read: int, can_come: int) -> float:
        """How long a turn that read ``read`` requests waits for more before it runs (0: it runs at once), when at
        most ``can_come`` more can come meanwhile (the connections that carried requests and have no exchange under
        way); a wait returned is taken (``waited`` then says what it brought)."""
        wait_s = min(self.max_wait_s, self.arrival_gap_s * min(self.batch_cap - read, can_come))
        self.turns_since_wait += 1
        if self.batches_on_loop and wait_s >= self.arrival_gap_s and (
                self.wait_yield >= GATHER_MIN_YIELD or self.turns_since_wait >= GATHER_PROBE_TURNS):
            self.turns_since_wait = 0
            return wait_s
        return 0.0

    def waited(self, brought: int) -> None:
        """A wait ended having read ``brought`` more requests."""
        self.wait_yield += YIELD_WEIGHT * (brought - self.wait_yield)

    def turn_runs(self, requests: int, now: float) -> None:
        """A turn of ``requests`` (at least one) runs at ``now``: the pace follows the time since the last one."""
        gap_s = min((now - self.last_turn) / requests, ARRIVAL_GAP_IDLE_S)
        self.arrival_gap_s += ARRIVAL_WEIGHT * (gap_s - self.arrival_gap_s)
        self.last_turn = now
