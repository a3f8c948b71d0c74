"""The batcher on its own, with fake predict functions and no server."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Sequence

import pytest

from app.batcher import Batcher, BatcherClosed, BatchSizeMismatch, QueueFull


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

    def make(fn: Callable, **kwargs: float) -> Batcher:
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


def test_wrong_output_count_fails_the_batch(make_batcher) -> None:
    batcher = make_batcher(lambda items: [0] * (len(items) + 1), max_wait_ms=1)
    with pytest.raises(BatchSizeMismatch):
        batcher.submit(1).result(timeout=10)
    assert batcher.is_alive()


def _hold_worker(batcher: Batcher, recorder: Recorder) -> None:
    """Park the worker inside predict_fn so the queue fills up behind it."""
    recorder.gate.clear()
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
