"""The batcher on its own, with fake predict functions and no server."""
from __future__ import annotations

import threading
import time
import types
from concurrent.futures import CancelledError, ThreadPoolExecutor
from typing import Callable, Iterator, Sequence

import pytest

from app.engine.batching.types import (
    BatcherClosed,
    BatchResult,
    BatchRun,
    BatchSizeMismatch,
    DeadlineExpired,
    DeadlineTooShort,
    DeadlineUnreachable,
    Group,
    PrepareTimeout,
    QueueFull,
)
from app.engine.batching import batcher as batcher_module
from app.engine.batching.batcher import QUEUE_DEPTH_REPORT_S, Batcher, ItemsFailed
from tests.support.fakes import wait_until


class Recorder:
    """A predict_fn that doubles its inputs, records batch sizes and can be held shut by a gate."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.batches: list[list[int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.fail_on = fail_on

    def __call__(self, items: list[int]) -> Sequence[int]:
        self.entered.set()
        self.gate.wait(timeout=10)
        self.batches.append(list(items))
        if self.fail_on is not None and self.fail_on in items:
            raise RuntimeError("boom")
        return [2 * i for i in items]


@pytest.fixture
def make_batcher() -> Iterator[Callable[..., Batcher]]:
    started: list[Batcher] = []

    def make(fn: Callable, **kwargs: object) -> Batcher:
        options = {"max_batch_size": 4, "max_wait_ms": 20, "queue_size": 64} | kwargs
        batcher = Batcher(fn, **options).start()  # type: ignore[arg-type]
        started.append(batcher)
        return batcher

    yield make
    for batcher in started:
        batcher.stop(timeout=5)


def test_concurrent_submits_form_batches_and_each_caller_gets_its_own_row(make_batcher) -> None:
    recorder = Recorder()
    batcher = make_batcher(recorder, max_batch_size=8, max_wait_ms=50)
    barrier = threading.Barrier(16)

    def call(i: int) -> int:
        barrier.wait()
        return batcher.submit(i).result(timeout=10).value

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(call, range(16)))
    assert results == [2 * i for i in range(16)]
    assert max(len(b) for b in recorder.batches) > 1
    assert all(len(b) <= 8 for b in recorder.batches)
    assert sorted(i for b in recorder.batches for i in b) == list(range(16))


def test_batch_result_says_how_it_was_served(make_batcher) -> None:
    batcher = make_batcher(Recorder())
    results = [f.result(timeout=10) for f in batcher.submit_many([1, 2, 3])]
    assert [r.value for r in results] == [2, 4, 6]
    assert {r.batch_size for r in results} == {3}
    assert len({r.batch_id for r in results}) == 1
    assert all(r.queued_s >= 0 and r.run_s >= 0 for r in results)


def test_a_lone_item_runs_alone_after_max_wait(make_batcher) -> None:
    recorder = Recorder()
    batcher = make_batcher(recorder, max_batch_size=8, max_wait_ms=30)
    assert batcher.submit(5).result(timeout=10).batch_size == 1
    assert recorder.batches == [[5]]


def test_a_full_batch_does_not_wait_for_max_wait(make_batcher) -> None:
    # With a one-hour max_wait, only a full batch can ever run: reaching the result proves it did not wait.
    recorder = Recorder()
    batcher = make_batcher(recorder, max_batch_size=4, max_wait_ms=3_600_000)
    futures = batcher.submit_many([1, 2, 3, 4])
    assert [f.result(timeout=10).value for f in futures] == [2, 4, 6, 8]


def test_nothing_incoming_means_no_wait_and_something_incoming_means_company(make_batcher) -> None:
    # A one-hour max_wait again: the lone item can only finish if the batcher knows nobody else is coming.
    recorder, incoming = Recorder(), [0]
    batcher = make_batcher(recorder, max_batch_size=4, max_wait_ms=3_600_000, incoming=lambda: incoming[0])
    assert batcher.submit(1).result(timeout=10).batch_size == 1
    incoming[0] = 1  # one request still decoding: the next batch waits for it
    first = batcher.submit(2)
    second = batcher.submit(3)
    incoming[0] = 0
    batcher.submit(4)
    assert first.result(timeout=10).batch_size == 3 and second.result(timeout=10).batch_size == 3
    assert recorder.batches == [[1], [2, 3, 4]]


class ThreadRecorder:
    """A predict_fn that records which thread ran each batch and the most batches ever running at once."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self._active = 0
        self.most_at_once = 0
        self._lock = threading.Lock()
        self.delay_s = 0.0  # each batch's own time

    def __call__(self, items: list[int]) -> Sequence[int]:
        with self._lock:
            self._active += 1
            self.most_at_once = max(self.most_at_once, self._active)
        self.threads.append(threading.current_thread())
        time.sleep(self.delay_s)
        self.entered.set()
        self.gate.wait(timeout=10)
        with self._lock:
            self._active -= 1
        if -1 in items:
            raise RuntimeError("boom")
        return [2 * i for i in items]


def test_a_lone_item_on_an_idle_batcher_runs_on_the_callers_thread(make_batcher) -> None:
    fn, incoming = ThreadRecorder(), [0]
    batcher = make_batcher(fn, max_wait_ms=3_600_000, incoming=lambda: incoming[0], inline_when_idle=True)
    future = batcher.submit(5)
    assert future.done() and future.result().value == 10 and future.result().batch_size == 1
    assert fn.threads == [threading.current_thread()] and batcher.batches_inline == 1
    incoming[0] = 1  # another request on its way: batching needs the worker
    waiting = batcher.submit(6)
    incoming[0] = 0
    batcher.submit(7).result(timeout=10)
    assert waiting.result(timeout=10).batch_size == 2
    assert fn.threads[1] is not threading.current_thread() and batcher.batches_inline == 1


def test_work_arriving_during_an_inline_batch_waits_for_it(make_batcher) -> None:
    fn = ThreadRecorder()
    batcher = make_batcher(fn, max_wait_ms=1, incoming=lambda: 0, inline_when_idle=True)
    fn.gate.clear()
    inline = ThreadPoolExecutor(1)
    first = inline.submit(batcher.submit, 1)
    assert fn.entered.wait(timeout=10)
    queued = batcher.submit_many([2, 3])  # the batcher is busy: these queue, even with nothing incoming
    assert not any(f.done() for f in queued) and batcher.depth == 2
    fn.gate.set()
    assert first.result(timeout=10).result(timeout=10).value == 2
    assert [f.result(timeout=10).value for f in queued] == [4, 6]
    assert fn.most_at_once == 1 and batcher.batches_inline == 1
    inline.shutdown()


def test_an_inline_batch_leaves_an_idle_worker_asleep(make_batcher) -> None:
    fn = ThreadRecorder()
    batcher = make_batcher(fn, incoming=lambda: 0, inline_when_idle=True)
    notified, notify = [], batcher._cond.notify
    batcher._cond.notify = lambda n=1: (notified.append(n), notify(n))  # type: ignore[method-assign]
    assert [batcher.submit(i).result(timeout=10).value for i in range(3)] == [0, 2, 4]
    assert batcher.batches_inline == 3 and notified == []  # nothing queued meanwhile: no wake-up for nothing


def test_an_inline_batch_that_fails_fails_its_caller_and_frees_the_batcher(make_batcher) -> None:
    fn = ThreadRecorder()
    batcher = make_batcher(fn, max_batch_size=2, incoming=lambda: 0, inline_when_idle=True)
    with pytest.raises(RuntimeError, match="boom"):
        batcher.submit(-1).result(timeout=10)
    assert batcher.submit(4).result(timeout=10).value == 8
    big = batcher.submit_many([1, 2, 3])  # over the batch cap: split by the worker, not run inline
    assert [f.result(timeout=10).batch_size for f in big] == [2, 2, 1]
    assert batcher.batches_inline == 2


def test_arrivals_count_a_request_until_it_queues_or_leaves() -> None:
    from app.engine.batching.arrivals import Arrivals

    arrivals = Arrivals()
    with arrivals.arriving() as arrived:
        with arrivals.arriving():
            assert arrivals.count() == 2
        arrived()
        arrived()  # only once
        assert arrivals.count() == 0
    with pytest.raises(ValueError), arrivals.arriving():
        assert arrivals.count() == 1
        raise ValueError("bad image")  # a request that fails before queueing
    assert arrivals.count() == 0


def test_large_request_is_split_into_max_batch_size_batches(make_batcher) -> None:
    recorder = Recorder()
    batcher = make_batcher(recorder, max_batch_size=4, max_wait_ms=1)
    futures = batcher.submit_many(list(range(10)))
    assert [f.result(timeout=10).value for f in futures] == [2 * i for i in range(10)]
    assert [len(b) for b in recorder.batches] == [4, 4, 2]


def test_failing_batch_fails_only_its_callers_and_the_worker_goes_on(make_batcher) -> None:
    recorder = Recorder(fail_on=13)
    batcher = make_batcher(recorder, max_wait_ms=1)
    with pytest.raises(RuntimeError, match="boom"):
        batcher.submit(13).result(timeout=10)
    assert batcher.is_alive()
    assert batcher.submit(4).result(timeout=10).value == 8


def test_an_input_that_fails_the_model_fails_only_its_own_request(make_batcher) -> None:
    # Before: the whole batch failed, so the requests batched with a bad one failed too.
    recorder = Recorder(fail_on=13)
    batcher = make_batcher(recorder, max_batch_size=4, max_wait_ms=1)
    _hold_worker(batcher, recorder)
    futures = batcher.submit_many([1, 13, 2])
    recorder.gate.set()
    assert [f.exception(timeout=10) is not None for f in futures] == [False, True, False]
    assert [futures[0].result().value, futures[2].result().value] == [2, 4]
    assert recorder.batches[-4:] == [[1, 13, 2], [1], [13], [2]]  # the batch, then each alone


def _fails_odd_items(seen: list[list[int]]) -> Callable[[list[int]], list[int]]:
    """A predict_fn whose batch runs but whose odd items get no output (as a model's NaN rows): ItemsFailed."""

    def predict(items: list[int]) -> list[int]:
        seen.append(list(items))
        odd = {index: ValueError(f"no output for {item}") for index, item in enumerate(items) if item % 2}
        if odd:
            raise ItemsFailed(f"{len(odd)} of {len(items)} items failed", [2 * i for i in items], odd)
        return [2 * i for i in items]

    return predict


def test_items_a_batch_ran_without_an_output_fail_alone_and_nothing_runs_again(make_batcher) -> None:
    # Before: ItemsFailed did not exist, a model's NaN row was answered as a class; raising instead would have run
    # every item of the batch again alone.
    seen: list[list[int]] = []
    events = Events()
    batcher = make_batcher(_fails_odd_items(seen), max_batch_size=8, max_wait_ms=1, observer=events)
    futures = batcher.submit_many([2, 3, 4])
    assert futures[0].result(timeout=10).value == 4 and futures[2].result(timeout=10).value == 8
    with pytest.raises(ValueError, match="no output for 3"):
        futures[1].result(timeout=10)
    assert futures[0].result().batch_size == 3  # the batch that ran, all of it
    grouped = batcher.submit_group([6, 8, 9, 10])
    with pytest.raises(ValueError, match="no output for 9"):
        grouped.result(timeout=10)
    assert grouped.failed_at == 2
    assert seen == [[2, 3, 4], [6, 8, 9, 10]] and events.batches == [3, 4]  # each ran once, counted as it ran
    assert "batch_failed" not in events.events and batcher.is_alive()


def test_a_split_batch_s_part_with_failed_items_runs_only_those_again(make_batcher) -> None:
    seen: list[list[int]] = []
    predict = _fails_odd_items(seen)

    def fits_two(items: list[int]) -> list[int]:
        if len(items) > 2:
            seen.append(list(items))
            raise OutOfMemory(f"{len(items)} do not fit")
        return predict(items)

    batcher = make_batcher(fits_two, max_batch_size=4, max_wait_ms=1, split_on=(OutOfMemory,))
    futures = batcher.submit_many([2, 4, 6, 7])
    assert [f.result(timeout=10).value for f in futures[:3]] == [4, 8, 12]
    with pytest.raises(ValueError, match="no output for 7"):
        futures[3].result(timeout=10)
    assert seen == [[2, 4, 6, 7], [2, 4], [6, 7], [7]]  # 6 answered from its part: only 7 ran again


def test_wrong_output_count_fails_the_batch(make_batcher) -> None:
    batcher = make_batcher(lambda items: [0] * (len(items) + 1), max_wait_ms=1)
    with pytest.raises(BatchSizeMismatch):
        batcher.submit(1).result(timeout=10)
    assert batcher.is_alive()


def _hold_worker(batcher: Batcher, recorder: Recorder) -> None:
    """Park the worker inside predict_fn so the queue fills up behind it."""
    recorder.gate.clear()
    recorder.entered.clear()
    batcher.submit(0)
    assert recorder.entered.wait(timeout=10)


def test_full_queue_rejects_at_once_and_all_or_nothing(make_batcher) -> None:
    recorder = Recorder()
    batcher = make_batcher(recorder, max_batch_size=2, max_wait_ms=1, queue_size=4)
    _hold_worker(batcher, recorder)
    queued = batcher.submit_many([1, 2, 3])
    with pytest.raises(QueueFull) as excinfo:
        batcher.submit_many([4, 5])  # only one slot left: neither may be queued
    assert excinfo.value.retry_after_s > 0
    assert batcher.depth == 3
    queued.append(batcher.submit(6))  # the last slot is still free
    with pytest.raises(QueueFull):
        batcher.submit(7)
    recorder.gate.set()
    assert [f.result(timeout=10).value for f in queued] == [2, 4, 6, 12]


def test_cancelled_items_cost_no_forward_pass(make_batcher) -> None:
    recorder = Recorder()
    batcher = make_batcher(recorder, max_wait_ms=1)
    _hold_worker(batcher, recorder)
    doomed, kept = batcher.submit_many([41, 42])
    assert doomed.cancel()
    recorder.gate.set()
    assert kept.result(timeout=10).value == 84
    assert all(41 not in b for b in recorder.batches)


def test_stop_finishes_queued_work_then_refuses_new(make_batcher) -> None:
    recorder = Recorder()
    batcher = make_batcher(recorder, max_wait_ms=1)
    _hold_worker(batcher, recorder)
    pending = batcher.submit_many([1, 2, 3])
    stopper = threading.Thread(target=batcher.stop, kwargs={"timeout": 10})
    stopper.start()
    recorder.gate.set()
    stopper.join(timeout=10)
    assert [f.result(timeout=1).value for f in pending] == [2, 4, 6]
    assert not batcher.is_alive()
    with pytest.raises(BatcherClosed):
        batcher.submit(1)


@pytest.mark.parametrize("bad", [{"max_batch_size": 0}, {"max_wait_ms": -1}, {"queue_size": 0}])
def test_constructor_rejects_bad_limits(bad: dict[str, float]) -> None:
    options = {"max_batch_size": 4, "max_wait_ms": 1, "queue_size": 4} | bad
    with pytest.raises(ValueError):
        Batcher(lambda items: items, **options)  # type: ignore[arg-type]


class Events:
    """A BatchObserver that remembers what it was told."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.batches: list[int] = []
        self.depths: list[int] = []
        self.runs: list[tuple[float, float]] = []  # (wall, CPU) seconds per batch

    def batch_done(self, size: int, run_s: float, queued_s: Sequence[float], cpu_s: float) -> None:
        self.batches.append(size)
        self.runs.append((run_s, cpu_s))

    def event(self, name: str, count: int = 1) -> None:
        self.events.extend([name] * count)

    def queue_depth(self, depth: int) -> None:
        self.depths.append(depth)

    def running(self, alive: bool) -> None:
        self.events.append("started" if alive else "stopped")


def test_the_observer_hears_the_thread_start_and_stop(make_batcher) -> None:
    events = Events()
    batcher = make_batcher(Recorder(), observer=events)
    assert batcher.submit(1).result(timeout=10).value == 2
    batcher.stop(timeout=5)
    assert events.events[0] == "started" and events.events[-1] == "stopped"


def test_expired_items_are_dropped_before_the_forward_pass(make_batcher) -> None:
    recorder, events = Recorder(), Events()
    batcher = make_batcher(recorder, max_wait_ms=1, observer=events)
    _hold_worker(batcher, recorder)
    expired = batcher.submit(7, deadline=time.monotonic() + 0.01)
    alive = batcher.submit(8, deadline=time.monotonic() + 60)
    time.sleep(0.05)
    recorder.gate.set()
    with pytest.raises(DeadlineExpired):
        expired.result(timeout=10)
    assert alive.result(timeout=10).value == 16
    assert all(7 not in b for b in recorder.batches)
    assert [e for e in events.events if e != "started"] == ["deadline_dropped"]


def test_a_deadline_the_backlog_cannot_meet_is_refused_at_once(make_batcher) -> None:
    recorder = Recorder()
    batcher = make_batcher(recorder, max_batch_size=1, max_wait_ms=50)  # estimate: at least 50 ms a batch
    batcher.submit(1).result(timeout=10)  # one measured batch gives the latency estimate
    _hold_worker(batcher, recorder)
    batcher.submit_many([2, 3, 4])
    asked = time.monotonic()
    with pytest.raises(DeadlineUnreachable) as excinfo:
        batcher.submit(5, deadline=asked + 0.1)  # enough alone, not behind three batches
    assert excinfo.value.retry_after_s > 0
    # until when one more image would not be answered: what an HTTP worker refuses the route's like by
    assert asked + 0.1 < excinfo.value.busy_until < time.monotonic() + 60
    with pytest.raises(DeadlineUnreachable) as two:
        batcher.submit_many([5, 6], deadline=time.monotonic() + 0.1)
    assert two.value.busy_until <= time.monotonic() + float(str(two.value).split("up to ")[1].split("s")[0])
    assert batcher.depth == 3
    recorder.gate.set()


def test_decodes_side_by_side_count_before_the_queue_when_a_deadline_is_judged(make_batcher) -> None:
    # Before: admission judged the queue alone; a burst of large photos decoding side by side (each many times its
    # time alone) was admitted on an empty queue, spent the deadline in its decodes and was answered 504 after their
    # CPU (hey -c 64, 5 MB photos, X-Request-Timeout 1500: 177-340 answered 200 and 23-123 504 in 20 s, now 505-514
    # and 0-7 on the 2-core VM).
    recorder = Recorder()
    batcher = make_batcher(recorder, max_batch_size=4, max_wait_ms=1)
    batcher.submit(1).result(timeout=10)  # a measured batch: deadlines are judged
    batcher.note_decoded(2, 1.6)  # an image's decode takes 0.8 s now, its neighbours' beside it
    batcher.check_room(1, time.monotonic() + 0.5)  # nothing on its way: as before, the queue alone (empty)
    with pytest.raises(DeadlineUnreachable) as refused:
        batcher.check_room(1, time.monotonic() + 0.5, decoding=3)
    assert refused.value.retry_after_s > 0 and refused.value.busy_until > time.monotonic() + 0.5
    batcher.check_room(1, time.monotonic() + 2.0, decoding=3)  # room for its decode and what is ahead
    batcher.note_decoded(1, 0.0)  # decodes speeding up as a burst ends: the average follows within a few
    for _ in range(8):
        batcher.note_decoded(1, 0.01)
    batcher.check_room(1, time.monotonic() + 0.5, decoding=3)
    assert batcher.depth == 0


def test_a_deadline_shorter_than_the_request_alone_is_the_callers_mistake(make_batcher) -> None:
    # Before: refused as "unreachable" (429 with Retry-After), inviting a retry that could never succeed.
    recorder = Recorder()
    batcher = make_batcher(recorder, max_batch_size=1, max_wait_ms=50)  # its own: a batch's 50 ms wait at least
    batcher.submit(1).result(timeout=10)
    _hold_worker(batcher, recorder)  # judged while batches run (an idle batcher runs it: its estimate may be stale)
    with pytest.raises(DeadlineTooShort, match="shorter than these 2 images' own inference"):
        batcher.submit_many([2, 3], deadline=time.monotonic() + 0.04)
    with pytest.raises(DeadlineTooShort, match=r"^the \d+ ms deadline is shorter than this image's own"):
        batcher.submit(4, deadline=time.monotonic() + 0.03)  # one image: not "these 1 images'"
    assert batcher.depth == 0
    recorder.gate.set()


def test_a_deadline_of_microseconds_is_said_in_them() -> None:
    # a V2 timeout is in microseconds: one of 12 was told "the 0 ms deadline"; an X-Request-Timeout of 1.5 was told
    # "the 2 ms deadline"
    from app.engine.batching.types import ms

    assert [ms(s) for s in (0.000012, 0.0004, 0.0015, 0.0123, 0.0, -1.0)] == [
        "0.012 ms", "0.4 ms", "1.5 ms", "12 ms", "0 ms", "0 ms"]


class OutOfMemory(Exception):
    """Stands in for torch.cuda.OutOfMemoryError."""


def test_out_of_memory_batches_are_split_and_the_cap_lowered(make_batcher) -> None:
    seen: list[int] = []

    def fits_two(items: list[int]) -> list[int]:
        seen.append(len(items))
        if len(items) > 2:
            raise OutOfMemory(f"{len(items)} do not fit")
        return [2 * i for i in items]

    events = Events()
    batcher = make_batcher(fits_two, max_batch_size=8, max_wait_ms=1, split_on=(OutOfMemory,), shrink_s=60,
                           observer=events)
    futures = batcher.submit_many(list(range(8)))
    assert [f.result(timeout=10).value for f in futures] == [2 * i for i in range(8)]
    assert seen == [8, 4, 2, 2, 4, 2, 2]
    assert events.events.count("batch_split") == 3
    assert batcher.current_max_batch_size == 2
    seen.clear()
    assert [f.result(timeout=10).value for f in batcher.submit_many(list(range(6)))] == [2 * i for i in range(6)]
    assert seen == [2, 2, 2]  # the lowered cap avoids hitting the wall again


def test_a_split_batch_whose_part_fails_runs_again_only_that_part_s_items(make_batcher) -> None:
    # Split for memory, the first half ran and the second failed: every item of the batch ran again alone, the first
    # half's a second time (their rows monitored twice, their forward passes counted twice).
    seen: list[list[int]] = []

    def fits_two_chokes_on_13(items: list[int]) -> list[int]:
        seen.append(list(items))
        if len(items) > 2:
            raise OutOfMemory(f"{len(items)} do not fit")
        if 13 in items:
            raise ValueError("the model chokes on 13")
        return [2 * i for i in items]

    events = Events()
    batcher = make_batcher(fits_two_chokes_on_13, max_batch_size=8, max_wait_ms=1, split_on=(OutOfMemory,),
                           observer=events)
    futures = batcher.submit_many([1, 2, 3, 13])
    assert [f.result(timeout=10).value for f in futures[:3]] == [2, 4, 6]
    with pytest.raises(ValueError, match="chokes"):
        futures[3].result(timeout=10)
    assert seen == [[1, 2, 3, 13], [1, 2], [3, 13], [3], [13]]  # 1 and 2 ran once
    assert events.batches == [2, 1]  # the half that ran, then 3 alone
    assert batcher.is_alive()


def test_out_of_memory_on_a_single_item_fails_it(make_batcher) -> None:
    def never_fits(items: list[int]) -> list[int]:
        raise OutOfMemory("no")

    batcher = make_batcher(never_fits, max_wait_ms=1, split_on=(OutOfMemory,))
    with pytest.raises(OutOfMemory):
        batcher.submit(1).result(timeout=10)
    assert batcher.is_alive()


def test_shrunk_cap_recovers_after_its_time(make_batcher) -> None:
    calls = {"n": 0}

    def first_call_too_big(items: list[int]) -> list[int]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise OutOfMemory("once")
        return items

    batcher = make_batcher(first_call_too_big, max_batch_size=4, max_wait_ms=1, split_on=(OutOfMemory,),
                           shrink_s=0.05)
    [f.result(timeout=10) for f in batcher.submit_many([1, 2, 3, 4])]
    assert batcher.current_max_batch_size == 2
    time.sleep(0.1)
    assert batcher.current_max_batch_size == 4


def test_observer_hears_batches_and_queue_depth(make_batcher) -> None:
    events = Events()
    batcher = make_batcher(Recorder(), max_wait_ms=1, observer=events)
    [f.result(timeout=10) for f in batcher.submit_many([1, 2, 3])]
    assert events.batches == [3] and events.depths[0] == 3 and events.depths[-1] == 0


def _held_until(release: threading.Event) -> Callable[[list[int]], list[int]]:
    """A predict whose batch runs until ``release`` is set (at most 10 s)."""
    def held(items: list[int]) -> list[int]:
        release.wait(10)
        return items

    return held


def test_a_stuck_batch_still_lets_submits_tell_the_queue_depth_now_and_then(make_batcher) -> None:
    events, release = Events(), threading.Event()
    batcher = make_batcher(_held_until(release), max_batch_size=1, max_wait_ms=1, observer=events)
    first = batcher.submit(1)
    wait_until(lambda: batcher.running_since() is not None)  # taken: its batch hangs
    told = len(events.depths)
    batcher.submit_many([2, 3])  # told at once only if none was told lately: not yet
    time.sleep(QUEUE_DEPTH_REPORT_S * 1.5)
    batcher.submit_many([4, 5, 6])
    assert events.depths[told:] == [5]  # a queue no batch is taken from is still told now and then
    release.set()
    first.result(timeout=10)


def test_a_take_that_empties_the_queue_tells_no_0_while_images_wait_and_the_idle_queue_reads_0(make_batcher) -> None:
    # Before: each take that emptied the queue told 0, and a submit told the depth only 0.1 s after that: a saturated
    # server's gauge read about 0 (a capacity trial: mean 0.4 against 5.3 images waiting by the queue stage's time,
    # the HPA's metric)
    events, gate = Events(), threading.Event()
    batcher = make_batcher(_held_until(gate), max_batch_size=4, max_wait_ms=1, observer=events)
    first = batcher.submit_many([1, 2, 3])
    wait_until(lambda: batcher.running_since() is not None)  # taken whole: the queue is empty, its batch runs
    assert 0 not in events.depths
    time.sleep(QUEUE_DEPTH_REPORT_S * 1.5)
    more = batcher.submit_many([4, 5])
    assert events.depths[-1] == 2  # what waits behind the running batch
    gate.set()
    assert [f.result(timeout=10).value for f in [*first, *more]] == [1, 2, 3, 4, 5]
    wait_until(lambda: events.depths[-1] == 0 and batcher.depth == 0)  # the last batch settled: idle, it reads 0


@pytest.mark.parametrize("inline", [False, True])
def test_observer_hears_the_cpu_time_of_the_thread_running_the_batch(make_batcher, inline: bool) -> None:
    def busy(items: list[int]) -> list[int]:  # 50 ms of CPU on whichever thread runs the batch
        started = time.thread_time()
        while time.thread_time() - started < 0.05:
            pass
        return items

    def idle(items: list[int]) -> list[int]:  # 100 ms of wall time, next to no CPU
        time.sleep(0.1)
        return items

    events = Events()
    options = {"incoming": lambda: 0, "inline_when_idle": True} if inline else {}
    batcher = make_batcher(lambda items: (busy if items[0] else idle)(items), max_wait_ms=1, observer=events,
                           **options)
    batcher.submit(1).result(timeout=10)
    batcher.submit(0).result(timeout=10)
    (busy_wall, busy_cpu), (idle_wall, idle_cpu) = events.runs
    assert busy_cpu >= 0.05 and idle_wall >= 0.1 and idle_cpu < 0.05


def test_prepare_runs_on_the_worker_thread_before_any_batch() -> None:
    threads: list[tuple[str, int]] = []

    def predict(items: list[int]) -> list[int]:
        threads.append(("batch", threading.get_ident()))
        return items

    batcher = Batcher(predict, max_batch_size=4, max_wait_ms=0, queue_size=8)
    batcher.start(lambda: threads.append(("prepare", threading.get_ident())))
    try:
        assert threads and threads[0][0] == "prepare"  # start() returned after prepare ran
        assert batcher.submit(1).result(timeout=10).value == 1
        assert {ident for _, ident in threads} == {batcher._thread.ident} != {threading.get_ident()}
    finally:
        batcher.stop(timeout=5)


def test_a_failing_prepare_is_raised_by_start_and_ends_the_worker() -> None:
    def prepare() -> None:
        raise RuntimeError("warm-up failed")

    batcher = Batcher(lambda items: items, max_batch_size=4, max_wait_ms=0, queue_size=8)
    with pytest.raises(RuntimeError, match="warm-up failed"):
        batcher.start(prepare)
    assert not batcher.is_alive()


def test_a_prepare_that_does_not_end_in_time_is_a_timeout_and_its_worker_ends_without_a_batch_once_it_returns(
        ) -> None:
    # Before: start() waited for ever, a hung warm-up holding its version LOADING and every later change behind it.
    released, ran = threading.Event(), []
    batcher = Batcher(lambda items: ran.append(items) or items, max_batch_size=4, max_wait_ms=0, queue_size=8)
    started = time.monotonic()
    with pytest.raises(PrepareTimeout, match="did not end within 0.2s"):
        batcher.start(lambda: released.wait(10), timeout_s=0.2)
    assert 0.2 <= time.monotonic() - started < 5 and batcher.is_alive()  # still in prepare
    released.set()
    batcher._thread.join(5)
    assert not batcher.is_alive() and ran == []
    quick = Batcher(lambda items: items, max_batch_size=4, max_wait_ms=0, queue_size=8)
    quick.start(lambda: None, timeout_s=5)  # one that ends in time serves as before
    try:
        assert quick.submit(3).result(timeout=10).value == 3
    finally:
        quick.stop(timeout=5)


def test_the_cap_can_be_lowered_after_start(make_batcher) -> None:
    recorder = Recorder()
    batcher = make_batcher(recorder, max_batch_size=8, max_wait_ms=200)
    batcher.set_max_batch_size(2)
    recorder.gate.clear()
    futures = [batcher.submit(i) for i in range(5)]
    recorder.gate.set()
    assert [f.result(timeout=10).value for f in futures] == [0, 2, 4, 6, 8]
    assert max(len(b) for b in recorder.batches) <= 2 and batcher.current_max_batch_size == 2
    with pytest.raises(ValueError):
        batcher.set_max_batch_size(0)


def test_a_group_is_answered_once_all_its_items_are_whatever_order_they_finish_in() -> None:
    group: Group[int] = Group(3)
    assert group.wanted() and group.wanted()  # the first item taken starts it: its cancel comes too late
    assert not group.cancel()
    called: list[Group[int]] = []
    group.add_done_callback(called.append)
    for index in (2, 0):  # a failed batch's items, each run again alone, in any order
        group.set_rows(index, [index * 10], BatchRun(1, index + 1, 1, 0.0, 0.0))
    assert not group.done() and not called and not group.wait(0.01)  # the middle item still runs
    with pytest.raises(TimeoutError):
        group.result(timeout=0.01)
    waiter = threading.Thread(target=group.wait)  # a caller waiting when the last row comes is woken
    waiter.start()
    group.set_rows(1, [10], BatchRun(1, 2, 1, 0.0, 0.0))
    waiter.join(5)
    assert not waiter.is_alive() and called == [group] and group.done() and not group.cancelled()
    assert group.result(timeout=1) == [0, 10, 20]
    assert [run.batch_id for run in group.runs()] == [1, 2, 3]  # in item order
    late: list[Group[int]] = []
    group.add_done_callback(late.append)  # added once done: called at once
    assert late == [group]

    failing: Group[int] = Group(2)
    failing.set_failed(1, ValueError("image 1"))
    failing.set_rows(0, [0], BatchRun(1, 1, 2, 0.0, 0.0))  # a row after the failure changes nothing
    assert failing.failed_at == 1 and isinstance(failing.exception(timeout=1), ValueError)
    with pytest.raises(ValueError, match="image 1"):
        failing.result()
    assert not failing.wanted() and not failing.cancel()  # its items still queued are not run

    dropped: Group[int] = Group(2)
    told: list[Group[int]] = []
    dropped.add_done_callback(told.append)
    assert dropped.cancel() and dropped.cancel() and not dropped.wanted()  # cancelled before any item ran
    assert dropped.done() and dropped.cancelled() and told == [dropped]
    dropped.set_failed(0, DeadlineExpired("late"))  # nobody waits for it: nothing raised, told once
    assert told == [dropped]
    with pytest.raises(CancelledError):
        dropped.result()


def test_a_submitted_group_runs_across_batches_and_a_cancelled_one_never_runs(make_batcher) -> None:
    recorder = Recorder()
    recorder.gate.clear()
    batcher = make_batcher(recorder, max_batch_size=2, max_wait_ms=1)
    first = batcher.submit_group([1, 2, 3])  # two batches: [1, 2] runs (held at the gate), [3] waits
    assert recorder.entered.wait(10)
    cancelled = batcher.submit_group([7, 8])
    assert cancelled.cancel()
    recorder.gate.set()
    assert first.result(timeout=10) == [2, 4, 6]
    runs = first.runs()  # the rows of a batch's consecutive items handed over at once: a run each
    assert [(run.rows, run.batch_size) for run in runs] == [(2, 2), (1, 1)] and runs[0].batch_id != runs[1].batch_id
    wait_until(lambda: batcher.depth == 0 and len(recorder.batches) == 2)
    assert recorder.batches == [[1, 2], [3]]  # the cancelled group's items never ran


def test_deferred_groups_run_on_the_callers_thread_as_one_batch_once_measured_and_expected_within_the_limit(
        make_batcher) -> None:
    fn, incoming = ThreadRecorder(), [0]
    batcher = make_batcher(fn, max_wait_ms=1, max_batch_size=16, incoming=lambda: incoming[0],
                           runs_queued_on_caller=True)  # (a lone submit's batch stays the worker's)
    wait_until(lambda: _worker_asleep(batcher))  # started, whatever the machine's load: it takes nothing unwoken
    fn.delay_s = 0.01  # each batch's own time: 10 ms
    notified, notify = [], batcher._cond.notify
    batcher._cond.notify = lambda n=1: (notified.append(n), notify(n))  # type: ignore[method-assign]
    first = batcher.submit_group([1], defer=True)
    assert notified == [] and batcher.depth == 1  # queued, the worker not woken
    batcher.run_queued(0.1)  # nothing measured yet: the worker's
    assert first.wait(10) and fn.threads[-1] is not threading.current_thread() and notified == [1]
    wait_until(lambda: _worker_asleep(batcher))  # done with that batch, whatever the machine's load
    groups = [batcher.submit_group([2], defer=True), batcher.submit_group([3], defer=True)]
    batcher.run_queued(1.0)  # two images, about 20 ms expected: one batch here, done at return
    assert all(group.wait(0) for group in groups) and fn.threads[-1] is threading.current_thread()
    assert [(group.result()[0], group.runs()[0].batch_size) for group in groups] == [(4, 2), (6, 2)]
    incoming[0] = 1  # another request on its way: the worker's, which waits for it
    waiting = batcher.submit_group([4], defer=True)
    batcher.run_queued(1.0)
    incoming[0] = 0
    assert waiting.wait(10) and fn.threads[-1] is not threading.current_thread()
    group = batcher.submit_group(list(range(16)), defer=True)
    batcher.run_queued(0.1)  # 16 x >= 5 ms per item: the worker's
    assert group.wait(10) and group.result() == [2 * i for i in range(16)]
    assert fn.threads[-1] is not threading.current_thread() and batcher.batches_inline == 1


def test_a_turn_s_groups_queue_under_one_hold_each_judged_with_those_before_it_and_none_wakes_the_worker(
        make_batcher) -> None:
    fn = Recorder()
    batcher = make_batcher(fn, max_batch_size=8, queue_size=5, incoming=lambda: 0, runs_queued_on_caller=True)
    wait_until(lambda: _worker_asleep(batcher))
    notified, notify = [], batcher._cond.notify
    batcher._cond.notify = lambda n=1: (notified.append(n), notify(n))  # type: ignore[method-assign]
    now = time.monotonic()
    answers = batcher.submit_groups([([1, 2], now + 10), ([7], now - 1), ([8], 1j), ([3, 4, 5], now + 10),
                                     ([6], now + 10)])  # type: ignore[list-item]  # (1j: a deadline that faults)
    assert [type(answer).__name__ for answer in answers] == ["Group", "DeadlineExpired", "TypeError", "Group",
                                                             "QueueFull"]
    assert notified == [] and batcher.depth == 5  # five queued (of at most five), the worker not woken
    batcher.run_queued(10.0)  # nothing measured yet: the worker's
    first, second = answers[0], answers[3]
    assert first.wait(10) and second.wait(10)  # type: ignore[union-attr]
    assert (first.result(), second.result()) == ([2, 4], [6, 8, 10]) and fn.batches == [[1, 2, 3, 4, 5]]  # type: ignore


def test_a_turn_s_groups_after_batches_ran_are_each_judged_with_the_backlog_those_before_them_make(
        make_batcher) -> None:
    # A turn's requests whose deadlines the whole turn's backlog clears by are queued without a closer look each: a
    # request whose deadline it does not clear by is still judged, with those before it queued
    fn = Recorder()
    batcher = make_batcher(fn, max_batch_size=8, max_wait_ms=1, queue_size=100, incoming=lambda: 0,
                           runs_queued_on_caller=True)
    wait_until(lambda: _worker_asleep(batcher))
    with batcher._cond:  # as after batches of 10 ms an image
        batcher.batches_run = 1
        batcher._item_seconds = batcher._last_item_seconds = batcher._large_item_seconds = 0.01
        batcher._batch_seconds = 0.005
    now = time.monotonic()  # on an idle batcher, shorter than its own inference with a batch's wait (0.011 s)
    assert [type(answer).__name__ for answer in batcher.submit_groups([([0], now + 0.0105)])] == ["DeadlineTooShort"]
    batcher._batch_seconds = 0.08
    answers = batcher.submit_groups([([1] * 8, now + 60.0), ([2], now + 0.1), ([3], now + 0.005)])
    # the second: 0.1 s, less than the 0.16 s the eight before it and itself take (more than the longest request's own
    # inference, 0.081 s, and its own, 0.011 s); the third: shorter than its own inference
    assert [type(answer).__name__ for answer in answers] == ["Group", "DeadlineUnreachable", "DeadlineTooShort"]
    answers = batcher.submit_groups([([4] * 91, now + 60.0), ([5] * 2, now + 60.0)])  # the second: past the size
    assert [type(answer).__name__ for answer in answers] == ["Group", "QueueFull"] and batcher.depth == 99


def test_a_turn_s_request_whose_deadline_is_now_is_refused_though_its_batches_took_no_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: batches timed at 0 s (a clock that did not move) made the bound past which requests need no look `now`
    # itself, and a request whose deadline was now was queued, where its look refuses it as passed
    monkeypatch.setattr(batcher_module, "time", types.SimpleNamespace(monotonic=lambda: 1000.0,
                                                                     thread_time=time.thread_time))
    batcher = Batcher(lambda items: items, max_batch_size=8, max_wait_ms=0, queue_size=64)  # (no worker started)
    batcher.batches_run = 1
    answers = batcher.submit_groups([([0], 1000.0), ([1], 1000.5)])
    # (a deadline passed before it was judged is too short once batches were timed: app/engine/call.py says whether
    # its length or the time before it queued made it so)
    assert [type(answer).__name__ for answer in answers] == ["DeadlineTooShort", "Group"]


def test_deferred_groups_run_here_only_where_the_batcher_was_told_they_may_whatever_lone_batches_do(
        make_batcher) -> None:
    fn = ThreadRecorder()
    batcher = make_batcher(fn, max_batch_size=2, incoming=lambda: 0, inline_when_idle=True)
    assert batcher.submit(0).result(timeout=10).value == 0  # a lone batch, measured: on this thread
    assert fn.threads[-1] is threading.current_thread() and batcher.batches_inline == 1
    wait_until(lambda: _worker_asleep(batcher))
    group = batcher.submit_group([1], defer=True)
    assert not batcher.run_queued(10.0)  # not told it may (a version whose batches need the worker's thread)
    assert group.wait(10) and group.result() == [2] and fn.threads[-1] is not threading.current_thread()
    wait_until(lambda: _worker_asleep(batcher))
    batcher.runs_queued_on_caller = True  # as a version is told once its warm-up showed where batches can run
    group = batcher.submit_group([2], defer=True)
    assert batcher.run_queued(10.0) and group.wait(0) and group.result() == [4]
    assert fn.threads[-1] is threading.current_thread() and batcher.batches_inline == 2


def test_a_deferred_batch_holding_an_item_the_caller_may_not_run_is_the_worker_s_with_what_follows(
        make_batcher) -> None:
    fn = ThreadRecorder()
    batcher = make_batcher(fn, max_batch_size=2, incoming=lambda: 0, runs_queued_on_caller=True)
    assert batcher.submit(0).result(timeout=10).value == 0  # a batch measured (on the worker)
    wait_until(lambda: _worker_asleep(batcher))
    batcher.caller_may_run = lambda item: item % 2 == 0  # odd items: decoded on the CPU in their batch, say
    groups = [batcher.submit_group([item], defer=True) for item in (2, 4, 5, 6)]
    assert batcher.run_queued(10.0)  # [2, 4] here; [5, 6] holds 5: the worker's, woken
    assert groups[0].wait(0) and groups[1].wait(0) and fn.threads[1] == threading.current_thread()
    assert groups[2].wait(10) and groups[3].wait(10) and fn.threads[2] is not threading.current_thread()
    assert [group.result()[0] for group in groups] == [4, 8, 10, 12] and batcher.batches_inline == 1
    wait_until(lambda: _worker_asleep(batcher))
    first = batcher.submit_group([7], defer=True)
    assert not batcher.run_queued(10.0)  # the first batch already holds one: nothing here
    assert first.wait(10) and fn.threads[-1] is not threading.current_thread() and batcher.batches_inline == 1


def test_deferred_groups_over_the_cap_run_here_in_batches_of_the_cap(make_batcher) -> None:
    recorder = Recorder()
    batcher = make_batcher(recorder, max_batch_size=2, incoming=lambda: 0, inline_when_idle=True,
                           runs_queued_on_caller=True)
    assert batcher.submit(0).result(timeout=10).value == 0  # a batch measured
    wait_until(lambda: _worker_asleep(batcher))  # started, whatever the machine's load: it takes nothing unwoken
    groups = [batcher.submit_group([i], defer=True) for i in range(1, 6)]
    batcher.run_queued(10.0)
    assert all(group.wait(0) for group in groups) and [g.result()[0] for g in groups] == [2, 4, 6, 8, 10]
    assert recorder.batches[1:] == [[1, 2], [3, 4], [5]] and batcher.batches_inline == 4 and batcher.depth == 0


def test_a_backlog_runs_here_a_slice_a_call_and_the_rest_waits_for_the_next_call_not_the_worker(
        make_batcher) -> None:
    recorder = Recorder()
    batcher = make_batcher(recorder, max_batch_size=2, incoming=lambda: 0, inline_when_idle=True,
                           runs_queued_on_caller=True)
    assert batcher.submit(0).result(timeout=10).value == 0  # a batch measured
    wait_until(lambda: _worker_asleep(batcher))  # started, whatever the machine's load: it takes nothing unwoken
    batcher.expected_batch_s = lambda items: 0.01  # type: ignore[method-assign]  # 10 ms a batch, whatever its size
    notified, notify = [], batcher._cond.notify
    batcher._cond.notify = lambda n=1: (notified.append(n), notify(n))  # type: ignore[method-assign]
    groups = [batcher.submit_group([i], defer=True) for i in range(1, 8)]  # seven items: four batches of the cap
    assert batcher.run_queued(0.025)  # two batches fit in 25 ms: they run here, the rest waits
    assert [group.wait(0) for group in groups] == [True] * 4 + [False] * 3
    assert batcher.depth == 3 and notified == [] and _worker_asleep(batcher)
    assert batcher.run_queued(0.025) and batcher.depth == 0
    assert [g.result()[0] for g in groups] == [2, 4, 6, 8, 10, 12, 14]
    assert recorder.batches[1:] == [[1, 2], [3, 4], [5, 6], [7]] and batcher.batches_inline == 5 and notified == []
    longer = batcher.submit_group([8, 9, 10], defer=True)
    assert not batcher.run_queued(0.005) and longer.wait(10)  # a batch beyond the limit: the worker's, woken
    assert notified == [1] and recorder.batches[-2:] == [[8, 9], [10]]


def test_what_others_queue_while_a_caller_s_run_drops_all_it_judged_is_the_worker_s(make_batcher) -> None:
    # Before: the queue was let go without waking the worker when nothing run_queued judged ran (all dropped), and
    # the caller (the engine's loop) calls again only after a run: a decode thread's request queued meanwhile, whose
    # wake-up met the queue held, waited for its deadline.
    batcher = make_batcher(Recorder(), max_wait_ms=1, runs_queued_on_caller=True)
    assert batcher.submit(0).result(timeout=10).value == 0  # a batch measured
    wait_until(lambda: _worker_asleep(batcher))
    late_by = time.monotonic() + 0.01
    late = batcher.submit_group([100], deadline=late_by, defer=True)
    wait_until(lambda: time.monotonic() > late_by)
    queued: list[Group] = []

    def queue_another(_: object) -> None:  # as the run fails the late one, a decode thread queues a request
        thread = threading.Thread(target=lambda: queued.append(batcher.submit_group([1])))
        thread.start()
        thread.join(10)
        wait_until(lambda: bool(batcher._cond._waiters))  # type: ignore[attr-defined]  # woken, it found the queue
        # held and sleeps again

    late.add_done_callback(queue_another)
    assert not batcher.run_queued(10.0)  # nothing it judged ran: the late one was dropped
    assert isinstance(late.exception(0), DeadlineExpired)
    assert queued[0].wait(10) and queued[0].result() == [2]


class _Job:
    """Background work of ``size`` images that records the sizes of each group it runs in (``ran``)."""

    def __init__(self, size: int, ran: list[list[int]]) -> None:
        self.size, self.deadline, self.ran, self.dropped = size, time.monotonic() + 60, ran, ""

    def group_key(self) -> object:
        return "shadow"

    def run_group(self, jobs: list) -> None:
        self.ran.append([job.size for job in jobs])

    def drop(self, reason: str) -> None:
        self.dropped = reason


def test_background_work_over_its_limit_is_taken_alone_and_refused_as_full_only_behind_other_work(
        make_batcher) -> None:
    # Before: a job of more images than the limit was refused as full with nothing waiting: a shadow never compared
    # a request larger than SHADOW_QUEUE_SIZE, even on an idle server.
    recorder, ran = Recorder(), []
    batcher = make_batcher(recorder, incoming=lambda: 0)
    _hold_worker(batcher, recorder)  # a batch runs, nothing is queued: background work waits for it
    assert batcher.submit_background(_Job(6, ran), limit=4) is None
    assert batcher.submit_background(_Job(1, ran), limit=4) == "full"  # behind it, over the limit
    batcher.submit(1)
    assert batcher.submit_background(_Job(1, ran), limit=4) == "busy"  # an item is queued
    recorder.gate.set()
    wait_until(lambda: ran == [[6]])


def test_low_priority_items_run_after_the_items_queued_behind_them_in_batches_of_their_own(make_batcher) -> None:
    # Before: a shadow's images on its candidate were queued as any request's, so a version promoted from shadow
    # answered its first requests only after the shadow work it held (a suite run: 3.7-4.3 s on a starved machine).
    recorder = Recorder()
    batcher = make_batcher(recorder, max_batch_size=4, max_wait_ms=1, queue_size=6)
    _hold_worker(batcher, recorder)
    low = batcher.submit_many([101, 102], low_priority=True)
    first = batcher.submit_many([1, 2, 3, 4])
    second = batcher.submit_many([5, 6])  # the low-priority items are no backlog for these: 6 of 6
    assert (batcher.depth, batcher.depth_for_caller) == (8, 6)  # what run_queued may run: not the low-priority ones
    with pytest.raises(QueueFull):  # a low-priority item is judged with every item queued
        batcher.submit_many([103], low_priority=True)
    with pytest.raises(QueueFull):  # the others with each other
        batcher.submit_many([7])
    recorder.gate.set()
    assert [f.result(timeout=10).value for f in first + second + low] == [2, 4, 6, 8, 10, 12, 202, 204]
    assert recorder.batches == [[0], [1, 2, 3, 4], [5, 6], [101, 102]]


def test_low_priority_items_queued_while_a_caller_runs_the_queue_are_the_worker_s_and_it_is_woken(
        make_batcher) -> None:
    fn, low = ThreadRecorder(), []
    handing = threading.Event()

    def predict(items: list[int]) -> Sequence[int]:
        if handing.is_set() and not low:  # as the caller's batch runs, another thread hands work over
            thread = threading.Thread(target=lambda: low.extend(batcher.submit_many([101, 102], low_priority=True)))
            thread.start()
            thread.join(10)
        return fn(items)

    batcher = make_batcher(predict, max_batch_size=1, incoming=lambda: 0, runs_queued_on_caller=True)
    assert batcher.submit(0).result(timeout=10).value == 0  # a batch measured
    wait_until(lambda: _worker_asleep(batcher))
    batcher.expected_batch_s = lambda items: 0.001  # type: ignore[method-assign]
    groups = [batcher.submit_group([i], defer=True) for i in (1, 2, 3)]
    groups[2].cancel()  # its place, judged, meets the work handed over
    handing.set()
    assert batcher.run_queued(1.0)
    assert [group.result() for group in groups[:2]] == [[2], [4]]
    assert [f.result(timeout=10).value for f in low] == [202, 204]  # the worker woken for them
    here = threading.current_thread()
    assert fn.threads[1:] == [here, here, batcher._thread, batcher._thread]


def _worker_asleep(batcher: Batcher) -> bool:
    """The worker waits for work with none taken (so only a notify or an item it is told of wakes it)."""
    return not batcher._busy and bool(batcher._cond._waiters)  # type: ignore[attr-defined]


class Settles:
    """A batcher's ``settle``: at each call, how many batches had run and whether the last submitted item's answer
    had left; and when (``at``, time.monotonic())."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder, self.calls, self.last, self.at = recorder, [], None, []

    def __call__(self) -> None:
        self.at.append(time.monotonic())
        self.calls.append((len(self.recorder.batches), self.last is not None and self.last.done()))


def test_batches_settle_together_settle_s_after_the_last_settle_by_the_idle_worker(make_batcher) -> None:
    # Before: every batch that emptied the queue settled (about a fifth of an engine's instructions for a request
    # that came alone); a reader that needs them sooner settles the version itself (a scrape, a monitoring read).
    recorder = Recorder()
    settles = Settles(recorder)
    batcher = make_batcher(recorder, max_batch_size=2, max_wait_ms=1, settle=settles, settle_s=0.5)
    _settled_once(batcher, settles)
    _hold_worker(batcher, recorder)  # [0] runs, held; 1-5 queue behind it
    futures = batcher.submit_many([1, 2, 3, 4, 5])
    recorder.gate.set()
    assert [f.result(timeout=10).value for f in futures] == [2, 4, 6, 8, 10]
    assert recorder.batches[1:] == [[0], [1, 2], [3, 4], [5]]
    wait_until(lambda: len(settles.calls) == 2)
    assert settles.calls[1] == (5, False)  # once, for the four batches: the queue's end settled nothing
    assert settles.at[1] - settles.at[0] >= 0.5


def test_a_settle_interval_of_zero_settles_every_batch_before_its_answers(make_batcher) -> None:
    recorder = Recorder()
    settles = Settles(recorder)
    batcher = make_batcher(recorder, max_batch_size=2, max_wait_ms=1, settle=settles, settle_s=0.0)
    _hold_worker(batcher, recorder)
    futures = batcher.submit_many([1, 2, 3])
    settles.last = futures[-1]
    recorder.gate.set()
    assert [f.result(timeout=10).value for f in futures] == [2, 4, 6]
    assert settles.calls == [(1, False), (2, False), (3, False)]


def test_batches_settle_by_the_first_that_ends_settle_s_after_the_last_settle_and_as_the_batcher_stops(
        make_batcher, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]

    def monotonic() -> float:  # each batch takes 0.1 s of this clock; each reading a microsecond
        clock[0] += 1e-6
        return clock[0]

    def timed(items: list[int]) -> Sequence[int]:
        clock[0] += 0.1
        return recorder(items)

    monkeypatch.setattr(batcher_module, "time", types.SimpleNamespace(monotonic=monotonic,
                                                                      thread_time=time.thread_time))
    recorder = Recorder()
    settles = Settles(recorder)
    batcher = make_batcher(timed, max_batch_size=1, max_wait_ms=1, settle=settles, settle_s=0.25)
    _settled_once(batcher, settles)
    _hold_worker(batcher, recorder)
    futures = batcher.submit_many(list(range(1, 8)))
    settles.last = futures[-1]
    recorder.gate.set()
    assert [f.result(timeout=10).value for f in futures] == [2 * i for i in range(1, 8)]
    # [0] ends 0.1 s after the first settle, [1] 0.2, [2] 0.3: settled; [5] 0.3 after that; [7], 0.2 after it, not
    assert settles.calls[1:] == [(4, False), (7, False)]
    batcher.stop(timeout=10)
    assert settles.calls[1:] == [(4, False), (7, False), (9, True)]  # its thread's end settles what is held


def test_batches_run_on_a_callers_thread_settle_by_the_worker_woken_for_it(make_batcher) -> None:
    # The worker sleeps without a limit while idle: the first batch held since a settle, run on another thread (an
    # engine's loop, a request's thread), tells it when they are due.
    recorder = Recorder()
    settles = Settles(recorder)
    batcher = make_batcher(recorder, max_wait_ms=1, incoming=lambda: 0, inline_when_idle=True, settle=settles,
                           settle_s=0.3)
    _settled_once(batcher, settles)
    assert batcher.submit(1).result(timeout=10).value == 2  # on this thread: the queue was idle
    assert batcher.batches_inline == 2 and len(settles.calls) in (1, 2)  # each on this thread
    wait_until(lambda: len(settles.calls) == 2)
    assert settles.calls[1] == (2, False)
    wait_until(lambda: _worker_asleep(batcher))
    time.sleep(0.4)
    assert len(settles.calls) == 2  # nothing held: no settle again


def test_the_worker_woken_to_settle_takes_none_of_the_items_a_caller_queued_to_run_itself(make_batcher) -> None:
    # An engine's loop queues a turn's items deferred and runs them in slices (run_queued), the rest left for its
    # next turn. Before: the worker, woken by the settle's timer between two turns, took them (a hand-off between
    # threads that running them on the loop avoids).
    ran_on: list[str] = []

    def predict(items: list[int]) -> list[int]:
        ran_on.append(threading.current_thread().name)
        time.sleep(0.002)
        return [2 * item for item in items]

    settles = Settles(Recorder())
    batcher = make_batcher(predict, max_batch_size=1, max_wait_ms=0, incoming=lambda: 0, runs_queued_on_caller=True,
                           settle=settles, settle_s=0.1, name="worker")
    assert batcher.submit_group([0]).result(timeout=10) is not None  # measured, settled (the first batch)
    batcher.expected_batch_s = lambda items: 0.002  # type: ignore[method-assign]  # a slice of one batch below
    groups = [batcher.submit_group([i], defer=True) for i in range(1, 7)]
    assert batcher.run_queued(0.003)  # one slice: a batch here, five left for the next turn
    wait_until(lambda: len(settles.calls) == 2)  # the worker woke to settle the batch held...
    time.sleep(0.05)
    assert batcher.depth == 5  # ...and took none of the five
    assert batcher.run_queued(1.0)
    assert [group.result(timeout=10)[0] for group in groups] == [2 * i for i in range(1, 7)]
    assert ran_on[1:] == [threading.current_thread().name] * 6


def test_background_work_waits_for_the_items_a_caller_queued_to_run_itself(make_batcher) -> None:
    # Background work runs only when no item is queued. Before: the worker, told of no item, took a pending shadow
    # job ahead of the items an engine's loop had queued for its next run_queued (which then found it busy).
    recorder, ran = Recorder(), []
    incoming = [0]
    batcher = make_batcher(recorder, max_batch_size=4, max_wait_ms=0, incoming=lambda: incoming[0],
                           runs_queued_on_caller=True)
    assert batcher.submit_group([0]).result(timeout=10) == [0]  # measured
    wait_until(lambda: _worker_asleep(batcher))
    incoming[0] = 1  # a request on its way: background work waits
    assert batcher.submit_background(_Job(1, ran), limit=10) is None
    group = batcher.submit_group([7], defer=True)
    incoming[0] = 0  # it queued: nothing on its way
    time.sleep(0.05)  # the worker looks every BACKGROUND_LOOK_S
    assert ran == [] and batcher.depth == 1
    assert batcher.run_queued(1.0) and group.result(timeout=10) == [14]
    wait_until(lambda: ran == [[1]])  # then the job


def test_a_stopping_batcher_settles_the_batches_it_finishes(make_batcher) -> None:
    recorder = Recorder()
    settles = Settles(recorder)
    batcher = make_batcher(recorder, max_batch_size=1, max_wait_ms=1, settle=settles, settle_s=60.0)
    _settled_once(batcher, settles)
    _hold_worker(batcher, recorder)
    batcher.submit(1)
    batcher.stop(timeout=0)  # closed while [0] runs and [1] waits
    recorder.gate.set()
    batcher.stop(timeout=10)
    assert recorder.batches[1:] == [[0], [1]] and settles.calls[1:] == [(3, False)]


def _settled_once(batcher: Batcher, settles: Settles) -> None:
    """One batch run and settled (a first batch settles: none was, ``settle_s`` ago), the worker asleep again."""
    assert batcher.submit(9).result(timeout=10).value == 18
    wait_until(lambda: _worker_asleep(batcher))
    assert settles.calls == [(1, False)]


# -- admission against the live backlog, items nobody waits for, faults past the forward pass ----------------------

class Clock:
    """The batcher's ``time.monotonic``, moved by hand (a batch's time is what its predict_fn adds), a microsecond
    a reading; its thread CPU time stays the real one."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 1000.0
        monkeypatch.setattr(batcher_module, "time", types.SimpleNamespace(monotonic=self.monotonic,
                                                                          thread_time=time.thread_time))

    def monotonic(self) -> float:
        self.now += 1e-6
        return self.now


def test_one_slow_batch_refuses_a_short_deadline_on_an_idle_batcher_once_not_for_good(
        make_batcher, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the estimate, 600 ms after one stalled batch, refused every 200 ms deadline as too short (400), and
    # as nothing ran then, nothing brought it down.
    clock, recorder = Clock(monkeypatch), Recorder()

    def timed(items: list[int]) -> Sequence[int]:
        clock.now += 0.6 if not recorder.batches else 0.005  # the first batch stalls; every later one takes 5 ms
        return recorder(items)

    batcher = make_batcher(timed, max_batch_size=8, max_wait_ms=1, incoming=lambda: 0)
    assert batcher.submit_group([1]).result(timeout=10) == [2]
    outcomes: list[object] = []
    for item in range(10):
        wait_until(lambda: _worker_asleep(batcher))  # idle: nothing queued, nothing running
        try:
            outcomes.append(batcher.submit_group([item], deadline=clock.now + 0.2).result(timeout=10))
        except DeadlineTooShort:
            outcomes.append("400")
    # refused by the stall's own figure, then the next runs whatever the estimate, and its batch refreshes it
    assert outcomes == ["400"] + [[2 * item] for item in range(1, 10)]


def test_a_refusal_a_fresh_batch_confirmed_holds_on_an_idle_batcher_then_a_request_runs_to_refresh_it(
        make_batcher, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: every second request with the same too-short deadline ran and was answered past its deadline, after
    # the 400 had said a retry cannot succeed: 400, 200, 400, 200 (a Triton client's trial, V2's timeout parameter)
    clock, recorder = Clock(monkeypatch), Recorder()

    def timed(items: list[int]) -> Sequence[int]:
        clock.now += 0.25  # every batch takes 250 ms
        return recorder(items)

    batcher = make_batcher(timed, max_batch_size=8, max_wait_ms=1, incoming=lambda: 0)
    assert batcher.submit_group([1]).result(timeout=10) == [2]

    def outcome(item: int) -> object:
        wait_until(lambda: _worker_asleep(batcher))  # idle: nothing queued, nothing running
        clock.now += 0.3  # a client's retry, 0.3 s on
        try:
            return batcher.submit_group([item], deadline=clock.now + 0.15).result(timeout=10)
        except DeadlineTooShort:
            return "400"

    # refused, then one runs (its batch refreshes the estimate: 250 ms, again), then refused while that holds
    assert [outcome(item) for item in range(6)] == ["400", [2]] + ["400"] * 4
    clock.now += batcher_module.CONFIRMED_REFUSAL_S
    assert [outcome(item) for item in range(3)] == [[0], "400", "400"]  # held long enough: one runs again


def test_a_request_s_own_inference_is_its_images_at_the_time_per_image_not_a_full_batch_s(
        make_batcher, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: after full batches (82 ms each here) one image was "too short" (400, no retry) for any deadline
    # below a whole batch's time, though alone it takes 12 ms.
    clock, recorder = Clock(monkeypatch), Recorder()

    def timed(items: list[int]) -> Sequence[int]:
        clock.now += 0.002 + 0.010 * len(items)
        return recorder(items)

    batcher = make_batcher(timed, max_batch_size=8, max_wait_ms=1, incoming=lambda: 0)
    for _ in range(3):
        assert [f.result(timeout=10).value for f in batcher.submit_many(list(range(8)))] == list(range(0, 16, 2))
    _hold_worker(batcher, recorder)  # judged while a batch runs
    with pytest.raises(DeadlineUnreachable):  # behind the batch running: retry once it clears
        batcher.submit(1, deadline=clock.now + 0.04)
    with pytest.raises(DeadlineTooShort, match=r"own inference \(about 11 ms\)"):  # 10.25 ms an image, 1 ms wait
        batcher.submit(1, deadline=clock.now + 0.005)
    recorder.gate.set()


def test_admission_counts_what_is_left_of_the_batch_running_now(make_batcher,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: only the queue counted: a request was admitted behind a batch that had just started, and timed out.
    clock, recorder = Clock(monkeypatch), Recorder()

    def timed(items: list[int]) -> Sequence[int]:
        outputs = recorder(items)  # (held at the gate first: the batch's 300 ms pass once it is let go)
        clock.now += 0.3
        return outputs

    batcher = make_batcher(timed, max_batch_size=8, max_wait_ms=1, incoming=lambda: 0)
    assert batcher.submit(1).result(timeout=10).value == 2  # measured: 300 ms a batch
    wait_until(lambda: _worker_asleep(batcher))
    batcher.check_room(1, clock.now + 0.45)  # idle: nothing ahead of it
    _hold_worker(batcher, recorder)  # a batch starts
    with pytest.raises(DeadlineUnreachable) as raised:  # its 300 ms, then its own 300 ms
        batcher.submit(2, deadline=clock.now + 0.45)
    assert raised.value.retry_after_s == pytest.approx(0.3, abs=0.01)  # what the running batch has left
    batcher.check_room(1, clock.now + 0.65)
    recorder.gate.set()


def test_a_backlog_of_full_batches_is_judged_at_a_full_batch_s_time_after_lone_ones(
        make_batcher, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: every batch of the backlog was judged at the recent batch time whatever its size: after lone requests
    # (5 ms) nine batches of eight (40 ms each) were judged 50 ms, and a 150 ms deadline admitted failed in the
    # queue (504) instead of a 429 at once.
    clock, recorder = Clock(monkeypatch), Recorder()

    def timed(items: list[int]) -> Sequence[int]:
        outputs = recorder(items)  # (held at the gate first)
        clock.now += 0.005 * len(items)  # 5 ms an image, at any batch size
        return outputs

    batcher = make_batcher(timed, max_batch_size=8, max_wait_ms=1, queue_size=128, incoming=lambda: 0)
    for item in range(5):
        assert batcher.submit(item).result(timeout=10).value == 2 * item  # lone requests: 5 ms batches
        wait_until(lambda: _worker_asleep(batcher))
    _hold_worker(batcher, recorder)  # judged while a batch runs (5 ms expected of it)
    batcher.submit_many(list(range(64)))  # eight batches of the cap behind it, 40 ms each
    with pytest.raises(DeadlineUnreachable):  # 5 + 9 x 40 ms
        batcher.submit_many(list(range(8)), deadline=clock.now + 0.15)
    batcher.check_room(8, clock.now + 0.38)  # a deadline the backlog meets is admitted
    batcher.check_room(1, clock.now + 0.34)  # 5 + 8 x 40 + 5 ms: a last batch of one counts as one image's
    recorder.gate.set()


def test_a_backlog_is_judged_at_the_time_per_image_of_large_batches_once_one_ran(
        make_batcher, monkeypatch: pytest.MonkeyPatch) -> None:
    # A GPU's batch costs about the same whatever its size (5 ms here): judged at lone batches' time per image, a
    # backlog of 64 would read 8 x 40 ms, and a 100 ms deadline it meets in 45 ms would be refused.
    clock, recorder = Clock(monkeypatch), Recorder()

    def timed(items: list[int]) -> Sequence[int]:
        outputs = recorder(items)
        clock.now += 0.005  # 5 ms a batch, at any size
        return outputs

    batcher = make_batcher(timed, max_batch_size=8, max_wait_ms=1, queue_size=128, incoming=lambda: 0)
    _hold_worker(batcher, recorder)
    batcher.submit_many(list(range(8)))  # one full batch behind the held one
    recorder.gate.set()
    wait_until(lambda: batcher.depth == 0 and _worker_asleep(batcher))
    for item in range(5):
        assert batcher.submit(item).result(timeout=10).value == 2 * item  # then lone ones
        wait_until(lambda: _worker_asleep(batcher))
    _hold_worker(batcher, recorder)
    batcher.submit_many(list(range(64)))
    batcher.check_room(8, clock.now + 0.1)  # 5 + 9 x 5 ms, not 9 x 40
    recorder.gate.set()


def test_a_deadline_is_judged_with_the_spread_of_batches_times_and_retry_after_with_their_average(
        make_batcher, monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: judged at the average alone, a backlog on a host whose batches swung 3-5x (its CPU refusing a storm
    # of requests) was admitted against deadlines it then missed: a third of the images answered 504 after their
    # forward pass, the CPU spent for nothing, counted as the version's failures.
    clock, recorder, took = Clock(monkeypatch), Recorder(), iter([0.04, 0.12] * 4)

    def swinging(items: list[int]) -> Sequence[int]:
        outputs = recorder(items)
        clock.now += next(took, 0.08) if len(items) == 4 else 0.001  # full batches: 10 or 30 ms an image
        return outputs

    batcher = make_batcher(swinging, max_batch_size=4, max_wait_ms=1, queue_size=64, incoming=lambda: 0)
    for _ in range(8):
        _hold_worker(batcher, recorder)
        batcher.submit_many([1, 2, 3, 4])
        recorder.gate.set()
        wait_until(lambda: batcher.depth == 0 and _worker_asleep(batcher))
    _hold_worker(batcher, recorder)
    batcher.submit_many(list(range(8)))  # two full batches behind the held one
    try:  # with 4 more: three batches of 4 at about 20 ms an image (240 ms), or 0.7 s with the spread (4 x ~10 ms)
        with pytest.raises(DeadlineUnreachable) as refused:
            batcher.check_room(4, clock.now + 0.35)
        assert 0.15 < refused.value.retry_after_s < 0.25  # when the 8 are expected to clear: at the average
        batcher.check_room(4, clock.now + 0.8)
    finally:
        recorder.gate.set()
    wait_until(lambda: batcher.depth == 0 and _worker_asleep(batcher))
    spread = batcher._large_item_spread
    for item in range(10):  # then lone batches: the storm's spread fades, it does not judge a quiet hour
        assert batcher.submit(item).result(timeout=10).value == 2 * item
        wait_until(lambda: _worker_asleep(batcher))
    assert 0 < batcher._large_item_spread < 0.15 * spread


def test_a_gpu_s_batches_of_any_size_in_one_time_make_no_spread(make_batcher, monkeypatch: pytest.MonkeyPatch) -> None:
    # Half-full to full batches of one time (a GPU's): their time an image differs by their size, not by the host,
    # and their time does not: no spread judges a deadline, so a deadline the average meets is admitted.
    clock, recorder, sizes = Clock(monkeypatch), Recorder(), iter([2, 3, 4, 4, 2, 4, 3, 4])

    def constant(items: list[int]) -> Sequence[int]:
        outputs = recorder(items)
        clock.now += 0.005 if len(items) > 1 else 0.001
        return outputs

    batcher = make_batcher(constant, max_batch_size=4, max_wait_ms=1, queue_size=64, incoming=lambda: 0)
    for size in sizes:
        _hold_worker(batcher, recorder)
        batcher.submit_many(list(range(size)))
        recorder.gate.set()
        wait_until(lambda: batcher.depth == 0 and _worker_asleep(batcher))
    assert batcher._large_item_spread == pytest.approx(0.0, abs=1e-5)
    _hold_worker(batcher, recorder)
    batcher.submit_many(list(range(8)))
    try:
        waits = batcher._clear_s(12, clock.now), batcher._clear_s(12, clock.now, cautious=True)
        assert waits[1] == pytest.approx(waits[0], rel=0.01)
    finally:
        recorder.gate.set()


def test_items_whose_callers_left_are_no_backlog_for_admission(make_batcher) -> None:
    # Before: cancelled groups counted until a batch took them: 5 images more were refused as a full queue.
    recorder = Recorder()
    batcher = make_batcher(recorder, max_batch_size=4, max_wait_ms=1, queue_size=16, incoming=lambda: 0)
    _hold_worker(batcher, recorder)
    gone = [batcher.submit_group([100 + i] * 4) for i in range(3)]  # 12 images...
    assert all(group.cancel() for group in gone)  # ...whose clients all left (504, 499)
    kept = batcher.submit_group([5] * 5)  # 5 of 16 waiting for someone
    with pytest.raises(QueueFull, match=r"\(5/16 waiting\)"):
        batcher.submit_many([6] * 12)
    recorder.gate.set()
    assert kept.result(timeout=10) == [10] * 5
    wait_until(lambda: batcher.depth == 0 and _worker_asleep(batcher))
    assert batcher._live == 0 and not any(item >= 100 for batch in recorder.batches for item in batch)
    assert len(batcher.submit_many([7] * 16)) == 16  # the count came back to nothing, not below it


def test_a_group_found_past_its_deadline_as_a_batch_is_gathered_leaves_the_backlog_once_whatever_cancels_it(
        make_batcher) -> None:
    # Before: its items were set aside to fail as expired with their group not marked taken, so the group's cancel
    # meanwhile (the request's own deadline, at the same moment) counted them out of the backlog a second time: the
    # count went below nothing and the queue then took more than its size.
    recorder, incoming = Recorder(), [0]
    batcher = make_batcher(recorder, max_batch_size=4, max_wait_ms=60_000, queue_size=4,
                           incoming=lambda: incoming[0])
    _hold_worker(batcher, recorder)
    late_by = time.monotonic() + 0.01
    late = batcher.submit_group([100, 101], deadline=late_by)
    kept = batcher.submit(1)
    wait_until(lambda: time.monotonic() > late_by)
    incoming[0] = 1  # a request on its way: the next batch waits for it
    recorder.gate.set()
    wait_until(lambda: len(batcher._expired) == 2)  # the late items set aside, the batch [1] waiting for company
    assert not late.cancel()  # too late: the batch gathered took it
    assert batcher._live == 0
    incoming[0] = 0
    more = batcher.submit(2)  # wakes the batch, which leaves with it
    assert kept.result(timeout=10).value == 2 and more.result(timeout=10).value == 4
    assert isinstance(late.exception(10), DeadlineExpired)
    wait_until(lambda: batcher.depth == 0 and _worker_asleep(batcher))
    assert batcher._live == 0 and not any(item >= 100 for batch in recorder.batches for item in batch)
    _hold_worker(batcher, recorder)
    batcher.submit_many([3, 4, 5, 6])  # the queue's size, and no more
    with pytest.raises(QueueFull, match=r"\(4/4 waiting\)"):
        batcher.submit(7)
    recorder.gate.set()


def test_items_nobody_waits_for_give_their_places_in_a_batch_to_live_ones(make_batcher,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: a batch took the cap's worth of the queue, then dropped the dead: the 4 live items behind 2 cancelled
    # ones and one past its deadline ran as [1] and [2, 3, 4].
    clock, recorder, events = Clock(monkeypatch), Recorder(), Events()
    batcher = make_batcher(recorder, max_batch_size=4, max_wait_ms=1, incoming=lambda: 0, observer=events)
    _hold_worker(batcher, recorder)
    gone = [batcher.submit_group([100 + i]) for i in range(2)]
    assert all(group.cancel() for group in gone)
    late = batcher.submit(200, deadline=clock.now + 1)
    live = [batcher.submit_group([i]) for i in range(1, 5)]
    clock.now += 2  # past the late one's deadline
    recorder.gate.set()
    assert [group.result(timeout=10) for group in live] == [[2], [4], [6], [8]]
    with pytest.raises(DeadlineExpired):
        late.result(timeout=10)
    assert recorder.batches[1:] == [[1, 2, 3, 4]] and events.events.count("deadline_dropped") == 1


def test_after_a_failed_batch_only_items_someone_waits_for_run_again_alone(make_batcher,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: every item ran again alone: those of a request that had failed already, and those past their deadline.
    clock, seen = Clock(monkeypatch), []

    def predict(items: list[int]) -> list[int]:
        seen.append(list(items))
        if len(items) > 1:
            clock.now += 5  # the failed batch took its items past any deadline of 5 s
            raise RuntimeError("the batch failed")
        if items == [0]:
            raise RuntimeError("the model chokes on 0")
        return [2 * i for i in items]

    batcher = make_batcher(predict, max_batch_size=8, max_wait_ms=1, incoming=lambda: 0)
    group = batcher.submit_group([0, 1, 2, 3])
    with pytest.raises(RuntimeError, match="chokes on 0"):
        group.result(timeout=10)
    wait_until(lambda: _worker_asleep(batcher))
    assert seen == [[0, 1, 2, 3], [0]]  # its other items: their request failed with item 0
    late = batcher.submit_many([5, 6], deadline=clock.now + 1)
    for future in late:
        with pytest.raises(DeadlineExpired):
            future.result(timeout=10)
    wait_until(lambda: _worker_asleep(batcher))
    assert seen[2:] == [[5, 6]]  # past their deadline once their batch failed: not run again
    assert batcher.submit(4, deadline=clock.now + 1).result(timeout=10).value == 8


def test_a_stop_while_a_caller_holds_the_queue_ends_the_worker_once_it_lets_go(make_batcher) -> None:
    # Before: stop()'s wake-up came while run_queued held the queue; the worker slept again for good, and the
    # retired version's model was never freed.
    recorder = Recorder()
    batcher = make_batcher(recorder, max_batch_size=2, incoming=lambda: 0, runs_queued_on_caller=True)
    assert batcher.submit(0).result(timeout=10).value == 0
    wait_until(lambda: _worker_asleep(batcher))
    batcher.expected_batch_s = lambda items: 0.01  # type: ignore[method-assign]  # 10 ms a batch
    groups = [batcher.submit_group([i], defer=True) for i in range(1, 7)]  # three batches
    recorder.gate.clear()
    recorder.entered.clear()
    loop = threading.Thread(target=batcher.run_queued, args=(0.015,))  # a slice of one batch, on "the loop"
    loop.start()
    assert recorder.entered.wait(10)
    waits, wait = [], batcher._cond.wait
    batcher._cond.wait = lambda timeout=None: (waits.append(timeout), wait(timeout))[1]  # type: ignore[method-assign]
    stopper = threading.Thread(target=batcher.stop, kwargs={"timeout": 10})  # (one stop: one wake-up)
    stopper.start()  # closed while the slice runs: the worker wakes, finds the queue held...
    wait_until(lambda: bool(waits))  # ...and sleeps again
    recorder.gate.set()
    loop.join(10)
    stopper.join(10)
    assert not batcher.is_alive()
    assert [group.result(timeout=1)[0] for group in groups] == [2, 4, 6, 8, 10, 12]  # the rest: the worker's


class FaultyObserver(Events):
    """An observer whose ``batch_done`` raises for the ``fault_at``-th batch (a metrics file on a full disk)."""

    def __init__(self, fault_at: int) -> None:
        super().__init__()
        self.fault_at = fault_at

    def batch_done(self, size: int, run_s: float, queued_s: Sequence[float], cpu_s: float) -> None:
        super().batch_done(size, run_s, queued_s, cpu_s)
        if len(self.batches) == self.fault_at:
            raise OSError("No space left on device")


def test_a_fault_past_the_forward_pass_fails_its_batch_s_items_and_the_worker_goes_on(make_batcher) -> None:
    # Before: it ended the worker thread: its batch's callers and every later one waited for their deadlines.
    batcher = make_batcher(Recorder(), max_wait_ms=1, incoming=lambda: 0, observer=FaultyObserver(2))
    assert batcher.submit(0).result(timeout=10).value == 0
    group = batcher.submit_group([1, 2])
    with pytest.raises(OSError, match="No space left"):
        group.result(timeout=10)
    assert batcher.submit_group([3]).result(timeout=10) == [6] and batcher.is_alive()


@pytest.mark.parametrize("outputs, errors", [(1, {0: ValueError("nan")}), (2, {5: ValueError("nan")})],
                         ids=["an output short", "an item it does not have"])
def test_items_failed_that_do_not_fit_the_batch_are_a_size_mismatch_and_the_worker_goes_on(
        make_batcher, outputs: int, errors: dict[int, BaseException]) -> None:
    # Before: an IndexError out of handing them out ended the worker thread.
    seen: list[list[int]] = []

    def predict(items: list[int]) -> list[int]:
        seen.append(list(items))
        if len(items) > 1:
            raise ItemsFailed("rows that do not add up", [2 * i for i in items[:outputs]], errors)
        return [2 * i for i in items]

    batcher = make_batcher(predict, max_wait_ms=1, incoming=lambda: 0)
    group = batcher.submit_group([1, 2])
    assert group.result(timeout=10) == [2, 4]  # each run again alone, as a batch whose outputs miscount
    assert seen == [[1, 2], [1], [2]] and batcher.is_alive()


def test_what_a_caller_s_run_leaves_when_it_raises_is_the_worker_s(make_batcher) -> None:
    # Before: run_queued raised with items still queued and the worker asleep: nobody answered them (the engine's
    # loop logs the fault and goes on).
    fn = ThreadRecorder()
    batcher = make_batcher(fn, max_batch_size=2, incoming=lambda: 0, runs_queued_on_caller=True)
    assert batcher.submit(0).result(timeout=10).value == 0
    wait_until(lambda: _worker_asleep(batcher))

    def may_run(item: int) -> bool:
        if item == 3:
            raise RuntimeError("a fault deciding where 3 runs")
        return True

    batcher.caller_may_run = may_run
    groups = [batcher.submit_group([i], defer=True) for i in range(1, 6)]
    with pytest.raises(RuntimeError, match="a fault deciding"):
        batcher.run_queued(10.0)
    assert [group.result(timeout=10)[0] for group in groups] == [2, 4, 6, 8, 10]
    assert fn.threads[1] is threading.current_thread() and threading.current_thread() not in fn.threads[2:]


def test_a_worker_thread_that_ends_fails_what_it_held_and_what_was_queued(make_batcher) -> None:
    # Before: the thread ended with the batch it was gathering; those items and every one queued after waited for
    # their deadlines, and the batcher still took more.
    broken = threading.Event()

    def incoming() -> int:
        if broken.is_set():
            raise RuntimeError("a fault counting what is on its way")
        return 1  # something always on its way: a batch waits for company

    recorder = Recorder()
    batcher = make_batcher(recorder, max_batch_size=4, max_wait_ms=20, incoming=incoming)
    _hold_worker(batcher, recorder)
    queued = [batcher.submit_group([1]), batcher.submit_group([2])]
    broken.set()
    recorder.gate.set()  # the next batch takes them, then asks what is on its way
    for group in queued:
        with pytest.raises(BatcherClosed):
            group.result(timeout=10)
    wait_until(lambda: not batcher.is_alive())
    with pytest.raises(BatcherClosed):
        batcher.submit(3)


def test_an_item_taken_again_after_it_was_put_back_is_still_wanted() -> None:
    # A batch the caller may not run goes back to the queue for the worker, its items already marked running: a
    # future's second mark raised (a RuntimeError out of the worker's take).
    from concurrent.futures import Future

    pending = batcher_module._Pending(1, Future(), 0.0, None)
    assert pending.wanted() and pending.wanted()
    pending.future.set_result(2)  # type: ignore[union-attr]
    assert not pending.wanted()
