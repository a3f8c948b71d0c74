"""Dynamic batching: a bounded queue and one worker thread that runs one forward pass per batch.

The batcher knows neither Flask nor the model: it takes items, calls ``predict_fn(list_of_items)`` and hands each
caller its own row of the result: through a Future an item (``submit_many``), or one Group a request
(``submit_group``).
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import math
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, Callable, Generic, Sequence, TypeVar

from app.engine.batching.types import (
    BackgroundJob,
    BatcherClosed,
    BatcherError,
    BatchObserver,
    BatchResult,
    BatchRun,
    BatchSizeMismatch,
    DeadlineExpired,
    DeadlineTooShort,
    DeadlineUnreachable,
    Group,
    NullObserver,
    PrepareTimeout,
    QueueFull,
    ms,
)

log = logging.getLogger(__name__)
QUEUE_DEPTH_REPORT_S = 0.1  # the depth is told when none was told this long (as a batch is taken, or by a submit),
# and as the batches' figures are settled (``_settle_now``: after the last batch of a burst, so an idle queue reads
# 0): a saturated queue's depth is a gauge write every 0.1 s, not two every batch. (Told each time a batch emptied
# the queue, it read 0 nearly always while a saturated server's images waited: what an autoscaler reads.)
BACKGROUND_LOOK_S = 0.01  # with background work waiting, how often an idle worker looks whether requests still arrive
DEADLINE_SPREADS = 4  # a backlog judged against a deadline at its batches' recent time an image plus this many times
# their mean deviation an image (as TCP's retransmission timer judges a round trip, RFC 6298), for each image ahead:
# the slowness it guards against lasts (a host whose batches slow 3-5x while its CPU refuses a storm of requests,
# where an average alone admitted a third of the images too late to be answered), it does not average out
DECODE_AVERAGING = 0.25  # the weight of a request's decode time an image in the moving average admission judges by:
# it follows a burst's decodes slowing each other within a few requests, and their speeding up as it ends
CONFIRMED_REFUSAL_S = 5.0  # an idle batcher's "deadline too short" made by the estimate the batch of a request run
# after such a refusal refreshed (confirmed) holds this long before a request runs again whatever its deadline (and
# refreshes the estimate): every second one ran before, answered past its deadline after a 400 that had said a retry
# cannot succeed

In = TypeVar("In")
Out = TypeVar("Out")


_UNRUN = object()  # the output of an item whose part of a split batch failed


class ItemsFailed(BatcherError):
    """What ``predict_fn`` raises when its batch ran but some items have no output: ``outputs`` holds one per item
    (a failed item's is never handed out), ``errors`` each failed item's error by its index in the batch. The batcher
    fails those items with their errors and answers the others: none runs again (a model that answers NaN for one
    image of a batch, app/engine/loaded/predictor.py)."""

    def __init__(self, message: str, outputs: Sequence[Any], errors: dict[int, BaseException]) -> None:
        super().__init__(message)
        self.outputs, self.errors = outputs, errors


class _PartlyRun(Exception):
    """A batch split for memory of which a part failed: per item its output, or ``_UNRUN``."""

    def __init__(self, outputs: list[object]) -> None:
        super().__init__(f"{sum(output is _UNRUN for output in outputs)} of {len(outputs)} items unrun")
        self.outputs = outputs


@dataclass(slots=True)
class _Pending(Generic[In]):
    item: In
    future: Future | None  # the item's own (submit_many), or None: its group's (submit_group)
    enqueued_at: float
    deadline: float | None  # time.monotonic() after which nobody waits for the answer
    group: Group | None = None
    index: int = 0
    low: bool = False  # queued behind every other item and batched apart from them (``submit_many``'s low_priority)

    def wanted(self) -> bool:
        """As it is taken into a batch: whether someone still waits for it (marking it running, past a cancel)."""
        if self.group is not None:
            return self.group.wanted()
        try:
            return self.future.set_running_or_notify_cancel()  # type: ignore[union-attr]
        except RuntimeError:  # running already: taken before, and put back (a batch the caller may not run)
            return not self.future.done()  # type: ignore[union-attr]

    def expired(self) -> bool:
        """Whether someone still waits for it (so its passed deadline fails it)."""
        if self.group is not None:
            return not self.group.over
        return not self.future.cancelled()  # type: ignore[union-attr]

    def done(self) -> bool:
        """Answered, failed or cancelled: nothing runs for it any more (a failed batch's item left to run alone)."""
        if self.group is not None:
            return self.group.over
        return self.future.done()  # type: ignore[union-attr]

    def fail(self, exc: BaseException) -> None:
        if self.group is not None:
            self.group.set_failed(self.index, exc)
            return
        with contextlib.suppress(InvalidStateError):  # cancelled meanwhile: nobody waits for it
            self.future.set_exception(exc)  # type: ignore[union-attr]


class Batcher(Generic[In, Out]):
    """Collects up to ``max_batch_size`` items, waiting at most ``max_wait_ms`` after the first, then runs them.

    ``incoming`` (optional) says how many items are still on their way; when it is 0 a batch does not wait.

    ``inline_when_idle``: when nothing runs, nothing waits and nothing is on its way, ``submit_many`` runs the batch
    on the caller's own thread instead of handing it to the worker. The worker thread would run it on another core,
    whose caches hold neither the freshly preprocessed input nor the weights, and only after a wake-up, so a lone
    batch costs more there (docs/performance.md: Figures behind the code's choices). Only one batch runs at a time
    either way. ``runs_queued_on_caller``: the same for ``run_queued``, an event loop's turn of deferred items (a
    public attribute: its owner may allow it once warm-up showed where batches can run); ``caller_may_run`` (None:
    any item), the items a batch run there may hold: a batch with another is the worker's.

    ``split_on`` names exceptions that mean "this batch is too big" (CUDA out-of-memory): such a batch is split in
    halves and retried, and the batch size is capped at the size that worked for ``shrink_s`` seconds. Any other
    error runs the batch's items again one by one (those someone still waits for); ``ItemsFailed`` (the batch ran,
    some items have no output) fails those items alone and answers the rest. A fault past that (an observer's) fails
    the batch's items, never the thread; a thread that ends all the same fails what is queued (BatcherClosed).

    Admission (``check_room``, each submit) counts the items someone still waits for, kept as they change state,
    behind what is left of the batch running now; items nobody waits for are skipped as a batch is taken, so it
    fills to the cap with live ones.

    Background work (``submit_background``: a shadow comparison) runs on the worker thread only when no item is
    queued, no batch runs and nothing is on its way; an item queued meanwhile waits for that one job at most.
    Low-priority items (``submit_many(low_priority=True)``: a shadow's images on its candidate) queue behind every
    other item, those queued after them included, run in batches of their own on the worker's thread only, and count
    in no other item's admission: an item queued after them waits for a low-priority batch already running at most
    (a version promoted from shadow to default serves its first requests ahead of the shadow work it still holds).

    ``settle`` (optional) is the caller's accounting of its batches (a version's monitor and metrics), done for
    every batch since the last call by the first batch that ends ``settle_s`` or more after it (before that batch's
    answers leave), or by the idle worker then (so what is held waits at most ``settle_s`` and the batch running
    meanwhile); a busy batcher accounts for many batches at once (0: every batch). It runs on the thread holding the
    queue, one call at a time; readers that need every answer in it call the caller's accounting themselves. The
    worker, woken for it, takes no item it was not told of: items a caller queued to run itself (``defer``) stay
    its own, unless items the worker was told of are queued with them.
    """

    _items_handed = False  # the worker was told of queued items (woken on a timer alone, it takes none)
    _decode_item_seconds = 0.0  # moving average of an image's decode before it queues, as long as it took

    # When the batch running now (its forward pass and answers, on the worker's thread or a caller's) started, in
    # time.monotonic(); None while none runs: what a stall is judged by (``running_since``)
    _batch_started: float | None = None
    _abandoned = False  # start() stopped waiting for its prepare (PrepareTimeout): the worker takes no batch

    def __init__(self, predict_fn: Callable[[list[In]], Sequence[Out]], *, max_batch_size: int,
                 max_wait_ms: float, queue_size: int, name: str = "batcher",
                 split_on: tuple[type[BaseException], ...] = (), shrink_s: float = 30.0,
                 observer: BatchObserver | None = None, incoming: Callable[[], int] | None = None,
                 inline_when_idle: bool = False, runs_queued_on_caller: bool = False,
                 settle: Callable[[], None] | None = None, settle_s: float = 0.0) -> None:
        if max_batch_size <= 0:
            raise ValueError(f"max_batch_size must be positive, got {max_batch_size}")
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        if queue_size <= 0:
            raise ValueError(f"queue_size must be positive, got {queue_size}")
        self._predict_fn = predict_fn
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self.queue_size = queue_size
        self._queue: collections.deque[_Pending[In]] = collections.deque()
        # What admission counts as the backlog: the queued items someone still waits for, kept as items change state
        # (queued, taken, dropped; a group cancelled or failed: its items still queued at once, the groups' hooks);
        # and of the queue's items the low-priority ones (all at its tail, all counted in ``_live``)
        self._live = self._low = 0
        self._expired: list[_Pending[In]] = []  # taken past their deadline, to fail once the lock is let go
        self._dropped_unrun, self._failed_unrun = self._group_cancelled, self._group_failed
        self._background: collections.deque[BackgroundJob] = collections.deque()
        self._cond = threading.Condition()
        self._depth_reported_at = -math.inf
        self._closed = self._ended = False  # ended: the worker thread has (closed with it), and what is queued fails
        self._batch_ids = itertools.count(1)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._batch_seconds = 0.0  # moving average of one predict_fn call, for Retry-After estimates
        # the same per item; the last batch's (0: none ran yet); over batches of half the cap or more, per item and
        self._item_seconds = self._last_item_seconds = 0.0  # per batch, and the spread (``_timed``)
        self._large_item_seconds = self._large_batch_seconds = self._large_item_spread = 0.0
        self._refused_idle_at = -1  # batches_run at the last refusal on an idle batcher (deadline too short); the
        self._probed_when = self._refusal_confirmed_until = -math.inf  # time.monotonic() when a request ran after
        # one (a probe), and up to which a refusal by the estimate its batch refreshed holds without another
        self._warmed_item_seconds = 0.0  # an item's forward pass at warm-up, 0 without (``expect_item_s``)
        self._split_on, self._shrink_s, self._shrunk_size, self._shrunk_until = split_on, shrink_s, max_batch_size, 0.0
        self._observer: BatchObserver = observer or NullObserver()
        self._incoming = incoming  # items on their way (requests decoding): with none, a batch waits for no company
        self._inline_when_idle = inline_when_idle
        self.runs_queued_on_caller = runs_queued_on_caller
        self.caller_may_run: Callable[[In], bool] | None = None
        self._busy = False  # a batch is being gathered or run, by the worker or inline by a caller
        self._running_until = 0.0  # while busy: when the batch gathered or running now is expected to end
        self.batches_run = self.batches_inline = 0  # batches run, and of them on a caller's thread
        self._settle, self._settle_s, self._settled_at = settle, settle_s, -math.inf
        self._unsettled = False  # batches ran since the last settle
        self._prepare: Callable[[], object] | None = None
        self._prepared: Future[BaseException | None] = Future()  # prepare's outcome: None, or what it raised

    def start(self, prepare: Callable[[], object] | None = None,
              timeout_s: float | None = None) -> "Batcher[In, Out]":
        """Start the worker thread; returns self.

        ``prepare`` runs on the worker thread before it takes any batch, and ``start`` waits for it and re-raises its
        error (the worker then ends). It is for set-up whose effect belongs to the thread that runs it: cuDNN keeps
        its autotuned convolution plans per thread, so a warm-up on another thread leaves every batch shape to be
        tuned again, slowly, by the first real batch (docs/performance.md: Figures behind the code's choices).
        ``start`` waits ``timeout_s`` at most (None: as long as it takes), then raises PrepareTimeout: a thread
        cannot be stopped, so the worker is left in ``prepare`` and ends when it returns, taking no batch.
        """
        self._prepare = prepare
        self._thread.start()
        try:
            error = self._prepared.result(timeout=timeout_s)
        except TimeoutError:
            with self._cond:  # (prepare may end now: then its outcome counts)
                if not self._prepared.done():
                    self._abandoned = True  # the worker ends once prepare returns, if ever; it takes no batch
                    raise PrepareTimeout(f"did not end within {timeout_s:g}s") from None
            error = self._prepared.result()
        if error is not None:
            self._thread.join()
            raise error
        return self

    def set_max_batch_size(self, size: int) -> None:
        """Change the batch size cap (e.g. to the one measured at warm-up)."""
        if size <= 0:
            raise ValueError(f"max_batch_size must be positive, got {size}")
        with self._cond:
            self.max_batch_size = self._shrunk_size = size

    def is_alive(self) -> bool:
        """True while the worker thread runs (liveness)."""
        return self._thread.is_alive()

    def running_since(self) -> float | None:
        """When the batch running now (on the worker's thread or a caller's) started, in time.monotonic(); None
        while none runs. Warm-up (``start``'s ``prepare``) is no batch."""
        return self._batch_started

    @property
    def depth(self) -> int:
        """Items waiting in the queue now."""
        return len(self._queue)

    @property
    def depth_for_caller(self) -> int:
        """Of the items waiting now, those ``run_queued`` may run (the low-priority ones are the worker's)."""
        return len(self._queue) - self._low

    @property
    def current_max_batch_size(self) -> int:
        """The batch size cap in force: lowered for a while after an out-of-memory split."""
        return self._cap_at(time.monotonic())

    def _cap_at(self, now: float) -> int:
        """``current_max_batch_size`` at ``now`` (a time the caller has already read)."""
        return self._shrunk_size if now < self._shrunk_until else self.max_batch_size

    def submit(self, item: In, deadline: float | None = None) -> "Future[BatchResult[Out]]":
        """Queue one item; raises QueueFull or BatcherClosed at once instead of blocking."""
        return self.submit_many([item], deadline)[0]

    def submit_many(self, items: Sequence[In], deadline: float | None = None, inline: bool = True,
                    low_priority: bool = False) -> "list[Future[BatchResult[Out]]]":
        """Queue several items all together or none of them, so a rejected request leaves nothing behind.

        ``deadline`` (a time.monotonic() value) is when the caller stops waiting: items are refused at once when
        the backlog cannot clear by then, and dropped unrun if it passes while they wait. ``inline=False``: never
        on the caller's thread. ``low_priority``: behind every other item, on the worker's thread, judged with
        every item queued (another batcher's thread handing over its background work: a shadow's images).
        """
        now = time.monotonic()
        pending = [_Pending(item, Future(), now, deadline, low=low_priority) for item in items]
        self._queue_pending(pending, deadline, inline and not low_priority, now, low=low_priority)
        return [p.future for p in pending]  # type: ignore[misc]

    def submit_group(self, items: Sequence[In], deadline: float | None = None, inline: bool = True,
                     defer: bool = False) -> "Group[Out]":
        """``submit_many``'s queueing, with one Group for all of the items' results (a request's images).
        ``defer``: queued only, the worker not woken: the caller queues more (a loop turn's requests), then
        ``run_queued`` runs them or wakes it."""
        now = time.monotonic()
        group: Group[Out] = Group(len(items), self._dropped_unrun, self._failed_unrun)
        self._queue_pending(_entries(group, items, now, deadline), deadline, inline and not defer, now,  # type: ignore
                            wake=not defer)
        return group

    def submit_groups(self, requests: Sequence[tuple[Sequence[In], float | None]]) -> list["Group[Out] | Exception"]:
        """``submit_group(defer=True)`` for several requests (each its items and deadline: an event loop's turn's),
        under one hold of the queue: each its Group, in order, or what ``submit_group`` would have raised (a
        refusal, judged with those before it queued; or what its items' check raised: nothing of it queued, the
        others' fate not its). The worker is not woken: ``run_queued`` runs them or wakes it."""
        now = time.monotonic()
        answers: list[Group[Out] | Exception] = []
        queue, dropped_unrun, failed_unrun = self._queue, self._dropped_unrun, self._failed_unrun
        with self._cond:
            fits_from, low = self._fits_from(requests, now), self._low
            if low:  # the low-priority tail to the head: the requests queue after the others, then it goes back
                queue.rotate(low)
            for items, deadline in requests:
                try:
                    if fits_from is None or not (isinstance(deadline, float) and deadline >= fits_from and deadline
                                                 > now and self._live - low + len(items) <= self.queue_size):
                        self._check_room(len(items), deadline, now)
                except Exception as exc:  # noqa: BLE001 - a refusal (a BatcherError), or a request's own fault
                    answers.append(exc)
                    continue
                group: Group[Out] = Group(len(items), dropped_unrun, failed_unrun)
                queue.extend(_entries(group, items, now, deadline))
                self._live += len(items)
                answers.append(group)
            if low:
                queue.rotate(-low)
            if now - self._depth_reported_at >= QUEUE_DEPTH_REPORT_S:
                self._report_depth(now)
        return answers

    def _fits_from(self, requests: Sequence[tuple[Sequence[In], float | None]], now: float) -> float | None:
        """Under the lock, once batches ran: a deadline from which each of ``requests`` fits as ``_check_room``
        judges it (the backlog they all make clears by then, a batch's time growing with its images, and the
        largest one's own inference ends by then), so those within the queue's size need no closer look; None
        when each needs one."""
        if not self.batches_run or self._closed:
            return None
        try:
            counts = [len(items) for items, _ in requests]
        except TypeError:  # a request's items of no length: its own fault, judged with it
            return None
        own = max(counts, default=0) * min(self._item_seconds, self._last_item_seconds) + self.max_wait_s
        return now + max(self._clear_s(self._live - self._low + sum(counts), now, cautious=True), own)

    def run_queued(self, inline_within_s: float) -> bool:
        """After ``submit_group(defer=True)``: the items waiting run on the caller's thread, in batches of the cap,
        when ``runs_queued_on_caller``, nothing runs and nothing is on its way, batches were measured and the
        first is expected within ``inline_within_s`` (``expected_batch_s``); else the worker is woken to take them.
        Here, as many batches run as are expected within ``inline_within_s`` (one at least): what is left stays
        queued for the caller's next call (``depth``), the worker not woken for it, so a backlog of short batches
        runs on one thread in slices of ``inline_within_s`` instead of moving to the worker's and its answers back.
        A batch holding an item ``caller_may_run`` refuses is the worker's, woken for it and what follows it, as
        it is for what is left when anything here raises (the caller logs it; no item waits for its deadline),
        and for what others queued meanwhile when nothing ran here (all it judged was dropped on the way: the
        caller calls again only after a run, and their wake-up met the queue held). Whether any ran here."""
        with self._cond:
            left = self.depth_for_caller
            if not left:
                return False
            cap = self.current_max_batch_size
            first_s = self.expected_batch_s(min(left, cap))
            if not (self.runs_queued_on_caller and self._idle() and first_s <= inline_within_s):
                self._items_handed = True
                self._cond.notify()
                return False
            if left > cap and first_s > 0:  # a slice of the backlog: as many batches of the cap as fit the time
                left = min(left, cap * int(inline_within_s / first_s))  # (one at least)
            self._busy = True  # the queue is this thread's: the worker takes nothing meanwhile
        ran = refused = False
        try:
            while left > 0 and not refused:  # only what was judged: the rest, and what others queue meanwhile, waits
                batch: list[_Pending[In]] = []
                with self._cond:
                    now = time.monotonic()
                    cap = self._cap_at(now)
                    refused = self._take(batch, min(left, cap), now, self.caller_may_run, low_ok=False)
                    self._report_depth_taken(now)
                if self._expired:
                    self._fail_expired()
                if batch:
                    left -= len(batch)
                    ran = True
                    self.batches_inline += 1
                    self._run_taken(batch)
                elif not refused:  # what was judged was all dropped (cancelled, expired) on the way
                    left = 0
                self._settle_when_due()
        except BaseException:
            refused = True  # what is left is the worker's
            raise
        finally:
            self._release_inline(wake_worker=refused or not ran)
        return ran

    def expected_batch_s(self, items: int) -> float:
        """How long a batch of ``items`` takes, from the recent batches (their time, and their time per item times
        ``items``, whichever is longer); infinite before the first one was run."""
        if not self.batches_run:
            return math.inf
        return max(self._batch_seconds, self._item_seconds * items)

    def _queue_pending(self, pending: list[_Pending[In]], deadline: float | None, inline: bool, now: float,
                       wake: bool = True, low: bool = False) -> None:
        with self._cond:
            self._check_room(len(pending), deadline, now, low)
            inline = inline and self._may_run_inline(len(pending))
            if inline:
                self._busy = True
            else:
                self._enqueue(pending, low)
                if wake:
                    self._items_handed = True
                    self._cond.notify()
                if now - self._depth_reported_at >= QUEUE_DEPTH_REPORT_S:  # a stuck batch takes none: still told
                    self._report_depth(now)
        if inline:
            self._run_inline(pending)

    def _enqueue(self, pending: list[_Pending[In]], low: bool) -> None:
        """Under the lock: ``pending`` (all ``low`` or none) queued, counted; ahead of the low-priority items unless
        they are some."""
        queue, behind = self._queue, self._low
        if low:
            self._low += len(pending)
            queue.extend(pending)
        elif behind:
            queue.rotate(behind)  # the low-priority tail to the head, the new items after the others, and back
            queue.extend(pending)
            queue.rotate(-behind)
        else:
            queue.extend(pending)
        self._live += len(pending)

    def _own_s(self, count: int) -> float:
        """``count`` items' own inference with nothing ahead: at the recent time an item (the lower of the average
        and the last batch's: one slow batch must not make it; before any batch, the warm-up's), and a batch's
        wait for company."""
        return count * self._own_item_s() + self.max_wait_s

    def _own_item_s(self) -> float:
        return min(self._item_seconds, self._last_item_seconds) if self.batches_run else self._warmed_item_seconds

    def expect_item_s(self, seconds: float) -> None:
        """An item's forward pass as the warm-up timed it: before the first batch, a deadline that passed before
        its items queued is judged by it (too short, or spent), as later by the batches' own times. Admission
        judges nothing else by it: a warm-up times the forward pass alone (no decode, no batch's making)."""
        with self._cond:
            self._warmed_item_seconds = seconds

    def note_decoded(self, count: int, seconds: float) -> None:
        """``count`` images were decoded (or their headers read) in ``seconds`` before they queued: what an image
        on its way takes now, the decodes beside it included (a moving average, each request weighing alike)."""
        if count:
            item_s = seconds / count
            known = self._decode_item_seconds  # (a plain float: a race loses one sample, never the average)
            self._decode_item_seconds = item_s if not known else known + DECODE_AVERAGING * (item_s - known)

    def check_room(self, count: int, deadline: float | None = None, decoding: int = 0) -> None:
        """Raise what ``submit_many`` would raise for ``count`` items with ``deadline`` now, without queueing them:
        admission asks before a request's body is parsed or its images decoded, so work that will be refused costs
        nothing (the queue may still fill meanwhile: ``submit_many`` checks again). ``decoding``: other requests
        on their way to this queue now, their images being decoded; with any, this request's own decode, at the
        recent time an image, counts before the queue ahead, and they count in that queue (an image each)."""
        with self._cond:
            self._check_room(count, deadline, time.monotonic(), decoding=decoding)

    def _check_room(self, count: int, deadline: float | None, now: float, low: bool = False,
                    decoding: int = 0) -> None:
        """Under the lock: BatcherClosed, QueueFull, DeadlineExpired, DeadlineTooShort or DeadlineUnreachable, else
        nothing. The backlog is the live items (``_live``: not those whose caller left) behind what runs now, the
        low-priority ones only for a ``low`` item (others go ahead of them).

        A deadline is judged by ``_check_deadline``."""
        if self._closed:
            raise BatcherClosed("the inference worker is shutting down")
        live = self._live if low else self._live - self._low
        backlog = live + count
        if backlog > self.queue_size:
            raise QueueFull(f"inference queue is full ({live}/{self.queue_size} waiting)",
                            retry_after_s=self._clear_s(backlog, now))
        if deadline is not None:
            self._check_deadline(count, deadline, now, live, decoding)

    def _check_deadline(self, count: int, deadline: float, now: float, live: int, decoding: int) -> None:
        """Under the lock: DeadlineExpired, DeadlineTooShort or DeadlineUnreachable for ``count`` items with
        ``deadline`` behind ``live`` items and ``decoding`` requests on their way, else nothing.

        Deadlines are judged once batches were timed (one that passed before its items queued, from the warm-up's
        time an item before: ``expect_item_s``). A deadline is too short (the caller's mistake: no retry)
        when the request's own inference would outlast it: its images at the recent time per image (the lower of
        the average and the last batch's: one slow batch must not make it), and a batch's wait for company
        (``max_wait_ms``). On an idle batcher (nothing queued, nothing running) nothing is ahead, and only a batch
        run refreshes the estimate: after a refusal there the next request runs whatever its deadline, so an
        estimate no batch refreshed never refuses twice (a stall's would refuse every short deadline for good); a
        refusal by the estimate such a run's batch refreshed (confirmed) holds CONFIRMED_REFUSAL_S until the next."""
        if now >= deadline:  # too short where its whole length is below the items' own inference (a deadline of
            # microseconds: app/engine/call.py service_error), not the model's failure to answer in time (504)
            if self.batches_run or self._warmed_item_seconds:
                raise DeadlineTooShort(count, self._own_s(count), 0.0, self._clear_s(live, now))
            raise DeadlineExpired(f"the deadline passed {ms(now - deadline)} before the items were queued")
        if not self.batches_run:
            return
        # Decodes side by side share the cores: under a burst of large photos each takes many times its time
        # alone, and a request admitted on the queue alone spent its deadline before its images queued (504s after
        # their decode's CPU, where a 429 at once would have cost nothing)
        decode_s = count * self._decode_item_seconds if decoding else 0.0
        busy = live or self._busy or decoding
        if busy:
            wait = self._clear_s(live + count + decoding, now, cautious=True) + decode_s
            if now + wait <= deadline:
                return
        elif self._refused_idle_at == self.batches_run and now >= self._refusal_confirmed_until:
            self._probed_when = now  # refused here by an estimate no batch refreshed since (unconfirmed, or
            return  # confirmed long ago): this one runs, and its batch refreshes it
        own = self._own_s(count)
        if now + own > deadline:  # no backlog could clear in time for this: the same deadline would fail again
            if not busy and self._refused_idle_at != self.batches_run:
                if now - self._probed_when < CONFIRMED_REFUSAL_S:  # by the estimate a recent probe's batch
                    self._refusal_confirmed_until = now + CONFIRMED_REFUSAL_S  # refreshed: confirmed
                self._refused_idle_at = self.batches_run
            raise DeadlineTooShort(count, own, deadline - now, self._clear_s(live, now))
        if busy:
            raise self._unreachable(count, deadline - now, now, live + decoding, wait, decode_s / count, decoding)

    def _unreachable(self, count: int, left_s: float, now: float, ahead: int, wait: float, decode_item_s: float,
                     decoding: int) -> DeadlineUnreachable:
        """Under the lock: the refusal of ``count`` items whose backlog (``ahead`` items, ``decoding`` of them on
        their way) may take ``wait``, more than the ``left_s`` their deadline leaves; until when one more image
        would be refused alike (``busy_until``: an HTTP worker refuses the route's like by it)."""
        one_more_s = wait if count == 1 else self._clear_s(ahead + 1, now, cautious=True) + decode_item_s
        said = "the queue ahead" + (f" and {decoding} requests decoding beside it" if decoding else "")
        return DeadlineUnreachable(f"{said} may need up to {wait:.3f}s, more than the {left_s:.3f}s deadline",
                                   retry_after_s=self._clear_s(ahead, now), busy_until=now + one_more_s,
                                   item_s=self._own_item_s(), company_s=self.max_wait_s)

    def _clear_s(self, items: int, now: float, cautious: bool = False) -> float:
        """Under the lock: how long ``items`` queued items take to clear: what is left of the batch gathered or
        running now, then batches of the cap and one of the rest, each its images at the recent time per image
        (a batch's time grows with its images: after lone ones, a full batch is not a lone one's time; of batches
        of half the cap or more once one ran, as a GPU's batch costs less per image than a lone one), the recent
        batch time and ``max_wait_ms`` at least. ``cautious`` (a deadline's judgement; Retry-After is the
        average's): each image with DEADLINE_SPREADS of the batches' mean deviation an image more."""
        cap = self._cap_at(now)
        full, rest = divmod(items, cap)
        batch_s, least_s = self._batch_seconds, self.max_wait_s
        item_s = self._large_item_seconds or self._item_seconds  # a lone image's time overstates a GPU's full batch
        if cautious:
            item_s += DEADLINE_SPREADS * self._large_item_spread
        wait = full * max(batch_s, item_s * cap, least_s)
        if rest:
            wait += max(batch_s, item_s * rest, least_s)
        if self._busy and self._running_until > now:
            wait += self._running_until - now
        return wait

    def _may_run_inline(self, count: int) -> bool:
        """Called under the lock: no batch runs, none waits, no item is on its way, and these items fit one batch."""
        return not self._queue and count <= self.current_max_batch_size and self._idle_for_inline()

    def _idle_for_inline(self) -> bool:
        """Called under the lock: lone batches may run on callers' threads, none runs, and no item is on its way."""
        return self._inline_when_idle and self._idle()

    def _idle(self) -> bool:
        """Called under the lock: no batch runs and no item is on its way."""
        return not self._busy and (self._incoming is None or self._incoming() == 0)

    def _run_inline(self, pending: list[_Pending[In]]) -> None:
        """On the caller's thread, holding the queue (busy): its own items, never queued, run as one batch."""
        try:
            live = self._still_wanted(pending)
            if live:
                self.batches_inline += 1
                self._run_taken(live)
            self._settle_when_due()
        finally:
            self._release_inline()

    def _release_inline(self, wake_worker: bool = True) -> None:
        """The queue no longer this thread's: the worker woken for what waits (``wake_worker``: the items; background
        work always) and, once stopping, always (``stop``'s wake-up came while this thread held the queue: the
        worker waits for this one to finish or end); else an idle worker is left asleep (a wake-up for nothing costs
        the caller's thread the GIL's hand-over and back). What is queued once the worker has ended fails."""
        with self._cond:
            self._busy = False
            handed = self._closed or bool(self._low) or (wake_worker and bool(self._queue))
            self._items_handed = self._items_handed or handed
            if self._background or handed:
                self._cond.notify()
        if self._ended:
            self._fail_queued()

    def expected_wait_s(self, items: int) -> float:
        """How long ``items`` queued items take to clear at the recent batch latency, behind the batch running now."""
        with self._cond:
            return self._clear_s(items, time.monotonic())

    def submit_background(self, job: BackgroundJob, limit: int) -> str | None:
        """Queue ``job`` behind every request; returns why it was refused (``busy``: items are queued, ``full``:
        background work waits already and with this job would be over ``limit`` images: a job alone is taken
        whatever its size, ``retired``: stopping), else None."""
        with self._cond:
            if self._closed:
                return "retired"
            if self._queue:
                return "busy"
            background = self._background
            if background and sum(j.size for j in background) + job.size > limit:
                return "full"
            self._background.append(job)
            self._cond.notify()
        return None

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new work, finish everything already queued, then end the worker thread."""
        with self._cond:
            self._closed = self._items_handed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _collect(self) -> list[_Pending[In]] | list[BackgroundJob] | None:
        """Block for the first item, then gather more until the batch is full or max_wait has passed; or, when
        the worker is idle and nothing is on its way, a group of background jobs. The batch holds only items
        someone waits for (``_take``): empty when every item it met was dropped."""
        with self._cond:
            while not self._queue or self._busy or not self._items_handed:
                if self._closed and not self._queue and not self._busy:  # (a caller holding the queue may put
                    self._drop_background("retired")  # items back: its release wakes this thread once closed)
                    return None
                # background work once no item is queued, even one a caller queued to run itself
                if (self._background and not self._queue and not self._busy
                        and (self._incoming is None or self._incoming() == 0)):
                    self._busy = True
                    self._running_until = time.monotonic() + self._batch_seconds
                    return self._take_background()
                if self._unsettled and not self._busy and self._settle_due_in(time.monotonic()) <= 0:
                    self._busy = True  # an idle batcher's held figures, due: settled by the worker (``_run``)
                    return []
                self._cond.wait(self._idle_wait_s())
            self._busy = True
            now = time.monotonic()
            self._report_depth_taken(now)  # as a batch is taken: the backlog it met, then what it left
            # (each told when none was told lately, or when it is 0)
            limit = self._cap_at(now)
            until = now + self.max_wait_s
            self._running_until = until + self._batch_seconds  # gathered by then at the latest, then run
            batch: list[_Pending[In]] = []
            try:
                self._take(batch, limit, now)
                while batch and not batch[0].low and len(batch) < limit and now < until and not self._closed:
                    if self._nothing_incoming():
                        break
                    self._cond.wait(until - now)
                    now = time.monotonic()
                    self._take(batch, limit, now)
            except BaseException:  # (what ``incoming`` raised) what it held goes back: the thread's end fails it
                self._put_back(batch)
                raise
            self._report_depth_taken(now)
            return batch

    def _idle_wait_s(self) -> float | None:
        """Under the lock: how long the worker waits for items when none is queued (or another thread holds the
        queue): background work's look, the held figures' settle when they are due first (a look every
        BACKGROUND_LOOK_S while another thread holds the queue: that one settles them if its batches go on), else
        no limit."""
        waits = [BACKGROUND_LOOK_S] if self._background else []
        if self._unsettled:
            due_in = self._settle_due_in(time.monotonic())
            waits.append(max(due_in, BACKGROUND_LOOK_S) if self._busy else max(0.0, due_in))
        return min(waits) if waits else None

    def _take(self, batch: list[_Pending[In]], limit: int, now: float,
              may_run: Callable[[In], bool] | None = None, low_ok: bool = True) -> bool:
        """Under the lock, holding the queue (busy): queued items moved into ``batch`` until it holds ``limit`` or
        the queue is empty, in one pass that skips those nobody waits for (cancelled; past their deadline: marked
        taken, into ``_expired``, failed once the lock is let go), so a batch fills to the cap with live ones. An item
        ``may_run`` refuses puts back what this call took, and with it: True (the batch is the worker's). A batch
        holds low-priority items or none (``low_ok``: it may hold them), as its first item does."""
        queue, had = self._queue, len(batch)
        pending: _Pending[In] | None = None  # the item being judged, out of the queue
        started: Group | None = None  # the group of the last item taken (``wanted`` marked it running)
        try:
            while len(batch) < limit and queue:
                if self._low:  # low-priority items queued (at the tail): the batch's kind is its first item's
                    head_low = queue[0].low
                    if (head_low and not low_ok) or (batch and head_low is not batch[0].low):
                        break
                    self._low -= head_low
                pending = queue.popleft()
                group = pending.group
                # (an item of the group taken last: that group was marked running then, so it still runs unless over)
                unwanted = group.over if group is started and group is not None else not pending.wanted()
                if unwanted:  # a group cancelled while queued left the count at once
                    if group is None or not group.cancelled():
                        self._live -= 1
                elif pending.deadline is not None and now > pending.deadline:  # marked taken by wanted(): a cancel
                    self._expired.append(pending)  # before it fails comes too late to count it out again
                    self._live -= 1
                elif may_run is not None and not may_run(pending.item):  # (never a low-priority item: ``low_ok``)
                    queue.appendleft(pending)
                    queue.extendleft(reversed(batch[had:]))
                    del batch[had:]
                    return True
                else:
                    batch.append(pending)
                    started = group
                pending = None
        except BaseException:  # (``may_run``'s fault) what this call took goes back, for the worker
            if pending is not None:
                queue.appendleft(pending)
                self._low += pending.low
            queue.extendleft(reversed(batch[had:]))
            self._low += sum(p.low for p in batch[had:])
            del batch[had:]
            raise
        finally:
            self._live -= len(batch) - had
            if not queue:  # nothing left that the worker was told of
                self._items_handed = False
        return False

    def _put_back(self, batch: list[_Pending[In]]) -> None:
        """Under the lock: taken items back at the head of the queue, in their order, counted again (low-priority
        ones at the head of the low-priority tail)."""
        low = bool(batch) and batch[0].low
        if low:
            self._queue.rotate(self._low)
        self._queue.extendleft(reversed(batch))
        if low:
            self._low += len(batch)
            self._queue.rotate(-self._low)
        self._live += len(batch)

    def _group_cancelled(self, count: int) -> None:
        """A group's ``cancel`` (its caller left before any of its items was taken): its ``count`` items, still
        queued, no longer count as backlog; ``_take`` skips them unrun."""
        with self._cond:
            self._live -= count

    def _group_failed(self, group: Group) -> None:
        """A group failed (one of its items, or its deadline): its items still queued dropped unrun at once, so they
        stop counting as backlog (a bundle's requests run again one by one find the room they held). Rare: one
        pass over the queue."""
        with self._cond:
            queue = self._queue
            kept = [pending for pending in queue if pending.group is not group]
            if len(kept) != len(queue):
                self._live -= len(queue) - len(kept)
                queue.clear()
                queue.extend(kept)

    def _fail_expired(self) -> None:
        """Holding the queue, the lock let go (a failure runs its caller's callbacks): the items ``_take`` found
        past their deadline failed, dropped before their forward pass."""
        expired, self._expired = self._expired, []
        now = time.monotonic()
        for pending in expired:
            pending.fail(DeadlineExpired(f"deadline passed after {now - pending.enqueued_at:.3f}s in queue"))
        try:
            self._observer.event("deadline_dropped", len(expired))
        except Exception:  # noqa: BLE001 - a count never strands the batch taken with them
            log.exception("counting the items dropped for their deadline failed")

    def _report_depth_taken(self, now: float) -> None:
        """Under the lock, as a batch is taken: the depth told when it was not told lately."""
        if now - self._depth_reported_at >= QUEUE_DEPTH_REPORT_S:
            self._report_depth(now)

    def _report_depth(self, now: float) -> None:
        """Under the lock: the queue's depth to the observer (whose fault is logged: a gauge never ends the worker
        or strands the items being taken)."""
        self._depth_reported_at = now
        try:
            self._observer.queue_depth(len(self._queue))
        except Exception:  # noqa: BLE001 - see above
            log.exception("reporting the queue's depth failed")

    def _nothing_incoming(self) -> bool:
        return self._incoming is not None and self._incoming() == 0

    def _take_background(self) -> list[BackgroundJob]:
        """Under the lock: the first live background job and those after it of its group, up to the batch cap."""
        now, jobs, size = time.monotonic(), [], 0
        while self._background:
            job = self._background[0]
            if job.deadline < now:
                self._background.popleft().drop("stale")
                continue
            if jobs and (job.group_key() != jobs[0].group_key() or size + job.size > self.current_max_batch_size):
                break
            jobs.append(self._background.popleft())
            size += job.size
        return jobs

    def _drop_background(self, reason: str) -> None:
        while self._background:
            self._background.popleft().drop(reason)

    def _run(self) -> None:
        try:
            if self._prepare is not None:
                self._prepare()
        except BaseException as exc:  # noqa: BLE001 - handed to start(), which raises it in the caller
            self._prepared.set_result(exc)
            return
        with self._cond:
            if self._abandoned:  # start() gave up waiting: nothing will be queued here
                return
            self._prepared.set_result(None)
        self._observer.running(True)
        try:
            while (batch := self._collect()) is not None:
                try:
                    if batch and not isinstance(batch[0], _Pending):
                        self._run_background(batch)  # type: ignore[arg-type]
                        continue
                    if self._expired:
                        self._fail_expired()
                    if batch:
                        self._run_taken(batch)  # type: ignore[arg-type]
                    self._settle_when_due()
                finally:
                    with self._cond:
                        self._busy = False
            if self._unsettled:  # stopped: what the last batches held is written before their version goes
                self._settle_now(time.monotonic())
        except Exception:  # noqa: BLE001 - logged; what waits is failed below, not left to its deadline
            log.exception("the batcher's thread failed")
        finally:
            self._fail_what_is_left()
            self._observer.running(False)
        log.info("batcher stopped after %d batches", self.batches_run)

    def _fail_what_is_left(self) -> None:
        """As the worker thread ends, however: closed, the background work dropped and every item still queued
        failed, so no caller waits for its deadline on a thread that is gone (after ``stop`` nothing is left: the
        thread finished it)."""
        with self._cond:
            self._closed = self._ended = True
            self._drop_background("retired")
        if self._expired:  # taken past their deadline as it ended
            self._fail_expired()
        self._fail_queued()

    def _fail_queued(self) -> None:
        """The worker thread has ended: the items queued failed (BatcherClosed), the lock let go meanwhile."""
        with self._cond:
            left = list(self._queue)
            self._queue.clear()
            self._live = self._low = 0
        error = BatcherClosed("the inference worker stopped")
        for pending in left:
            pending.fail(error)

    def _run_taken(self, batch: list[_Pending[In]]) -> None:
        """Holding the queue (busy): a batch taken run; what escapes its forward pass's own handling (an
        observer's fault, a bug) fails its items not answered yet, never the thread that runs it."""
        self._batch_started = time.monotonic()
        try:
            self._run_batch(batch)
        except BaseException as exc:  # noqa: BLE001 - see above; the thread's end is only for what ends threads
            log.exception("a batch of %d failed past its forward pass", len(batch))
            error = exc if isinstance(exc, Exception) else BatcherClosed("the inference worker stopped")
            for pending in batch:
                pending.fail(error)
            if error is not exc:
                raise
        finally:
            self._batch_started = None

    def _settle_when_due(self) -> None:
        """Holding the queue (busy), after a take, or woken idle for it (``_collect``): settle what the batches
        left unsettled once ``settle_s`` has passed since the last settle (a take's items may all have been
        dropped, so no batch of theirs settles)."""
        if self._unsettled:
            now = time.monotonic()
            if self._settle_due_in(now) <= 0:
                self._settle_now(now)

    def _settle_due_in(self, now: float) -> float:
        """How long until the held figures are due to be settled (``settle_s`` after the last settle; 0 or less:
        due)."""
        return self._settled_at + self._settle_s - now

    def _settle_now(self, now: float) -> None:
        self._unsettled, self._settled_at = False, now
        with self._cond:  # the depth as it is now: the last settle after a burst's batches tells the idle queue's 0
            self._report_depth(now)
        if self._settle is None:
            return
        try:
            self._settle()
        except Exception:  # noqa: BLE001 - accounting must never end the worker or fail the answers
            log.exception("settling the batches' accounting failed")

    def _run_background(self, jobs: list[BackgroundJob]) -> None:
        try:
            jobs[0].run_group(jobs)
        except Exception:  # noqa: BLE001 - background work must never end the worker
            log.exception("background work of %d jobs failed", len(jobs))

    def _still_wanted(self, batch: list[_Pending[In]]) -> list[_Pending[In]]:
        """Drop items whose caller gave up (cancelled) or whose deadline passed: they cost no forward pass."""
        now = time.monotonic()
        live = []
        for p in batch:
            if p.deadline is not None and now > p.deadline and p.expired():
                p.fail(DeadlineExpired(f"deadline passed after {now - p.enqueued_at:.3f}s in queue"))
                self._observer.event("deadline_dropped")
            elif p.wanted():
                live.append(p)
        return live

    def _predict(self, items: list[In]) -> Sequence[Out]:
        try:
            outputs = self._predict_fn(items)
        except self._split_on:
            if len(items) == 1:
                raise
            half = len(items) // 2
            # Remember the size that fits, so the next batches do not hit the same wall.
            self._shrunk_size, self._shrunk_until = half, time.monotonic() + self._shrink_s
            self._observer.event("batch_split")
            log.warning("batch of %d did not fit; retrying as %d + %d", len(items), half, len(items) - half)
            outputs = [*self._predict_part(items[:half]), *self._predict_part(items[half:])]
            if any(output is _UNRUN for output in outputs):
                raise _PartlyRun(outputs)
            return outputs
        except ItemsFailed as failed:  # its outputs are handed out by index: they must be the batch's
            if len(failed.outputs) != len(items) or not all(0 <= index < len(items) for index in failed.errors):
                raise BatchSizeMismatch(f"predict_fn's ItemsFailed held {len(failed.outputs)} outputs and failed "
                                        f"items {sorted(failed.errors)} for {len(items)} inputs") from failed
            raise
        if len(outputs) != len(items):
            raise BatchSizeMismatch(f"predict_fn returned {len(outputs)} outputs for {len(items)} inputs")
        return outputs

    def _predict_part(self, items: list[In]) -> list[Out | object]:
        """A part of a batch split for memory: its outputs, ``_UNRUN`` for each item of a part that failed (run
        alone after, as a failed batch's; the parts that ran are answered, never run again)."""
        try:
            return list(self._predict(items))
        except _PartlyRun as part:
            return part.outputs
        except ItemsFailed as failed:  # the part ran: its failed items run alone after (and fail there), the others
            return [_UNRUN if index in failed.errors else output  # are answered
                    for index, output in enumerate(failed.outputs)]
        except Exception:  # noqa: BLE001 - a failing part fails no item yet: its items run alone after
            log.exception("a part of %d of a split batch failed", len(items))
            return [_UNRUN] * len(items)

    def _run_batch(self, batch: list[_Pending[In]]) -> None:
        batch_id = next(self._batch_ids)
        started, cpu_started = time.monotonic(), time.thread_time()
        self._running_until = started + self._batch_seconds  # what admission counts of it: one batch, as queued
        try:
            outputs = self._predict([p.item for p in batch])
        except _PartlyRun as part:  # split for memory, and a part failed: the others' rows are answered
            self._observer.event("batch_failed")
            ran = [(p, output) for p, output in zip(batch, part.outputs) if output is not _UNRUN]
            if ran:
                self._done(batch_id, [p for p, _ in ran], [output for _, output in ran], started, cpu_started)
            self._run_alone([p for p, output in zip(batch, part.outputs) if output is _UNRUN])
            return
        except ItemsFailed as failed:  # it ran: the failed items fail with their errors, the others are answered
            self._done(batch_id, batch, failed.outputs, started, cpu_started, failed.errors)
            return
        except Exception as exc:  # noqa: BLE001 - a failing batch fails its callers, never the worker
            log.exception("batch %d of %d failed", batch_id, len(batch))
            self._observer.event("batch_failed")
            if len(batch) == 1:
                batch[0].fail(exc)
                return
            # One input the model chokes on must not fail the requests batched with it: each runs again alone,
            # so only the items that fail on their own fail (a broken model costs len(batch) more passes, once).
            self._run_alone(batch)
            return
        self._done(batch_id, batch, outputs, started, cpu_started)

    def _run_alone(self, batch: list[_Pending[In]]) -> None:
        """A failed batch's items run again one at a time, each only while someone waits for it: not once its
        request failed (an item of it before failed alone), was answered or cancelled, nor past its deadline."""
        for p in batch:
            if p.done():
                continue
            if p.deadline is not None and time.monotonic() > p.deadline:
                p.fail(DeadlineExpired(f"deadline passed after {time.monotonic() - p.enqueued_at:.3f}s, before "
                                       f"this item's run alone after its batch failed"))
                self._observer.event("deadline_dropped")
                continue
            self._run_batch([p])

    def _timed(self, run_s: float, items: int, started: float) -> None:
        """A batch of ``items`` that ran ``run_s`` counted and folded into the moving averages: a call's time, an
        item's, and over batches of half the cap or more an item's, a batch's and the spread (``DEADLINE_SPREADS``):
        each such batch's deviation from them an item, the lower of the two (a CPU's batch takes its images' time,
        a GPU's about one time at any size: the size makes neither deviate), which fades while batches are smaller
        (a storm's spread is not a quiet hour's)."""
        self.batches_run += 1
        first = self.batches_run == 1
        self._batch_seconds = run_s if first else 0.8 * self._batch_seconds + 0.2 * run_s
        per_item = self._last_item_seconds = run_s / items
        self._item_seconds = per_item if first else 0.8 * self._item_seconds + 0.2 * per_item
        if 2 * items < self._cap_at(started):
            self._large_item_spread *= 0.8
            return
        large, large_batch = self._large_item_seconds, self._large_batch_seconds
        if large:
            deviation = min(abs(per_item - large), abs(run_s - large_batch) / items)
            self._large_item_spread = 0.8 * self._large_item_spread + 0.2 * deviation
        self._large_item_seconds = per_item if not large else 0.8 * large + 0.2 * per_item
        self._large_batch_seconds = run_s if not large else 0.8 * large_batch + 0.2 * run_s

    def _done(self, batch_id: int, batch: list[_Pending[In]], outputs: Sequence[Out], started: float,
              cpu_started: float, failed: dict[int, BaseException] | None = None) -> None:
        """A batch that ran: counted, timed, settled when due, its outputs handed to their waiters; the items of
        ``failed`` (by index) failed with their errors instead."""
        run_s = time.monotonic() - started
        self._timed(run_s, len(batch), started)
        queued = [started - p.enqueued_at for p in batch]
        self._observer.batch_done(len(batch), run_s, queued, time.thread_time() - cpu_started)
        ended = self._running_until = started + run_s  # (admission counts nothing more of it)
        if self._settle_due_in(ended) <= 0:
            self._settle_now(ended)
        elif not self._unsettled:  # the first batch held since the last settle: the worker's idle wait is bounded
            self._unsettled = True  # by the settle's time from now on (it may sleep without end: batches run on a
            with self._cond:  # caller's thread never wake it)
                self._cond.notify()
        size = len(batch)
        if failed:
            for index, error in failed.items():
                batch[index].fail(error)
            kept = [index for index in range(size) if index not in failed]
            batch, outputs, queued = [batch[i] for i in kept], [outputs[i] for i in kept], [queued[i] for i in kept]
        self._answer(batch, outputs, queued, batch_id, run_s, size)

    @staticmethod
    def _answer(batch: list[_Pending[In]], outputs: Sequence[Out], queued: list[float], batch_id: int,
                run_s: float, size: int) -> None:
        """Each item's output to whoever waits for it: a future its result, a group the rows of its consecutive
        items in this batch (of ``size`` items) at once."""
        first, count = 0, len(batch)
        while first < count:
            item = batch[first]
            group = item.group
            if group is None:
                result = BatchResult(outputs[first], batch_id, size, queued[first], run_s)
                item.future.set_result(result)  # type: ignore[union-attr]
                first += 1
                continue
            end = first + 1
            while end < count and batch[end].group is group and batch[end].index == item.index + end - first:
                end += 1
            rows = (outputs[first],) if end == first + 1 else outputs[first:end]
            group.set_rows(item.index, rows, BatchRun(end - first, batch_id, size, queued[first], run_s))
            first = end


def _entries(group: Group[Any], items: Sequence[In], now: float, deadline: float | None) -> Sequence[_Pending[In]]:
    """``items`` as the queue's entries of ``group``, kept on it (``Group.queued``: a cancel lets go of them)."""
    group.queued = ((_Pending(items[0], None, now, deadline, group, 0),) if len(items) == 1 else  # (most requests)
                    [_Pending(item, None, now, deadline, group, index) for index, item in enumerate(items)])
    return group.queued
