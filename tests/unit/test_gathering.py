"""When the engine's loop waits for more requests before a turn (app/link/gathering.py): the pace, the yield, the
probe, and the loop's batches."""
from __future__ import annotations

import pytest

from app.link.gathering import ARRIVAL_GAP_IDLE_S, GATHER_PROBE_TURNS, Gathering

OPEN = 64  # connections that could each send a request during a wait: more than any cap here


def _busy(max_wait_s: float = 0.002, cap: int = 8, every_s: float = 0.0005) -> tuple[Gathering, float]:
    """A policy whose turns' batches run on the loop, after turns of one request every ``every_s``; and the clock."""
    gathering, now = Gathering(max_wait_s, cap, now=0.0), 0.0
    gathering.batches_on_loop = True
    for _ in range(100):  # the pace settles at one request every ``every_s``
        now += every_s
        gathering.turn_runs(1, now)
    return gathering, now


def test_no_wait_before_the_pace_is_known_or_while_batches_run_on_the_batcher_s_thread() -> None:
    gathering = Gathering(0.002, 8, now=0.0)
    assert gathering.arrival_gap_s == ARRIVAL_GAP_IDLE_S and gathering.wait_s(1, OPEN) == 0.0  # the first requests
    gathering, _ = _busy()
    gathering.batches_on_loop = False  # a GPU's batches: its batcher's thread waits for more images itself
    assert gathering.wait_s(1, OPEN) == 0.0


def test_a_busy_loop_waits_at_most_max_wait_and_no_longer_than_a_batch_of_the_cap_takes_to_come() -> None:
    gathering, _ = _busy(max_wait_s=0.002, cap=8, every_s=0.0005)
    assert gathering.arrival_gap_s == pytest.approx(0.0005, rel=1e-3)
    assert gathering.wait_s(1, OPEN) == pytest.approx(0.002)  # 7 more would take 3.5 ms: the wait's bound first
    assert gathering.wait_s(6, OPEN) == pytest.approx(0.001, rel=1e-3)  # the two that fill the batch come in 1 ms
    assert gathering.wait_s(8, OPEN) == 0.0  # a batch of the cap already: nothing to wait for


def test_a_wait_is_for_the_requests_that_can_still_come() -> None:
    # a connection carries one request at a time: those with one read or in flight send nothing before its answer
    gathering, _ = _busy(max_wait_s=0.004, cap=32, every_s=0.0005)
    assert gathering.wait_s(4, OPEN) == pytest.approx(0.004)  # 28 more would take 14 ms: the bound
    assert gathering.wait_s(4, 3) == pytest.approx(0.0015, rel=1e-3)  # the three idle connections' requests
    assert gathering.wait_s(4, 0) == 0.0  # every connection waits for an answer: nothing can come


def test_requests_slower_than_one_per_wait_are_not_waited_for() -> None:
    gathering, _ = _busy(max_wait_s=0.002, every_s=0.005)
    assert gathering.wait_s(1, OPEN) == 0.0


def test_waits_that_bring_nothing_stop_but_for_a_probe_and_waits_that_bring_more_go_on() -> None:
    gathering, _ = _busy()
    waits = []
    for _ in range(2 * GATHER_PROBE_TURNS):
        waited = gathering.wait_s(1, OPEN) > 0
        waits.append(waited)
        if waited:
            gathering.waited(0)  # a lone client: its next request cannot come before its answer
    # the yield 1.0 -> 0.8 -> 0.64 -> 0.51 -> 0.41, below GATHER_MIN_YIELD after four waits; then a probe once
    # GATHER_PROBE_TURNS turns went by without a wait (it brings nothing either: the next is past these turns)
    assert [turn for turn, waited in enumerate(waits) if waited] == [0, 1, 2, 3, 3 + GATHER_PROBE_TURNS]
    while not gathering.wait_s(1, OPEN):  # the next probe
        pass
    gathering.waited(3)  # clients came meanwhile: it brought three
    assert gathering.wait_yield >= 0.5 and gathering.wait_s(1, OPEN) > 0  # so the loop waits again at once


def test_a_pause_resets_the_pace_to_idle() -> None:
    gathering, now = _busy()
    gathering.turn_runs(1, now + 60.0)  # a minute without requests: its turn counts as idle, not as 60 s
    assert gathering.arrival_gap_s == pytest.approx(0.0005 + 0.2 * (ARRIVAL_GAP_IDLE_S - 0.0005), rel=1e-3)
    assert gathering.wait_s(1, OPEN) == 0.0  # the next requests after it are not waited for
